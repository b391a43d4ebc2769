"""The local backend, one folder: `backend.py` (each attempt as `torchrun --standalone` on this machine, watched by
PID; in-place switches). It has no profile section and no job-side helper: the attempt's shell wrapper records the
exit code.

The backend's names load on first use, as for every backend package (`cona.orchestrator.backends`).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["LocalBackend"]


def __getattr__(name: str) -> Any:
    backend = importlib.import_module("cona.orchestrator.backends.local.backend")
    try:
        return getattr(backend, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
