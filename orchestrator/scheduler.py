"""The scheduler loop: launch, poll, follow switches, stops, crashes, hangs, disruptions and pending attempts,
persist (docs/architecture.md).

What the run knows and decides lives in the run model (`runmodel.py`, no I/O); this loop feeds it heartbeats and
the time, carries out its decisions through the backend and control.json, and persists both in state.json. All
state that must survive an orchestrator restart lives there; everything decided is logged in events.jsonl with its
numbers. The loop never runs two attempts at once: it launches only after the previous attempt is known to have
ended, and the run lock keeps a second orchestrator out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn

from cona.orchestrator.backends.base import Attempt, AttemptStatus, Backend, BackendError, Outcome
from cona.orchestrator.elastic import ElasticPlan, is_elastic, node_range, nodes_of, plan_table, write_plan
from cona.orchestrator.job import Job
from cona.orchestrator.planner import Candidate, enumerate_candidates, no_feasible_strategy
from cona.orchestrator.policy import prior_noise_scale
from cona.orchestrator.profile import ClusterProfile
from cona.orchestrator.runmodel import LiveStatus, RunModel, SwitchCompleted
from cona.orchestrator.runstate import (
    STATE_FIX,
    PendingSpell,
    RunState,
    SwitchRequest,
    check_run_yaml,
    end_torn_events,
    log_event,
    read_events,
    read_state,
    stored_measurements,
    used_attempts,
    write_state,
)
from cona.orchestrator.switchcost import SwitchKind
from cona.protocol.heartbeat_record import NOTICE_EVENTS, Heartbeat
from cona.protocol.inputs import FIX_FILES, FIX_JOB
from cona.protocol.rundir import (
    HOLD_TIMEOUT_REASON,
    ControlRecord,
    ExitCode,
    ExitRecord,
    RunDir,
    SwitchPoints,
    read_jsonl,
)
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

if TYPE_CHECKING:
    from cona.orchestrator.tensorboard import TensorBoardWriter

__all__ = ["LiveStatus", "RunFailed", "Scheduler", "device_counts", "drive"]


_PROTOCOL_EXITS = frozenset({ExitCode.DONE, ExitCode.SWITCH, ExitCode.STOPPED})
"""Exit codes whose record's reason is no cause of a crash (a hung attempt cancelled by SIGTERM says `STOPPED`)."""


class RunFailed(Exception):
    """The run cannot go on (too many crashes, an attempt that cannot start, no feasible strategy); the message
    says why."""


class Scheduler:
    """Drives one run to its target on one backend."""

    def __init__(
        self,
        *,
        run_dir: RunDir,
        profile: ClusterProfile,
        job: Job,
        backend: Backend,
        poll_interval_s: float | None = None,
        on_update: Callable[[LiveStatus], None] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.profile = profile
        self.job = job
        self.backend = backend
        self.poll_interval_s = poll_interval_s if poll_interval_s is not None else backend.poll_interval_s
        self.on_update = on_update or (lambda status: None)
        # Only the feasible ones: a run never shows a rejection (`cona plan --all` does), and on a wide elastic range
        # building the rejected ones too took most of a run's start.
        self.candidates: list[Candidate] = [
            c
            for devices in device_counts(profile, job)
            for c in enumerate_candidates(profile=profile, job=job, num_devices=devices, feasible_only=True)
        ]
        if not self.candidates:
            raise RunFailed(no_feasible_strategy(profile, job))
        self.model = RunModel(
            profile=profile, job=job, candidates=self.candidates,
            switch_kind=lambda a, b: backend.switch_kind(a, b, in_place_allowed=job.policy.in_place_switch),
            switch_overhead_s=backend.switch_overhead_s,
        )  # fmt: skip
        # `cona run --measured`: a `cona profile` run's step times, as if this run had measured them (a restored
        # state replaces them with its own, which include them).
        self.model.throughput.absorb(stored_measurements(run_dir))
        self.elastic = is_elastic(profile)
        """`min_nodes` < `nodes`: the run trains on any node count of that range (`cona.orchestrator.elastic`)."""
        self.state = RunState()
        """The loop's own state (attempts, control sequence, heartbeat offset, restarts, ...), with the model's."""
        self.watching_since = time.time()
        """When this orchestrator took the run up (`start_or_resume`): an attempt that ended before it ended while
        no orchestrator watched (`_ended_unwatched`)."""
        self.tensorboard: TensorBoardWriter | None = None
        """`metrics.tensorboard`: the run's one TensorBoard writer, fed as heartbeats are absorbed."""
        if job.metrics.tensorboard:
            from cona.orchestrator.tensorboard import TensorBoardWriter

            self.tensorboard = TensorBoardWriter(run_dir.root)

    @property
    def live(self) -> LiveStatus:
        return self.model.live

    # ----------------------------------------------------------------------------------------------- state

    def _save(self) -> None:
        self.state.model = self.model.to_dict()
        self.state.updated = time.time()
        write_state(self.run_dir, self.state)

    def check_resumable(self) -> RunState:
        """The run's state, or ConfigError in one line naming the file when the run directory cannot be gone on with
        as it is: a run.yaml cut short (its missing sections would be run with their defaults), or a state.json lost
        while the run has attempts (`read_state`). Reads only; `drive` calls it before the live view starts."""
        check_run_yaml(self.run_dir)
        return read_state(self.run_dir, resume=True)

    def _restore(self) -> None:
        self.state = self.check_resumable()
        try:
            self.model.restore(self.state.model)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            # The run model's part of state.json (estimators, measured step times) edited or damaged into valid
            # JSON of other types (`"noise": "x"`) ended the resume in a traceback; say which file and what to do.
            raise ConfigError(f"{self.run_dir.state_json}: its run model ('model') is unreadable ({e}); "
                              f"{STATE_FIX}") from None  # fmt: skip

    @property
    def current(self) -> Attempt | None:
        return self.state.current

    def _launch(
        self, strategy: Strategy, *, previous: Attempt | None, why: str, in_place: bool = False,
        elastic: dict[int, Strategy] | None = None, at: float | None = None,
    ) -> Attempt:  # fmt: skip
        """Start `strategy` as the next attempt; `in_place`: `previous`'s processes already went on as it.

        `elastic`: an elastic (re)start, which the backend may begin on any node count of this table ({node count:
        strategy}, from the planning table) with that count's strategy. `at`: when the attempt began, where that was
        before now (an in-place switch: the previous attempt's exit record), logged as the launch event's `at`."""
        number = self.state.attempts_started + 1
        if not in_place:
            # Processes already went on as an in-place switch's attempt; any other launch starts from a checkpoint.
            self._refuse_lost_progress()
            # state.json from a backup, or older than the run: a number some attempt used would mix two attempts'
            # heartbeats, samples and exit records in one file (the trainer appends to them).
            used = max(used_attempts(self.run_dir, launched=False), default=0)
            if used >= number:
                log_event(self.run_dir, "attempt-numbers-skipped", first=number, last=used,
                          reason="state.json is older than the attempts in the run directory")  # fmt: skip
                number = used + 1
        # Saved before launching: an orchestrator that dies during the launch never hands out the number again.
        self.state.attempts_started = number
        self.state.status, self.state.reason = "running", None  # a failed launch's reason is history now
        self._save()
        self.run_dir.attempt_dir(number).mkdir(parents=True, exist_ok=True)
        try:
            if in_place:
                assert previous is not None
                attempt = self.backend.continued(previous, number=number, strategy=strategy)
            elif elastic is not None:
                attempt = self.backend.launch(attempt=number, strategy=strategy, previous=previous, elastic=elastic)
            else:
                attempt = self.backend.launch(attempt=number, strategy=strategy, previous=previous)
        except (BackendError, ConfigError) as e:  # ConfigError: a profile value the batch script cannot carry
            # Nothing of this attempt runs (`sbatch` missing or refused, an API that does not answer) and the error
            # ends this orchestrator: state.json says so and why (`cona status`: failed, not a run still running).
            # Not final: the same command, `cona run --resume` or a restarted orchestrator pod goes on from here.
            reason = f"attempt {number} could not be launched: {e}; fix that and resume with `cona run --resume " \
                     f"{self.run_dir.root}`"  # fmt: skip
            self.state.status, self.state.reason = "failed", reason
            self.live.status = "failed"
            self._save()
            log_event(self.run_dir, "launch-failed", attempt=number, detail=str(e))
            raise
        if at is not None:
            attempt.started_at = at
        self.state.attempts.append(attempt)
        # Cleared only now: an orchestrator that died during the launch still knows which switch it followed.
        self.state.switch_requested = None
        self.state.heartbeat_offset = 0
        self.model.attempt_started(number, strategy)
        self.state.launched_at = time.time()
        self.state.last_heartbeat_time = None
        self.state.pending = None
        self._save()
        log_event(self.run_dir, "launch", attempt=number, strategy=strategy.to_dict(), reason=why,
                  backend=self.backend.name, backend_id=attempt.backend_id, **({"at": at} if at is not None else {}))  # fmt: skip
        return attempt

    def _refuse_lost_progress(self) -> None:
        """Fail the run, in one line naming the checkpoints, instead of launching a trainer that would find no
        checkpoint and train from sample 0 again after the run had checkpointed progress
        (`RunDir.progress_without_checkpoint`, the one place of that rule)."""
        reason = self.run_dir.progress_without_checkpoint(samples_known=self.live.samples)
        if reason is None:
            return
        self._finish("failed", reason=reason)
        log_event(self.run_dir, "failed", reason=reason)
        raise RunFailed(reason)

    def _next_seq(self) -> int:
        seq = self.state.control_seq + 1
        existing = self.run_dir.read_control()
        if existing is not None and existing.seq >= seq:
            seq = existing.seq + 1  # `cona stop` may have written one meanwhile
        return seq

    def _send(
        self, command: str, *, seq: int | None = None, reason: str = "", in_place: bool = False, attempt: int | None = None
    ) -> int:  # fmt: skip
        seq = self._next_seq() if seq is None else seq
        self.run_dir.write_control(ControlRecord(seq=seq, command=command, reason=reason, in_place=in_place,
                                                 attempt=attempt))  # fmt: skip
        self.state.control_seq = seq
        return seq

    def _send_switch(self, request: SwitchRequest, reason: str, *, attempt: int) -> None:
        self._send("switch", seq=request.seq, reason=reason, in_place=request.in_place, attempt=attempt)

    # ----------------------------------------------------------------------------------------------- heartbeats

    def _tail_heartbeats(self, attempt: Attempt) -> list[Heartbeat]:
        path = self.run_dir.heartbeat_file(attempt.number)
        damaged: list[str] = []
        records, offset = read_jsonl(path, offset=self.state.heartbeat_offset, damaged=damaged)
        self.state.heartbeat_offset = offset
        for what in damaged:
            log_event(self.run_dir, "bad-heartbeat", attempt=attempt.number, record=what)
        beats = []
        for record in records:
            try:
                beats.append(Heartbeat.from_dict(record))
            except TypeError as e:
                # What is wrong with it, not the record's Python repr cut at 200 characters (which hid the bad field
                # behind the good ones), with its step to find it by when that much of it is usable.
                step = record.get("step")
                at = f" (the record of step {step})" if isinstance(step, int) and not isinstance(step, bool) else ""
                log_event(self.run_dir, "bad-heartbeat", attempt=attempt.number, record=f"{path}: {e}{at}"[:300])
        return beats

    def _absorb(self, attempt: Attempt, beats: list[Heartbeat]) -> None:
        if beats:
            self.state.last_heartbeat_time = time.time()
        for hb in beats:
            # The trainer resumed from an older checkpoint, or repaired an interrupted re-save: say which and why.
            if hb.event in NOTICE_EVENTS:
                log_event(self.run_dir, hb.event, attempt=attempt.number, detail=hb.reason)
        for done in self.model.absorb(attempt.number, attempt.strategy, beats):
            self._log_switch_completed(done, attempt)
        if self.tensorboard is not None:
            # Until its first decision the cona policy ranks with the prior (`live.noise_source` "prior").
            scale = self.live.noise_scale
            if scale is None and self.job.policy.name == "cona" and self.live.noise_source == "prior":
                scale = prior_noise_scale(self.job.policy, base_gbs=self.job.batch.base_gbs)
            self.tensorboard.heartbeats(beats, noise_estimate=self.model.noise.value, noise_scale=scale)

    def _log_switch_completed(self, done: SwitchCompleted, attempt: Attempt) -> None:
        log_event(self.run_dir, "switch-complete", attempt=done.attempt, switch_cost_s=round(done.cost_s, 3),
                  kind=done.kind.value, predicted_s=done.predicted_s)  # fmt: skip
        if self.tensorboard is not None:
            previous = next((a for a in self.state.attempts if a.number == done.attempt - 1), None)
            self.tensorboard.switch(source=previous.strategy if previous else None, target=attempt.strategy,
                                    cost_s=done.cost_s, kind=done.kind.value)  # fmt: skip

    def _elapsed(self, at: float | None = None) -> float:
        """The run's time so far (up to `at`, if given), without the time it lay stopped before a `--resume`."""
        now = time.time() if at is None else at
        return now - (self.state.run_started or now) - self.state.paused_s

    # ----------------------------------------------------------------------------------------------- decisions

    def _evaluate(self, attempt: Attempt) -> None:
        if self.state.switch_requested or self.state.stop_requested:
            return
        now = time.time()
        worlds = self._worlds_now(attempt) if self.elastic else None
        plan = self.model.decide(now=now, current=attempt.strategy, elapsed_s=self._elapsed(), worlds=worlds,
                                 strategy_since=self.state.strategy_since or attempt.started_at)  # fmt: skip
        if plan is None:
            return
        if plan.target.world_size > attempt.strategy.world_size:
            log_event(self.run_dir, "grow", attempt=attempt.number, nodes=nodes_of(plan.target, self.profile),
                      available_nodes=max(worlds or [0]) // self.profile.gpus_per_node,
                      reason=plan.decision.reason)  # fmt: skip
        decision = plan.decision
        request = SwitchRequest(time=now, seq=self._next_seq(), source=attempt.strategy, target=plan.target,
                                kind=plan.kind, predicted_s=plan.predicted_s)  # fmt: skip
        if request.in_place:
            # The trainer learns every strategy from a launch record: the one of the attempt it goes on as.
            self.backend.offer_in_place(attempt, number=attempt.number + 1, strategy=plan.target)
        # Saved before the control record goes out: a restarted orchestrator knows what it asked for (and sends it
        # again if it died in between).
        self.state.switch_requested = request
        self._save()
        self._send_switch(request, decision.reason, attempt=attempt.number)
        log_event(self.run_dir, "switch", attempt=attempt.number, **{"from": attempt.strategy.to_dict()},
                  to=plan.target.to_dict(), reason=decision.reason, metrics=decision.metrics,
                  samples=self.live.samples, noise_scale=self.model.noise.value, switch_cost_s=plan.predicted_s,
                  kind=plan.kind.value)  # fmt: skip
        self._save()

    def _worlds_now(self, attempt: Attempt) -> set[int]:
        """The world sizes an elastic run may switch to now: its own, and those of more nodes when the cluster has
        them (`Backend.available_nodes`). Growing is then a candidate switch like any other: the policy takes it
        only when the larger world's throughput pays for the switch's cost. Fewer nodes are never chosen: a run
        shrinks only when it loses nodes (`_shrink`)."""
        worlds = {attempt.strategy.world_size}
        nodes = nodes_of(attempt.strategy, self.profile)
        if nodes < self.profile.nodes:
            available = self.backend.available_nodes(attempt) or 0
            worlds |= {n * self.profile.gpus_per_node for n in node_range(self.profile) if nodes < n <= available}
        return worlds

    def _replan(self, reason: str) -> ElasticPlan:
        """The planning table under the current noise scale, kept in the run directory and logged."""
        plan = plan_table(self.model, reason=reason, time=time.time())
        write_plan(self.run_dir, plan)
        log_event(self.run_dir, "elastic-plan", reason=reason, noise_scale=plan.noise_scale,
                  plans={str(p.nodes): p.strategy.to_dict() if p.strategy else None for p in plan.plans})  # fmt: skip
        return plan

    def _started_as(self, attempt: Attempt, strategy: Strategy) -> None:
        """An elastic launch started on another node count than planned and runs `strategy`, the table's for it."""
        log_event(self.run_dir, "elastic-start", attempt=attempt.number, nodes=nodes_of(strategy, self.profile),
                  strategy=strategy.to_dict(), planned=attempt.strategy.to_dict())  # fmt: skip
        attempt.strategy = strategy
        self.model.attempt_started(attempt.number, strategy)
        self._save()

    def _shrink(self, attempt: Attempt, outcome: Outcome) -> Attempt:
        """`attempt` lost nodes (`outcome.lost_nodes`): go on from the last complete checkpoint on the nodes that are
        left, with the best strategy for that world under the current noise scale (the trainer reshards and resumes
        at the next unseen sample; the LR rule follows the new global batch). Not a failure: no restart is counted.
        Below `min_nodes` the launch waits in the queue for nodes to come back."""
        self._absorb(attempt, self._tail_heartbeats(attempt))
        if not outcome.status.finished:
            self.backend.cancel(attempt)
        try:  # what the attempt still holds (Kubernetes: its pods on the nodes left) is freed for the next one
            self.backend.release(attempt)
        except BackendError as e:
            log_event(self.run_dir, "release-failed", attempt=attempt.number, detail=str(e))
        lost = ",".join(outcome.lost_nodes)
        left = max(nodes_of(attempt.strategy, self.profile) - len(outcome.lost_nodes), node_range(self.profile)[0])
        plan = self._replan(f"lost node {lost}")
        # Nothing feasible on that many nodes: the same strategy again, whose job queues until its nodes are back.
        target = plan.strategy_for(left) or attempt.strategy
        log_event(self.run_dir, "attempt-end", attempt=attempt.number, status="lost-node", exit_code=outcome.exit_code,
                  detail=outcome.detail, samples=self.live.samples, step=self.live.step)  # fmt: skip
        latest = self.run_dir.latest_checkpoint()
        log_event(self.run_dir, "shrink", attempt=attempt.number, lost=list(outcome.lost_nodes), nodes=left,
                  **{"from": attempt.strategy.to_dict()}, to=target.to_dict(), noise_scale=plan.noise_scale,
                  checkpoint=latest.name if latest else None,
                  reason=f"node {lost} lost ({outcome.detail}); replanned for {left} node(s) under B_noise="
                         f"{'-' if plan.noise_scale is None else f'{plan.noise_scale:.3g}'}: {target.short()}, from the "
                         f"last complete checkpoint")  # fmt: skip
        self._abandon_switch(attempt, why=f"attempt {attempt.number} lost node {lost}", next_strategy=target)
        self.state.strategy_since = time.time()
        self._save()
        return self._launch(target, previous=attempt, why=f"shrink after losing node {lost}",
                            elastic=plan.by_nodes(up_to=left))  # fmt: skip

    def _user_stop_requested(self) -> bool:
        record = self.run_dir.read_control()
        return record is not None and record.command == "stop" and record.seq > self.state.control_seq

    # ----------------------------------------------------------------------------------------------- the loop

    def _write_switch_points(self) -> None:
        """Tell the trainer where a fixed schedule switches (`SwitchPoints`), before any attempt can start.

        It holds there until it reads the decision, so it waits longer than an orchestrator restart takes (its
        `hold` heartbeats meanwhile keep it from being taken for a hung one); past `wait_s` it checkpoints and exits
        SWITCH with `HOLD_TIMEOUT_REASON`, and `_handle_end` relaunches at the point."""
        points = self.model.policy.switch_points()
        if not points:
            self.run_dir.switch_points_json.unlink(missing_ok=True)
            return
        wait_s = max(120.0, 10 * self.job.policy.decision_interval_s)
        self.run_dir.write_switch_points(SwitchPoints(samples=tuple(points), wait_s=wait_s))

    def _relaunch(self, attempt: Attempt, *, why: str) -> Attempt:
        """Launch `attempt`'s strategy again (`_relaunch_strategy`) from the last complete checkpoint: after a crash,
        a hang, a preemption, a disruption, or the user's resume of an ended run.

        An elastic run's relaunch may begin on fewer nodes, down to `min_nodes`, with the planning table's strategy
        for them, as its start and a shrink do: with the node count fixed, a node drained or gone meanwhile (not
        seen DOWN while the attempt ran: it crashed first, or it went during the backoff) held the relaunch in the
        queue for as long as it stayed away, while the run could train on the rest. On as many nodes as before it
        runs the same strategy (a relaunch is no switch)."""
        strategy = self._relaunch_strategy(attempt)
        if not self.elastic:
            return self._launch(strategy, previous=attempt, why=why)
        nodes = nodes_of(strategy, self.profile)
        table = {**self._replan(why).by_nodes(up_to=nodes), nodes: strategy}
        return self._launch(strategy, previous=attempt, why=why, elastic=table)

    def _relaunch_strategy(self, attempt: Attempt) -> Strategy:
        """The strategy to relaunch `attempt` with after a crash, hang, preemption or disruption: its own, unless
        the policy prescribes one for where training resumes (a schedule whose switch point the newest checkpoint
        already reached, e.g. the switch checkpoint of a trainer killed before its exit record)."""
        try:
            state = self.run_dir.latest_trainer_state()
        except (ValueError, OSError):  # unreadable: the trainer says which and falls back; so does the schedule
            state = None
        samples = state.get("samples", 0) if isinstance(state, dict) else 0
        prescribed = self.model.policy.strategy_at(samples if isinstance(samples, int) else 0)
        return prescribed if prescribed is not None else attempt.strategy

    def _take_up_ended_run(self, previous_status: str, *, ended_at: float | None, **note: str) -> None:
        """Go on with a run that ended `previous_status` at `ended_at` (stopped or failed): a `resume-run` event, the
        time it lay ended (which trained nothing: a time budget counts the run's time, not the calendar's) and the
        flags of its end cleared. The caller relaunches from the last complete checkpoint."""
        log_event(self.run_dir, "resume-run", previous_status=previous_status, **note)
        if ended_at is not None:
            self.state.paused_s += max(0.0, time.time() - ended_at)
        # The stop that ended it was served; a relaunch from a checkpoint older than the one that served it (the
        # newest found damaged) would read it as new and stop again at its first step: a wasted attempt.
        self.run_dir.control_json.unlink(missing_ok=True)
        self.state.final = self.state.stop_requested = self.state.time_budget_reached = False
        self.state.reason = self.state.switch_requested = None
        self.state.restarts_in_row = self.state.disruptions_without_progress = 0
        self.state.status = "running"

    def start_or_resume(self) -> Attempt | None:
        self._restore()
        self.watching_since = time.time()
        # This orchestrator holds the run now (its lock or Lease): nobody else will finish a torn last event.
        end_torn_events(self.run_dir)
        if self.state.status == "done":
            return None
        self._write_switch_points()
        resumed = None
        if self.state.final:
            # A stopped or failed run resumed by the user: go on from its last complete checkpoint.
            resumed = self.state.status
            self._take_up_ended_run(self.state.status, ended_at=self.state.finished_at)
        if self.state.run_started is None:
            self.state.run_started = time.time()
        attempt = self.current
        if attempt is None:
            strategy, reason = self.model.initial_choice()
            self.state.strategy_since = time.time()
            log_event(self.run_dir, "start", strategy=strategy.to_dict(), policy=self.job.policy.name,
                      profile=self.profile.name, num_candidates=len(self.candidates),
                      prior_noise_scale=prior_noise_scale(self.job.policy, base_gbs=self.job.batch.base_gbs))  # fmt: skip
            if self.elastic:  # start on whatever the cluster gives, with the strategy planned for it
                plan = self._replan("start")
                return self._launch(plan.strategy_for(plan.max_nodes) or strategy, previous=None,
                                    elastic=plan.by_nodes(), why="initial strategy (elastic)")  # fmt: skip
            return self._launch(strategy, previous=None, why="initial strategy" + (f": {reason}" if reason else ""))
        request = self.state.switch_requested
        control = self.run_dir.read_control()
        if request is not None and (control is None or control.seq < request.seq):
            # The previous orchestrator decided a switch and died before the control record went out.
            self._send_switch(request, "switch decided before an orchestrator restart", attempt=attempt.number)
        if self.backend.adopt(attempt):
            log_event(self.run_dir, "adopt", attempt=attempt.number, backend_id=attempt.backend_id)
        elif resumed is not None:
            # The ended run's last attempt was handled when it ended: relaunch now, under the user's resume, rather
            # than handle its end a second time (a second attempt-end, and "resume after preemption").
            return self._relaunch(attempt, why=f"resume of the {resumed} run")
        else:
            log_event(self.run_dir, "resume", attempt=attempt.number, note="orchestrator restarted; attempt not running")
        return attempt

    def _addressed_stop(self) -> ControlRecord | None:
        """The stop in control.json that `cona stop` sent to the trainer of one attempt while no orchestrator ran
        (`request_stop`'s `attempt`), else None. It stays there until the run it stopped is taken up again
        (`_take_up_ended_run` removes it) or it is dropped (`_drop_unserved_stop`)."""
        record = self.run_dir.read_control()
        return record if record is not None and record.command == "stop" and record.attempt is not None else None

    def _drop_unserved_stop(self, attempt: Attempt, record: ExitRecord | None) -> None:
        """`attempt` ended (or went on as the next attempt elsewhere than in place) without serving the stop that
        `cona stop` sent to its trainer while no orchestrator ran (a crash): that stop was for those processes alone
        and ends with them — left in force, it would stop the run after its relaunch's first step. Removed, and
        said so. `record`: `attempt`'s exit record."""
        stop = self._addressed_stop()
        if stop is None or (record is not None and record.served_stop):
            return
        self.run_dir.control_json.unlink(missing_ok=True)
        self.state.control_seq = max(self.state.control_seq, stop.seq)
        self.state.stop_requested = False
        how = f"it exited {record.name}" if record is not None else "its processes are gone without an exit record"
        log_event(self.run_dir, "stop-dropped", attempt=attempt.number, seq=stop.seq,
                  reason=f"attempt {attempt.number}'s trainer ended before it served the stop ({how}); the run goes on")  # fmt: skip
        self._save()

    def _ended_unwatched(self, record: ExitRecord | None) -> float | None:
        """When the trainer of an attempt with exit record `record` exited, if that was before this orchestrator took
        the run up (the record's time); None when it ended while watched, or left no record. A run that ended
        meanwhile ended then, not when an orchestrator came back to see it: the time between trained nothing."""
        return record.time if record is not None and record.time < self.watching_since else None

    def run(self) -> RunState:
        """Run to the end; returns the final state. Raises RunFailed with a clear reason."""
        attempt = self.start_or_resume()
        if attempt is None:
            return self.state
        next_decision = time.time() + self.job.policy.decision_interval_s
        while True:
            beats = self._tail_heartbeats(attempt)
            self._absorb(attempt, beats)
            self.live.elapsed_s = self._elapsed()
            self.live.restarts = self.state.restarts_in_row
            if beats:
                self._save()
            if self._user_stop_requested():
                self.state.stop_requested = True
                self.state.control_seq = self.run_dir.read_control().seq  # type: ignore[union-attr]
                log_event(self.run_dir, "stop-requested", attempt=attempt.number)
                self._save()
            max_time = self.job.target.max_time_s
            if max_time and self._elapsed() > max_time and not self.state.stop_requested:
                self._send("stop", reason=f"time budget of {max_time:.0f}s reached")
                self.state.stop_requested = True
                self.state.time_budget_reached = True
                log_event(self.run_dir, "time-budget", elapsed_s=round(self._elapsed(), 1))
                self._save()

            following = self._switched_in_place(attempt)
            if following is not None:
                attempt = following
                next_decision = time.time() + self.job.policy.decision_interval_s
                continue

            outcome = self.backend.poll(attempt)
            if outcome.strategy is not None and outcome.strategy != attempt.strategy:
                self._started_as(attempt, outcome.strategy)
            if self.elastic and outcome.lost_nodes and not self.state.stop_requested:
                attempt = self._shrink(attempt, outcome)
                next_decision = time.time() + self.job.policy.decision_interval_s
                continue
            if outcome.status is AttemptStatus.PENDING:
                outcome = self._note_pending(attempt, outcome)
            if outcome.status.finished:
                # Read the heartbeats written just before the exit.
                self._absorb(attempt, self._tail_heartbeats(attempt))
                try:
                    self.backend.release(attempt)
                except BackendError as e:  # what is left behind is logged; the run goes on
                    log_event(self.run_dir, "release-failed", attempt=attempt.number, detail=str(e))
                next_attempt = self._handle_end(attempt, outcome.status, outcome.exit_code, outcome.detail)
                if next_attempt is None:
                    return self.state
                attempt = next_attempt
                next_decision = time.time() + self.job.policy.decision_interval_s
                continue

            if outcome.status is not AttemptStatus.PENDING:  # pending: `_note_pending` noted it above
                self.live.status = "running"
                if self.state.pending is not None:
                    self.state.pending = None
                    self._save()  # `cona status` stops showing it
                self._check_hang(attempt)
            if time.time() >= next_decision and self.state.last_heartbeat_time:
                self._evaluate(attempt)
                next_decision = time.time() + self.job.policy.decision_interval_s
            self.on_update(self.live)
            time.sleep(self.poll_interval_s)

    def _switched_in_place(self, attempt: Attempt) -> Attempt | None:
        """The next attempt, if `attempt`'s processes switched in place (their exit record names it); else None.

        Checked before the backend's poll: the processes may already have finished the next attempt too, and its
        exit belongs to that attempt, not to this one."""
        record = self.run_dir.switched_in_place(attempt.number)
        if record is None:
            return None
        assert record.next_strategy is not None  # `switched_in_place` checked it
        self._absorb(attempt, self._tail_heartbeats(attempt))  # the lines written before the exit record
        log_event(self.run_dir, "attempt-end", attempt=attempt.number, status="switched", exit_code=record.exit_code,
                  detail="in place", samples=self.live.samples, step=self.live.step)  # fmt: skip
        self.state.restarts_in_row = 0
        requested = self.state.switch_requested
        # The processes went on as the next attempt when they wrote the record, which an orchestrator that was gone
        # (Ctrl-C during the switch) reads only when it is back: the next attempt began then, not now.
        return self._follow_switch(attempt, record.next_strategy, requested=requested, in_place=True,
                                   requested_at=requested.time if requested else record.time, at=record.time)  # fmt: skip

    def _follow_switch(
        self, attempt: Attempt, target: Strategy, *, requested: SwitchRequest | None, requested_at: float,
        in_place: bool = False, at: float | None = None,
    ) -> Attempt:  # fmt: skip
        """The attempt after a switch of `attempt` to `target`: relaunched, or the same processes gone on in place
        (at `at`)."""
        if in_place:
            kind = SwitchKind.IN_PLACE
        else:  # the processes exited: whatever was planned, the next attempt is launched
            kind = self.model.switch_kind(attempt.strategy, target)
            kind = SwitchKind.RELAUNCH if kind is SwitchKind.IN_PLACE else kind
        self.model.switch_started(requested_at=requested_at, to_attempt=attempt.number + 1, kind=kind,
                                  predicted_s=requested.predicted_s if requested else None)  # fmt: skip
        self.state.strategy_since = at if at is not None else time.time()
        return self._launch(target, previous=attempt, why="switch in place" if in_place else "switch", in_place=in_place,
                            at=at)  # fmt: skip

    def _note_pending(self, attempt: Attempt, outcome: Outcome) -> Outcome:
        """Note that `attempt` is pending, and apply the backend's pending timeout: the one place that decides it.

        Queued, unschedulable, pulling its image, or requeued by Slurm (a node failure, `scontrol requeue`, the
        pre-timeout USR1): no heartbeat is due until it runs, so the heartbeat-gap clock restarts instead of firing.
        state.json keeps since when and why (`cona status` shows both), from the first poll of the spell, so the
        clock survives an orchestrator restart. Past `Backend.pending_timeout_s`: an event `pending-timeout` with
        the reason, once per spell; then an attempt that is `Outcome.stuck` (waiting will not bring what it waits
        for, e.g. an image that cannot be pulled) is cancelled and ends as UNSTARTABLE (the outcome returned),
        while one that waits for capacity — a queue, like Slurm's — goes on waiting, reported (`outcome`
        returned as it is). A stuck attempt's timeout counts from the first poll of its current stuck run
        (`PendingSpell.stuck_since`), so a reason that appears after hours in a queue gets the same grace."""
        now = time.time()
        self.state.pending_seen_at = now
        self.live.status = "pending"
        spell = self.state.pending
        if spell is None or spell.attempt != attempt.number:
            spell = self.state.pending = PendingSpell(attempt=attempt.number, since=now, detail=outcome.detail,
                                                      stuck_since=now if outcome.stuck else None)  # fmt: skip
            log_event(self.run_dir, "pending", attempt=attempt.number, detail=outcome.detail)
            self._save()
        elif spell.detail != outcome.detail:
            spell.detail = outcome.detail
            self._save()
        if outcome.stuck != (spell.stuck_since is not None):  # a stuck run of polls begins, or ends
            spell.stuck_since = now if outcome.stuck else None
            self._save()
        timeout = self.backend.pending_timeout_s
        waited = now - spell.since
        if timeout is None:
            return outcome
        if outcome.stuck:
            assert spell.stuck_since is not None
            stuck_for = now - spell.stuck_since
            if stuck_for < timeout:
                return outcome
        elif waited < timeout or not self.backend.reports_long_queue_waits:
            return outcome
        if not spell.timed_out or outcome.stuck:  # the failure is logged even after a queue wait's report
            spell.timed_out = True
            log_event(self.run_dir, "pending-timeout", attempt=attempt.number, pending_s=round(waited, 1),
                      timeout_s=timeout, detail=outcome.detail, action="fail" if outcome.stuck else "wait")  # fmt: skip
            self._save()
        if not outcome.stuck:
            return outcome
        self.backend.cancel(attempt)  # frees what its pods hold already (nodes, GPUs)
        # The time stuck is said apart from the time pending where they differ (a queue wait came first).
        stuck = f", stuck {stuck_for:.0f}s" if waited - stuck_for >= 1 else ""
        detail = f"{outcome.detail}; pending {waited:.0f}s{stuck} (timeout {timeout:.0f}s)"
        return Outcome(AttemptStatus.UNSTARTABLE, None, detail)

    def _check_hang(self, attempt: Attempt) -> None:
        timeout = self.job.policy.heartbeat_timeout_s
        beat, queued = self.state.last_heartbeat_time, self.state.pending_seen_at
        if not beat or (queued and queued > beat):
            # Still starting — or starting again after a pending spell (a Slurm job requeued runs the attempt in
            # new processes): processes, rendezvous and the checkpoint load come before the first heartbeat. The
            # plain heartbeat timeout cancelled such a restart as hung on a loaded machine.
            timeout = max(timeout, self.job.policy.startup_timeout_s)
        # The gap runs from the latest of: the last heartbeat, the launch, the last poll that said PENDING.
        marks = [self.state.last_heartbeat_time, self.state.launched_at, self.state.pending_seen_at]
        last = max([m for m in marks if m] or [attempt.started_at])
        if time.time() - last > timeout:
            log_event(self.run_dir, "heartbeat-gap", attempt=attempt.number, seconds=round(time.time() - last, 1),
                      timeout_s=timeout)  # fmt: skip
            self.backend.cancel(attempt)
            self.state.hang_cancelled = attempt.number
            self._save()

    def _finish(self, status: str, *, reason: str | None = None, at: float | None = None) -> None:
        """End the run `status`, at `at` when it ended before now (`_ended_unwatched`)."""
        if self.current is not None:  # a switch still asked for when the run ends never happened
            self._abandon_switch(self.current, why=f"the run ended ({status})")
        self.state.status, self.state.final, self.state.finished_at = status, True, time.time() if at is None else at
        if at is not None:  # `cona run`'s last line says the run's time, as the end event records it
            self.live.elapsed_s = self._elapsed(at)
        self.state.reason = reason
        self.state.pending = None
        self.live.status = status
        self._save()
        self.backend.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

    def _handle_end(self, attempt: Attempt, status: AttemptStatus, code: int | None, detail: str) -> Attempt | None:
        log_event(self.run_dir, "attempt-end", attempt=attempt.number, status=status.value, exit_code=code,
                  detail=detail, samples=self.live.samples, step=self.live.step)  # fmt: skip
        exit_record = self.run_dir.read_exit(attempt.number)  # the attempt has ended: its record is final
        self._drop_unserved_stop(attempt, exit_record)
        ended = self._ended_unwatched(exit_record)
        at = {"at": ended} if ended is not None else {}  # END events say when the run ended, if before they were logged
        if status is AttemptStatus.DONE:
            self._finish("done", at=ended)
            log_event(self.run_dir, "done", samples=self.live.samples, val_perplexity=self.live.val_perplexity,
                      elapsed_s=round(self._elapsed(ended), 2), switches=self.live.switches, **at)  # fmt: skip
            return None
        if status is AttemptStatus.SWITCHED:
            self.state.restarts_in_row = 0
            requested = self.state.switch_requested
            if requested is None and exit_record is not None and exit_record.reason.startswith(HOLD_TIMEOUT_REASON):
                # The trainer held at a switch point longer than the switch points' wait_s (this orchestrator was
                # down or slow) and checkpointed there: relaunch at the point under the schedule's strategy.
                log_event(self.run_dir, "hold-timeout", attempt=attempt.number, detail=exit_record.reason)
                return self._relaunch(attempt, why="relaunch at the switch point after the trainer's hold timed out")
            if requested is None:
                # Every switch request is saved before it is sent, so nobody asked for this one: carry on as before.
                log_event(self.run_dir, "switch-unrequested", attempt=attempt.number)
                return self._relaunch(attempt, why="resume after an unrequested switch exit")
            return self._follow_switch(attempt, requested.target, requested=requested, requested_at=requested.time)
        if status is AttemptStatus.STOPPED and ended is not None and self._addressed_stop() is not None:
            # `cona stop` reached the trainer of an orchestrator that was gone, which served it: the run stopped
            # then. This orchestrator was started to go on with it (`cona run --resume`, the same command again), as
            # with any stopped run: its stop and resume are logged as they would have been, and the time it lay
            # stopped since is not the run's (`paused_s`, the report's wall time).
            reason = "stopped on request while its orchestrator was gone"
            log_event(self.run_dir, "stopped", reason=reason, samples=self.live.samples, **at)
            self._take_up_ended_run("stopped", ended_at=ended, note=f"attempt {attempt.number}'s trainer served "
                                    "`cona stop` while no orchestrator ran")  # fmt: skip
            return self._relaunch(attempt, why="resume of the stopped run")
        if status in (AttemptStatus.STOPPED, AttemptStatus.DISRUPTED) and self.state.stop_requested:
            # A disrupted attempt of a run asked to stop is not relaunched just to stop again.
            reason = "time budget reached" if self.state.time_budget_reached else "stopped on request"
            self._finish("stopped", reason=reason, at=ended)
            log_event(self.run_dir, "stopped", reason=reason, samples=self.live.samples, **at)
            return None
        if status is AttemptStatus.STOPPED:
            # Preempted, at a time limit, or a stopped run resumed: the checkpoint is there, carry on with the same
            # strategy. The reason says which, from what the trainer recorded (`signal SIGUSR1 (4 ranks)`).
            self.state.restarts_in_row = 0
            self._abandon_switch(attempt, why=f"attempt {attempt.number} ended (stopped)", relaunch=True)
            return self._relaunch(attempt, why=_resume_reason(exit_record))
        if status is AttemptStatus.DISRUPTED and self.state.hang_cancelled != attempt.number:
            return self._relaunch_disrupted(attempt, detail)
        if status is AttemptStatus.UNSTARTABLE:
            # Relaunching would wait for the same thing again: the user fixes it (the image, a Secret) and resumes.
            self._fail(attempt, f"attempt {attempt.number} could not start: {detail}; once fixed, "
                                f"{self.backend.resume_hint(detail)}")  # fmt: skip
        recorded = exit_record if status is AttemptStatus.CRASHED else None
        if recorded is not None and recorded.exit_code == ExitCode.CONFIG:
            # The trainer refused its input (model.init_from, the data, no loadable checkpoint): every relaunch would
            # refuse it alike, so fail now with the trainer's own line, not after max_restarts backoffs as `exited 2`.
            self._fail(attempt, f"attempt {attempt.number} refused its input: {recorded.reason}; "
                                f"{self._refusal_advice(recorded)}")  # fmt: skip
        # Crashed (or hung and cancelled, or an unusable world): relaunch from the last complete checkpoint.
        restarts = self.state.restarts_in_row + 1
        self.state.restarts_in_row = restarts
        limit = self.job.policy.max_restarts
        what = "hang" if self.state.hang_cancelled == attempt.number else status.value
        # What the trainer said of its crash (`step 7: loss nan ...; lower optimizer.lr`), when it wrote it down.
        reason = recorded.reason if recorded is not None and recorded.exit_code not in _PROTOCOL_EXITS else ""
        running = attempt.running.to_dict()
        replayed = self._replayed_crash(reason, running) if restarts > 1 else None
        if replayed is not None:
            # A relaunch resumes from the same checkpoint under the same strategy with the same data order, so a
            # crash the trainer explained (`step 7: loss nan ...`) replays bit for bit: on a cluster every further
            # relaunch is one more allocation spent on the same line.
            self._fail(attempt, f"attempt {attempt.number} {what} as attempt {replayed} did, under the same strategy: "
                                f"{reason}; a relaunch would replay it, so the run stops here (not after {limit} "
                                "restarts)")  # fmt: skip
        if restarts > limit:
            said = f": {reason}" if reason else ""
            self._fail(attempt, f"attempt {attempt.number} {what} ({detail or f'exit {code}'}){said}; gave up after "
                                f"{limit} restarts")  # fmt: skip
        self._abandon_switch(attempt, why=f"attempt {attempt.number} ended ({what})", relaunch=True)
        backoff = min(30.0, 2.0 ** (restarts - 1))
        log_event(self.run_dir, "failure", attempt=attempt.number, kind=what, detail=detail, exit_code=code,
                  restart=restarts, backoff_s=backoff, strategy=running,
                  **({"reason": reason} if reason else {}))  # fmt: skip
        self._save()
        time.sleep(backoff)
        return self._relaunch(attempt, why=f"relaunch after {what}")

    def _abandon_switch(
        self, attempt: Attempt, *, why: str, relaunch: bool = False, next_strategy: Strategy | None = None
    ) -> None:  # fmt: skip
        """Forget the switch `attempt` was asked to make and ended without making (a crash, a hang, a stop, a
        disruption, a lost node, the run's end): the one place that says so, with a `switch-aborted` event for its
        `switch` event. Readers count and list only the switches that went ahead (`runstate.switch_events`): the
        relaunch resumes from a checkpoint before the switch, and the policy decides it again there, so without it
        one switch was counted and listed twice.

        Not aborted when the next launch runs the switch's target anyway (`next_strategy`, or with `relaunch` the
        strategy `_relaunch` takes: a schedule whose switch point the newest checkpoint has reached)."""
        request = self.state.switch_requested
        self.state.switch_requested = None
        if request is None:
            return
        if relaunch:
            next_strategy = self._relaunch_strategy(attempt)
        if next_strategy is not None and next_strategy == request.target:
            return
        log_event(self.run_dir, "switch-aborted", attempt=attempt.number, **{"from": request.source.to_dict()},
                  to=request.target.to_dict(), reason=f"{why} before it switched")  # fmt: skip

    def _replayed_crash(self, reason: str, strategy: dict[str, int]) -> int | None:
        """The attempt whose crash, the one just before this (a relaunched crash in a row), the trainer explained in
        the same words under the same strategy, or None. Only a recorded reason counts: an unexplained exit (a
        killed process, a lost node) says nothing about the next try."""
        if not reason:
            return None
        failures = [e for e in read_events(self.run_dir) if e.get("event") == "failure"]
        last = failures[-1] if failures else None
        if last is not None and last.get("reason") == reason and last.get("strategy") == strategy:
            number = last.get("attempt")
            return number if isinstance(number, int) else None
        return None

    def _relaunch_disrupted(self, attempt: Attempt, detail: str) -> Attempt:
        """The cluster took a pod or node of `attempt` away: relaunch its strategy from the last complete checkpoint.

        Not a failure: no restart is counted and there is no backoff (the new pods queue in the cluster's scheduler);
        `restarts_in_row` stays as it is, as a disruption neither counts as a crash nor shows the trainer healthy.
        What ends an endless loop of disruptions is progress: a disruption that finds no newer complete checkpoint
        than the previous one (or than the run's start) counts, and more than
        `policy.max_disruptions_without_progress` of them in a row fail the run. So a run on a cluster that
        preempts it now and then goes on forever, while one whose pods are taken away before they checkpoint (pods
        evicted for the node pressure they cause, preemptions faster than `checkpoint.interval_steps`) stops."""
        latest = self.run_dir.latest_checkpoint()
        checkpoint = latest.name if latest is not None else None
        if checkpoint != self.state.disruption_checkpoint:
            self.state.disruptions_without_progress = 0
        else:
            self.state.disruptions_without_progress += 1
        self.state.disruption_checkpoint = checkpoint
        count, limit = self.state.disruptions_without_progress, self.job.policy.max_disruptions_without_progress
        if count > limit:
            self._fail(attempt, f"attempt {attempt.number} disrupted ({detail}); gave up after {count} disruptions in "
                                f"a row without a newer complete checkpoint (policy.max_disruptions_without_progress "
                                f"{limit})")  # fmt: skip
        self._abandon_switch(attempt, why=f"attempt {attempt.number} ended (disrupted)", relaunch=True)
        log_event(self.run_dir, "disruption", attempt=attempt.number, detail=detail, checkpoint=checkpoint,
                  without_progress=count, restarts=self.state.restarts_in_row)  # fmt: skip
        self._save()
        return self._relaunch(attempt, why="relaunch after a disruption")

    def _refusal_advice(self, recorded: ExitRecord) -> str:
        """What to do about a refused input, by where its exit record says the fix lies (`ExitRecord.fix`,
        `cona.protocol.inputs`): a run's job is fixed once it exists (`--resume` takes no --set, and the same
        --run-dir with another job is refused), so a job field takes a new run; the files on disk, a resume."""
        resume = f"`cona run --resume {self.run_dir.root}`"
        new_run = "start a new run (another --run-dir) with the corrected job"
        if recorded.fix == FIX_JOB:
            return f"a run's job cannot change: {new_run}"
        if recorded.fix == FIX_FILES:
            return f"fix the files and resume with {resume}"
        return f"fix files on disk and resume with {resume}, or, for a job field, {new_run}"

    def _fail(self, attempt: Attempt, reason: str) -> NoReturn:
        """End the run as failed with `reason` (one line), after `attempt`."""
        self._finish("failed", reason=reason)
        log_event(self.run_dir, "failed", reason=reason)
        raise RunFailed(f"{reason}; logs: {self.run_dir.attempt_dir(attempt.number)}")


def _resume_reason(stopped: ExitRecord | None) -> str:
    """The launch reason of the relaunch after a stopped attempt, from the reason its trainer recorded: a signal
    (SIGTERM: a preemption, a deleted pod, a time limit reached; SIGUSR1: Slurm's signal ahead of the time limit),
    a stop on request (the run is being resumed), or anything else as written."""
    reason = stopped.reason if stopped is not None else ""
    if reason.startswith("signal "):
        return f"resume after {reason.removeprefix('signal ')}"
    if reason.startswith("stop (control seq"):
        return "resume after a stop on request"
    return f"resume after a stop: {reason}" if reason else "resume after a stop from outside"


def device_counts(profile: ClusterProfile, job: Job) -> list[int]:
    """The device counts to plan for: all of the profile's first; those of every node count of an elastic profile
    ([min_nodes, nodes]); for the `schedule` and `fixed` policies also the
    smaller world sizes their strategies name when those fill whole nodes, so a schedule can move a run to fewer
    nodes (the Slurm backend resubmits with the smaller `--nodes`). Anything else is left to `make_policy`, which
    says why it cannot run."""
    from cona.orchestrator.planner import named_world_reason

    counts = [profile.num_gpus]
    # An elastic run plans for every node count of its range (`cona.orchestrator.elastic`).
    counts += [n * profile.gpus_per_node for n in reversed(node_range(profile)) if n < profile.nodes]
    pol = job.policy
    named = [e.strategy for e in pol.schedule] if pol.name == "schedule" else [pol.strategy or ""] if pol.name == "fixed" else []
    for text in named:
        try:
            world = Strategy.parse(text).world_size
        except ValueError:
            continue
        if world < profile.num_gpus and not named_world_reason(world, profile) and world not in counts:
            counts.append(world)
    return counts


def drive(
    *, run_dir: RunDir, profile: ClusterProfile, job: Job, quiet: bool = False,
    also: Callable[[LiveStatus], None] | None = None,
) -> tuple[RunState, str | None]:  # fmt: skip
    """Drive a created run to its end (`cona run`, and `cona orchestrate` in a submitted run's pod) under its
    backend's exclusion (flock, or a Kubernetes Lease), with the live view; `also` runs on every pass of the loop
    (the Kubernetes status mirror). Returns the final state and, if the run failed, why (one line)."""
    from cona.orchestrator.backends import make_backend
    from cona.orchestrator.live import LiveView

    view = LiveView(run_dir=run_dir, job=job, quiet=quiet)
    backend = make_backend(profile=profile, run_dir=run_dir, job=job)
    with backend.exclusion() as exclusion:

        def on_update(live: LiveStatus) -> None:
            exclusion.check()  # another orchestrator took over (a Kubernetes Lease lost): stop here
            view.update(live)
            if also is not None:
                also(live)

        try:
            scheduler = Scheduler(run_dir=run_dir, profile=profile, job=job, backend=backend, on_update=on_update)
        except RunFailed as e:  # nothing feasible for a stored run (a resume after the models changed): one line
            return read_state(run_dir), str(e)
        scheduler.check_resumable()  # a damaged run directory is refused in its one line, before the live view
        view.begin(scheduler)
        try:
            state = scheduler.run()
        except RunFailed as e:
            view.end(scheduler)
            return scheduler.state, str(e)
        view.end(scheduler)
    return state, None
