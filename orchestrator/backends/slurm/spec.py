"""The profile's `slurm:` section: how to submit to Slurm. Owned by the backend; `cona.orchestrator.profile` only embeds it.

Imports nothing of the backend itself, so loading a profile does not load the backend.
"""

from __future__ import annotations

import re

import pydantic
from cona.protocol.yamlconfig import StrictModel
from pydantic import Field

_SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|unlimited|infinite", re.IGNORECASE)
"""The forms `sbatch --time` accepts (man sbatch)."""


class SlurmSpec(StrictModel):
    """How to submit to Slurm. Every value is shell-quoted into the batch script."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str = "04:00:00"
    """`--time` of the training job, in one of Slurm's forms: `MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`,
    `D-HH:MM:SS`, or `UNLIMITED`."""
    extra_sbatch: list[str] = Field(default_factory=list)
    """Extra `#SBATCH` options, e.g. `--constraint=a100`."""
    setup: list[str] = Field(default_factory=list)
    """Shell commands run before training (module loads, `source venv/bin/activate`)."""
    use_submitit: bool = False
    """Submit through submitit instead of a rendered sbatch script."""
    signal_before_timeout_s: int = Field(120, ge=0)
    """Send SIGUSR1 this many seconds before the time limit so the trainer checkpoints."""
    rendezvous_port_base: int = Field(29500, gt=1023, lt=65000)
    """Rendezvous ports are this plus an offset per job, so concurrent jobs don't collide."""
    python: str = "python3"
    """Python interpreter on the compute nodes."""
    gpus_per_node_flag: bool = True
    """Request `--gpus-per-node`; false on CPU-only clusters."""

    @pydantic.field_validator("time_limit")
    @classmethod
    def _time_limit(cls, value: str) -> str:
        if value.strip() and not _SLURM_TIME.fullmatch(value.strip()):  # empty: no --time line (the partition's)
            raise ValueError("not a Slurm time: use MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED")
        return value.strip()
