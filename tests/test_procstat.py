"""The one reader of /proc/<pid>/stat that the trainer and the orchestrator share."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from cona.protocol import procstat


def test_a_command_name_with_spaces_and_parentheses_does_not_shift_the_fields() -> None:
    # A process may name itself anything (prctl PR_SET_NAME, or its comm file): the parser must not split it.
    code = "import pathlib, time; pathlib.Path('/proc/self/comm').write_text('a) b (c'); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 60
        while "(a) b (c)" not in Path(f"/proc/{child.pid}/stat").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "(a) b (c)" in Path(f"/proc/{child.pid}/stat").read_text()
        stat = procstat.read(child.pid)
        assert stat is not None and stat.ppid == os.getpid() and stat.state in "RSD" and not stat.exited
        assert stat.start_ticks.isdigit() and procstat.start_time(child.pid) == stat.start_ticks
        assert child.pid in procstat.children()[os.getpid()]
    finally:
        child.kill()
        child.wait()


def test_an_exited_child_not_yet_reaped_is_not_alive_but_keeps_its_start_time() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while (stat := procstat.read(child.pid)) is not None and not stat.exited and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stat is not None and stat.exited  # a zombie until we wait for it
    assert not procstat.alive(child.pid) and procstat.start_time(child.pid) == stat.start_ticks
    child.wait()
    assert procstat.read(child.pid) is None and procstat.start_time(child.pid) is None and not procstat.alive(child.pid)


def test_this_process_started_before_now_on_the_wall_clock() -> None:
    started = procstat.wall_start_time()
    assert started is not None and time.time() - 3600 * 24 * 365 < started <= time.time()
    assert procstat.alive(os.getpid())
