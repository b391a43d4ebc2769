"""Online calibration of the analytical cost model by measured step times (docs/architecture.md).

The cost model ranks strategies well but its absolute times are off by a factor that depends on the machine
(achieved MFU, collective latencies, Python overheads). Measured step times fix that in three tiers, from the
most to the least trustworthy:

1. the strategy itself was measured: its own measured time;
2. a strategy with the same (dp, tp, pp, mbs) was measured at another gbs: its time scaled by the cost model's
   ratio predicted(c)/predicted(measured). Same layout means the same per-micro-batch cost; only the number of
   micro-batches changes, which the model predicts well;
3. otherwise the prediction times a global calibration factor: the geometric mean of measured/predicted over
   every measured strategy (1.0 when none). A geometric mean because the factors are ratios.

Each measured time is the median of the last `window` observations: heartbeat step times are already window
means, but the first windows after a launch (allocation, first collectives, compilation) and checkpoint or
evaluation hiccups produce outliers that a median ignores and a mean would not. The median also follows a real
change in speed once half the window has seen it.

Torch-free.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any, Literal

from cona.orchestrator.planner import Candidate
from cona.protocol.strategy import Strategy

DEFAULT_WINDOW = 9
Source = Literal["measured", "layout", "degrees", "calibrated", "none"]


def _key(dp: int, tp: int, pp: int, mbs: int, gbs: int) -> Strategy:
    return Strategy(dp=dp, tp=tp, pp=pp, mbs=mbs, gbs=gbs)


def _candidate_key(candidate: Candidate) -> Strategy:
    return candidate.strategy


def _layout(s: Strategy) -> tuple[int, int, int, int]:
    return (s.dp, s.tp, s.pp, s.mbs)


class _Measurement:
    """Recent step times of one strategy, and the cost model's prediction for it (when known)."""

    def __init__(self, *, window: int, predicted_s: float | None) -> None:
        self.times: deque[float] = deque(maxlen=window)
        self.count = 0
        self.predicted_s = predicted_s

    @property
    def time_s(self) -> float:
        return statistics.median(self.times)


class ThroughputModel:
    """Calibrated iteration time and samples/s of every candidate, from the cost model and measured step times."""

    def __init__(self, *, candidates: list[Candidate], window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"throughput window must be at least 1, got {window}")
        self.window = int(window)
        self._measured: dict[Strategy, _Measurement] = {}
        self._predicted: dict[Strategy, float] = {}
        self.set_candidates(candidates)

    def set_candidates(self, candidates: list[Candidate]) -> None:
        """Replace the candidate list (for example after the device count changed); measurements are kept."""
        for c in candidates:
            if c.prediction is not None and c.iter_time_s > 0 and math.isfinite(c.iter_time_s):
                self._predicted[_candidate_key(c)] = c.iter_time_s
        for key, m in self._measured.items():
            if m.predicted_s is None:
                m.predicted_s = self._predicted.get(key)

    # ------------------------------------------------------------------------------------------ observing

    def observe(self, strategy: Strategy, step_time_s: float) -> None:
        """Record one measured mean step time of `strategy` (non-positive or non-finite values are ignored).

        Which windows count (for example skipping the first one after a launch) is the caller's choice; the
        median over the last `window` observations absorbs the occasional outlier either way.
        """
        if step_time_s is None or not math.isfinite(step_time_s) or step_time_s <= 0:
            return
        key = _key(strategy.dp, strategy.tp, strategy.pp, strategy.mbs, strategy.gbs)
        m = self._measured.get(key)
        if m is None:
            m = self._measured[key] = _Measurement(window=self.window, predicted_s=self._predicted.get(key))
        m.times.append(float(step_time_s))
        m.count += 1

    def measured_time_s(self, strategy: Strategy) -> float | None:
        """The measured step time of exactly this strategy, or None if it never ran."""
        m = self._measured.get(strategy)
        return m.time_s if m is not None else None

    def num_observations(self, strategy: Strategy) -> int:
        m = self._measured.get(strategy)
        return m.count if m is not None else 0

    @property
    def calibration_factor(self) -> float:
        """Geometric mean of measured/predicted over measured strategies with a known prediction (1.0 if none)."""
        logs = [
            math.log(m.time_s / m.predicted_s) for m in self._measured.values() if m.predicted_s is not None
        ]
        return math.exp(sum(logs) / len(logs)) if logs else 1.0

    # ------------------------------------------------------------------------------------------ estimating

    def _calibrate(self, strategy: Strategy, predicted: float | None) -> tuple[float, Source]:
        m = self._measured.get(strategy)
        if m is not None:
            return m.time_s, "measured"
        if predicted is None or not math.isfinite(predicted) or predicted <= 0:
            return math.inf, "none"
        layout = _layout(strategy)
        same_layout = [
            (s, mm) for s, mm in self._measured.items() if _layout(s) == layout and mm.predicted_s is not None
        ]
        if same_layout:
            # The nearest measured gbs (in ratio) extrapolates best; ties go to the better-measured one, then
            # to the smaller gbs (deterministic).
            _, nearest = min(
                same_layout,
                key=lambda item: (abs(math.log(item[0].gbs / strategy.gbs)), -item[1].count, item[0].gbs),
            )
            assert nearest.predicted_s is not None
            return nearest.time_s * predicted / nearest.predicted_s, "layout"
        degrees = strategy.layout()
        same_degrees = [
            (s, mm) for s, mm in self._measured.items() if s.layout() == degrees and mm.predicted_s is not None
        ]
        if same_degrees:
            # Same process groups, other micro-batch: the measured time carries the layout's communication and
            # overheads, which a global factor would smear across all layouts.
            _, nearest = min(
                same_degrees,
                key=lambda item: (
                    abs(math.log(item[0].mbs / strategy.mbs)) + abs(math.log(item[0].gbs / strategy.gbs)),
                    -item[1].count, item[0].mbs, item[0].gbs,
                ),
            )  # fmt: skip
            assert nearest.predicted_s is not None
            return nearest.time_s * predicted / nearest.predicted_s, "degrees"
        return predicted * self.calibration_factor, "calibrated"

    def estimate(self, candidate: Candidate) -> tuple[float, Source]:
        """(iteration time in seconds, which tier produced it): `measured`, `layout`, `calibrated` or `none`."""
        if candidate.prediction is None:  # rejected before the cost model ran (its fields may not even agree)
            return math.inf, "none"
        return self._calibrate(_candidate_key(candidate), candidate.iter_time_s)

    def iter_time_s(self, candidate: Candidate) -> float:
        """Calibrated seconds per optimizer step of `candidate` (inf when it has no prediction)."""
        return self.estimate(candidate)[0]

    def samples_per_s(self, candidate: Candidate) -> float:
        """Calibrated training throughput X(c) = gbs / iteration time (0 when unknown)."""
        t = self.iter_time_s(candidate)
        return candidate.gbs / t if 0 < t < math.inf else 0.0

    def samples_per_s_of(self, strategy: Strategy) -> float | None:
        """Throughput of a strategy given as a `Strategy`: measured if it ran, else calibrated from the cost
        model when it is one of the candidates, else None."""
        t, _ = self._calibrate(strategy, self._predicted.get(strategy))
        return strategy.gbs / t if 0 < t < math.inf else None

    # ------------------------------------------------------------------------------------------ persistence

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data: every measured strategy with its recent times, count and prediction."""
        return {
            "window": self.window,
            "measured": [
                {
                    "strategy": s.to_dict(),
                    "times": list(m.times),
                    "count": m.count,
                    "predicted_s": m.predicted_s,
                    "time_s": m.time_s,  # for people reading state.json
                }
                for s, m in sorted(self._measured.items())
            ],
            "calibration_factor": self.calibration_factor,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, candidates: list[Candidate]) -> ThroughputModel:
        """Rebuild a model saved by `to_dict` over the (possibly new) candidate list."""
        model = cls(candidates=candidates, window=int(data.get("window", DEFAULT_WINDOW)))
        for entry in data.get("measured", []):
            strategy = Strategy.from_dict(entry["strategy"])
            times = [float(t) for t in entry.get("times", []) if t and float(t) > 0]
            if not times:
                continue
            predicted = entry.get("predicted_s")
            m = _Measurement(
                window=model.window,
                predicted_s=model._predicted.get(strategy, None if predicted is None else float(predicted)),
            )
            m.times.extend(times)
            m.count = int(entry.get("count", len(times)))
            model._measured[strategy] = m
        return model
