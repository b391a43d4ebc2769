"""Backends start and watch trainer attempts. One registry: a backend is a module (or package) here and one line
in `BACKENDS`; every backend is built with the same keyword arguments (`Backend.__init__`).

Backends are imported lazily, so a login node needs only what the backend it uses needs.
"""

from __future__ import annotations

import importlib

from cona.orchestrator.backends.base import Attempt, AttemptStatus, Backend, Outcome
from cona.orchestrator.profile import ClusterProfile
from cona.protocol.job import JobSpec
from cona.protocol.rundir import RunDir

__all__ = ["BACKENDS", "Attempt", "AttemptStatus", "Backend", "Outcome", "backend_class", "make_backend"]

BACKENDS: dict[str, str] = {
    "local": "cona.orchestrator.backends.local:LocalBackend",
    "slurm": "cona.orchestrator.backends.slurm:SlurmBackend",
}
"""Backend name (a profile's `backend:`) → `module:class`."""


def backend_class(name: str) -> type[Backend]:
    """The class registered as `name`; a ValueError that lists the available ones otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not available yet; available: {', '.join(sorted(BACKENDS))}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_backend(*, profile: ClusterProfile, run_dir: RunDir, job: JobSpec | None = None) -> Backend:
    """The backend the profile names, for this run directory and job."""
    return backend_class(profile.backend)(run_dir=run_dir, profile=profile, job=job)
