"""`kubernetes.host_network`: trainer pods on their nodes' network, for clusters whose pod network cannot carry NCCL.

What it renders on the trainer pods of an Indexed Job and of a JobSet (`hostNetwork`, `dnsPolicy:
ClusterFirstWithHostNet`, the rendezvous port as a `hostPort`, one pod of the attempt per node, torchrun's static
rendezvous on the same endpoint), validated strictly (`kubernetes-validate`; a JobSet against its CRD), with a golden
file; its refusal with `workload: trainjob` (Trainer v1alpha1's runtimePatches have no hostNetwork or dnsPolicy) and
of a value that is not a boolean, in one line naming the field; and that false, the default, renders exactly what
was rendered before it existed (the golden files of the other tests), the orchestrator pod included.
`UPDATE_GOLDEN=1 pytest tests/test_k8s_host_network.py` rewrites its golden file.
"""

from __future__ import annotations

import copy

import pytest
import yaml
from cona.orchestrator.backends.kubernetes.render import render_attempt, render_text
from cona.orchestrator.backends.kubernetes.runobjects import render_submission
from cona.orchestrator.backends.kubernetes.spec import KubernetesSpec, host_network_problem
from cona.orchestrator.job import load_job
from cona.orchestrator.profile import load_profile
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

from tests.conftest import EXAMPLES
from tests.test_k8s_manifests import (
    GOLDEN,
    K8S_PROFILE,
    MULTI_NODE,
    WORKLOAD_KINDS,
    _flag,
    _golden,
    _jobset_job,
    _patched_pod,
    _profile,
    _validate,
    k8s_expand,
)

POD_WORKLOADS = ("indexed-job", "jobset")
"""The kinds whose pods cona writes itself, and so can put on the node's network."""
PARTIAL_NODE = Strategy.parse("dp=3,tp=4,pp=1,mbs=1,gbs=12")
"""12 processes on nodes of 8: `placement` gives 3 pods of 4 devices, two of which one node could hold."""


def _job_template(objects: list[dict]) -> dict:
    """The attempt's Indexed Job template (the Job's own, or the JobSet's replicatedJob's)."""
    (workload,) = [obj for obj in objects if obj["kind"] in ("Job", "JobSet")]
    return workload["spec"]["template"] if workload["kind"] == "Job" else _jobset_job(workload)["spec"]["template"]


def _render(workload: str, strategy: Strategy = MULTI_NODE, attempt: int = 1, **kubernetes) -> list[dict]:
    objects = render_attempt(profile=_profile(workload=workload, **kubernetes), strategy=strategy, attempt=attempt,
                             run_dir="/runs/r")  # fmt: skip
    for obj in objects:
        _validate(obj)
    return objects


@pytest.mark.parametrize("workload", POD_WORKLOADS)
def test_host_network_puts_the_trainer_pods_on_the_node_network(workload):
    objects = _render(workload, host_network=True)
    template = _job_template(objects)
    pod = template["spec"]
    assert pod["hostNetwork"] is True
    # Else the pods resolve with the node's DNS and cannot find pod 0's name in the headless Service.
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    (container,) = pod["containers"]
    # The port the API server would default on the node's network, written out: the scheduler reserves it.
    assert container["ports"] == [{"name": "rdzv", "containerPort": 29400, "protocol": "TCP", "hostPort": 29400}]
    # The rest of the pod is what the pod network's renders.
    plain = _job_template(_render(workload))["spec"]
    rest = {key: value for key, value in pod.items() if key not in ("hostNetwork", "dnsPolicy", "affinity")}
    plain["containers"][0]["ports"][0]["hostPort"] = 29400
    plain["containers"][0]["command"] = container["command"]  # compared below
    assert rest == plain


@pytest.mark.parametrize("workload", POD_WORKLOADS)
def test_host_network_rendezvous_keeps_the_endpoint_and_makes_node_rank_0_the_host(workload):
    """Pod 0's hostname is its node's on the node's network: c10d, which guesses the store's host from how that
    name resolves, gives way to the static rendezvous (node rank 0 hosts it) on the same endpoint, the headless
    Service's name of pod 0, which resolves to its IP (now its node's)."""
    host = _job_template(_render(workload, host_network=True))["spec"]["containers"][0]["command"]
    plain = _job_template(_render(workload))["spec"]["containers"][0]["command"]
    assert _flag(plain, "--rdzv-backend") == "c10d" and _flag(host, "--rdzv-backend") == "static"
    assert [arg for arg in host if not arg.startswith("--rdzv-backend=")] == [
        arg for arg in plain if not arg.startswith("--rdzv-backend=")
    ]
    assert _flag(host, "--rdzv-endpoint").endswith(".r-a1:29400")
    assert _flag(host, "--node-rank") == "$(JOB_COMPLETION_INDEX)"


@pytest.mark.parametrize("workload", POD_WORKLOADS)
def test_torchrun_reads_the_host_network_command_as_a_static_rendezvous_on_pod_0(workload, monkeypatch):
    from torch.distributed.run import config_from_args, parse_args

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun would set it in this process otherwise
    argv = _job_template(_render(workload, host_network=True))["spec"]["containers"][0]["command"]
    assert argv[:3] == ["python", "-m", "torch.distributed.run"]
    for index in (0, 3):
        expanded = [k8s_expand(arg, {"JOB_COMPLETION_INDEX": str(index)}) for arg in argv[3:]]
        config, _python, args = config_from_args(parse_args(expanded))
        assert (config.rdzv_backend, config.rdzv_configs["rank"]) == ("static", index)
        assert config.rdzv_endpoint == _flag(argv, "--rdzv-endpoint")
        assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.max_restarts) == (4, 4, 8, 0)
        assert args[1:] == ["-m", "cona.trainer", "--run-dir", "/runs/r", "--attempt", "1"]  # after `-u`


@pytest.mark.parametrize("workload", POD_WORKLOADS)
@pytest.mark.parametrize(
    ("strategy", "overrides"),
    [(MULTI_NODE, []), (PARTIAL_NODE, []), (Strategy.parse("dp=2,tp=2,pp=1,mbs=1,gbs=8"), ["accelerator.device=cpu"])],
    ids=["whole-nodes", "partial-nodes", "cpu"],
)
def test_host_network_keeps_one_pod_of_the_attempt_per_node(workload, strategy, overrides):
    """A required anti-affinity on the node's hostname against the attempt's other pods: whole-node pods need it
    not, but pods of fewer devices (`placement` spreads 12 processes as 3 × 4 on nodes of 8) or a CPU profile's
    could share a node, its ports and its hostname."""
    profile = load_profile(K8S_PROFILE, [f"kubernetes.workload={workload}", "kubernetes.host_network=true", *overrides])
    objects = render_attempt(profile=profile, strategy=strategy, attempt=2, run_dir="/runs/r")
    for obj in objects:
        _validate(obj)
    template = _job_template(objects)
    (term,) = template["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert set(template["spec"]["affinity"]) == {"podAntiAffinity"}
    assert term["topologyKey"] == "kubernetes.io/hostname"
    selector = term["labelSelector"]["matchLabels"]
    labels = template["metadata"]["labels"]
    # It selects exactly the pods of this attempt: every one of them, none of another attempt's or run's.
    assert selector.items() <= labels.items()
    assert selector == {"app.kubernetes.io/instance": labels["app.kubernetes.io/instance"], "cona.dev/attempt": "2"}
    other = _job_template(render_attempt(profile=profile, strategy=strategy, attempt=3, run_dir="/runs/r"))
    assert not selector.items() <= other["metadata"]["labels"].items()
    service = [obj for obj in objects if obj["kind"] == "Service"]
    if service:  # the Indexed Job's own headless Service selects the same pods
        assert service[0]["spec"]["selector"] == selector


def test_host_network_golden_and_valid_for_the_pod_kinds():
    texts = []
    for workload in POD_WORKLOADS:
        text = render_text(profile=_profile(workload=workload, host_network=True), strategy=MULTI_NODE,
                           run_dir="/runs/golden-run")  # fmt: skip
        docs = [doc for doc in yaml.safe_load_all(text) if doc]
        assert [doc["kind"] for doc in docs] == WORKLOAD_KINDS[workload]
        for doc in docs:
            _validate(doc)
        texts.append(text)
    _golden("host-network.yaml", "".join(texts))


@pytest.mark.parametrize("workload", list(WORKLOAD_KINDS))
@pytest.mark.parametrize("name", ["h100-4-nodes", "h100-1-node"])
def test_false_renders_exactly_what_the_default_rendered_before(workload, name):
    strategy = MULTI_NODE if name == "h100-4-nodes" else Strategy.parse("dp=2,tp=2,pp=2,mbs=1,gbs=8")
    golden = GOLDEN / (f"{name}.yaml" if workload == "indexed-job" else f"{name}-{workload}.yaml")
    for profile in (_profile(workload=workload), _profile(workload=workload, host_network=False)):
        assert not profile.kubernetes.host_network
        text = render_text(profile=profile, strategy=strategy, run_dir="/runs/golden-run")
        assert text == golden.read_text()
        assert not any(word in text for word in ("hostNetwork", "dnsPolicy", "hostPort", "affinity", "static"))


def test_the_orchestrator_pod_keeps_the_pod_network():
    """It talks to the API server and reads the PVC, no NCCL: the node's network would only widen what it
    exposes; its profile (what it renders the attempts from) carries the field."""
    job = load_job(EXAMPLES / "tiny-gpt.yaml")
    job.data.path = "/runs/data/shakespeare.txt"
    configmap, orchestrator = render_submission(profile=_profile(host_network=True), job=job, run="r", submitted=0.0)
    for obj in (configmap, orchestrator):
        _validate(obj)
    pod = orchestrator["spec"]["template"]["spec"]
    assert not {"hostNetwork", "dnsPolicy", "affinity"} & set(pod)
    assert "hostPort" not in str(pod)
    assert yaml.safe_load(configmap["data"]["profile.yaml"])["kubernetes"]["host_network"] is True


def test_trainjob_with_host_network_is_refused_in_one_line_naming_both_fields():
    with pytest.raises(ConfigError) as info:
        load_profile(K8S_PROFILE, ["kubernetes.workload=trainjob", "kubernetes.host_network=true"])
    text = str(info.value)
    assert "\n" not in text, text
    assert "host_network true cannot reach the pods of workload trainjob" in text, text
    assert "hostNetwork: true and dnsPolicy: ClusterFirstWithHostNet in the trainer_runtime's pod template" in text
    assert "use workload indexed-job or jobset" in text  # what to do instead
    # A spec changed without validation meets the same decision when it is rendered (or submitted).
    with pytest.raises(ConfigError) as info:
        render_attempt(profile=_profile(workload="trainjob", host_network=True), strategy=MULTI_NODE, attempt=1,
                       run_dir="/runs/r")  # fmt: skip
    assert str(info.value).startswith("kubernetes.host_network: true cannot reach the pods of workload trainjob")
    assert "\n" not in str(info.value)
    # False is the default with a TrainJob as with every kind.
    (trainjob,) = _render("trainjob", host_network=False)
    assert "hostNetwork" not in str(trainjob)
    # Why: the TrainJob's pod-level override, the only one, has no place for either field (its CRD's schema).
    for field, value in (("hostNetwork", True), ("dnsPolicy", "ClusterFirstWithHostNet")):
        patched = copy.deepcopy(trainjob)
        _patched_pod(patched)["spec"][field] = value
        with pytest.raises(AssertionError, match="Additional properties are not allowed"):
            _validate(patched)


@pytest.mark.parametrize("value", ['"true"', '"false"', "1", "0", "on-node", "[true]", "{}"])
def test_a_value_that_is_not_a_boolean_is_refused_in_one_line_naming_the_field(value):
    """pydantic's lax mode would take "true" or 1 for true: in a field that puts pods on the node's network, a
    slip is said, not guessed."""
    with pytest.raises(ConfigError) as info:
        load_profile(K8S_PROFILE, [f"kubernetes.host_network={value}"])
    text = str(info.value)
    assert "\n" not in text, text
    assert "field 'kubernetes.host_network'" in text and "is not true or false" in text, text
    with pytest.raises(ConfigError, match=r"^kubernetes\.host_network: .* is not true or false"):
        render_attempt(profile=_profile(host_network=yaml.safe_load(value)), strategy=MULTI_NODE, attempt=1,
                       run_dir="/runs/r")  # fmt: skip


@pytest.mark.parametrize("value", ["true", "false", "yes", "no"])
def test_yaml_booleans_are_taken(value):
    spec = load_profile(K8S_PROFILE, [f"kubernetes.host_network={value}"]).kubernetes
    assert spec.host_network is (value in ("true", "yes"))
    assert KubernetesSpec(host_network=spec.host_network).host_network is spec.host_network
    assert host_network_problem(spec.host_network, "indexed-job") is None
