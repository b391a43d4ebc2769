"""SlurmBackend against the real two-node cluster of `slurm/local-cluster.sh`, with a fake trainer.

The batch script runs `torchrun ... -m $CONA_TRAINER_MODULE` (the documented test hook); here that is a tiny
module written to a temporary directory that records its rank environment and exits as a plan in the run
directory says (`fake_plan.json`: {"<attempt>" or "<attempt>.r<restart>": "control" | "exit:<code>"}; "control"
waits for control.json or SIGUSR1/SIGTERM like the real trainer and exits 42 (switch) or 43 (stop, signal)).

Skipped when no cluster is running, unless CONA_REQUIRE_SLURM=1 (CI), which turns that into a failure.
Start the cluster with `slurm/local-cluster.sh start` (add `--accounting` to exercise sacct as well).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from cona.orchestrator.backends.base import Attempt, AttemptStatus, Outcome
from cona.orchestrator.backends.slurm import SlurmBackend, parse_sinfo_nodes
from cona.orchestrator.backends.slurm.script import render_batch_script
from cona.orchestrator.profile import ClusterProfile, load_profile
from cona.protocol.rundir import ControlRecord, RunDir
from cona.protocol.strategy import Strategy

from tests.conftest import PROFILES, REPO

pytestmark = pytest.mark.slurm

LOCAL_CLUSTER = REPO / "slurm" / "local-cluster.sh"
FAKE_MODULE = "cona_fake_trainer"
FAKE_TRAINER = '''
"""Stands in for `python -m cona.trainer` under torchrun in cona's Slurm tests."""
import json, os, signal, sys, time

args = sys.argv[1:]
run_dir = args[args.index("--run-dir") + 1]
attempt = int(args[args.index("--attempt") + 1])
strategy_arg = args[args.index("--strategy") + 1] if "--strategy" in args else None
rank = int(os.environ.get("RANK", "0"))
restart = os.environ.get("SLURM_RESTART_COUNT", "0")
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append("USR1"))
signal.signal(signal.SIGTERM, lambda s, f: got.append("TERM"))
try:
    with open(os.path.join(run_dir, "fake_plan.json")) as f:
        plans = json.load(f)
except OSError:
    plans = {}
plan = plans.get(f"{attempt}.r{restart}", plans.get(str(attempt), "control"))
out = os.path.join(run_dir, "fake")
os.makedirs(out, exist_ok=True)
tag = f"{attempt}-r{restart}-rank{rank}"
info = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_JOB_ID", "SLURMD_NODENAME",
                                      "NCCL_DEBUG", "FAKE_ODD")}
info.update(plan=plan, strategy=strategy_arg, pid=os.getpid())
with open(os.path.join(out, tag + ".start.json"), "w") as f:
    json.dump(info, f)


def control():
    try:
        with open(os.path.join(run_dir, "control.json")) as f:
            c = json.load(f)
        return int(c.get("seq", 0)), c.get("command")
    except (OSError, ValueError):
        return 0, None


seq0 = control()[0]
code = 9  # a crash when nothing happens within the deadline
deadline = time.time() + 300
while time.time() < deadline:
    if plan.startswith("exit:"):
        code = int(plan[5:])
        break
    # control.json first: torchrun SIGTERMs the other workers as soon as one exits (every protocol exit is
    # non-zero), and a worker that was descheduled may see that SIGTERM before the command it acts on.
    seq, command = control()
    if seq > seq0:
        code = {"switch": 42, "stop": 43}.get(command, 7)
        break
    if got:
        code = 43  # "checkpointed" on SIGUSR1/SIGTERM
        break
    time.sleep(0.05)
with open(os.path.join(out, tag + ".exit.json"), "w") as f:
    json.dump({"code": code, "signals": got}, f)
sys.exit(code)
'''

S4 = Strategy(dp=4, tp=1, pp=1, mbs=1, gbs=4)  # 2 nodes x 2 processes
S4_TP = Strategy(dp=2, tp=2, pp=1, mbs=1, gbs=2)  # 2 nodes x 2 processes, another layout
S2 = Strategy(dp=2, tp=1, pp=1, mbs=1, gbs=2)  # 1 node x 2 processes
ENV = {"NCCL_DEBUG": "WARN", "FAKE_ODD": "it's $(hostname) \"q\" `id` \\"}
"""The profile's env of the runs here: every trainer rank must see it as written (sbatch and submitit)."""


def _sh(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)


def _cluster_problem() -> str | None:
    """None when a usable Slurm cluster with two nodes answers, else why not."""
    for tool in ("sbatch", "squeue", "scontrol", "sinfo", "srun"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (start the test cluster: slurm/local-cluster.sh start)"
    try:
        if "is UP" not in _sh("scontrol", "ping", timeout=10).stdout:
            return "slurmctld is not running (slurm/local-cluster.sh start)"
        nodes = parse_sinfo_nodes(_sh("sinfo", "-h", "-N", "-o", "%N|%T", timeout=10).stdout)
    except subprocess.TimeoutExpired:
        return "Slurm commands time out"
    down = [n for n, s in nodes.items() if s.startswith(("down", "drain", "fail")) or s.endswith("*")]
    if down and LOCAL_CLUSTER.exists() and os.geteuid() == 0:
        _sh(str(LOCAL_CLUSTER), "start", timeout=120)  # restarts dead slurmds and resumes nodes
        nodes = parse_sinfo_nodes(_sh("sinfo", "-h", "-N", "-o", "%N|%T").stdout)
        down = [n for n, s in nodes.items() if s.startswith(("down", "drain", "fail")) or s.endswith("*")]
    usable = [n for n in nodes if n not in down]
    if len(usable) < 2:
        return f"need 2 usable Slurm nodes, have {nodes}"
    return None


@pytest.fixture(scope="module")
def cluster():
    problem = _cluster_problem()
    if problem:
        if os.environ.get("CONA_REQUIRE_SLURM") == "1":
            pytest.fail(f"CONA_REQUIRE_SLURM=1 but the Slurm cluster is not usable: {problem}")
        pytest.skip(problem)


@pytest.fixture(scope="module")
def fake_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fake_trainer")
    (path / f"{FAKE_MODULE}.py").write_text(FAKE_TRAINER)
    return path


class Run:
    """One run directory, its backends (sacct detected, and sacct forced off) and helpers to drive the fake."""

    def __init__(self, root: Path, fake_dir: Path, profile: ClusterProfile | None = None) -> None:
        self.run = RunDir(root)
        root.mkdir(parents=True, exist_ok=True)
        env = {
            "CONA_TRAINER_MODULE": FAKE_MODULE,
            "PYTHONPATH": os.pathsep.join(p for p in (str(fake_dir), os.environ.get("PYTHONPATH", "")) if p),
        }
        profile = profile or load_profile(PROFILES / "local-slurm.yaml").model_copy(update={"env": ENV})
        self.backend = SlurmBackend(run_dir=self.run, profile=profile, env=env, handoff_timeout_s=45)
        self.no_sacct = SlurmBackend(run_dir=self.run, profile=profile, env=env, use_sacct=False)
        self.jobs: set[str] = set()
        self.seq = 0

    def plan(self, **plans: str) -> None:
        data = {key.replace("_r", ".r").lstrip("a"): value for key, value in plans.items()}
        (self.run.root / "fake_plan.json").write_text(json.dumps(data))

    def launch(self, attempt: int, strategy: Strategy, previous: Attempt | None = None) -> Attempt:
        launched = self.backend.launch(attempt=attempt, strategy=strategy, previous=previous)
        self.jobs.add(launched.backend_id)
        return launched

    def control(self, command: str) -> None:
        self.seq += 1
        self.run.write_control(ControlRecord(seq=self.seq, command=command))

    def started(self, attempt: int, restart: int = 0, ranks: int = 4, timeout: float = 180) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            files = sorted((self.run.root / "fake").glob(f"{attempt}-r{restart}-rank*.start.json"))
            if len(files) >= ranks:
                return [json.loads(f.read_text()) for f in files]
            time.sleep(0.2)
        pytest.fail(f"attempt {attempt} (restart {restart}) did not start {ranks} ranks\n{self.logs()}")

    def wait(self, attempt: Attempt, *statuses: AttemptStatus, timeout: float = 180) -> Outcome:
        deadline = time.monotonic() + timeout
        seen: list[str] = []
        while time.monotonic() < deadline:
            outcome = self.backend.poll(attempt)
            if not seen or seen[-1] != f"{outcome.status.value}: {outcome.detail}":
                seen.append(f"{outcome.status.value}: {outcome.detail}")
            if outcome.status in statuses:
                return outcome
            time.sleep(0.3)
        pytest.fail(f"attempt {attempt.number}: wanted {statuses}, saw {seen}\n{self.logs()}")

    def exits(self, attempt: int, restart: int = 0) -> list[dict]:
        files = sorted((self.run.root / "fake").glob(f"{attempt}-r{restart}-rank*.exit.json"))
        return [json.loads(f.read_text()) for f in files]

    def logs(self) -> str:
        out = [f"--- squeue\n{_sh('squeue', '-o', '%i %T %r %D %N %M').stdout}"]
        for job in sorted(self.jobs):
            out.append(f"--- scontrol show job {job}\n{_sh('scontrol', 'show', 'job', '-o', job).stdout}")
        out.append(f"--- uptime\n{_sh('uptime').stdout}")
        for path in sorted(self.run.root.glob("attempts/**/*")):
            if path.is_file() and path.suffix in (".out", ".log", ".json"):
                out.append(f"--- {path.relative_to(self.run.root)}\n{path.read_text()[-3000:]}")
        return "\n".join(out)

    def cleanup(self) -> None:
        for job in self.jobs:
            _sh("scancel", job)


@pytest.fixture
def run(cluster, fake_dir, tmp_path):
    r = Run(tmp_path / "run", fake_dir)
    yield r
    r.cleanup()


def _job_state(job_id: str) -> str:
    out = _sh("scontrol", "show", "job", "-o", job_id).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "")


def test_switch_relaunches_inside_the_allocation(run):
    run.plan(a1="control", a2="exit:0")
    first = run.launch(1, S4)
    ranks = run.started(1)
    assert sorted(int(r["RANK"]) for r in ranks) == [0, 1, 2, 3]
    assert {r["WORLD_SIZE"] for r in ranks} == {"4"} and {r["LOCAL_WORLD_SIZE"] for r in ranks} == {"2"}
    assert {r["SLURMD_NODENAME"] for r in ranks} == {"n1", "n2"}
    assert {r["strategy"] for r in ranks} == {str(S4)}
    assert all((r["NCCL_DEBUG"], r["FAKE_ODD"]) == (ENV["NCCL_DEBUG"], ENV["FAKE_ODD"]) for r in ranks), ranks
    assert run.backend.poll(first).status == AttemptStatus.RUNNING

    run.control("switch")
    outcome = run.wait(first, AttemptStatus.SWITCHED)
    assert outcome.exit_code == 42 and {e["code"] for e in run.exits(1)} == {42}
    assert _job_state(first.backend_id) == "RUNNING"  # the job waits for its next attempt

    second = run.launch(2, S4_TP, previous=first)
    assert second.backend_id == first.backend_id and second.extra["mode"] == "relaunch"
    ranks = run.started(2)
    assert {r["strategy"] for r in ranks} == {str(S4_TP)} and {r["SLURM_JOB_ID"] for r in ranks} == {
        first.backend_id
    }
    outcome = run.wait(second, AttemptStatus.DONE)
    assert outcome.exit_code == 0
    assert run.no_sacct.poll(second).status == AttemptStatus.DONE
    assert run.no_sacct.poll(first).status == AttemptStatus.SWITCHED


def test_usr1_to_the_batch_shell_checkpoints_and_requeues(run):
    """`--signal=B:USR1@N` before the time limit, simulated with `scancel --batch --signal=USR1`."""
    run.plan(a1="control", a1_r1="exit:0")
    first = run.launch(1, S4)
    run.started(1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", first.backend_id], check=True)
    run.wait(first, AttemptStatus.PENDING, AttemptStatus.DONE)
    exits = run.exits(1)
    assert {e["code"] for e in exits} == {43}
    # every trainer got USR1 exactly once (a SIGTERM may follow: torchrun stops the rest of a node's workers
    # as soon as one of them has exited)
    assert all(e["signals"][0] == "USR1" and e["signals"].count("USR1") == 1 for e in exits), exits
    run.started(1, restart=1)  # the requeued job runs the same attempt again
    outcome = run.wait(first, AttemptStatus.DONE)
    assert outcome.exit_code == 0
    slurm = json.loads((run.run.attempt_dir(1) / "slurm.json").read_text())
    assert slurm["restarts"] == 1 and slurm["job_id"] == first.backend_id


def test_scontrol_requeue_reruns_the_attempt(run):
    run.plan(a1="control", a1_r1="exit:0")
    first = run.launch(1, S4)
    run.started(1)
    subprocess.run(["scontrol", "requeue", first.backend_id], check=True)
    run.started(1, restart=1)
    outcome = run.wait(first, AttemptStatus.DONE)
    assert outcome.exit_code == 0
    assert json.loads((run.run.attempt_dir(1) / "slurm.json").read_text())["restarts"] == 1


def test_outcomes_resubmission_and_cancel_with_and_without_sacct(run):
    run.plan(a1="control", a2="control", a3="exit:7", a4="control")
    first = run.launch(1, S4)
    run.started(1)
    run.control("switch")
    run.wait(first, AttemptStatus.SWITCHED)

    # 4 → 2 processes: one node, so a new job; the idle two-node job is released
    second = run.launch(2, S2, previous=first)
    assert second.backend_id != first.backend_id and second.extra["nnodes"] == 1
    ranks = run.started(2, ranks=2)
    assert {r["WORLD_SIZE"] for r in ranks} == {"2"} and len({r["SLURMD_NODENAME"] for r in ranks}) == 1
    run.control("stop")
    outcome = run.wait(second, AttemptStatus.STOPPED)
    assert outcome.exit_code == 43

    third = run.launch(3, S2, previous=second)
    assert third.backend_id != second.backend_id
    outcome = run.wait(third, AttemptStatus.CRASHED)
    assert outcome.exit_code == 7

    fourth = run.launch(4, S4, previous=third)
    run.started(4)
    run.backend.cancel(fourth)
    # scancel sends SIGTERM: the trainer checkpoints (43) before the job dies, so the attempt is STOPPED
    outcome = run.wait(fourth, AttemptStatus.STOPPED)
    assert "SIGTERM" in outcome.detail

    # Every job has ended now; the outcomes stay the same with and without accounting.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
        _job_state(a.backend_id) in ("RUNNING", "PENDING", "COMPLETING")
        for a in (first, second, third, fourth)
    ):
        time.sleep(0.3)
    assert _job_state(first.backend_id) == "CANCELLED"  # released when attempt 2 needed one node
    assert _job_state(second.backend_id) == "COMPLETED"  # a requested stop ends the job cleanly
    assert _job_state(third.backend_id) == "FAILED"  # the crash code is the job's exit code
    for backend in (run.backend, run.no_sacct):
        assert backend.poll(first).status == AttemptStatus.SWITCHED
        assert backend.poll(second).status == AttemptStatus.STOPPED
        assert (backend.poll(third).status, backend.poll(third).exit_code) == (AttemptStatus.CRASHED, 7)
        assert backend.poll(fourth).status == AttemptStatus.STOPPED
    assert _job_state(fourth.backend_id) == "CANCELLED"  # and not requeued by its own script
    if run.backend.use_sacct:
        acct = run.backend.accounting(third.backend_id)
        assert acct is not None and acct.state == "FAILED" and acct.exit_status == 7


@pytest.mark.slow
def test_killed_slurmd_is_detected_and_the_job_requeued(run):
    pidfile = Path("/run/cona-slurm/slurmd-n2.pid")
    if not pidfile.exists() or os.geteuid() != 0:
        pytest.skip("needs the cluster of slurm/local-cluster.sh, as root")
    run.plan(a1="control", a1_r1="exit:0")
    first = run.launch(1, S4)
    run.started(1)
    os.kill(int(pidfile.read_text()), 9)
    try:
        outcome = run.wait(first, AttemptStatus.CRASHED, AttemptStatus.PENDING, timeout=90)
        assert "n2 DOWN" in outcome.detail, outcome
        nodes = parse_sinfo_nodes(_sh("sinfo", "-h", "-N", "-o", "%N|%T").stdout)
        assert nodes["n2"].startswith("down"), nodes
    finally:
        subprocess.run(
            [str(LOCAL_CLUSTER), "restart-node", "n2"], check=True, capture_output=True, timeout=120
        )
    # Slurm requeued the job on the node failure; it runs attempt 1 again once n2 is back.
    run.started(1, restart=1, timeout=90)
    outcome = run.wait(first, AttemptStatus.DONE, timeout=90)
    assert json.loads((run.run.attempt_dir(1) / "slurm-exit.json").read_text())["restarts"] == 1


def test_submitit_submission(cluster, fake_dir, tmp_path):
    profile = load_profile(PROFILES / "local-slurm.yaml")
    profile = profile.model_copy(update={"slurm": profile.slurm.model_copy(update={"use_submitit": True}), "env": ENV})
    r = Run(tmp_path / "run", fake_dir, profile)
    try:
        r.plan(a1="control", a2="exit:0")
        first = r.launch(1, S4)
        ranks = r.started(1)
        assert {x["SLURMD_NODENAME"] for x in ranks} == {"n1", "n2"}
        assert all((x["NCCL_DEBUG"], x["FAKE_ODD"]) == (ENV["NCCL_DEBUG"], ENV["FAKE_ODD"]) for x in ranks), ranks
        r.control("switch")
        r.wait(first, AttemptStatus.SWITCHED)
        second = r.launch(2, S4_TP, previous=first)
        assert second.backend_id == first.backend_id
        assert r.wait(second, AttemptStatus.DONE).exit_code == 0
        assert any((tmp_path / "run" / "slurm" / "submitit").iterdir())
    finally:
        r.cleanup()


def _final_state(job_id: str, backend: SlurmBackend, timeout: float = 30) -> str:
    """The job's state once it has ended (COMPLETING over); sacct's agrees when the cluster keeps accounting."""
    deadline = time.monotonic() + timeout
    while (state := _job_state(job_id)) in ("RUNNING", "PENDING", "COMPLETING") and time.monotonic() < deadline:
        time.sleep(0.2)
    if backend.use_sacct:  # what a user reads; slurmdbd hears of the end a moment after slurmctld
        while (acct := backend.accounting(job_id)) is None or acct.state != state:
            assert time.monotonic() < deadline, f"job {job_id}: sacct says {acct}, scontrol {state}"
            time.sleep(0.3)
    return state


@pytest.mark.parametrize("submitit", [False, True], ids=["sbatch", "submitit"])
def test_a_job_that_ends_by_itself_keeps_its_own_end_state(cluster, fake_dir, tmp_path, submitit):
    """A crashed attempt's job ends FAILED and a finished run's COMPLETED, not CANCELLED: the orchestrator reads a
    job's exit record while its batch script is still exiting, and its scancel in that window (the resubmission's
    release, `close` at the end of the run) made Slurm record every such job CANCELLED. An EXIT trap in the setup
    widens that window (under submitit its Python process pickles the result there) to make the race certain.
    Under submitit only the run's end: the resubmission's release is the same code, and a job less is 5 s less."""
    profile = load_profile(PROFILES / "local-slurm.yaml")
    # Under submitit the setup runs in submitit's batch script as well: the job ends 1 s after the record either way.
    slow_end = [f"trap 'sleep {0.5 if submitit else 1}' EXIT"]
    profile = profile.model_copy(
        update={"slurm": profile.slurm.model_copy(update={"use_submitit": submitit, "setup": slow_end})}
    )
    r = Run(tmp_path / "run", fake_dir, profile)
    try:
        ends: dict[str, str] = {}  # job id → the state Slurm must record
        previous = None
        if not submitit:
            r.plan(a1="exit:7", a2="exit:0")
            previous = r.launch(1, S2)
            assert r.wait(previous, AttemptStatus.CRASHED).exit_code == 7
            ends[previous.backend_id] = "FAILED"
        else:
            r.plan(a1="exit:0")
        last = r.launch(len(ends) + 1, S2, previous=previous)  # after a crash: a new job once that one has ended
        assert r.wait(last, AttemptStatus.DONE).exit_code == 0
        ends[last.backend_id] = "COMPLETED"
        r.backend.close()  # the scheduler's end of the run
        assert {job: _final_state(job, r.backend) for job in ends} == ends, r.logs()
    finally:
        r.cleanup()


def test_sbatch_reads_hostile_values_back_exactly(cluster, tmp_path):
    """#SBATCH values with quotes, `$(...)`, `#` and backslashes reach Slurm unchanged (and run nothing)."""
    marker = tmp_path / "pwned"
    name = f"job $(touch {marker}) 'q' \"d\" #x"
    comment = f"a `touch {marker}` \\ b"
    profile = load_profile(PROFILES / "local-slurm.yaml")
    profile = profile.model_copy(
        update={"slurm": profile.slurm.model_copy(update={"extra_sbatch": [f"--comment={comment}"]})}
    )
    script = tmp_path / "job.sbatch"
    script.write_text(render_batch_script(profile, None, tmp_path / "run dir", job_name=name))
    (tmp_path / "run dir" / "attempts").mkdir(parents=True)
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--hold", str(script)], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        out = _sh("squeue", "-h", "-j", job_id, "-o", "%j\t%k").stdout.rstrip("\n")
        assert out == f"{name}\t{comment}"
    finally:
        _sh("scancel", job_id)
    assert not marker.exists()
