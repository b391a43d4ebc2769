"""The Kubernetes backend of an elastic run (`min_nodes` < `nodes`) against the API emulator: how it sees lost
nodes (a pod's Node gone or NotReady, a pod Pending past `kubernetes.elastic_pending_timeout_s`), how many nodes
it could run on (Ready, schedulable, matching `node_selector`, with the GPUs allocatable) and which strategy of
the planning table an elastic launch starts. The emulator plays the kubelet (`k8s.make_pods`, `k8s.add_node`).
No cluster, no torch."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from cona.orchestrator.backends.base import AttemptStatus
from cona.orchestrator.backends.kubernetes.backend import KubernetesBackend, NodeState
from cona.orchestrator.profile import ClusterProfile, load_profile
from cona.protocol.rundir import ExitCode, ExitRecord, RunDir
from cona.protocol.strategy import Strategy
from kubernetes import client

from tests.conftest import REPO

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),  # inside kmock
]

NS = "cona"
GPU = "nvidia.com/gpu"
PRODUCT = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}  # the profile's node_selector
TWO = Strategy.parse("dp=2,tp=8,pp=1,mbs=1,gbs=16")  # 2 pods of 8 GPUs
ONE = Strategy.parse("dp=1,tp=8,pp=1,mbs=2,gbs=16")  # 1 pod
TABLE = {1: ONE, 2: TWO}
INSUFFICIENT = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."


def _profile(mount: Path, *, elastic: bool = True, pending_s: float = 300.0) -> ClusterProfile:
    profile = load_profile(REPO / "manifests" / "profiles" / "h100-k8s.yaml")
    spec = profile.kubernetes.model_copy(update={"mount_path": str(mount), "elastic_pending_timeout_s": pending_s})
    return profile.model_copy(update={"kubernetes": spec, "nodes": 2, "min_nodes": 1 if elastic else None})


def _backend(k8s, tmp_path: Path, **kwargs) -> tuple[KubernetesBackend, RunDir]:
    run_dir = RunDir(tmp_path / "runs" / "exp1")
    run_dir.root.mkdir(parents=True, exist_ok=True)
    profile = _profile(tmp_path / "runs", **kwargs)
    return KubernetesBackend(run_dir=run_dir, profile=profile, api_client=k8s.api_client()), run_dir


def _node(k8s, name: str, **kwargs) -> None:
    k8s.add_node(name, resource=GPU, count=8, labels=kwargs.pop("labels", PRODUCT), **kwargs)


def _core(k8s) -> client.CoreV1Api:
    return client.CoreV1Api(k8s.api_client("kubelet-in-test"))


def test_an_elastic_launch_starts_the_plan_for_the_nodes_that_can_run_a_pod(k8s, tmp_path):
    """Of five nodes one can take a pod (the others: cordoned, NotReady, another GPU product, too few GPUs): the
    launch runs the table's one-node strategy in one pod and reports it; `available_nodes` counts 1, then 2 once a
    usable node joins."""
    backend, run_dir = _backend(k8s, tmp_path)
    _node(k8s, "a")
    _node(k8s, "cordoned", unschedulable=True)
    _node(k8s, "notready", ready=False)
    _node(k8s, "other", labels={"nvidia.com/gpu.product": "A100"})
    k8s.add_node("small", resource=GPU, count=4, labels=PRODUCT)
    attempt = backend.launch(attempt=1, strategy=TWO, elastic=TABLE)
    assert attempt.strategy == TWO  # what the scheduler planned; the poll says what runs
    job = client.BatchV1Api(k8s.api_client("reader")).read_namespaced_job(attempt.backend_id, NS)
    assert job.spec.completions == 1
    assert Strategy.from_dict(json.loads((run_dir.attempt_dir(1) / "launch.json").read_text())["strategy"]) == ONE
    k8s.make_pods(attempt.backend_id, NS, node_name="a")
    outcome = backend.poll(attempt)
    assert (outcome.status, outcome.strategy, outcome.lost_nodes) == (AttemptStatus.RUNNING, ONE, ())
    assert backend.available_nodes(attempt) == 1
    _node(k8s, "b")
    assert backend.available_nodes(attempt) == 2


def test_an_elastic_launch_on_enough_nodes_runs_the_planned_strategy(k8s, tmp_path):
    backend, _run_dir = _backend(k8s, tmp_path)
    _node(k8s, "a")
    _node(k8s, "b")
    attempt = backend.launch(attempt=1, strategy=TWO, elastic=TABLE)
    assert "elastic_strategy" not in attempt.extra
    k8s.make_pods(attempt.backend_id, NS, node_name="a")
    assert backend.poll(attempt).strategy is None


@pytest.mark.parametrize("how", ["deleted", "notready"])
def test_a_pod_whose_node_is_gone_or_notready_reports_the_node_lost(k8s, tmp_path, how):
    backend, run_dir = _backend(k8s, tmp_path)
    _node(k8s, "a")
    _node(k8s, "b")
    attempt = backend.launch(attempt=1, strategy=TWO, elastic=TABLE)
    pods = k8s.make_pods(attempt.backend_id, NS, node_name="b")
    assert backend.poll(attempt).lost_nodes == ()
    if how == "deleted":
        _core(k8s).delete_node("b")
    else:
        _core(k8s).patch_node("b", {"status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}})
    backend._node_cache = None  # polls list Nodes every few seconds: ask now
    outcome = backend.poll(attempt)
    assert outcome.lost_nodes == ("b",) and outcome.status is AttemptStatus.RUNNING, outcome
    assert outcome.detail.startswith(f"node b of pod {pods[0]} is {'gone' if how == 'deleted' else 'NotReady'}")
    # A crash the trainer recorded because its peer went away is the lost node's doing, not a crash of its own;
    # the Nodes are listed afresh for it, whatever the poll's cache holds.
    backend._node_cache = (time.monotonic(), {"a": NodeState(True, True), "b": NodeState(True, True)})
    run_dir.write_exit(1, ExitRecord(exit_code=1, name="CRASH", reason="peer", step=3, time=time.time()))
    assert backend.poll(attempt).lost_nodes == ("b",)
    # A protocol exit is what it says, whatever happened to the node after it.
    run_dir.write_exit(1, ExitRecord(exit_code=ExitCode.SWITCH, name="SWITCH", reason="t", step=3, time=time.time()))
    k8s.set_job_status(attempt.backend_id, NS, conditions=[{"type": "Failed", "status": "True"}])
    outcome = backend.poll(attempt)
    assert (outcome.status, outcome.lost_nodes) == (AttemptStatus.SWITCHED, ())


def test_a_pod_pending_past_the_elastic_timeout_is_a_lost_node_but_a_bad_image_is_not(k8s, tmp_path):
    backend, _ = _backend(k8s, tmp_path, pending_s=0.5)
    attempt = backend.launch(attempt=1, strategy=TWO)
    unschedulable = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": INSUFFICIENT}]
    pods = k8s.make_pods(attempt.backend_id, NS, phase="Pending", conditions=unschedulable)
    first = backend.poll(attempt)
    assert (first.status, first.lost_nodes) == (AttemptStatus.PENDING, ())
    time.sleep(0.6)
    outcome = backend.poll(attempt)
    assert outcome.lost_nodes == tuple(f"pod {p}" for p in pods), outcome
    assert outcome.detail.startswith(f"pod {pods[0]} Pending ") and INSUFFICIENT in outcome.detail
    # An attempt on `min_nodes` (one pod) waits for its pod: fewer nodes are not to be had.
    single = backend.launch(attempt=3, strategy=ONE)
    k8s.make_pods(single.backend_id, NS, phase="Pending", conditions=unschedulable)
    backend.poll(single)
    time.sleep(0.6)
    outcome = backend.poll(single)
    assert (outcome.status, outcome.lost_nodes) == (AttemptStatus.PENDING, ()), outcome
    # An image that cannot be pulled: no node would run it (the run fails past `pending_timeout_s` instead).
    attempt2 = backend.launch(attempt=2, strategy=TWO)
    k8s.make_pods(attempt2.backend_id, NS, phase="Pending", container_waiting={"reason": "ErrImagePull"})
    backend.poll(attempt2)
    time.sleep(0.6)
    outcome = backend.poll(attempt2)
    assert outcome.stuck and outcome.lost_nodes == (), outcome


def test_a_run_that_is_not_elastic_never_reads_nodes(k8s, tmp_path):
    backend, _ = _backend(k8s, tmp_path, elastic=False, pending_s=0.1)
    _node(k8s, "b")
    attempt = backend.launch(attempt=1, strategy=TWO, elastic={2: TWO})
    k8s.make_pods(attempt.backend_id, NS, node_name="b")
    _core(k8s).delete_node("b")
    assert backend.poll(attempt).lost_nodes == ()
    assert not [path for _, path in k8s.backend_requests() if path == "/api/v1/nodes"]


def test_nodes_that_may_not_be_read_leave_the_planned_strategy(k8s, tmp_path):
    """Without the ClusterRole of manifests/elastic/nodes.yaml the API refuses to list Nodes (403): the launch runs
    the planned strategy and the run cannot tell whether it could grow."""
    backend, _ = _backend(k8s, tmp_path)
    _node(k8s, "a")
    assert backend.nodes() == {"a": NodeState(ready=True, usable=True)}
    k8s.refuse("get", "", "v1", "nodes", status=403, message="nodes is forbidden")
    attempt = backend.launch(attempt=1, strategy=TWO, elastic=TABLE)
    assert "elastic_strategy" not in attempt.extra
    assert backend.available_nodes(attempt) is None
