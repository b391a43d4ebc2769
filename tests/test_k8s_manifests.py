"""Kubernetes manifests: the kustomize base in `manifests/` and the per-attempt workload the backend renders.

No cluster and no network: `kubectl kustomize` renders offline, and every object is checked against the Kubernetes
1.32 OpenAPI schemas that `kubernetes-validate` ships (strict: unknown fields fail). `UPDATE_GOLDEN=1 pytest
tests/test_k8s_manifests.py` rewrites the golden files in tests/golden/kubernetes/.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from cona.orchestrator.backends.kubernetes.render import (
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

from tests.conftest import EXAMPLES, REPO, assert_golden, run_cona

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


def _validate(obj: dict) -> None:
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
        ("batch", "jobs"): {"create", "get", "list", "watch", "delete"},
        ("", "services"): {"create", "get", "delete"},
        ("", "pods"): {"get", "list", "watch"},
        ("", "pods/log"): {"get"},
        ("", "configmaps"): {"create", "get", "patch"},
        ("coordination.k8s.io", "leases"): {"create", "get", "patch"},
    }
    # The submitting user's Role is not bound by the base: who may submit is the cluster's decision.
    assert granted["cona-submitter"] == {
        ("", "configmaps"): {"create", "get", "patch", "delete"},
        ("batch", "jobs"): {"create", "get"},
        ("", "pods"): {"list"},
    }
    bindings = [doc for doc in docs if doc["kind"] == "RoleBinding"]
    assert [b["roleRef"]["name"] for b in bindings] == ["cona"]


def test_profiles_are_not_part_of_the_kustomization():
    kustomization = yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())
    assert not any("profiles" in resource for resource in kustomization["resources"])
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


def test_single_node_strategy_uses_one_pod_with_its_processes():
    strategy = Strategy.parse("dp=2,tp=2,pp=1,mbs=1,gbs=8")
    container = _container(render_attempt(profile=load_profile(K8S_PROFILE), strategy=strategy, attempt=1, run_dir="/runs/r"))
    assert "--nnodes=1" in container["command"] and "--nproc-per-node=4" in container["command"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "4"}


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
        "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }  # fmt: skip
    assert pod["serviceAccountName"] == "cona"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["runs"]["persistentVolumeClaim"] == {"claimName": "cona-runs"}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert mounts == {"runs": "/runs", "dshm": "/dev/shm"}
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
    assert workload_names("1st run", 1)[0] == "r-1st-run-a1"  # a Service name starts with a letter


def test_hostile_values_stay_inert():
    run_dir = f"/runs/{HOSTILE}"
    image = "registry.example/cona:v1\"';$(id)"
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


def test_jobset_workload_is_not_supported_yet():
    with pytest.raises(ValueError, match="workload 'jobset' is not supported yet; use indexed-job"):
        render_attempt(profile=_profile(workload="jobset"), strategy=MULTI_NODE, attempt=1, run_dir="/runs/r")


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


def test_cona_render_kubernetes_keeps_a_hostile_job_name_inert():
    name = "x\";$(rm -rf /)'`id`"
    out = run_cona("render", "kubernetes", "--profile", str(K8S_PROFILE), "--job", str(EXAMPLES / "tiny-gpt.yaml"),
                   "--set", f"name={name}")  # fmt: skip
    assert out.returncode == 0, out.stderr
    docs = [doc for doc in yaml.safe_load_all(out.stdout) if doc]
    for doc in docs:
        _validate(doc)
        assert DNS_1035.fullmatch(doc["metadata"]["name"])
    argv = _container(docs)["command"]
    assert _flag(argv, "--run-dir") == escape(f"/runs/{name}-RUN")
    assert k8s_expand(_flag(argv, "--run-dir"), {"rm -rf /": "BOOM"}) == f"/runs/{name}-RUN"
