"""The orchestrator end to end on the local backend: real `cona run`, real torchrun, real trainer (CPU/gloo)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cona.orchestrator.job import load_job
from cona.orchestrator.runstate import read_events, read_state
from cona.protocol.procstat import alive as process_alive
from cona.protocol.rundir import RunDir
from cona.protocol.samples_log import audit_samples

from tests.conftest import REPO

pytestmark = pytest.mark.distributed

PROFILE = str(REPO / "slurm" / "profiles" / "local-cpu.yaml")
TINY = str(REPO / "examples" / "tiny-gpt.yaml")
SHORT = [  # a short run: 100 steps of gbs 16, about 30 s of training on 2 cores
    "--set", "target.max_samples=1600", "--set", "target.val_perplexity=null", "--set", "eval.interval_samples=800",
    "--set", "checkpoint.interval_steps=10", "--set", "policy.heartbeat_timeout_s=90", "--set", "optimizer.warmup_samples=256",
]  # fmt: skip
# The switch must be decided before the trainer reaches max_samples, by an orchestrator that starts again after
# being killed: on an idle machine 100 steps take about 20 s, so the schedule switches halfway and decisions come
# every second (with 1200 and the default 5 s, the trainer sometimes finished the last 400 samples first).
SCHEDULE = [
    "--set", "policy.name=schedule", "--set", "policy.decision_interval_s=1",
    "--set", "policy.schedule=[{samples: 0, strategy: 'dp=4,tp=1,pp=1,mbs=4,gbs=16'}, "
             "{samples: 800, strategy: 'dp=2,tp=1,pp=2,mbs=4,gbs=32'}]",
]  # fmt: skip


def cona(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "cona.orchestrator.cli", *args], cwd=REPO, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs,
    )  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"cona run did not finish in {timeout}s:\n{out[-3000:]}")
    return out


def wait_for(predicate, *, timeout: float, what: str, detail=None) -> None:
    """Poll `predicate` until it holds; on time-out fail, appending `detail()` (e.g. the queue) when given."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    pytest.fail(f"timed out after {timeout}s waiting for {what}" + (f"\n{detail()}" if detail else ""))


def heartbeats(run_dir: RunDir, attempt: int) -> list[dict]:
    path = run_dir.heartbeat_file(attempt)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip().endswith("}")]


def worker_pids(run_dir: Path) -> list[int]:
    """Trainer worker processes of this run (not torchrun, not the shell wrapper)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        text = b" ".join(argv).decode(errors="replace")
        if "-m cona.trainer" in text and str(run_dir) in text and "torch.distributed.run" not in text and "/bin/sh" not in text:
            pids.append(int(proc.name))
    return pids


def assert_attempts_never_overlap(run_dir: RunDir) -> None:
    events = read_events(run_dir)
    open_attempt = None
    for e in events:
        if e["event"] == "launch":
            assert open_attempt is None, f"attempt {e['attempt']} launched while {open_attempt} was still running"
            open_attempt = e["attempt"]
        elif e["event"] == "attempt-end":
            assert e["attempt"] == open_attempt
            open_attempt = None


def assert_samples_exact(run_dir: RunDir) -> int:
    ranges = audit_samples(run_dir)
    assert ranges and ranges[0][0] == 0
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert start == end
    return ranges[-1][1]


@pytest.mark.slow
def test_main_command_switches_and_reaches_target(tmp_path):
    """The README's main command: tiny GPT, local backend, 4 processes, cona policy."""
    run_dir = RunDir(tmp_path / "run")
    proc = cona("run", "--profile", PROFILE, "--job", TINY, "--run-dir", str(run_dir.root))
    out = finish(proc, timeout=900)
    assert proc.returncode == 0, out[-3000:]
    state = read_state(run_dir)
    job = load_job(TINY)
    assert state.status == "done"
    assert state.live["val_perplexity"] <= job.target.val_perplexity, out[-2000:]
    switches = [e for e in read_events(run_dir) if e["event"] == "switch"]
    # The cost model ranks one layout first at every batch on the local CPU profile; the probe of a layout that
    # never ran (docs/decisions.md) is what changes the degrees, the noise scale what changes the batch.
    assert any(s["from"]["gbs"] != s["to"]["gbs"] for s in switches), f"no switch changed gbs: {switches}"
    layout = [(s["from"]["dp"], s["from"]["tp"], s["from"]["pp"]) != (s["to"]["dp"], s["to"]["tp"], s["to"]["pp"])
              for s in switches]  # fmt: skip
    assert any(layout), f"no switch changed the degrees: {switches}"
    assert_attempts_never_overlap(run_dir)
    total = assert_samples_exact(run_dir)
    assert total == state.live["samples"]
    assert (run_dir.root / "report.png").stat().st_size > 10_000
    assert "report:" in out
    report = (run_dir.root / "report.md").read_text()
    assert f"covers samples 0–{total - 1:,} once each, in order, across " in report, report


@pytest.mark.slow
def test_orchestrator_killed_and_restarted_adopts_the_attempt(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    args = ("run", "--profile", PROFILE, "--job", TINY, "--run-dir", str(run_dir.root), *SHORT, *SCHEDULE)
    first = cona(*args)
    wait_for(lambda: len(heartbeats(run_dir, 1)) >= 3, timeout=120, what="attempt 1 heartbeats")
    # While it runs, a second orchestrator for the same run is refused.
    second = cona("run", "--resume", str(run_dir.root))
    out = finish(second, timeout=60)
    assert second.returncode == 2 and "another cona orchestrator" in out
    first.send_signal(signal.SIGKILL)
    first.communicate()
    assert worker_pids(run_dir.root), "the trainer must survive its orchestrator"
    time.sleep(2)
    again = cona(*args)  # the same command again
    out = finish(again, timeout=400)
    assert again.returncode == 0, out[-3000:]
    events = read_events(run_dir)
    assert any(e["event"] == "adopt" and e["attempt"] == 1 for e in events), out[-2000:]
    assert read_state(run_dir).status == "done"
    assert_attempts_never_overlap(run_dir)
    # The switch lands at a step boundary after sample 800 and the last step may run past the budget by less
    # than one global batch; every sample is still consumed exactly once.
    total = assert_samples_exact(run_dir)
    assert total == read_state(run_dir).live["samples"]
    assert 1600 <= total < 1600 + 32
    assert [e["strategy"]["gbs"] for e in events if e["event"] == "launch"] == [16, 32]


# A run that only has to go on after an event at its first checkpoint (step 10, sample 160): half of SHORT.
AFTER_FIRST_CHECKPOINT = ["--set", "target.max_samples=800"]


@pytest.mark.slow
def test_killed_worker_is_recovered_from_the_last_checkpoint(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    proc = cona("run", "--profile", PROFILE, "--job", TINY, "--run-dir", str(run_dir.root), *SHORT,
                *AFTER_FIRST_CHECKPOINT, "--policy", "fixed:dp=4,tp=1,pp=1,mbs=4,gbs=16")  # fmt: skip
    wait_for(lambda: run_dir.latest_checkpoint() is not None, timeout=180, what="a complete checkpoint")
    victims = worker_pids(run_dir.root)
    assert len(victims) == 4
    os.kill(victims[-1], signal.SIGKILL)
    out = finish(proc, timeout=400)
    assert proc.returncode == 0, out[-3000:]
    events = read_events(run_dir)
    failures = [e for e in events if e["event"] == "failure"]
    assert failures and failures[0]["attempt"] == 1
    launches = [e for e in events if e["event"] == "launch"]
    assert len(launches) == 2 and launches[1]["strategy"] == launches[0]["strategy"]
    assert_attempts_never_overlap(run_dir)
    assert assert_samples_exact(run_dir) == 800


@pytest.mark.slow
def test_stop_then_resume(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    args = ("run", "--profile", PROFILE, "--job", TINY, "--run-dir", str(run_dir.root), *SHORT,
            "--policy", "fixed:dp=2,tp=1,pp=2,mbs=4,gbs=16")  # fmt: skip
    proc = cona(*args)
    wait_for(lambda: len(heartbeats(run_dir, 1)) >= 3, timeout=120, what="attempt 1 heartbeats")
    stop = subprocess.run([sys.executable, "-m", "cona.orchestrator.cli", "stop", str(run_dir.root)], cwd=REPO,
                          capture_output=True, text=True)  # fmt: skip
    assert stop.returncode == 0, stop.stderr
    out = finish(proc, timeout=120)
    assert proc.returncode == 0, out[-3000:]
    state = read_state(run_dir)
    assert state.status == "stopped"
    stopped_at = state.live["samples"]
    assert 0 < stopped_at < 1600
    status = subprocess.run([sys.executable, "-m", "cona.orchestrator.cli", "status", str(run_dir.root), "--json"],
                            cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert json.loads(status.stdout)["status"] == "stopped"
    resumed = cona("run", "--resume", str(run_dir.root))
    out = finish(resumed, timeout=300)
    assert resumed.returncode == 0, out[-3000:]
    assert read_state(run_dir).status == "done"
    assert assert_samples_exact(run_dir) == 1600


def test_bad_input_fails_fast_with_one_line(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text("to be or not to be " * 5000)
    run_dir = RunDir(tmp_path / "run")
    proc = cona("run", "--profile", PROFILE, "--job", TINY, "--run-dir", str(run_dir.root), *SHORT,
                "--set", f"data.path={data}", "--policy", "fixed:dp=3,tp=1,pp=1,mbs=4,gbs=12")  # fmt: skip
    out = finish(proc, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in out
    assert "policy.strategy" in out.strip().splitlines()[-1]


@pytest.mark.slow
def test_hung_attempt_is_cancelled_and_relaunched(tmp_path):
    """A worker that stops making progress (SIGSTOP) silences the heartbeats: after the timeout the attempt is
    cancelled and relaunched from its last checkpoint."""
    run_dir = RunDir(tmp_path / "run")
    proc = cona("run", "--profile", PROFILE, "--job", TINY, "--run-dir", str(run_dir.root), *SHORT, *AFTER_FIRST_CHECKPOINT,
                "--set", "policy.heartbeat_timeout_s=15", "--policy", "fixed:dp=4,tp=1,pp=1,mbs=4,gbs=16")  # fmt: skip
    wait_for(lambda: run_dir.latest_checkpoint() is not None, timeout=180, what="a complete checkpoint")
    victim = worker_pids(run_dir.root)[0]
    os.kill(victim, signal.SIGSTOP)
    out = finish(proc, timeout=400)
    assert proc.returncode == 0, out[-3000:]
    events = read_events(run_dir)
    gaps = [e for e in events if e["event"] == "heartbeat-gap"]
    assert gaps and gaps[0]["attempt"] == 1 and gaps[0]["seconds"] >= 15
    assert [e["kind"] for e in events if e["event"] == "failure"] == ["hang"]
    # The cancel took every worker of the hung attempt down, the frozen one and those waiting on it in a collective
    # (torchrun runs each worker in a session of its own; they would otherwise outlive it, orphaned).
    assert not process_alive(victim) and worker_pids(run_dir.root) == []
    assert_attempts_never_overlap(run_dir)
    assert assert_samples_exact(run_dir) == 800


@pytest.mark.slow
def test_in_place_switch_continues_exactly_as_a_relaunch(tmp_path):
    """An in-place switch (the processes stay; model, optimizer and meshes are rebuilt for the new layout and batch)
    trains exactly what a fresh torchrun of the new strategy trains from the same checkpoint, bit for bit."""
    schedule = ["--set", "policy.name=schedule", "--set",
                "policy.schedule=[{samples: 0, strategy: 'dp=4,tp=1,pp=1,mbs=4,gbs=16'}, "
                "{samples: 480, strategy: 'dp=2,tp=1,pp=2,mbs=4,gbs=32'}]",
                "--set", "target.max_samples=1120", "--set", "eval.interval_samples=560",
                "--set", "checkpoint.keep=50"]  # fmt: skip
    run_dir = RunDir(tmp_path / "in-place")
    proc = cona("run", "--profile", PROFILE, "--job", TINY, "--run-dir", str(run_dir.root), *SHORT, *schedule)
    out = finish(proc, timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert read_state(run_dir).status == "done"
    assert_attempts_never_overlap(run_dir)
    assert 1120 <= assert_samples_exact(run_dir) < 1120 + 32  # the last gbs-32 step may run past the budget
    attempts = read_state(run_dir).attempts
    assert [a.strategy.gbs for a in attempts] == [16, 32]
    assert attempts[0].backend_id == attempts[1].backend_id, "an in-place switch keeps the processes"
    launch = run_dir.read_launch(2)
    assert launch is not None and launch.in_place and launch.strategy == attempts[1].strategy
    assert launch.extra["launched_as"] == 1
    switched = run_dir.read_exit(1)
    assert switched is not None and switched.next_attempt == 2 and switched.next_strategy.pp == 2
    assert json.loads((run_dir.attempt_dir(2) / "startup.json").read_text())["in_place"] is True
    assert [e["event"] for e in read_events(run_dir)].count("switch-complete") == 1

    # The same checkpoint, relaunched by hand under the new strategy: the same losses step by step.
    step = switched.step
    fresh = RunDir(tmp_path / "relaunch")
    fresh.checkpoints.mkdir(parents=True)
    (fresh.root / "run.yaml").write_text((run_dir.root / "run.yaml").read_text())
    shutil.copytree(run_dir.checkpoint_dir(step), fresh.checkpoint_dir(step))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    by_hand = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m", "cona.trainer",
         "--run-dir", str(fresh.root), "--strategy", "dp=2,tp=1,pp=2,mbs=4,gbs=32", "--attempt", "2",
         "--max-steps", str(step + 5)], cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert fresh.read_exit(2) is not None and fresh.read_exit(2).name == "STOPPED", by_hand.stderr[-3000:]

    def losses(rd: RunDir) -> dict[int, float]:
        # Every step's line: periodic, or "eval" when an evaluation followed the step.
        return {hb["step"]: hb["train_loss"] for hb in heartbeats(rd, 2)
                if hb.get("event") in (None, "eval") and hb["train_loss"] is not None and hb["step"] <= step + 5}  # fmt: skip

    assert sorted(losses(fresh)) == list(range(step + 1, step + 6))
    assert losses(run_dir) == losses(fresh)
