"""The lifecycle loop's recovery rules, on a scripted backend that runs nothing (no processes, no I/O but files)."""

from __future__ import annotations

import dataclasses

import pytest
from cona.orchestrator.backends.base import Attempt, AttemptStatus, Backend, Outcome
from cona.orchestrator.job import load_job
from cona.orchestrator.profile import load_profile
from cona.orchestrator.runstate import (
    RunState,
    SwitchRequest,
    create_run,
    read_events,
    read_state,
    write_state,
)
from cona.orchestrator.scheduler import Scheduler
from cona.orchestrator.switchcost import SwitchKind
from cona.protocol.rundir import ExitCode, RunDir
from cona.protocol.strategy import Strategy

from tests.conftest import EXAMPLES, PROFILES

A = Strategy.parse("dp=1,tp=1,pp=4,mbs=4,gbs=16")
B = Strategy.parse("dp=2,tp=1,pp=2,mbs=16,gbs=64")


class ScriptedBackend(Backend):
    """Every attempt is 'running' until the test sets its exit code; launches are recorded, nothing runs."""

    name = "local"
    supports_in_place_switch = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.launched: list[tuple[int, Strategy]] = []
        self.exit_codes: dict[int, int] = {}

    def render(self, *, strategy: Strategy) -> str:
        return ""

    def launch(self, *, attempt: int, strategy: Strategy, previous: Attempt | None = None) -> Attempt:
        self.write_launch(attempt, strategy)
        self.launched.append((attempt, strategy))
        return Attempt(number=attempt, strategy=strategy, backend_id=f"job{attempt}")

    def poll(self, attempt: Attempt) -> Outcome:
        code = self.exit_codes.get(attempt.number)
        if code is None:
            return Outcome(AttemptStatus.RUNNING)
        return Outcome(AttemptStatus.from_exit_code(code), exit_code=code)

    def cancel(self, attempt: Attempt) -> None:
        self.exit_codes.setdefault(attempt.number, 1)

    def continued(self, attempt: Attempt, *, number: int, strategy: Strategy) -> Attempt:
        return dataclasses.replace(attempt, number=number, strategy=strategy)


@pytest.fixture
def run(tmp_path):
    profile = load_profile(PROFILES / "local-cpu.yaml")
    job = load_job(EXAMPLES / "tiny-gpt.yaml", ["data.path=examples/tiny-gpt.yaml"])
    run_dir = RunDir(tmp_path / "run")
    create_run(run_dir=run_dir, profile=profile, job=job)
    backend = ScriptedBackend(run_dir=run_dir, profile=profile, job=job)
    return Scheduler(run_dir=run_dir, profile=profile, job=job, backend=backend, poll_interval_s=0.01), backend


def _state_with_attempt_one(run_dir: RunDir, **fields) -> None:
    write_state(run_dir, RunState(status="running", run_started=1.0, attempts_started=1,
                                  attempts=[Attempt(number=1, strategy=A, backend_id="job1")], **fields))  # fmt: skip


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
