"""What a person watching a run sees: the live line of `cona run` and the summary of `cona status`."""

from __future__ import annotations

import dataclasses
import fcntl
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cona.orchestrator.job import Job
from cona.orchestrator.runstate import (
    RunState,
    event_line,
    launched_without_state,
    read_events,
    read_new_events,
    read_state,
    switch_events,
    unlogged_attempts,
    warn_skipped,
)
from cona.protocol.checkpoint_record import checkpoint_problem
from cona.protocol.heartbeat_record import NOTICE_EVENTS, Heartbeat, perplexity, timed_window
from cona.protocol.rundir import RunDir, open_regular, open_regular_fd, read_json, read_jsonl

if TYPE_CHECKING:
    from cona.orchestrator.profile import ClusterProfile
    from cona.orchestrator.scheduler import LiveStatus, Scheduler
    from cona.protocol.strategy import Strategy


NOT_MEASURED = "—"
"""What the live line and `cona status` show for a value that is undefined: samples/s and the time to target while the
current attempt has not measured its throughput yet (after a launch, a switch or a resume, until its first window
after warm-up), and any number that is NaN, infinite or negative where it cannot be (`_defined`)."""


def _defined(value: Any, *, signed: bool = False) -> float | None:
    """`value` when it is a number that can be shown, else None (shown as `NOT_MEASURED`): finite and, unless
    `signed`, not negative. The one rule for the live line, `cona status` and its JSON: state.json may hold what an
    older cona, a diverged run (a NaN loss) or a hand edit left there, and a negative time to target or a NaN noise
    scale would read as a measurement."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value) if signed or value >= 0 else None


def _shown(value: float | None, spec: str) -> str:
    """`value` formatted with `spec`, or `NOT_MEASURED` for None (pass it through `_defined` first)."""
    return NOT_MEASURED if value is None else format(value, spec)


def _duration(seconds: float | None) -> str:
    seconds = _defined(seconds)
    if seconds is None:
        return NOT_MEASURED
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def status_line(live: LiveStatus | dict[str, Any]) -> str:
    """One line: step, samples, loss, perplexity, noise scale, current and best strategy, time to target."""
    get = live.get if isinstance(live, dict) else lambda k, d=None: getattr(live, k, d)
    parts = [f"attempt {get('attempt')}", f"step {get('step')}", f"samples {get('samples'):,}"]
    if get("train_loss") is not None:
        parts.append(f"loss {_shown(_defined(get('train_loss'), signed=True), '.3f')}")
    if get("val_perplexity") is not None:
        parts.append(f"val ppl {_shown(_defined(get('val_perplexity')), '.2f')}")
    noise = get("noise_scale")
    parts.append(f"B_noise {_shown(_defined(noise), '.0f')} ({get('noise_source')})" if noise is not None
                 else "B_noise prior")  # fmt: skip
    parts.append(f"on {get('strategy')}")
    # None until the attempt's first measured window (`RunModel.attempt_started`): "—", not the previous attempt's.
    rate = _defined(get("samples_per_s"))
    parts.append(f"{rate:.0f} samples/s" if rate else f"{NOT_MEASURED} samples/s")
    best, gain = get("best"), _defined(get("best_gain"), signed=True)
    if best and best != get("strategy") and gain is not None:
        parts.append(f"best {best} ({gain:+.0%})")
    parts.append(f"switches {get('switches')}")
    parts.append(f"ETA {_duration(get('eta_s'))}")
    return " | ".join(parts)


def _switch_line(source: dict, target: dict, reason: str) -> str:
    """The policy's reasons already start with "switch A → B:" or "probe A → B:"; other reasons get the pair."""
    head = f"{_short(source)} → {_short(target)}"
    return reason if head in reason else f"switch {head}: {reason}"


# ------------------------------------------------------------------------------- reading a run directory safely


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def notice_line(run_dir: RunDir, event: dict[str, Any]) -> str:
    """A `checkpoint-skipped` or `checkpoint-restored` event (the trainer passed over a damaged checkpoint, or put
    back an interrupted re-save) in one line, with the step its attempt then resumed from: that it trains on from an
    older checkpoint than the newest is what a person must see (`startup.json`, written before these are sent)."""
    attempt = event["attempt"]
    line = f"{event['event']} (attempt {attempt}): {event['detail']}"
    try:
        startup = read_json(run_dir.attempt_dir(attempt) / "startup.json")
    except (OSError, ValueError):
        startup = None
    if isinstance(startup, dict) and "resumed_step" in startup:
        step = startup["resumed_step"]
        line += f"; attempt {attempt} resumed from step {step}" if _is_int(step) else f"; attempt {attempt} started from step 0"
    return line


def newest_intact_checkpoint(run_dir: RunDir) -> tuple[Path | None, list[dict[str, str]]]:
    """The checkpoint a resume would load, and each newer complete one it would pass over ({"path", "problem"},
    newest first), by the trainer's checks that need no torch (`checkpoint_problem`: the marker's content, every
    file's size, trainer_state.json). Not the CRC-32s: they read every shard, which the trainer does at load and
    `cona status` must not. Directories without their marker are left out: a save in progress has none."""
    passed: list[dict[str, str]] = []
    for path in reversed(run_dir.complete_checkpoints()):
        try:
            problem = checkpoint_problem(path)
        except OSError as e:  # no permission to look: as unusable for a resume
            problem = f"unreadable ({e.strerror})"
        if problem is None:
            return path, passed
        passed.append({"path": str(path), "problem": problem})
    return None, passed


@dataclasses.dataclass(frozen=True)
class Orphaned:
    """A run that has not ended, whose orchestrator is gone (`orphaned`)."""

    pid: str
    """The process id orchestrator.lock names: the orchestrator that held it last, as written."""
    attempt: int | None
    """The attempt its trainer runs as, or ended as: the current one, or the last of the in-place switches it went on
    through after its orchestrator was gone (`RunDir.running_as`)."""
    trainer_seen_s: float | None
    """Seconds since that trainer last wrote, when that is recent enough that it may still train and it is not known
    to have ended (`trainer_end`): an orchestrator that dies leaves its trainer training, and a resume adopts it.
    None: no sign of it."""
    heartbeating: bool = True
    """Whether that was a heartbeat; False: the attempt's launch record, its trainer has sent none yet (starting,
    or never started: the orchestrator may have died in the launch)."""
    trainer_end: str | None = None
    """How that trainer is known to have ended, for a person (`exited CRASH`, `its processes are gone without an exit
    record`); None: not known to have ended."""
    stopped: bool = False
    """That trainer served a stop (`cona stop` reached it while its orchestrator was gone): the run lies stopped, and
    `cona run --resume` goes on with it as with any stopped run."""

    def status(self, run_dir: RunDir) -> tuple[str, str]:
        """(status, reason) for `cona status`."""
        resume = f"`cona run --resume {run_dir.root}`"
        if self.stopped:
            return "stopped", (f"attempt {self.attempt}'s trainer served a stop command (it checkpointed and exited) "
                               f"while its orchestrator (pid {self.pid}) was gone; resume with {resume}")  # fmt: skip
        if self.trainer_end is not None:
            return "not running", (f"its orchestrator (pid {self.pid}) is gone, and so is attempt {self.attempt}'s "
                                   f"trainer ({self.trainer_end}); resume with {resume}")  # fmt: skip
        if self.trainer_seen_s is None:
            return "not running", f"its orchestrator (pid {self.pid}) is gone; resume with {resume}"
        seen = (f"attempt {self.attempt}'s trainer wrote {_duration(self.trainer_seen_s)} ago and may train on "
                "unattended") if self.heartbeating else (f"attempt {self.attempt} was launched "
                f"{_duration(self.trainer_seen_s)} ago and has sent no heartbeat yet: it may be starting")  # fmt: skip
        return "running", (f"its orchestrator (pid {self.pid}) is gone, but {seen}; {resume} adopts it, "
                           f"`cona stop {run_dir.root}` stops it")  # fmt: skip


def _unheld_lock(path: Path) -> str | None:
    """The pid written in the lock file `path` when no process holds its flock; None when one does, when there is
    no such file (no orchestrator ever ran here), or when it cannot be told (no locking on that filesystem)."""
    try:
        fd = open_regular_fd(path)
    except OSError:
        return None
    try:
        try:
            # A shared lock for an instant is refused while an orchestrator holds its exclusive one. An orchestrator
            # starting in that very instant is refused too (its one line, "another cona orchestrator"); run it again.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: held; anything else (ENOLCK on some network filesystems): cannot tell
            return None
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)  # drops the shared lock, if taken


def _uses_run_lock(profile: ClusterProfile) -> bool:
    """Whether the profile's backend keeps orchestrators apart with the flock on orchestrator.lock (the default
    `Backend.exclusion`: local, Slurm), so that an unheld lock means no orchestrator; Kubernetes uses a Lease."""
    from cona.orchestrator.backends import backend_class
    from cona.orchestrator.backends.base import Backend

    try:
        return backend_class(profile.backend).exclusion is Backend.exclusion
    except (ImportError, ValueError):
        return False


def _unattended(run_dir: RunDir, *, profile: ClusterProfile, job: Job, state: RunState, pid: str) -> Orphaned:
    """What is known of the trainer of a run whose orchestrator (`pid`) is gone: the attempt it runs as (an in-place
    switch the orchestrator did not follow goes on as the next attempt), whether it ended — its exit record, or its
    processes gone without one (`Backend.gone`: a crash leaves no record, and its last heartbeat looks recent for a
    while) — and else how long ago it last wrote its heartbeat file (before its first heartbeat: since its launch
    record), when within the heartbeat (startup) timeout."""
    from cona.orchestrator.backends import make_backend

    current = state.current
    if current is None:
        return Orphaned(pid=pid, attempt=None, trainer_seen_s=None)
    number = run_dir.running_as(current.number)
    record = run_dir.read_exit(number)
    if record is not None:
        return Orphaned(pid=pid, attempt=number, trainer_seen_s=None, trainer_end=f"it exited {record.name}",
                        stopped=record.served_stop)  # fmt: skip
    # The processes of an in-place chain are the current attempt's: the backend knows them by it. Built without the
    # job, which a backend reads only to launch (and Slurm's warns about once it has it).
    if make_backend(profile=profile, run_dir=run_dir).gone(current):
        return Orphaned(pid=pid, attempt=number, trainer_seen_s=None,
                        trainer_end="its processes are gone, without an exit record")  # fmt: skip
    now = time.time()
    for path, limit, heartbeat in ((run_dir.heartbeat_file(number), job.policy.heartbeat_timeout_s, True),
                                   (run_dir.launch_file(number), job.policy.startup_timeout_s, False)):  # fmt: skip
        try:
            age = now - path.stat().st_mtime
        except OSError:
            continue
        return Orphaned(pid=pid, attempt=number, trainer_seen_s=max(age, 0.0) if age < limit else None,
                        heartbeating=heartbeat)  # fmt: skip
    return Orphaned(pid=pid, attempt=number, trainer_seen_s=None, heartbeating=False)


def orphaned(run_dir: RunDir, *, profile: ClusterProfile, job: Job, state: RunState) -> Orphaned | None:
    """The run has not ended, yet no orchestrator drives it: its backend uses the run lock (`_uses_run_lock`), the
    lock file exists (an orchestrator ran here) and no process holds it — the kernel drops the flock when its holder
    dies, even by SIGKILL. None otherwise, and whenever it cannot be told."""
    if state.final or not _uses_run_lock(profile):
        return None
    pid = _unheld_lock(run_dir.lock)
    if pid is None:
        return None
    return _unattended(run_dir, profile=profile, job=job, state=state, pid=pid)


def trainer_progress(run_dir: RunDir, state: RunState, attempt: int) -> dict[str, Any]:
    """The progress attempt `attempt`'s trainer wrote in its heartbeat file beyond what state.json holds, as the keys
    of `cona status`'s summary (step, samples, losses, the trainer's own samples/s), or {} when it wrote nothing
    newer. For a run whose orchestrator is gone: the trainer trains on and writes heartbeats that nobody reads into
    state.json, which keeps the progress of the orchestrator's last poll."""
    current = state.current
    # The orchestrator read the current attempt's file up to `heartbeat_offset`; an attempt it did not follow (an
    # in-place switch after it was gone), not at all.
    offset = state.heartbeat_offset if current is not None and current.number == attempt else 0
    records, _ = read_jsonl(run_dir.heartbeat_file(attempt), offset=offset)  # a torn tail is left to its writer
    beats = []
    for record in records:
        try:
            beats.append(Heartbeat.from_dict(record))
        except TypeError:  # damaged: the orchestrator's reads name it (`bad-heartbeat`), status skips it
            continue
    if not beats:
        return {}
    last = beats[-1]
    progress: dict[str, Any] = {"step": last.step, "samples": last.samples, "progress_from": str(run_dir.heartbeat_file(attempt))}
    losses = [hb.train_loss for hb in beats if hb.train_loss is not None]
    if losses:
        progress["train_loss"] = _defined(losses[-1], signed=True)
    evals = [hb for hb in beats if hb.val_loss is not None]
    if evals:
        progress.update(val_loss=_defined(evals[-1].val_loss, signed=True), val_samples=evals[-1].samples,
                        val_perplexity=_defined(perplexity(evals[-1].val_loss)))  # fmt: skip
    windows = [hb for hb in beats if timed_window(hb)]
    # The trainer's own measure of its last window: the run model that smooths it is the orchestrator's.
    progress["samples_per_s"] = _defined(windows[-1].samples_per_s) if windows else None
    return progress


class LiveView:
    """Prints a status line at most every `interval_s` and every decision as it happens."""

    def __init__(self, *, run_dir: RunDir, job: Job, quiet: bool = False, interval_s: float = 2.0) -> None:
        self.run_dir = run_dir
        self.job = job
        self.quiet = quiet
        self.interval_s = interval_s
        self._last = 0.0
        self._events_offset = 0
        self._switches = 0
        """`switch` events in events.jsonl so far: the count `cona status` and the report show."""

    def begin(self, scheduler: Scheduler) -> None:
        print(f"cona: run directory {self.run_dir.root}", flush=True)
        print(
            f"cona: {self.job.name}, policy {self.job.policy.name}, {len(scheduler.candidates)} feasible strategies "
            f"on {scheduler.profile.name} ({scheduler.profile.backend} backend)",
            flush=True,
        )
        earlier, self._events_offset = read_new_events(self.run_dir, 0)
        self._switches = len(switch_events(earlier)[0])  # a resumed run's switches count too

    def _print_events(self) -> None:
        skipped: list[str] = []
        events, self._events_offset = read_new_events(self.run_dir, self._events_offset, skipped=skipped)
        for e in events:
            kind = e["event"]
            if kind in NOTICE_EVENTS:  # the run goes on from an older checkpoint than the newest: say so here too
                print(f"cona: {notice_line(self.run_dir, e)}", flush=True)
            elif kind == "launch":
                print(f"cona: launch attempt {e['attempt']} with {_short(e['strategy'])} ({e.get('reason', '')})", flush=True)
            elif kind == "switch":
                self._switches += 1
                print(f"cona: {_switch_line(e['from'], e['to'], e.get('reason', ''))}", flush=True)
            elif kind == "switch-aborted":  # counted when it was decided; it never happened
                self._switches -= 1
                print(f"cona: {event_line(e)}", flush=True)
            elif kind == "switch-complete":
                print(f"cona: switch took {e['switch_cost_s']:.1f}s", flush=True)
            # resume-run: a stopped or failed run taken up again (`cona run --resume`); without it the console
            # shows only the next launch, whose reason reads as if the cluster had preempted it.
            elif kind in ("failure", "heartbeat-gap", "failed", "adopt", "resume", "resume-run", "stop-requested", "stop-dropped",
                          "time-budget", "disruption", "pending", "pending-timeout", "pods-not-created", "cpu-shortage"):
                print(f"cona: {event_line(e)}", flush=True)
        warn_skipped(skipped)

    def switches(self, live: LiveStatus) -> int:
        """The switches to show: those decided so far (their `switch` events), as `cona status` counts them. The run
        model counts a switch only once it is under way (`RunModel.switch_started`, at the next launch), so the line
        printed beside a switch decision would still say one fewer. Never fewer than the model's count, which also
        holds switches whose event line was damaged."""
        return max(self._switches, live.switches)

    def update(self, live: LiveStatus) -> None:
        self._print_events()
        if self.quiet:
            return
        now = time.time()
        if now - self._last >= self.interval_s:
            self._last = now
            shown = dataclasses.replace(live, switches=self.switches(live))  # the scheduler's own stays as it is
            print(f"cona: {status_line(shown)}", flush=True)

    def end(self, scheduler: Scheduler) -> None:
        self._print_events()
        state = scheduler.state
        live = scheduler.live
        ppl = f"{live.val_perplexity:.2f}" if live.val_perplexity else "n/a"
        if live.val_perplexity and live.val_samples is not None and live.val_samples < live.samples:
            ppl += f" (evaluated at {live.val_samples:,} samples)"  # the last evaluation's, not the end's
        print(
            f"cona: run {state.status} after {_duration(live.elapsed_s)}: {live.samples:,} samples, "
            f"val perplexity {ppl}, {self.switches(live)} switch(es), {len(state.attempts)} attempt(s)"
            + (f"; {state.reason}" if state.reason else ""),
            file=sys.stdout,
            flush=True,
        )


def _short(strategy: dict[str, int]) -> str:
    return f"d{strategy['dp']}t{strategy['tp']}p{strategy['pp']} m{strategy['mbs']} g{strategy['gbs']}"


def status_summary(run_dir: RunDir) -> dict[str, Any]:
    """Everything `cona status` shows, from the run directory alone (works while the run goes on)."""
    from cona.orchestrator.runstate import load_run

    profile, job = load_run(run_dir)
    state = read_state(run_dir)
    skipped: list[str] = []
    events = read_events(run_dir, skipped=skipped, settled=state.final)  # an ended run's torn tail is never finished
    warn_skipped(skipped)
    if (lost := unlogged_attempts(run_dir, state, events)) is not None:  # else `switches 0` for a run that switched
        print(lost, file=sys.stderr, flush=True)
    switches, aborted = switch_events(events)
    notices = [e for e in events if e["event"] in NOTICE_EVENTS]
    live = state.live
    current = state.current
    latest, passed_over = newest_intact_checkpoint(run_dir)
    spell = state.pending
    pending = None
    if spell is not None:
        pending = {"attempt": spell.attempt, "since": spell.since, "for_s": round(time.time() - spell.since, 1),
                   "detail": spell.detail, "timed_out": spell.timed_out}  # fmt: skip
    status, reason = state.status, state.reason
    # An attempt was launched (state.json is written before every launch), but the run's record of it is gone.
    if launched_without_state(run_dir, events):
        status = "unknown"
        reason = f"{run_dir.state_json.name} is missing; the last event in {run_dir.events.name} is {events[-1]['event']!r}"
    orphan = orphaned(run_dir, profile=profile, job=job, state=state) if status == "running" else None
    attempt, strategy = (current.number, current.strategy) if current else (0, None)
    progress: dict[str, Any] = {}
    if orphan is not None:  # state.json says running, but the orchestrator that would say otherwise is dead
        status, reason = orphan.status(run_dir)
        if orphan.attempt is not None and orphan.attempt != attempt:  # an in-place switch it did not follow
            launch = run_dir.read_launch(orphan.attempt)
            attempt, strategy = orphan.attempt, launch.strategy if launch is not None else strategy
        # Its trainer went on writing heartbeats that nobody took into state.json: they are the newer progress.
        progress = trainer_progress(run_dir, state, attempt) if attempt else {}
    return {
        "run_dir": str(run_dir.root),
        "job": job.name,
        "profile": profile.name,
        "policy": job.policy.name,
        "status": status,
        "attempt": attempt,
        "strategy": strategy.to_dict() if strategy else None,
        "step": live.get("step", 0),
        "samples": live.get("samples", 0),
        "train_loss": _defined(live.get("train_loss"), signed=True),
        "val_loss": _defined(live.get("val_loss"), signed=True),
        "val_perplexity": _defined(live.get("val_perplexity")),
        "val_samples": live.get("val_samples"),
        "target_val_perplexity": job.target.val_perplexity,
        "noise_scale": _defined(live.get("noise_scale")),
        "noise_source": live.get("noise_source", "prior"),
        "samples_per_s": _defined(live.get("samples_per_s")),
        # The last estimate state.json holds outlives the run (and its orchestrator): nobody estimates it any more.
        "eta_s": None if state.final or orphan is not None else _defined(live.get("eta_s")),
        "progress_from": None,
        **progress,
        "switches": [
            {"time": e["time"], "from": e["from"], "to": e["to"], "reason": e.get("reason", "")} for e in switches
        ],
        # Decided and sent, but the attempt ended without making them (a crash before the switch): not switches.
        "aborted_switches": [
            {"time": e["time"], "from": e["from"], "to": e["to"], "reason": e.get("reason", ""),
             "aborted": why} for e, why in aborted
        ],
        "last_decision": state.model.get("last_decision"),
        "reason": reason,
        "pending": pending,
        "restarts_in_row": state.restarts_in_row,
        "latest_checkpoint": str(latest) if latest else None,
        "damaged_checkpoints": passed_over,
        "checkpoint_notice": notice_line(run_dir, notices[-1]) if notices else None,
        "orphaned": dataclasses.asdict(orphan) if orphan else None,
        "updated": state.updated,
        **_world(run_dir, profile, strategy),
    }


def _world(run_dir: RunDir, profile: ClusterProfile, strategy: Strategy | None) -> dict[str, Any]:
    """The world the run trains on now and, for an elastic profile, its node range and planning table."""
    from cona.orchestrator.elastic import is_elastic, node_range, nodes_of, read_plan

    out: dict[str, Any] = {
        "world_size": strategy.world_size if strategy else None,
        "nodes": nodes_of(strategy, profile) if strategy else None,
        "elastic": None,
    }
    if is_elastic(profile):
        nodes = node_range(profile)
        plan = read_plan(run_dir)
        out["elastic"] = {
            "min_nodes": nodes[0], "max_nodes": nodes[-1],
            "plans": [p.to_dict() for p in plan.plans] if plan else [],
            "planned_because": plan.reason if plan else None,
            "devices_file": _devices_file(run_dir) if profile.backend == "local" else None,
        }  # fmt: skip
    return out


def _devices_file(run_dir: RunDir) -> str | None:
    """What a local elastic run's `devices` file says (the devices the machine has now), as written; None: none."""
    from cona.orchestrator.backends.local.backend import DEVICES_FILE

    try:
        with open_regular(run_dir.root / DEVICES_FILE) as f:
            return f.read().decode(errors="replace").strip()[:20]
    except OSError:
        return None


def print_status(summary: dict[str, Any]) -> None:
    """`cona status` as text. A run on Kubernetes adds its name, namespace and orchestrator pod; before the
    orchestrator first reports (or when the run could not start) only what is known is shown."""
    if summary.get("run"):
        print(f"run        {summary['run']} in namespace {summary.get('namespace')} ({summary.get('run_dir') or '-'})")
    else:
        print(f"run        {summary.get('run_dir')}")
    if "job" in summary:
        print(f"job        {summary['job']} on {summary['profile']}, policy {summary['policy']}")
    print(f"status     {summary['status']}" + (f" ({summary['reason']})" if summary.get("reason") else ""))
    if "orchestrator" in summary:
        print(f"orchestrator {summary['orchestrator']}")
    if "attempt" not in summary:
        return
    strategy = summary["strategy"]
    print(f"attempt    {summary['attempt']} with {_short(strategy) if strategy else '-'}")
    if summary.get("world_size"):
        print(f"world      {summary['world_size']} devices on {summary['nodes']} node(s)")
    elastic = summary.get("elastic")
    if elastic:
        devices = f"; devices file: {elastic['devices_file']}" if elastic.get("devices_file") is not None else ""
        print(f"elastic    {elastic['min_nodes']}-{elastic['max_nodes']} nodes{devices}"
              + (f"; planned at {elastic['planned_because']}:" if elastic["planned_because"] else ""))  # fmt: skip
        for p in elastic["plans"]:
            chosen = _short(p["strategy"]) if p["strategy"] else "nothing feasible (waits)"
            print(f"           {p['nodes']} node(s), {p['devices']} devices: {chosen} (of {p['feasible']} feasible)")
    pending = summary.get("pending")
    if pending:
        late = "; past the pending timeout" if pending["timed_out"] else ""
        print(f"pending    for {_duration(pending['for_s'])}{late}: {pending['detail']}")
    ppl = summary.get("val_perplexity")
    target = summary.get("target_val_perplexity")
    at = summary.get("val_samples")
    stale = _defined(ppl) is not None and isinstance(at, int) and not isinstance(at, bool) and at < summary["samples"]
    print(
        f"progress   step {summary['step']}, {summary['samples']:,} samples, val perplexity "
        f"{_shown(_defined(ppl), '.2f')}" + (f" at {at:,} samples" if stale else "")
        + (f" (target {target})" if target else "")
        + (f"; from {summary['progress_from']} (no orchestrator reads it)" if summary.get("progress_from") else "")
    )
    noise = _defined(summary.get("noise_scale"))
    print(f"noise      B_noise {_shown(noise or None, '.1f')} ({summary.get('noise_source')})")
    print(f"switches   {len(summary['switches'])}")
    for s in summary["switches"]:
        print(f"           {_switch_line(s['from'], s['to'], s['reason'])}")
    for s in summary.get("aborted_switches") or []:
        print(f"           aborted, {s['aborted']}: {_switch_line(s['from'], s['to'], s['reason'])}")
    if summary.get("last_decision"):
        print(f"decision   {summary['last_decision']['reason']}")
    print(f"checkpoint {summary.get('latest_checkpoint') or '-'}")
    for damaged in summary.get("damaged_checkpoints") or []:
        print(f"           passed over (a resume skips it): {damaged['path']}: {damaged['problem']}")
    if summary.get("checkpoint_notice"):
        print(f"notice     {summary['checkpoint_notice']}")
