"""The Kubernetes backend against the API emulator (kmock, `tests/k8s_emulator.py`): launch, poll, cancel, errors,
for each workload kind (Indexed Job, JobSet, TrainJob).

The emulator has no controllers, so each test plays the Job, JobSet or Trainer controller and the kubelet itself
(`k8s.make_pods`, `k8s.set_status`). No cluster, no network, no torch.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cona.orchestrator.backends.base import Attempt, AttemptStatus, BackendError
from cona.orchestrator.backends.kubernetes.backend import KubernetesBackend
from cona.orchestrator.backends.kubernetes.render import render_attempt
from cona.orchestrator.job import load_job
from cona.orchestrator.live import status_summary
from cona.orchestrator.profile import ClusterProfile, load_profile
from cona.orchestrator.runstate import create_run, read_events, read_state
from cona.orchestrator.scheduler import RunFailed, Scheduler
from cona.protocol.rundir import ExitCode, ExitRecord, RunDir
from cona.protocol.strategy import Strategy
from kubernetes import client

from tests.conftest import EXAMPLES, REPO

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),  # inside kmock
]

K8S_PROFILE = REPO / "manifests" / "profiles" / "h100-k8s.yaml"
NS = "cona"
TWO_NODES = Strategy.parse("dp=2,tp=8,pp=1,mbs=1,gbs=16")  # 16 processes: 2 pods of 8 GPUs
INSUFFICIENT = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu. preemption: 0/4 nodes are available"


def _profile(mount: Path, workload: str = "indexed-job") -> ClusterProfile:
    profile = load_profile(K8S_PROFILE)
    spec = profile.kubernetes.model_copy(update={"mount_path": str(mount), "workload": workload})
    return profile.model_copy(update={"kubernetes": spec})


@pytest.fixture
def setup(k8s, tmp_path):
    """(backend, run dir, profile) for a run `exp1` on the PVC mounted at tmp_path/runs."""
    mount = tmp_path / "runs"
    run_dir = RunDir(mount / "exp1")
    run_dir.root.mkdir(parents=True)
    profile = _profile(mount)
    backend = KubernetesBackend(run_dir=run_dir, profile=profile, api_client=k8s.api_client())
    return backend, run_dir, profile


def _setup(k8s, tmp_path: Path, workload: str) -> tuple[KubernetesBackend, RunDir, ClusterProfile]:
    mount = tmp_path / "runs"
    run_dir = RunDir(mount / "exp1")
    run_dir.root.mkdir(parents=True, exist_ok=True)
    profile = _profile(mount, workload)
    return KubernetesBackend(run_dir=run_dir, profile=profile, api_client=k8s.api_client()), run_dir, profile


CUSTOM = {  # workload: (API path prefix, its kind, success condition, the trainer container)
    "jobset": (f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets", "JobSet", "Completed", "trainer"),
    "trainjob": (f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NS}/trainjobs", "TrainJob", "Complete", "node"),
}


def _launch(backend: KubernetesBackend, attempt: int = 1) -> Attempt:
    return backend.launch(attempt=attempt, strategy=TWO_NODES)


def _record(run_dir: RunDir, attempt: int, code: int) -> None:
    run_dir.write_exit(attempt, ExitRecord(exit_code=code, name=ExitCode(code).name, reason="test", step=3,
                                           time=time.time()))  # fmt: skip


def test_launch_creates_the_rendered_service_and_job(k8s, setup):
    backend, run_dir, profile = setup
    attempt = _launch(backend)
    service, job = render_attempt(profile=profile, strategy=TWO_NODES, attempt=1, run_dir=str(run_dir.root))
    assert attempt.backend_id == job["metadata"]["name"] == "exp1-a1"
    assert attempt.extra == {"namespace": NS, "service": "exp1-a1"}
    sanitize = client.ApiClient().sanitize_for_serialization
    api = k8s.api_client("reader")
    got_service = sanitize(client.CoreV1Api(api).read_namespaced_service("exp1-a1", NS))
    got_job = sanitize(client.BatchV1Api(api).read_namespaced_job("exp1-a1", NS))
    assert got_service["spec"] == service["spec"] and got_service["metadata"]["labels"] == service["metadata"]["labels"]
    assert got_job["spec"] == job["spec"]
    assert got_job["metadata"]["annotations"] == job["metadata"]["annotations"]
    # The launch record is on the PVC before the Job exists, with the objects' names.
    launch = json.loads((run_dir.attempt_dir(1) / "launch.json").read_text())
    assert launch["backend"] == "kubernetes" and Strategy.from_dict(launch["strategy"]) == TWO_NODES
    assert (launch["namespace"], launch["job_name"], launch["service"]) == (NS, "exp1-a1", "exp1-a1")
    assert k8s.backend_requests() == [
        ("POST", f"/api/v1/namespaces/{NS}/services"),
        ("POST", f"/apis/batch/v1/namespaces/{NS}/jobs"),
    ]


@pytest.mark.parametrize(
    ("codes", "reason", "status", "code"),
    [
        ([42, 1], "PodFailurePolicy", AttemptStatus.SWITCHED, 42),
        ([43, 43], "PodFailurePolicy", AttemptStatus.STOPPED, 43),
        ([44, 1], "PodFailurePolicy", AttemptStatus.BAD_WORLD, 44),
        ([1, 0], "BackoffLimitExceeded", AttemptStatus.CRASHED, 1),
    ],
)
def test_poll_maps_a_failed_job_by_the_trainers_exit_code(k8s, setup, codes, reason, status, code):
    backend, _, _ = setup
    attempt = _launch(backend)
    k8s.make_pods("exp1-a1", NS, phase="Failed", exit_codes=codes)
    k8s.set_job_status("exp1-a1", NS, conditions=[{"type": "Failed", "status": "True", "reason": reason,
                                                   "message": "Job has reached the specified backoff limit"}])  # fmt: skip
    outcome = backend.poll(attempt)
    assert (outcome.status, outcome.exit_code) == (status, code)
    if status is AttemptStatus.CRASHED:
        assert reason in outcome.detail and "exit code 1" in outcome.detail and "\n" not in outcome.detail
        # Which rank died of what: its own crash record on the shared volume (`Backend.with_crash_cause`).
        from cona.protocol.rundir import CrashRecord

        backend.run_dir.write_crash(1, CrashRecord(1, "ValueError: injected on one rank", 1.0))
        said = backend.poll(attempt).detail
        assert said == f"{outcome.detail}: rank 1: ValueError: injected on one rank", said


def test_poll_complete_is_done_and_prefers_the_trainers_exit_record(k8s, setup):
    backend, run_dir, _ = setup
    attempt = _launch(backend)
    k8s.make_pods("exp1-a1", NS, phase="Succeeded", exit_codes=[0, 0])
    k8s.set_job_status("exp1-a1", NS, conditions=[{"type": "Complete", "status": "True"}], succeeded=2)
    outcome = backend.poll(attempt)
    assert (outcome.status, outcome.exit_code) == (AttemptStatus.DONE, 0)

    # torchrun exits 1 whatever its workers returned: rank 0's exit record says what happened.
    second = _launch(backend, attempt=2)
    k8s.make_pods("exp1-a2", NS, phase="Failed", exit_codes=[1, 1])
    k8s.set_job_status("exp1-a2", NS, conditions=[{"type": "Failed", "status": "True",
                                                   "reason": "BackoffLimitExceeded"}])  # fmt: skip
    _record(run_dir, 2, int(ExitCode.SWITCH))
    outcome = backend.poll(second)
    assert (outcome.status, outcome.exit_code) == (AttemptStatus.SWITCHED, 42)


def test_poll_pending_running_and_a_missing_job(k8s, setup):
    backend, _, profile = setup
    attempt = _launch(backend)
    assert backend.poll(attempt).status is AttemptStatus.PENDING  # no pods yet
    unschedulable = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": INSUFFICIENT}]
    k8s.make_pods("exp1-a1", NS, phase="Pending", conditions=unschedulable)
    outcome = backend.poll(attempt)
    assert (outcome.status, outcome.detail) == (AttemptStatus.PENDING, INSUFFICIENT)

    assert not outcome.stuck  # a queue: capacity may come

    second = _launch(backend, attempt=2)
    k8s.make_pods("exp1-a2", NS, phase="Pending", container_waiting={"reason": "ImagePullBackOff",
                                                                      "message": "Back-off pulling image"})  # fmt: skip
    outcome = backend.poll(second)
    assert (outcome.status, outcome.detail) == (
        AttemptStatus.PENDING, f"image {profile.kubernetes.image} cannot be pulled (ImagePullBackOff: Back-off pulling image)")  # fmt: skip
    assert outcome.stuck

    third = _launch(backend, attempt=3)
    k8s.make_pods("exp1-a3", NS, phase="Running")
    assert backend.poll(third).status is AttemptStatus.RUNNING

    gone = Attempt(number=9, strategy=TWO_NODES, backend_id="exp1-a9")
    outcome = backend.poll(gone)
    assert (outcome.status, outcome.detail) == (AttemptStatus.CRASHED, "the Job is gone")


@pytest.mark.parametrize(
    ("waiting", "stuck"),
    [
        ("ErrImagePull", True), ("InvalidImageName", True), ("CreateContainerConfigError", True),
        ("ContainerCreating", False), ("PodInitializing", False),
    ],
)  # fmt: skip
def test_a_pending_pod_is_stuck_only_for_reasons_waiting_does_not_fix(k8s, setup, waiting, stuck):
    backend, _, _ = setup
    attempt = _launch(backend)
    k8s.make_pods("exp1-a1", NS, phase="Pending", container_waiting={"reason": waiting, "message": "why"})
    outcome = backend.poll(attempt)
    assert outcome.status is AttemptStatus.PENDING and outcome.stuck is stuck
    assert f"{waiting}: why" in outcome.detail and "\n" not in outcome.detail


def test_a_stuck_pod_names_the_attempts_pending_reason_whatever_its_index():
    """Pod 0 waits for a GPU, pod 1 for an image that cannot be pulled: the image is what must be fixed."""
    def pod(name: str, **status) -> client.V1Pod:
        return client.V1Pod(metadata=client.V1ObjectMeta(name=name), status=client.V1PodStatus(phase="Pending", **status))

    unschedulable = pod("p0", conditions=[client.V1PodCondition(type="PodScheduled", status="False", message=INSUFFICIENT)])
    waiting = client.V1ContainerState(waiting=client.V1ContainerStateWaiting(reason="InvalidImageName", message="bad"))
    bad_image = pod("p1", container_statuses=[client.V1ContainerStatus(
        name="trainer", image="Not/An:Image:", image_id="", ready=False, restart_count=0, state=waiting)])  # fmt: skip
    assert KubernetesBackend._pending([unschedulable, bad_image]) == (
        "image Not/An:Image: cannot be pulled (InvalidImageName: bad)", True)  # fmt: skip
    assert KubernetesBackend._pending([unschedulable, pod("p2")]) == (INSUFFICIENT, False)


DISRUPTION = [{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler",
               "message": "preempted by a higher-priority pod"}]  # fmt: skip


def test_a_disrupted_pod_disrupts_the_attempt_and_deletes_its_job(k8s, setup):
    backend, _, _ = setup
    attempt = _launch(backend)
    pods = k8s.make_pods("exp1-a1", NS, phase="Running", conditions=DISRUPTION, node_name="gpu-n3")
    outcome = backend.poll(attempt)
    assert outcome.status is AttemptStatus.DISRUPTED
    assert outcome.detail == f"pod {pods[0]} on node gpu-n3: PreemptionByScheduler (preempted by a higher-priority pod)"
    assert ("DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/exp1-a1") in k8s.backend_requests()
    assert backend.poll(attempt).detail == "the Job is gone"


def test_a_disruption_outranks_the_job_failure_it_caused_but_not_the_trainers_exit_record(k8s, setup):
    """Pod 1 evicted: torchrun in pod 0 loses its peer and exits 1, so the Job fails too; the root cause is the
    disruption. A trainer that recorded its exit (here a stop after a checkpoint) says what happened."""
    backend, run_dir, _ = setup
    attempt = _launch(backend)
    k8s.make_pods("exp1-a1", NS, phase="Failed", exit_codes=[1, 137], conditions=DISRUPTION)
    k8s.set_job_status("exp1-a1", NS, conditions=[{"type": "Failed", "status": "True",
                                                   "reason": "BackoffLimitExceeded"}])  # fmt: skip
    outcome = backend.poll(attempt)
    assert outcome.status is AttemptStatus.DISRUPTED and "PreemptionByScheduler" in outcome.detail
    _record(run_dir, 1, int(ExitCode.STOPPED))
    assert backend.poll(attempt).status is AttemptStatus.STOPPED


# --- the scheduler's pending timeout on the backend's view of the pods ------------------------------------------------


def _scheduler(k8s, tmp_path, pods, *, timeout_s: float, complete_after: int | None = None) -> tuple[Scheduler, list]:
    """The real scheduler loop on the backend, `kubernetes.pending_timeout_s` = `timeout_s`. The test plays the
    cluster from the loop's update hook: the attempt's pods are made with `pods` (make_pods' keywords) at the
    first update; with `complete_after`, the Job completes that many updates after the `pending-timeout` event.
    Also returns the `cona status` summaries taken after that event."""
    mount = tmp_path / "runs"
    profile = _profile(mount)
    spec = profile.kubernetes.model_copy(update={"pending_timeout_s": timeout_s})
    profile = profile.model_copy(update={"kubernetes": spec})
    job = load_job(EXAMPLES / "tiny-gpt.yaml", [f"data.path={EXAMPLES / 'tiny-gpt.yaml'}"])
    run_dir = RunDir(mount / "exp1")
    create_run(run_dir=run_dir, profile=profile, job=job)
    backend = KubernetesBackend(run_dir=run_dir, profile=profile, job=job, api_client=k8s.api_client())
    after: list[dict] = []
    made: list[str] = []

    def script(live) -> None:
        name = sched.current.backend_id
        if not made:
            made.append(name)
            k8s.make_pods(name, NS, **pods)
        if any(e["event"] == "pending-timeout" for e in read_events(run_dir)):
            after.append(status_summary(run_dir))
            if len(after) == complete_after:
                k8s.set_job_status(name, NS, conditions=[{"type": "Complete", "status": "True"}], succeeded=2)

    sched = Scheduler(run_dir=run_dir, profile=profile, job=job, backend=backend, poll_interval_s=0.02,
                      on_update=script)  # fmt: skip
    return sched, after


def test_a_pod_whose_image_cannot_be_pulled_fails_the_run_past_the_pending_timeout(k8s, tmp_path, monkeypatch):
    waiting = {"reason": "ErrImagePull", "message": 'failed to pull image "ghcr.io/x:y": not found'}
    sched, _ = _scheduler(k8s, tmp_path, {"phase": "Pending", "container_waiting": waiting}, timeout_s=0.3)
    with pytest.raises(RunFailed) as info:
        sched.run()
    message = str(info.value)
    image = sched.profile.kubernetes.image
    why = 'ErrImagePull: failed to pull image "ghcr.io/x:y": not found'
    expected = f"attempt 1 could not start: image {image} cannot be pulled ({why}); pending "
    assert "\n" not in message and message.startswith(expected)
    # What resumes it with a fixed image: `cona run` drove it here; a submitted run's orchestrator names its run.
    fix = f"; once fixed, `cona run --resume {sched.run_dir.root} --profile-set kubernetes.image=IMAGE`; logs: "
    assert fix in message, message
    monkeypatch.setenv("CONA_OWNER_JOB", "exp1-orch")
    assert sched.backend.resume_hint(message) == (f"`cona submit --resume {sched.run_dir.root.name} --namespace {NS} "
                                                  "--profile-set kubernetes.image=IMAGE`")  # fmt: skip
    state = read_state(sched.run_dir)
    assert state.status == "failed" and state.reason.startswith(expected)
    timeouts = [e for e in read_events(sched.run_dir) if e["event"] == "pending-timeout"]
    assert [(e["action"], e["timeout_s"]) for e in timeouts] == [("fail", 0.3)]
    # The Job and its Service are deleted, and no second attempt was launched.
    assert ("DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/exp1-a1") in k8s.backend_requests()
    assert [p for m, p in k8s.backend_requests() if m == "POST" and p.endswith("/jobs")] == [
        f"/apis/batch/v1/namespaces/{NS}/jobs"]  # fmt: skip


def test_an_unschedulable_pod_past_the_pending_timeout_is_reported_once_and_waits(k8s, tmp_path):
    unschedulable = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": INSUFFICIENT}]
    sched, after = _scheduler(k8s, tmp_path, {"phase": "Pending", "conditions": unschedulable}, timeout_s=0.3,
                              complete_after=5)  # fmt: skip
    assert sched.run().status == "done"
    timeouts = [e for e in read_events(sched.run_dir) if e["event"] == "pending-timeout"]
    assert [(e["detail"], e["action"]) for e in timeouts] == [(INSUFFICIENT, "wait")]
    assert after[0]["pending"]["detail"] == INSUFFICIENT and after[0]["pending"]["timed_out"]
    assert after[0]["pending"]["for_s"] >= 0.3
    # Waited: nothing cancelled while pending; the attempt's objects are deleted once, when it has ended (released).
    requests = k8s.backend_requests()
    deletes = [i for i, (method, _) in enumerate(requests) if method == "DELETE"]
    assert [requests[i][1] for i in deletes] == [f"/apis/batch/v1/namespaces/{NS}/jobs/exp1-a1",
                                                 f"/api/v1/namespaces/{NS}/services/exp1-a1"]  # fmt: skip
    assert ("GET", f"/api/v1/namespaces/{NS}/pods/exp1-a1-0-abcde/log") in requests[: deletes[0]]


@pytest.mark.parametrize("workload", ["indexed-job", "jobset"])
def test_runs_whose_directories_differ_only_in_case_hold_their_own_lease_and_workloads(k8s, tmp_path, workload):
    """`runs/Exp1` and `runs/exp1` on one PVC: each run takes its own Lease and creates its own attempt objects, and
    cancelling one's attempt leaves the other's running (their names were one lower-cased name)."""
    mount = tmp_path / "runs"
    profile = _profile(mount, workload)
    backends = {}
    for run in ("exp1", "Exp1"):
        run_dir = RunDir(mount / run)
        run_dir.root.mkdir(parents=True)
        backends[run] = KubernetesBackend(run_dir=run_dir, profile=profile, api_client=k8s.api_client())
    leases = [backend.exclusion() for backend in backends.values()]
    assert leases[0].name == "exp1" and re.fullmatch(r"exp1-[0-9a-f]{8}", leases[1].name)
    for lease in leases:
        lease.wait_s = 1.0  # the same name would wait for the other's Lease, then fail
        lease.acquire()
    try:
        attempts = {run: _launch(backend) for run, backend in backends.items()}
        assert attempts["exp1"].backend_id == "exp1-a1" != attempts["Exp1"].backend_id
        backends["Exp1"].cancel(attempts["Exp1"])
        assert backends["exp1"].poll(attempts["exp1"]).status is AttemptStatus.PENDING  # still there, no pods yet
    finally:
        for lease in leases:
            lease.release()


def test_cancel_deletes_the_job_and_the_service_and_is_idempotent(k8s, setup):
    backend, _, _ = setup
    attempt = _launch(backend)
    backend.cancel(attempt)
    backend.cancel(attempt)
    api = k8s.api_client("reader")
    for read in (client.BatchV1Api(api).read_namespaced_job, client.CoreV1Api(api).read_namespaced_service):
        with pytest.raises(client.ApiException) as info:
            read("exp1-a1", NS)
        assert info.value.status == 404
    deletes = [r for r in k8s.backend_requests() if r[0] == "DELETE"]
    assert deletes == [
        ("DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/exp1-a1"),
        ("DELETE", f"/api/v1/namespaces/{NS}/services/exp1-a1"),
    ] * 2
    body = next(r for r in k8s.requests() if r.method.value.upper() == "DELETE").data
    assert body["propagationPolicy"] == "Foreground"


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (403, "kubernetes: create jobs 'exp1-a1' in namespace 'cona': you (or the service account) lack create on jobs; "
              "apply manifests/rbac.yaml and bind its Role"),
        (409, "kubernetes: create jobs 'exp1-a1' in namespace 'cona': already exists (409); "
              "delete it (kubectl -n cona delete jobs exp1-a1) first"),
        (422, "kubernetes: create jobs 'exp1-a1' in namespace 'cona': rejected as invalid (422): "
              "spec.template.spec.containers[0].image: Required value; check the profile's kubernetes: section"),
    ],
)  # fmt: skip
def test_api_errors_are_one_line_backend_errors(k8s, setup, status, expected):
    backend, _, _ = setup
    k8s.refuse("post", "batch", "v1", "jobs", status=status, message='jobs.batch "exp1-a1" is refused\nsecond line',
               causes=[{"field": "spec.template.spec.containers[0].image", "message": "Required value"}])  # fmt: skip
    with pytest.raises(BackendError) as info:
        _launch(backend)
    assert str(info.value) == expected
    # The Service created before the Job was refused is deleted again.
    assert k8s.backend_requests()[-1] == ("DELETE", f"/api/v1/namespaces/{NS}/services/exp1-a1")


def test_a_body_the_client_refuses_is_a_one_line_backend_error(k8s, setup, monkeypatch):
    backend, _, _ = setup
    real = render_attempt

    def with_int_quantity(**kwargs):
        service, job = real(**kwargs)
        job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu": 8}
        return service, job

    monkeypatch.setattr("cona.orchestrator.backends.kubernetes.backend.render_attempt", with_int_quantity)
    with pytest.raises(BackendError) as info:
        _launch(backend)
    message = str(info.value)
    assert "\n" not in message and message.startswith("kubernetes: create jobs 'exp1-a1' in namespace 'cona': ")
    assert "resources.limits.nvidia.com/gpu: Input should be a valid string" in message


def test_an_unreachable_api_server_is_a_one_line_backend_error(tmp_path):
    configuration = client.Configuration(host="http://127.0.0.1:9")  # discard port: nothing listens
    configuration.retries = 0
    run_dir = RunDir(tmp_path / "runs" / "exp1")
    backend = KubernetesBackend(run_dir=run_dir, profile=_profile(tmp_path / "runs"),
                                api_client=client.ApiClient(configuration))  # fmt: skip
    with pytest.raises(BackendError) as info:
        backend.poll(Attempt(number=1, strategy=TWO_NODES, backend_id="exp1-a1"))
    message = str(info.value)
    assert "\n" not in message and "cannot reach the API server at http://127.0.0.1:9" in message


RBAC_RESOURCES = {"jobs": "batch", "services": "", "pods": ""}


def _granted() -> set[tuple[str, str, str]]:
    role = next(doc for doc in yaml.safe_load_all((REPO / "manifests" / "rbac.yaml").read_text()) if doc["kind"] == "Role")
    return {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}  # fmt: skip


def _verb(method: str, path: str) -> tuple[str, str, str]:
    """(API group, resource, RBAC verb) of a namespaced request path."""
    parts = path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[parts.index("namespaces") + 2 :]
    resource, named = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else ""), len(rest) > 1  # pods/log: a subresource
    verb = {"POST": "create", "DELETE": "delete", "PATCH": "patch", "PUT": "update"}.get(method)
    verb = verb or ("get" if named else "list")
    return group, resource, verb


@pytest.mark.parametrize(
    ("workload", "expected"),
    [
        ("indexed-job", {("", "services", "create"), ("batch", "jobs", "create"), ("batch", "jobs", "get"),
                         ("", "pods", "list"), ("batch", "jobs", "delete"), ("", "services", "delete")}),
        ("jobset", {("jobset.x-k8s.io", "jobsets", "create"), ("jobset.x-k8s.io", "jobsets", "get"),
                    ("", "pods", "list"), ("jobset.x-k8s.io", "jobsets", "delete")}),
        ("trainjob", {("trainer.kubeflow.org", "trainjobs", "create"), ("trainer.kubeflow.org", "trainjobs", "get"),
                      ("", "pods", "list"), ("trainer.kubeflow.org", "trainjobs", "delete")}),
    ],
)  # fmt: skip
def test_every_call_the_backend_makes_is_granted_by_the_role(k8s, tmp_path, workload, expected):
    backend, run_dir, _ = _setup(k8s, tmp_path, workload)
    attempt = _launch(backend)
    backend.poll(attempt)
    k8s.make_pods("exp1-a1", NS, phase="Failed", exit_codes=[43, 43], workload=workload)
    k8s.set_status(workload, "exp1-a1", NS, conditions=[{"type": "Failed", "status": "True", "reason": "PodFailurePolicy"}])
    _record(run_dir, 1, int(ExitCode.STOPPED))
    assert backend.poll(attempt).status is AttemptStatus.STOPPED
    backend.cancel(attempt)
    backend.cancel(attempt)
    used = {_verb(method, path) for method, path in k8s.backend_requests()}
    assert used == expected
    assert used <= _granted()


# ---- JobSet and TrainJob ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("workload", ["jobset", "trainjob"])
def test_launch_creates_the_rendered_custom_object_and_no_service(k8s, tmp_path, workload):
    backend, run_dir, profile = _setup(k8s, tmp_path, workload)
    attempt = _launch(backend)
    (obj,) = render_attempt(profile=profile, strategy=TWO_NODES, attempt=1, run_dir=str(run_dir.root))
    path, kind, _, _ = CUSTOM[workload]
    assert obj["kind"] == kind and attempt.backend_id == obj["metadata"]["name"] == "exp1-a1"
    assert attempt.extra == {"namespace": NS, "workload": workload}
    group, version = obj["apiVersion"].split("/")
    got = client.CustomObjectsApi(k8s.api_client("reader")).get_namespaced_custom_object(
        group, version, NS, path.rsplit("/", 1)[1], "exp1-a1")  # fmt: skip
    assert got["spec"] == obj["spec"] and got["metadata"]["labels"] == obj["metadata"]["labels"]
    launch = json.loads((run_dir.attempt_dir(1) / "launch.json").read_text())
    assert (launch["namespace"], launch["job_name"], launch["workload"]) == (NS, "exp1-a1", workload)
    assert "service" not in launch
    assert k8s.backend_requests() == [("POST", path)]


@pytest.mark.parametrize("workload", ["jobset", "trainjob"])
def test_poll_reads_the_kinds_own_conditions_and_trainer_container(k8s, tmp_path, workload):
    backend, run_dir, _ = _setup(k8s, tmp_path, workload)
    _, kind, succeeded, container = CUSTOM[workload]
    attempt = _launch(backend)
    assert backend.poll(attempt).detail == "no pods yet"
    names = k8s.make_pods("exp1-a1", NS, phase="Running", workload=workload)
    assert len(names) == 2 and backend.poll(attempt).status is AttemptStatus.RUNNING
    # A condition type of another kind means nothing here (a JobSet says Completed, a Job or TrainJob Complete).
    other = "Complete" if succeeded == "Completed" else "Completed"
    k8s.set_status(workload, "exp1-a1", NS, conditions=[{"type": other, "status": "True"}])
    assert backend.poll(attempt).status is AttemptStatus.RUNNING
    k8s.set_status(workload, "exp1-a1", NS, conditions=[{"type": succeeded, "status": "True"}])
    assert (backend.poll(attempt).status, backend.poll(attempt).exit_code) == (AttemptStatus.DONE, 0)

    # Failed: the protocol code of the kind's trainer container (`node` in Trainer's torch runtime).
    second = _launch(backend, attempt=2)
    pods = k8s.make_pods("exp1-a2", NS, phase="Failed", exit_codes=[1, 44], workload=workload)
    k8s.set_status(workload, "exp1-a2", NS, conditions=[{"type": "Failed", "status": "True", "reason": "FailedJobs",
                                                         "message": "jobset failed\nbecause"}])  # fmt: skip
    pod = client.CoreV1Api(k8s.api_client("reader")).read_namespaced_pod(pods[0], NS)
    assert pod.status.container_statuses[0].name == container
    outcome = backend.poll(second)
    assert (outcome.status, outcome.exit_code) == (AttemptStatus.BAD_WORLD, 44)

    third = _launch(backend, attempt=3)
    k8s.make_pods("exp1-a3", NS, phase="Failed", exit_codes=[1, 0], workload=workload)
    k8s.set_status(workload, "exp1-a3", NS, conditions=[{"type": "Failed", "status": "True", "reason": "FailedJobs",
                                                         "message": "jobset failed\nbecause"}])  # fmt: skip
    outcome = backend.poll(third)
    assert outcome.status is AttemptStatus.CRASHED
    assert outcome.detail == f"the {kind} failed (FailedJobs: jobset failed because); trainer exit code 1"

    # The trainer's exit record comes first, and a workload gone is reported by its kind.
    _record(run_dir, 3, int(ExitCode.SWITCH))
    assert backend.poll(third).status is AttemptStatus.SWITCHED
    gone = Attempt(number=9, strategy=TWO_NODES, backend_id="exp1-a9", extra={"workload": workload})
    assert backend.poll(gone).detail == f"the {kind} is gone"


@pytest.mark.parametrize("workload", ["jobset", "trainjob"])
def test_pods_of_another_attempt_are_not_mixed_in(k8s, tmp_path, workload):
    backend, _, _ = _setup(k8s, tmp_path, workload)
    first, second = _launch(backend), _launch(backend, attempt=2)
    k8s.make_pods("exp1-a1", NS, phase="Running", workload=workload)
    # The emulator ignores label selectors: attempt 2's pods come back from the list and must be dropped.
    k8s.make_pods("exp1-a2", NS, phase="Pending", workload=workload,
                  conditions=[{"type": "PodScheduled", "status": "False", "message": INSUFFICIENT}])  # fmt: skip
    assert backend.poll(first).status is AttemptStatus.RUNNING
    assert (backend.poll(second).status, backend.poll(second).detail) == (AttemptStatus.PENDING, INSUFFICIENT)
    selectors = [r.params.get("labelSelector") for r in k8s.requests()
                 if r.url.path.endswith("/pods") and r.method.value.upper() == "GET"]  # fmt: skip
    assert set(selectors) == {"jobset.sigs.k8s.io/jobset-name=exp1-a1", "jobset.sigs.k8s.io/jobset-name=exp1-a2"}


def test_a_trainjob_ends_when_its_trainer_exited_and_a_pod_failed_before_the_runtime_retries_it(k8s, tmp_path):
    """Trainer's torch runtime leaves its Job's backoffLimit at 6: the Job would replace the failed pod and run the
    attempt again. The backend ends the attempt on the trainer's exit record and deletes the TrainJob first."""
    backend, run_dir, _ = _setup(k8s, tmp_path, "trainjob")
    attempt = _launch(backend)
    k8s.make_pods("exp1-a1", NS, phase="Failed", exit_codes=[1, 1], workload="trainjob")
    assert backend.poll(attempt).status is AttemptStatus.RUNNING  # no record yet: the Job may still retry
    _record(run_dir, 1, int(ExitCode.SWITCH))
    assert backend.poll(attempt).status is AttemptStatus.SWITCHED
    assert k8s.backend_requests()[-1] == ("DELETE", f"{CUSTOM['trainjob'][0]}/exp1-a1")
    # A JobSet's Job has backoffLimit 0 (rendered by cona): its own Failed condition ends the attempt instead.
    jobset_backend, jobset_run, _ = _setup(k8s, tmp_path / "js", "jobset")
    js_attempt = _launch(jobset_backend, attempt=2)
    k8s.make_pods("exp1-a2", NS, phase="Failed", exit_codes=[1, 1], workload="jobset")
    _record(jobset_run, 2, int(ExitCode.SWITCH))
    assert jobset_backend.poll(js_attempt).status is AttemptStatus.RUNNING


@pytest.mark.parametrize("workload", ["jobset", "trainjob"])
def test_cancel_deletes_the_custom_object_in_the_foreground_and_no_service(k8s, tmp_path, workload):
    backend, _, _ = _setup(k8s, tmp_path, workload)
    attempt = _launch(backend)
    backend.cancel(attempt)
    backend.cancel(attempt)
    path = CUSTOM[workload][0]
    assert [r for r in k8s.backend_requests() if r[0] == "DELETE"] == [("DELETE", f"{path}/exp1-a1")] * 2
    body = next(r for r in k8s.requests() if r.method.value.upper() == "DELETE").data
    assert body["propagationPolicy"] == "Foreground"
    assert backend.poll(attempt).detail == f"the {CUSTOM[workload][1]} is gone"


def test_a_missing_jobset_crd_is_a_one_line_error_saying_what_to_install(k8s, tmp_path):
    backend, _, _ = _setup(k8s, tmp_path, "jobset")
    k8s.refuse("post", "jobset.x-k8s.io", "v1alpha2", "jobsets", status=404,
               message="the server could not find the requested resource")  # fmt: skip
    with pytest.raises(BackendError) as info:
        _launch(backend)
    assert str(info.value) == (
        "kubernetes: create jobsets 'exp1-a1' in namespace 'cona': not found (404): the server could not find the "
        "requested resource; is jobset.x-k8s.io/v1alpha2 installed (the JobSet controller, kubernetes-sigs/jobset, "
        "which installs the jobsets.jobset.x-k8s.io CRD), and does namespace 'cona' exist (apply manifests/)?"
    )


@pytest.mark.parametrize("workload", ["jobset", "trainjob"])
def test_render_prints_the_kinds_manifest(k8s, tmp_path, workload):
    backend, _, _ = _setup(k8s, tmp_path, workload)
    kinds = [doc["kind"] for doc in yaml.safe_load_all(backend.render(strategy=TWO_NODES)) if doc]
    assert kinds == [CUSTOM[workload][1]]
    assert k8s.backend_requests() == []  # rendering calls no API


def test_render_is_the_first_attempts_manifests(setup):
    backend, run_dir, _ = setup
    text = backend.render(strategy=TWO_NODES)
    kinds = [doc["kind"] for doc in yaml.safe_load_all(text) if doc]
    assert kinds == ["Service", "Job"] and f"--run-dir, {run_dir.root}" not in text and str(run_dir.root) in text


def test_the_kubernetes_client_is_imported_only_when_the_backend_is_built():
    code = (
        "import sys, cona.orchestrator.backends.kubernetes.backend, cona.orchestrator.profile as p; "
        f"p.load_profile({str(K8S_PROFILE)!r}); "
        "assert 'kubernetes' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_rank_killed_by_a_signal_is_named_from_the_pods_logs(k8s, setup):
    """A rank killed by a signal writes no crash record: the crash line said only that the Job failed. Each pod's
    torchrun ends its log with its summary; the pods' logs are saved into the attempt's directory when the crash is
    seen (as `release` saves them), and the summary that saw the failure first names the rank and the signal."""
    from tests.test_local_backend import torchrun_summary

    backend, run_dir, _ = setup
    attempt = _launch(backend)
    pods = k8s.make_pods("exp1-a1", NS, phase="Failed", exit_codes=[1, 1])
    k8s.set_job_status("exp1-a1", NS, conditions=[{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}])
    plain = backend.poll(attempt).detail
    assert plain == "the Job failed (BackoffLimitExceeded); trainer exit code 1"  # no logs: as before
    k8s.pod_logs[pods[0]] = "step 7\n" + torchrun_summary(rank=0, code=1, at="20:41:05")
    k8s.pod_logs[pods[1]] = "step 7\n"
    assert backend.poll(attempt).detail == f"{plain}: rank 0 exited 1"  # no signal, no record: torchrun's root
    k8s.pod_logs[pods[1]] = "step 7\n" + torchrun_summary(rank=9, code=-9, at="20:41:04")
    outcome = backend.poll(attempt)
    assert (outcome.status, outcome.detail) == (AttemptStatus.CRASHED, f"{plain}: rank 9 killed by SIGKILL")
    assert (run_dir.attempt_dir(1) / f"pod-{pods[1]}.log").read_text() == k8s.pod_logs[pods[1]]


def test_gone_tells_an_ended_attempt_by_read_only_gets(k8s, setup, tmp_path):
    """`cona status` and `cona stop` of a run whose orchestrator is gone ask `gone`: a workload that is gone, has
    finished or failed, or whose pods have all ended (none to be replaced), is gone; one with a pod running, to come
    or replacing a disrupted one is not, nor any when the API server cannot be reached. Only GETs."""
    backend, run_dir, _ = setup

    def attempt_with(number: int, *, phase: str | None = None, codes: list[int] | None = None,
                     conditions: list[dict] | None = None, job: str | None = None) -> Attempt:  # fmt: skip
        attempt = _launch(backend, attempt=number)
        if phase is not None:
            k8s.make_pods(attempt.backend_id, NS, phase=phase, exit_codes=codes, conditions=conditions)
        if job is not None:
            k8s.set_job_status(attempt.backend_id, NS, conditions=[{"type": job, "status": "True"}])
        return attempt

    disrupted = [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]
    cases = [
        (attempt_with(1), False),  # no pods yet
        (attempt_with(2, phase="Running"), False),
        (attempt_with(3, phase="Failed", codes=[1, 1]), True),  # the Job controller adds Failed moments later
        (attempt_with(4, phase="Failed", codes=[137, 137], conditions=disrupted), False),  # replaced, not counted
        (attempt_with(5, phase="Failed", codes=[1, 1], job="Failed"), True),
        (attempt_with(6, phase="Succeeded", codes=[0, 0], job="Complete"), True),
    ]
    deleted = attempt_with(7, phase="Running")
    backend.cancel(deleted)
    cases.append((deleted, True))
    asked = len(k8s.backend_requests())
    before = sorted(p.relative_to(run_dir.root) for p in run_dir.root.rglob("*"))
    for attempt, expected in cases:
        assert backend.gone(attempt) is expected, attempt.number
    assert {method for method, _ in k8s.backend_requests()[asked:]} == {"GET"}
    assert sorted(p.relative_to(run_dir.root) for p in run_dir.root.rglob("*")) == before

    configuration = client.Configuration(host="http://127.0.0.1:9")  # discard port: nothing listens
    configuration.retries = 0
    unreachable = KubernetesBackend(run_dir=run_dir, profile=_profile(tmp_path / "runs"),
                                    api_client=client.ApiClient(configuration))  # fmt: skip
    assert unreachable.gone(cases[-1][0]) is False
    assert backend.gone(Attempt(number=8, strategy=TWO_NODES)) is False  # never launched
