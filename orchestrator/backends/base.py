"""The backend interface: launch a strategy as an attempt, poll it, cancel it, tell its end apart.

A switch or stop is *asked* through the run directory's control.json (backend-independent); the backend only
starts and watches processes. Backends never decide anything: the scheduler loop does.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import time
from pathlib import Path
from typing import Any

from cona.orchestrator.backends.crashcause import crash_cause
from cona.orchestrator.job import Job
from cona.orchestrator.profile import ClusterProfile
from cona.orchestrator.switchcost import SwitchKind
from cona.protocol.rundir import ExitCode, LaunchRecord, RunDir
from cona.protocol.strategy import Strategy


class BackendError(RuntimeError):
    """A cluster command or API call failed in a way the user must look at; the message is one line."""


class AttemptStatus(enum.Enum):
    PENDING = "pending"
    """Submitted, not yet running (queued)."""
    RUNNING = "running"
    DONE = "done"
    """Exited 0: target or budget reached."""
    SWITCHED = "switched"
    """Exited after checkpointing for a switch."""
    STOPPED = "stopped"
    """Exited after checkpointing for a stop, preemption or time limit."""
    BAD_WORLD = "bad_world"
    """The world it got does not fit its strategy."""
    CRASHED = "crashed"
    """Anything else: a non-protocol exit code, a killed process, a lost node, a cancelled job."""
    DISRUPTED = "disrupted"
    """The cluster took a pod or node away (eviction, preemption, node drain) before the trainer recorded an exit:
    relaunched from the last complete checkpoint with the same strategy, without counting as a failure (bounded by
    `policy.max_disruptions_without_progress` instead of `policy.max_restarts`)."""
    UNSTARTABLE = "unstartable"
    """Set by the scheduler, never by a backend: the attempt stayed pending past the backend's `pending_timeout_s`
    waiting for something that waiting does not bring (`Outcome.stuck`: an image that cannot be pulled, a missing
    Secret). The run fails with the reason; fix it and resume the run."""

    @property
    def finished(self) -> bool:
        return self not in (AttemptStatus.PENDING, AttemptStatus.RUNNING)

    @classmethod
    def from_exit_code(cls, code: int | None) -> AttemptStatus:
        mapping = {
            ExitCode.DONE: cls.DONE,
            ExitCode.SWITCH: cls.SWITCHED,
            ExitCode.STOPPED: cls.STOPPED,
            ExitCode.BAD_WORLD: cls.BAD_WORLD,
        }
        if code is None:
            return cls.CRASHED
        return mapping.get(code, cls.CRASHED)  # type: ignore[call-overload]


ELASTIC_STRATEGY = "elastic_strategy"
"""The `Attempt.extra` key of the strategy an elastic launch started with, when not the planned one."""


@dataclasses.dataclass
class Attempt:
    """One launch of the trainer under one strategy. `backend_id` is what the backend needs to find it again."""

    number: int
    strategy: Strategy
    backend_id: str = ""
    """Local: the torchrun PID. Slurm: the job id (plus the run-dir key). Kubernetes: the Job name."""
    started_at: float = 0.0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def running(self) -> Strategy:
        """The strategy the attempt runs: `strategy`, the one the scheduler planned, unless an elastic launch
        started it on another node count with the table's strategy for that count (`started_as`)."""
        chosen = self.extra.get(ELASTIC_STRATEGY)
        return Strategy.from_dict(chosen) if isinstance(chosen, dict) else self.strategy

    @staticmethod
    def started_as(started: Strategy, planned: Strategy) -> dict[str, Any]:
        """The `extra` entry of an elastic launch that started `started` instead of `planned` (empty if not)."""
        return {ELASTIC_STRATEGY: started.to_dict()} if started != planned else {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "strategy": self.strategy.to_dict(),
            "backend_id": self.backend_id,
            "started_at": self.started_at,
            "extra": self.extra,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attempt:
        return cls(
            number=int(data["number"]),
            strategy=Strategy.from_dict(data["strategy"]),
            backend_id=str(data.get("backend_id", "")),
            started_at=float(data.get("started_at", 0.0)),
            extra=dict(data.get("extra", {})),
        )


@dataclasses.dataclass
class Outcome:
    status: AttemptStatus
    exit_code: int | None = None
    detail: str = ""
    """A one-line human reason (e.g. `node n2 DOWN`, `exit code -9`)."""
    stuck: bool = False
    """Only with PENDING: what the attempt waits for does not come by waiting (a container image that cannot be
    pulled, a missing Secret), unlike capacity in a queue. Past the backend's `pending_timeout_s` the scheduler
    ends such an attempt as UNSTARTABLE; an attempt waiting for capacity goes on waiting."""
    strategy: Strategy | None = None
    """The strategy the attempt actually runs when it is not the one it was launched with: an elastic launch
    started on another node count and runs the planning table's strategy for it."""
    lost_nodes: tuple[str, ...] = ()
    """Nodes of the attempt the cluster has lost (Slurm: DOWN or FAIL; Kubernetes: a pod's Node gone or NotReady, or
    `pod <name>` Pending past `kubernetes.elastic_pending_timeout_s`, or `pod <index> of Job <name>` not created as
    long because a ResourceQuota admits fewer pods; local: `devices a-b` no longer in the run
    directory's `devices` file): an elastic run replans for the others."""

    @classmethod
    def of_exit(cls, code: int | None, *, who: str) -> Outcome:
        """The end of an attempt whose `who` (torchrun, the trainer) exited with `code`; a crash says so."""
        status = AttemptStatus.from_exit_code(code)
        return cls(status, code, f"{who} exited {code}" if status is AttemptStatus.CRASHED else "")


class Backend(abc.ABC):
    """Starts and watches trainer attempts for one run directory."""

    name: str = "abstract"

    def __init__(self, *, run_dir: RunDir, profile: ClusterProfile | None = None, job: Job | None = None) -> None:
        """Every backend is built the same way (the registry in `cona.orchestrator.backends` does it): the run
        directory, the cluster profile (a backend reads its own section of it) and the job. Backends may take
        further keyword-only options with defaults, for tests."""
        self.run_dir = run_dir
        self.profile = profile
        self.job = job

    def write_launch(self, attempt: int, strategy: Strategy, *, in_place: bool = False, **extra: Any) -> LaunchRecord:
        """Write attempt `attempt`'s launch record (`attempts/<n>/launch.json`), before the attempt can start: the
        trainer learns its strategy there. `extra` carries the backend's own fields."""
        record = LaunchRecord(attempt=attempt, strategy=strategy, backend=self.name, written_at=time.time(),
                              in_place=in_place, extra=extra)  # fmt: skip
        self.run_dir.write_launch(record)
        return record

    @abc.abstractmethod
    def render(self, *, strategy: Strategy) -> str:
        """What this backend would run or submit for an attempt of `strategy`, as text (`cona render BACKEND`)."""

    @abc.abstractmethod
    def launch(
        self, *, attempt: int, strategy: Strategy, previous: Attempt | None = None,
        elastic: dict[int, Strategy] | None = None,
    ) -> Attempt:  # fmt: skip
        """Start the trainer for `attempt` under `strategy`.

        `previous` is the attempt that just ended (switched/stopped/crashed), so a backend can reuse its
        allocation when the node count stays the same (Slurm relaunches inside the running job).

        `elastic` (an elastic run's planning table, {node count: strategy}, `strategy` among them): the attempt may
        start on any of these node counts, whatever the cluster gives, with that count's strategy; `poll` then
        reports the strategy it runs (`Outcome.strategy`). Slurm lets the allocation decide; Kubernetes counts the
        Nodes a pod could run on, local the devices its `devices` file leaves; a backend that cannot tell launches
        `strategy`.
        """

    @abc.abstractmethod
    def poll(self, attempt: Attempt) -> Outcome:
        """Where the attempt stands now; never blocks for long."""

    @abc.abstractmethod
    def cancel(self, attempt: Attempt) -> None:
        """Kill the attempt (used for hangs and `cona stop --now`); idempotent."""

    poll_interval_s: float = 0.5
    """How often the scheduler's loop polls an attempt (and tails its heartbeats): cheap for local processes and
    files; a cluster API answers every poll, so the Kubernetes backend polls less often."""

    supports_in_place_switch: bool = False
    """Whether `offer_in_place`/`continued` work: the backend can watch processes that go on as the next attempt."""

    in_place_overhead_s: float = 1.0
    """Seconds an in-place switch adds to checkpoint save and load (exit record, barrier, release and rebuild)."""
    relaunch_overhead_s: float = 30.0
    """Seconds a relaunch adds to checkpoint save and load: teardown, process start, imports, rendezvous, build."""
    resubmit_overhead_s: float = 120.0
    """Seconds a switch that needs a new allocation adds to checkpoint save and load (a relaunch plus the queue)."""

    @property
    def pending_timeout_s(self) -> float | None:
        """How long an attempt may stay pending before the scheduler reports it (a `pending-timeout` event) and
        ends it if it is `Outcome.stuck`; None: pending is a queue without a limit (Slurm, local)."""
        return None

    def resume_hint(self, detail: str) -> str:
        """The command that resumes this run once what an unstartable attempt waited for (`detail`) is fixed: the
        end of the run's failure line."""
        return f"`cona run --resume {self.run_dir.root}`"

    reports_long_queue_waits: bool = True
    """Whether an attempt that waits for capacity (not `Outcome.stuck`) past `pending_timeout_s` is reported (a
    `pending-timeout` event with action `wait`; `cona status`: past the pending timeout): Kubernetes, where a pod
    unschedulable for ten minutes is news; not Slurm, where hours in a queue are the norm and the timeout is only
    for reasons that waiting does not resolve."""

    def switch_kind(self, current: Strategy, target: Strategy, *, in_place_allowed: bool) -> SwitchKind:
        """How a switch from `current` to `target` happens on this backend (the one place that decides it).

        In place when allowed (`policy.in_place_switch`), supported and the world size stays; otherwise the
        processes exit and the next attempt is launched."""
        if in_place_allowed and self.supports_in_place_switch and current.world_size == target.world_size:
            return SwitchKind.IN_PLACE
        return SwitchKind.RELAUNCH

    def switch_overhead_s(self, kind: SwitchKind) -> float:
        """The backend's part of a switch of `kind`, beyond the step in flight and checkpoint save and load."""
        return {
            SwitchKind.IN_PLACE: self.in_place_overhead_s,
            SwitchKind.RELAUNCH: self.relaunch_overhead_s,
            SwitchKind.RESUBMIT: self.resubmit_overhead_s,
        }[kind]

    def offer_in_place(self, attempt: Attempt, *, number: int, strategy: Strategy) -> None:
        """Before an in-place switch is asked for: write the launch record of attempt `number`, which `attempt`'s
        processes go on as under `strategy` (the trainer reads it there; `launched_as` names the attempt that
        started the processes, whose directory keeps their log and exit code)."""
        if not self.supports_in_place_switch:
            raise NotImplementedError(f"the {self.name} backend cannot switch in place")
        self.write_launch(number, strategy, in_place=True, launched_as=attempt.extra.get("launched_as", attempt.number))

    def continued(self, attempt: Attempt, *, number: int, strategy: Strategy) -> Attempt:
        """The attempt `number` that `attempt`'s processes became by switching in place to `strategy` (its launch
        record was written by `offer_in_place`)."""
        raise NotImplementedError(f"the {self.name} backend cannot switch in place")

    def available_nodes(self, attempt: Attempt) -> int | None:
        """How many nodes a run could train on now: those `attempt` holds plus idle ones it could get (an elastic
        run grows when the policy says it pays); None when the backend cannot tell (then it never grows)."""
        return None

    def crash_logs(self, attempt: Attempt) -> list[Path]:
        """The logs of `attempt` that end with torchrun's failure summary when a worker failed, one per node (the
        local `torchrun.log`, Slurm's `node-<i>.log`, Kubernetes' `pod-<name>.log`): `crashcause.crash_cause`
        reads which rank died of what there. Default: none."""
        return []

    def with_crash_cause(self, attempt: Attempt, outcome: Outcome) -> Outcome:
        """`outcome` with the rank that died and of what (`crashcause.crash_cause`: a signal torchrun's summary in
        `crash_logs` names, else the attempt's crash records) added to a crash's detail: the cluster says a job or
        pod failed, torchrun and the ranks' own records say why. Unchanged for any other status, or where nothing
        says (no summary and no record: a lost node)."""
        if outcome.status is not AttemptStatus.CRASHED:
            return outcome
        said = crash_cause(self.run_dir, attempt.number, self.crash_logs(attempt))
        return dataclasses.replace(outcome, detail=f"{outcome.detail}: {said}") if said else outcome

    def gone(self, attempt: Attempt) -> bool:
        """Whether `attempt`'s processes are known to have ended, told without acting on anything: for `cona status`
        and `cona stop` of a run whose orchestrator is gone, where a trainer that crashed meanwhile left no exit
        record and its last heartbeat still looks recent. False: running, or this backend cannot tell from here."""
        return False

    def adopt(self, attempt: Attempt) -> bool:
        """After an orchestrator restart: True if `attempt` is still alive and can be watched again."""
        return not self.poll(attempt).status.finished

    def release(self, attempt: Attempt) -> None:
        """After `attempt` ended, before the next one is launched: free what it still holds and keep what only it
        has (Kubernetes: save the pods' logs into the attempt's directory, delete the workload and wait until its
        pods are gone, so the next attempt's pods find the GPUs free). Default: nothing (local processes are gone;
        a Slurm step ends with its processes)."""
        return None

    def exclusion(self) -> Any:
        """What keeps a second orchestrator off this run while this one drives it: a context manager whose value
        has `check()`, which raises once the exclusion is lost (the orchestrator then stops acting on the run).
        Default: an exclusive `flock` on the run directory's orchestrator.lock (`RunLock`)."""
        from cona.orchestrator.runstate import RunLock

        return RunLock(self.run_dir.lock)

    def close(self) -> None:
        """Release anything held across attempts (an allocation) at the end of the run."""
        return None
