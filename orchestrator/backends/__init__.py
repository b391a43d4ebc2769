"""Backends start and watch trainer attempts: `local` (torchrun here), `slurm`, `kubernetes`."""

from __future__ import annotations

from cona.orchestrator.backends.base import Attempt, AttemptStatus, Backend, Outcome
from cona.orchestrator.profile import ClusterProfile
from cona.protocol.job import JobSpec
from cona.protocol.rundir import RunDir

__all__ = ["Attempt", "AttemptStatus", "Backend", "Outcome", "make_backend"]


def make_backend(*, profile: ClusterProfile, run_dir: RunDir, job: JobSpec | None = None) -> Backend:
    """The backend named by the profile. Imports lazily so a login node needs only what it uses."""
    if profile.backend == "local":
        from cona.orchestrator.backends.local import LocalBackend

        return LocalBackend(run_dir=run_dir)
    if profile.backend == "slurm":
        try:
            from cona.orchestrator.backends.slurm import SlurmBackend
        except ModuleNotFoundError as e:  # pragma: no cover - only while the backend is being built
            raise ValueError(f"the slurm backend is not available in this installation ({e})") from None
        return SlurmBackend(run_dir=run_dir, profile=profile, job=job)
    raise ValueError(f"backend {profile.backend!r} is not available yet; use a local or slurm profile")
