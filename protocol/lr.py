"""The learning-rate schedule, defined over samples so that it survives changes of the global batch size.

Position p is the number of samples consumed *before* the step. For a step of gbs samples:

    warmup (p + gbs < warmup_samples):  lr = peak(gbs) · (p + gbs) / warmup_samples
    cosine afterwards:                  lr = floor + (peak(gbs) − floor) · ½ (1 + cos(π · t)),
                                        t = clamp((p − warmup_samples) / (decay_samples − warmup_samples), 0, 1)
    constant afterwards:                lr = peak(gbs)

peak(gbs) = optimizer.lr · factor, factor = (gbs / base_gbs)^k with k = 0 (`none`), 1 (`linear`) or ½ (`sqrt`),
clamped to [1/cap, cap] with cap = optimizer.lr_scaling_cap. floor = min(optimizer.min_lr, peak(gbs)) so a
scaled-down peak never sits below the floor.
"""

from __future__ import annotations

import math

from cona.protocol.job import JobSpec, OptimizerSpec

_EXPONENTS = {"none": 0.0, "linear": 1.0, "sqrt": 0.5}


def lr_scale_factor(*, gbs: int, base_gbs: int, rule: str, cap: float) -> float:
    """How much the peak LR at `gbs` differs from the one tuned at `base_gbs`."""
    factor = (gbs / base_gbs) ** _EXPONENTS[rule]
    return min(cap, max(1.0 / cap, factor))


def learning_rate(
    optimizer: OptimizerSpec, *, samples: int, gbs: int, base_gbs: int, decay_samples: int
) -> float:
    """The LR of the step that starts after `samples` samples and consumes `gbs` more."""
    factor = lr_scale_factor(gbs=gbs, base_gbs=base_gbs, rule=optimizer.lr_scaling, cap=optimizer.lr_scaling_cap)
    peak = optimizer.lr * factor
    warmup = optimizer.warmup_samples
    if warmup and samples + gbs < warmup:
        return peak * (samples + gbs) / warmup
    if optimizer.schedule == "constant":
        return peak
    floor = min(optimizer.min_lr, peak)
    span = max(1, decay_samples - warmup)
    t = min(1.0, max(0.0, (samples - warmup) / span))
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * t))


def job_learning_rate(job: JobSpec, *, samples: int, gbs: int) -> float:
    return learning_rate(
        job.optimizer, samples=samples, gbs=gbs, base_gbs=job.batch.base_gbs, decay_samples=job.decay_samples
    )
