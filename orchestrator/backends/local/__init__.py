"""The local backend, one folder: `backend.py` (each attempt as `torchrun --standalone` on this machine, watched by
PID; in-place switches). It has no profile section and no job-side helper: the attempt's shell wrapper records the
exit code. Nothing imports this package on the way to a profile, so it loads its backend directly.
"""

from __future__ import annotations

from cona.orchestrator.backends.local.backend import LocalBackend

__all__ = ["LocalBackend"]
