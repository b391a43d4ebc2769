"""An elastic Kubernetes run grows (and starts) only into the pods the namespace's ResourceQuotas admit now: without
that bound a run that shrank because a quota refused some of its pods (`tests/test_k8s_elastic_quota.py`) would grow
straight back into it, have the same pods refused, wait `kubernetes.elastic_pending_timeout_s` and shrink again.

Against the API emulator (kmock, `tests/k8s_emulator.py`), which has no quota controller: it keeps a ResourceQuota's
status as the test writes it (`_quota`, `_set_used`), as the controller would have counted it. The arithmetic alone
(`orchestrator/backends/kubernetes/quotas.py`) is tested without the API. No cluster, no torch."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from cona.orchestrator.backends.base import Attempt
from cona.orchestrator.backends.kubernetes import backend as backend_module
from cona.orchestrator.backends.kubernetes.backend import KubernetesBackend
from cona.orchestrator.backends.kubernetes.quotas import applies_to_every_pod, pod_charges, quota_room
from cona.orchestrator.backends.kubernetes.render import trainer_resources
from cona.orchestrator.job import load_job
from cona.orchestrator.policy import Decision
from cona.orchestrator.profile import ClusterProfile, load_profile
from cona.orchestrator.runmodel import SwitchPlan
from cona.orchestrator.runstate import create_run, read_events
from cona.orchestrator.scheduler import Scheduler
from cona.orchestrator.switchcost import SwitchKind
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy
from kubernetes import client

from tests.conftest import EXAMPLES, REPO
from tests.test_k8s_elastic_quota import JOB, WAIT_S, _admit, quota
from tests.test_k8s_events import add_event

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),  # inside kmock
]

NS = "cona"
GPU = "nvidia.com/gpu"
GPUS = f"requests.{GPU}"
PRODUCT = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}  # the profile's node_selector
TWO = Strategy.parse("dp=2,tp=8,pp=1,mbs=1,gbs=16")  # 2 pods of 8 GPUs
THREE = Strategy.parse("dp=3,tp=8,pp=1,mbs=1,gbs=24")
FOUR = Strategy.parse("dp=4,tp=8,pp=1,mbs=1,gbs=32")
TABLE = {2: TWO, 3: THREE, 4: FOUR}
QUOTAS = f"/api/v1/namespaces/{NS}/resourcequotas"
FORBIDDEN_LINE = ("cona: warning: kubernetes: list resourcequotas in namespace 'cona' refused (403): the Role lacks "
                  "list on resourcequotas; apply manifests/rbac.yaml, until then an elastic run may grow into pods a "
                  "ResourceQuota refuses\n")  # fmt: skip


def _profile(mount: Path, *overrides: str, nodes: int = 4, min_nodes: int = 2) -> ClusterProfile:
    profile = load_profile(REPO / "manifests" / "profiles" / "h100-k8s.yaml", list(overrides))
    spec = profile.kubernetes.model_copy(update={"mount_path": str(mount), "elastic_pending_timeout_s": WAIT_S})
    return profile.model_copy(update={"kubernetes": spec, "nodes": nodes, "min_nodes": min_nodes})


def _backend(k8s, tmp_path: Path, *overrides: str, nodes: int = 4) -> KubernetesBackend:
    """An elastic run of 4 nodes (at least 2) and `nodes` usable Nodes of 8 of the profile's devices."""
    run_dir = RunDir(tmp_path / "runs" / "exp1")
    run_dir.root.mkdir(parents=True, exist_ok=True)
    profile = _profile(tmp_path / "runs", *overrides)
    assert profile.kubernetes is not None
    for index in range(nodes):
        k8s.add_node(f"n{index}", resource=profile.kubernetes.gpu_resource, count=8, labels=PRODUCT)
    return KubernetesBackend(run_dir=run_dir, profile=profile, api_client=k8s.api_client())


def _quota(k8s, name: str, hard: dict[str, str], used: dict[str, str] | None, **spec: Any) -> None:
    """A ResourceQuota of `hard` with the status the quota controller would have given it (`used`; None: none yet,
    as just after its creation). `spec`: scopes, scopeSelector."""
    body: dict[str, Any] = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": name, "namespace": NS},
                            "spec": {"hard": hard, **spec}}  # fmt: skip
    if used is not None:
        body["status"] = {"hard": hard, "used": used}
    created = client.CoreV1Api(k8s.api_client("cona-test-controller")).create_namespaced_resource_quota(NS, body)
    assert created.status == (client.V1ResourceQuotaStatus(hard=hard, used=used) if used else None)  # kept as given


def _set_used(k8s, name: str, used: dict[str, str]) -> None:
    """The quota controller's recount (kmock answers PUT with 404: a merge patch of the status)."""
    core = client.CoreV1Api(k8s.api_client("cona-test-controller"))
    core.patch_namespaced_resource_quota_status(name, NS, {"status": {"used": used}})
    assert core.read_namespaced_resource_quota(name, NS).status.used == used


def _running(k8s, backend: KubernetesBackend, strategy: Strategy = TWO) -> Attempt:
    """An attempt of `strategy` whose pods all run (and so count in the quotas' `used`, as the test writes it)."""
    attempt = backend.launch(attempt=1, strategy=strategy)
    k8s.make_pods(attempt.backend_id, NS)
    return attempt


def _available(backend: KubernetesBackend, attempt: Attempt) -> int | None:
    backend._quota_cache = None  # listed at most every QUOTA_LIST_EVERY_S: ask now
    return backend.available_nodes(attempt)


def _quota_requests(k8s) -> list[tuple[str, str]]:
    return [r for r in k8s.backend_requests() if r[1] == QUOTAS]


def _started_on(k8s, backend: KubernetesBackend, attempt: int = 1) -> int:
    """The pods of an elastic launch of the table (`_start_on`): its Job's completions."""
    launched = backend.launch(attempt=attempt, strategy=FOUR, elastic=TABLE)
    job = client.BatchV1Api(k8s.api_client("reader")).read_namespaced_job(launched.backend_id, NS)
    return job.spec.completions


# ---- the backend against the emulator ---------------------------------------------------------------------------


def test_without_a_quota_the_nodes_alone_decide(k8s, tmp_path):
    """No ResourceQuota in the namespace: as many nodes as can run a pod, as before; the quotas were asked."""
    backend = _backend(k8s, tmp_path)
    attempt = _running(k8s, backend)
    assert _available(backend, attempt) == 4
    assert _started_on(k8s, backend, attempt=2) == 4
    assert _quota_requests(k8s) == [("GET", QUOTAS)] * 2


def test_growth_is_bounded_by_the_pods_the_quota_admits(k8s, tmp_path):
    """Two pods of 8 GPUs run (16 of the quota's `used`), four Nodes could take one: the run could have its own two
    and as many more as the rest of the quota holds, never more than the Nodes, never fewer than its own."""
    backend = _backend(k8s, tmp_path)
    attempt = _running(k8s, backend)
    _quota(k8s, "gpu-quota", {GPUS: "24"}, {GPUS: "16"})
    assert _available(backend, attempt) == 3  # room for 3 of 4 pods: one more
    _set_used(k8s, "gpu-quota", {GPUS: "8"})  # another's pod: room for all
    assert _available(backend, attempt) == 4
    _set_used(k8s, "gpu-quota", {GPUS: "24"})  # full: the run's own two
    assert _available(backend, attempt) == 2
    _set_used(k8s, "gpu-quota", {GPUS: "40"})  # over (the quota lowered below what runs): still its own
    assert _available(backend, attempt) == 2


def test_the_quota_listing_is_cached_between_decisions(k8s, tmp_path):
    backend = _backend(k8s, tmp_path)
    attempt = _running(k8s, backend)
    _quota(k8s, "gpu-quota", {GPUS: "24"}, {GPUS: "16"})
    assert [backend.available_nodes(attempt) for _ in range(3)] == [3, 3, 3]
    assert len(_quota_requests(k8s)) == 1  # at most every QUOTA_LIST_EVERY_S


def test_a_launch_starts_on_the_pods_the_quota_admits(k8s, tmp_path):
    """Four usable Nodes, a quota with room for three pods: the launch runs the table's strategy for three. The
    quota is read as it stands: what a previous attempt's pods still hold of it counts as used (`_start_on`)."""
    backend = _backend(k8s, tmp_path)
    _quota(k8s, "gpu-quota", {GPUS: "24"}, {GPUS: "0"})
    assert _started_on(k8s, backend) == 3
    run_dir = backend.run_dir
    assert Strategy.from_dict(json.loads((run_dir.attempt_dir(1) / "launch.json").read_text())["strategy"]) == THREE
    _set_used(k8s, "gpu-quota", {GPUS: "16"})
    assert _started_on(k8s, backend, attempt=2) == 2  # the table's least (fewer is not planned)


def test_a_cpu_profile_is_bounded_by_its_cpu_and_memory_quotas(k8s, tmp_path):
    """A CPU profile's pods ask 8 CPUs (a limit, hence the request) and 16Gi (request and limit); a quota on `cpu`,
    bare `memory` (the requests) and another on `limits.memory` bound the run by the scarcest of them."""
    backend = _backend(k8s, tmp_path, "accelerator.device=cpu", "kubernetes.trainer_memory=16Gi")
    assert trainer_resources(backend.spec, 8) == {"limits": {"cpu": "8", "memory": "16Gi"},
                                                  "requests": {"memory": "16Gi"}}  # fmt: skip
    attempt = _running(k8s, backend)
    _quota(k8s, "compute", {"cpu": "40", "memory": "48Gi"}, {"cpu": "16", "memory": "32Gi"})
    assert _available(backend, attempt) == 3  # CPUs for 3 more, memory for 1
    _quota(k8s, "limits", {"limits.memory": "40Gi", "limits.cpu": "100"}, {"limits.memory": "32Gi", "limits.cpu": "16"})
    assert _available(backend, attempt) == 2  # no memory limit left for a third pod


@pytest.mark.parametrize("name", ["pods", "count/pods"])
def test_a_quota_on_the_pod_count(k8s, tmp_path, name):
    """Five pods at most, three there (the run's two, the orchestrator's): one more trainer pod."""
    backend = _backend(k8s, tmp_path)
    attempt = _running(k8s, backend)
    _quota(k8s, "objects", {name: "4"}, {name: "3"})
    assert _available(backend, attempt) == 3


def test_a_scoped_quota_is_not_counted(k8s, tmp_path):
    """Full quotas scoped to some pods (a PriorityClass, NotBestEffort) may not count the trainer pods: they hold
    nothing back; the unscoped one does."""
    backend = _backend(k8s, tmp_path)
    attempt = _running(k8s, backend)
    full = ({GPUS: "16"}, {GPUS: "16"})
    _quota(k8s, "by-priority", *full, scopeSelector={"matchExpressions": [
        {"scopeName": "PriorityClass", "operator": "In", "values": ["high"]}]})  # fmt: skip
    _quota(k8s, "not-best-effort", *full, scopes=["NotBestEffort"])
    _quota(k8s, "gpu-quota", {GPUS: "24"}, {GPUS: "16"})
    assert _available(backend, attempt) == 3


def test_a_quota_without_a_status_yet_is_not_counted(k8s, tmp_path):
    """Just created, before the quota controller counted it: admission does not enforce it yet either."""
    backend = _backend(k8s, tmp_path)
    attempt = _running(k8s, backend)
    _quota(k8s, "new", {GPUS: "0"}, None)
    _quota(k8s, "gpu-quota", {GPUS: "24"}, {GPUS: "16"})
    assert _available(backend, attempt) == 3


def test_a_403_on_resourcequotas_is_said_once_and_the_nodes_decide(k8s, tmp_path, capsys):
    """A Role without list on resourcequotas (older than manifests/rbac.yaml): said once, not asked again, and the
    run counts the Nodes alone, as before."""
    backend = _backend(k8s, tmp_path)
    attempt = _running(k8s, backend)
    _quota(k8s, "gpu-quota", {GPUS: "16"}, {GPUS: "16"})
    k8s.refuse("get", "", "v1", "resourcequotas", status=403, message='resourcequotas is forbidden: User "system:serviceaccount:cona:cona" cannot list resource "resourcequotas"')  # fmt: skip
    assert [_available(backend, attempt) for _ in range(3)] == [4, 4, 4]
    assert _started_on(k8s, backend, attempt=2) == 4
    assert len(_quota_requests(k8s)) == 1
    assert capsys.readouterr().err == FORBIDDEN_LINE


def test_another_api_error_is_said_once_and_skips_the_quotas_for_that_call(k8s, tmp_path, capsys):
    backend = _backend(k8s, tmp_path)
    attempt = _running(k8s, backend)
    _quota(k8s, "gpu-quota", {GPUS: "16"}, {GPUS: "16"})
    k8s.refuse("get", "", "v1", "resourcequotas", status=500, message="etcdserver: request timed out")
    assert [_available(backend, attempt) for _ in range(2)] == [4, 4]
    assert len(_quota_requests(k8s)) == 2  # asked again at the next call
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cona: warning: kubernetes: list resourcequotas"), err
    assert "etcdserver: request timed out" in err
    assert err.endswith("; the run's growth is not bounded by the namespace's ResourceQuotas this time\n"), err


# ---- the scheduler: shrunk for a quota, it grows only once the quota has room -----------------------------------


def test_after_shrinking_for_a_quota_the_run_grows_back_only_once_the_quota_has_room(k8s, tmp_path, monkeypatch):
    """A whole `cona run` of 2 nodes (at least 1) on 2 usable Nodes: the quota admits 2 pods at the launch, then
    another's pod takes 8 of its 16 GPUs and pod 1 is refused; past the elastic timeout the run shrinks to 1 node.
    While the quota's status shows it full the decisions offer no larger world (the Nodes alone would: the run
    would grow straight back into the refusal); once the status shows room, the run grows (event `grow`).

    The policy stands in: it grows whenever a larger world is offered (whether growing pays is not this test's
    question); the trainer stands in as heartbeats' time, so that decisions are made."""
    monkeypatch.setattr(backend_module, "EVENTS_AFTER_S", 0.0)
    monkeypatch.setattr(backend_module, "QUOTA_LIST_EVERY_S", 0.0)
    mount = tmp_path / "runs"
    profile = _profile(mount, nodes=2, min_nodes=1)
    job = load_job(EXAMPLES / "tiny-gpt.yaml", [f"data.path={EXAMPLES / 'tiny-gpt.yaml'}", "policy.decision_interval_s=0.05"])
    run_dir = RunDir(mount / "exp1")
    create_run(run_dir=run_dir, profile=profile, job=job)
    for name in ("a", "b"):
        k8s.add_node(name, resource=GPU, count=8, labels=PRODUCT)
    _quota(k8s, "gpu-quota", {GPUS: "16"}, {GPUS: "0"})
    add_event(k8s, JOB, quota(8, 16).replace(f"{JOB}-3-", f"{JOB}-1-"))
    backend = KubernetesBackend(run_dir=run_dir, profile=profile, job=job, api_client=k8s.api_client())

    class Grown(Exception):
        """The run decided to grow: the test has seen what it came for."""

    offered: list[tuple[int, set[int]]] = []  # (attempt, worlds) of each decision once the attempt's pods exist
    made: set[int] = set()  # attempts whose pods the test made
    room = False

    def decide(*, now: float, current: Strategy, strategy_since: float, elapsed_s: float,
               worlds: set[int] | None = None) -> SwitchPlan | None:  # fmt: skip
        number = sched.state.attempts_started
        if number in made:
            offered.append((number, set(worlds or ())))
        if not worlds or max(worlds) <= current.world_size:
            return None
        target = TWO  # the only larger world: 2 nodes
        return SwitchPlan(decision=Decision(switch_to=target, reason="the test's policy grows"), target=target,
                          kind=SwitchKind.RESUBMIT, predicted_s=60.0)  # fmt: skip

    def on_update(_live: object) -> None:
        nonlocal room
        sched.state.last_heartbeat_time = time.time()
        if any(e["event"] == "grow" for e in read_events(run_dir)):
            raise Grown
        number = sched.state.attempts_started
        if number not in made:
            # The Job controller: the quota admits the first pod; 8 GPUs are another's by now, 8 the first pod's.
            _admit(k8s, f"exp1-a{number}", created=1)
            _set_used(k8s, "gpu-quota", {GPUS: "16"})
            made.add(number)
        elif number == 2 and not room and len([o for o in offered if o[0] == 2]) >= 5:
            _set_used(k8s, "gpu-quota", {GPUS: "8"})  # the other's pod ended
            room = True

    sched = Scheduler(run_dir=run_dir, profile=profile, job=job, backend=backend, poll_interval_s=0.02,
                      on_update=on_update)  # fmt: skip
    monkeypatch.setattr(sched.model, "decide", decide)
    with pytest.raises(Grown):
        sched.run()
    events = read_events(run_dir)
    (shrink,) = [e for e in events if e["event"] == "shrink"]
    assert (shrink["lost"], shrink["nodes"]) == ([f"pod 1 of Job {JOB}"], 1)
    assert sched.state.attempts[-1].strategy.world_size == 8 and sched.state.attempts_started == 2
    # Full: five decisions and more on one node offered nothing larger; then the room, and the growth.
    full = [worlds for number, worlds in offered if number == 2]
    assert full[:5] == [{8}] * 5, offered
    (grow,) = [e for e in events if e["event"] == "grow"]
    assert (grow["attempt"], grow["nodes"], grow["available_nodes"]) == (2, 2, 2)
    assert [e for e in events if e["event"] == "switch"][-1]["to"] == TWO.to_dict()


# ---- the arithmetic alone ---------------------------------------------------------------------------------------


def _q(hard: dict[str, str], used: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    return {"spec": {"hard": hard, **spec}, **({"status": {"hard": hard, "used": used}} if used is not None else {})}


def test_what_one_trainer_pod_counts_against_a_quota():
    profile = load_profile(REPO / "manifests" / "profiles" / "h100-k8s.yaml",
                           ["kubernetes.trainer_cpu=32", "kubernetes.trainer_memory=200Gi"])  # fmt: skip
    assert profile.kubernetes is not None
    gi = 1024**3
    assert pod_charges(trainer_resources(profile.kubernetes, 8)) == {
        "pods": 1, "count/pods": 1,
        "requests.cpu": 32, "cpu": 32, "requests.memory": 200 * gi, "memory": 200 * gi, "limits.memory": 200 * gi,
        "requests.nvidia.com/gpu": 8, "limits.nvidia.com/gpu": 8,  # a limit only: the request too
    }  # fmt: skip


def test_how_many_more_pods_the_quotas_admit():
    pod = pod_charges({"limits": {GPU: "8"}, "requests": {"cpu": "500m"}})
    assert quota_room([], pod) is None
    assert quota_room([_q({"requests.storage": "1Ti"}, {"requests.storage": "0"})], pod) is None  # nothing a pod asks
    assert quota_room([_q({GPUS: "64"}, {GPUS: "40"})], pod) == 3
    assert quota_room([_q({GPUS: "64"}, {GPUS: "40"}), _q({"cpu": "2"}, {"cpu": "1"})], pod) == 2  # the scarcest
    assert quota_room([_q({"cpu": "1.5"}, {"cpu": "0"})], pod) == 3  # an exact fit of fractions counts
    assert quota_room([_q({GPUS: "8"}, {GPUS: "16"})], pod) == 0  # never below 0
    assert quota_room([_q({GPUS: "0"})], pod) is None  # no status yet: not counted
    assert quota_room([_q({GPUS: "64"}, {})], pod) is None  # not counted yet
    assert quota_room([_q({GPUS: "8Q"}, {GPUS: "0"})], pod) is None  # not a quantity
    assert quota_room([_q({GPUS: "0"}, {GPUS: "0"}, scopes=["BestEffort"])], pod) is None


def test_quota_models_of_the_client_read_as_their_dicts():
    quota = client.V1ResourceQuota(spec=client.V1ResourceQuotaSpec(hard={GPUS: "24"}),
                                   status=client.V1ResourceQuotaStatus(hard={GPUS: "24"}, used={GPUS: "8"}))  # fmt: skip
    scoped = client.V1ResourceQuota(spec=client.V1ResourceQuotaSpec(hard={GPUS: "0"}, scope_selector=client.V1ScopeSelector(
        match_expressions=[client.V1ScopedResourceSelectorRequirement(operator="Exists", scope_name="PriorityClass")])))  # fmt: skip
    assert applies_to_every_pod(quota) and not applies_to_every_pod(scoped)
    assert quota_room([quota, scoped], pod_charges({"limits": {GPU: "8"}})) == 2
