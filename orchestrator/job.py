"""The job as the orchestrator reads it: the trainer's `JobSpec` plus the `policy` and `metrics` sections.

The policy (how strategies are picked and changed, the timeouts of the lifecycle loop) is the orchestrator's
alone; the trainer reads the same YAML through `cona.protocol.job`, which sets that section aside. The one thing
the trainer needs from it, whether to measure the Adam-preconditioned gradient norms, reaches it as its own field
`heartbeat.adam_stats`, which `Job` turns on for the `adam` noise estimator.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Literal

import pydantic
from cona.protocol.job import JobSpec, read_job_file
from cona.protocol.yamlconfig import ConfigError, StrictModel, validate
from pydantic import Field

__all__ = ["Job", "MetricsSpec", "PolicySpec", "ScheduleEntry", "job_from_dict", "job_to_dict", "load_job"]


class ScheduleEntry(StrictModel):
    """One step of a `schedule` policy: from `samples` on, train with `strategy`."""

    samples: int = Field(ge=0)
    strategy: str
    """A strategy string such as `dp=2,tp=2,pp=1,mbs=2,gbs=16`."""


class PolicySpec(StrictModel):
    """How the orchestrator picks and changes strategies."""

    name: Literal["cona", "static", "fixed", "schedule"] = "cona"
    """`cona` switches online; `static` keeps the fastest strategy at base_gbs; `fixed` keeps `strategy`;
    `schedule` follows `schedule`."""
    strategy: str | None = None
    """The strategy of the `fixed` policy."""
    schedule: list[ScheduleEntry] = Field(default_factory=list)
    """The (samples, strategy) pairs of the `schedule` policy, in increasing samples."""
    prior_noise_scale: float | None = Field(None, gt=0, le=1e15)  # the largest B_noise ranked (`policy.MAX_NOISE_SCALE`)
    """B_noise assumed before the estimate is stable (samples); set, every batch is ranked under it from the start.
    Unset: `batch.base_gbs`, the batch the LR was tuned at, taken as the estimator's value and multiplied by
    `critical_batch_factor` like every estimate; cona starts at the base batch unless another batch's R under that
    prior is ahead by `min_gain` (a steep throughput curve: gpt3-1.3b on 16×8 A100s with a base batch of 128 starts at 256),
    and then changes only the layout until the estimate is in, its blend with the prior included (a batch chosen on
    a guess, or on the first and smallest estimates, costs a switch to undo)."""
    noise_estimator: Literal["plain", "adam"] = "plain"
    """`plain` is McCandlish's tr Σ/|G|²; `adam` preconditions by Adam's second moment (Pollux). The `adam`
    estimate depends on the batch being trained (measured from one state of the tiny GPT: 14.6 → 64.0 samples from
    batch 16 to 256, where `plain` stays within 3%; `python -m benchmarks.noise_batch`), so it is not the default."""
    critical_batch_factor: float = Field(5.0, gt=0, le=1e6)  # beyond: every estimate ranks as the ceiling
    """Multiplies the estimated B_noise before ranking. The two-batch estimate sits below the batch at which larger
    batches stop paying (the critical batch fitted from fixed-batch runs): 1.2–7× on the tiny GPT (median about 3 at
    the full benchmark's targets, 6.7 at the earlier `--quick` ones, about 12× late in a run); near or above it on
    the tiny Llama (0.3–1.4×) and BERT (0.1–0.4×). 5, measured against 3, 4 and 6 on every benchmark workload:
    better than 3 on the steep a100-16x8 curve (cona/oracle 1.179 / 1.141 → 1.148 / 1.056) and at Llama's lowest
    target (1.082 → 1.066), the same everywhere else; 6 moves an a100-16x8 seed to a batch that misses the second
    target within the budget (docs/benchmarks.md)."""
    noise_growth: bool = True
    """Rank with the noise scale expected halfway through the horizon instead of today's: B_noise grows as the loss
    falls, and its growth per sample is fitted on the estimates of past evaluations (at least six; at most 2×
    today's). Measured neutral or better on every benchmark workload (docs/benchmarks.md); off ranks with today's."""
    noise_monotone: bool = True
    """Never rank with a noise scale below the largest trusted estimate so far: B_noise grows as the loss falls, so
    an estimate that dips below an earlier one is taken as noise, not as a reason for a smaller batch (a rise is
    taken at once). Measured neutral or better on every benchmark workload (docs/benchmarks.md); off ranks with
    the latest estimate."""
    probe_layouts: int = Field(2, ge=0)
    """Layouts that never ran which cona may try once each (a few heartbeats at the current batch) when the cost
    model puts them within 0.6× of the current strategy, the model has been seen to miss a measured step time by
    more than 5%, and the two switches cost at most 3% of the horizon (in place): the calibration can only correct
    what it has measured. 0 turns probing off."""
    lr_aware: bool = False
    """Rank candidates with the learning rate `optimizer.lr_scaling` gives each batch, taking `optimizer.lr` as the
    best LR at `batch.base_gbs` (`cona.orchestrator.policy.LrRule`); off, every batch is assumed to get its best LR."""
    noise_ema: float = Field(0.97, ge=0, lt=1)
    """EMA factor per heartbeat for the numerator and denominator of B_noise (0.97: about the last 30 heartbeats;
    a single step's two-batch estimate is noise-dominated)."""
    min_noise_samples: int = Field(8, ge=1)
    """Heartbeats with gradient statistics needed before the estimate replaces the prior."""
    decision_interval_s: float = Field(5.0, gt=0)
    """Seconds between evaluations of the candidates."""
    min_gain: float = Field(0.05, ge=0)
    """δ: the best candidate must beat the current one by at least this fraction, net of switch cost."""
    persistence: int = Field(2, ge=1)
    """k: consecutive evaluations a candidate must win before a switch."""
    min_dwell_s: float = Field(10.0, ge=0)
    """Minimum time on a strategy before switching again."""
    horizon_intervals: float = Field(24.0, gt=0)
    """The horizon H is at most this many decision intervals."""
    in_place_switch: bool = True
    """Switch between strategies of the same world size without restarting the trainer processes (the model,
    optimizer and meshes are rebuilt and resume from the switch checkpoint), where the backend supports it (local, Slurm).
    Off, every switch exits and relaunches."""
    switch_cost_s: float | None = Field(None, ge=0)
    """Seconds charged for a switch before one of its kind (in place, relaunch, resubmission) was measured. Unset,
    it is predicted from the checkpoint's size, the profile's storage bandwidths and the backend's overhead
    (`cona.orchestrator.switchcost`); set it only to pin a cost you measured elsewhere."""
    max_restarts: int = Field(3, ge=0)
    """Relaunches of a crashed or hung attempt before the run fails. A crash the trainer explains in its exit record
    (a diverged loss) that a relaunch replays in the same words under the same strategy fails the run at once: from
    the same checkpoint with the same data order it would replay every time."""
    max_disruptions_without_progress: int = Field(10, ge=0)
    """Disruptions (a pod or node taken away by the cluster: eviction, preemption, drain) in a row that find no
    newer complete checkpoint than the one before, before the run fails. A disruption is relaunched without
    counting against `max_restarts`; this bounds a loop that makes no progress (pods evicted for node pressure they
    cause, preempted faster than the run checkpoints)."""
    heartbeat_timeout_s: float = Field(300.0, gt=0)
    """A running attempt without a heartbeat for this long counts as hung."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """Allowance before an attempt's first heartbeat (process start, rendezvous, checkpoint load)."""

    @pydantic.model_validator(mode="after")
    def _policy_fields(self) -> PolicySpec:
        if self.name == "fixed" and not self.strategy:
            raise ValueError("policy 'fixed' needs policy.strategy, e.g. dp=2,tp=1,pp=2,mbs=2,gbs=32")
        if self.name == "schedule":
            if not self.schedule:
                raise ValueError("policy 'schedule' needs policy.schedule: a list of {samples, strategy}")
            starts = [e.samples for e in self.schedule]
            if starts[0] != 0 or any(a >= b for a, b in itertools.pairwise(starts)):
                raise ValueError(f"policy.schedule must start at samples 0 and increase strictly (got samples "
                                 f"{starts}): one entry per point where the strategy changes")  # fmt: skip
        # A strategy the named policy never reads is a forgotten `name:`: the run would switch online instead.
        if self.strategy and self.name != "fixed":
            raise ValueError(f"policy.strategy is read only by policy 'fixed', not {self.name!r}; set policy.name: "
                             "fixed, or remove policy.strategy")  # fmt: skip
        if self.schedule and self.name != "schedule":
            raise ValueError(f"policy.schedule is read only by policy 'schedule', not {self.name!r}; set "
                             "policy.name: schedule, or remove policy.schedule")  # fmt: skip
        return self


class MetricsSpec(StrictModel):
    """Where else the orchestrator writes the run's metrics (they are always in heartbeats/ and events.jsonl)."""

    tensorboard: bool = False
    """Write TensorBoard scalars (train/validation loss, perplexity, noise scale, samples/s, the strategy as text,
    switch markers) to RUN_DIR/tensorboard/ as the heartbeats arrive (`cona.orchestrator.tensorboard`); needs
    `pip install 'cona[tensorboard]'` (tensorboardX, no torch)."""


class Job(JobSpec):
    """A training job with its policy. Load with `load_job`."""

    policy: PolicySpec = Field(default_factory=PolicySpec)
    metrics: MetricsSpec = Field(default_factory=MetricsSpec)

    @pydantic.model_validator(mode="after")
    def _trainer_measures_what_the_policy_needs(self) -> Job:
        if self.policy.noise_estimator == "adam" and not self.heartbeat.adam_stats:
            self.heartbeat.adam_stats = True
        return self


def job_from_dict(data: dict[str, Any], *, source: str = "job") -> Job:
    """Validate a job given as a mapping (for example `run.yaml`'s `job` section)."""
    return validate(Job, data, source=source)


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Job:
    """Load and validate a job YAML file, applying `--set dotted.key=value` overrides; raises `ConfigError`."""
    _not_the_profiles(overrides)
    return read_job_file(Job, path, overrides)


def _not_the_profiles(overrides: list[str] | tuple[str, ...]) -> None:
    """A `--set` of a cluster profile's field (`nodes=2`) would be answered with the job's closest field ("did you
    mean 'model'?"): say which flag sets it instead."""
    from cona.orchestrator.profile import ClusterProfile

    for item in overrides:
        top = item.partition("=")[0].strip().split(".")[0]
        if top and top not in Job.model_fields and top in ClusterProfile.model_fields:
            raise ConfigError(f"--set {item}: {top!r} is a field of the cluster profile, not of the job; give it as "
                              f"--profile-set {item}")  # fmt: skip


def job_to_dict(job: Job) -> dict[str, Any]:
    """The resolved job as plain data (for run.yaml); `job_from_dict` reads it back unchanged."""
    return job.model_dump(mode="json")
