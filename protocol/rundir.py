"""The run directory: the only channel between orchestrator and trainer (docs/architecture.md). Torch-free.

All writes are atomic (temp file in the same directory, fsync, rename) or single appends of a whole line;
readers tolerate a torn last line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from cona.protocol.strategy import Strategy


class ExitCode(enum.IntEnum):
    """Trainer exit codes; anything not listed here is a crash."""

    DONE = 0
    """Target or budget reached; final checkpoint written."""
    SWITCH = 42
    """Checkpointed at a step boundary on a `switch` command; relaunch with the new strategy. Also after a hold at
    a switch point that timed out (reason `HOLD_TIMEOUT_REASON`): relaunch there with the schedule's strategy."""
    STOPPED = 43
    """Checkpointed on a `stop` command, SIGTERM or SIGUSR1 (preemption, time limit); resume later."""
    BAD_WORLD = 44
    """The world size does not fit the strategy (elastic shrink); replan for the GPUs present."""
    CONFIG = 2
    """Bad input (job, strategy, data path): the message on stderr says which."""


MAX_STEPS_REASON = "max_steps"
"""The exit reason of a trainer that stopped at its own `--max-steps` (after its checkpoint)."""

STOP_REASON_PREFIX = "stop (control seq "
"""How the exit reason of a trainer that served a `stop` control record begins (`stop_exit_reason`)."""


def stop_exit_reason(seq: int) -> str:
    """The exit reason of a trainer that checkpointed and exited STOPPED on the `stop` control record `seq` (not on a
    signal): the one spelling, which the orchestrator reads back (`ExitRecord.served_stop`)."""
    return f"{STOP_REASON_PREFIX}{seq})"


HOLD_TIMEOUT_REASON = "hold at the switch point timed out"
"""How the exit reason of a trainer whose hold at a switch point (`SwitchPoints`) got no decision within `wait_s`
begins. It exits SWITCH after a checkpoint at the point: training on under the old strategy would move the switch
off its exact step, and exiting as for a switch is what every backend already relaunches from (the orchestrator
takes the schedule's strategy for where training resumes; on Slurm the job waits for that launch)."""


def process_exit_status(code: int, *, reason: str) -> int:
    """The status the trainer process exits with for the exit record (`code`, `reason`): the one place that
    decides it.

    It is the record's code, except for a stop that the trainer's own command line asked for (`--max-steps`): the
    run ended where its user said, so the process exits 0 and torchrun reports success instead of printing its
    ChildFailedError dump. The exit record keeps STOPPED (43): whoever must tell "stopped" from "done" (the
    orchestrator's backends) reads the record first and the process status only without one
    (`RunDir.attempt_exit_code`).

    A hold at a switch point that timed out (`HOLD_TIMEOUT_REASON`) keeps SWITCH (42), as any switch does: the
    orchestrator must relaunch at the point, so it must not look like a normal end."""
    if code == ExitCode.STOPPED and reason == MAX_STEPS_REASON:
        return int(ExitCode.DONE)
    return int(code)


COMPLETE_MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"


def restrict_umask() -> None:
    """Never create run-directory files that others may write: a world-writable control.json takes commands
    from anyone, and a checkpoint's DCP metadata is unpickled on load. Called by every process that writes there
    (`cona`, the trainer); keeps the user's stricter bits."""
    current = os.umask(0o022)
    os.umask(current | 0o022)


class NotRegularFile(Exception):
    """A run-directory file that is no regular file: a FIFO, a socket, a device (or a link to one). Reading a FIFO
    blocks for ever (`cona status` hung on a state.json made one) and a device may never end (/dev/zero); cona
    writes only regular files there, so one of these is refused, in one line naming it.

    Neither an OSError nor a ValueError: the readers of records that may be missing or damaged (an exit record, a
    control record, a heartbeat line) take those as absent or damaged and go on; this one reaches the program's
    own one-line refusal (`cona`, the trainer, `cona export`)."""


_KINDS = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device"}  # fmt: skip


def _not_regular(path: Path | str, mode: int | None) -> NotRegularFile:
    kind = _KINDS.get(stat.S_IFMT(mode)) if mode is not None else None
    return NotRegularFile(f"{path} is {f'{kind}, not' if kind else 'not'} a regular file; cona keeps only regular "
                          "files in a run directory: remove it, or put back the file it replaced")  # fmt: skip


def open_regular_fd(path: Path | str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """`os.open(path, flags)` for a file of a run directory: the one place that refuses what is no regular file
    (`NotRegularFile`), for every reader and appender of one. Opened without blocking, so that a FIFO is found out
    before anything waits on it (an open for writing blocks until a reader comes, a read until a writer writes);
    the descriptor it returns blocks as usual. A directory raises IsADirectoryError, as open() does."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno != errno.ENXIO:  # a socket, or a FIFO opened for writing with no reader
            raise
        try:
            found: int | None = os.stat(path).st_mode
        except OSError:
            found = None
        raise _not_regular(path, found) from None
    try:
        found = os.fstat(fd).st_mode
        if stat.S_ISDIR(found):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(found):
            raise _not_regular(path, found)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: Path | str) -> BinaryIO:
    """`path`, a file of a run directory, opened for reading in binary (`open_regular_fd`)."""
    return os.fdopen(open_regular_fd(path), "rb")


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> Any | None:
    """The JSON in `path`, or None when it does not exist."""
    try:
        with open_regular(path) as f:
            return json.loads(f.read().decode())
    except FileNotFoundError:
        return None


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one JSON line with a single write, so concurrent readers see whole lines or a torn tail."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    fd = open_regular_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


_TAIL_CHUNK = 1 << 16


def _tail_start(fd: int, size: int, floor: int = 0) -> int:
    """Where the unterminated last line of the open file `fd` (`size` bytes long) begins: just after its last
    newline at or after byte `floor`, else at `floor`; `size` when the file ends with a newline.

    The one definition of a JSON-lines file's torn tail, for its readers (`read_jsonl` leaves it unread) and its
    owner (`drop_torn_tail` cuts it): whatever follows the last newline. Looked for backwards, in chunks, because the
    file may be long and the tail is short."""
    end = size
    while end > floor:
        start = max(floor, end - _TAIL_CHUNK)
        found = os.pread(fd, end - start, start).rfind(b"\n")
        if found >= 0:
            return start + found + 1
        end = start
    return floor


def _tail_damage(tail: bytes) -> str | None:
    """What the unterminated last line `tail` holds when it can never become a record, or None when it may be one
    being written: `append_jsonl` writes every record whole in one write, so a reader that races its writer sees a
    prefix of a record, which starts with `{` and holds no NUL byte. Anything else — the NUL bytes a crash leaves in
    a file that had grown but was never written, a cut-off line of garbage — is damage."""
    if b"\0" in tail:
        return "NUL bytes"
    if not tail.startswith(b"{"):
        return "no JSON record"
    return None


def drop_torn_tail(path: Path) -> tuple[int, bytes]:
    """Cut the torn tail off `path` (the bytes after its last newline, `_tail_start`): returns where it began and
    what was cut (b"" when the file ends with a newline, is empty or does not exist).

    Only for the file's owner before it appends, while no other writer of it can be running (the orchestrator under
    the run lock): readers leave a torn tail for its writer to finish, but a writer that died never will, and the
    next appended record would be glued onto it and lost with it. So it is cut whatever it holds, a record cut short
    or damage (`_tail_damage`). The caller says what was dropped (an event), so it is cut rather than ended with a
    newline, which would leave a damaged line every reader warns about forever. Readers' offsets stay valid: they
    never read past the last newline (`read_jsonl`)."""
    try:
        fd = open_regular_fd(path, os.O_RDWR)
    except FileNotFoundError:
        return 0, b""
    try:
        size = os.fstat(fd).st_size
        end = _tail_start(fd, size)
        if end == size:
            return size, b""
        dropped = os.pread(fd, size - end, end)
        if os.fstat(fd).st_size != size:  # an append landed meanwhile (`cona stop`): leave it whole, cut nothing
            return size, b""
        os.ftruncate(fd, end)
        os.fsync(fd)
        return end, dropped
    finally:
        os.close(fd)


def read_jsonl(
    path: Path, *, offset: int | None = None, damaged: list[str] | None = None, settled: bool = False
) -> tuple[list[dict[str, Any]], int]:
    """Records from byte `offset` on, and the offset after the last whole line (where the next call starts).

    A whole line that is not a JSON object (a disk or a hand edit damaged it) is skipped; when `damaged` is given,
    one description per such line is appended to it, so the caller can say so instead of losing it silently.

    The torn tail (`_tail_start`: no newline yet) is never read as a record. A reader that follows the file as it
    grows passes `offset` (where its last call ended: the scheduler's heartbeats, `cona run`'s console) and comes
    back to the tail on its next call, so it is left alone: its writer may still finish it, and saying it on every
    call would repeat. A reader of the whole file as it is now (no `offset`: `cona status`, `cona report`) is told
    through `damaged` of a tail that can never become a record (`_tail_damage`), which would otherwise be dropped
    without a word; with `settled` (no writer of the file is left: the run has ended) of any tail, a record its
    writer was killed in the middle of (the run's last `stopped` record, dropped without a word).
    """
    start = offset or 0
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            end = _tail_start(f.fileno(), size, start)
            f.seek(start)
            data = f.read(end - start) if end > start else b""
            data = data[: data.rfind(b"\n") + 1]  # whole lines only, also when the file was cut meanwhile
            tail = b""
            if offset is None and damaged is not None and size > end:
                f.seek(end)
                tail = f.read(size - end)
    except FileNotFoundError:
        return [], start
    records = []
    position = start
    for line in data.split(b"\n"):
        at, position = position, position + len(line) + 1
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            # Besides JSONDecodeError and UnicodeDecodeError (both ValueErrors): a number of over 4,300 digits is a
            # bare ValueError and a line nested too deep a RecursionError. Garbage all the same, never a record, but
            # they ended `cona status`/`report` and the orchestrator in a line naming no file, or a traceback.
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif damaged is not None:
            damaged.append(f"{path}: the line at byte {at} is not a JSON object")
    held = _tail_damage(tail) if tail else None
    if held is None and tail and settled:
        held = "a record cut short (its writer ended in the middle of it)"
    if held is not None and damaged is not None:
        damaged.append(f"{path}: the last {len(tail)} bytes, from byte {end}, have no newline and hold {held}, "
                       "not a record being written")  # fmt: skip
    return records, start + len(data)


FIX_JOB = "job"
"""A refusal's fix is a job field: a run's job is fixed once it exists, so it takes a new run with the corrected job."""
FIX_FILES = "files"
"""A refusal's fix is on disk (the data, a model directory): fix the files and resume the run."""
FIX_EITHER = "either"
"""Either a job field or the files on disk (or it is not known which)."""
FIXES = (FIX_JOB, FIX_FILES, FIX_EITHER)
"""The values of `ExitRecord.fix` (`cona.protocol.inputs.InputRefused.fix` decides which)."""


@dataclasses.dataclass(frozen=True)
class ExitRecord:
    """`attempts/<n>/exit.json`: how attempt n's trainer ended, written by rank 0 just before it exits (its only
    writer) and read through `RunDir.read_exit`. torchrun exits 1 whenever a worker exits non-zero, so this is
    where the orchestrator reads SWITCH/STOPPED/BAD_WORLD/CONFIG; a process killed outright leaves none."""

    exit_code: int
    name: str
    """The `ExitCode` name, or CRASH."""
    reason: str
    step: int | None
    """The optimizer step of the last checkpoint, when there is one."""
    time: float
    next_attempt: int | None = None
    """After an in-place switch: the attempt these processes go on as (n + 1)."""
    next_strategy: Strategy | None = None
    """After an in-place switch: the strategy they go on with."""
    fix: str | None = None
    """After a refused input (exit CONFIG): where the fix lies, `FIX_JOB`, `FIX_FILES` or
    `FIX_EITHER` (`InputRefused.fix`), which the orchestrator's advice follows. None for any other exit, and for a
    record without it or with a value this version does not know (read as no advice of where the fix lies)."""

    @property
    def served_stop(self) -> bool:
        """Whether the trainer exited on a `stop` control record (`cona stop`, a time budget), not on a signal."""
        return self.exit_code == ExitCode.STOPPED and self.reason.startswith(STOP_REASON_PREFIX)

    @property
    def went_on_in_place(self) -> bool:
        """Whether the processes did not exit but went on in place as attempt `next_attempt` under `next_strategy`."""
        return self.next_attempt is not None and self.next_strategy is not None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"exit_code": self.exit_code, "name": self.name, "reason": self.reason,
                                "step": self.step, "time": self.time}  # fmt: skip
        if self.next_strategy is not None:
            data.update(next_attempt=self.next_attempt, next_strategy=self.next_strategy.to_dict())
        if self.fix is not None:  # only a refusal has one: every other exit.json stays as it was
            data["fix"] = self.fix
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExitRecord:
        nxt = data.get("next_strategy")
        return cls(
            exit_code=int(data["exit_code"]), name=str(data.get("name", "")), reason=str(data.get("reason", "")),
            step=None if data.get("step") is None else int(data["step"]), time=float(data.get("time", 0.0)),
            next_attempt=None if data.get("next_attempt") is None else int(data["next_attempt"]),
            next_strategy=Strategy.from_dict(nxt) if nxt else None,
            # Unknown to this version (a newer trainer's, a hand edit): no advice is better than an unreadable record.
            fix=data["fix"] if data.get("fix") in FIXES else None,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class CrashRecord:
    """`attempts/<n>/crash-<rank>.json`: the exception that ended rank `rank` of attempt n where no exit record says
    why (`RunDir.crash_file`), written by that rank just before it dies — each rank its own file, its only writer. A
    rank killed by a signal writes none (its launcher knows the signal). The ranks a dead peer leaves behind often
    write one too, later (a collective's `Connection closed by peer`): the earliest names the cause
    (`describe_crashes`)."""

    rank: int
    error: str
    """`<exception type>: <the last line of its message>`."""
    time: float

    @classmethod
    def of(cls, rank: int, error: BaseException) -> CrashRecord:
        import time

        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        text = f"{type(error).__name__}: {lines[-1]}" if lines else type(error).__name__
        return cls(rank=rank, error=text[:300], time=time.time())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CrashRecord:
        rank, error, when = data["rank"], data["error"], data["time"]
        if isinstance(rank, bool) or not isinstance(rank, int) or not isinstance(error, str) or \
                isinstance(when, bool) or not isinstance(when, int | float):  # fmt: skip
            raise ValueError("not a crash record")
        return cls(rank=rank, error=error, time=float(when))


def describe_crashes(records: list[CrashRecord]) -> str | None:
    """The crash the earliest record describes, with every rank that died of the same error (`rank 3: ValueError:
    …`, `ranks 0, 1, 2, 3: KeyError: 'x'`); None for no record. The later records of other errors are the peers'
    consequences and are left out."""
    if not records:
        return None
    first = min(records, key=lambda r: r.time)
    ranks = sorted({r.rank for r in records if r.error == first.error})
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: {first.error}"


@dataclasses.dataclass(frozen=True)
class LaunchRecord:
    """`attempts/<n>/launch.json`: what the orchestrator launched as attempt n. Written by the orchestrator (the
    backend that launches the attempt) for every backend, before the attempt can start; it is the only place a
    launched trainer learns its strategy from, and the newest one tells a Slurm job which attempt is current.

    The JSON is flat: these fields plus the backend's own (`extra`: Slurm's submission token, node count, processes
    per node, job id, mode), which the job-side helper reads without importing cona."""

    attempt: int
    strategy: Strategy
    backend: str
    written_at: float
    in_place: bool = False
    """The attempt continues the previous attempt's processes (an in-place switch)."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    _FIELDS = ("attempt", "strategy", "backend", "written_at", "in_place")

    def to_dict(self) -> dict[str, Any]:
        return {**self.extra, "attempt": self.attempt, "strategy": self.strategy.to_dict(), "backend": self.backend,
                "written_at": self.written_at, "in_place": self.in_place}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LaunchRecord:
        return cls(
            attempt=int(data["attempt"]), strategy=Strategy.from_dict(data["strategy"]),
            backend=str(data.get("backend", "")), written_at=float(data.get("written_at", 0.0)),
            in_place=bool(data.get("in_place", False)),
            extra={k: v for k, v in data.items() if k not in cls._FIELDS},
        )  # fmt: skip


@dataclasses.dataclass
class ControlRecord:
    """Orchestrator → trainer command. The trainer acts on each `seq` once."""

    seq: int
    command: str  # "switch" | "stop" | "checkpoint"
    reason: str = ""
    in_place: bool = False
    """For a switch: the orchestrator wrote the launch record of the next attempt (`in_place: true`, the new
    strategy) and will watch the same processes go on as it; the trainer rebuilds the model in place instead of
    exiting (its exit record then names `next_attempt` and `next_strategy`). Without it the trainer exits and the
    orchestrator launches the next attempt."""
    attempt: int | None = None
    """The attempt the command is for; None: whichever runs (`cona stop`, the time budget). A relaunched attempt
    resumes from a checkpoint that may predate a switch it never received, and must not act on the switch meant
    for the attempt before it (found by `python -m tests.faults`)."""

    COMMANDS = ("switch", "stop", "checkpoint")

    def __post_init__(self) -> None:
        if self.command not in self.COMMANDS:
            raise ValueError(f"control command {self.command!r} is not one of {', '.join(self.COMMANDS)}")
        # A hand-edited or damaged record (`"seq": "9"`) is refused here, so that `read_control` passes it over as
        # damaged: compared with an int, it crashed the trainer's poll, the orchestrator and `cona stop`.
        def whole(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not whole(self.seq) or self.seq < 0:
            raise ValueError(f"control seq {self.seq!r} is not a non-negative integer")
        if self.attempt is not None and not whole(self.attempt):
            raise ValueError(f"control attempt {self.attempt!r} is not an integer")
        if not isinstance(self.in_place, bool) or not isinstance(self.reason, str):
            raise ValueError("control in_place must be true or false and reason text")


@dataclasses.dataclass(frozen=True)
class SwitchPoints:
    """`switch_points.json`: where a fixed schedule (`policy: schedule`) changes strategy, so that the switch
    happens at the same step in every run, whatever the timing.

    A trainer whose step crosses one of `samples` (start < point ≤ end) holds after that step — no next step —
    until a switch or stop arrives (the orchestrator decides once it sees the step's heartbeat; a `checkpoint`
    command is served and the hold goes on) or `wait_s` passes (then it checkpoints and exits SWITCH with
    `HOLD_TIMEOUT_REASON`, for a relaunch at the point); the switch therefore lands at the first step boundary at or
    past the point. Without the hold the trainer would train on until the orchestrator's next decision, and the
    switch point would depend on timing."""

    samples: tuple[int, ...] = ()
    wait_s: float = 60.0
    """How long a trainer holds at a point for the decision before it exits for a relaunch there."""

    def to_dict(self) -> dict[str, Any]:
        return {"samples": list(self.samples), "wait_s": self.wait_s}

    @classmethod
    def from_dict(cls, data: Any) -> SwitchPoints:
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        samples = data.get("samples", [])
        if not isinstance(samples, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                    for n in samples):  # fmt: skip
            raise ValueError("`samples` must be a list of positive integers")
        wait_s = data.get("wait_s", 60.0)
        if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or not wait_s > 0:
            raise ValueError("`wait_s` must be a positive number")
        return cls(samples=tuple(sorted(samples)), wait_s=float(wait_s))

    def crossed(self, start: int, end: int) -> bool:
        """Whether the step over samples [start, end) reaches a point it started before."""
        return any(start < point <= end for point in self.samples)


CHECKPOINT_NAME = re.compile(r"step-\d{8,}")
"""The name of a checkpoint directory (`RunDir.checkpoint_dir`). Only these are listed, resumed from or pruned: a
`step-abc` or `step-1` someone left in checkpoints/ is not cona's (it was skipped on every resume as "no COMPLETE
marker, it was being written", and one that sorted before the newest checkpoint was deleted as a partial save)."""


def is_checkpoint_name(name: str) -> bool:
    return CHECKPOINT_NAME.fullmatch(name) is not None


def _marked(path: Path) -> bool:
    """Whether the checkpoint directory `path` holds its COMPLETE marker. One this user may not look into counts as
    marked: it may be complete, and listed it reaches the resume's checks, which name it and say what to do (left
    out, it would be passed over without a word, or taken for a partial save to delete)."""
    try:
        return (path / COMPLETE_MARKER).exists()
    except OSError:
        return True


def file_given_as_run_dir(root: Path, *, new: bool = False) -> str | None:
    """One line when `root`, given where a run directory belongs, exists and is no directory, saying what to give
    instead; None otherwise (a directory, or nothing there: each command says that in its own words). `cona export
    FILE` said "no such run directory" and `cona status FILE` "not a cona run directory (no run.yaml)", as if the
    path were missing or a directory. A file of a run (`runs/x/state.json`) points to the run's directory; `new`: the
    path is to be a new run's (`cona run --run-dir`)."""
    if not root.exists() or root.is_dir():
        return None
    parent = root.parent
    if (parent / "run.yaml").is_file() or (parent / "checkpoints").is_dir():
        return f"{root}: a file, not a run directory; give the run directory it is in, {parent}"
    if new:
        return f"{root}: a file, not a run directory; pick a path where none exists (or an empty directory)"
    return f"{root}: a file, not a run directory; give the run's directory (the --run-dir it was created with)"


@dataclasses.dataclass
class RunDir:
    """Paths and small helpers of one run directory."""

    root: Path

    def __post_init__(self) -> None:
        self.root = Path(self.root)

    @property
    def run_yaml(self) -> Path:
        return self.root / "run.yaml"

    @property
    def state_json(self) -> Path:
        return self.root / "state.json"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def control_json(self) -> Path:
        return self.root / "control.json"

    @property
    def lock(self) -> Path:
        return self.root / "orchestrator.lock"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def heartbeats(self) -> Path:
        return self.root / "heartbeats"

    @property
    def samples_log(self) -> Path:
        """Rank 0 appends the sample indices of every step here (for audits: none lost, none repeated)."""
        return self.root / "samples"

    def attempt_dir(self, attempt: int) -> Path:
        return self.root / "attempts" / str(attempt)

    def exit_file(self, attempt: int) -> Path:
        """`attempts/<n>/exit.json`: the trainer's exit code and reason, written by rank 0 just before it exits.

        torchrun exits 1 whenever a worker exits non-zero, so this file (or the `exit` heartbeat) is where the
        orchestrator reads SWITCH/STOPPED/BAD_WORLD/CONFIG. A process killed outright leaves none.
        """
        return self.attempt_dir(attempt) / "exit.json"

    def read_exit(self, attempt: int) -> ExitRecord | None:
        """Attempt `attempt`'s exit record, or None (no protocol exit recorded, or an unreadable one)."""
        try:
            data = read_json(self.exit_file(attempt))
            return ExitRecord.from_dict(data) if isinstance(data, dict) else None
        except (json.JSONDecodeError, OSError, KeyError, TypeError, ValueError):
            return None

    def switched_in_place(self, attempt: int) -> ExitRecord | None:
        """Attempt `attempt`'s exit record when its processes went on in place as attempt `attempt` + 1, else None."""
        record = self.read_exit(attempt)
        if record is None or not record.went_on_in_place or record.next_attempt != attempt + 1:
            return None
        return record

    def running_as(self, attempt: int) -> int:
        """The attempt that attempt `attempt`'s processes run as now, or ended as: `attempt`, or the last of the in-place
        switches they went on through (`switched_in_place`), which an orchestrator that was gone did not follow."""
        while self.switched_in_place(attempt) is not None:
            attempt += 1
        return attempt

    def attempt_exit_code(self, attempt: int, process_status: int | None) -> int | None:
        """How attempt `attempt` ended, as an `ExitCode` value: its exit record's code when rank 0 wrote one, else
        the process status (torchrun exits 1 for any non-zero worker, and 0 for a `--max-steps` stop: see
        `process_exit_status`)."""
        recorded = self.read_exit(attempt)
        return recorded.exit_code if recorded is not None else process_status

    def write_exit(self, attempt: int, record: ExitRecord) -> None:
        atomic_write_json(self.exit_file(attempt), record.to_dict())

    def crash_file(self, attempt: int, rank: int) -> Path:
        """`attempts/<n>/crash-<rank>.json`: rank `rank`'s `CrashRecord` (that rank is its only writer)."""
        return self.attempt_dir(attempt) / f"crash-{rank}.json"

    def write_crash(self, attempt: int, record: CrashRecord) -> None:
        atomic_write_json(self.crash_file(attempt, record.rank), record.to_dict())

    def read_crashes(self, attempt: int) -> list[CrashRecord]:
        """Attempt `attempt`'s crash records, oldest first; unreadable ones are left out."""
        found = []
        for path in self.attempt_dir(attempt).glob("crash-*.json"):
            try:
                data = read_json(path)
                found.append(CrashRecord.from_dict(data))
            except (OSError, ValueError, KeyError, TypeError, NotRegularFile):  # a crash line's detail, no more
                continue
        return sorted(found, key=lambda r: r.time)

    def heartbeat_file(self, attempt: int) -> Path:
        return self.heartbeats / f"{attempt}.jsonl"

    def checkpoint_dir(self, step: int) -> Path:
        return self.checkpoints / f"step-{step:08d}"

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoint directories, oldest first (a directory without its marker is not complete)."""
        if not self.checkpoints.is_dir():
            return []
        found = [p for p in self.checkpoints.iterdir() if is_checkpoint_name(p.name) and _marked(p)]
        return sorted(found, key=lambda p: p.name)

    def incomplete_checkpoints(self) -> list[Path]:
        if not self.checkpoints.is_dir():
            return []
        return sorted(
            p for p in self.checkpoints.iterdir() if is_checkpoint_name(p.name) and not _marked(p)
        )

    def latest_checkpoint(self) -> Path | None:
        complete = self.complete_checkpoints()
        return complete[-1] if complete else None

    def has_marked_checkpoint(self) -> bool:
        """Whether a trainer could resume from anything here: a `step-*` directory with its COMPLETE marker, or the
        staged or replaced copy of one whose re-save a crash interrupted (the trainer's `recover_resaves` puts it
        back under its name before it lists the checkpoints)."""
        if not self.checkpoints.is_dir():
            return False
        return any(is_checkpoint_name(p.name.removeprefix(".resave-").removeprefix(".replaced-")) and _marked(p)
                   for p in self.checkpoints.iterdir())  # fmt: skip

    def recorded_progress(self) -> tuple[int, int]:
        """From the heartbeats of every attempt: the most samples the run reached, and the most it ever had in a
        checkpoint (a `checkpoint` record, an attempt that resumed from one, a trainer that exited after its
        checkpoint: done, switched or stopped). 0 for none; damaged lines are left out."""
        reached = checkpointed = 0
        saved_on_exit = (ExitCode.DONE, ExitCode.SWITCH, ExitCode.STOPPED)
        for path in sorted(self.heartbeats.glob("*.jsonl")):
            if not path.is_file():
                continue
            for record in read_jsonl(path)[0]:
                samples, event = record.get("samples"), record.get("event")
                if isinstance(samples, bool) or not isinstance(samples, int):
                    continue
                reached = max(reached, samples)
                if event in ("checkpoint", "resume") or (event == "exit" and record.get("exit_code") in saved_on_exit):
                    checkpointed = max(checkpointed, samples)
        return reached, checkpointed

    def progress_without_checkpoint(self, *, samples_known: int = 0) -> str | None:
        """Why a new attempt must not start: the run has had progress in a checkpoint, and no checkpoint is left to
        resume it from (deleted, or none has its COMPLETE marker); None when it may start. The one place of the
        rule that a run never silently starts again from sample 0 after it had checkpointed progress. A run that
        never wrote a checkpoint (a crash before the first one) does start again from 0: nothing saved is lost.
        `samples_known`: what the caller knows the run reached (the orchestrator's state.json)."""
        if self.has_marked_checkpoint():
            return None
        reached, checkpointed = self.recorded_progress()
        if checkpointed <= 0:
            return None
        reached = max(reached, samples_known, checkpointed)
        return (f"{self.root} reached {reached:,} samples (checkpointed up to {checkpointed:,}) but has no complete "
                f"checkpoint in {self.checkpoints}; restore them from a backup and resume, or start over with a new "
                "--run-dir")  # fmt: skip

    def latest_trainer_state(self) -> dict[str, Any] | None:
        latest = self.latest_checkpoint()
        return read_json(latest / TRAINER_STATE) if latest else None

    def write_control(self, record: ControlRecord) -> None:
        atomic_write_json(self.control_json, dataclasses.asdict(record))

    def read_control(self) -> ControlRecord | None:
        try:
            data = read_json(self.control_json)
        except (ValueError, OSError):  # JSONDecodeError, and UnicodeDecodeError for bytes that are no text
            return None
        if not isinstance(data, dict):
            return None
        known = {f.name for f in dataclasses.fields(ControlRecord)}
        try:  # unknown keys (an older orchestrator's `strategy`) are ignored
            return ControlRecord(**{k: v for k, v in data.items() if k in known})
        except (TypeError, ValueError):
            return None

    @property
    def switch_points_json(self) -> Path:
        """`switch_points.json`: the sample counts at which the trainer must wait for the orchestrator's switch
        decision (`SwitchPoints`), written by the orchestrator before it launches anything."""
        return self.root / "switch_points.json"

    def write_switch_points(self, points: SwitchPoints) -> None:
        atomic_write_json(self.switch_points_json, points.to_dict())

    def read_switch_points(self) -> SwitchPoints:
        """The run's switch points; none when the file does not exist. A corrupt file raises ValueError naming it:
        training past a point without the orchestrator's decision would break the schedule silently."""
        try:
            data = read_json(self.switch_points_json)
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
            raise ValueError(f"{self.switch_points_json}: unreadable ({type(e).__name__}); "
                             "delete it and resume with `cona run --resume` to have it written again") from None
        if data is None:
            return SwitchPoints()
        try:
            return SwitchPoints.from_dict(data)
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{self.switch_points_json}: {e}; delete it and resume with `cona run --resume` to "
                             "have it written again") from None

    def launch_file(self, attempt: int) -> Path:
        """`attempts/<n>/launch.json`: the orchestrator's `LaunchRecord` of attempt n (its only writer)."""
        return self.attempt_dir(attempt) / "launch.json"

    def write_launch(self, record: LaunchRecord) -> None:
        atomic_write_json(self.launch_file(record.attempt), record.to_dict())

    def read_launch(self, attempt: int) -> LaunchRecord | None:
        """Attempt `attempt`'s launch record, or None when there is none (or it is unreadable)."""
        try:
            data = read_json(self.launch_file(attempt))
            return LaunchRecord.from_dict(data) if isinstance(data, dict) else None
        except (json.JSONDecodeError, OSError, KeyError, TypeError, ValueError):
            return None

    def latest_launch(self) -> LaunchRecord | None:
        """The launch record of the newest attempt launched so far."""
        numbers = sorted(
            (int(p.parent.name) for p in self.root.glob("attempts/*/launch.json") if p.parent.name.isdigit()),
            reverse=True,
        )
        for number in numbers:
            record = self.read_launch(number)
            if record is not None:
                return record
        return None
