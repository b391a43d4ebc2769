"""The Slurm backend, one folder: `backend.py` (submit, watch, cancel, adopt), `script.py` and `templates/` (the
batch script and its job-side helper), `spec.py` (the profile's `slurm:` section).

The backend's names load on first use: a profile needs only `SlurmSpec`, and the backend module imports the
profile, so importing it eagerly here would make the two import each other.
"""

from __future__ import annotations

import importlib
from typing import Any

from cona.orchestrator.backends.slurm.spec import SlurmSpec

__all__ = ["SlurmBackend", "SlurmSpec"]


def __getattr__(name: str) -> Any:
    backend = importlib.import_module("cona.orchestrator.backends.slurm.backend")
    try:
        return getattr(backend, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
