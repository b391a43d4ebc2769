"""Which rank of a crashed attempt died of what, in a few words, for every backend's crash line.

Two sources: torchrun's failure summary at the end of an attempt's log ("Root Cause (first observed failure)"), the
one process that knows how each worker ended — a worker killed by a signal leaves no record of its own — and the
ranks' own crash records (`CrashRecord`, `describe_crashes`). The logs are the backend's: the local attempt's
`torchrun.log`, a Slurm step's `node-<i>.log`, a Kubernetes attempt's `pod-<name>.log` (`Backend.crash_logs`); a
multi-node attempt has one per node, each with the summary of its own node's torchrun.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
from collections.abc import Iterable
from pathlib import Path

from cona.protocol.rundir import NotRegularFile, RunDir, describe_crashes, open_regular

_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\s*\n(?P<head>(?:.*\n){0,6}?)\s*rank\s*:\s*(?P<rank>\d+)"
                         r"[^\n]*\n\s*exitcode\s*:\s*(?P<code>-?\d+)")  # fmt: skip
_TIME = re.compile(r"^\s*time\s*:\s*(\S+)", re.M)
_LOG_TAIL = 1 << 16
"""torchrun's failure summary ends its output: a log's last 64 KiB hold it."""


@dataclasses.dataclass(frozen=True)
class RootCause:
    """The worker one torchrun names as the root cause of its failure."""

    rank: int
    exit_code: int
    """Negative: the signal that killed it."""
    time: str
    """When torchrun saw it fail, as its summary prints it (`2026-12-07_20:41:04`, the host's local time, whole
    seconds; they sort as times); "" when the summary has none."""


def _summary(log: Path) -> RootCause | None:
    """The root cause of the last summary in `log`'s tail, or None (no such log, no summary)."""
    try:
        with open_regular(log) as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - _LOG_TAIL))
            text = f.read().decode(errors="replace")
    except (OSError, NotRegularFile):  # the detail of a crash line, not worth failing the run over
        return None
    found = list(_ROOT_CAUSE.finditer(text))
    if not found:
        return None
    last = found[-1]
    when = _TIME.search(last["head"])
    return RootCause(int(last["rank"]), int(last["code"]), when[1] if when else "")


def torchrun_root_cause(logs: Iterable[Path]) -> RootCause | None:
    """The worker torchrun names as the root cause of a failed attempt, from the summaries at the ends of `logs`
    (one per node), or None when none has one. Of several nodes' summaries, the failure seen first (their `time`:
    the way torchrun picks the root among its own workers); in the same second, a signal before an exit code (a
    killed worker leaves no record, its peers' errors follow from its loss); then the first log."""
    found = [cause for cause in map(_summary, logs) if cause is not None]
    if not found:
        return None
    # An empty time sorts after any time: a summary that does not say when is not known to be first.
    return min(found, key=lambda c: (c.time or "\uffff", c.exit_code >= 0))


def crash_cause(run_dir: RunDir, attempt: int, logs: Iterable[Path]) -> str | None:
    """Which rank of `attempt` died of what, in a few words, or None when nothing says: a rank killed by a signal
    (torchrun's root cause in `logs`, `rank 3 killed by SIGKILL`), else the exception the earliest rank recorded
    (`CrashRecord`, `rank 3: ValueError: …`), else the root cause's exit code (`rank 3 exited 1`)."""
    root = torchrun_root_cause(logs)
    if root is not None and root.exit_code < 0:
        try:
            name = signal.Signals(-root.exit_code).name
        except ValueError:
            name = f"signal {-root.exit_code}"
        return f"rank {root.rank} killed by {name}"
    recorded = describe_crashes(run_dir.read_crashes(attempt))
    if recorded is not None:
        return recorded
    return f"rank {root.rank} exited {root.exit_code}" if root is not None else None
