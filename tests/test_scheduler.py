"""The lifecycle loop's recovery rules, on a scripted backend that runs nothing (no processes, no I/O but files)."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable

import pytest
from cona.orchestrator.backends.base import Attempt, AttemptStatus, Backend, BackendError, Outcome
from cona.orchestrator.job import load_job
from cona.orchestrator.live import print_status, status_summary
from cona.orchestrator.profile import load_profile
from cona.orchestrator.report import write_report
from cona.orchestrator.runstate import (
    PendingSpell,
    RunState,
    SwitchRequest,
    create_run,
    log_event,
    read_events,
    read_state,
    request_stop,
    write_state,
)
from cona.orchestrator.scheduler import RunFailed, Scheduler, _resume_reason
from cona.orchestrator.switchcost import SwitchKind
from cona.protocol.rundir import COMPLETE_MARKER, ExitCode, ExitRecord, RunDir, append_jsonl, stop_exit_reason
from cona.protocol.strategy import Strategy

from tests.conftest import EXAMPLES, PROFILES

A = Strategy.parse("dp=1,tp=1,pp=4,mbs=4,gbs=16")
B = Strategy.parse("dp=2,tp=1,pp=2,mbs=16,gbs=64")


class ScriptedBackend(Backend):
    """Every attempt is 'running' until the test sets its exit code or outcome; launches are recorded, nothing
    runs. `checkpoint_per_attempt`: each launch leaves a new complete checkpoint behind (progress)."""

    name = "local"
    supports_in_place_switch = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.launched: list[tuple[int, Strategy]] = []
        self.exit_codes: dict[int, int] = {}
        self.outcomes: dict[int, Outcome] = {}
        self.cancelled: list[int] = []
        self.calls: list[tuple[str, int]] = []
        """("launch" | "release", attempt) in order."""
        self.release_error: str | None = None
        self.timeout: float | None = None
        self.checkpoint_per_attempt = False

    @property
    def pending_timeout_s(self) -> float | None:
        return self.timeout

    def render(self, *, strategy: Strategy) -> str:
        return ""

    def launch(self, *, attempt: int, strategy: Strategy, previous: Attempt | None = None) -> Attempt:
        self.write_launch(attempt, strategy)
        self.launched.append((attempt, strategy))
        self.calls.append(("launch", attempt))
        if self.checkpoint_per_attempt:
            checkpoint = self.run_dir.checkpoint_dir(10 * attempt)
            checkpoint.mkdir(parents=True)
            (checkpoint / COMPLETE_MARKER).touch()
        return Attempt(number=attempt, strategy=strategy, backend_id=f"job{attempt}")

    def poll(self, attempt: Attempt) -> Outcome:
        if attempt.number in self.outcomes:
            return self.outcomes[attempt.number]
        code = self.exit_codes.get(attempt.number)
        if code is None:
            return Outcome(AttemptStatus.RUNNING)
        return Outcome(AttemptStatus.from_exit_code(code), exit_code=code)

    def cancel(self, attempt: Attempt) -> None:
        self.cancelled.append(attempt.number)
        self.exit_codes.setdefault(attempt.number, 1)

    def continued(self, attempt: Attempt, *, number: int, strategy: Strategy) -> Attempt:
        return dataclasses.replace(attempt, number=number, strategy=strategy)

    def release(self, attempt: Attempt) -> None:
        self.calls.append(("release", attempt.number))
        if self.release_error:
            raise BackendError(self.release_error)


def make_scheduler(root, *overrides: str, on_update: Callable | None = None) -> tuple[Scheduler, ScriptedBackend]:
    profile = load_profile(PROFILES / "local-cpu.yaml")
    job = load_job(EXAMPLES / "tiny-gpt.yaml", ["data.path=examples/tiny-gpt.yaml", *overrides])
    run_dir = RunDir(root / "run")
    create_run(run_dir=run_dir, profile=profile, job=job)
    backend = ScriptedBackend(run_dir=run_dir, profile=profile, job=job)
    return Scheduler(run_dir=run_dir, profile=profile, job=job, backend=backend, poll_interval_s=0.01,
                     on_update=on_update), backend  # fmt: skip


@pytest.fixture
def run(tmp_path):
    return make_scheduler(tmp_path)


def _state_with_attempt_one(run_dir: RunDir, **fields) -> None:
    write_state(run_dir, RunState(**{"status": "running", "run_started": 1.0, "attempts_started": 1,
                                     "attempts": [Attempt(number=1, strategy=A, backend_id="job1")], **fields}))  # fmt: skip


def test_a_switch_saved_but_never_sent_is_sent_after_a_restart(run):
    sched, backend = run
    request = SwitchRequest(time=2.0, seq=1, source=A, target=B, kind=SwitchKind.IN_PLACE, predicted_s=1.0)
    backend.offer_in_place(Attempt(number=1, strategy=A), number=2, strategy=B)
    _state_with_attempt_one(sched.run_dir, switch_requested=request)
    assert sched.run_dir.read_control() is None  # the orchestrator died before writing it
    attempt = sched.start_or_resume()
    assert attempt is not None and attempt.number == 1
    control = sched.run_dir.read_control()
    assert control is not None and (control.seq, control.command, control.in_place) == (1, "switch", True)
    # The trainer reads the strategy it goes on with from the launch record offered before the request.
    assert sched.run_dir.read_launch(2).strategy == B and sched.run_dir.read_launch(2).in_place


def test_a_switch_exit_follows_the_saved_request(run):
    sched, backend = run
    request = SwitchRequest(time=2.0, seq=1, source=A, target=B, kind=SwitchKind.RELAUNCH)
    _state_with_attempt_one(sched.run_dir, switch_requested=request, control_seq=1)
    attempt = sched.start_or_resume()
    nxt = sched._handle_end(attempt, AttemptStatus.SWITCHED, int(ExitCode.SWITCH), "")
    assert nxt is not None and (nxt.number, nxt.strategy) == (2, B)
    state = read_state(sched.run_dir)
    assert state.switch_requested is None and [a.number for a in state.attempts] == [1, 2]
    assert backend.launched == [(2, B)]


def test_a_switch_exit_nobody_asked_for_resumes_the_same_strategy(run):
    sched, _ = run
    _state_with_attempt_one(sched.run_dir)
    attempt = sched.start_or_resume()
    nxt = sched._handle_end(attempt, AttemptStatus.SWITCHED, int(ExitCode.SWITCH), "")
    assert nxt is not None and (nxt.number, nxt.strategy) == (2, A)
    assert any(e["event"] == "switch-unrequested" for e in read_events(sched.run_dir))


def test_attempt_numbers_are_never_reused_after_a_launch_that_died(run):
    """The number is saved before the launch: an orchestrator that died during it hands out the next one."""
    sched, _ = run
    _state_with_attempt_one(sched.run_dir)
    state = read_state(sched.run_dir)
    state.attempts_started = 2  # attempt 2 was being launched when the orchestrator died
    write_state(sched.run_dir, state)
    attempt = sched.start_or_resume()
    nxt = sched._handle_end(attempt, AttemptStatus.STOPPED, int(ExitCode.STOPPED), "")
    assert nxt is not None and nxt.number == 3


# --- disruptions: the cluster took a pod or node away --------------------------------------------------------------

DISRUPTED = Outcome(AttemptStatus.DISRUPTED, None, "pod exp1-a1-1-x on node n3: EvictionByEvictionAPI (drain)")
CRASHED = Outcome(AttemptStatus.CRASHED, 1, "trainer exited 1")
DONE = Outcome(AttemptStatus.DONE, 0)


def _events(sched: Scheduler, kind: str) -> list[dict]:
    return [e for e in read_events(sched.run_dir) if e["event"] == kind]


def test_every_ended_attempt_is_released_before_the_next_launch(tmp_path):
    sched, backend = make_scheduler(tmp_path, "policy.max_restarts=2")
    backend.outcomes = {1: CRASHED, 2: DISRUPTED, 3: DONE}
    assert sched.run().status == "done"
    assert backend.calls == [("launch", 1), ("release", 1), ("launch", 2), ("release", 2), ("launch", 3),
                             ("release", 3)]  # fmt: skip


def test_a_release_that_fails_is_logged_and_the_run_goes_on(tmp_path):
    sched, backend = make_scheduler(tmp_path, "policy.max_restarts=2")
    backend.outcomes = {1: CRASHED, 2: DONE}
    backend.release_error = "kubernetes: delete jobs 'x': cannot reach the API server"
    assert sched.run().status == "done"
    assert [e["attempt"] for e in _events(sched, "release-failed")] == [1, 2]


def test_disruptions_in_a_row_finish_with_max_restarts_0(tmp_path):
    sched, backend = make_scheduler(tmp_path, "policy.max_restarts=0")
    backend.outcomes = {1: DISRUPTED, 2: DISRUPTED, 3: DISRUPTED, 4: DONE}
    state = sched.run()
    assert state.status == "done" and state.restarts_in_row == 0
    assert [n for n, _ in backend.launched] == [1, 2, 3, 4]
    assert len({strategy for _, strategy in backend.launched}) == 1  # relaunched with the same strategy
    disruptions = _events(sched, "disruption")
    assert [e["attempt"] for e in disruptions] == [1, 2, 3]
    assert all(e["detail"] == DISRUPTED.detail for e in disruptions)
    assert not _events(sched, "failure")
    ends = [(e["attempt"], e["status"]) for e in _events(sched, "attempt-end")]
    assert ends == [(1, "disrupted"), (2, "disrupted"), (3, "disrupted"), (4, "done")]
    reasons = [e["reason"] for e in _events(sched, "launch")]
    assert reasons[1:] == ["relaunch after a disruption"] * 3
    # The first launch says why it starts where it does (the cona policy under its prior).
    assert reasons[0] == "initial strategy: " + sched.model.policy.start(
        candidates=[c for c in sched.candidates if c.strategy.world_size == sched.profile.num_gpus],
        throughput=sched.model.throughput)[1]
    assert "B_noise=" in reasons[0]


def test_a_disruption_does_not_consume_max_restarts(tmp_path):
    sched, backend = make_scheduler(tmp_path, "policy.max_restarts=1")
    backend.outcomes = {1: CRASHED, 2: DISRUPTED, 3: DISRUPTED, 4: DONE}
    state = sched.run()
    assert state.status == "done" and state.restarts_in_row == 1  # only the crash
    assert [e["restart"] for e in _events(sched, "failure")] == [1]


def test_a_disruption_does_not_forgive_a_crash(tmp_path):
    """Crash, disruption, crash with max_restarts=1: the second crash is the second restart in a row."""
    sched, backend = make_scheduler(tmp_path, "policy.max_restarts=1")
    backend.outcomes = {1: CRASHED, 2: DISRUPTED, 3: CRASHED}
    with pytest.raises(RunFailed, match=r"attempt 3 crashed .*gave up after 1 restarts"):
        sched.run()
    assert read_state(sched.run_dir).status == "failed"


def test_an_attempt_that_refused_its_input_fails_the_run_at_once_with_its_line(tmp_path):
    """The trainer's exit 2 (a damaged model.init_from, no loadable checkpoint) was taken for a crash: relaunched
    max_restarts times with backoff, each refusing alike, then failed as `torchrun exited 2` without the reason."""
    reason = "model.init_from: /hf/config.json: n_embd is '64', not an integer; fix config.json (model.hidden_size)"

    def trainer_refuses(live) -> None:  # once attempt 1 runs (an exit record before it would be a run's leftover)
        sched.run_dir.write_exit(1, ExitRecord(exit_code=ExitCode.CONFIG, name="CONFIG", reason=reason, step=None,
                                               time=1.0))  # fmt: skip
        backend.exit_codes = {1: ExitCode.CONFIG}

    sched, backend = make_scheduler(tmp_path, "policy.max_restarts=3", on_update=trainer_refuses)
    with pytest.raises(RunFailed) as info:
        sched.run()
    # The record says not where the fix lies (`fix`, `cona.protocol.inputs`): both ways are offered.
    assert str(info.value).startswith(f"attempt 1 refused its input: {reason}; fix files on disk and resume with "
                                      f"`cona run --resume {sched.run_dir.root}`, or, for a job field, start a new "
                                      "run (another --run-dir) with the corrected job; logs: ")  # fmt: skip
    assert [n for n, _ in backend.launched] == [1] and not _events(sched, "failure")
    assert read_state(sched.run_dir).status == "failed"


def test_resuming_a_stopped_run_removes_the_served_stop(tmp_path):
    """A stop served at step 33 whose checkpoint is then found damaged: the relaunch resumes from step 30, whose
    trainer state has not seen the stop's seq, and stopped again at its first step (an attempt wasted)."""
    sched, backend = make_scheduler(tmp_path)
    request_stop(sched.run_dir)
    backend.exit_codes = {1: ExitCode.STOPPED}
    assert sched.run().status == "stopped" and sched.run_dir.read_control() is not None
    again = Scheduler(run_dir=sched.run_dir, profile=sched.profile, job=sched.job, poll_interval_s=0.01,
                      backend=ScriptedBackend(run_dir=sched.run_dir, profile=sched.profile, job=sched.job))  # fmt: skip
    again.backend.exit_codes = {1: ExitCode.STOPPED, 2: ExitCode.DONE}  # 1 found ended, as it is
    assert again.run().status == "done" and sched.run_dir.read_control() is None
    # The resume relaunches at once, saying so; attempt 1's end was handled when it ended, not a second time as a
    # preemption.
    events = read_events(sched.run_dir)
    assert [e["attempt"] for e in events if e["event"] == "attempt-end"] == [1, 2]
    assert [e["reason"] for e in events if e["event"] == "launch"][1] == "resume of the stopped run"


def test_a_run_resumed_days_after_its_stop_keeps_its_time_budget(tmp_path):
    """The time a stopped run lay ended trained nothing: `target.max_time_s` and the elapsed time that `cona run`
    prints count the run's time. Before, a run stopped overnight hit its budget at once on `--resume`."""
    sched, backend = make_scheduler(tmp_path, "target.max_time_s=3600")
    request_stop(sched.run_dir)
    backend.exit_codes = {1: ExitCode.STOPPED}
    assert sched.run().status == "stopped"
    state = read_state(sched.run_dir)
    ran = state.finished_at - state.run_started
    day = 86_400.0
    state.run_started -= 2 * day  # the stop was two days ago
    state.finished_at -= 2 * day
    write_state(sched.run_dir, state)
    again = Scheduler(run_dir=sched.run_dir, profile=sched.profile, job=sched.job, poll_interval_s=0.01,
                      backend=ScriptedBackend(run_dir=sched.run_dir, profile=sched.profile, job=sched.job))  # fmt: skip
    again.backend.exit_codes = {1: ExitCode.STOPPED, 2: ExitCode.DONE}  # 1 found ended, as it is
    assert again.run().status == "done"
    events = read_events(sched.run_dir)
    assert "time-budget" not in [e["event"] for e in events]
    done = next(e for e in events if e["event"] == "done")
    assert ran <= done["elapsed_s"] < ran + 60
    # Carried in state.json: an orchestrator restarted later still leaves the pause out.
    assert read_state(sched.run_dir).paused_s == pytest.approx(2 * day, abs=60)


# --- what happened while no orchestrator watched (killed, Ctrl-C) -----------------------------------------------------


def test_a_stop_a_trainer_served_while_its_orchestrator_was_gone_is_a_stopped_run_the_resume_goes_on_with(tmp_path):
    """`cona stop` of a run whose orchestrator was gone reached its trainer, which checkpointed and exited 100 s ago.
    The first `cona run --resume` logged the run stopped now and ended, training nothing; a second resume trained,
    and the report counted the time before the first one as wall time. The run stopped when its trainer did: it is
    logged so, the time since is a pause, and the resume goes on at once."""
    sched, backend = make_scheduler(tmp_path)
    _state_with_attempt_one(sched.run_dir)
    seq = request_stop(sched.run_dir, attempt=1)  # `cona stop` of the orphaned attempt 1
    exited = time.time() - 100
    sched.run_dir.write_exit(1, ExitRecord(exit_code=ExitCode.STOPPED, name="STOPPED", reason=stop_exit_reason(seq),
                                           step=21, time=exited))  # fmt: skip
    backend.exit_codes = {1: ExitCode.STOPPED, 2: ExitCode.DONE}
    assert sched.run().status == "done"
    assert [n for n, _ in backend.launched] == [2]
    stopped = _events(sched, "stopped")
    assert len(stopped) == 1 and stopped[0]["at"] == exited, stopped
    assert _events(sched, "resume-run")[0]["previous_status"] == "stopped"
    assert [e["reason"] for e in _events(sched, "launch")] == ["resume of the stopped run"]
    assert read_state(sched.run_dir).paused_s == pytest.approx(100, abs=30)
    assert sched.run_dir.read_control() is None  # served: the relaunch must not see it


def test_a_stop_sent_to_a_trainer_that_crashed_before_serving_it_ends_with_it(tmp_path):
    """The orchestrator was killed, `cona stop` was sent to its trainer, which crashed before its next step: the
    stop stayed in control.json, and the resume's relaunch served it after one step (a second resume finished).
    It was for that trainer alone: dropped, said so, and the relaunch trains."""
    sched, backend = make_scheduler(tmp_path)
    _state_with_attempt_one(sched.run_dir)
    seq = request_stop(sched.run_dir, attempt=1)
    backend.exit_codes = {1: 1, 2: ExitCode.DONE}  # killed without an exit record
    launched_with: list = []
    launch = backend.launch

    def launch_and_note(**kw):
        launched_with.append(sched.run_dir.read_control())
        return launch(**kw)

    backend.launch = launch_and_note  # type: ignore[method-assign]
    state = sched.run()
    assert state.status == "done" and not state.stop_requested
    assert launched_with == [None], launched_with
    dropped = _events(sched, "stop-dropped")
    assert [(e["attempt"], e["seq"]) for e in dropped] == [(1, seq)], dropped
    assert "ended before it served the stop (its processes are gone without an exit record)" in dropped[0]["reason"]


def test_what_the_trainer_did_while_no_orchestrator_watched_is_dated_when_it_happened(tmp_path):
    """Ctrl-C of `cona run` during an in-place switch: the trainer went on as attempt 2 and finished. The resume
    logged attempt 2's launch (and the report's strategies table started it) when it saw it, 50 s late; the run's
    end, when it saw that."""
    sched, backend = make_scheduler(tmp_path)
    now = time.time()
    request = SwitchRequest(time=now - 60, seq=1, source=A, target=B, kind=SwitchKind.IN_PLACE, predicted_s=1.0)
    backend.offer_in_place(Attempt(number=1, strategy=A), number=2, strategy=B)
    _state_with_attempt_one(sched.run_dir, switch_requested=request, control_seq=1, run_started=now - 100)
    append_jsonl(sched.run_dir.events, {"time": now - 100, "event": "start", "strategy": A.to_dict()})
    append_jsonl(sched.run_dir.events, {"time": now - 100, "event": "launch", "attempt": 1, "strategy": A.to_dict(),
                                        "reason": "initial strategy"})  # fmt: skip
    sched.run_dir.write_exit(1, ExitRecord(exit_code=ExitCode.SWITCH, name="SWITCH", reason="switch in place", step=30,
                                           time=now - 50, next_attempt=2, next_strategy=B))  # fmt: skip
    sched.run_dir.write_exit(2, ExitRecord(exit_code=ExitCode.DONE, name="DONE", reason="max_samples", step=80,
                                           time=now - 20))  # fmt: skip
    backend.exit_codes = {1: ExitCode.DONE, 2: ExitCode.DONE}  # the processes' status, read through attempt 2
    state = sched.run()
    assert state.status == "done" and backend.launched == []  # followed in place, nothing launched
    launch = _events(sched, "launch")[-1]
    assert (launch["attempt"], launch["reason"], launch["at"]) == (2, "switch in place", now - 50)
    assert state.attempts[-1].started_at == now - 50 and state.strategy_since == now - 50
    done = _events(sched, "done")[0]
    assert done["at"] == now - 20 and state.finished_at == now - 20
    assert done["elapsed_s"] == pytest.approx(80, abs=1)
    report = write_report(sched.run_dir)[1].read_text()
    assert "| 2 | 50.0 | `d2t1p2 m16 g64` |" in report, report


def test_a_crash_without_an_exit_record_is_still_relaunched(tmp_path):
    sched, backend = make_scheduler(tmp_path, "policy.max_restarts=1")
    backend.exit_codes = {1: ExitCode.CONFIG, 2: ExitCode.DONE}  # exit 2 from something else than the trainer's line
    assert sched.run().status == "done" and [n for n, _ in backend.launched] == [1, 2]


def test_disruptions_without_a_newer_checkpoint_fail_the_run(tmp_path):
    sched, backend = make_scheduler(tmp_path, "policy.max_disruptions_without_progress=1")
    backend.outcomes = {1: DISRUPTED, 2: DISRUPTED, 3: DONE}
    with pytest.raises(RunFailed) as info:
        sched.run()
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"attempt 2 disrupted ({DISRUPTED.detail}); gave up after 2 "
                                                      "disruptions in a row without a newer complete checkpoint")
    state = read_state(sched.run_dir)
    assert state.status == "failed" and state.reason in message and [n for n, _ in backend.launched] == [1, 2]


def test_disruptions_with_progress_between_them_go_on(tmp_path):
    """Each attempt leaves a newer checkpoint: however many disruptions, none is without progress."""
    sched, backend = make_scheduler(tmp_path, "policy.max_disruptions_without_progress=0", "policy.max_restarts=0")
    backend.checkpoint_per_attempt = True
    backend.outcomes = {1: DISRUPTED, 2: DISRUPTED, 3: DISRUPTED, 4: DONE}
    assert sched.run().status == "done"
    names = [sched.run_dir.checkpoint_dir(step).name for step in (10, 20, 30)]
    assert [(e["checkpoint"], e["without_progress"]) for e in _events(sched, "disruption")] == [(n, 0) for n in names]


def test_a_disrupted_attempt_of_a_run_asked_to_stop_is_not_relaunched(run):
    sched, backend = run
    _state_with_attempt_one(sched.run_dir, stop_requested=True, control_seq=1)
    attempt = sched.start_or_resume()
    assert sched._handle_end(attempt, AttemptStatus.DISRUPTED, None, DISRUPTED.detail) is None
    assert read_state(sched.run_dir).status == "stopped" and backend.launched == []


def test_a_disruption_seen_after_a_hang_cancel_is_the_hang(run):
    """The scheduler cancelled the attempt for a heartbeat gap: whatever the pods report then, it hung."""
    sched, _ = run
    _state_with_attempt_one(sched.run_dir, hang_cancelled=1)
    attempt = sched.start_or_resume()
    nxt = sched._handle_end(attempt, AttemptStatus.DISRUPTED, None, DISRUPTED.detail)
    assert nxt is not None and nxt.number == 2
    assert read_state(sched.run_dir).restarts_in_row == 1
    assert [e["kind"] for e in _events(sched, "failure")] == ["hang"] and not _events(sched, "disruption")


# --- pending: queued, unschedulable, or waiting for an image -------------------------------------------------------


def test_an_attempt_that_runs_again_after_a_pending_spell_gets_the_startup_timeout(run):
    """A Slurm job requeued (`scontrol requeue`, a node failure, the pre-timeout USR1) is PENDING, then starts the
    attempt again in new processes: until its first heartbeat that is a start-up, not a hang. The heartbeat timeout
    (30 s in the fault suite) cancelled such a restart on a loaded machine (found by the Slurm fault suite); a gap
    after a heartbeat, or a start-up past the startup timeout, is still a hang."""
    sched, backend = run
    _state_with_attempt_one(sched.run_dir)
    attempt = sched.start_or_resume()
    assert attempt is not None
    timeout, startup = sched.job.policy.heartbeat_timeout_s, sched.job.policy.startup_timeout_s
    assert startup > timeout + 10
    now = time.time()
    sched.state.launched_at = now - 10 * startup
    sched.state.last_heartbeat_time = now - timeout - 20  # trained, then the job was requeued
    sched.state.pending_seen_at = now - timeout - 5  # the last poll that saw it queued
    sched._check_hang(attempt)
    assert backend.cancelled == [] and not _events(sched, "heartbeat-gap")
    sched.state.last_heartbeat_time = now - startup - 20
    sched.state.pending_seen_at = now - startup - 5  # restarted, but no heartbeat within the startup timeout
    sched._check_hang(attempt)
    assert backend.cancelled == [1] and _events(sched, "heartbeat-gap")[0]["timeout_s"] == startup
    backend.cancelled.clear()
    sched.state.last_heartbeat_time, sched.state.pending_seen_at = now - timeout - 5, now - timeout - 20
    sched._check_hang(attempt)  # running again, heartbeats came, then stopped: the plain timeout
    assert backend.cancelled == [1] and _events(sched, "heartbeat-gap")[-1]["timeout_s"] == timeout

INSUFFICIENT = "0/4 nodes are available: 4 Insufficient nvidia.com/gpu"
BAD_IMAGE = "image ghcr.io/x:y cannot be pulled (ImagePullBackOff: Back-off pulling image)"


def test_the_pending_reason_reaches_state_json_and_cona_status(tmp_path, capsys):
    seen: list[dict] = []

    def script(live) -> None:
        summary = status_summary(sched.run_dir)
        seen.append(summary)
        if len(seen) == 3:
            backend.outcomes[1] = Outcome(AttemptStatus.RUNNING)
        elif len(seen) == 5:
            backend.outcomes[1] = DONE

    sched, backend = make_scheduler(tmp_path, on_update=script)
    backend.timeout = 3600.0
    backend.outcomes[1] = Outcome(AttemptStatus.PENDING, None, INSUFFICIENT)
    before = time.time()
    assert sched.run().status == "done"
    pending = seen[0]["pending"]
    assert pending["attempt"] == 1 and pending["detail"] == INSUFFICIENT and not pending["timed_out"]
    assert before <= pending["since"] <= time.time() and pending["for_s"] >= 0
    assert seen[0]["status"] == "running"
    assert seen[3]["pending"] is None  # running: no longer shown
    assert read_state(sched.run_dir).pending is None
    assert [e["detail"] for e in _events(sched, "pending")] == [INSUFFICIENT]  # one spell, one event
    assert not _events(sched, "pending-timeout")  # not before the timeout
    print_status(seen[0])
    assert re.search(rf"^pending    for \d+s: {re.escape(INSUFFICIENT)}$", capsys.readouterr().out, re.M)


def test_pending_for_capacity_past_the_timeout_is_reported_once_and_waits(tmp_path, capsys):
    after: list[dict] = []  # `cona status` at each loop after the timeout; 5 of them, then the attempt ends

    def script(live) -> None:
        if _events(sched, "pending-timeout"):
            after.append(status_summary(sched.run_dir))
            if len(after) == 5:
                backend.outcomes[1] = DONE

    sched, backend = make_scheduler(tmp_path, on_update=script)
    backend.timeout = 0.05
    backend.outcomes[1] = Outcome(AttemptStatus.PENDING, None, INSUFFICIENT)
    assert sched.run().status == "done"
    assert after[0]["pending"]["timed_out"] and after[0]["pending"]["for_s"] >= 0.05
    print_status(after[0])
    assert f"past the pending timeout: {INSUFFICIENT}" in capsys.readouterr().out
    timeouts = _events(sched, "pending-timeout")
    assert len(timeouts) == 1 and backend.cancelled == [] and [n for n, _ in backend.launched] == [1]
    assert (timeouts[0]["attempt"], timeouts[0]["detail"], timeouts[0]["action"]) == (1, INSUFFICIENT, "wait")
    assert timeouts[0]["pending_s"] >= 0.05 and timeouts[0]["timeout_s"] == 0.05


def test_a_queue_wait_past_the_timeout_is_not_news_where_the_backend_says_so(tmp_path):
    """Slurm: a job in the queue for hours is the norm, and `slurm.pending_timeout_s` is for stuck reasons only."""
    loops = {"n": 0}

    def script(live) -> None:
        loops["n"] += 1
        time.sleep(0.01)  # past the timeout from the second loop on
        if loops["n"] == 5:
            spell = read_state(sched.run_dir).pending
            assert time.time() - spell.since > backend.timeout and not spell.timed_out
            backend.outcomes[1] = DONE

    sched, backend = make_scheduler(tmp_path, on_update=script)
    backend.timeout, backend.reports_long_queue_waits = 0.01, False
    backend.outcomes[1] = Outcome(AttemptStatus.PENDING, None, INSUFFICIENT)
    assert sched.run().status == "done"
    assert not _events(sched, "pending-timeout") and backend.cancelled == []


def test_a_stuck_attempt_past_the_timeout_fails_the_run_with_its_reason(tmp_path):
    sched, backend = make_scheduler(tmp_path, "policy.max_restarts=3")
    backend.timeout = 0.05
    backend.outcomes[1] = Outcome(AttemptStatus.PENDING, None, BAD_IMAGE, stuck=True)
    with pytest.raises(RunFailed) as info:
        sched.run()
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"attempt 1 could not start: {BAD_IMAGE}; pending ")
    assert f"(timeout 0s); once fixed, `cona run --resume {sched.run_dir.root}`; logs: " in message, message
    state = read_state(sched.run_dir)
    assert state.status == "failed" and state.reason.startswith(f"attempt 1 could not start: {BAD_IMAGE}")
    assert state.pending is None and state.restarts_in_row == 0
    assert backend.cancelled == [1] and [n for n, _ in backend.launched] == [1]  # not relaunched
    assert [e["action"] for e in _events(sched, "pending-timeout")] == ["fail"]
    assert [e["status"] for e in _events(sched, "attempt-end")] == ["unstartable"]


def test_a_stuck_attempt_before_the_timeout_waits(tmp_path):
    """The kubelet retries a pull: within the timeout, a stuck reason is only reported."""
    loops = {"n": 0}

    def script(live) -> None:
        loops["n"] += 1
        if loops["n"] == 5:
            backend.outcomes[1] = DONE

    sched, backend = make_scheduler(tmp_path, on_update=script)
    backend.timeout = 3600.0
    backend.outcomes[1] = Outcome(AttemptStatus.PENDING, None, BAD_IMAGE, stuck=True)
    assert sched.run().status == "done"
    assert not _events(sched, "pending-timeout") and backend.cancelled == []


def test_the_pending_clock_survives_an_orchestrator_restart(tmp_path):
    """The spell began 100 s ago under the previous orchestrator: the timeout of 50 s is already past."""
    sched, backend = make_scheduler(tmp_path)
    spell = PendingSpell(attempt=1, since=time.time() - 100, detail=BAD_IMAGE, stuck_since=time.time() - 100)
    _state_with_attempt_one(sched.run_dir, pending=spell)
    backend.timeout = 50.0
    backend.outcomes[1] = Outcome(AttemptStatus.PENDING, None, BAD_IMAGE, stuck=True)
    with pytest.raises(RunFailed, match=r"could not start: .*; pending 10\ds \(timeout 50s\)"):
        sched.run()
    assert not _events(sched, "pending")  # the same spell: not announced again
    assert len(_events(sched, "pending-timeout")) == 1


def test_a_reason_that_turns_stuck_after_a_queue_wait_gets_the_whole_grace(tmp_path):
    """Slurm: hours pending for `Priority`, then `PartitionDown` — the timeout counts from the first stuck poll, and a
    stuck reason that clears (the partition is up again) starts the count afresh the next time."""
    polls: list[PendingSpell] = []

    def script(live) -> None:
        polls.append(read_state(sched.run_dir).pending)
        if len(polls) == 2:  # the partition came back up before the timeout
            backend.outcomes[1] = Outcome(AttemptStatus.PENDING, None, INSUFFICIENT)
        elif len(polls) == 3:
            backend.outcomes[1] = Outcome(AttemptStatus.PENDING, None, BAD_IMAGE, stuck=True)
        elif len(polls) == 5:
            sched.state.pending.stuck_since = time.time() - 60  # 60 s stuck by the next poll: past the timeout

    sched, backend = make_scheduler(tmp_path, on_update=script)
    now = time.time()
    _state_with_attempt_one(sched.run_dir, pending=PendingSpell(attempt=1, since=now - 7200, detail=INSUFFICIENT))
    backend.timeout, backend.reports_long_queue_waits = 50.0, False
    backend.outcomes[1] = Outcome(AttemptStatus.PENDING, None, BAD_IMAGE, stuck=True)
    with pytest.raises(RunFailed, match=r"could not start: .*; pending 720\ds, stuck 6\ds \(timeout 50s\)"):
        sched.run()
    first, cleared, again = polls[0], polls[2], polls[3]
    assert first.stuck_since is not None and first.stuck_since >= now  # from the first stuck poll, not `since`
    assert cleared.stuck_since is None and again.stuck_since > first.stuck_since
    assert [e["action"] for e in _events(sched, "pending-timeout")] == ["fail"]
    assert backend.cancelled == [1]


def test_nothing_feasible_is_said_as_render_says_it(tmp_path):
    """5 nodes of 8 A100s: tiny-gpt's power-of-two batches split over no layout of 40 devices (the factor 5 is more
    pipeline stages than its 4 layers, and no tp divides its heads by it). A scheduler that
    finds nothing feasible (a resumed run, the Kubernetes orchestrator) says so in the words `cona run`/`render`/
    `submit` use before the run exists (`cli.first_strategy`), with the odd factor that is the cause."""
    from cona.orchestrator.cli import UserError, first_strategy

    profile = load_profile(PROFILES / "a100-4x8.yaml", ["nodes=5"])
    job = load_job(EXAMPLES / "tiny-gpt.yaml")
    run_dir = RunDir(tmp_path / "run")
    with pytest.raises(RunFailed) as scheduler:
        Scheduler(run_dir=run_dir, profile=profile, job=job, backend=ScriptedBackend(run_dir=run_dir, profile=profile,
                                                                                     job=job))  # fmt: skip
    with pytest.raises(UserError) as render:
        first_strategy(profile, job)
    assert str(scheduler.value) == str(render.value) == (
        "no feasible strategy for tiny-gpt on a100-4x8; 40 devices have the factor 5, and none of the global "
        "batches [8, 16, 32, 64, 128] is a multiple of it: give e.g. batch.gbs_choices=[10, 20, 40, 80] with "
        "batch.base_gbs=20, or use a power-of-two number of devices; run `cona plan --all` to see why"
    )


def test_drive_says_nothing_feasible_in_one_line(tmp_path):
    """A stored run for which nothing is feasible any more (resumed after the cost or memory model changed) ends
    `drive` with the one-line reason, as every other failure does, not with a traceback from the constructor."""
    from cona.orchestrator.runstate import create_run
    from cona.orchestrator.scheduler import drive

    profile = load_profile(PROFILES / "a100-4x8.yaml", ["nodes=5"])
    job = load_job(EXAMPLES / "tiny-gpt.yaml")
    run_dir = RunDir(tmp_path / "run")
    create_run(run_dir=run_dir, profile=profile, job=job)
    state, failure = drive(run_dir=run_dir, profile=profile, job=job, quiet=True)
    assert failure is not None and failure.startswith("no feasible strategy for tiny-gpt on a100-4x8;")
    assert "\n" not in failure and state.status == "created"


class _ElasticScripted(ScriptedBackend):
    """ScriptedBackend that also records the planning table each launch was given (`elastic`)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.tables: list[dict[int, Strategy] | None] = []

    def launch(self, *, attempt: int, strategy: Strategy, previous: Attempt | None = None,
               elastic: dict[int, Strategy] | None = None) -> Attempt:  # fmt: skip
        self.tables.append(elastic)
        return super().launch(attempt=attempt, strategy=strategy, previous=previous)


def test_an_elastic_runs_relaunch_may_start_on_fewer_nodes_and_runs_the_same_strategy_on_all(tmp_path):
    """A crash or a disruption of an elastic run: the relaunch may begin on fewer nodes (down to min_nodes) with the
    planning table's strategy for them, as the start and a shrink do; with the node count fixed it waited in the
    queue for a node drained or gone meanwhile. On all its nodes it is the same strategy (a relaunch is no switch)."""
    profile = load_profile(PROFILES / "local-slurm.yaml", ["min_nodes=1"])  # 2 nodes × 2 processes
    job = load_job(EXAMPLES / "tiny-gpt.yaml", ["data.path=examples/tiny-gpt.yaml", "policy.name=fixed",
                                                "policy.strategy=dp=2,tp=1,pp=2,mbs=2,gbs=16"])  # fmt: skip
    run_dir = RunDir(tmp_path / "run")
    create_run(run_dir=run_dir, profile=profile, job=job)
    backend = _ElasticScripted(run_dir=run_dir, profile=profile, job=job)
    sched = Scheduler(run_dir=run_dir, profile=profile, job=job, backend=backend, poll_interval_s=0.01)
    backend.outcomes = {1: CRASHED, 2: DISRUPTED, 3: DONE}
    assert sched.run().status == "done"
    fixed = Strategy.parse("dp=2,tp=1,pp=2,mbs=2,gbs=16")
    assert [s for _, s in backend.launched] == [fixed] * 3
    assert all(t is not None and set(t) == {1, 2} and t[2] == fixed and t[1].world_size == 2 for t in backend.tables)
    reasons = [e["reason"] for e in _events(sched, "elastic-plan")]
    assert reasons == ["start", "relaunch after crashed", "relaunch after a disruption"], reasons
    # A run that is not elastic relaunches on its node count, as before.
    plain, scripted = make_scheduler(tmp_path / "plain")
    scripted.outcomes = {1: CRASHED, 2: DONE}
    assert plain.run().status == "done" and not _events(plain, "elastic-plan")


@pytest.mark.parametrize(
    ("reason", "launch"),
    [
        ("signal SIGUSR1 (4 ranks)", "resume after SIGUSR1 (4 ranks)"),  # Slurm's signal ahead of the time limit
        ("signal SIGTERM (1 rank)", "resume after SIGTERM (1 rank)"),  # a preemption, a deleted pod
        ("stop (control seq 3)", "resume after a stop on request"),
        ("max_steps", "resume after a stop: max_steps"),
        ("", "resume after a stop from outside"),
        (None, "resume after a stop from outside"),
    ],
)
def test_the_relaunch_after_a_stop_says_what_stopped_it(reason, launch):
    # It said "resume after preemption" for every stop, a Slurm time limit and a deleted pod among them.
    record = None if reason is None else ExitRecord(ExitCode.STOPPED, "STOPPED", reason, 10, time.time())
    assert _resume_reason(record) == launch


# --- a switch that its attempt ended without making -----------------------------------------------------------------


def _decide_switch(sched: Scheduler, attempt: Attempt, target: Strategy) -> None:
    """What `Scheduler._evaluate` does for a decided switch: the request saved and sent, its `switch` event."""
    request = SwitchRequest(time=time.time(), seq=sched._next_seq(), source=attempt.strategy, target=target,
                            kind=SwitchKind.RELAUNCH)  # fmt: skip
    sched.state.switch_requested = request
    sched._send_switch(request, "schedule: samples 208 ≥ 200", attempt=attempt.number)
    log_event(sched.run_dir, "switch", attempt=attempt.number, **{"from": attempt.strategy.to_dict()},
              to=target.to_dict(), reason="schedule: samples 208 ≥ 200")  # fmt: skip


def test_a_switch_a_crash_aborted_is_counted_and_listed_once(tmp_path, capsys):
    """The crash relaunches from a checkpoint before the switch and the policy decides it again there: `cona
    status` said `switches 2` and listed the one switch twice, and so did the report."""
    from cona.orchestrator.report import write_report

    sched, _ = make_scheduler(tmp_path, "policy.max_restarts=2")
    first = sched.start_or_resume()
    assert first is not None
    _decide_switch(sched, first, B)
    second = sched._handle_end(first, AttemptStatus.CRASHED, 1, "torchrun exited 1")  # before the switch
    assert second is not None and second.strategy == first.strategy
    aborted = _events(sched, "switch-aborted")
    assert [(e["attempt"], e["to"], e["reason"]) for e in aborted] == [
        (1, B.to_dict(), "attempt 1 ended (crashed) before it switched")
    ]
    _decide_switch(sched, second, B)  # decided again at the same point, and made this time
    third = sched._handle_end(second, AttemptStatus.SWITCHED, int(ExitCode.SWITCH), "")
    assert third is not None and third.strategy == B
    assert len(_events(sched, "switch-aborted")) == 1

    summary = status_summary(sched.run_dir)
    assert [(s["from"], s["to"]) for s in summary["switches"]] == [(first.strategy.to_dict(), B.to_dict())]
    assert [s["aborted"] for s in summary["aborted_switches"]] == ["attempt 1 ended (crashed) before it switched"]
    print_status(summary)
    out = capsys.readouterr().out
    assert "switches   1\n" in out and "aborted, attempt 1 ended (crashed) before it switched: " in out
    _, md = write_report(sched.run_dir)
    report = md.read_text()
    assert "switches: 1\n" in report
    assert report.count("(not counted)") == 1


def test_a_switch_the_relaunch_makes_anyway_is_not_aborted(tmp_path, monkeypatch):
    """A trainer killed after its switch checkpoint and before its exit record: the relaunch runs the target (the
    schedule's strategy where the checkpoint is), so the switch went ahead."""
    sched, _ = make_scheduler(tmp_path, "policy.max_restarts=2")
    first = sched.start_or_resume()
    assert first is not None
    _decide_switch(sched, first, B)
    monkeypatch.setattr(sched, "_relaunch_strategy", lambda attempt: B)
    second = sched._handle_end(first, AttemptStatus.CRASHED, 1, "torchrun exited 1")
    assert second is not None and second.strategy == B
    assert not _events(sched, "switch-aborted")
    assert len(status_summary(sched.run_dir)["switches"]) == 1
