"""The gradient noise scale B_noise = tr Σ / |G|², estimated online from heartbeats (docs/architecture.md).

McCandlish et al. (2018), "An Empirical Model of Large-Batch Training", appendix A: the squared norm of a
mini-batch gradient of B samples has expectation E|G_B|² = |G|² + tr Σ / B. Two batch sizes observed on the
same step — one replica's gradient before the data-parallel reduction (B_small) and the reduced gradient
(B_big) — give two equations and so unbiased estimates of both unknowns:

    |G|² ≈ (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    tr Σ ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

Each step's estimates are very noisy (and |G|² can come out negative), so numerator and denominator are
averaged separately with an exponential moving average, bias-corrected like Adam's moments, and only their
ratio is taken. Averaging the ratio instead would be biased (E[a/b] ≠ E[a]/E[b]).

For the plain norms both estimates are of batch-size-independent quantities, so records from different global or
local batch sizes (before and after a strategy switch) can be mixed in the same average; measured from one state
at batches 16 to 256, the plain estimate agrees within the sampling noise (`python -m benchmarks.noise_batch`).

The `adam` kind applies the same estimator to gradients preconditioned by Adam's second-moment estimate
(Pollux's "preconditioned gradient noise scale"): the trainer reports Σᵢ gᵢ²/vᵢ-style squared norms in
`adam_local_sqnorm` / `adam_global_sqnorm`. The preconditioner v is built from the noisy gradients of the batch
being trained, so this estimate is *not* batch-independent: at the same parameters it grows 3–16× from batch 16
to 256 (same benchmark). It is therefore not the default (`policy.noise_estimator`).

Torch-free: the orchestrator runs this on a login node.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Literal

from cona.protocol.heartbeat_record import Heartbeat

NoiseKind = Literal["plain", "adam"]

DEFAULT_STABLE_WINDOW = 4
"""Number of most recent estimates that must agree for the estimate to count as stable."""
DEFAULT_STABLE_TOLERANCE = 0.25
"""Largest relative spread (max/min − 1) of those estimates that still counts as stable."""


def two_batch_estimates(
    *, small_sqnorm: float, small_batch: float, big_sqnorm: float, big_batch: float
) -> tuple[float, float]:
    """Unbiased single-step estimates (|G|², tr Σ) from the squared norms of a small- and a big-batch gradient.

    Raises ValueError when the batch sizes cannot tell the two terms apart (B_small ≥ B_big or non-positive).
    """
    if not 0 < small_batch < big_batch:
        raise ValueError(f"need 0 < B_small < B_big, got B_small={small_batch}, B_big={big_batch}")
    grad_sqnorm = (big_batch * big_sqnorm - small_batch * small_sqnorm) / (big_batch - small_batch)
    trace_sigma = (small_sqnorm - big_sqnorm) / (1.0 / small_batch - 1.0 / big_batch)
    return grad_sqnorm, trace_sigma


class NoiseScaleEstimator:
    """Running estimate of the gradient noise scale from heartbeat gradient statistics.

    `ema` is the per-update decay β of both moving averages (0 keeps only the latest record). `kind` picks the
    plain or the Adam-preconditioned squared norms. `min_updates` records are needed before `stable` can be
    true.

    Stability (`stable`): at least `min_updates` records, and the last `stable_window` values of the estimate
    are all defined and lie within a relative spread of `stable_tolerance` (max/min − 1). The spread of
    successive EMA values measures how much one more record still moves the estimate; a slow drift (B_noise
    grows as the loss falls) stays within the tolerance, a young or noise-dominated average does not.
    """

    def __init__(
        self,
        *,
        ema: float,
        kind: NoiseKind,
        min_updates: int,
        stable_window: int = DEFAULT_STABLE_WINDOW,
        stable_tolerance: float = DEFAULT_STABLE_TOLERANCE,
    ) -> None:
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"noise EMA factor must lie in [0, 1), got {ema}")
        if kind not in ("plain", "adam"):
            raise ValueError(f"noise estimator kind must be 'plain' or 'adam', got {kind!r}")
        if min_updates < 1:
            raise ValueError(f"min_updates must be at least 1, got {min_updates}")
        if stable_window < 1:
            raise ValueError(f"stable_window must be at least 1, got {stable_window}")
        if stable_tolerance < 0:
            raise ValueError(f"stable_tolerance must be non-negative, got {stable_tolerance}")
        self.ema = float(ema)
        self.kind: NoiseKind = kind
        self.min_updates = int(min_updates)
        self.stable_window = int(stable_window)
        self.stable_tolerance = float(stable_tolerance)
        self._num_updates = 0
        self._num_skipped = 0
        self._ema_grad_sqnorm = 0.0  # biased EMA of the |G|² estimates
        self._ema_trace_sigma = 0.0  # biased EMA of the tr Σ estimates
        self._recent: deque[float | None] = deque(maxlen=self.stable_window)

    # ------------------------------------------------------------------------------------------ updating

    def _stats(self, hb: Heartbeat) -> tuple[float, float, float, float] | None:
        if self.kind == "adam":
            small, big = hb.adam_local_sqnorm, hb.adam_global_sqnorm
        else:
            small, big = hb.local_sqnorm, hb.global_sqnorm
        b_small, b_big = hb.local_batch, hb.global_batch
        if small is None or big is None or b_small is None or b_big is None:
            return None
        values = (float(small), float(b_small), float(big), float(b_big))
        # A zero squared norm is no gradient measured (Adam's preconditioned norms before the optimizer has state,
        # a skipped step): it scales both averages alike, so folded in it would count towards `min_updates` and the
        # stability window without moving the estimate — one real record would look stable.
        if not all(math.isfinite(v) for v in values) or small <= 0 or big <= 0:
            return None
        if not 0 < b_small < b_big:  # dp = 1 without micro-batch statistics: the two batches coincide
            return None
        return values

    def update(self, hb: Heartbeat) -> None:
        """Fold one heartbeat in; records without usable gradient statistics (none, a zero, negative or non-finite
        squared norm, B_small ≥ B_big, or estimates that overflow) are skipped."""
        stats = self._stats(hb)
        if stats is None:
            self._num_skipped += 1
            return
        small, b_small, big, b_big = stats
        grad_sqnorm, trace_sigma = two_batch_estimates(
            small_sqnorm=small, small_batch=b_small, big_sqnorm=big, big_batch=b_big
        )
        if not (math.isfinite(grad_sqnorm) and math.isfinite(trace_sigma)):
            # Finite norms near the float limit overflow B·|G|²: an inf (or inf − inf = NaN) folded into an average
            # stays there for the rest of the run, and the estimate with it.
            self._num_skipped += 1
            return
        beta = self.ema
        self._ema_grad_sqnorm = beta * self._ema_grad_sqnorm + (1.0 - beta) * grad_sqnorm
        self._ema_trace_sigma = beta * self._ema_trace_sigma + (1.0 - beta) * trace_sigma
        self._num_updates += 1
        self._recent.append(self.value)

    # ------------------------------------------------------------------------------------------ reading

    @property
    def num_updates(self) -> int:
        """Records folded into the averages."""
        return self._num_updates

    @property
    def num_skipped(self) -> int:
        """Records passed to `update` that carried no usable statistics."""
        return self._num_skipped

    def _correction(self) -> float:
        return 1.0 - self.ema**self._num_updates

    @property
    def grad_sqnorm(self) -> float | None:
        """Bias-corrected EMA of |G|² (None before the first record). May be ≤ 0 while noise dominates."""
        if self._num_updates == 0:
            return None
        return self._ema_grad_sqnorm / self._correction()

    @property
    def trace_sigma(self) -> float | None:
        """Bias-corrected EMA of tr Σ, the per-sample gradient variance summed over parameters."""
        if self._num_updates == 0:
            return None
        return self._ema_trace_sigma / self._correction()

    @property
    def value(self) -> float | None:
        """B_noise = tr Σ / |G|² in samples, or None until both averages are positive (and while their ratio is not a
        positive finite number: it can underflow to 0 or overflow)."""
        g2, trace = self.grad_sqnorm, self.trace_sigma
        if g2 is None or trace is None or g2 <= 0 or trace <= 0:
            return None
        result = trace / g2
        return result if 0 < result < math.inf else None

    @property
    def relative_spread(self) -> float | None:
        """max/min − 1 over the last `stable_window` estimates (None if fewer, or any undefined)."""
        if len(self._recent) < self.stable_window or any(v is None for v in self._recent):
            return None
        values = [v for v in self._recent if v is not None]
        return max(values) / min(values) - 1.0

    @property
    def stable(self) -> bool:
        """Enough records, and the last few estimates agree (see the class docstring)."""
        if self._num_updates < self.min_updates:
            return False
        spread = self.relative_spread
        return spread is not None and spread <= self.stable_tolerance

    # ------------------------------------------------------------------------------------------ persistence

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data: the settings and the running state, so an orchestrator restart loses nothing."""
        return {
            "ema": self.ema,
            "kind": self.kind,
            "min_updates": self.min_updates,
            "stable_window": self.stable_window,
            "stable_tolerance": self.stable_tolerance,
            "num_updates": self._num_updates,
            "num_skipped": self._num_skipped,
            "ema_grad_sqnorm": self._ema_grad_sqnorm,
            "ema_trace_sigma": self._ema_trace_sigma,
            "recent": list(self._recent),
            # For people reading state.json; ignored by from_dict.
            "value": self.value,
            "stable": self.stable,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NoiseScaleEstimator:
        """Rebuild an estimator saved by `to_dict`."""
        est = cls(
            ema=float(data["ema"]),
            kind=data["kind"],
            min_updates=int(data["min_updates"]),
            stable_window=int(data.get("stable_window", DEFAULT_STABLE_WINDOW)),
            stable_tolerance=float(data.get("stable_tolerance", DEFAULT_STABLE_TOLERANCE)),
        )
        est._num_skipped = int(data.get("num_skipped", 0))
        sums = (float(data.get("ema_grad_sqnorm", 0.0)), float(data.get("ema_trace_sigma", 0.0)))
        if not all(math.isfinite(v) for v in sums):
            # A NaN or inf average (a state.json edited, or written by a cona that folded such records in) would keep
            # the estimate undefined for good: the averages start over and fill from the next records, while the
            # policy ranks with its last trusted value meanwhile (`ConaPolicy.noise_scale_used`).
            return est
        est._num_updates = int(data.get("num_updates", 0))
        est._ema_grad_sqnorm, est._ema_trace_sigma = sums
        for v in data.get("recent", []):
            # Only what `value` can return: a 0 would divide the stability check by zero, a NaN never compare.
            est._recent.append(float(v) if isinstance(v, int | float) and 0 < v < math.inf else None)
        return est

    def __repr__(self) -> str:
        value = "None" if self.value is None else f"{self.value:.4g}"
        return (
            f"NoiseScaleEstimator(kind={self.kind}, ema={self.ema}, updates={self._num_updates}, "
            f"B_noise={value}, stable={self.stable})"
        )
