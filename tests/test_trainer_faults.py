"""Crashes, corrupt checkpoints, commands and signals (real torchrun, 2 CPU processes, gloo)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cona.protocol.rundir import ControlRecord, ExitCode, RunDir
from cona.protocol.samples_log import audit_samples

try:
    import tests.trainer_helpers as helpers
except ImportError:  # tests/ is not a package here
    import trainer_helpers as helpers

REPO, Launch, describe, heartbeats = helpers.REPO, helpers.Launch, helpers.describe, helpers.heartbeats
launch, step_records, trainer_command = helpers.launch, helpers.step_records, helpers.trainer_command
trainer_env, write_job = helpers.trainer_env, helpers.write_job

STRATEGY = "dp=2,tp=1,pp=1,mbs=4,gbs=16"


class Running:
    """A torchrun launch in the background."""

    def __init__(self, run_dir: Path, *, job: Path, attempt: int, max_steps: int = 1000) -> None:
        self.run_dir, self.attempt = run_dir, attempt
        cmd = trainer_command(run_dir, nproc=2, strategy=STRATEGY, job=job, max_steps=max_steps, attempt=attempt)
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip

    def last_step(self) -> int:
        path = self.run_dir / "samples" / f"{self.attempt}.jsonl"
        steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines()] if path.exists() else []
        return max(steps, default=0)

    def wait_for(self, condition, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.proc.poll() is not None:
                raise AssertionError(f"trainer exited while waiting for {what}:\n{self.proc.communicate()[1][-3000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def workers(self) -> list[int]:
        """torchrun's worker processes (its children running the trainer, not helper processes)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        workers = []
        for pid in out.split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "trainer" in cmdline and "resource_tracker" not in cmdline:
                workers.append(int(pid))
        assert workers, "no trainer worker processes found"
        return workers

    def finish(self, timeout: float = 120) -> Launch:
        stdout, stderr = self.proc.communicate(timeout=timeout)
        exit_data = RunDir(self.run_dir).read_exit(self.attempt)
        return Launch(returncode=self.proc.returncode, exit=exit_data, stdout=stdout, stderr=stderr)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()


def _reference_losses(tmp_path: Path, job: Path, steps: int) -> dict[int, float]:
    ref = tmp_path / "reference"
    result = launch(ref, nproc=0, strategy="dp=1,mbs=8,gbs=16", job=job, max_steps=steps)
    assert result.exit_code == ExitCode.STOPPED, describe(result)
    return {step: hb["train_loss"] for step, hb in step_records(ref, 0).items()}


@pytest.mark.distributed
def test_sigkill_then_relaunch_resumes_from_the_last_intact_checkpoint(tmp_path):
    job = write_job(tmp_path, checkpoint={"interval_steps": 3, "keep": 10})
    run = tmp_path / "run"
    first = Running(run, job=job, attempt=0)
    try:
        first.wait_for(lambda: first.last_step() >= 8, "step 8")
        os.kill(first.workers()[-1], signal.SIGKILL)  # one worker dies mid-step; torchrun tears down the rest
        crashed = first.finish()
    finally:
        first.kill()
    assert crashed.returncode != 0 and crashed.exit is None, "a killed worker must not look like a protocol exit"
    run_dir = RunDir(run)
    complete = run_dir.complete_checkpoints()
    assert len(complete) >= 2, [p.name for p in complete]
    newest = complete[-1]
    newest_step = int(newest.name.split("-")[1])
    # Storage trouble on top: the newest complete checkpoint loses the tail of a shard, and a later one was being
    # written when the job died (no COMPLETE marker).
    shard = sorted(newest.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    half = run_dir.checkpoint_dir(newest_step + 3)
    half.mkdir(exist_ok=True)  # the kill may have left this one half-written already
    (half / "__0_0.distcp").write_bytes(b"\0" * 100)

    resume_step = int(complete[-2].name.split("-")[1])
    final = newest_step + 2
    relaunch = launch(run, nproc=2, strategy=STRATEGY, job=job, attempt=1, max_steps=final)
    assert relaunch.exit_code == ExitCode.STOPPED, describe(relaunch)
    warnings = [line for line in relaunch.stderr.splitlines() if "skipping checkpoint" in line]
    assert any(half.name in line and "COMPLETE" in line for line in warnings), warnings
    assert any(newest.name in line and "truncated" in line for line in warnings), warnings
    resumed = [hb for hb in heartbeats(run, 1) if hb.get("event") == "resume"]
    assert resumed and resumed[0]["step"] == resume_step

    # The relaunch trains the lost steps again on the same samples, with the losses of an uninterrupted run.
    expected = _reference_losses(tmp_path, job, final)
    for step, hb in step_records(run, 1).items():
        assert hb["train_loss"] == pytest.approx(expected[step], abs=1e-5), step
    assert audit_samples(run) == [(16 * k, 16 * k + 16) for k in range(final)]


@pytest.mark.distributed
def test_commands_and_signals(tmp_path):
    job = write_job(tmp_path)
    run = tmp_path / "run"
    run_dir = RunDir(run)

    # A `checkpoint` command checkpoints and continues; a `switch` command checkpoints and exits SWITCH.
    first = Running(run, job=job, attempt=0)
    try:
        first.wait_for(lambda: first.last_step() >= 2, "step 2")
        run_dir.write_control(ControlRecord(seq=1, command="checkpoint"))
        first.wait_for(lambda: any(hb.get("event") == "checkpoint" for hb in heartbeats(run, 0)), "a checkpoint")
        run_dir.write_control(ControlRecord(seq=2, command="switch"))
        switched = first.finish()
    finally:
        first.kill()
    assert switched.exit_code == ExitCode.SWITCH, describe(switched)
    assert "control seq 2" in switched.exit.reason
    checkpoint_events = [hb for hb in heartbeats(run, 0) if hb.get("event") == "checkpoint"]
    assert "control seq 1" in checkpoint_events[0]["reason"]
    switch_step = switched.exit.step
    assert run_dir.latest_checkpoint() == run_dir.checkpoint_dir(switch_step)
    assert run_dir.latest_trainer_state()["last_control_seq"] == 2
    last = heartbeats(run, 0)[-1]
    assert last["event"] == "exit" and last["exit_code"] == ExitCode.SWITCH

    # The relaunch does not act on the old record again (it trains on), and SIGUSR1 to a single worker (Slurm's
    # pre-timeout signal) makes all ranks agree to checkpoint and stop.
    second = Running(run, job=job, attempt=1)
    try:
        second.wait_for(lambda: second.last_step() >= switch_step + 2, "two more steps")
        os.kill(second.workers()[-1], signal.SIGUSR1)
        stopped = second.finish()
    finally:
        second.kill()
    assert stopped.exit_code == ExitCode.STOPPED, describe(stopped)
    assert stopped.exit.reason == "signal SIGUSR1 (1 rank)"
    assert run_dir.latest_checkpoint() == run_dir.checkpoint_dir(stopped.exit.step)

    # SIGTERM to torchrun (preemption): torchrun forwards it, the workers checkpoint and exit STOPPED.
    third = Running(run, job=job, attempt=2)
    try:
        third.wait_for(lambda: third.last_step() >= stopped.exit.step + 2, "two more steps")
        third.proc.send_signal(signal.SIGTERM)
        preempted = third.finish()
    finally:
        third.kill()
    assert preempted.exit_code == ExitCode.STOPPED, describe(preempted)
    assert "SIGTERM" in preempted.exit.reason
    assert run_dir.latest_checkpoint() == run_dir.checkpoint_dir(preempted.exit.step)
    steps = preempted.exit.step
    assert audit_samples(run) == [(16 * k, 16 * k + 16) for k in range(steps)]


@pytest.mark.distributed
def test_an_attempt_run_again_at_a_switch_point_acts_on_the_decision_before_its_first_step(tmp_path):
    """A Slurm job stopped while its trainer held at a switch point (a signal or a stop ended the hold) and was
    requeued: the same attempt starts again, under the same strategy, from the checkpoint written at the hold.
    The orchestrator's decision (here written while the job waited in the queue) must take effect there, before
    any step — one step more moved the switch from samples 208 to 224 and the result off the uninterrupted run's
    (found by `python -m tests.faults --backend slurm`: preempt-usr1, then the job's requeue). A relaunch under the
    next strategy has made the switch already and must not hold."""
    from cona.protocol.rundir import SwitchPoints

    job = write_job(tmp_path)
    run, run_dir = tmp_path / "run", RunDir(tmp_path / "run")
    run.mkdir()
    run_dir.write_switch_points(SwitchPoints(samples=(40,), wait_s=300))
    first = Running(run, job=job, attempt=1)  # gbs 16: step 3 reaches 48 ≥ 40 and holds
    try:
        first.wait_for(lambda: any(hb.get("event") == "hold" for hb in heartbeats(run, 1)), "the hold at 48")
        run_dir.write_control(ControlRecord(seq=1, command="stop", attempt=1))
        stopped = first.finish()
    finally:
        first.kill()
    assert (stopped.exit_code, stopped.exit.step) == (ExitCode.STOPPED, 3), describe(stopped)
    assert run_dir.latest_trainer_state()["decision_due"] is True

    run_dir.write_control(ControlRecord(seq=2, command="switch", attempt=1))
    again = launch(run, nproc=2, strategy=STRATEGY, job=job, attempt=1)
    assert (again.exit_code, again.exit.step) == (ExitCode.SWITCH, 3), describe(again)
    assert "control seq 2" in again.exit.reason
    assert audit_samples(run) == [(0, 16), (16, 32), (32, 48)]

    nxt = launch(run, nproc=2, strategy="dp=2,tp=1,pp=1,mbs=8,gbs=32", job=job, attempt=2, max_steps=5)
    assert (nxt.exit_code, nxt.exit.step) == (ExitCode.STOPPED, 5), describe(nxt)
    assert not [hb for hb in heartbeats(run, 2) if hb.get("event") == "hold"]
    assert audit_samples(run)[-1] == (80, 112)


@pytest.mark.distributed
def test_a_diverged_run_stops_with_one_line_and_its_exit_record(tmp_path):
    """A learning rate far too high: the loss is no longer finite after a step. Every rank has the same all-reduced
    loss and stops; rank 0 says so once (not once per rank) and records it, and the attempt exits 1 (a crash, so
    the orchestrator may relaunch it, not bad input)."""
    job = write_job(tmp_path, optimizer={"lr": 1e30, "min_lr": 1e29, "warmup_samples": 0})
    result = launch(tmp_path / "run", nproc=2, strategy="dp=2,tp=1,pp=1,mbs=4,gbs=16", job=job, max_steps=20)
    assert result.returncode != 0, describe(result)
    said = [line for line in result.stderr.splitlines() if "training diverged" in line]
    assert len(said) == 1 and said[0].startswith("cona trainer: error: training diverged: step "), describe(result)
    assert said[0].endswith("; lower optimizer.lr"), said
    assert result.exit is not None and result.exit.exit_code == 1 and "lower optimizer.lr" in result.exit.reason
