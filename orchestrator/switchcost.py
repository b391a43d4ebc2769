"""What a switch costs: measured once one of its kind has happened, predicted before that.

A switch loses the wall time from the decision to the first heartbeat of the new strategy (the scheduler measures
exactly that span). It is made of

    the step in flight      the trainer checkpoints at the next step boundary: half a step on average
    checkpoint save         checkpoint bytes / `storage.write_bandwidth`
    the backend's overhead  in place: exit record, barrier, releasing and rebuilding the model and meshes;
                            relaunch: tearing the processes down, interpreter start, imports, rendezvous, model
                            build; resubmission: a relaunch plus a new allocation from the queue
    checkpoint load         checkpoint bytes / `storage.read_bandwidth`

Which kind a switch is depends on the backend and the two strategies (`Backend.switch_kind`), and so does the
overhead (`Backend.switch_overhead_s`): on the local backend a switch that keeps the world size stays in place and
costs about a second for the tiny model, a relaunch about ten, so charging every switch a relaunch before the first
one was measured would make the first switch look eight times dearer than it is.

Measured costs are kept per kind: an in-place switch says little about what a relaunch will cost. The prediction is
used only until a switch of the same kind has been measured (or when `policy.switch_cost_s` pins it).

Torch-free.
"""

from __future__ import annotations

import enum
from typing import Any

from cona.orchestrator.job import Job
from cona.orchestrator.profile import ClusterProfile
from cona.protocol.yamlconfig import parse_bytes

CHECKPOINT_BYTES_PER_PARAM = 12
"""The trainer's checkpoint holds fp32 parameters and Adam's two fp32 moments: 12 bytes per parameter."""
RECENT_SWITCHES = 3
"""A kind's measured cost is the mean of its last few switches (same model, same storage)."""


class SwitchKind(enum.Enum):
    IN_PLACE = "in_place"
    """The trainer processes stay and rebuild the model for the new strategy."""
    RELAUNCH = "relaunch"
    """The processes exit and new ones start on the same machines (the same allocation)."""
    RESUBMIT = "resubmit"
    """The processes exit and the new strategy needs another allocation (another node count)."""


def checkpoint_bytes(job: Job) -> float:
    """Bytes of one checkpoint of `job`'s model (parameters plus optimizer state; data and RNG state are tiny)."""
    return float(CHECKPOINT_BYTES_PER_PARAM * job.model.num_params)


def checkpoint_save_s(job: Job, profile: ClusterProfile) -> float:
    """Seconds one checkpoint of `job` takes to write at the profile's `storage.write_bandwidth`."""
    return checkpoint_bytes(job) / parse_bytes(profile.storage.write_bandwidth, per_second=True)


def predicted_switch_cost_s(*, job: Job, profile: ClusterProfile, overhead_s: float, step_time_s: float) -> float:
    """Seconds a switch costs by the formula in the module docstring; `overhead_s` is the backend's part."""
    load = checkpoint_bytes(job) / parse_bytes(profile.storage.read_bandwidth, per_second=True)
    return 0.5 * max(0.0, step_time_s) + checkpoint_save_s(job, profile) + overhead_s + load


class SwitchCosts:
    """Measured switch costs by kind, and the prediction for the kinds not yet measured.

    `pinned_s` (`policy.switch_cost_s`) replaces the prediction when set; a measurement of the same kind still wins.
    """

    def __init__(self, *, job: Job, profile: ClusterProfile, pinned_s: float | None = None) -> None:
        self.job = job
        self.profile = profile
        self.pinned_s = pinned_s
        self._measured: dict[SwitchKind, list[float]] = {}

    def observe(self, kind: SwitchKind, cost_s: float) -> None:
        """One measured switch of `kind` (decision to the first heartbeat of the new strategy)."""
        self._measured.setdefault(kind, []).append(max(0.0, float(cost_s)))

    def measured_s(self, kind: SwitchKind) -> float | None:
        """Mean of the last `RECENT_SWITCHES` measured switches of `kind`, or None if none was measured."""
        costs = self._measured.get(kind)
        if not costs:
            return None
        recent = costs[-RECENT_SWITCHES:]
        return sum(recent) / len(recent)

    def cost_s(self, kind: SwitchKind, *, overhead_s: float, step_time_s: float) -> tuple[float, str]:
        """(seconds, source) for a switch of `kind`: source is `measured`, `pinned` or `predicted`."""
        measured = self.measured_s(kind)
        if measured is not None:
            return measured, "measured"
        if self.pinned_s is not None:
            return float(self.pinned_s), "pinned"
        predicted = predicted_switch_cost_s(job=self.job, profile=self.profile, overhead_s=overhead_s,
                                            step_time_s=step_time_s)  # fmt: skip
        return predicted, "predicted"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data: the measured costs by kind."""
        return {kind.value: list(costs) for kind, costs in sorted(self._measured.items(), key=lambda kv: kv[0].value)}

    def restore(self, data: dict[str, Any]) -> SwitchCosts:
        """Load measurements saved by `to_dict`; returns self."""
        self._measured = {SwitchKind(k): [float(c) for c in v] for k, v in (data or {}).items()}
        return self
