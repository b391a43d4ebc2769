"""The trainer's hold at a schedule's switch point (`SwitchPoints`), with real torchrun processes (gloo, 2 ranks):
a user's `checkpoint` command during the hold is served without ending it, and a hold that times out never trains
past the point."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cona.protocol import rundir
from cona.protocol.rundir import ControlRecord, ExitCode, RunDir, SwitchPoints, read_jsonl

from tests.trainer_helpers import REPO, describe, heartbeats, launch, trainer_command, trainer_env, write_job

DP2 = "dp=2,tp=1,pp=1,mbs=4,gbs=16"
POINT = 32
"""Step 2 (samples [16, 32)) reaches it: the trainer holds after step 2."""

pytestmark = pytest.mark.distributed


def _wait_for(what: str, condition: Callable[[], bool], proc: subprocess.Popen, timeout: float = 180) -> None:
    """Wait on the run's state, not on the clock: generous, for a loaded machine."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"the trainer exited {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} within {timeout:.0f}s")
        time.sleep(0.2)


def _trained_steps(run: Path, attempt: int = 0) -> list[int]:
    path = run / "samples" / f"{attempt}.jsonl"
    return [r["step"] for r in read_jsonl(path)[0] if "step" in r] if path.exists() else []


def test_a_checkpoint_command_during_the_hold_is_served_and_the_hold_goes_on(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rd = RunDir(run)
    rd.write_switch_points(SwitchPoints(samples=(POINT,), wait_s=600))
    job = write_job(tmp_path)
    cmd = trainer_command(run, nproc=2, strategy=DP2, job=job, max_steps=8)
    log = tmp_path / "trainer.log"  # a file, not a pipe: nobody reads a pipe while the test waits
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=trainer_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_for("hold heartbeat", lambda: any(hb.get("event") == "hold" for hb in heartbeats(run)), proc)
        rd.write_control(ControlRecord(seq=1, command="checkpoint", reason="user", attempt=0))

        def served() -> bool:
            return any(hb.get("event") == "checkpoint" and "control seq 1" in (hb.get("reason") or "") for hb in heartbeats(run))

        _wait_for("checkpoint heartbeat for the command", served, proc)
        assert (rd.checkpoint_dir(2) / "COMPLETE").exists()

        # Still holding: a `hold` heartbeat (every 5 s) after the checkpoint, and no step past the point.
        def held_after() -> bool:
            events = [hb.get("event") for hb in heartbeats(run)]
            return "hold" in events[events.index("checkpoint") + 1 :]

        _wait_for("hold heartbeat after the checkpoint", held_after, proc)
        assert _trained_steps(run) == [1, 2]
        assert proc.poll() is None

        rd.write_control(ControlRecord(seq=2, command="switch", reason="schedule", attempt=0))
        proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    record = rd.read_exit(0)
    assert record is not None and record.exit_code == ExitCode.SWITCH, log.read_text()[-3000:]
    assert record.step == 2 and _trained_steps(run) == [1, 2]
    # The checkpoint the next attempt resumes from knows the decision's seq, not only the served checkpoint's.
    assert json.loads((rd.checkpoint_dir(2) / "trainer_state.json").read_text())["last_control_seq"] == 2


def test_a_hold_that_times_out_exits_at_the_switch_point_instead_of_training_on(tmp_path):
    """The orchestrator never decides (wait_s 1 in the switch-points record): the trainer checkpoints at the point
    and exits SWITCH with the hold-timeout reason, for the orchestrator to relaunch there under the schedule's
    next strategy; it never trains past the point under the old one."""
    run = tmp_path / "run"
    run.mkdir()
    RunDir(run).write_switch_points(SwitchPoints(samples=(POINT,), wait_s=1))
    job = write_job(tmp_path)
    result = launch(run, nproc=2, strategy=DP2, job=job, max_steps=6)
    assert result.exit is not None and result.exit.exit_code == ExitCode.SWITCH, describe(result)
    assert result.exit.reason.startswith(rundir.HOLD_TIMEOUT_REASON) and result.exit.step == 2, result.exit
    assert result.exit.next_strategy is None  # relaunched, never in place: no strategy was decided
    assert _trained_steps(run) == [1, 2]
    assert (RunDir(run).checkpoint_dir(2) / "COMPLETE").exists()
