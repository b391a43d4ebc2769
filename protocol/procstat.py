"""A process as Linux's /proc/<pid>/stat describes it: its state, parent and start time.

The trainer records its processes' identities (a PID and the kernel's start time, which tells a reused PID from the
original) and the orchestrator checks them later, so both read /proc the same way, here. Every reader answers None
where /proc cannot say (no /proc, the process gone, a field missing): callers decide what not knowing means.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

__all__ = ["ProcStat", "alive", "children", "read", "start_time", "wall_start_time"]


@dataclasses.dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/<pid>/stat that cona uses."""

    state: str
    """One letter: R running, S sleeping, ..., Z zombie (exited, not yet reaped), X dead."""
    ppid: int
    """The parent's PID."""
    start_ticks: str
    """Field 22, the start time in clock ticks after boot, kept as text: it is compared, never computed with."""

    @property
    def exited(self) -> bool:
        """An exited process whose entry lingers until its parent reaps it."""
        return self.state in ("Z", "X")


def read(pid: int | str) -> ProcStat | None:
    """The stat of `pid` ("self" for this process), or None when it is gone or /proc cannot say."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces and parentheses; the fields after the last
    # closing parenthesis are fixed: state is field 3, ppid field 4, starttime field 22.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        return ProcStat(state=fields[0], ppid=int(fields[1]), start_ticks=fields[19])
    except (IndexError, ValueError):
        return None


def start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (a zombie's too), to tell a reused PID from the process recorded."""
    stat = read(pid)
    return None if stat is None else stat.start_ticks


def alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (an exited child not yet reaped still has a /proc entry)."""
    stat = read(pid)
    return stat is not None and not stat.exited


def children() -> dict[int, list[int]]:
    """Every process's children, {ppid: [pid, ...]}, from /proc's parent links ({} where /proc cannot be listed)."""
    found: dict[int, list[int]] = {}
    try:
        entries = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]
    except OSError:
        return found
    for pid in entries:
        stat = read(pid)
        if stat is not None:
            found.setdefault(stat.ppid, []).append(pid)
    return found


def wall_start_time() -> float | None:
    """When this process started, on time.time()'s scale (boot time + start ticks), or None without /proc."""
    stat = read("self")
    if stat is None:
        return None
    try:
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
        return boot + int(stat.start_ticks) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return None
