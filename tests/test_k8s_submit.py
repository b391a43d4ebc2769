"""`cona submit` end to end on the emulated cluster: the laptop creates the run's ConfigMap and orchestrator Job;
the emulator runs the orchestrator pod (`cona orchestrate`) as a local process, which creates the attempts' Jobs,
whose pods it runs too. The laptop then follows, stops and fetches the report through the API only.

Two kubeconfigs tell the callers apart in the emulator's request log: `laptop` (the CLI) and `orchestrator-sa`
(what the pods get, standing in for the ServiceAccount), so each side's calls are checked against its Role.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import yaml
from cona.orchestrator.runstate import read_events, read_state
from cona.protocol.rundir import RunDir

from tests.conftest import REPO, run_cona
from tests.k8s_emulator import frozen, kill_pod
from tests.test_k8s_backend import _verb
from tests.test_k8s_e2e import BASE, NAMESPACE, S2, S4, TINY, write_profile
from tests.test_k8s_submit_unit import namespace_objects
from tests.test_orchestrator_e2e import assert_attempts_never_overlap, assert_samples_exact, heartbeats

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),  # inside kmock
]

DATA = str(REPO / "data" / "shakespeare.txt")


def _role(name: str) -> set[tuple[str, str, str]]:
    for doc in yaml.safe_load_all((REPO / "manifests" / "rbac.yaml").read_text()):
        if doc and doc["kind"] == "Role" and doc["metadata"]["name"] == name:
            return {(g, r, v) for rule in doc["rules"] for g in rule["apiGroups"] for r in rule["resources"]
                    for v in rule["verbs"]}  # fmt: skip
    raise AssertionError(f"no Role {name} in manifests/rbac.yaml")


class Cluster:
    """The emulated cluster with a laptop kubeconfig, and the runs submitted to it."""

    def __init__(self, k8s, root: Path) -> None:
        self.k8s = k8s
        self.root = root
        (root / "pods").mkdir()
        pods_config = k8s.write_kubeconfig(root / "sa-kubeconfig", token="orchestrator-sa", namespace=NAMESPACE)
        self.kubeconfig = k8s.write_kubeconfig(root / "kubeconfig", token="laptop", namespace=NAMESPACE)
        self.controller = k8s.run_jobs(root / "pods", env={"KUBECONFIG": str(pods_config)})
        self.profile = write_profile(root)
        namespace_objects(k8s, NAMESPACE)  # the PVC and ServiceAccount `cona submit` checks, as manifests/ makes them

    def cona(self, *args: str, timeout: float = 180):
        return run_cona(*args, env={"KUBECONFIG": str(self.kubeconfig)}, timeout=timeout)

    def submit(self, name: str, *args: str) -> None:
        out = self.cona("submit", "--profile", str(self.profile), "--job", TINY, "--name", name, *BASE,
                        "--set", f"data.path={DATA}", *args)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert f"submitted run {name} to namespace {NAMESPACE}" in out.stdout, out.stdout

    def run_dir(self, name: str) -> RunDir:
        return RunDir(self.root / name)

    def status(self, name: str) -> dict:
        out = self.cona("status", name, "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def orchestrator(self, name: str):
        return self.controller.wait_job(f"{name}-orch").pods[0]

    def attempt_job(self, name: str, attempt: int):
        """The Job of an attempt (its name is in the attempt's launch record)."""
        job = json.loads((self.run_dir(name).attempt_dir(attempt) / "launch.json").read_text())["job_name"]
        return self.controller.wait_job(job)

    def events(self, name: str) -> list[str]:
        return [e["event"] for e in read_events(self.run_dir(name))]

    def wait(self, predicate, timeout: float, what: str, name: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.5)
        pytest.fail(f"timed out after {timeout}s waiting for {what}\n{self.logs(name)}")

    def final(self, name: str) -> str | None:
        try:
            state = read_state(self.run_dir(name))
        except Exception:
            return None
        return state.status if state.final else None

    def logs(self, name: str) -> str:
        try:
            events = read_events(self.run_dir(name))
        except Exception:
            events = []
        return self.controller.logs() + "\n--- events\n" + "\n".join(json.dumps(e)[:300] for e in events)


@pytest.fixture
def cluster(k8s, tmp_path):
    return Cluster(k8s, tmp_path)


# Attempt 2 (gbs 32 from sample 800 on) is held still while the orchestrator restarts, so a short budget does: it
# only has to outlast the test's poll that sees its step 2 (75 steps, a few seconds at least on a loaded machine).
MAX_SAMPLES = 3200


@pytest.mark.slow
def test_submit_switches_survives_a_killed_orchestrator_and_reports(cluster):
    """A schedule 2 pods × 2 → 1 pod × 2 at 800 samples. The orchestrator pod is killed (-9) during attempt 2:
    Kubernetes restarts it (OnFailure), the new process waits for the Lease, adopts the running attempt and
    finishes the run. The laptop sees it all through `cona status` and fetches the report.

    Attempt 2's processes are stopped (SIGSTOP) from before the kill until the adoption: the attempt is still
    running when the new orchestrator looks, however long its start and the Lease take on a loaded machine."""
    schedule = f"[{{samples: 0, strategy: '{S4}'}}, {{samples: 800, strategy: '{S2}'}}]"
    cluster.submit("r1", "--set", "policy.name=schedule", "--set", f"policy.schedule={schedule}",
                   "--set", f"target.max_samples={MAX_SAMPLES}")  # fmt: skip
    run = cluster.run_dir("r1")
    status = cluster.status("r1")
    assert status["run"] == "r1" and status["orchestrator"].startswith(("pod r1-orch-", "Job r1-orch")), status
    cluster.wait(lambda: max((h.get("step", 0) for h in heartbeats(run, 2)), default=0) >= 2, 240,
                 "attempt 2 (after the switch) at step 2", "r1")  # fmt: skip
    # Held first, looked at after: a laptop call takes seconds on a loaded machine, and attempt 2 would train on.
    with frozen(cluster.attempt_job("r1", 2).pods):
        assert cluster.status("r1")["status"] == "running"
        kill_pod(cluster.orchestrator("r1"), signal.SIGKILL)
        cluster.wait(lambda: "adopt" in cluster.events("r1"), 240, "the restarted orchestrator's adoption", "r1")
    assert cluster.wait(lambda: cluster.final("r1"), 300, "the run's end", "r1") == "done", cluster.logs("r1")

    events = read_events(run)
    kinds = [e["event"] for e in events]
    assert kinds.count("start") == 1 and "adopt" in kinds, kinds  # the same attempt 2, watched again
    assert cluster.orchestrator("r1").restarts == 1
    switches = [e for e in events if e["event"] == "switch"]
    assert switches and switches[0]["to"]["gbs"] == 32, switches
    assert_attempts_never_overlap(run)
    samples = read_state(run).live["samples"]
    assert samples >= MAX_SAMPLES and assert_samples_exact(run) == samples

    # The workloads are owned by the orchestrator Job (deleting it deletes them).
    orchestrator = cluster.controller.wait_job("r1-orch")
    for attempt in (1, 2):
        assert cluster.attempt_job("r1", attempt).owners == [("Job", "r1-orch", orchestrator.uid)]

    # The laptop: the mirrored status, the stored report.
    cluster.wait(lambda: cluster.status("r1")["status"] == "done", 30, "status done in the ConfigMap", "r1")
    status = cluster.status("r1")
    assert status["samples"] == samples and len(status["switches"]) == len(switches), status
    text = cluster.cona("status", "r1").stdout
    assert "status     done" in text and "orchestrator" in text, text
    out = cluster.cona("report", "r1", "--out", str(cluster.root / "fetched"))
    assert out.returncode == 0, out.stderr
    md, png = cluster.root / "fetched" / "report.md", cluster.root / "fetched" / "report.png"
    assert md.read_text() == (run.root / "report.md").read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.read_bytes() == (run.root / "report.png").read_bytes()


@pytest.mark.slow
def test_stop_and_report_of_a_live_run_through_the_api(cluster):
    """`cona report` while the run trains (the orchestrator writes it on request), then `cona stop`: the run
    checkpoints and ends `stopped`; a second stop says it has ended; `cona submit --resume` finishes it. Each
    side's API calls are exactly its Role.

    The trainer is held still (SIGSTOP) from its first checkpoint until the orchestrator has passed the stop on: it
    then stops at its next step, so the run is stopped mid-way however slow the laptop's calls are on a loaded machine."""
    budget = 1600
    cluster.submit("r2", "--policy", f"fixed:{S4}", "--set", f"target.max_samples={budget}")
    run = cluster.run_dir("r2")
    cluster.wait(lambda: run.latest_checkpoint() is not None, 240, "a checkpoint", "r2")
    # Held first, looked at after: each laptop call takes seconds on a loaded machine, and the trainer would train on.
    with frozen(cluster.attempt_job("r2", 1).pods):
        cluster.wait(lambda: cluster.status("r2")["status"] == "running", 30, "status running in the ConfigMap", "r2")
        assert cluster.status("r2")["orchestrator"].startswith("pod r2-orch-"), cluster.status("r2")
        out = cluster.cona("report", "r2", "--out", str(cluster.root / "live"))
        assert out.returncode == 0, out.stderr + cluster.logs("r2")
        assert "attempt" in (cluster.root / "live" / "report.md").read_text().lower()
        out = cluster.cona("stop", "r2")
        assert out.returncode == 0 and "asked run r2 to stop" in out.stdout, out.stderr
        cluster.wait(lambda: "stop-requested" in cluster.events("r2"), 120, "the stop passed to the trainer", "r2")
    assert cluster.wait(lambda: cluster.final("r2"), 240, "the run's end", "r2") == "stopped", cluster.logs("r2")
    cluster.wait(lambda: cluster.status("r2")["status"] == "stopped", 30, "status stopped in the ConfigMap", "r2")
    assert "already ended (stopped)" in cluster.cona("stop", "r2").stdout
    stopped_at = read_state(run).live["samples"]
    assert 0 < stopped_at < budget

    # `cona submit --resume`: a new orchestrator Job goes on from the last checkpoint to the end.
    out = cluster.cona("submit", "--resume", "r2")
    assert out.returncode == 0 and "resuming run r2 (stopped)" in out.stdout, out.stderr
    cluster.wait(lambda: cluster.final("r2") == "done", 300, "the resumed run's end", "r2")
    cluster.wait(lambda: cluster.status("r2")["status"] == "done", 30, "status done in the ConfigMap", "r2")
    kinds = [e["event"] for e in read_events(run)]
    assert kinds.count("resume-requested") == 1 and "resume-run" in kinds, kinds
    samples = read_state(run).live["samples"]
    assert samples >= budget and assert_samples_exact(run) == samples
    assert "nothing to resume" in cluster.cona("submit", "--resume", "r2").stderr

    # Each side called only what its Role grants, and its Role grants nothing it does not use: the orchestrator's
    # every verb but those of the other workload kinds (tests/test_k8s_backend.py covers those), the laptop's every
    # verb but the ConfigMap delete that undoes a submission whose Job could not be created. Listing events is left
    # out on both sides: it explains pods that are missing, which a healthy run may or may not have for a while
    # (tests/test_k8s_events.py covers it); so is listing resourcequotas, which only an elastic run does
    # (tests/test_k8s_quota_growth.py covers it).
    other_kinds = {(g, r, v) for g, r, v in _role("cona") if r in ("jobsets", "trainjobs")}
    sometimes = {("", "events", "list"), ("", "resourcequotas", "list")}
    for token, role, unused in (("laptop", "cona-submitter", {("", "configmaps", "delete")}),
                                ("orchestrator-sa", "cona", other_kinds)):  # fmt: skip
        used = {_verb(method, path) for method, path in cluster.k8s.requests_by(token)} - sometimes
        assert used == _role(role) - unused - sometimes, (token, used ^ (_role(role) - unused - sometimes))
