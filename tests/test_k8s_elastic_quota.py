"""An elastic run (`min_nodes` < `nodes`) on Kubernetes whose pods a ResourceQuota admits only some of: the pods the
Job controller cannot create count as lost nodes past `kubernetes.elastic_pending_timeout_s`, as unschedulable
pods do, so the run shrinks to the pods that fit; a refusal that every pod meets alike does not shrink it, and a
run that is not elastic is as it was.

Against the API emulator (kmock, `tests/k8s_emulator.py`), which has no controllers: each test creates the pods
the quota admitted (`k8s.make_pods`, then deletes the others) and injects the Job controller's `FailedCreate`
Event itself (`tests/test_k8s_events.add_event`). No cluster, no torch."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
from cona.orchestrator.backends.base import Attempt, AttemptStatus, Outcome
from cona.orchestrator.backends.kubernetes import backend as backend_module
from cona.orchestrator.backends.kubernetes.backend import KubernetesBackend, missing_indices
from cona.orchestrator.backends.kubernetes.events import explain_refusal, trainer_fields
from cona.orchestrator.job import load_job
from cona.orchestrator.profile import ClusterProfile, load_profile
from cona.orchestrator.runstate import create_run, read_events
from cona.orchestrator.scheduler import Scheduler
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError
from kubernetes import client

from tests.conftest import EXAMPLES, REPO
from tests.test_k8s_events import NO_PRIORITY, add_event

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),  # inside kmock
]

NS = "cona"
JOB = "exp1-a1"
FOUR = Strategy.parse("dp=4,tp=8,pp=1,mbs=1,gbs=32")  # 4 pods of 8 GPUs
TWO = Strategy.parse("dp=2,tp=8,pp=1,mbs=1,gbs=16")  # 2 pods: min_nodes
WAIT_S = 0.5
"""The profile's `elastic_pending_timeout_s` here."""
PREFIX = f'Error creating: pods "{JOB}-3-" is forbidden: '


def quota(used: int, limited: int) -> str:
    """The Job controller's message for a pod of 8 GPUs that the ResourceQuota `gpu-quota` refuses."""
    return (f"{PREFIX}exceeded quota: gpu-quota, requested: requests.nvidia.com/gpu=8, used: "
            f"requests.nvidia.com/gpu={used}, limited: requests.nvidia.com/gpu={limited}")  # fmt: skip


TOO_SMALL = quota(24, 24)
"""Three of the four pods fit in all (24 GPUs for 32): waiting never brings the fourth (stuck), three nodes would."""
USED_UP = quota(56, 64)
"""Room for all four, but other pods hold 32 of it: the fourth waits for them (not stuck), or three nodes train."""
NOT_ONE = quota(0, 4)
"""Not even one pod fits: fewer nodes would be refused the same."""
EVERY_POD = {
    "priority-class": NO_PRIORITY,
    "service-account": f'{PREFIX}error looking up service account cona/trainer: serviceaccount "trainer" not found',
    "pod-security": f'{PREFIX}violates PodSecurity "baseline:latest": privileged (container "trainer")',
    "quota-wants-a-field": f"{PREFIX}failed quota: compute: must specify limits.cpu",
    "quota-smaller-than-one-pod": NOT_ONE,
}


def _profile(mount: Path, *, elastic: bool = True, workload: str = "indexed-job") -> ClusterProfile:
    """4 nodes of 8 GPUs, at least 2 when elastic."""
    profile = load_profile(REPO / "manifests" / "profiles" / "h100-k8s.yaml")
    spec = profile.kubernetes.model_copy(update={"mount_path": str(mount), "elastic_pending_timeout_s": WAIT_S,
                                                 "workload": workload})  # fmt: skip
    return profile.model_copy(update={"kubernetes": spec, "nodes": 4, "min_nodes": 2 if elastic else None})


def _backend(k8s, tmp_path: Path, *, elastic: bool = True, workload: str = "indexed-job") -> KubernetesBackend:
    run_dir = RunDir(tmp_path / "runs" / "exp1")
    run_dir.root.mkdir(parents=True, exist_ok=True)
    profile = _profile(tmp_path / "runs", elastic=elastic, workload=workload)
    return KubernetesBackend(run_dir=run_dir, profile=profile, api_client=k8s.api_client())


def _admit(k8s, job: str, *, created: int, workload: str = "indexed-job") -> list[str]:
    """Of the Job's pods, only the first `created` exist (Running: waiting at the rendezvous for the others), as
    the Job controller leaves them when the quota refuses the rest; their names."""
    core = client.CoreV1Api(k8s.api_client("cona-test-controller"))
    for pod in core.list_namespaced_pod(NS).items:
        core.delete_namespaced_pod(pod.metadata.name, NS)
    pods = k8s.make_pods(job, NS, workload=workload)
    for name in pods[created:]:
        core.delete_namespaced_pod(name, NS)
    return pods[:created]


def _admitted(k8s, backend: KubernetesBackend, strategy: Strategy, *, created: int) -> Attempt:
    """An attempt of `strategy` launched `EVENTS_AFTER_S` ago and more (its missing pods are not the controller
    being slow) whose first `created` pods exist (`_admit`)."""
    attempt = backend.launch(attempt=1, strategy=strategy)
    _admit(k8s, attempt.backend_id, created=created, workload=backend.spec.workload)
    return dataclasses.replace(attempt, started_at=attempt.started_at - backend_module.EVENTS_AFTER_S - 1)


def _before_and_after(backend: KubernetesBackend, attempt: Attempt) -> tuple[Outcome, Outcome]:
    """The poll's outcome at once, and again past the elastic timeout."""
    first = backend.poll(attempt)
    time.sleep(WAIT_S + 0.1)
    return first, backend.poll(attempt)


def _line(message: str, pods: int = 4) -> tuple[str, bool]:
    """What `events.explain_refusal` says of `message` for the attempt's Job: (line, stuck)."""
    line, stuck, _ = explain_refusal(message, creator=f"Job {JOB}", namespace=NS, fields=trainer_fields("nvidia.com/gpu"),
                                     pods=pods)  # fmt: skip
    return line, stuck


@pytest.mark.parametrize(("message", "stuck"), [(TOO_SMALL, True), (USED_UP, False)], ids=["too-small", "used-up"])
def test_a_pod_a_quota_does_not_admit_is_a_lost_node_past_the_elastic_timeout(k8s, tmp_path, message, stuck):
    """Three of four pods created: before the timeout the attempt is pending with the quota's line (stuck or not,
    as for a run that is not elastic); past it, pod 3 is a lost node, named by its completion index (no pod, no
    node name), so the scheduler replans on the three nodes that fit."""
    backend = _backend(k8s, tmp_path)
    attempt = _admitted(k8s, backend, FOUR, created=3)
    add_event(k8s, JOB, message)
    first, outcome = _before_and_after(backend, attempt)
    line, _ = _line(message)
    assert (first.status, first.detail, first.stuck, first.lost_nodes) == (AttemptStatus.PENDING, line, stuck, ())
    assert (outcome.status, outcome.lost_nodes) == (AttemptStatus.RUNNING, (f"pod 3 of Job {JOB}",)), outcome
    assert outcome.detail.startswith(f"pod 3 of Job {JOB} not created for ") and outcome.detail.endswith(f"({line})")


def test_each_pod_not_created_is_one_lost_node(k8s, tmp_path):
    """Two of four created (the quota used up by others): two nodes lost, which leaves `min_nodes`."""
    backend = _backend(k8s, tmp_path)
    attempt = _admitted(k8s, backend, FOUR, created=2)
    add_event(k8s, JOB, quota(48, 64))
    first, outcome = _before_and_after(backend, attempt)
    assert first.lost_nodes == ()
    assert outcome.lost_nodes == (f"pod 2 of Job {JOB}", f"pod 3 of Job {JOB}"), outcome
    assert outcome.detail.startswith(f"pods 2, 3 of Job {JOB} not created for ")


@pytest.mark.parametrize("workload", ["jobset", "trainjob"])
def test_a_jobsets_pods_are_named_by_the_index_of_its_job(k8s, tmp_path, workload):
    """A JobSet (and a TrainJob's JobSet) creates its pods through one Indexed Job, `<name>-node-0`, whose event
    says why and whose indices name the pods not created."""
    backend = _backend(k8s, tmp_path, workload=workload)
    attempt = _admitted(k8s, backend, FOUR, created=3)
    add_event(k8s, f"{JOB}-node-0", USED_UP)
    first, outcome = _before_and_after(backend, attempt)
    assert first.lost_nodes == () and outcome.lost_nodes == (f"pod 3 of Job {JOB}-node-0",), outcome


def test_the_clock_starts_when_the_refusal_is_seen_and_stops_when_the_pod_is_created(k8s, tmp_path):
    """Events are read from `EVENTS_AFTER_S` after the launch: before that nothing says why the pod is missing and
    nothing is lost; a pod created after all (the quota freed) is not lost either."""
    backend = _backend(k8s, tmp_path)
    attempt = _admitted(k8s, backend, FOUR, created=3)
    fresh = dataclasses.replace(attempt, started_at=time.time())
    add_event(k8s, JOB, USED_UP)
    first, outcome = _before_and_after(backend, fresh)
    # Three pods running, nothing said of the fourth: as in a run that is not elastic.
    assert (first.status, outcome.status, outcome.lost_nodes) == (AttemptStatus.RUNNING, AttemptStatus.RUNNING, ())
    assert backend.poll(attempt).lost_nodes == ()  # the refusal seen now: the clock starts
    time.sleep(WAIT_S + 0.1)
    _admit(k8s, JOB, created=4)
    assert backend.poll(attempt) == Outcome(AttemptStatus.RUNNING)


@pytest.mark.parametrize("message", list(EVERY_POD.values()), ids=list(EVERY_POD))
def test_a_refusal_every_pod_meets_alike_does_not_shrink(k8s, tmp_path, message):
    """Fewer pods would be refused the same: the attempt stays pending with the refusal's line, stuck, and fails
    the run past `kubernetes.pending_timeout_s` as it does in a run that is not elastic."""
    backend = _backend(k8s, tmp_path)
    attempt = _admitted(k8s, backend, FOUR, created=0)
    add_event(k8s, JOB, message)
    first, outcome = _before_and_after(backend, attempt)
    assert first == outcome
    assert (outcome.status, outcome.detail, outcome.stuck, outcome.lost_nodes) == (
        AttemptStatus.PENDING, _line(message)[0], True, ())  # fmt: skip


def test_an_attempt_on_min_nodes_waits_for_its_pods(k8s, tmp_path):
    """Fewer nodes are not to be had: pending with the quota's line, as in a run that is not elastic."""
    backend = _backend(k8s, tmp_path)
    attempt = _admitted(k8s, backend, TWO, created=1)
    add_event(k8s, JOB, quota(8, 8))
    _, outcome = _before_and_after(backend, attempt)
    assert (outcome.status, outcome.detail, outcome.stuck, outcome.lost_nodes) == (
        AttemptStatus.PENDING, _line(quota(8, 8), pods=2)[0], True, ())  # fmt: skip


@pytest.mark.parametrize(("message", "stuck"), [(TOO_SMALL, True), (USED_UP, False)], ids=["too-small", "used-up"])
def test_a_run_that_is_not_elastic_is_unchanged(k8s, tmp_path, message, stuck):
    backend = _backend(k8s, tmp_path, elastic=False)
    attempt = _admitted(k8s, backend, FOUR, created=3)
    add_event(k8s, JOB, message)
    first, outcome = _before_and_after(backend, attempt)
    assert first == outcome == Outcome(AttemptStatus.PENDING, None, _line(message)[0], stuck=stuck)
    assert not [path for _, path in k8s.backend_requests() if path == "/api/v1/nodes"]


@pytest.mark.parametrize(("message", "fewer"), [
    (TOO_SMALL, True), (USED_UP, True), (quota(64, 64), True), (NOT_ONE, False),
    ("exceeded quota: q, requested: requests.cpu=4,requests.nvidia.com/gpu=8, used: requests.cpu=0,"
     "requests.nvidia.com/gpu=0, limited: requests.cpu=2,requests.nvidia.com/gpu=64", False),
    *((m, False) for m in EVERY_POD.values()),
    ('Internal error occurred: failed calling webhook "w.example.com": context deadline exceeded', False),
])  # fmt: skip
def test_which_refusals_fewer_pods_would_pass(message, fewer):
    """`explain_refusal` decides it with whether the refusal is stuck: only a ResourceQuota that one pod fits (a
    CPU request above the quota is one pod too many, whatever its GPUs)."""
    assert explain_refusal(message, creator="Job x", namespace=NS, fields=trainer_fields("nvidia.com/gpu"),
                           pods=4)[2] is fewer  # fmt: skip


def test_the_missing_indices_are_those_no_pod_has():
    def pod(index: str | None) -> client.V1Pod:
        annotations = {"batch.kubernetes.io/job-completion-index": index} if index is not None else {}
        return client.V1Pod(metadata=client.V1ObjectMeta(name=f"p{index}", annotations=annotations))

    assert missing_indices([pod("0"), pod("2")], 4) == [1, 3]
    assert missing_indices([pod("0"), pod(None)], 4) == [1, 2]  # a pod without an index counts, unplaced


def test_the_scheduler_shrinks_to_the_pods_the_quota_admits(k8s, tmp_path, monkeypatch):
    """A whole `cona run` of 2 nodes (at least 1) whose quota admits one pod: past the elastic timeout the attempt
    ends as a lost node (no restart counted) and the next one runs the planning table's strategy for 1 node."""
    monkeypatch.setattr(backend_module, "EVENTS_AFTER_S", 0.0)
    mount = tmp_path / "runs"
    profile = _profile(mount).model_copy(update={"nodes": 2, "min_nodes": 1})
    job = load_job(EXAMPLES / "tiny-gpt.yaml", [f"data.path={EXAMPLES / 'tiny-gpt.yaml'}"])
    run_dir = RunDir(mount / "exp1")
    create_run(run_dir=run_dir, profile=profile, job=job)
    backend = KubernetesBackend(run_dir=run_dir, profile=profile, job=job, api_client=k8s.api_client())
    add_event(k8s, JOB, quota(8, 8).replace(f"{JOB}-3-", f"{JOB}-1-"))

    class Launched(Exception):
        """The second attempt is launched: the test has seen what it came for."""

    admitted: list[str] = []

    def on_update(_live: object) -> None:
        """Called after each poll: after the first, the pods the Job controller made (pod 0, which the quota
        admitted); once the second attempt is launched, the end of the test."""
        if sched.state.attempts_started > 1:
            raise Launched
        if not admitted:
            admitted.extend(_admit(k8s, JOB, created=1))

    sched = Scheduler(run_dir=run_dir, profile=profile, job=job, backend=backend, poll_interval_s=0.02,
                      on_update=on_update)  # fmt: skip
    with pytest.raises(Launched):
        sched.run()
    events = read_events(run_dir)
    (shrink,) = [e for e in events if e["event"] == "shrink"]
    assert (shrink["lost"], shrink["nodes"]) == ([f"pod 1 of Job {JOB}"], 1)
    assert [e["status"] for e in events if e["event"] == "attempt-end"] == ["lost-node"]
    assert not [e for e in events if e["event"] in ("failure", "pending-timeout")]
    second = sched.state.attempts[-1]
    assert Strategy.from_dict(shrink["to"]) == second.strategy and second.strategy.world_size == 8
    job_object = client.BatchV1Api(k8s.api_client("reader")).read_namespaced_job(second.backend_id, NS)
    assert job_object.spec.completions == 1


def test_an_elastic_timeout_not_shorter_than_the_pending_timeout_is_refused_naming_both():
    """A quota that admits fewer pods is also stuck (`events.explain_refusal`): with elastic_pending_timeout_s at or above
    pending_timeout_s the run would fail before it could shrink. Refused when the profile loads, elastic only."""
    path = REPO / "manifests" / "profiles" / "h100-k8s.yaml"
    late = ["nodes=4", "min_nodes=2", "kubernetes.elastic_pending_timeout_s=600", "kubernetes.pending_timeout_s=600"]
    with pytest.raises(ConfigError) as refused:
        load_profile(path, late)
    line = str(refused.value)
    assert "kubernetes.elastic_pending_timeout_s=600 is not shorter than kubernetes.pending_timeout_s=600" in line
    assert "\n" not in line
    assert load_profile(path, ["nodes=4", *late[2:]]).min_nodes is None  # not elastic: the order does not matter
    assert load_profile(path, [*late[:3], "kubernetes.pending_timeout_s=601"]).min_nodes == 2
