"""The scheduler against bad run-directory input and the schedule's exact switch points, on the scripted backend
of tests/test_scheduler.py (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

from cona.orchestrator.backends.base import Attempt, AttemptStatus
from cona.orchestrator.runstate import read_events
from cona.protocol.rundir import COMPLETE_MARKER, TRAINER_STATE, SwitchPoints
from cona.protocol.strategy import Strategy

from tests.test_scheduler import A, _state_with_attempt_one, make_scheduler

SCHEDULE = ("policy.name=schedule",
            "policy.schedule=[{samples: 0, strategy: 'dp=1,tp=1,pp=4,mbs=4,gbs=16'}, "
            "{samples: 200, strategy: 'dp=2,tp=1,pp=2,mbs=16,gbs=64'}, "
            "{samples: 300, strategy: 'dp=2,tp=1,pp=2,mbs=16,gbs=64'}]")  # fmt: skip
B = Strategy.parse("dp=2,tp=1,pp=2,mbs=16,gbs=64")


def test_garbage_heartbeat_lines_are_skipped_and_logged_never_fatal(tmp_path):
    sched, _ = make_scheduler(tmp_path)
    _state_with_attempt_one(sched.run_dir)
    attempt = sched.start_or_resume()
    good = {"time": 1.0, "attempt": 1, "strategy": A.to_dict(), "step": 2, "samples": 32, "tokens": 1, "train_loss": 3.0,
            "lr": 1e-3, "step_time_s": 0.1, "samples_per_s": 160.0}  # fmt: skip
    lines = [
        json.dumps(good), "not json", "[1, 2]", json.dumps({**good, "samples": "many"}),
        json.dumps({**good, "step": None}), json.dumps({**good, "step_time_s": [1]}), json.dumps({"step": 3}),
        json.dumps({**good, "event": "checkpoint-skipped", "reason": "skipping checkpoint X: Y is missing"}),
        json.dumps({**good, "event": "checkpoint-restored", "reason": "restored checkpoint X from .resave-X"}),
    ]  # fmt: skip
    path = sched.run_dir.heartbeat_file(1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(("\n".join(lines) + "\n").encode() + b'{"torn": ')
    assert attempt is not None
    sched._absorb(attempt, sched._tail_heartbeats(attempt))
    assert sched.live.samples == 32
    events = read_events(sched.run_dir)
    bad = [e for e in events if e["event"] == "bad-heartbeat"]
    # The two lines that are not JSON objects (by byte position), the three mistyped records and the one missing
    # its fields: each is said, none is silently lost; the torn tail is not (it may still be being written).
    assert len(bad) == 6
    assert [e["record"] for e in bad[:2]] == [f"{path}: the line at byte {at} is not a JSON object"
                                              for at in (len(lines[0]) + 1, len(lines[0]) + len(lines[1]) + 2)]
    # A mistyped record is said by what is wrong with it, not by its Python repr (cut before the bad field).
    assert [e["record"] for e in bad[2:]] == [
        f"{path}: heartbeat field samples is not a number: 'many' (the record of step 2)",
        f"{path}: heartbeat field step is null",
        f"{path}: heartbeat field step_time_s is not a number: [1] (the record of step 2)",
        f"{path}: heartbeat record lacks field(s) time, attempt, strategy, samples, tokens, train_loss, lr, step_time_s, "
        "samples_per_s (the record of step 3)",
    ]
    assert [e["detail"] for e in events if e["event"] == "checkpoint-skipped"] == ["skipping checkpoint X: Y is missing"]
    assert [e["detail"] for e in events if e["event"] == "checkpoint-restored"] == ["restored checkpoint X from .resave-X"]
    assert sched.state.heartbeat_offset == path.read_bytes().rfind(b"\n") + 1  # the torn tail is read next time


def test_the_switch_points_are_written_before_the_first_launch(tmp_path):
    sched, backend = make_scheduler(tmp_path, *SCHEDULE)
    sched.start_or_resume()
    points = sched.run_dir.read_switch_points()
    assert points.samples == (200,)  # the entry at 300 keeps the strategy: nothing to wait for there
    assert points.wait_s >= 120
    assert backend.launched == [(1, A)]


def _switch_checkpoint(sched) -> Path:
    """A complete checkpoint at step 13, samples 208: the first step boundary past the switch point 200."""
    checkpoint = sched.run_dir.checkpoint_dir(13)
    checkpoint.mkdir(parents=True)
    (checkpoint / TRAINER_STATE).write_text(json.dumps({"step": 13, "samples": 208}))
    (checkpoint / COMPLETE_MARKER).write_text("{}")
    return checkpoint


def test_a_relaunch_takes_the_schedules_strategy_for_where_training_resumes(tmp_path):
    """A trainer killed after its switch checkpoint at 208 but before its exit record: the relaunch must train
    from 208 under the next entry's strategy, as the uninterrupted run did."""
    sched, backend = make_scheduler(tmp_path, *SCHEDULE, "policy.max_restarts=5")
    attempt = sched.start_or_resume()
    assert attempt is not None and attempt.strategy == A
    checkpoint = _switch_checkpoint(sched)
    sched.job.policy.heartbeat_timeout_s = 1e9
    nxt = sched._handle_end(attempt, AttemptStatus.CRASHED, 1, "killed")
    assert nxt is not None and nxt.strategy == B
    assert backend.launched[-1] == (2, B)
    # Before the point, the relaunch keeps the attempt's own strategy.
    (checkpoint / TRAINER_STATE).write_text(json.dumps({"step": 12, "samples": 192}))
    again = sched._handle_end(Attempt(number=2, strategy=A), AttemptStatus.CRASHED, 1, "killed")
    assert again is not None and again.strategy == A


def test_switch_points_round_trip_and_crossing():
    points = SwitchPoints(samples=(200, 600), wait_s=30)
    assert SwitchPoints.from_dict(json.loads(json.dumps(points.to_dict()))) == points
    assert points.crossed(192, 208) and points.crossed(184, 200) and not points.crossed(200, 216)
    assert not points.crossed(0, 16)


def test_a_relaunched_attempt_ignores_the_switch_meant_for_the_one_before(tmp_path):
    """Attempt 1 was killed while saving its switch checkpoint; attempt 2 resumes from an older checkpoint (its
    last handled seq predates the switch) and must not act on attempt 1's switch record. `cona stop` (no attempt)
    reaches whichever attempt runs."""
    from cona.protocol.rundir import ControlRecord, RunDir
    from cona.trainer.control import Action, ControlState

    run = RunDir(tmp_path)
    control = ControlState(last_seq=-1)
    run.write_control(ControlRecord(seq=1, command="switch", in_place=True, attempt=1))
    assert control.poll(run, 2) is Action.NONE
    assert control.poll(run, 1) is Action.SWITCH
    run.write_control(ControlRecord(seq=2, command="switch", attempt=2))
    assert control.poll(run, 2) is Action.SWITCH
    run.write_control(ControlRecord(seq=3, command="stop"))
    assert control.poll(run, 7) is Action.STOP


def test_a_trainer_whose_hold_timed_out_is_relaunched_at_the_switch_point(tmp_path):
    """The trainer checkpointed at the switch point 208 and exited SWITCH with the hold-timeout reason (no decision
    came): the orchestrator relaunches there under the schedule's next strategy, counting no restart."""
    from cona.protocol.rundir import HOLD_TIMEOUT_REASON, ExitCode, ExitRecord

    sched, backend = make_scheduler(tmp_path, *SCHEDULE)
    attempt = sched.start_or_resume()
    assert attempt is not None and attempt.strategy == A
    _switch_checkpoint(sched)
    reason = f"{HOLD_TIMEOUT_REASON}: no decision 120s after samples 208; relaunch there under the schedule's strategy"
    sched.run_dir.write_exit(1, ExitRecord(exit_code=int(ExitCode.SWITCH), name="SWITCH", reason=reason, step=13, time=0.0))
    nxt = sched._handle_end(attempt, AttemptStatus.SWITCHED, int(ExitCode.SWITCH), reason)
    assert nxt is not None and nxt.strategy == B
    assert backend.launched[-1] == (2, B)
    assert sched.state.restarts_in_row == 0
    events = read_events(sched.run_dir)
    assert [e["detail"] for e in events if e["event"] == "hold-timeout"] == [reason]
    assert "switch-unrequested" not in [e["event"] for e in events]
