"""The orchestrator's side of the run directory: run.yaml, state.json (`RunState`), events.jsonl and the single-owner
lock."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from cona.orchestrator.backends.base import Attempt
from cona.orchestrator.job import Job, job_from_dict, job_to_dict
from cona.orchestrator.profile import ClusterProfile
from cona.orchestrator.switchcost import SwitchKind
from cona.orchestrator.throughput import checked_measurement
from cona.protocol.rundir import (
    RunDir,
    append_jsonl,
    atomic_write_json,
    atomic_write_text,
    read_json,
    read_jsonl,
    restrict_umask,
)
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError, load_yaml, validate


def create_run(*, run_dir: RunDir, profile: ClusterProfile, job: Job, measured: list[dict[str, Any]] | None = None) -> None:
    """Write the immutable run.yaml (resolved profile and job, and the step times `cona run --measured` starts the
    throughput model with)."""
    if run_dir.run_yaml.exists():
        raise ConfigError(f"{run_dir.run_yaml}: the run already exists; resume it with `cona run --resume {run_dir.root}`")
    job = job.model_copy(deep=True)
    data_path = Path(job.data.path)
    if not data_path.exists():
        raise ConfigError(
            f"data.path {job.data.path!r} does not exist; for the Shakespeare corpus run "
            "`python scripts/fetch_shakespeare.py data/shakespeare.txt`"
        )
    job.data.path = str(data_path.resolve())  # workers may start in another directory
    restrict_umask()
    try:
        run_dir.root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--run-dir {run_dir.root}: cannot create it ({e.strerror}); pick a writable directory") from None
    document = {
        "created": time.time(),
        "profile": profile.model_dump(mode="json"),
        "job": job_to_dict(job),
    }
    if measured:
        document["measured"] = measured
    atomic_write_text(run_dir.run_yaml, yaml.safe_dump(document, sort_keys=False))


def load_run(run_dir: RunDir) -> tuple[ClusterProfile, Job]:
    """The profile and job a run was created with."""
    if not run_dir.run_yaml.exists():
        raise ConfigError(f"{run_dir.root}: not a cona run directory (no run.yaml)")
    # `load_yaml` names the file for every way it can be unreadable (corrupt YAML, bytes that are no text, a directory).
    document = load_yaml(run_dir.run_yaml)
    if "profile" not in document or "job" not in document:
        raise ConfigError(f"{run_dir.run_yaml}: missing the profile or job section")
    profile = validate(ClusterProfile, document["profile"], source=f"{run_dir.run_yaml} (profile)")
    job = job_from_dict(document["job"], source=f"{run_dir.run_yaml} (job)")
    return profile, job


def stored_measurements(run_dir: RunDir) -> list[dict[str, Any]]:
    """The measured step times the run was created with (`cona run --measured`; run.yaml's `measured`), or []."""
    if not run_dir.run_yaml.exists():
        return []
    measured = load_yaml(run_dir.run_yaml).get("measured") or []
    try:  # what `ThroughputModel.absorb` reads
        measured = [checked_measurement(entry) for entry in measured]
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{run_dir.run_yaml}: its `measured` step times are damaged ({type(e).__name__}: {e}); "
                          "remove the `measured` section to start without them") from None  # fmt: skip
    return measured


def request_stop(run_dir: RunDir, *, reason: str = "cona stop") -> int:
    """Ask the run to stop: a stop command in control.json (the trainer checkpoints at its next step boundary and
    exits; the orchestrator marks the run stopped). Returns the control record's sequence number."""
    from cona.protocol.rundir import ControlRecord

    current = run_dir.read_control()
    try:  # the orchestrator acts only on a seq above the newest it took note of (control.json may be damaged)
        noted = read_state(run_dir).control_seq
    except ConfigError:
        noted = 0
    seq = max(current.seq if current else 0, noted) + 1
    run_dir.write_control(ControlRecord(seq=seq, command="stop", reason=reason))
    log_event(run_dir, "stop-command", seq=seq, reason=reason)
    return seq


def log_event(run_dir: RunDir, kind: str, /, **fields: Any) -> dict[str, Any]:
    """Append one decision or incident to events.jsonl."""
    record = {"time": time.time(), "event": kind, **fields}
    append_jsonl(run_dir.events, record)
    return record


def _usable_event(record: dict[str, Any]) -> bool:
    """Whether a record has what readers of events.jsonl rely on: a numeric `time`, a string `event`, and for a
    switch two strategies. A line damaged by hand (or by a disk) that still parses as JSON is skipped like a torn one."""
    time_ = record.get("time")
    if not isinstance(record.get("event"), str) or isinstance(time_, bool) or not isinstance(time_, int | float):
        return False
    if record["event"] == "switch":
        try:
            Strategy.from_dict(record["from"])
            Strategy.from_dict(record["to"])
        except (KeyError, TypeError, ValueError):
            return False
    return True


def read_events(run_dir: RunDir, *, skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """The records of events.jsonl that readers can use (see `_usable_event`); the lines left out are described in
    `skipped` when it is given."""
    records = read_jsonl(run_dir.events, damaged=skipped)[0]
    usable = [e for e in records if _usable_event(e)]
    if skipped is not None:
        unusable = len(records) - len(usable)
        skipped.extend([f"{run_dir.events}: a record without a numeric time, an event name or its strategies"] * unusable)
    return usable


def warn_skipped(skipped: list[str]) -> None:
    """Say on stderr, in one line, that a reader left damaged lines out (how many, and the first), rather than drop
    them silently: the rest of the file is still used."""
    if skipped:
        more = f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
        print(f"cona: warning: skipped a damaged line, {skipped[0]}{more}; the rest is used", file=sys.stderr, flush=True)


STATE_VERSION = 2
"""Version of state.json's layout. 1 (cona 0.1, unversioned): the run model's fields at the top level next to
`attempt` and `strategy` copies of the newest attempt; still read. 2: `RunState`. Fields added to version 2 since
(`pending`, `disruptions_without_progress`, `disruption_checkpoint`) have defaults, so a state written before them
reads as before, and an older cona 2 reader ignores them: no new version."""


@dataclasses.dataclass
class PendingSpell:
    """The current attempt is pending (queued, unschedulable, pulling its image): since when, and why."""

    attempt: int
    since: float
    """The first poll of this spell that found the attempt pending (the backend's pending timeout counts from here)."""
    detail: str = ""
    """The backend's reason, e.g. the cluster scheduler's `0/4 nodes are available: 4 Insufficient nvidia.com/gpu`."""
    timed_out: bool = False
    """The `pending-timeout` event was logged (once per spell)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PendingSpell:
        return cls(attempt=int(data["attempt"]), since=float(data["since"]), detail=str(data.get("detail", "")),
                   timed_out=bool(data.get("timed_out", False)))  # fmt: skip


@dataclasses.dataclass
class SwitchRequest:
    """A switch the orchestrator asked for and whose attempt has not ended yet."""

    time: float
    """When it was decided (the switch's cost is measured from here)."""
    seq: int
    """The control.json seq that carries it."""
    source: Strategy
    target: Strategy
    kind: SwitchKind
    """How it is carried out: in place, by relaunch or by resubmission."""
    predicted_s: float | None = None

    @property
    def in_place(self) -> bool:
        return self.kind is SwitchKind.IN_PLACE

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.time, "seq": self.seq, "from": self.source.to_dict(), "to": self.target.to_dict(),
                "kind": self.kind.value, "predicted_s": self.predicted_s}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SwitchRequest:
        kind = data.get("kind") or (SwitchKind.IN_PLACE if data.get("in_place") else SwitchKind.RELAUNCH).value
        return cls(time=float(data["time"]), seq=int(data.get("seq", 0)), source=Strategy.from_dict(data["from"]),
                   target=Strategy.from_dict(data["to"]), kind=SwitchKind(kind), predicted_s=data.get("predicted_s"))  # fmt: skip


@dataclasses.dataclass
class RunState:
    """state.json: what the orchestrator must know to go on after a restart. One writer, the scheduler; `cona
    status` and the report read it. Times are Unix seconds."""

    status: str = "created"
    """created, running, done, stopped or failed."""
    final: bool = False
    """The run ended (done, stopped or failed); `cona run --resume` clears it to go on."""
    reason: str | None = None
    """Why it stopped or failed."""
    attempts: list[Attempt] = dataclasses.field(default_factory=list)
    """Every attempt launched, oldest first; the last is the current one."""
    attempts_started: int = 0
    """The highest attempt number handed out, saved before the launch so a restart never reuses a number."""
    run_started: float | None = None
    strategy_since: float | None = None
    """When the current strategy started (the policy's minimum dwell time counts from here)."""
    launched_at: float | None = None
    last_heartbeat_time: float | None = None
    """When the current attempt's last heartbeat was read (None: none yet, the start-up timeout applies)."""
    pending_seen_at: float | None = None
    """The last poll that found the attempt queued (the heartbeat-gap clock restarts there)."""
    heartbeat_offset: int = 0
    """Bytes of the current attempt's heartbeat file already read."""
    control_seq: int = 0
    """The newest control.json seq this orchestrator wrote or took note of."""
    restarts_in_row: int = 0
    """Crashes since the last attempt that ended well (policy.max_restarts bounds it). A disruption leaves it as it
    is: it neither counts as a crash nor proves that the trainer is healthy."""
    disruptions_without_progress: int = 0
    """Disruptions in a row that found the same latest complete checkpoint (policy.max_disruptions_without_progress
    bounds it)."""
    disruption_checkpoint: str | None = None
    """The latest complete checkpoint (its directory name) when the last disruption was handled."""
    pending: PendingSpell | None = None
    """Set while the current attempt is pending (`cona status` shows it); cleared when it runs or ends."""
    hang_cancelled: int | None = None
    """The attempt cancelled for a heartbeat gap, so its end is reported as a hang."""
    switch_requested: SwitchRequest | None = None
    stop_requested: bool = False
    time_budget_reached: bool = False
    finished_at: float | None = None
    updated: float | None = None
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The run model's own state (`RunModel.to_dict`): estimators, switch costs, the live view, the last decision."""
    version: int = STATE_VERSION

    @property
    def current(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def live(self) -> dict[str, Any]:
        """The live view as saved (step, samples, losses, noise scale, ...)."""
        return dict(self.model.get("live") or {})

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["attempts"] = [a.to_dict() for a in self.attempts]
        data["switch_requested"] = self.switch_requested.to_dict() if self.switch_requested else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "state.json") -> RunState:
        version = data.get("version", 1)
        if not isinstance(version, int) or version > STATE_VERSION:
            raise ConfigError(
                f"{source}: written by a newer cona (state version {version}; this cona reads up to "
                f"{STATE_VERSION}); resume the run with the cona that started it, or upgrade cona"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        if version == 1:
            # Unversioned: the run model's keys sat at the top level; `attempt`/`strategy` copied the newest attempt.
            model = {k: v for k, v in data.items() if k not in fields and k not in ("attempt", "strategy")}
            model["last_decision"] = data.get("last_decision")
            data = {**{k: v for k, v in data.items() if k in fields}, "model": model,
                    "attempts_started": int(data.get("attempt", 0))}  # fmt: skip
        try:
            known = {k: v for k, v in data.items() if k in fields}
            known["attempts"] = [Attempt.from_dict(a) for a in data.get("attempts") or []]
            request = data.get("switch_requested")
            known["switch_requested"] = SwitchRequest.from_dict(request) if request else None
            pending = data.get("pending")
            known["pending"] = PendingSpell.from_dict(pending) if pending else None
            known["version"] = STATE_VERSION
            return cls(**known)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{source}: unreadable run state ({e}); the run cannot be resumed from it") from None


def read_state(run_dir: RunDir) -> RunState:
    """The run's state.json (a fresh RunState when there is none yet)."""
    try:
        data = read_json(run_dir.state_json)
    except (OSError, ValueError):
        raise ConfigError(f"{run_dir.state_json}: unreadable; the run cannot be resumed from it") from None
    if data is None:
        return RunState()
    if not isinstance(data, dict):
        raise ConfigError(f"{run_dir.state_json}: not a JSON object; the run cannot be resumed from it")
    return RunState.from_dict(data, source=str(run_dir.state_json))


def write_state(run_dir: RunDir, state: RunState) -> None:
    atomic_write_json(run_dir.state_json, state.to_dict())


@dataclasses.dataclass
class RunLock:
    """An exclusive `flock` on the run directory: never two orchestrators, hence never two attempts at once.

    The kernel drops the lock when the holder dies (even by SIGKILL), so a restarted orchestrator just takes it.
    """

    path: Path
    _fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(
                f"{self.path.parent}: another cona orchestrator (pid {holder}) is running this run; "
                "stop it first or watch it with `cona status`"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd

    def check(self) -> None:
        """The kernel keeps the lock for as long as this process lives: it cannot be lost."""

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
