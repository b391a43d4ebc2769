"""Backends start and watch trainer attempts. One registry: a backend is a module (or package) here and one line
in `BACKENDS`; every backend is built with the same keyword arguments (`Backend.__init__`).

Backends are imported lazily, so a login node needs only what the backend it uses needs. Each backend also owns
its profile section (`<backend>/spec.py`, embedded by `cona.orchestrator.profile`); this module imports nothing at
import time, so loading a profile never loads a backend.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cona.orchestrator.backends.base import Backend
    from cona.orchestrator.job import Job
    from cona.orchestrator.profile import ClusterProfile
    from cona.protocol.rundir import RunDir

__all__ = ["BACKENDS", "Attempt", "AttemptStatus", "Backend", "Outcome", "backend_class", "make_backend"]

BACKENDS: dict[str, str] = {
    "local": "cona.orchestrator.backends.local.backend:LocalBackend",
    "slurm": "cona.orchestrator.backends.slurm.backend:SlurmBackend",
    "kubernetes": "cona.orchestrator.backends.kubernetes.backend:KubernetesBackend",
}
"""Backend name (a profile's `backend:`) → `module:class`."""


def backend_class(name: str) -> type[Backend]:
    """The class registered as `name`; a ValueError that lists the available ones otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"backend {name!r} is not available yet; available: {', '.join(sorted(BACKENDS))}")
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_backend(*, profile: ClusterProfile, run_dir: RunDir, job: Job | None = None) -> Backend:
    """The backend the profile names, for this run directory and job."""
    return backend_class(profile.backend)(run_dir=run_dir, profile=profile, job=job)


def __getattr__(name: str) -> Any:
    # The base classes load on first use: `cona.orchestrator.profile` imports the backends' spec modules, and
    # `base` imports the profile.
    if name in ("Attempt", "AttemptStatus", "Backend", "Outcome"):
        return getattr(importlib.import_module("cona.orchestrator.backends.base"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
