"""Kubernetes manifests: the kustomize base in `manifests/` and the per-attempt workload the backend renders.

No cluster and no network: `kubectl kustomize` renders offline, and every object is checked against the Kubernetes
1.32 OpenAPI schemas that `kubernetes-validate` ships (strict: unknown fields fail); a JobSet or TrainJob against
its CRD's schema in `manifests/crds/` (`jsonschema`, made strict the same way). `UPDATE_GOLDEN=1 pytest
tests/test_k8s_manifests.py` rewrites the golden files in tests/golden/kubernetes/.
"""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cona.orchestrator.backends.kubernetes.render import (
    MAX_JOBSET_NAME,
    MAX_NAME,
    PROTOCOL_EXIT_CODES,
    escape,
    render_attempt,
    render_text,
    workload_names,
)
from cona.orchestrator.profile import ClusterProfile, load_profile
from cona.protocol.rundir import ExitCode
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

from tests.conftest import EXAMPLES, HOSTILE_IMAGE, REPO, assert_golden, run_cona

K8S_VERSION = "1.32"
MANIFESTS = REPO / "manifests"
K8S_PROFILE = MANIFESTS / "profiles" / "h100-k8s.yaml"
GOLDEN = REPO / "tests" / "golden" / "kubernetes"
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
STANDARD_LABELS = {f"app.kubernetes.io/{key}" for key in ("name", "instance", "component", "part-of", "managed-by")}
MULTI_NODE = Strategy.parse("dp=4,tp=8,pp=1,mbs=1,gbs=32")  # 32 processes: 4 nodes of 8 H100s
HOSTILE = "evil'\"; $(rm -rf /) `id` $$(x) ${HOME}\nnext"


def _profile(**kubernetes) -> ClusterProfile:
    profile = load_profile(K8S_PROFILE)
    return profile.model_copy(update={"kubernetes": profile.kubernetes.model_copy(update=kubernetes)})


CRD_SCHEMAS = {
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): MANIFESTS / "crds" / "jobset.x-k8s.io_jobsets.v1alpha2.schema.yaml",
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): MANIFESTS / "crds" / "trainer.kubeflow.org_trainjobs.v1alpha1.schema.yaml",
}
WORKLOAD_KINDS = {"indexed-job": ["Service", "Job"], "jobset": ["JobSet"], "trainjob": ["TrainJob"]}


def _strict(schema: Any) -> Any:
    """A CRD schema that refuses unknown fields, as kubernetes-validate's strict mode does for built-in kinds: every
    object schema with `properties` gets `additionalProperties: false` unless it keeps unknown fields on purpose."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: ({name: _strict(sub) for name, sub in value.items()} if key == "properties" else _strict(value))
           for key, value in schema.items()}  # fmt: skip
    if "properties" in out and "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def _crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    schema = yaml.safe_load(CRD_SCHEMAS[(api_version, kind)].read_text())
    return jsonschema.Draft7Validator(_strict(schema))


def _validate(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        errors = sorted(_crd_validator(*key).iter_errors(obj), key=lambda e: list(e.path))
        if errors:
            raise AssertionError(f"{obj['kind']} {obj['metadata'].get('name')}: {errors[0].message} at "
                                 f"{list(errors[0].path)} ({len(errors)} errors)")  # fmt: skip
        return
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{obj['kind']} {obj['metadata'].get('name')}: {e.message} at {list(e.path)}") from None


def _golden(name: str, text: str) -> None:
    assert_golden(GOLDEN / name, text, what="the rendered manifests")


def _kustomize() -> list[dict]:
    if not Path(KUBECTL).exists():
        pytest.fail(
            f"kubectl not found (looked on PATH and at {KUBECTL}); the manifest tests need kubectl >= 1.32 "
            "(kustomize built in) to render manifests/ offline — install it, this test is not skipped"
        )
    out = subprocess.run([KUBECTL, "kustomize", str(MANIFESTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def k8s_expand(text: str, env: dict[str, str]) -> str:
    """What the kubelet makes of `text` in a container's command: `$$` → `$`, `$(VAR)` → its value when VAR is
    defined (else left as written); a lone `$` stays."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (end := text.find(")", i)) != -1 and text[i + 2 : end] in env:
            out.append(env[text[i + 2 : end]])
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _job(objects: list[dict]) -> dict:
    return next(obj for obj in objects if obj["kind"] == "Job")


def _container(objects: list[dict]) -> dict:
    return _job(objects)["spec"]["template"]["spec"]["containers"][0]


def _flag(argv: list[str], name: str) -> str:
    if name in argv:
        return argv[argv.index(name) + 1]
    return next(arg.split("=", 1)[1] for arg in argv if arg.startswith(f"{name}="))


# ---- the kustomize base -----------------------------------------------------------------------------------------


def test_kustomize_base_renders_offline_and_validates():
    docs = _kustomize()
    assert sorted(doc["kind"] for doc in docs) == sorted(
        ["Namespace", "ServiceAccount", "Role", "Role", "RoleBinding", "PersistentVolumeClaim"]
    )
    for doc in docs:
        _validate(doc)
        assert set(doc["metadata"]["labels"]) >= STANDARD_LABELS, doc["kind"]
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "cona"


def test_kustomize_base_matches_the_example_profile():
    spec = load_profile(K8S_PROFILE).kubernetes
    by_kind = {doc["kind"]: doc for doc in _kustomize() if doc["metadata"]["name"] != "cona-submitter"}
    assert by_kind["Namespace"]["metadata"]["name"] == spec.namespace
    assert by_kind["ServiceAccount"]["metadata"]["name"] == spec.service_account
    pvc = by_kind["PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == spec.pvc and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    subject = by_kind["RoleBinding"]["subjects"][0]
    assert (subject["kind"], subject["name"], subject["namespace"]) == ("ServiceAccount", "cona", "cona")
    assert by_kind["RoleBinding"]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cona"}


def test_rbac_is_namespaced_exact_and_has_no_wildcard():
    docs = _kustomize()
    assert not {"ClusterRole", "ClusterRoleBinding"} & {doc["kind"] for doc in docs}
    roles = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "Role"}
    granted: dict[str, dict[tuple[str, str], set[str]]] = {}
    for name, role in roles.items():
        for rule in role["rules"]:
            assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames/nonResourceURLs
            for field in ("apiGroups", "resources", "verbs"):
                assert not any("*" in value for value in rule[field]), rule
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted.setdefault(name, {}).setdefault((group, resource), set()).update(rule["verbs"])
    assert granted["cona"] == {
        ("batch", "jobs"): {"create", "get", "delete"},
        ("jobset.x-k8s.io", "jobsets"): {"create", "get", "delete"},
        ("trainer.kubeflow.org", "trainjobs"): {"create", "get", "delete"},
        ("", "services"): {"create", "delete"},
        ("", "pods"): {"list"},
        ("", "events"): {"list"},
        # Elastic runs grow only into the pods the namespace's ResourceQuotas admit.
        ("", "resourcequotas"): {"list"},
        ("", "pods/log"): {"get"},
        ("", "configmaps"): {"create", "get", "patch"},
        ("coordination.k8s.io", "leases"): {"create", "get", "patch"},
    }
    # The submitting user's Role is not bound by the base: who may submit is the cluster's decision.
    assert granted["cona-submitter"] == {
        ("", "configmaps"): {"create", "get", "patch", "delete"},
        ("batch", "jobs"): {"create", "get", "delete"},
        ("", "pods"): {"list"},
        ("", "events"): {"list"},
        # `cona submit` checks that the profile's PVC and ServiceAccount exist before it creates anything.
        ("", "persistentvolumeclaims"): {"get"},
        ("", "serviceaccounts"): {"get"},
    }
    bindings = [doc for doc in docs if doc["kind"] == "RoleBinding"]
    assert [b["roleRef"]["name"] for b in bindings] == ["cona"]


def test_profiles_and_crd_schemas_are_not_part_of_the_kustomization():
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert not any("profiles" in resource or "crds" in resource for resource in kustomization["resources"])
    assert not any(doc["kind"] == "CustomResourceDefinition" for doc in _kustomize())
    assert all((MANIFESTS / resource).is_file() for resource in kustomization["resources"])


# ---- the rendered workload --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "strategy"), [("h100-4-nodes", MULTI_NODE), ("h100-1-node", Strategy.parse("dp=2,tp=2,pp=2,mbs=1,gbs=8"))]
)
def test_rendered_workload_golden_and_valid(name, strategy):
    profile = load_profile(K8S_PROFILE)
    text = render_text(profile=profile, strategy=strategy, run_dir="/runs/golden-run")
    _golden(f"{name}.yaml", text)
    docs = [doc for doc in yaml.safe_load_all(text) if doc]
    assert [doc["kind"] for doc in docs] == ["Service", "Job"]
    for doc in docs:
        _validate(doc)
        assert STANDARD_LABELS | {"cona.dev/run", "cona.dev/attempt"} <= set(doc["metadata"]["labels"])


def test_job_completions_match_the_placement_for_a_multi_node_strategy():
    objects = render_attempt(profile=load_profile(K8S_PROFILE), strategy=MULTI_NODE, attempt=3, run_dir="/runs/r")
    spec = _job(objects)["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 4
    assert spec["backoffLimit"] == 0
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    container = pod["containers"][0]
    argv = container["command"]
    assert "args" not in container
    assert argv[:3] == ["python", "-m", "torch.distributed.run"]
    assert "--nnodes=4" in argv and "--nproc-per-node=8" in argv and "--node-rank=$(JOB_COMPLETION_INDEX)" in argv
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    assert argv[-6:] == ["-m", "cona.trainer", "--run-dir", "/runs/r", "--attempt", "3"]


def test_tensor_parallelism_across_nodes_gets_whole_nodes():
    # tp=16 over nodes of 8: every tp group is two whole pods' processes (torchrun numbers a pod's ranks together).
    strategy = Strategy.parse("dp=2,tp=16,pp=1,mbs=1,gbs=8")
    objects = render_attempt(profile=load_profile(K8S_PROFILE), strategy=strategy, attempt=1, run_dir="/runs/r")
    assert _job(objects)["spec"]["completions"] == 4
    argv = _container(objects)["command"]
    assert "--nnodes=4" in argv and "--nproc-per-node=8" in argv


def test_single_node_strategy_uses_one_pod_with_its_processes():
    strategy = Strategy.parse("dp=2,tp=2,pp=1,mbs=1,gbs=8")
    container = _container(render_attempt(profile=load_profile(K8S_PROFILE), strategy=strategy, attempt=1, run_dir="/runs/r"))
    assert "--nnodes=1" in container["command"] and "--nproc-per-node=4" in container["command"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "4"}


def test_a_cpu_profile_asks_for_cpus_not_gpus_unless_it_names_a_resource():
    """A `device: cpu` profile's pods asked for `nvidia.com/gpu`, one per process, and stayed Pending on CPU nodes:
    its default resource is a CPU per process; one named explicitly (an extended resource) stays."""
    strategy = Strategy.parse("dp=2,tp=2,pp=1,mbs=1,gbs=8")
    cpu = ["accelerator.device=cpu"]
    container = _container(render_attempt(profile=load_profile(K8S_PROFILE, cpu), strategy=strategy, attempt=1,
                                          run_dir="/runs/r"))  # fmt: skip
    assert container["resources"]["limits"] == {"cpu": "4"}
    named = load_profile(K8S_PROFILE, [*cpu, "kubernetes.gpu_resource=cona.dev/cpu"])
    container = _container(render_attempt(profile=named, strategy=strategy, attempt=1, run_dir="/runs/r"))
    assert container["resources"]["limits"] == {"cona.dev/cpu": "4"}


def test_pod_failure_policy_ends_the_job_on_every_protocol_exit_code():
    rules = _job(render_attempt(profile=load_profile(K8S_PROFILE), strategy=MULTI_NODE, attempt=1, run_dir="/runs/r"))[
        "spec"
    ]["podFailurePolicy"]["rules"]
    fail = [rule for rule in rules if rule["action"] == "FailJob"]
    assert len(fail) == 1
    codes = fail[0]["onExitCodes"]
    assert codes["operator"] == "In" and codes["containerName"] == "trainer"
    assert codes["values"] == [2, 42, 43, 44] == PROTOCOL_EXIT_CODES
    assert set(codes["values"]) == {int(code) for code in ExitCode} - {0}
    ignore = [rule for rule in rules if rule["action"] == "Ignore"]
    assert ignore == [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]


def test_rendezvous_service_and_pod_dns():
    objects = render_attempt(profile=load_profile(K8S_PROFILE), strategy=MULTI_NODE, attempt=2, run_dir="/runs/r")
    service, job = objects
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    pod = job["spec"]["template"]
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    name = job["metadata"]["name"]
    argv = pod["spec"]["containers"][0]["command"]
    assert _flag(argv, "--rdzv-endpoint") == f"{name}-0.{service['metadata']['name']}:29400"
    assert _flag(argv, "--rdzv-backend") == "c10d" and _flag(argv, "--rdzv-id") == name
    assert service["spec"]["ports"][0]["port"] == 29400


def test_pod_security_and_profile_settings():
    profile = _profile(shm_size="64Gi", rendezvous_port=29500)
    objects = render_attempt(profile=profile, strategy=MULTI_NODE, attempt=1, run_dir="/runs/r")
    for obj in objects:
        _validate(obj)
    pod = _job(objects)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True,
        "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"},
    }  # fmt: skip
    assert {"name": "HOME", "value": "/tmp"} in container["env"]
    assert pod["serviceAccountName"] == "cona"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["runs"]["persistentVolumeClaim"] == {"claimName": "cona-runs"}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert mounts == {"runs": "/runs", "dshm": "/dev/shm", "tmp": "/tmp"}  # the root filesystem is read-only
    assert _flag(container["command"], "--rdzv-endpoint").endswith(":29500")


def test_names_are_dns_labels_for_a_long_run_name():
    long_a = "My_Very.Long Run Name " * 8 + "A"
    long_b = "My_Very.Long Run Name " * 8 + "B"
    names = set()
    for run_name in (long_a, long_b):
        objects = render_attempt(
            profile=load_profile(K8S_PROFILE), strategy=MULTI_NODE, attempt=12, run_dir="/runs/r", run_name=run_name
        )
        for obj in objects:
            _validate(obj)
            name = obj["metadata"]["name"]
            assert DNS_1035.fullmatch(name) and len(name) <= MAX_NAME, name
            # Pod hostnames of an Indexed Job are `<job>-<index>`: still a 63-character label.
            assert len(f"{name}-{obj['spec'].get('completions', 1) - 1}") <= 63
            for value in obj["metadata"]["labels"].values():
                assert len(value) <= 63 and LABEL_VALUE.fullmatch(value), value
        names.add(_job(objects)["metadata"]["name"])
    assert len(names) == 2, "a shortened name keeps a hash of the whole run name"
    # A Service name starts with a letter; a name that had to be changed ends in a hash of the run's (`r-1st-run`
    # would be another run's).
    assert re.fullmatch(r"r-1st-run-[0-9a-f]{8}-a1", workload_names("1st run", 1)[0])
    assert workload_names("r-1st-run", 1)[0] == "r-1st-run-a1"


@pytest.mark.parametrize("workload", ["indexed-job", "jobset", "trainjob"])
def test_run_directories_whose_names_differ_only_in_case_get_distinct_objects(workload):
    """Names are lower case: `runs/Exp1` and `runs/exp1` got the same workloads, Service and Lease, so one run
    could adopt or delete the other's. A name that lowering or replacing changed keeps a hash of the original;
    one that is already a DNS label stays as it was (existing runs keep their names)."""
    limit = MAX_NAME if workload == "indexed-job" else MAX_JOBSET_NAME
    rendered = {}
    for run in ("exp1", "Exp1", "EXP1", "exp_1", "exp-1", "exp.1"):
        objects = render_attempt(profile=_profile(workload=workload), strategy=MULTI_NODE, attempt=1,
                                 run_dir=f"/runs/{run}")  # fmt: skip
        for obj in objects:
            _validate(obj)
            assert DNS_1035.fullmatch(obj["metadata"]["name"]) and len(obj["metadata"]["name"]) <= limit
        rendered[run] = {obj["metadata"]["name"] for obj in objects}
        assert workload_names(run, 1, limit)[0] in rendered[run]
    assert rendered["exp1"] == {"exp1-a1"} and rendered["exp-1"] == {"exp-1-a1"}
    names = [name for run_names in rendered.values() for name in run_names]
    assert len(set(names)) == len(rendered), rendered
    assert all(re.fullmatch(r"exp-?1-[0-9a-f]{8}-a1", name) for name in names if name not in ("exp1-a1", "exp-1-a1"))
    # A long name is shortened with the hash as before: two differing only in case still differ.
    long = [render_attempt(profile=_profile(workload=workload), strategy=MULTI_NODE, attempt=1,
                           run_dir=f"/runs/{run}")[-1]["metadata"]["name"] for run in ("x" * 60, "X" + "x" * 59)]  # fmt: skip
    assert long[0] != long[1] and all(len(name) <= limit for name in long)


def test_hostile_values_stay_inert(renderer_without_image_check):
    run_dir = f"/runs/{HOSTILE}"
    image = HOSTILE_IMAGE
    objects = render_attempt(
        profile=_profile(image=image), strategy=MULTI_NODE, attempt=1, run_dir=run_dir, run_name=HOSTILE
    )
    for obj in objects:
        _validate(obj)
        name = obj["metadata"]["name"]
        assert DNS_1035.fullmatch(name) and len(name) <= MAX_NAME
    container = _container(objects)
    argv = container["command"]
    # An argv list, never a shell: no `sh -c`, no args the image's entrypoint could hand to one.
    assert argv[0] == "python" and "-c" not in argv and "args" not in container
    assert not any(word in ("sh", "bash", "/bin/sh", "/bin/bash") for word in argv)
    # The run directory is one argv element, every `$` doubled, so the kubelet's expansion gives it back literally.
    assert _flag(argv, "--run-dir") == escape(run_dir) == run_dir.replace("$", "$$")
    assert "$$(rm -rf /)" in _flag(argv, "--run-dir")
    env = {"JOB_COMPLETION_INDEX": "3", "HOME": "/root", "x": "X", "rm -rf /": "BOOM"}
    expanded = [k8s_expand(arg, env) for arg in argv]
    assert _flag(expanded, "--run-dir") == run_dir
    assert "--node-rank=3" in expanded
    # The only reference left for the kubelet to expand is the completion index.
    references = {m for arg in argv for m in re.findall(r"(?<!\$)(?:\$\$)*\$\(([^)]*)\)", arg)}
    assert references == {"JOB_COMPLETION_INDEX"}
    # The image is not expanded by Kubernetes: it is passed on as written.
    assert container["image"] == image
    # The YAML text carries the same values back.
    text = render_text(profile=_profile(image=image), strategy=MULTI_NODE, run_dir=run_dir, run_name=HOSTILE)
    _golden("hostile.yaml", text)
    assert [doc for doc in yaml.safe_load_all(text) if doc] == objects


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("namespace", "cona\n$(rm -rf /)", "kubernetes.namespace"),
        ("namespace", "Cona'", "kubernetes.namespace"),
        ("image", "cona:1 $(rm -rf /)", "kubernetes.image"),
        ("image", "cona:1\nnext", "kubernetes.image"),
        ("pvc", "runs;rm", "kubernetes.pvc"),
        ("service_account", "a b", "kubernetes.service_account"),
        ("shm_size", "64 GB", "kubernetes.shm_size"),
    ],
)
def test_values_that_cannot_be_names_are_refused_in_one_line(field, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as info:
        render_attempt(profile=_profile(**{field: value}), strategy=MULTI_NODE, attempt=1, run_dir="/runs/r")
    assert "\n" not in str(info.value)


def test_run_dir_must_lie_on_the_pvc():
    for run_dir in ("/scratch/r", "relative/r", "/runs/../etc/r"):
        with pytest.raises(ConfigError, match=r"not under kubernetes\.mount_path"):
            render_attempt(profile=load_profile(K8S_PROFILE), strategy=MULTI_NODE, attempt=1, run_dir=run_dir)


def test_strategy_larger_than_the_profile_is_refused():
    with pytest.raises(ValueError, match="needs 8 nodes but the profile has 4"):
        render_attempt(profile=load_profile(K8S_PROFILE), strategy=Strategy.parse("dp=8,tp=8,pp=1,mbs=1,gbs=64"),
                       attempt=1, run_dir="/runs/r")  # fmt: skip


# ---- JobSet and TrainJob ---------------------------------------------------------------------------------------


def _jobset_job(jobset: dict) -> dict:
    """The Job template of the JobSet's one replicatedJob."""
    (replicated,) = jobset["spec"]["replicatedJobs"]
    return replicated["template"]


def _patched_pod(trainjob: dict) -> dict:
    """The pod template the TrainJob's runtime patch applies to the `node` replicatedJob."""
    (patch,) = trainjob["spec"]["runtimePatches"]
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert replicated["name"] == "node"
    return replicated["template"]["spec"]["template"]


@pytest.mark.parametrize("workload", ["jobset", "trainjob"])
@pytest.mark.parametrize(
    ("name", "strategy"), [("h100-4-nodes", MULTI_NODE), ("h100-1-node", Strategy.parse("dp=2,tp=2,pp=2,mbs=1,gbs=8"))]
)
def test_rendered_jobset_and_trainjob_golden_and_valid_against_their_crds(workload, name, strategy):
    text = render_text(profile=_profile(workload=workload), strategy=strategy, run_dir="/runs/golden-run")
    _golden(f"{name}-{workload}.yaml", text)
    docs = [doc for doc in yaml.safe_load_all(text) if doc]
    assert [doc["kind"] for doc in docs] == WORKLOAD_KINDS[workload]  # no Service: JobSet makes its own
    (doc,) = docs
    _validate(doc)
    assert STANDARD_LABELS | {"cona.dev/run", "cona.dev/attempt"} <= set(doc["metadata"]["labels"])


def test_pull_secrets_and_priority_class_golden_and_valid_for_every_kind():
    """A private registry's Secrets and a PriorityClass in the pod of each kind (a TrainJob's pods take no priority
    class: its runtimePatches cannot set one); every object still validates, strictly or against its CRD."""
    texts = []
    for workload in WORKLOAD_KINDS:
        fields = {"workload": workload, "image_pull_secrets": ["regcred", "mirror.pull-2"]}
        if workload != "trainjob":
            fields["priority_class"] = "ml-high"
        text = render_text(profile=_profile(**fields), strategy=MULTI_NODE, run_dir="/runs/golden-run")
        for doc in yaml.safe_load_all(text):
            if doc:
                _validate(doc)
        texts.append(text)
    _golden("pull-secrets-and-priority.yaml", "".join(texts))


@pytest.mark.parametrize("workload", ["jobset", "trainjob"])
def test_the_crd_schemas_refuse_what_their_servers_would(workload):
    (obj,) = render_attempt(profile=_profile(workload=workload), strategy=MULTI_NODE, attempt=1, run_dir="/runs/r")
    _validate(obj)
    typo, missing, wrong = copy.deepcopy(obj), copy.deepcopy(obj), copy.deepcopy(obj)
    if workload == "jobset":
        _jobset_job(typo)["spec"]["template"]["spec"]["containers"][0]["comand"] = ["x"]  # deep inside the pod
        del missing["spec"]["replicatedJobs"][0]["name"]
        wrong["spec"]["failurePolicy"]["maxRestarts"] = "0"
    else:
        _patched_pod(typo)["spec"]["containers"][0]["command"] = ["x"]  # not patchable through runtimePatches
        del missing["spec"]["runtimeRef"]
        wrong["spec"]["trainer"]["numProcPerNode"] = "auto"  # an int in v1alpha1 of Trainer v2.3
    for broken in (typo, missing, wrong):
        with pytest.raises(AssertionError):
            _validate(broken)


def test_jobset_runs_the_indexed_job_of_the_attempt():
    jobset_objects = render_attempt(profile=_profile(workload="jobset"), strategy=MULTI_NODE, attempt=2,
                                    run_dir="/runs/r")  # fmt: skip
    service, job = render_attempt(profile=load_profile(K8S_PROFILE), strategy=MULTI_NODE, attempt=2, run_dir="/runs/r")
    (jobset,) = jobset_objects
    name = jobset["metadata"]["name"]
    assert (jobset["apiVersion"], jobset["kind"], name) == ("jobset.x-k8s.io/v1alpha2", "JobSet", "r-a2")
    spec = jobset["spec"]
    assert spec["network"] == {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True}
    assert spec["failurePolicy"] == {"maxRestarts": 0}
    (replicated,) = spec["replicatedJobs"]
    assert (replicated["name"], replicated["replicas"]) == ("node", 1)
    template = replicated["template"]
    assert template["metadata"]["labels"] == jobset["metadata"]["labels"] == job["metadata"]["labels"]
    # The same Indexed Job as `indexed-job` renders, but for the subdomain (JobSet sets its own) and the endpoint:
    # pod 0 is `<jobset>-node-0-0` in the JobSet's subdomain.
    job_spec = copy.deepcopy(job["spec"])
    del job_spec["template"]["spec"]["subdomain"]
    argv = job_spec["template"]["spec"]["containers"][0]["command"]
    argv[argv.index(f"--rdzv-endpoint={name}-0.{service['metadata']['name']}:29400")] = (
        f"--rdzv-endpoint={name}-node-0-0.{name}:29400"
    )
    assert template["spec"] == job_spec
    assert (job_spec["completions"], job_spec["parallelism"], job_spec["backoffLimit"]) == (4, 4, 0)
    assert "subdomain" not in template["spec"]["template"]["spec"]


def test_trainjob_on_the_torch_runtime():
    profile = _profile(workload="trainjob", trainer_runtime="my-torch", shm_size="64Gi")
    (trainjob,) = render_attempt(profile=profile, strategy=MULTI_NODE, attempt=3, run_dir="/runs/r")
    assert (trainjob["apiVersion"], trainjob["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    spec = trainjob["spec"]
    assert spec["runtimeRef"] == {"name": "my-torch", "apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime"}
    trainer = spec["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (4, 8)
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": "8"}}
    assert trainer["image"] == "ghcr.io/cona-project/cona:0.1.0"
    # The runtime's PET_* variables carry nodes, processes, node rank and the rendezvous: the command names none,
    # and sets none of them (Trainer refuses a TrainJob whose env does).
    assert trainer["command"] == ["python", "-m", "torch.distributed.run", "--max-restarts=0", "-m", "cona.trainer",
                                  "--run-dir", "/runs/r", "--attempt", "3"]  # fmt: skip
    assert not any(var["name"].startswith("PET_") for var in trainer["env"])
    assert {"name": "CONA_ATTEMPT", "value": "3"} in trainer["env"]
    pod = _patched_pod(trainjob)
    assert pod["metadata"]["labels"] == trainjob["metadata"]["labels"]
    pod_spec = pod["spec"]
    volumes = {volume["name"]: volume for volume in pod_spec["volumes"]}
    assert volumes["runs"]["persistentVolumeClaim"] == {"claimName": "cona-runs"}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    (container,) = pod_spec["containers"]
    assert container["name"] == "node"
    assert {m["name"]: m["mountPath"] for m in container["volumeMounts"]} == {"runs": "/runs", "dshm": "/dev/shm",
                                                                               "tmp": "/tmp"}  # fmt: skip
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod_spec["securityContext"]["runAsUser"] == 1000 and pod_spec["serviceAccountName"] == "cona"
    assert pod_spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


@pytest.mark.parametrize("workload", ["jobset", "trainjob"])
def test_jobset_and_trainjob_names_keep_generated_pod_names_within_63(workload):
    names = set()
    for run_name in ("My_Very.Long Run Name " * 8 + "A", "My_Very.Long Run Name " * 8 + "B"):
        (obj,) = render_attempt(profile=_profile(workload=workload), strategy=MULTI_NODE, attempt=12,
                                run_dir="/runs/r", run_name=run_name)  # fmt: skip
        _validate(obj)
        name = obj["metadata"]["name"]
        assert DNS_1035.fullmatch(name) and len(name) <= MAX_JOBSET_NAME == 46, name
        # JobSet's webhook: the longest generated pod name, for 1000 nodes, with the 5-character suffix.
        assert len(f"{name}-node-0-999-abcde") <= 63
        names.add(name)
    assert len(names) == 2

    # Past 1,000 nodes the index has more digits, and the name gives them room (it was 64 characters at 1,024).
    wide = load_profile(K8S_PROFILE, ["nodes=1024", "gpus_per_node=1", f"kubernetes.workload={workload}"])
    (obj,) = render_attempt(profile=wide, strategy=Strategy.parse("dp=1024,tp=1,pp=1,mbs=1,gbs=1024"), attempt=12,
                            run_dir="/runs/r", run_name="a" * 60)  # fmt: skip
    assert len(f"{obj['metadata']['name']}-node-0-1023-abcde") <= 63, obj["metadata"]["name"]


@pytest.mark.parametrize("workload", ["jobset", "trainjob"])
def test_hostile_values_stay_inert_in_jobset_and_trainjob(workload, renderer_without_image_check):
    run_dir = f"/runs/{HOSTILE}"
    image = HOSTILE_IMAGE
    profile = _profile(workload=workload, image=image)
    objects = render_attempt(profile=profile, strategy=MULTI_NODE, attempt=1, run_dir=run_dir, run_name=HOSTILE)
    (obj,) = objects
    _validate(obj)
    assert DNS_1035.fullmatch(obj["metadata"]["name"])
    if workload == "jobset":
        container = _jobset_job(obj)["spec"]["template"]["spec"]["containers"][0]
        argv, expected_refs = container["command"], {"JOB_COMPLETION_INDEX"}
        assert container["image"] == image and "args" not in container
    else:
        trainer = obj["spec"]["trainer"]
        argv, expected_refs = trainer["command"], set()
        assert trainer["image"] == image and "args" not in trainer
    assert argv[0] == "python" and "-c" not in argv
    assert not any(word in ("sh", "bash", "/bin/sh", "/bin/bash") for word in argv)
    assert _flag(argv, "--run-dir") == escape(run_dir)
    expanded = [k8s_expand(arg, {"JOB_COMPLETION_INDEX": "3", "HOME": "/root", "x": "X", "rm -rf /": "BOOM"})
                for arg in argv]  # fmt: skip
    assert _flag(expanded, "--run-dir") == run_dir
    references = {m for arg in argv for m in re.findall(r"(?<!\$)(?:\$\$)*\$\(([^)]*)\)", arg)}
    assert references == expected_refs
    text = render_text(profile=profile, strategy=MULTI_NODE, run_dir=run_dir, run_name=HOSTILE)
    _golden(f"hostile-{workload}.yaml", text)
    assert [doc for doc in yaml.safe_load_all(text) if doc] == objects


def test_a_workload_kind_that_does_not_exist_lists_the_valid_ones(tmp_path):
    text = K8S_PROFILE.read_text().replace("workload: indexed-job", "workload: pytorchjob")
    assert "pytorchjob" in text
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_profile(path)
    assert "field 'kubernetes.workload': Input should be 'indexed-job', 'jobset' or 'trainjob'" in str(info.value)
    with pytest.raises(ConfigError, match=r"kubernetes\.trainer_runtime"):
        render_attempt(profile=_profile(workload="trainjob", trainer_runtime="Torch Runtime"), strategy=MULTI_NODE,
                       attempt=1, run_dir="/runs/r")  # fmt: skip


@pytest.mark.parametrize("workload", ["jobset", "trainjob"])
def test_cona_render_kubernetes_prints_the_chosen_kind(tmp_path, workload):
    path = tmp_path / "profile.yaml"
    path.write_text(K8S_PROFILE.read_text().replace("workload: indexed-job", f"workload: {workload}"))
    out = run_cona("render", "kubernetes", "--profile", str(path), "--job", str(EXAMPLES / "tiny-gpt.yaml"))
    assert out.returncode == 0, out.stderr
    docs = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    assert [doc["kind"] for doc in docs] == WORKLOAD_KINDS[workload]
    _validate(docs[0])
    assert docs[0]["metadata"]["annotations"]["cona.dev/run-dir"] == "/runs/tiny-gpt-RUN"


def test_cona_render_kubernetes_prints_valid_manifests():
    out = run_cona("render", "kubernetes", "--profile", str(K8S_PROFILE), "--job", str(EXAMPLES / "tiny-gpt.yaml"))
    assert out.returncode == 0, out.stderr
    docs = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    assert [doc["kind"] for doc in docs] == ["Service", "Job"]
    for doc in docs:
        _validate(doc)
    argv = _container(docs)["command"]
    assert _flag(argv, "--run-dir") == "/runs/tiny-gpt-RUN" and _flag(argv, "--attempt") == "1"


def test_cona_render_kubernetes_refuses_another_backends_profile():
    out = run_cona("render", "kubernetes", "--profile", str(REPO / "slurm" / "profiles" / "local-cpu.yaml"),
                   "--job", str(EXAMPLES / "tiny-gpt.yaml"))  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "`cona render kubernetes` needs a kubernetes profile" in out.stderr


def test_cona_render_kubernetes_keeps_a_hostile_run_directory_inert_and_refuses_a_hostile_job_name():
    name = "x\";$(rm -rf /)'`id`"
    refused = run_cona("render", "kubernetes", "--profile", str(K8S_PROFILE), "--job", str(EXAMPLES / "tiny-gpt.yaml"),
                       "--set", f"name={name}")  # fmt: skip
    assert refused.returncode == 2 and "field 'name'" in refused.stderr and "Traceback" not in refused.stderr
    out = run_cona("render", "kubernetes", "--profile", str(K8S_PROFILE), "--job", str(EXAMPLES / "tiny-gpt.yaml"),
                   "--run-dir", f"/runs/{name}-RUN")  # fmt: skip
    assert out.returncode == 0, out.stderr
    docs = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    for doc in docs:
        _validate(doc)
        assert DNS_1035.fullmatch(doc["metadata"]["name"])
    argv = _container(docs)["command"]
    assert _flag(argv, "--run-dir") == escape(f"/runs/{name}-RUN")
    assert k8s_expand(_flag(argv, "--run-dir"), {"rm -rf /": "BOOM"}) == f"/runs/{name}-RUN"
