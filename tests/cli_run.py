"""What every end-to-end harness needs around one `cona run` subprocess: start it with its output in a file, read
the run directory's events, wait for a condition while the run is alive, finish and check it ended `done`, kill
it at the end. Each backend's harness adds its own views and what a failure should show (`logs`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cona.orchestrator.runstate import RunState, read_events, read_state
from cona.protocol.rundir import RunDir

from tests.conftest import REPO


class CliRun:
    """One `cona run` in a subprocess, on the run directory `run_root`, its output in `out_path`."""

    finish_timeout_s = 400.0

    def __init__(self, run_root: Path, out_path: Path) -> None:
        self.run = RunDir(run_root)
        self.out_path = out_path
        self.proc: subprocess.Popen | None = None

    def start_cli(self, args: list[str], env: dict[str, str]) -> None:
        """`python -m cona.orchestrator.cli run --run-dir RUN *args` from the repository, unbuffered."""
        self.out = self.out_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "cona.orchestrator.cli", "run", "--run-dir", str(self.run.root), *args],
            cwd=REPO, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=self.out, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip

    def output(self) -> str:
        return self.out_path.read_text(errors="replace") if self.out_path.exists() else ""

    def events(self, kind: str | None = None) -> list[dict]:
        try:
            events = read_events(self.run)
        except (OSError, ValueError):
            return []
        return [e for e in events if kind is None or e["event"] == kind]

    def wait(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc is not None and self.proc.poll() is not None and not predicate():
                pytest.fail(f"cona run exited ({self.proc.returncode}) while waiting for {what}\n{self.logs()}")
            time.sleep(0.5)
        pytest.fail(f"timed out after {timeout}s waiting for {what}\n{self.logs()}")

    def finish(self, timeout: float | None = None) -> RunState:
        assert self.proc is not None
        timeout = self.finish_timeout_s if timeout is None else timeout
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"cona run did not finish in {timeout}s\n{self.logs()}")
        assert self.proc.returncode == 0, self.logs()
        state = read_state(self.run)
        assert state.status == "done", self.logs()
        return state

    def events_text(self) -> str:
        return "--- events\n" + "\n".join(json.dumps(e)[:400] for e in self.events())

    def logs(self) -> str:
        return f"--- cona run output\n{self.output()[-4000:]}\n{self.events_text()}"

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if hasattr(self, "out"):
            self.out.close()
