"""Pods Kubernetes refuses to create: the Job controller's `FailedCreate` events in the pending reason.

Against the API emulator (kmock, `tests/k8s_emulator.py`), which has no controllers: each test injects the core/v1
Event the Job controller would record (`Error creating: pods "…" is forbidden: …`) and checks the one line the
backend's poll, the scheduler and `cona status` give, whether the attempt is stuck (failed past
`kubernetes.pending_timeout_s`) or waits, and that a Role without `list` on events changes nothing but one notice.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
import uuid
from pathlib import Path

import pytest
import yaml
from cona.orchestrator.backends.base import Attempt, AttemptStatus
from cona.orchestrator.backends.kubernetes import backend as backend_module
from cona.orchestrator.backends.kubernetes.backend import KubernetesBackend
from cona.orchestrator.backends.kubernetes.events import ORCHESTRATOR_FIELDS, explain_refusal, trainer_fields
from cona.orchestrator.backends.kubernetes.remote import remote_status, submit
from cona.orchestrator.job import load_job
from cona.orchestrator.live import LiveView
from cona.orchestrator.runstate import create_run, read_events, read_state
from cona.orchestrator.scheduler import RunFailed, Scheduler
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy
from kubernetes import client

from tests.conftest import EXAMPLES, REPO
from tests.test_k8s_backend import _profile
from tests.test_k8s_submit_unit import _objects, namespace_objects

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),  # inside kmock
]

NS = "cona"
TWO_NODES = Strategy.parse("dp=2,tp=8,pp=1,mbs=1,gbs=16")  # 2 pods of 8 GPUs
NO_PRIORITY = 'Error creating: pods "exp1-a1-0-" is forbidden: no PriorityClass with name high was found'
QUOTA_USED_UP = ('Error creating: pods "exp1-a1-1-" is forbidden: exceeded quota: gpu-quota, requested: '
                 "requests.nvidia.com/gpu=8, used: requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=16")  # fmt: skip
HEAD = "pods of Job exp1-a1 cannot be created (FailedCreate)"
PRIORITY_LINE = (f"{HEAD}: no PriorityClass 'high' in the cluster; set kubernetes.priority_class to one of "
                 "`kubectl get priorityclasses`, or leave it out")  # fmt: skip
QUOTA_LINE = (f"{HEAD}: namespace 'cona''s ResourceQuota 'gpu-quota' is used up (requested requests.nvidia.com/gpu=8, "
              "used requests.nvidia.com/gpu=8, limited requests.nvidia.com/gpu=16); the pods are created once other "
              "pods free it")  # fmt: skip


def _iso(when: float) -> str:
    return datetime.datetime.fromtimestamp(when, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def add_event(k8s, involved: str, message: str, *, kind: str = "Job", reason: str = "FailedCreate",
              type_: str = "Warning", seen: float | None = None) -> None:  # fmt: skip
    """Record a core/v1 Event on `kind` `involved`, as the Job controller's recorder does (lastTimestamp, count)."""
    when = _iso(time.time() if seen is None else seen)
    body = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{involved}.{uuid.uuid4().hex[:16]}", "namespace": NS},
        "involvedObject": {"apiVersion": "batch/v1", "kind": kind, "name": involved, "namespace": NS},
        "reason": reason, "message": message, "type": type_, "count": 3,
        "firstTimestamp": when, "lastTimestamp": when, "source": {"component": "job-controller"},
    }  # fmt: skip
    client.CoreV1Api(k8s.api_client("cona-test-controller")).create_namespaced_event(NS, body)


def _backend(k8s, tmp_path: Path, workload: str = "indexed-job") -> tuple[KubernetesBackend, RunDir]:
    mount = tmp_path / "runs"
    run_dir = RunDir(mount / "exp1")
    run_dir.root.mkdir(parents=True, exist_ok=True)
    return KubernetesBackend(run_dir=run_dir, profile=_profile(mount, workload), api_client=k8s.api_client()), run_dir


def _launched_a_while_ago(backend: KubernetesBackend) -> Attempt:
    """An attempt launched `EVENTS_AFTER_S` ago and more: its missing pods are not the controller being slow."""
    attempt = backend.launch(attempt=1, strategy=TWO_NODES)
    return dataclasses.replace(attempt, started_at=attempt.started_at - backend_module.EVENTS_AFTER_S - 1)


def _event_requests(k8s) -> list[str]:
    return [path for method, path in k8s.backend_requests() if method == "GET" and path.endswith("/events")]


# ---- the backend's poll -----------------------------------------------------------------------------------------


def test_a_missing_priority_class_is_the_pending_reason_and_stuck(k8s, tmp_path, capsys):
    backend, run_dir = _backend(k8s, tmp_path)
    attempt = _launched_a_while_ago(backend)
    assert backend.poll(attempt).detail == "no pods yet"
    add_event(k8s, "exp1-a1", NO_PRIORITY)
    backend._events_cache = None  # the poll above read no event; the next one need not wait EVENTS_EVERY_S
    outcome = backend.poll(attempt)
    assert (outcome.status, outcome.detail, outcome.stuck) == (AttemptStatus.PENDING, PRIORITY_LINE, True)
    assert backend.poll(attempt).detail == PRIORITY_LINE
    # Said once per attempt, in events.jsonl, which the run's console prints (the backend prints nothing itself).
    said = [e for e in read_events(run_dir) if e["event"] == "pods-not-created"]
    assert [(e["attempt"], e["detail"], e["stuck"]) for e in said] == [(1, PRIORITY_LINE, True)]
    assert capsys.readouterr() == ("", "")
    view = LiveView(run_dir=run_dir, job=backend.job, quiet=True)
    view._print_events()
    assert capsys.readouterr().out == f"cona: pods-not-created: attempt 1, stuck=true: {PRIORITY_LINE}\n"


def test_an_orchestrator_that_restarted_does_not_log_the_refusal_again(k8s, tmp_path):
    """A new orchestrator process (the pod restarted) adopts the attempt: what its predecessor logged to
    events.jsonl is not logged a second time; a new line for the attempt is."""
    backend, run_dir = _backend(k8s, tmp_path)
    attempt = _launched_a_while_ago(backend)
    add_event(k8s, "exp1-a1", NO_PRIORITY)
    assert backend.poll(attempt).detail == PRIORITY_LINE
    successor, _ = _backend(k8s, tmp_path)
    assert successor.poll(attempt).detail == PRIORITY_LINE
    said = [e for e in read_events(run_dir) if e["event"] == "pods-not-created"]
    assert [(e["attempt"], e["detail"]) for e in said] == [(1, PRIORITY_LINE)]
    add_event(k8s, "exp1-a1", QUOTA_USED_UP, seen=time.time() + 1)
    third, _ = _backend(k8s, tmp_path)
    assert third.poll(attempt).detail == QUOTA_LINE
    said = [e for e in read_events(run_dir) if e["event"] == "pods-not-created"]
    assert [(e["attempt"], e["detail"]) for e in said] == [(1, PRIORITY_LINE), (1, QUOTA_LINE)]


def test_an_exceeded_quota_names_the_namespaces_resourcequota_and_waits(k8s, tmp_path):
    backend, _ = _backend(k8s, tmp_path)
    attempt = _launched_a_while_ago(backend)
    add_event(k8s, "exp1-a1", QUOTA_USED_UP)
    outcome = backend.poll(attempt)
    # Capacity, as an unschedulable pod: the quota frees as other pods end, and the Job controller retries.
    assert (outcome.status, outcome.detail, outcome.stuck) == (AttemptStatus.PENDING, QUOTA_LINE, False)


@pytest.mark.parametrize(("used", "limited"), [(0, 4), (8, 8)])
def test_a_quota_smaller_than_the_attempts_pods_together_is_stuck_and_names_the_field(k8s, tmp_path, used, limited):
    """Smaller than one pod (4 GPUs for 8), or than both pods (8 for 16) while pod 0 holds its 8: pod 1 would wait
    for pod 0, which waits for pod 1 at the rendezvous. Waiting cannot help."""
    backend, _ = _backend(k8s, tmp_path)
    attempt = _launched_a_while_ago(backend)
    add_event(k8s, "exp1-a1", 'Error creating: pods "exp1-a1-1-" is forbidden: exceeded quota: gpu-quota, requested: '
              f"requests.nvidia.com/gpu=8, used: requests.nvidia.com/gpu={used}, limited: requests.nvidia.com/gpu={limited}")  # fmt: skip
    outcome = backend.poll(attempt)
    assert outcome.stuck and outcome.detail == (
        f"{HEAD}: the 2 pods, which must run together, ask for more than namespace 'cona''s ResourceQuota 'gpu-quota' "
        f"allows in all (each requested requests.nvidia.com/gpu=8, limited requests.nvidia.com/gpu={limited}); ask the "
        "cluster's admin to raise it, or ask less per pod (gpus_per_node)"
    )


def test_a_403_on_events_is_said_once_and_the_poll_says_what_it_said_before(k8s, tmp_path, capsys):
    backend, run_dir = _backend(k8s, tmp_path)
    attempt = _launched_a_while_ago(backend)
    add_event(k8s, "exp1-a1", NO_PRIORITY)
    k8s.refuse("get", "", "v1", "events", status=403, message='events is forbidden: User "system:serviceaccount:cona:cona" cannot list resource "events"')  # fmt: skip
    for _ in range(3):
        backend._events_cache = None
        outcome = backend.poll(attempt)
        assert (outcome.status, outcome.detail, outcome.stuck) == (AttemptStatus.PENDING, "no pods yet", False)
    assert len(_event_requests(k8s)) == 1  # not asked again by this orchestrator
    err = capsys.readouterr().err
    assert err == ("cona: warning: kubernetes: list events in namespace 'cona' refused (403): the Role lacks list on "
                   "events; apply manifests/rbac.yaml, until then a pod that cannot be created shows only as "
                   "missing\n")  # fmt: skip
    assert not [e for e in read_events(run_dir) if e["event"] == "pods-not-created"]


def test_events_are_not_read_soon_after_launch_nor_at_every_poll(k8s, tmp_path):
    backend, _ = _backend(k8s, tmp_path)
    fresh = backend.launch(attempt=1, strategy=TWO_NODES)
    add_event(k8s, "exp1-a1", NO_PRIORITY)
    assert backend.poll(fresh).detail == "no pods yet"  # the Job controller may not have acted yet
    assert _event_requests(k8s) == []
    old = dataclasses.replace(fresh, started_at=fresh.started_at - backend_module.EVENTS_AFTER_S - 1)
    assert [backend.poll(old).detail for _ in range(3)] == [PRIORITY_LINE] * 3
    assert _event_requests(k8s) == [f"/api/v1/namespaces/{NS}/events"]  # once per EVENTS_EVERY_S


def test_events_of_other_objects_other_reasons_and_before_the_attempt_are_left_out(k8s, tmp_path):
    """The emulator ignores field selectors, as a server may: the backend filters the events itself."""
    backend, _ = _backend(k8s, tmp_path)
    attempt = _launched_a_while_ago(backend)
    add_event(k8s, "exp1-a2", NO_PRIORITY)  # another attempt's Job
    add_event(k8s, "exp1-a1", NO_PRIORITY, kind="Pod")
    add_event(k8s, "exp1-a1", "Created pod: exp1-a1-0-abcde", reason="SuccessfulCreate", type_="Normal")
    add_event(k8s, "exp1-a1", "Job has reached the specified backoff limit", reason="BackoffLimitExceeded")
    add_event(k8s, "exp1-a1", NO_PRIORITY, seen=attempt.started_at - 3600)  # a run of that name an hour ago
    assert backend.poll(attempt).detail == "no pods yet"
    # The newest of several refusals is the one shown.
    add_event(k8s, "exp1-a1", QUOTA_USED_UP, seen=time.time() - 30)
    add_event(k8s, "exp1-a1", NO_PRIORITY, seen=time.time() - 5)
    backend._events_cache = None
    assert backend.poll(attempt).detail == PRIORITY_LINE


@pytest.mark.parametrize("pod_state", ["running", "image"])
def test_fewer_pods_than_the_strategy_places_are_pending_with_the_refusal(k8s, tmp_path, profile_image, pod_state):
    """The quota let pod 0 in, not pod 1: the attempt does not run (pod 0 waits at the rendezvous), it is pending,
    with the quota's line; unless pod 0 waits for an image that cannot be pulled, which is stuck and named first."""
    backend, _ = _backend(k8s, tmp_path)
    attempt = _launched_a_while_ago(backend)
    state = {"phase": "Running"} if pod_state == "running" else {
        "phase": "Pending", "container_waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}  # fmt: skip
    pods = k8s.make_pods("exp1-a1", NS, **state)
    client.CoreV1Api(k8s.api_client("cona-test-controller")).delete_namespaced_pod(pods[1], NS)
    if pod_state == "running":
        assert backend.poll(attempt).status is AttemptStatus.RUNNING  # no event: nothing says the pod was refused
        backend._events_cache = None
    add_event(k8s, "exp1-a1", QUOTA_USED_UP)
    outcome = backend.poll(attempt)
    expected = (QUOTA_LINE, False) if pod_state == "running" else (
        f"image {profile_image} cannot be pulled (ImagePullBackOff: Back-off pulling image)", True)  # fmt: skip
    assert (outcome.status, outcome.detail, outcome.stuck) == (AttemptStatus.PENDING, *expected)


@pytest.fixture
def profile_image(tmp_path) -> str:
    return _profile(tmp_path).kubernetes.image


def test_another_error_on_events_is_said_once_and_the_poll_goes_on(k8s, tmp_path, capsys):
    backend, _ = _backend(k8s, tmp_path)
    attempt = _launched_a_while_ago(backend)
    k8s.refuse("get", "", "v1", "events", status=500, message="etcdserver: request timed out")
    for _ in range(3):
        backend._events_cache = None
        assert backend.poll(attempt).detail == "no pods yet"
    assert len(_event_requests(k8s)) == 3  # asked again: it may pass
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cona: warning: kubernetes: list events 'of Job exp1-a1' in "
                                                    "namespace 'cona': failed (500")  # fmt: skip
    assert err.endswith("a pod that cannot be created shows only as missing\n") and "Traceback" not in err
    namespace_objects(k8s)
    submit(_objects(), api_client=k8s.api_client())
    assert remote_status("tiny-1", namespace=NS, api_client=k8s.api_client())["orchestrator"] == (
        "Job tiny-1-orch: no pod yet")  # fmt: skip


@pytest.mark.parametrize("workload", ["jobset", "trainjob"])
def test_a_jobsets_pods_are_explained_by_its_child_jobs_events(k8s, tmp_path, workload):
    backend, _ = _backend(k8s, tmp_path, workload)
    attempt = _launched_a_while_ago(backend)
    add_event(k8s, "exp1-a1-node-0", NO_PRIORITY.replace("exp1-a1-0-", "exp1-a1-node-0-0-"))
    outcome = backend.poll(attempt)
    assert outcome.status is AttemptStatus.PENDING and outcome.stuck
    assert outcome.detail == PRIORITY_LINE.replace("Job exp1-a1 ", "Job exp1-a1-node-0 ")


def test_a_persistent_failed_create_fails_the_run_past_the_pending_timeout(k8s, tmp_path, monkeypatch):
    """The same rule as an image that cannot be pulled, applied by the same place (`Scheduler._note_pending`)."""
    monkeypatch.setattr(backend_module, "EVENTS_AFTER_S", 0.0)
    mount = tmp_path / "runs"
    profile = _profile(mount)
    profile = profile.model_copy(update={"kubernetes": profile.kubernetes.model_copy(update={"pending_timeout_s": 0.3})})
    job = load_job(EXAMPLES / "tiny-gpt.yaml", [f"data.path={EXAMPLES / 'tiny-gpt.yaml'}"])
    run_dir = RunDir(mount / "exp1")
    create_run(run_dir=run_dir, profile=profile, job=job)
    backend = KubernetesBackend(run_dir=run_dir, profile=profile, job=job, api_client=k8s.api_client())
    add_event(k8s, "exp1-a1", NO_PRIORITY)
    sched = Scheduler(run_dir=run_dir, profile=profile, job=job, backend=backend, poll_interval_s=0.02)
    with pytest.raises(RunFailed) as info:
        sched.run()
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"attempt 1 could not start: {PRIORITY_LINE}; pending ")
    assert read_state(run_dir).reason.startswith(f"attempt 1 could not start: {PRIORITY_LINE}; pending ")
    timeouts = [e for e in read_events(run_dir) if e["event"] == "pending-timeout"]
    assert [(e["action"], e["detail"]) for e in timeouts] == [("fail", PRIORITY_LINE)]
    assert ("DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/exp1-a1") in k8s.backend_requests()


# ---- `cona status`: the orchestrator Job without its pod --------------------------------------------------------


def test_cona_status_says_why_the_orchestrator_job_has_no_pod(k8s):
    namespace_objects(k8s)
    submit(_objects(), api_client=k8s.api_client())
    assert remote_status("tiny-1", namespace=NS, api_client=k8s.api_client())["orchestrator"] == (
        "Job tiny-1-orch: no pod yet")  # fmt: skip
    add_event(k8s, "tiny-1-orch", 'Error creating: pods "tiny-1-orch-" is forbidden: exceeded quota: q, requested: '
              "requests.memory=2Gi, used: requests.memory=0, limited: requests.memory=1Gi")  # fmt: skip
    status = remote_status("tiny-1", namespace=NS, api_client=k8s.api_client())
    assert status["orchestrator"] == (
        "Job tiny-1-orch: no pod yet; pods of Job tiny-1-orch cannot be created (FailedCreate): one pod asks for more "
        "than namespace 'cona''s ResourceQuota 'q' allows in all (requested requests.memory=2Gi, limited "
        "requests.memory=1Gi); ask the cluster's admin to raise it, or ask less per pod (kubernetes.orchestrator_memory)"
    )


def test_cona_status_with_a_role_that_cannot_list_events_says_what_it_said_before(k8s, capsys):
    namespace_objects(k8s)
    submit(_objects(), api_client=k8s.api_client())
    add_event(k8s, "tiny-1-orch", NO_PRIORITY)
    k8s.refuse("get", "", "v1", "events", status=403, message="events is forbidden")
    status = remote_status("tiny-1", namespace=NS, api_client=k8s.api_client())
    assert status["orchestrator"] == "Job tiny-1-orch: no pod yet"
    assert capsys.readouterr().err == ""


# ---- the one line of each refusal ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "stuck", "says"),
    [
        ('pods "x-0-" is forbidden: error looking up service account cona/trainer: serviceaccount "trainer" not found',
         True, "no ServiceAccount 'trainer' in namespace 'cona'; create it (`kubectl apply -k manifests/` creates cona) "
               "or set kubernetes.service_account to one that exists"),
        ('pods "x-0-" is forbidden: failed quota: compute: must specify requests.cpu,requests.memory', True,
         "namespace 'cona''s ResourceQuota 'compute' wants every pod to set requests.cpu,requests.memory; set "
         "kubernetes.trainer_cpu, kubernetes.trainer_memory"),
        ('pods "x-0-" is forbidden: failed quota: compute: must specify limits.cpu,limits.memory', True,
         "namespace 'cona''s ResourceQuota 'compute' wants every pod to set limits.cpu,limits.memory; set "
         "kubernetes.trainer_memory; no profile field sets limits.cpu: ask the cluster's admin"),
        ('pods "x-0-" is forbidden: violates PodSecurity "baseline:latest": privileged (container "c")', True,
         "namespace 'cona''s Pod Security admission (baseline:latest) refuses them: privileged (container \"c\"); run "
         "in a namespace whose pod-security.kubernetes.io/enforce level admits them"),
        ('admission webhook "policy.example.com" denied the request: GPUs need the team label', True,
         'admission webhook "policy.example.com" denied the request: GPUs need the team label'),
        ('Internal error occurred: failed calling webhook "w.example.com": context deadline exceeded', False,
         'Internal error occurred: failed calling webhook "w.example.com": context deadline exceeded'),
    ],
)  # fmt: skip
def test_each_refusal_is_one_line_naming_what_to_fix(message, stuck, says):
    line, is_stuck, _ = explain_refusal(f"Error creating: {message}", creator="Job x", namespace=NS, fields=trainer_fields("nvidia.com/gpu"))
    assert (line, is_stuck) == (f"pods of Job x cannot be created (FailedCreate): {says}", stuck)
    assert "\n" not in line


def test_the_orchestrator_pods_quota_fields_are_its_own():
    line, stuck, _ = explain_refusal("exceeded quota: q, requested: requests.cpu=1, used: requests.cpu=0, limited: requests.cpu=500m",
                          creator="Job r-orch", namespace=NS, fields=ORCHESTRATOR_FIELDS)  # fmt: skip
    assert stuck and line.endswith("ask less per pod (kubernetes.orchestrator_cpu)")


# ---- RBAC -------------------------------------------------------------------------------------------------------


def test_both_roles_grant_list_on_events_and_nothing_more_of_them():
    for doc in yaml.safe_load_all((REPO / "manifests" / "rbac.yaml").read_text()):
        if doc and doc["kind"] == "Role":
            verbs = {v for rule in doc["rules"] if "events" in rule["resources"] and "" in rule["apiGroups"]
                     for v in rule["verbs"]}  # fmt: skip
            assert verbs == {"list"}, doc["metadata"]["name"]
