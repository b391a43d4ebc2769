"""The orchestrator's side of the run directory: run.yaml, state.json, events.jsonl and the single-owner lock."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import time
from pathlib import Path
from typing import Any

import yaml
from cona.orchestrator.profile import ClusterProfile
from cona.protocol.job import JobSpec, job_from_dict, job_to_dict
from cona.protocol.rundir import (
    RunDir,
    append_jsonl,
    atomic_write_json,
    atomic_write_text,
    read_json,
    read_jsonl,
)
from cona.protocol.yamlconfig import ConfigError, validate


def create_run(*, run_dir: RunDir, profile: ClusterProfile, job: JobSpec) -> None:
    """Write the immutable run.yaml (resolved profile and job)."""
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
    run_dir.root.mkdir(parents=True, exist_ok=True)
    document = {
        "created": time.time(),
        "profile": profile.model_dump(mode="json"),
        "job": job_to_dict(job),
    }
    atomic_write_text(run_dir.run_yaml, yaml.safe_dump(document, sort_keys=False))


def load_run(run_dir: RunDir) -> tuple[ClusterProfile, JobSpec]:
    """The profile and job a run was created with."""
    try:
        document = yaml.safe_load(run_dir.run_yaml.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{run_dir.root}: not a cona run directory (no run.yaml)") from None
    except yaml.YAMLError:
        raise ConfigError(f"{run_dir.run_yaml}: corrupt YAML; the run directory cannot be resumed") from None
    if not isinstance(document, dict) or "profile" not in document or "job" not in document:
        raise ConfigError(f"{run_dir.run_yaml}: missing the profile or job section")
    profile = validate(ClusterProfile, document["profile"], source=f"{run_dir.run_yaml} (profile)")
    job = job_from_dict(document["job"], source=f"{run_dir.run_yaml} (job)")
    return profile, job


def log_event(run_dir: RunDir, kind: str, /, **fields: Any) -> dict[str, Any]:
    """Append one decision or incident to events.jsonl."""
    record = {"time": time.time(), "event": kind, **fields}
    append_jsonl(run_dir.events, record)
    return record


def read_events(run_dir: RunDir) -> list[dict[str, Any]]:
    return read_jsonl(run_dir.events)[0]


def read_state(run_dir: RunDir) -> dict[str, Any]:
    return read_json(run_dir.state_json) or {}


def write_state(run_dir: RunDir, state: dict[str, Any]) -> None:
    atomic_write_json(run_dir.state_json, state)


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

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
