"""Kubernetes profiles other than the shipped one and bad input to `cona submit/status/stop/report`, as an ML
infrastructure engineer with a cluster of their own gives them.

Profiles: 1 × 1, 2 × 4 in a namespace, PVC and service account of their own (a dotted node-selector key, tolerations,
quantities such as 1.5Gi), 16 × 8, elastic, CPU-only; every shipped job renders on each, for every workload kind,
into objects that validate (strictly, or against the kind's CRD). Bad input is refused in one line that names the
field, before anything is created on the (emulated) cluster: a selector or toleration the API server would refuse
only in the orchestrator's pod later, an image without a tag, a memory quantity without its unit, a mount path the
pods use for something else, a PVC or service account missing from the namespace, a PVC the run's nodes cannot all
mount, a namespace that is no DNS label. And what one run's name does to another's (an orchestrator pod taken for
an attempt's, a report ConfigMap), a stop or resume of a run whose orchestrator Job failed or is gone, the
kustomize base under an overlay for another namespace.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from cona.orchestrator.backends.base import AttemptStatus, BackendError
from cona.orchestrator.backends.kubernetes.backend import KubernetesBackend
from cona.orchestrator.backends.kubernetes.remote import (
    remote_report,
    remote_status,
    remote_stop,
    resume,
    submit,
)
from cona.orchestrator.backends.kubernetes.render import (
    MAX_JOBSET_NAME,
    MAX_NAME,
    render_attempt,
    workload_names,
)
from cona.orchestrator.backends.kubernetes.runobjects import (
    RUN_NAME_MAX,
    orchestrator_job_name,
    render_submission,
    run_dir_for,
    run_name,
)
from cona.orchestrator.cli import UserError, first_strategy
from cona.orchestrator.job import load_job
from cona.orchestrator.profile import ClusterProfile, load_profile
from cona.protocol.rundir import RunDir
from cona.protocol.yamlconfig import ConfigError
from kubernetes import client

from tests.conftest import EXAMPLES, run_cona
from tests.test_k8s_manifests import DNS_1035, K8S_PROFILE, KUBECTL, LABEL_VALUE, MANIFESTS, _validate
from tests.test_k8s_submit_unit import NS, SUBMITTED, namespace_objects

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),  # inside kmock
]

GKE_ACCELERATOR = "cloud.google.com/gke-accelerator"
CPU = "accelerator={name: cpu, peak_tflops: 0.05, memory: 4 GiB, memory_bandwidth: 10 GB/s, device: cpu}"
PROFILES = {
    "1x1": ["nodes=1", "gpus_per_node=1"],
    "2x4-own-namespace": [
        "nodes=2", "gpus_per_node=4", "kubernetes.namespace=ml-team", "kubernetes.pvc=team-data.v2",
        "kubernetes.service_account=trainer-sa", "kubernetes.shm_size=1.5Gi", "kubernetes.orchestrator_memory=1.5Gi",
        "kubernetes.orchestrator_cpu=500m", "kubernetes.trainer_cpu=8", "kubernetes.trainer_memory=64Gi",
        "kubernetes.image_pull_secrets=[team-registry, mirror.pull-2]",
        f'kubernetes.node_selector."{GKE_ACCELERATOR}"=nvidia-h100-80gb',
        "kubernetes.tolerations=[{key: dedicated, operator: Equal, value: ml, effect: NoExecute, "
        "tolerationSeconds: 300}, {operator: Exists}]",
    ],
    "16x8": ["nodes=16", "gpus_per_node=8"],
    "elastic-8": ["nodes=8", "min_nodes=2"],
    "cpu-2x4": ["nodes=2", "gpus_per_node=4", CPU, "kubernetes.node_selector={}", "kubernetes.tolerations=[]"],
}  # fmt: skip
JOBS = sorted(EXAMPLES.glob("*.yaml"))
DATA = "/runs/data/corpus.bin"


def _profile(*overrides: str) -> ClusterProfile:
    return load_profile(K8S_PROFILE, list(overrides))


def _job(path: Path = EXAMPLES / "tiny-gpt.yaml"):
    job = load_job(path)
    job.data.path = DATA
    return job


def _pods(objects: list[dict]) -> list[dict]:
    """The pod templates of the rendered objects, whatever their kind."""
    pods = []
    for obj in objects:
        if obj["kind"] == "Job":
            pods.append(obj["spec"]["template"]["spec"])
        elif obj["kind"] == "JobSet":
            pods.append(obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"])
        elif obj["kind"] == "TrainJob":
            (patch,) = obj["spec"]["runtimePatches"]
            (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
            pods.append(replicated["template"]["spec"]["template"]["spec"])
    return pods


# ---- other profiles: every shipped job, every workload kind --------------------------------------------------------


@pytest.mark.parametrize("workload", ["indexed-job", "jobset", "trainjob"])
@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_example_job_renders_valid_objects_on_other_profiles(name, workload):
    profile = _profile(*PROFILES[name], f"kubernetes.workload={workload}")
    spec = profile.kubernetes
    limit = MAX_NAME if workload == "indexed-job" else MAX_JOBSET_NAME
    rendered = 0
    for path in JOBS:
        job = _job(path)
        try:
            strategy = first_strategy(profile, job)
        except UserError as e:  # a 1.3B model does not fit 4 GiB CPU processes: said in one line
            assert name == "cpu-2x4" and "no feasible strategy" in str(e) and "\n" not in str(e), str(e)
            continue
        run = run_name(f"{job.name}-20261206-120000")
        submission = render_submission(profile=profile, job=job, run=run, submitted=SUBMITTED)
        attempt = render_attempt(profile=profile, strategy=strategy, attempt=1, run_dir=run_dir_for(profile, run))
        for obj in submission + attempt:
            _validate(obj)
            metadata = obj["metadata"]
            assert metadata["namespace"] == spec.namespace and DNS_1035.fullmatch(metadata["name"]), metadata
            assert all(len(v) <= 63 and LABEL_VALUE.fullmatch(v) for v in metadata["labels"].values()), metadata
        assert [o["metadata"]["name"] for o in attempt][-1] == workload_names(run, 1, limit)[0]
        for pod in _pods(attempt) + _pods(submission):
            assert pod["serviceAccountName"] == spec.service_account
            assert pod.get("imagePullSecrets", []) == [{"name": name} for name in spec.image_pull_secrets]
            assert pod.get("priorityClassName") == spec.priority_class
            claims = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
            assert claims == [spec.pvc]
        for pod in _pods(attempt):
            assert pod.get("nodeSelector", {}) == spec.node_selector
            assert pod.get("tolerations", []) == spec.tolerations
        rendered += 1
    assert rendered >= 5, rendered


def test_a_dotted_node_selector_key_and_quantities_reach_the_pods():
    profile = _profile(*PROFILES["2x4-own-namespace"])
    objects = render_attempt(profile=profile, strategy=first_strategy(profile, _job()), attempt=1,
                             run_dir=run_dir_for(profile, "r"))  # fmt: skip
    (pod,) = _pods(objects)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", GKE_ACCELERATOR: "nvidia-h100-80gb"}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1.5Gi"}} in pod["volumes"]
    (container,) = pod["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": "4", "memory": "64Gi"},
                                      "requests": {"cpu": "8", "memory": "64Gi"}}  # fmt: skip
    # A TrainJob carries them per node, where its runtime puts them on the trainer container.
    trainjob = render_attempt(profile=_profile(*PROFILES["2x4-own-namespace"], "kubernetes.workload=trainjob"),
                              strategy=first_strategy(profile, _job()), attempt=1, run_dir=run_dir_for(profile, "r"))  # fmt: skip
    assert trainjob[-1]["spec"]["trainer"]["resourcesPerNode"] == container["resources"]
    # Without them, as before: the devices only.
    plain = render_attempt(profile=_profile(), strategy=first_strategy(_profile(), _job()), attempt=1,
                           run_dir=run_dir_for(_profile(), "r"))  # fmt: skip
    assert _pods(plain)[0]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "8"}}
    _, job = render_submission(profile=profile, job=_job(), run="r", submitted=SUBMITTED)
    resources = job["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources == {"requests": {"cpu": "500m", "memory": "1.5Gi"}, "limits": {"memory": "1.5Gi"}}


@pytest.mark.parametrize("job_name", ["UPPER_CASE", "1st_model.v2", "a.b.c", "x-", "A" + "b" * 62, "9" * 63])
def test_run_names_from_any_job_name_are_dns_labels_unique_per_submission(job_name):
    """`cona submit`'s default run name is `<job name>-<time>` as a DNS-1035 label: the names of the run's objects
    and of its attempts' workloads (and their pods' hostnames) stay DNS labels, and two submissions differ."""
    names = {run_name(f"{job_name}-{stamp}") for stamp in ("20261206-120000", "20261206-120001")}
    assert len(names) == 2, names
    for run in names:
        assert DNS_1035.fullmatch(run) and len(run) <= RUN_NAME_MAX, run
        assert len(orchestrator_job_name(run)) <= MAX_NAME
        for attempt in (1, 10_000):
            assert len(f"{workload_names(run, attempt, MAX_NAME)[0]}-999") <= 63
            assert len(f"{workload_names(run, attempt, MAX_JOBSET_NAME)[0]}-node-0-999-abcde") <= 63
    with pytest.raises(ConfigError, match="field 'name'"):
        load_job(EXAMPLES / "tiny-gpt.yaml", ["name=модель"])


# ---- values the API server would refuse only in the orchestrator's pod ---------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("kubernetes.node_selector.gpu type=h100", "field 'kubernetes.node_selector': key 'gpu type' is not a label key"),
        (f'kubernetes.node_selector."{GKE_ACCELERATOR}"=nvidia h100',
         f"field 'kubernetes.node_selector': {GKE_ACCELERATOR}: value 'nvidia h100' is not a label value"),
        ('kubernetes.node_selector."Example.com/gpu"=x', "key 'Example.com/gpu' is not a label key"),
        # Unquoted, the label's dots split it into sections: the message says to quote it.
        (f"kubernetes.node_selector.{GKE_ACCELERATOR}=x", 'a key with dots goes in quotes there (node_selector."'),
        ("kubernetes.tolerations=[{key: gpu, value: 1}]", "[0].value 1: write it in quotes"),
        ("kubernetes.tolerations=[{key: gpu, value: true}]", "[0].value true: write it in quotes, as written"),
        # pydantic took true for 1 second, and named a float's `str` arm
        ("kubernetes.tolerations=[{key: a, operator: Exists, effect: NoExecute, tolerationSeconds: true}]",
         "[0].tolerationSeconds true: give whole seconds"),
        ("kubernetes.tolerations=[{key: a, operator: Exists, effect: NoExecute, tolerationSeconds: 1.5}]",
         "field 'kubernetes.tolerations': [0].tolerationSeconds 1.5: give whole seconds"),
        ("kubernetes.tolerations=[{key: gpu type, operator: Exists}]", "[0].key 'gpu type' is not a label key"),
        ("kubernetes.tolerations=[{key: gpu, value: a b}]", "[0].value 'a b' is not a label value"),
        ("kubernetes.tolerations=[{operator: Equal, value: x}]", "[0]: a toleration without a key needs operator 'Exists'"),
        ("kubernetes.tolerations=[{key: gpu, operator: Exists, tolerationSeconds: 30}]",
         "[0].tolerationSeconds is only for effect 'NoExecute'"),
    ],
)  # fmt: skip
def test_selectors_and_tolerations_the_api_server_would_refuse_are_one_line(override, message):
    with pytest.raises(ConfigError) as info:
        _profile(override)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


# ---- a private registry and a priority class ------------------------------------------------------------------------

PRIVATE = ("kubernetes.image_pull_secrets=[regcred, mirror.pull-2]", "kubernetes.priority_class=ml-high")


@pytest.mark.parametrize("workload", ["indexed-job", "jobset", "trainjob"])
def test_pull_secrets_and_the_priority_class_reach_every_pod_cona_creates(workload):
    """Every pod of a run pulls the image with the profile's Secrets and is scheduled with its PriorityClass: the
    trainer pods of each workload kind and the orchestrator pod (a TrainJob's pods take no priority class)."""
    private = PRIVATE if workload != "trainjob" else PRIVATE[:1]
    profile = _profile(*private, f"kubernetes.workload={workload}")
    objects = render_attempt(profile=profile, strategy=first_strategy(profile, _job()), attempt=1,
                             run_dir=run_dir_for(profile, "r"))  # fmt: skip
    objects += render_submission(profile=profile, job=_job(), run="r", submitted=SUBMITTED)
    for obj in objects:
        _validate(obj)
    pods = _pods(objects)
    assert len(pods) == 2  # the attempt's trainer pods' template, the orchestrator's
    for pod in pods:
        assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror.pull-2"}]
        assert pod.get("priorityClassName") == ("ml-high" if workload != "trainjob" else None)
    # Without them, the pods have neither field (the cluster's defaults apply).
    plain = _profile(f"kubernetes.workload={workload}")
    objects = render_attempt(profile=plain, strategy=first_strategy(plain, _job()), attempt=1,
                             run_dir=run_dir_for(plain, "r"))  # fmt: skip
    objects += render_submission(profile=plain, job=_job(), run="r", submitted=SUBMITTED)
    assert not any({"imagePullSecrets", "priorityClassName"} & set(pod) for pod in _pods(objects))


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["kubernetes.image_pull_secrets=[Regcred]"],
         "field 'kubernetes.image_pull_secrets': [0] 'Regcred' is not a DNS-1123 subdomain"),
        (["kubernetes.image_pull_secrets=[regcred, reg_cred]"], "[1] 'reg_cred' is not a DNS-1123 subdomain"),
        (["kubernetes.image_pull_secrets=[regcred, regcred]"], "[1] 'regcred' is listed twice; list each Secret once"),
        ([f"kubernetes.image_pull_secrets=[{'a' * 254}]"], "is not a DNS-1123 subdomain (at most 253"),
        (["kubernetes.image_pull_secrets=regcred"], "field 'kubernetes.image_pull_secrets': Input should be a valid list"),
        (["kubernetes.priority_class=High Priority"],
         "field 'kubernetes.priority_class': 'High Priority' is not a DNS-1123 subdomain"),
        (["kubernetes.priority_class=high", "kubernetes.workload=trainjob"],
         "priority_class 'high' cannot reach a TrainJob's pods"),
    ],
)  # fmt: skip
def test_pull_secrets_and_priority_classes_that_cannot_be_are_one_line_when_the_profile_loads(override, message):
    with pytest.raises(ConfigError) as info:
        _profile(*override)
    text = str(info.value)
    assert message in text and "\n" not in text, text
    assert ("give the name of" in text or "list each Secret once" in text or "leave priority_class out" in text
            or "valid list" in text), text  # what to do


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"image_pull_secrets": ["a b"]}, "kubernetes.image_pull_secrets: [0] 'a b' is not a DNS-1123 subdomain"),
        ({"priority_class": "$(id)"}, "kubernetes.priority_class: '$(id)' is not a DNS-1123 subdomain"),
        ({"priority_class": "high", "workload": "trainjob"}, "kubernetes.priority_class: 'high' cannot reach a TrainJob"),
    ],
)  # fmt: skip
def test_the_renderers_refuse_them_in_a_spec_built_without_validation(fields, message):
    profile = _profile()
    profile = profile.model_copy(update={"kubernetes": profile.kubernetes.model_copy(update=fields)})
    for render in (
        lambda: render_attempt(profile=profile, strategy=first_strategy(profile, _job()), attempt=1, run_dir="/runs/r"),
        lambda: render_submission(profile=profile, job=_job(), run="r", submitted=SUBMITTED),
    ):
        with pytest.raises(ConfigError) as info:
            render()
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_submit_with_pull_secrets_reads_no_secret(k8s):
    """`cona submit` checks the PVC and ServiceAccount but not the pull Secrets: reading a Secret gives its contents,
    which the submitter's Role does not grant. The Secrets are named in the orchestrator Job's pod as rendered."""
    namespace_objects(k8s)  # no Secret at all
    objects = render_submission(profile=_profile(*PRIVATE), job=_job(), run="private", submitted=SUBMITTED)
    assert submit(objects, api_client=k8s.api_client()) == ("private", NS)
    assert not any("secrets" in path for _, path in k8s.backend_requests())
    pod = client.BatchV1Api(k8s.api_client("reader")).read_namespaced_job("private-orch", NS).spec.template.spec
    assert [ref.name for ref in pod.image_pull_secrets] == ["regcred", "mirror.pull-2"]
    assert pod.priority_class_name == "ml-high"


@pytest.mark.parametrize("image", ["ghcr.io/cona-project/cona", "localhost:5000/cona", "cona:"])
def test_an_image_without_a_tag_is_refused(image):
    with pytest.raises(ConfigError, match=r"kubernetes\.image: .* has no tag; name the version") as info:
        render_submission(profile=_profile(f'kubernetes.image="{image}"'), job=_job(), run="r", submitted=SUBMITTED)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("image", "policy"),
    [
        ("ghcr.io/cona-project/cona:0.1.0", "IfNotPresent"),
        ("localhost:5000/team/cona:v2", "IfNotPresent"),
        ("ghcr.io/cona-project/cona@sha256:" + "a" * 64, "IfNotPresent"),
        ("ghcr.io/cona-project/cona:latest", "Always"),  # it moves: each pod pulls it, as Kubernetes would default
    ],
)
def test_image_pull_policy_follows_the_tag_in_every_pod(image, policy):
    profile = _profile(f"kubernetes.image={image}")
    strategy = first_strategy(profile, _job())
    objects = render_attempt(profile=profile, strategy=strategy, attempt=1, run_dir="/runs/r")
    objects += render_submission(profile=profile, job=_job(), run="r", submitted=SUBMITTED)
    containers = [pod["containers"][0] for pod in _pods(objects)]
    assert len(containers) == 2 and {(c["image"], c["imagePullPolicy"]) for c in containers} == {(image, policy)}


@pytest.mark.parametrize("mount", ["/tmp", "/tmp/", "/dev/shm", "/dev", "/"])
def test_a_mount_path_the_pods_use_for_something_else_is_refused(mount):
    profile = _profile(f"kubernetes.mount_path={mount}", f"storage.run_root={mount.rstrip('/')}/runs")
    with pytest.raises(ConfigError, match=r"kubernetes\.mount_path: .*; mount the PVC at a path of its own"):
        render_attempt(profile=profile, strategy=first_strategy(profile, _job()), attempt=1, run_dir="/runs/r")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ('kubernetes.orchestrator_memory="500m"', "kubernetes.orchestrator_memory: '500m' is 0.5 bytes; give a unit"),
        ('kubernetes.orchestrator_memory="2"', "kubernetes.orchestrator_memory: '2' is 2 bytes; give a unit"),
        ('kubernetes.shm_size="64"', "kubernetes.shm_size: '64' is 64 bytes; give a unit"),
        ("kubernetes.shm_size=500m", "kubernetes.shm_size: '500m' is 0.5 bytes; give a unit"),
        ("kubernetes.orchestrator_memory=2GB", "kubernetes.orchestrator_memory: '2GB' is not a quantity"),
        ('kubernetes.orchestrator_cpu="0"', "kubernetes.orchestrator_cpu: '0' is less than one millicore"),
        ('kubernetes.trainer_cpu="0m"', "kubernetes.trainer_cpu: '0m' is less than one millicore"),
        # A bare name is the API server's standard resource, or refused by it when the attempt is created.
        ("kubernetes.gpu_resource=GPU", "kubernetes.gpu_resource: 'GPU' is neither cpu nor an extended resource"),
        ("kubernetes.gpu_resource=memory", "kubernetes.gpu_resource: 'memory' is neither cpu nor"),
    ],
)  # fmt: skip
def test_a_memory_quantity_without_its_unit_is_one_line(override, message):
    """Kubernetes takes `500m` as half a byte and `2` as two: the orchestrator pod would be OOM-killed at start,
    restarted until its Job fails, and /dev/shm would be full at once (NCCL and the data loaders use it)."""
    with pytest.raises(ConfigError) as info:
        render_submission(profile=_profile(override), job=_job(), run="r", submitted=SUBMITTED)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_every_resource_field_takes_the_quantities_kubernetes_takes():
    """`trainer_cpu: 500m` was refused by a message that gave 500m as its example; `1e3` and `1Pi` were taken by
    some fields and not others."""
    for override in ("kubernetes.trainer_cpu=500m", "kubernetes.trainer_cpu=1e3", "kubernetes.trainer_cpu=0.5",
                     "kubernetes.orchestrator_memory=1Pi", "kubernetes.trainer_memory=1e12", "kubernetes.shm_size=1e10",
                     "kubernetes.orchestrator_cpu=.5"):  # fmt: skip
        objects = render_submission(profile=_profile(override), job=_job(), run="r", submitted=SUBMITTED)
        assert objects, override


# ---- the cluster side of `cona submit` --------------------------------------------------------------------------


def _created(k8s) -> list[tuple[str, str]]:
    return [(method, path) for method, path in k8s.backend_requests() if method in ("POST", "PATCH", "DELETE")]


@pytest.mark.parametrize(
    ("present", "message"),
    [
        ({"pvc": None}, "kubernetes.pvc 'cona-runs': no PersistentVolumeClaim of that name in namespace 'cona'"),
        ({"account": None}, "kubernetes.service_account 'cona': no ServiceAccount of that name in namespace 'cona'"),
        ({"modes": ("ReadWriteOnce",)}, "kubernetes.pvc 'cona-runs' is ReadWriteOnce: the pods of a run on 4 node(s)"),
        ({"modes": ("ReadOnlyMany",)}, "kubernetes.pvc 'cona-runs' is ReadOnlyMany"),
    ],
)  # fmt: skip
def test_submit_refuses_a_run_whose_pods_could_not_start_and_creates_nothing(k8s, present, message):
    namespace_objects(k8s, **present)
    objects = render_submission(profile=_profile(), job=_job(), run="tiny-1", submitted=SUBMITTED)
    with pytest.raises(ConfigError) as info:
        submit(objects, api_client=k8s.api_client())
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert _created(k8s) == []
    api = k8s.api_client("cona-test-setup")
    assert client.CoreV1Api(api).list_namespaced_config_map(NS).items == []
    assert client.BatchV1Api(api).list_namespaced_job(NS).items == []


def test_submit_takes_a_read_write_once_pvc_for_one_node_and_skips_checks_it_may_not_read(k8s):
    namespace_objects(k8s, modes=("ReadWriteOnce",))
    one_node = _profile("nodes=1")
    assert submit(render_submission(profile=one_node, job=_job(), run="one", submitted=SUBMITTED),
                  api_client=k8s.api_client()) == ("one", NS)  # fmt: skip
    # A submitter bound to an older cona-submitter Role may not read PVCs: the check is skipped, not the run.
    k8s.refuse("GET", "", "v1", "persistentvolumeclaims", status=403, message="forbidden")
    objects = render_submission(profile=_profile(), job=_job(), run="four", submitted=SUBMITTED)
    assert submit(objects, api_client=k8s.api_client()) == ("four", NS)


def test_cona_submit_of_a_missing_pvc_is_one_line_and_leaves_nothing(k8s, tmp_path):
    config = k8s.write_kubeconfig(tmp_path / "kubeconfig", token="laptop", namespace=NS)
    namespace_objects(k8s, pvc=None)
    out = run_cona("submit", "--profile", str(K8S_PROFILE), "--job", str(EXAMPLES / "tiny-gpt.yaml"),
                   "--set", f"data.path={DATA}", "--profile-set", "kubernetes.pvc=cona-runz",
                   env={"KUBECONFIG": str(config)})  # fmt: skip
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    assert "kubernetes.pvc 'cona-runz': no PersistentVolumeClaim" in out.stderr
    assert [method for method, _ in k8s.requests_by("laptop")] == ["GET"]


# ---- following a run: names and namespaces that do not exist -------------------------------------------------------


@pytest.mark.parametrize("call", [remote_status, remote_stop, resume])
def test_a_namespace_that_is_no_dns_label_is_one_line_before_any_call(k8s, call):
    with pytest.raises(ConfigError, match=r"namespace 'ML_Team' .*not a DNS-1123 label"):
        call("r", namespace="ML_Team", api_client=k8s.api_client())
    with pytest.raises(ConfigError, match="not a DNS-1123 label"):
        remote_report("r", namespace="a" * 64, out_dir=Path("unused"), api_client=k8s.api_client())
    assert k8s.backend_requests() == []


@pytest.mark.parametrize(
    "argv", [["status", "nope"], ["stop", "nope"], ["report", "nope"], ["submit", "--resume", "nope"],
             ["status", "nope", "-n", "Bad_NS"]],
)  # fmt: skip
def test_a_run_that_does_not_exist_is_one_line(k8s, tmp_path, argv):
    config = k8s.write_kubeconfig(tmp_path / "kubeconfig", token="laptop", namespace=NS)
    out = run_cona(*argv, env={"KUBECONFIG": str(config)}, cwd=tmp_path)
    assert out.returncode in (1, 2) and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr
    expected = "namespace 'Bad_NS'" if "Bad_NS" in argv else "no run 'nope' in namespace 'cona'"
    assert expected in out.stderr, out.stderr
    assert not (tmp_path / "nope-report").exists()
    assert all(method == "GET" for method, _ in k8s.requests_by("laptop"))


def _submitted_and_running(k8s):
    """Run `tiny-1` submitted to the emulated cluster, its mirrored status `running`; the set-up's API client."""
    namespace_objects(k8s)
    submit(render_submission(profile=_profile(), job=_job(), run="tiny-1", submitted=SUBMITTED),
           api_client=k8s.api_client())  # fmt: skip
    setup = k8s.api_client("cona-test-setup")
    client.CoreV1Api(setup).patch_namespaced_config_map(
        "tiny-1", NS, {"data": {"status.json": '{"status": "running", "run_dir": "/runs/tiny-1"}'}})
    return setup


def test_resume_goes_on_when_the_orchestrator_job_is_gone(k8s):
    """A `--resume` deletes the old orchestrator Job before it creates the new one; when that create failed, the
    run was left with no Job and the status its dead orchestrator mirrored last (running): it must stay
    resumable, not answered "stop it first" (a stop that no orchestrator would carry out)."""
    setup = _submitted_and_running(k8s)
    client.BatchV1Api(setup).delete_namespaced_job("tiny-1-orch", NS)
    assert "resuming run tiny-1 (running)" in resume("tiny-1", namespace=NS, api_client=k8s.api_client(), wait_s=5)
    job = client.BatchV1Api(setup).read_namespaced_job("tiny-1-orch", NS)
    assert job.spec.template.spec.containers[0].command[-1] == "tiny-1"
    # A run whose orchestrator is alive is still refused.
    with pytest.raises(BackendError, match="is running, not ended; stop it first"):
        resume("tiny-1", namespace=NS, api_client=k8s.api_client(), wait_s=5)


def test_the_profiles_above_dump_and_reload_as_the_orchestrator_reads_them():
    """The orchestrator validates the ConfigMap's profile.yaml again: a dotted selector key and the tolerations
    must survive the round trip."""
    profile = _profile(*PROFILES["2x4-own-namespace"])
    (configmap, _) = render_submission(profile=profile, job=_job(), run="r", submitted=SUBMITTED)
    reloaded = ClusterProfile.model_validate(yaml.safe_load(configmap["data"]["profile.yaml"]))
    assert reloaded.kubernetes == profile.kubernetes


# ---- names shared across runs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("workload", ["indexed-job", "jobset"])
def test_the_orchestrator_pod_of_a_run_named_like_an_attempt_is_not_that_attempts_pod(k8s, tmp_path, workload):
    """Run `exp1`'s attempt 1 is `exp1-a1`; a run submitted as `exp1-a1` (variants a1, a2 of an experiment) has an
    orchestrator pod labelled `app.kubernetes.io/instance: exp1-a1` too. Taken for one of the attempt's pods, its
    eviction disrupted (and deleted) exp1's attempt, its Pending made the attempt wait."""
    mount = tmp_path / "runs"
    run_dir = RunDir(mount / "exp1")
    run_dir.root.mkdir(parents=True)
    profile = _profile(f"kubernetes.mount_path={mount}", f"storage.run_root={mount}", f"kubernetes.workload={workload}")
    backend = KubernetesBackend(run_dir=run_dir, profile=profile, api_client=k8s.api_client())
    attempt = backend.launch(attempt=1, strategy=first_strategy(profile, _job()))
    assert attempt.backend_id == "exp1-a1"
    namespace_objects(k8s)
    other = render_submission(profile=profile, job=_job(), run="exp1-a1", submitted=SUBMITTED)
    submit(other, api_client=k8s.api_client("cona-test-setup"))
    evicted = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}
    k8s.make_pods("exp1-a1-orch", NS, phase="Pending", conditions=[evicted])
    k8s.make_pods("exp1-a1", NS, phase="Running", workload=workload)
    assert backend.poll(attempt).status is AttemptStatus.RUNNING
    assert backend._workload(backend._kind(attempt)).conditions("exp1-a1") is not None  # not deleted


def test_a_run_named_like_another_runs_report_configmap_is_refused():
    with pytest.raises(ConfigError, match=r"--name 'exp1-report': ends in '-report', the name of run 'exp1''s report"):
        render_submission(profile=_profile(), job=_job(), run="exp1-report", submitted=SUBMITTED)


def test_stop_of_a_run_whose_orchestrator_job_failed_leaves_no_stop_for_the_resumed_run(k8s):
    """The orchestrator Job failed (its pod restarted past backoffLimit) while the run trained. `cona stop` said
    "asked run to stop" and left a stop request nobody carried out: the next `--resume`'s orchestrator found it
    and stopped the resumed run at once."""
    setup = _submitted_and_running(k8s)
    k8s.set_job_status("tiny-1-orch", NS, conditions=[{"type": "Failed", "status": "True",
                       "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}])  # fmt: skip
    said = remote_stop("tiny-1", namespace=NS, api_client=k8s.api_client())
    assert said.startswith("run tiny-1 is not running (Job tiny-1-orch failed: BackoffLimitExceeded"), said
    assert "nothing to stop" in said and "cona submit --resume tiny-1" in said
    assert "stop" not in client.CoreV1Api(setup).read_namespaced_config_map("tiny-1", NS).data


# ---- the kustomize base under an overlay of one's own --------------------------------------------------------------


def test_an_overlay_for_another_namespace_binds_the_service_account_there(tmp_path):
    """`namespace: ml-team` in an overlay moved every object but left the RoleBinding's subject in `cona`: the
    orchestrator's service account in ml-team had no Role, and every call it made was refused (403)."""
    base = os.path.relpath(MANIFESTS, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(f"resources: [{base}]\nnamespace: ml-team\n")
    out = subprocess.run([KUBECTL, "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    docs = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    for doc in docs:
        _validate(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "ml-team", doc["metadata"]
    assert next(d for d in docs if d["kind"] == "Namespace")["metadata"]["name"] == "ml-team"
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "cona", "namespace": "ml-team"}]


def test_the_optional_cluster_role_for_elastic_runs_validates():
    docs = [doc for doc in yaml.safe_load_all((MANIFESTS / "elastic" / "nodes.yaml").read_text()) if doc]
    assert [d["kind"] for d in docs] == ["ClusterRole", "ClusterRoleBinding"]
    for doc in docs:
        _validate(doc)


def test_report_of_a_run_whose_orchestrator_job_failed_is_one_line_at_once(k8s, tmp_path):
    """Asked for a report, a run nobody drives any more waited the whole `wait_s` (2 minutes) for an answer."""
    namespace_objects(k8s)
    submit(render_submission(profile=_profile(), job=_job(), run="tiny-1", submitted=SUBMITTED),
           api_client=k8s.api_client())  # fmt: skip
    k8s.set_job_status("tiny-1-orch", NS, conditions=[{"type": "Failed", "status": "True",
                       "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}])  # fmt: skip
    with pytest.raises(BackendError, match=r"run 'tiny-1' is not running \(Job tiny-1-orch failed: .*no orchestrator"):
        remote_report("tiny-1", namespace=NS, out_dir=tmp_path / "r", wait_s=30, api_client=k8s.api_client())
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(("override", "message"), [
    (['kubernetes.trainer_memory="64"'], "kubernetes.trainer_memory: '64' is 64 bytes; give a unit"),
    (["kubernetes.trainer_memory=lots"], "kubernetes.trainer_memory"),
    (["kubernetes.trainer_cpu=eight"], "kubernetes.trainer_cpu"),
    ([CPU, "kubernetes.node_selector={}", "kubernetes.tolerations=[]", "kubernetes.trainer_cpu=4"],
     "the profile's devices are CPUs (gpu_resource: cpu)"),
])  # fmt: skip
def test_trainer_pod_requests_that_cannot_be_are_one_line(override, message):
    from cona.orchestrator.backends.kubernetes.render import check_spec

    with pytest.raises(ConfigError) as raised:
        check_spec(_profile(*override).kubernetes)
    assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


@pytest.mark.parametrize("image", ["ghcr.io/Team/cona:1", "Cona:1", "cona:-x", "ghcr.io//cona:1", "cona:1@sha256:abc",
                                   "cona:" + "x" * 129, "registry.example/cona:v1\"';$(id)"])  # fmt: skip
def test_an_image_reference_the_kubelet_could_not_pull_is_refused(image):
    """The API server takes any string as an image; a malformed one would fail only when the pods pull it."""
    from cona.orchestrator.backends.kubernetes.render import check_spec

    with pytest.raises(ConfigError) as raised:
        check_spec(_profile(f"kubernetes.image={image}").kubernetes)
    assert "kubernetes.image" in str(raised.value) and "not an image reference" in str(raised.value)


@pytest.mark.parametrize("image", ["nvcr.io/nvidia/pytorch:24.01-py3", "localhost:5000/cona:dev", "my_org/my__img:v1",
                                   "ghcr.io/cona-project/cona:0.1.0@sha256:" + "b" * 64, "cona@sha256:" + "a" * 64])  # fmt: skip
def test_image_references_of_every_form_are_taken(image):
    from cona.orchestrator.backends.kubernetes.render import check_spec

    check_spec(_profile(f"kubernetes.image={image}").kubernetes)


def test_a_kubeconfig_that_skips_tls_verification_prints_no_warning_per_request(tmp_path, monkeypatch):
    """`insecure-skip-tls-verify: true` (a test cluster's kubeconfig): urllib3 printed a multi-line
    InsecureRequestWarning on every request, above the one line an error is; kubectl honours it without a word."""
    import warnings

    import urllib3
    from cona.orchestrator.backends.kubernetes.api import default_client
    from kubernetes import client
    from kubernetes.config import kube_config

    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:1", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
    }  # fmt: skip
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    # The client reads KUBECONFIG when it is imported: its module's default is what a later call uses.
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    saved = client.Configuration.get_default_copy()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            default_client()
            warnings.warn("unverified", urllib3.exceptions.InsecureRequestWarning, stacklevel=1)
    finally:
        client.Configuration.set_default(saved)
    assert caught == []


def test_no_kubeconfig_says_where_to_point_it(tmp_path, monkeypatch):
    from cona.orchestrator.backends.kubernetes.api import default_client
    from kubernetes.config import kube_config

    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(BackendError) as info:
        default_client()
    message = str(info.value)
    assert message.startswith("kubernetes: cannot load the API configuration: ") and "\n" not in message
    assert message.endswith("; point KUBECONFIG (default ~/.kube/config) at the cluster's kubeconfig"), message
