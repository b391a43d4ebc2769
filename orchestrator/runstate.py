"""The orchestrator's side of the run directory: run.yaml, state.json (`RunState`), events.jsonl and the single-owner
lock."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from cona.orchestrator.backends.base import Attempt
from cona.orchestrator.job import Job, job_from_dict, job_to_dict
from cona.orchestrator.profile import ClusterProfile
from cona.orchestrator.switchcost import SwitchKind
from cona.orchestrator.throughput import checked_measurements
from cona.protocol.heartbeat_record import NOTICE_EVENTS
from cona.protocol.rundir import (
    RunDir,
    append_jsonl,
    atomic_write_json,
    atomic_write_text,
    drop_torn_tail,
    file_given_as_run_dir,
    open_regular_fd,
    read_json,
    read_jsonl,
    restrict_umask,
)
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError, load_yaml, validate


def create_run(*, run_dir: RunDir, profile: ClusterProfile, job: Job, measured: list[dict[str, Any]] | None = None) -> None:
    """Write run.yaml (resolved profile and job, and the step times `cona run --measured` starts the throughput model
    with). Nothing changes it afterwards but `amend_profile`, and only how an ended run's jobs are submitted."""
    if run_dir.run_yaml.exists():
        raise ConfigError(f"{run_dir.run_yaml}: the run already exists; resume it with `cona run --resume {run_dir.root}`")
    job = job.model_copy(deep=True)
    data_path = Path(job.data.path)
    if not data_path.exists():
        from cona.protocol.inputs import missing_data_hint  # the same advice as the trainer's

        raise ConfigError(f"data.path {job.data.path!r} does not exist; {missing_data_hint(job.data.path)}")
    job.data.path = str(data_path.resolve())  # workers may start in another directory
    restrict_umask()
    try:
        run_dir.root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--run-dir {run_dir.root}: cannot create it ({e.strerror}); pick a writable directory") from None
    document: dict[str, Any] = {
        "version": RUN_YAML_VERSION,
        "created": time.time(),
        "profile": profile.model_dump(mode="json"),
        "job": job_to_dict(job),
    }
    if measured:
        document["measured"] = measured
    document["complete"] = True  # last: a file cut short anywhere lacks it (`run_yaml_damage`)
    atomic_write_text(run_dir.run_yaml, yaml.safe_dump(document, sort_keys=False))


RUN_YAML_VERSION = 2
"""Version of run.yaml's layout. 1 (unversioned): `created`, `profile`, `job` and `measured`. 2: the same between
`version` (first) and `complete: true` (last), so that a file cut short anywhere — even inside a value — is told from
a whole one. Both are read."""

_ALWAYS_WRITTEN = {
    "profile": ("name", "backend", "nodes", "gpus_per_node", "accelerator", "network", "storage"),
    "job": ("name", "model", "data", "optimizer", "batch", "parallel", "target", "eval", "checkpoint", "heartbeat",
            "policy"),
}  # fmt: skip
"""The fields of run.yaml's profile and job that every cona has written (the resolved models dump every field):
one missing means the file was cut short or damaged, not that the run meant the default."""


def run_yaml_damage(document: dict[str, Any]) -> str | None:
    """What makes run.yaml's parsed `document` not the whole file `create_run` wrote, or None. A YAML file cut short
    often still parses; read as it is, its missing sections would take their defaults and the run would go on as
    another job (a lost target, another checkpoint interval and LR horizon) without a word."""
    version = document.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        return f"its version {version!r} is not a layout of run.yaml"
    if version > RUN_YAML_VERSION:
        return (f"written by a newer cona (run.yaml version {version}; this cona reads up to {RUN_YAML_VERSION}); "
                "use the cona that created the run, or upgrade cona")  # fmt: skip
    missing = []
    for section, fields in _ALWAYS_WRITTEN.items():
        data = document.get(section)
        if isinstance(data, dict):
            missing += [f"{section}.{name}" for name in fields if name not in data]
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        return f"cut short or damaged: {', '.join(missing[:4])}{more} missing, which cona always writes"
    if version >= 2 and document.get("complete") is not True:
        return "cut short: it does not end with the `complete: true` that cona writes last"
    return None


_warned: set[Path] = set()
"""The damaged run.yaml files this process has warned about."""


def load_run(run_dir: RunDir, *, resume: bool = False) -> tuple[ClusterProfile, Job]:
    """The profile and job a run was created with. A run.yaml that is not whole (`run_yaml_damage`) is refused for
    `resume` (the orchestrator would go on with defaults in place of the missing job); `cona status`, `stop` and
    `report` go on with what is there, after a warning line naming it."""
    document = _run_document(run_dir, resume=resume)
    profile = validate(ClusterProfile, document["profile"], source=f"{run_dir.run_yaml} (profile)")
    job = job_from_dict(document["job"], source=f"{run_dir.run_yaml} (job)")
    return profile, job


def _run_document(run_dir: RunDir, *, resume: bool) -> dict[str, Any]:
    """run.yaml as parsed, checked as `load_run` says (refused or warned about when it is not whole)."""
    if (problem := file_given_as_run_dir(run_dir.root)) is not None:
        raise ConfigError(problem)
    if not run_dir.run_yaml.exists():
        raise ConfigError(f"{run_dir.root}: not a cona run directory (no run.yaml)")
    # `load_yaml` names the file for every way it can be unreadable (corrupt YAML, bytes that are no text, a directory).
    document = load_yaml(run_dir.run_yaml, run_file=True)
    if "profile" not in document or "job" not in document:
        raise ConfigError(f"{run_dir.run_yaml}: missing the profile or job section")
    damage = run_yaml_damage(document)
    cut_inside = damage and not all(isinstance(document[k], dict) for k in ("profile", "job"))
    if damage and (resume or cut_inside):  # cut inside a section's first line: nothing of it to show with defaults
        raise ConfigError(f"{run_dir.run_yaml}: {damage}; restore it from a backup (cona writes it once, whole, when "
                          "the run is created) or start a new run with --run-dir")  # fmt: skip
    if damage and run_dir.run_yaml not in _warned:
        _warned.add(run_dir.run_yaml)  # once per process: `cona report` loads the run twice
        print(f"cona: warning: {run_dir.run_yaml}: {damage}; what it lacks is shown with its defaults", file=sys.stderr,
              flush=True)  # fmt: skip
    return document


AMENDABLE_PROFILE_FIELDS: dict[str, tuple[str, ...] | None] = {
    "env": None,  # the trainers' environment: a wrong NCCL_SOCKET_IFNAME is fixed on resume
    "slurm": None,  # every field
    "kubernetes": ("image", "image_pull_secrets", "service_account", "priority_class", "node_selector", "tolerations",
                   "pending_timeout_s", "elastic_pending_timeout_s", "shm_size", "trainer_cpu", "trainer_memory",
                   "orchestrator_cpu", "orchestrator_memory", "orchestrator_restarts"),
}  # fmt: skip
"""The profile fields an ended run may change on resume (`amend_profile`), by section (None: all of it): how its jobs
or pods are submitted and scheduled (a QOS, an account, a partition, an image that can be pulled, a Secret) and the
trainers' environment; not what the run was planned for (nodes, devices, network), which would change the
strategies its checkpoints and records were made under, nor where its objects live (a namespace, a PVC) or how they
are wired (workload kind, ports)."""


def check_amendable(overrides: list[str] | tuple[str, ...]) -> None:
    """ConfigError, in one line, for an override of a field `AMENDABLE_PROFILE_FIELDS` does not list."""
    for item in overrides:
        key = item.partition("=")[0].strip()
        section, _, rest = key.partition(".")
        fields = AMENDABLE_PROFILE_FIELDS.get(section, ())
        if not rest or (fields is not None and rest.split(".")[0] not in fields):
            which = (f"of {section}: {', '.join(fields)}" if rest and fields else
                     "env.*, slurm.*, kubernetes.image and the other kubernetes fields of how pods are scheduled")  # fmt: skip
            raise ConfigError(f"--profile-set {item}: a resumed run keeps the profile it was planned for; only how its "
                              f"jobs are submitted can change on resume ({which}); start a new run for the rest")  # fmt: skip


def amend_profile(
    run_dir: RunDir, overrides: list[str], *, lock: bool = True, token: str | None = None,
    check: Callable[[ClusterProfile], None] | None = None,
) -> ClusterProfile:  # fmt: skip
    """Apply `--profile-set` overrides (`check_amendable`) to an ended run's stored profile — `cona run --resume RUN
    --profile-set slurm.qos=...` after a job Slurm would never start, `cona submit --resume RUN --profile-set
    kubernetes.image=...` after an image that cannot be pulled — rewrite run.yaml whole and log a `profile-amended`
    event; returns the new profile. `lock`: under the run's flock, so that no orchestrator of the run runs meanwhile
    (a submitted run's new orchestrator holds its Lease instead). `token`: the resume that asked (Kubernetes), logged
    so that a restarted orchestrator does not apply it twice. `check`: what must hold of the new profile before it is
    written (`cona run`: the Slurm clients and partition), raising in one line. ConfigError, in one line, for another
    field, a run that has not ended or whose orchestrator holds it, or a value the profile refuses."""
    from cona.protocol.yamlconfig import apply_overrides

    check_amendable(overrides)
    with RunLock(run_dir.lock) if lock else contextlib.nullcontext():
        state = read_state(run_dir, resume=True)
        if state.status == "done":
            raise ConfigError(f"{run_dir.root}: the run has finished (done); there is nothing to resume with another "
                              "profile")  # fmt: skip
        if not state.final:
            raise ConfigError(f"{run_dir.root}: the run has not ended (status {state.status}); its profile can change "
                              "on resume once it has stopped or failed (`cona stop`)")  # fmt: skip
        document = _run_document(run_dir, resume=True)  # a damaged run.yaml is refused as a resume refuses it
        stored = document["profile"]
        for section in {item.partition("=")[0].strip().partition(".")[0] for item in overrides}:
            if not isinstance(stored.get(section), dict):
                raise ConfigError(f"--profile-set {section}.*: the run's profile {stored.get('name')!r} has no "
                                  f"{section} section (its backend is {stored.get('backend')!r})")  # fmt: skip
        amended = validate(ClusterProfile, apply_overrides(dict(stored), list(overrides), source="--profile-set"),
                           source=f"{run_dir.run_yaml} (profile)", overrides=overrides, flag="--profile-set")  # fmt: skip
        if check is not None:  # refused: run.yaml stays as it was
            check(amended)
        document["profile"] = amended.model_dump(mode="json")
        document.pop("complete", None)
        document["amended"] = [*document.get("amended", []), {"time": time.time(), "profile_set": list(overrides)}]
        document["complete"] = True  # last, as `create_run` writes it
        atomic_write_text(run_dir.run_yaml, yaml.safe_dump(document, sort_keys=False))
        log_event(run_dir, "profile-amended", profile_set=list(overrides), **({"token": token} if token else {}))
    return amended


def check_run_yaml(run_dir: RunDir) -> None:
    """ConfigError, naming run.yaml, unless it is the whole file `create_run` wrote (for an orchestrator that goes
    on with a run: `Scheduler.check_resumable`)."""
    load_run(run_dir, resume=True)


def stored_measurements(run_dir: RunDir) -> list[dict[str, Any]]:
    """The measured step times the run was created with (`cona run --measured`; run.yaml's `measured`), or []."""
    if not run_dir.run_yaml.exists():
        return []
    measured = load_yaml(run_dir.run_yaml, run_file=True).get("measured") or []
    try:  # what `ThroughputModel.absorb` reads
        measured = checked_measurements(measured)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"{run_dir.run_yaml}: its `measured` step times are damaged ({type(e).__name__}: {e}); "
                          "remove the `measured` section to start without them") from None  # fmt: skip
    return measured


def request_stop(run_dir: RunDir, *, reason: str = "cona stop", attempt: int | None = None) -> int:
    """Ask the run to stop: a stop command in control.json (the trainer checkpoints at its next step boundary and
    exits; the orchestrator marks the run stopped). Returns the control record's sequence number.

    `attempt`: the stop is for that attempt's trainer alone (`cona stop` of a run whose orchestrator is gone, sent to
    the trainer that trains on unattended): no relaunch serves it, and the next orchestrator drops it if that trainer
    ended without serving it, or resumes the run it stopped (`Scheduler.start_or_resume`). None: for the run, which
    its orchestrator carries across attempts until the run has stopped."""
    from cona.protocol.rundir import ControlRecord

    current = run_dir.read_control()
    try:  # the orchestrator acts only on a seq above the newest it took note of (control.json may be damaged)
        noted = read_state(run_dir).control_seq
    except ConfigError:
        noted = 0
    seq = max(current.seq if current else 0, noted) + 1
    run_dir.write_control(ControlRecord(seq=seq, command="stop", reason=reason, attempt=attempt))
    log_event(run_dir, "stop-command", seq=seq, reason=reason, **({"attempt": attempt} if attempt is not None else {}))
    return seq


def used_attempts(run_dir: RunDir, *, launched: bool = True) -> set[int]:
    """The attempt numbers the run directory shows were handed out (1 on; 0 is a trainer run by hand): a heartbeat
    or samples file, an exit record, a `launch` event, and with `launched` every `attempts/<n>/` directory (the
    scheduler creates it only after it saved the number in state.json). Without `launched`, an attempt whose
    directory holds only the launch record of an in-place switch offered but never taken does not count: only what
    some process of it ran or the orchestrator logged."""
    names = [p.stem for p in run_dir.heartbeats.glob("*.jsonl")] + [p.stem for p in run_dir.samples_log.glob("*.jsonl")]
    names += [p.parent.name for p in run_dir.root.glob("attempts/*/exit.json")]
    if launched:
        names += [p.name for p in run_dir.root.glob("attempts/*") if p.is_dir()]
    found = {int(name) for name in names if name.isdigit()}
    # Every launch record's number, also of one `event_problem` rejects for another field: evidence, not a reader.
    for record in read_jsonl(run_dir.events)[0]:
        if record.get("event") == "launch" and _is_int(record.get("attempt")):
            found.add(record["attempt"])
    return {n for n in found if n >= 1}


def end_torn_events(run_dir: RunDir) -> None:
    """Cut a torn last line off events.jsonl (left by a writer that died mid-append) and log what was cut; for the
    orchestrator that holds the run, before it appends: its first record would be glued onto the torn one and lost
    with it, and every reader would warn of the damaged line for ever after."""
    at, dropped = drop_torn_tail(run_dir.events)
    if dropped:
        text = dropped.decode("utf-8", errors="replace")
        log_event(run_dir, "torn-tail", file=str(run_dir.events), at=at, bytes=len(dropped),
                  dropped=text[:500] + ("…" if len(text) > 500 else ""))  # fmt: skip


def log_event(run_dir: RunDir, kind: str, /, **fields: Any) -> dict[str, Any]:
    """Append one decision or incident to events.jsonl."""
    record = {"time": time.time(), "event": kind, **fields}
    append_jsonl(run_dir.events, record)
    return record


_EVENT_TEXTS = ("detail", "reason", "note")
"""An event's free-text fields: said last, as written (`event_line`)."""


def event_line(record: dict[str, Any]) -> str:
    """An events.jsonl record in one line for a person, for any kind and any fields: its name, its attempt, its
    other fields as `name=value` (a strategy in its short form, `d2t1p1 m2 g16`), then its free text — never a
    Python dict repr, e.g. `failure: attempt 1, backoff_s=1, exit_code=1, kind=crashed, restart=1, strategy=d1t1p1
    m8 g8: step 7: loss nan; lower optimizer.lr`. The fields come in the record's order (events.jsonl sorts them).
    Generic, so a field an event gains is shown without a change here."""
    fields = []
    if "attempt" in record:
        fields.append(f"attempt {_event_value(record['attempt'])}")
    for key, value in record.items():
        if key in ("time", "event", "attempt", *_EVENT_TEXTS) or value is None or value == "":
            continue
        fields.append(f"{key}={_event_value(value)}")
    texts = [str(record[key]) for key in _EVENT_TEXTS if record.get(key) not in (None, "")]
    return ": ".join([str(record.get("event", "event")), *([", ".join(fields)] if fields else []), *texts])


def _event_value(value: Any) -> str:
    """One field of an event as `event_line` shows it."""
    if isinstance(value, bool):
        return "true" if value else "false"  # as events.jsonl spells it
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        if _is_strategy(value):
            return Strategy.from_dict(value).short()
        return "(" + ", ".join(f"{k}={_event_value(v)}" for k, v in value.items()) + ")"
    if isinstance(value, list | tuple):
        return "(" + ", ".join(_event_value(v) for v in value) + ")"
    return str(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    # Finite: Python's json reads `1e999` as inf and `NaN` as nan, and a report's wall time came out "inf s".
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_strategy(value: Any) -> bool:
    try:
        Strategy.from_dict(value)
    except (KeyError, TypeError, ValueError):
        return False
    return True


def event_problem(record: dict[str, Any]) -> str | None:
    """What an events.jsonl record lacks of what its readers take from a record of its kind, or None: usable. The
    one place these shapes are judged, for every reader (`read_events`, `read_new_events`: `cona status`, `cona
    report`, `cona run`'s console, the orchestrator's own reads): a numeric `time` and an event name for all; a
    launch's attempt number and strategy, a switch's two strategies and text reason, a switch-complete's cost, a
    checkpoint notice's attempt and detail. A record edited by hand, or bytes flipped into valid JSON, is skipped
    and said, as a damaged line is, instead of ending its reader in a KeyError or TypeError."""
    kind = record.get("event")
    if not isinstance(kind, str):
        return "a record without an event name"
    if not _is_number(record.get("time")):
        return f"a {kind} record without a numeric time"
    if "at" in record and not _is_number(record["at"]):
        return f"a {kind} record whose `at` is not a time ({record['at']!r})"
    if kind == "launch":
        if not _is_int(record.get("attempt")):
            return f"a launch record without an attempt number ({record.get('attempt')!r})"
        if not _is_strategy(record.get("strategy")):
            return "a launch record without a strategy"
    elif kind == "switch":
        if not _is_strategy(record.get("from")) or not _is_strategy(record.get("to")):
            return "a switch record without its two strategies"
        if not isinstance(record.get("reason", ""), str):
            return f"a switch record whose reason is not text ({record.get('reason')!r})"
    elif kind == "switch-aborted" and not _is_int(record.get("attempt")):
        return f"a switch-aborted record without an attempt number ({record.get('attempt')!r})"
    elif kind == "switch-complete":
        if not _is_number(record.get("switch_cost_s")):
            return f"a switch-complete record without a numeric switch_cost_s ({record.get('switch_cost_s')!r})"
    elif kind in NOTICE_EVENTS and not (_is_int(record.get("attempt")) and isinstance(record.get("detail"), str)):
        return f"a {kind} record without its attempt number and detail"
    return None


def happened_at(record: dict[str, Any]) -> float:
    """When what a usable event records happened: its `at`, where that was before the orchestrator logged it (an
    attempt that went on in place, or a run that ended, while no orchestrator watched), else its `time`."""
    return float(record.get("at", record["time"]))


def switch_events(
    events: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], str]]]:
    """The `switch` events of the switches that went ahead, and those of switches the attempt they were sent to
    ended without making (a crash, a hang, a stop: a `switch-aborted` event of that attempt, which the scheduler
    logs) each with that event's reason, in the file's order. The one reading of which switches a run made, for `cona status`, `cona
    report` and `cona run`'s console: an aborted switch is decided again after the relaunch, and counted with its
    first decision it was listed twice. An attempt is sent at most one switch (the next decision waits for its
    end), so the attempt number pairs them."""
    aborted = {e["attempt"]: str(e.get("reason", "")) for e in events if e.get("event") == "switch-aborted"}
    switches = [e for e in events if e.get("event") == "switch"]
    return ([e for e in switches if e.get("attempt") not in aborted],
            [(e, aborted[e["attempt"]]) for e in switches if e.get("attempt") in aborted])  # fmt: skip


def _usable_events(
    run_dir: RunDir, records: list[dict[str, Any]], skipped: list[str] | None
) -> list[dict[str, Any]]:
    """`records` less those `event_problem` rejects, each of which is described in `skipped` when it is given."""
    usable = []
    for record in records:
        problem = event_problem(record)
        if problem is None:
            usable.append(record)
        elif skipped is not None:
            when = f", at time {record['time']}" if _is_number(record.get("time")) else ""
            skipped.append(f"{run_dir.events}: {problem}{when}")
    return usable


def read_events(run_dir: RunDir, *, skipped: list[str] | None = None, settled: bool = False) -> list[dict[str, Any]]:
    """The usable records of events.jsonl (`event_problem`), the whole file as it is now. When `skipped` is given,
    each line left out is described in it: damaged lines, a tail that can never become a record (`read_jsonl`; with
    `settled`, a run that has ended, any tail), and records of the wrong shape."""
    return _usable_events(run_dir, read_jsonl(run_dir.events, damaged=skipped, settled=settled)[0], skipped)


def read_new_events(
    run_dir: RunDir, offset: int, *, skipped: list[str] | None = None
) -> tuple[list[dict[str, Any]], int]:
    """The usable records of events.jsonl from byte `offset` on, and where the next call starts: `read_events` for a
    reader that follows the file as it grows (`cona run`'s console); a torn tail waits for the next call."""
    records, offset = read_jsonl(run_dir.events, offset=offset, damaged=skipped)
    return _usable_events(run_dir, records, skipped), offset


def warn_skipped(skipped: list[str]) -> None:
    """Say on stderr, in one line, that a reader left damaged lines out (how many, and the first), rather than drop
    them silently: the rest of the file is still used."""
    if skipped:
        more = f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
        print(f"cona: warning: skipped a damaged line, {skipped[0]}{more}; the rest is used", file=sys.stderr, flush=True)


def launched_without_state(run_dir: RunDir, events: list[dict[str, Any]]) -> set[int]:
    """The attempts events.jsonl logs launches of when state.json is missing, else none: state.json is written before
    every launch, so it was lost, not a run that never started (`cona status` and `cona report` say `unknown`)."""
    if run_dir.state_json.exists():
        return set()
    return {e["attempt"] for e in events if e["event"] == "launch"}


def unlogged_attempts(run_dir: RunDir, state: RunState, events: list[dict[str, Any]]) -> str | None:
    """A warning line when events.jsonl lacks the launch records of attempts that state.json lists, or None.

    A deleted, emptied or replaced events.jsonl left `cona status` saying `switches 0` and `cona report` showing no
    attempts or switches for a run that had them, without a word. The newest attempt of a run going on is not
    counted: the scheduler saves state.json a moment before it logs that attempt's launch."""
    logged = {e.get("attempt") for e in events if e.get("event") == "launch"}
    listed = state.attempts if state.final else state.attempts[:-1]
    lost = [a.number for a in listed if a.number not in logged]
    if not lost:
        return None
    which = f"attempt {lost[0]}" if len(lost) == 1 else f"{len(lost)} attempts ({lost[0]}–{lost[-1]})"
    how = f"is missing, though state.json lists {which}" if not run_dir.events.exists() else \
        f"has no launch record of {which} that state.json lists"  # fmt: skip
    return (f"cona: warning: {run_dir.events} {how}: the attempts and switches it logged are left out; restore it "
            "from a backup to see them")  # fmt: skip


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
    stuck_since: float | None = None
    """The first poll of the spell's current run of `Outcome.stuck` polls (None: the last poll was not stuck). A
    stuck attempt is failed `pending_timeout_s` after this, not after `since`: a Slurm job may pend for hours for
    capacity before a reason that waiting does not resolve appears, and that reason gets the same grace."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PendingSpell:
        stuck = data.get("stuck_since")
        return cls(attempt=int(data["attempt"]), since=float(data["since"]), detail=str(data.get("detail", "")),
                   timed_out=bool(data.get("timed_out", False)),
                   stuck_since=None if stuck is None else float(stuck))  # fmt: skip


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
    paused_s: float = 0.0
    """Seconds the run lay ended (stopped or failed) before a `cona run --resume` went on with it: not part of its
    elapsed time, which a time budget (`target.max_time_s`) and `cona run`'s `run … after` count."""
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
        if not isinstance(version, int) or isinstance(version, bool):
            raise ConfigError(f"{source}: field 'version' is {_shown(version)}, not a whole number; {STATE_FIX}")
        if version > STATE_VERSION:
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
        known = {k: v for k, v in data.items() if k in fields}
        if (problem := _state_problem(known)) is not None:
            raise ConfigError(f"{source}: {problem}; {STATE_FIX}")
        try:
            known["attempts"] = [Attempt.from_dict(a) for a in data.get("attempts") or []]
            request = data.get("switch_requested")
            known["switch_requested"] = SwitchRequest.from_dict(request) if request else None
            pending = data.get("pending")
            known["pending"] = PendingSpell.from_dict(pending) if pending else None
            known["version"] = STATE_VERSION
            return cls(**known)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{source}: unreadable run state ({e}); {STATE_FIX}") from None


STATE_FIX = "the run cannot be resumed from it; restore state.json from a backup, or start a new run with --run-dir"
"""What to do about a state.json that cannot be read: the end of each line that refuses one."""

RUN_STATUSES = ("created", "running", "done", "stopped", "failed")
"""The values of `RunState.status`."""

_SCALAR_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "str": (lambda v: isinstance(v, str), "text"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "a whole number"),
    "float": (lambda v: isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v), "a finite number"),
    "dict[str, Any]": (lambda v: isinstance(v, dict), "a JSON object"),
    "list[Attempt]": (lambda v: isinstance(v, list) and all(isinstance(a, dict) for a in v), "a list of objects"),
}
"""The field annotations of `RunState` whose values `_state_problem` checks, with what a value must be."""


def _state_problem(known: dict[str, Any]) -> str | None:
    """What is wrong with the top-level values of a state.json (valid JSON, damaged or edited by hand), or None.

    `RunState(**known)` takes any value: `"status": 7` was shown as the run's status, `"final": "no"` read as true,
    and `"attempts_started": "4"` or `"model": [1]` ended `cona run --resume` (and `cona status`) in a traceback
    further on. The nested records (attempts, pending, switch_requested) are checked by their own `from_dict`."""
    for f in dataclasses.fields(RunState):
        if f.name not in known or not isinstance(f.type, str):
            continue
        value, optional = known[f.name], f.type.endswith(" | None")
        check = _SCALAR_CHECKS.get(f.type.removesuffix(" | None"))
        if check is None or (value is None and optional):
            continue
        if value is None or not check[0](value):
            return f"field {f.name!r} is {_shown(value)}, not {check[1]}"
    if "status" in known and known["status"] not in RUN_STATUSES:
        return f"field 'status' is {_shown(known['status'])}, not one of {', '.join(RUN_STATUSES)}"
    model = known.get("model", {})
    live = model.get("live")
    if live is not None and not isinstance(live, dict):
        return f"field 'model.live' is {_shown(live)}, not a JSON object"
    # What `cona status` formats: a count as `{:,}`, a loss as a number, the decision's reason as text.
    for key in ("step", "samples", "val_samples"):
        value = (live or {}).get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            return f"field 'model.live.{key}' is {_shown(value)}, not a count"
    for key in ("train_loss", "val_loss", "val_perplexity", "noise_scale", "samples_per_s", "eta_s"):
        value = (live or {}).get(key)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            return f"field 'model.live.{key}' is {_shown(value)}, not a number"
    decision = model.get("last_decision")
    if decision is not None and not (isinstance(decision, dict) and isinstance(decision.get("reason"), str)):
        return f"field 'model.last_decision' is {_shown(decision)}, not a decision with its reason"
    return None


def _shown(value: Any) -> str:
    """A state.json value for a message: short, whatever its size."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def read_state(run_dir: RunDir, *, resume: bool = False) -> RunState:
    """The run's state.json (a fresh RunState when there is none yet). For `resume` (an orchestrator that goes on
    with the run) a missing state.json of a run that has attempts is refused: a fresh state would hand out attempt
    numbers again, re-read the old attempts' heartbeats as new and overwrite their records."""
    try:
        data = read_json(run_dir.state_json)
    except PermissionError:  # the file may well be intact: restoring it from a backup is not the fix
        raise ConfigError(f"{run_dir.state_json}: permission denied; run cona as the user that owns the run, or "
                          "give this user read access") from None
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested too deep (garbage, not a state)
        raise ConfigError(f"{run_dir.state_json}: unreadable; {STATE_FIX}") from None
    if data is None and run_dir.state_json.exists():
        # The file holds `null` (read_json's None means no file): damaged, not missing, which a fresh state would be.
        raise ConfigError(f"{run_dir.state_json}: not a JSON object; {STATE_FIX}")
    if data is None and resume and (used := sorted(used_attempts(run_dir))):
        # The scheduler saves state.json before the first launch, so attempts without it mean it was lost.
        which = f"attempt {used[0]} exists" if len(used) == 1 else f"attempts {used[0]}–{used[-1]} exist"
        raise ConfigError(f"{run_dir.state_json} is missing but {which}; restore state.json from a backup, or start "
                          "a new run with --run-dir")  # fmt: skip
    if data is None:
        return RunState()
    if not isinstance(data, dict):
        raise ConfigError(f"{run_dir.state_json}: not a JSON object; {STATE_FIX}")
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
        fd = open_regular_fd(self.path, os.O_RDWR | os.O_CREAT)
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
