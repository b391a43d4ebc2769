"""cona end to end on the real local Slurm cluster: real `cona run`, the real scheduler loop, the real trainer.

Every test runs the tiny GPT on `slurm/profiles/local-slurm.yaml` (2 nodes × 2 CPU processes) and checks what a
user relies on: the run ends DONE, no two attempts ever overlap, and the samples consumed across every switch,
resubmission, requeue and node failure are exactly 0..N−1 (`cona.protocol.samples_log.audit_samples`).

- the `cona` policy switches in place inside its allocation (same Slurm job, same `srun` step);
- a `schedule` from 4 to 2 processes resubmits with `--nodes=1`;
- `scancel` mid-run: the trainer checkpoints on SIGTERM, the orchestrator resubmits and resumes;
- `scancel --batch --signal=USR1` then `scontrol requeue`: the job requeues itself / is requeued, and resumes;
- a node dies (slurmd killed, its trainers frozen): Slurm marks it DOWN, the run goes on once it is back.

Skipped when no cluster answers, unless CONA_REQUIRE_SLURM=1 (CI), which makes that a failure (the `cluster`
fixture of tests/test_slurm_cluster.py). The machine may be a loaded 2-core box: every wait polls for a condition
with a generous timeout, and the failure message carries the queue, the events and the job logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cona.orchestrator.backends.base import Attempt
from cona.orchestrator.backends.slurm import SlurmBackend
from cona.orchestrator.profile import load_profile
from cona.protocol.rundir import RunDir
from cona.protocol.samples_log import samples_file
from cona.protocol.strategy import Strategy

from tests.cli_run import CliRun
from tests.conftest import REPO
from tests.test_orchestrator_e2e import (
    assert_attempts_never_overlap,
    assert_samples_exact,
    heartbeats,
    wait_for,
)
from tests.test_slurm_cluster import LOCAL_CLUSTER, _sh, cluster  # noqa: F401 (the cluster fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]

PROFILE = str(REPO / "slurm" / "profiles" / "local-slurm.yaml")
TINY = str(REPO / "examples" / "tiny-gpt.yaml")
S4 = "dp=4,tp=1,pp=1,mbs=4,gbs=16"  # 2 nodes × 2 processes
S2 = "dp=2,tp=1,pp=1,mbs=4,gbs=16"  # 1 node × 2 processes


def sets(**values: object) -> list[str]:
    """`--set k=v` arguments; `policy__name` stands for `policy.name`."""
    out: list[str] = []
    for key, value in values.items():
        out += ["--set", f"{key.replace('__', '.')}={value}"]
    return out


BASE = sets(  # a short run: no perplexity target, a checkpoint every 10 steps, generous hang timeout
    target__val_perplexity="null", target__max_samples=1600, eval__interval_samples=800,
    checkpoint__interval_steps=10, policy__heartbeat_timeout_s=240, policy__decision_interval_s=2,
    optimizer__warmup_samples=256,
)  # fmt: skip


class SlurmRun(CliRun):
    """One `cona run` on the local Slurm cluster, with what the tests look at and what a failure should show."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, root.parent / f"{root.name}.out")

    def start(self, *args: str) -> None:
        self.start_cli(["--profile", PROFILE, "--job", TINY, *BASE, *args], dict(os.environ))

    # -- run-directory views -------------------------------------------------------------------------------

    def attempt_json(self, attempt: int, name: str) -> dict:
        path = self.run.attempt_dir(attempt) / name
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def job_ids(self) -> list[str]:
        ids = [self.attempt_json(int(p.parent.name), "launch.json").get("job_id")
               for p in self.run.root.glob("attempts/*/launch.json")]  # fmt: skip
        return sorted({str(i) for i in ids if i})

    def job_id(self, attempt: int = 1) -> str:
        self.wait(lambda: self.attempt_json(attempt, "launch.json").get("job_id"), 120, f"attempt {attempt} launch")
        return str(self.attempt_json(attempt, "launch.json")["job_id"])

    def steps(self, attempt: int) -> int:
        """The highest step attempt `attempt` reported (heartbeats)."""
        return max((hb.get("step", 0) for hb in heartbeats(self.run, attempt)), default=0)

    def resumes(self, attempt: int) -> list[dict]:
        path = samples_file(self.run, attempt)
        if not path.exists():
            return []
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]
        return [x for x in lines if "resume" in x]

    # -- waiting ---------------------------------------------------------------------------------------------

    def running(self, *, steps: int, attempt: int = 1, timeout: float = 240) -> None:
        """Attempt `attempt` has a complete checkpoint and has trained past step `steps`."""
        self.wait(lambda: self.run.latest_checkpoint() is not None and self.steps(attempt) >= steps, timeout,
                  f"attempt {attempt}: a checkpoint and step {steps}")  # fmt: skip

    def logs(self) -> str:
        parts = [f"--- cona run output\n{self.output()[-4000:]}"]
        parts.append(f"--- squeue\n{_sh('squeue', '-o', '%i %T %r %D %N %M').stdout}")
        parts.append(f"--- sinfo\n{_sh('sinfo', '-N', '-o', '%N %T %E').stdout}")
        for job in self.job_ids():
            parts.append(f"--- scontrol show job {job}\n{_sh('scontrol', 'show', 'job', '-o', job).stdout}")
        parts.append(f"--- uptime\n{_sh('uptime').stdout}")
        parts.append(self.events_text())
        for path in sorted(self.run.root.glob("attempts/**/*")):
            if path.is_file() and path.suffix in (".out", ".log", ".json"):
                parts.append(f"--- {path.relative_to(self.run.root)}\n{path.read_text(errors='replace')[-2500:]}")
        return "\n".join(parts)

    def cleanup(self) -> None:
        super().cleanup()
        for job in self.job_ids():
            _sh("scancel", job)


@pytest.fixture
def slurm_run(cluster, tmp_path):  # noqa: F811 (the imported fixture)
    run = SlurmRun(tmp_path / "run")
    yield run
    run.cleanup()


def slurm_state(job_id: str) -> str:
    out = _sh("scontrol", "show", "job", "-o", job_id).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "")


def assert_samples(run: SlurmRun, expected: int) -> None:
    assert_attempts_never_overlap(run.run)
    assert assert_samples_exact(run.run) == expected, run.logs()


# --------------------------------------------------------------------------------------------------- tests


def test_cona_policy_switches_in_place_inside_the_allocation(slurm_run, tmp_path):
    """The cona policy, not a schedule, decides: a tiny prior noise scale makes the cold start pick the smallest
    batch; the measured noise scale times a large critical-batch factor then makes the larger batch (same
    degrees, same two nodes) win, so the switch happens in place: the trainers of the job's one `srun` step go on
    as the next attempt, and train exactly what a relaunch from the switch's checkpoint trains."""
    slurm_run.start(
        *sets(policy__name="cona", policy__prior_noise_scale=1, policy__critical_batch_factor=100000,
              policy__noise_estimator="plain", policy__min_noise_samples=4, policy__persistence=1,
              policy__min_dwell_s=4, policy__min_gain=0.01, policy__switch_cost_s=0, batch__max_gbs=32,
              checkpoint__keep=50),
    )  # fmt: skip
    state = slurm_run.finish()
    events = slurm_run.events()
    switches = [e for e in events if e["event"] == "switch"]
    assert switches, slurm_run.logs()
    # A probe of a layout that never ran (docs/decisions.md) may come first, when the first measured step times
    # miss the cost model by more than 5%; and the measured fixed cost per step can make a larger batch win while
    # the noise scale is still the prior. The batch only grows, and the estimate makes at least one of the moves.
    grew = [e for e in switches if e["from"]["gbs"] != e["to"]["gbs"]]
    assert grew and all(e["from"]["gbs"] < e["to"]["gbs"] for e in grew), switches
    assert any(e["metrics"]["noise_source"] != "prior" for e in grew), grew  # the estimate decided, not only the prior
    assert {e["kind"] for e in switches} == {"in_place"}, switches
    launches = [e for e in events if e["event"] == "launch"]
    assert len(launches) == len(switches) + 1
    # Every attempt ran in the first job's first step: nothing was resubmitted or relaunched.
    job, submission = launches[0]["backend_id"], slurm_run.attempt_json(1, "launch.json")["submission"]
    last = len(launches)
    for n in range(1, last + 1):
        launch = slurm_run.attempt_json(n, "launch.json")
        assert (launch["job_id"], launch["submission"]) == (job, submission), launch
        assert launch["mode"] == ("submit" if n == 1 else "continued") and launch.get("in_place", False) == (n > 1)
        assert (slurm_run.run.attempt_dir(n) / "slurm.json").exists() == (n == 1), f"attempt {n} started a step"
        if n < last:
            assert slurm_run.run.read_exit(n).next_attempt == n + 1
    ended = slurm_run.attempt_json(last, "slurm-exit.json")
    assert (ended["attempt"], ended["started_as"], ended["action"]) == (last, 1, "done"), ended
    batch_log = (slurm_run.run.root / "attempts" / f"slurm-{job}.out").read_text()
    assert f"attempt {last} (started as attempt 1, switched in place) ended (srun 0): done" in batch_log, batch_log
    accounting = _sh("sacct", "-n", "-P", "-j", job, "-o", "JobID")
    if accounting.returncode == 0 and accounting.stdout.strip():  # the cluster keeps accounting (CI does)
        steps = [x for x in accounting.stdout.split() if "." in x and x.rsplit(".", 1)[1].isdigit()]
        assert steps == [f"{job}.0"], accounting.stdout
    assert_samples(slurm_run, state.live["samples"])
    assert state.live["samples"] >= 1600

    # The same checkpoint, relaunched by hand under the new strategy: the same losses step by step.
    run_dir, switched = slurm_run.run, slurm_run.run.read_exit(1)
    step, target = switched.step, switched.next_strategy
    trained = losses(run_dir, 2, upto=None)
    upto = min(step + 4, max(trained))
    assert upto > step, trained
    relaunched = relaunched_losses(run_dir, tmp_path, step=step, strategy=target, upto=upto)
    assert sorted(relaunched) == list(range(step + 1, upto + 1))
    assert {k: trained[k] for k in relaunched} == relaunched


def losses(run: RunDir, attempt: int, upto: int | None) -> dict[int, float]:
    """The training loss of each step of `attempt` (up to step `upto`), from its heartbeats."""
    return {hb["step"]: hb["train_loss"] for hb in heartbeats(run, attempt)
            if hb.get("event") in (None, "eval") and hb["train_loss"] is not None
            and (upto is None or hb["step"] <= upto)}  # fmt: skip


def snapshot(run: RunDir, step: int, dest: Path) -> RunDir:
    """A run directory at `dest` with `run`'s job and its checkpoint at `step` alone: taken while that checkpoint is
    new, it outlives the pruning (`checkpoint.keep`) of a run that goes on for as long as the test needs."""
    copy = RunDir(dest)
    copy.checkpoints.mkdir(parents=True)
    (copy.root / "run.yaml").write_text((run.root / "run.yaml").read_text())
    shutil.copytree(run.checkpoint_dir(step), copy.checkpoint_dir(step))
    return copy


def relaunched_losses(run: RunDir, tmp: Path, *, step: int, strategy: Strategy, upto: int) -> dict[int, float]:
    """The losses of a fresh torchrun of `strategy` from `run`'s checkpoint at `step`, by hand, up to step `upto`."""
    fresh = snapshot(run, step, tmp / "relaunch")
    by_hand = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={strategy.world_size}",
         "-m", "cona.trainer", "--run-dir", str(fresh.root), "--strategy", str(strategy), "--attempt", "2",
         "--max-steps", str(upto)], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=240,
    )  # fmt: skip
    assert fresh.read_exit(2) is not None and fresh.read_exit(2).name == "STOPPED", by_hand.stderr[-3000:]
    return losses(fresh, 2, upto)


def test_schedule_to_fewer_nodes_resubmits_with_one_node(slurm_run):
    """dp·tp·pp 4 → 2: two nodes → one node × 2 processes, through a new job submitted with --nodes=1."""
    schedule = f"[{{samples: 0, strategy: '{S4}'}}, {{samples: 800, strategy: '{S2}'}}]"
    slurm_run.start("--set", "policy.name=schedule", "--set", f"policy.schedule={schedule}")
    slurm_run.finish()
    first, second = slurm_run.attempt_json(1, "launch.json"), slurm_run.attempt_json(2, "launch.json")
    assert (first["nnodes"], first["nproc_per_node"]) == (2, 2)
    assert (second["nnodes"], second["nproc_per_node"], second["mode"]) == (1, 2, "submit"), second
    assert second["job_id"] != first["job_id"] and second["submission"] != first["submission"]
    assert len(slurm_run.attempt_json(1, "slurm.json")["nodelist"].split(",")) == 2
    assert len(slurm_run.attempt_json(2, "slurm.json")["nodelist"].split(",")) == 1
    script = (slurm_run.run.root / "slurm" / "cona.sbatch").read_text()
    assert "#SBATCH --requeue" in script
    out = _sh("scontrol", "show", "job", "-o", second["job_id"]).stdout
    assert "NumNodes=1 " in out, out  # sbatch --nodes=1 (the job is kept MinJobAge=300 s after its end)
    assert len(slurm_run.events("launch")) == 2
    assert_samples(slurm_run, 1600)


def test_a_job_slurm_will_never_start_fails_the_run_with_what_to_fix(slurm_run):
    """A job pending for a reason that waiting does not resolve (here a `--dependency` on a job that failed:
    DependencyNeverSatisfied) is cancelled past `slurm.pending_timeout_s`, and the run fails in one line naming the
    reason and what to fix; before, it pended for ever."""
    failed = _sh("sbatch", "--parsable", "--output=/dev/null", "--wrap", "false").stdout.strip().split(";")[0]
    wait_for(lambda: slurm_state(failed) == "FAILED", timeout=60, what=f"job {failed} to fail")
    slurm_run.start("--policy", f"fixed:{S4}", "--profile-set", f'slurm.extra_sbatch=["--dependency=afterok:{failed}"]',
                    "--profile-set", "slurm.pending_timeout_s=3")  # fmt: skip
    job = slurm_run.job_id()
    assert slurm_run.proc is not None
    slurm_run.proc.wait(timeout=120)
    last = slurm_run.output().strip().splitlines()[-1]
    assert slurm_run.proc.returncode == 2, slurm_run.logs()
    assert last.startswith(f"cona: error: attempt 1 could not start: job {job} PENDING (DependencyNeverSatisfied): "
                           "Slurm will not start it, the --dependency in slurm.extra_sbatch"), last  # fmt: skip
    assert f"once fixed, `cona run --resume {slurm_run.run.root} --profile-set slurm.FIELD=VALUE`" in last, last
    timeout = slurm_run.events("pending-timeout")
    assert len(timeout) == 1 and timeout[0]["action"] == "fail", slurm_run.logs()
    assert [e["status"] for e in slurm_run.events("attempt-end")] == ["unstartable"], slurm_run.logs()
    wait_for(lambda: slurm_state(job) in ("CANCELLED", ""), timeout=60, what=f"job {job} cancelled")
    # The fix it asks for, on the same run: the resume submits without the dependency and trains to the end.
    resumed = subprocess.run(
        [sys.executable, "-m", "cona.orchestrator.cli", "run", "--resume", str(slurm_run.run.root), "--quiet",
         "--no-report", "--profile-set", "slurm.extra_sbatch=[]"],
        cwd=REPO, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert resumed.returncode == 0, f"{resumed.stdout[-3000:]}{resumed.stderr[-3000:]}\n{slurm_run.logs()}"
    assert [e["profile_set"] for e in slurm_run.events("profile-amended")] == [["slurm.extra_sbatch=[]"]]
    assert "--dependency" not in (slurm_run.run.root / "slurm" / "cona.sbatch").read_text()
    assert_samples(slurm_run, 1600)


def test_scancel_mid_run_resubmits_and_resumes(slurm_run):
    slurm_run.start("--policy", f"fixed:{S4}")
    job = slurm_run.job_id()
    slurm_run.running(steps=12)
    subprocess.run(["scancel", job], check=True)
    slurm_run.wait(lambda: len(slurm_run.events("launch")) >= 2, 240, "a second launch after scancel")
    state = slurm_run.finish()
    end = slurm_run.events("attempt-end")[0]
    assert end["attempt"] == 1 and end["status"] in ("stopped", "crashed"), end
    # SIGTERM makes the trainer checkpoint and exit 43; attempt 2 resumes from that checkpoint
    trainer_exit = slurm_run.run.read_exit(1)
    resume = slurm_run.resumes(2)[0]
    assert resume["resume"] >= 10, resume
    if end["status"] == "stopped":
        assert trainer_exit is not None, "the trainer wrote no exit record"
        assert (trainer_exit.exit_code, trainer_exit.step) == (43, resume["resume"]), trainer_exit
    second = slurm_run.attempt_json(2, "launch.json")
    assert second["mode"] == "submit" and second["job_id"] != job
    assert slurm_state(job) == "CANCELLED"
    assert_samples(slurm_run, state.live["samples"])


def test_usr1_and_scontrol_requeue_resume_in_the_same_job(slurm_run):
    """The pre-timeout signal (simulated: USR1 to the batch shell) makes the job checkpoint and requeue itself;
    an admin's `scontrol requeue` requeues it again. The orchestrator follows both (the attempt is PENDING, no
    hang is declared) and the samples stay exact."""
    slurm_run.start("--policy", f"fixed:{S4}")
    job = slurm_run.job_id()
    slurm_run.running(steps=12)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    slurm_run.wait(lambda: slurm_run.attempt_json(1, "slurm.json").get("restarts") == 1, 240,
                   "attempt 1 started again after the USR1 requeue")  # fmt: skip
    first_resume = slurm_run.wait(lambda: slurm_run.resumes(1)[1:], 240, "the requeued trainer's resume")[0]
    slurm_run.wait(lambda: slurm_run.steps(1) >= first_resume["resume"] + 5, 240, "training after the requeue")
    subprocess.run(["scontrol", "requeue", job], check=True)
    slurm_run.wait(lambda: slurm_run.attempt_json(1, "slurm.json").get("restarts") == 2, 240,
                   "attempt 1 started again after scontrol requeue")  # fmt: skip
    state = slurm_run.finish()
    events = slurm_run.events()
    assert [e["attempt"] for e in events if e["event"] == "launch"] == [1], slurm_run.logs()
    assert not [e for e in events if e["event"] in ("heartbeat-gap", "failure")], slurm_run.logs()
    pending = [e for e in events if e["event"] == "pending"]
    assert sum("requeued" in e["detail"] for e in pending) >= 1, pending
    archived = sorted(slurm_run.run.attempt_dir(1).glob("slurm-exit.*.json"))
    usr1 = json.loads(archived[0].read_text())
    assert (usr1["code"], usr1["action"], usr1["signal"], usr1["job_id"]) == (43, "requeue", "USR1", job), usr1
    resumes = slurm_run.resumes(1)
    assert len(resumes) == 3 and resumes[1]["resume"] >= 12 and resumes[2]["resume"] > resumes[1]["resume"]
    assert_samples(slurm_run, state.live["samples"])
    assert state.live["samples"] >= 1600


def test_resubmission_waits_until_the_previous_job_has_ended(cluster, tmp_path):  # noqa: F811
    """Never two attempts at once: a resubmission cancels the previous job and submits only once Slurm reports it
    ended — here a job whose SIGTERM handling takes seconds (trainers checkpointing), and one that Slurm has
    requeued (it would otherwise run the attempt again)."""
    marker = tmp_path / "ended"
    slow_exit = f"trap 'sleep 4; date +%s.%N > {marker}; exit 0' TERM; sleep 600 & wait; sleep 600 & wait"
    backend = SlurmBackend(run_dir=RunDir(tmp_path / "run"), profile=load_profile(PROFILE),
                           env={"CONA_SLURM_DRY_RUN": "1"})  # the new job only prints its settings  # fmt: skip
    jobs = []
    try:
        for requeued in (False, True):
            job = _sh("sbatch", "--parsable", "--requeue", "--nodes=1", "-o", "/dev/null", "--wrap", slow_exit)
            jobs.append(job.stdout.strip())
            wait_until(lambda: slurm_state(jobs[-1]) == "RUNNING", 120, f"job {jobs[-1]} running")
            time.sleep(1)  # the trap is set
            if requeued:
                subprocess.run(["scontrol", "requeue", jobs[-1]], check=True)
                wait_until(lambda: slurm_state(jobs[-1]) == "PENDING", 120, f"job {jobs[-1]} requeued")
            previous = Attempt(1, Strategy.parse(S4), backend_id=jobs[-1], extra={"submission": "old", "nnodes": 2})
            marker.unlink(missing_ok=True)
            new = backend.launch(attempt=2, strategy=Strategy.parse(S4), previous=previous)
            jobs.append(new.backend_id)
            state = slurm_state(previous.backend_id)
            assert state in ("CANCELLED", "COMPLETED"), state  # ended, not COMPLETING or PENDING
            if not requeued:
                assert marker.exists()  # its processes were gone before the next job was submitted
            assert new.backend_id != previous.backend_id and new.extra["mode"] == "submit"
        time.sleep(3)
        assert slurm_state(jobs[2]) == "CANCELLED"  # the requeued job does not come back
    finally:
        for job in jobs:
            _sh("scancel", job)


def wait_until(predicate, timeout: float, what: str) -> None:
    wait_for(predicate, timeout=timeout, what=what, detail=lambda: _sh("squeue").stdout)


def _step_processes(run_dir: Path, node: str) -> list[int]:
    """The trainer and torchrun-agent processes of this run that Slurm started on `node`."""
    from tests.faults import SlurmCluster

    return SlurmCluster.step_processes(run_dir, node)


@pytest.mark.slow
def test_node_failure_is_detected_and_the_run_finishes(slurm_run):
    """n2 dies: its slurmd is killed and its trainer processes freeze (nothing on the node answers any more).
    Slurm marks n2 DOWN and requeues the job; the orchestrator follows the requeue or resubmits (never both:
    attempts never overlap), waits while the job is pending for lack of nodes, and finishes once n2 is back."""
    pidfile = Path("/run/cona-slurm/slurmd-n2.pid")
    if not pidfile.exists() or os.geteuid() != 0:
        pytest.skip("needs the cluster of slurm/local-cluster.sh, as root")
    slurm_run.start("--policy", f"fixed:{S4}")
    job = slurm_run.job_id()
    slurm_run.running(steps=12)
    frozen = _step_processes(slurm_run.run.root, "n2")
    assert frozen, "no process of the job on n2"
    try:
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

        def detected() -> bool:
            seen = [e.get("detail", "") for e in slurm_run.events() if e["event"] in ("pending", "failure")]
            return any("n2 DOWN" in d for d in seen)

        slurm_run.wait(detected, 180, "the orchestrator to see n2 DOWN")
    finally:
        subprocess.run([str(LOCAL_CLUSTER), "restart-node", "n2"], capture_output=True, timeout=180)
        for pid in set(frozen) & set(_step_processes(slurm_run.run.root, "n2")):  # normally gone by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    state = slurm_run.finish()
    launches = slurm_run.events("launch")
    if len(launches) == 1:  # followed Slurm's requeue of the job
        assert slurm_run.attempt_json(1, "slurm.json")["restarts"] >= 1
    else:  # resubmitted after the crash: the old job was cancelled first
        assert slurm_state(job) in ("CANCELLED", "NODE_FAIL", "FAILED", "COMPLETED"), slurm_state(job)
        assert slurm_run.attempt_json(2, "launch.json")["job_id"] != job
    last = max(e["attempt"] for e in launches)
    assert slurm_run.resumes(last)[-1]["resume"] >= 10  # from the last complete checkpoint
    assert_samples(slurm_run, state.live["samples"])
    assert state.live["samples"] >= 1600
