"""Online calibration of the analytical cost model by measured step times (docs/architecture.md).

The cost model ranks strategies well but its absolute times are off in a way that depends on the machine, and not
by one factor: a fixed cost per step (Python, kernel launches, collective latencies, the pipeline's per-micro-batch
overhead) is amortised by a larger batch, a per-sample cost is not. A single factor learnt from one strategy
scales both and keeps ranking small batches as it did; the calibration is therefore affine,

    measured(s) ≈ F + k · predicted(s)

per layout (dp, tp, pp), from the strategies of that layout that ran:

1. the strategy itself was measured: its own measured time;
2. its layout was measured at two or more global batches (cheap to visit with the in-place switch) whose predicted
   times differ: F and k by least squares over its measured strategies (F ≥ 0; k at least a tenth of the
   geometric-mean measured/predicted), leaving out a strategy measured during a load spike (below);
3. its layout was measured at one global batch (one strategy, or several micro-batches of that batch: they train
   the same samples per step, so what tells their predicted times apart is the micro-batches' efficiency, not the
   work per sample, and they cannot separate a per-step from a per-sample cost): k from the layouts where it is
   known (their median, on a log scale; the cost model's own 1.0 when none is), and the median excess of the
   measured times over k · their predictions as the fixed cost F. Attributing the unexplained time to the fixed
   cost is the optimistic reading for larger batches: the policy then tries one, and its measurement settles F and
   k (tier 2). Measured times below k · predicted are scaled instead (F = 0, k their median measured/predicted);
4. the layout never ran: the median F and the median k (on a log scale) of the measured layouts (0 and 1 when
   none).

Each measured time is the median of the last `window` observations (unless a load spike covers half of them,
below): heartbeat step times are already window means, but the first windows after a launch (allocation, first
collectives, compilation) and checkpoint or evaluation hiccups produce outliers that a median ignores and a mean
would not. The median also follows a real change in speed once half the window has seen it.

Robust to a load spike. On a shared machine a strategy can be measured while something else runs, 2–3 times
slower for a while; a spike only ever slows a step down. Without care that one strategy moved the calibration of
every other: the least-squares line through its layout's points, and the mean fixed cost and scale that other
layouts borrow. So, changing nothing where the measurements are consistent:
- per strategy, when half or more of its windows are disturbed (the median above `DISTURBED` × the lower quartile),
  its time is the median of the undisturbed ones (`undisturbed_time_s`);
- per layout (tier 2), a strategy measured more than `DISTURBED` times slower than the line through its layout's
  other strategies, which agree with that line, is left out of the fit, one at a time while those others still
  determine the layout and are most of its strategies (two batches cannot tell which one was slowed);
- across strategies and layouts (tiers 3 and 4), medians instead of means, and for scales medians of logarithms:
  ratios combine geometrically (a 2× and a 0.5× scale borrow 1×), and for two values the median is their
  (geometric) mean, so it differs only where there is a third value to outvote an outlier.
A strategy slowed in every window keeps that as its own measured time (tier 1): nothing tells a spike that lasted
all its windows from its speed.

Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

from cona.orchestrator.planner import Candidate
from cona.protocol.strategy import Strategy

DEFAULT_WINDOW = 9
Source = Literal["measured", "layout", "degrees", "calibrated", "none"]
"""Which tier produced an estimate: `measured` (1), `layout` (2: fitted on this layout), `degrees` (3: one
measured point of this layout), `calibrated` (4: other layouts' calibration), `none` (no prediction)."""
DISTINCT = 1.05
"""Global batches whose (mean) predicted times differ by less than this factor are one batch for the affine fit."""
MIN_SCALE_FRACTION = 0.1
"""k is kept at least this fraction of the geometric-mean measured/predicted of the layout's points (a fit whose
time does not grow with the work would make every larger batch free)."""
DISTURBED = 1.5
"""A step time more than this factor above what the strategy's other windows, or its layout's other strategies,
say is taken as measured during a load spike (module docstring): well above window noise (a few percent) and the
affine fit's error within a layout, below the 2–3× of a shared machine's spikes."""


@dataclasses.dataclass(frozen=True)
class Affine:
    """measured ≈ fixed_s + scale · predicted for one layout (or for layouts that never ran)."""

    fixed_s: float
    scale: float
    determined: bool
    """Fitted on at least two distinct predicted times (else a prior filled in what one point cannot say)."""

    def time_s(self, predicted_s: float) -> float:
        return self.fixed_s + self.scale * predicted_s


class Point(NamedTuple):
    """One measured strategy of a layout, as the affine fit sees it."""

    predicted_s: float
    measured_s: float
    gbs: int


def separates_costs(points: list[Point]) -> bool:
    """Whether `points` can tell a fixed cost per step from a per-sample one: two or more global batches whose mean
    predicted times differ by `DISTINCT`. Micro-batches of one global batch cannot (module docstring, tier 3)."""
    by_batch: dict[int, list[float]] = {}
    for point in points:
        by_batch.setdefault(point.gbs, []).append(point.predicted_s)
    means = [sum(p) / len(p) for p in by_batch.values()]
    return len(means) >= 2 and max(means) > DISTINCT * min(means)


def fit_affine(measured: Sequence[tuple[float, float, int]], *, prior_scale: float) -> Affine:
    """The affine calibration of (predicted, measured, gbs) points of one layout (module docstring, tiers 2 and 3)."""
    assert measured, "fit_affine needs at least one point"
    points = [Point(*point) for point in measured]
    if separates_costs(points):
        return _fit_line(_undisturbed_points(points))
    # Medians: one micro-batch variant measured during a spike must not set the fixed cost of the layout.
    fixed = statistics.median(t - prior_scale * p for p, t, _ in points)
    if fixed > 0:
        return Affine(fixed, prior_scale, False)
    return Affine(0.0, _log_median([t / p for p, t, _ in points]), False)


def _fit_line(points: list[Point]) -> Affine:
    """Least squares F + k · predicted through `points`, which separate the costs (F ≥ 0, k at least its floor)."""
    n = len(points)
    mp = sum(p for p, _, _ in points) / n
    mt = sum(t for _, t, _ in points) / n
    sxx = sum((p - mp) ** 2 for p, _, _ in points)
    k = sum((p - mp) * (t - mt) for p, t, _ in points) / sxx
    fixed = mt - k * mp
    if fixed < 0:  # no fixed cost: the least-squares scale through the origin
        fixed, k = 0.0, sum(t * p for p, t, _ in points) / sum(p * p for p, _, _ in points)
    floor = MIN_SCALE_FRACTION * _geometric_mean([t / p for p, t, _ in points])
    if k < floor:
        k = floor
        fixed = max(0.0, sum(t - k * p for p, t, _ in points) / n)
    return Affine(fixed, k, True)


def _undisturbed_points(points: list[Point]) -> list[Point]:
    """`points` less those measured during a load spike (module docstring), one at a time while the rest are most
    of `points` and still separate the costs.

    A point is left out when it is more than `DISTURBED` times slower than the least-squares line through the
    others and those others agree with their line (each within `DISTURBED` of it, either way): least squares lets
    one slowed point bend the line of all, the line of the others is not bent by it. A slowed point at the largest
    or smallest batch bends the line so far that a consistent point at the other end can look slowed against the
    line of the rest too, but then that rest, which holds the slowed point, does not agree with its line: the
    candidate that leaves the most consistent rest (the smallest largest log residual) goes, and of two that
    leave an exact rest (any two points are on their own line) the one further above its line. Measurements
    consistent up to their noise leave nothing out: the fit is then least squares over all of them."""
    kept = list(points)
    while 2 * (len(kept) - 1) > len(points):
        best: tuple[float, float, int] | None = None
        for i, point in enumerate(kept):
            others = kept[:i] + kept[i + 1 :]
            if not separates_costs(others):
                continue
            line = _fit_line(others)
            excess = point.measured_s / line.time_s(point.predicted_s)
            spread = max(abs(math.log(t / line.time_s(p))) for p, t, _ in others)
            if excess > DISTURBED and spread <= math.log(DISTURBED):
                # Rounded: a line through two points is exact only up to rounding, and then the excess decides.
                key = (round(spread, 9), -excess, i)
                best = key if best is None else min(best, key)
        if best is None:
            break
        del kept[best[2]]
    return kept


def _geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _log_median(values: list[float]) -> float:
    """The median of positive ratios on a log scale: robust to one outlying ratio among three or more, and for
    two the geometric mean (a 2× and a 0.5× make 1×, where the plain median would say 1.25×)."""
    return math.exp(statistics.median(math.log(v) for v in values))


def _lower_quartile(ordered: list[float]) -> float:
    """The lower quartile of sorted `ordered`, interpolated between neighbours (`statistics.quantiles`'s
    inclusive method, which needs two values; this takes one)."""
    position = (len(ordered) - 1) / 4
    i = math.floor(position)
    if i + 1 >= len(ordered):
        return ordered[i]
    return ordered[i] + (position - i) * (ordered[i + 1] - ordered[i])


def undisturbed_time_s(times: Sequence[float]) -> float:
    """A strategy's measured step time from its recent windows: their median, unless half or more of them were
    measured during a load spike — the median more than `DISTURBED` times the lower quartile, the time the strategy
    achieves undisturbed — then the median of the undisturbed ones (those within `DISTURBED` of the quartile).

    Where fewer than half the windows are outliers, as after a launch or at a checkpoint, this is the median. A
    lasting change of speed by more than `DISTURBED` is followed later than by the median if a slowdown (once it
    reaches the lower quartile: three quarters of the windows) and sooner if a speed-up (a quarter of them)."""
    ordered = sorted(times)
    median = statistics.median(ordered)
    calm = DISTURBED * _lower_quartile(ordered)
    if median <= calm:
        return median
    return statistics.median(t for t in ordered if t <= calm)


def _key(dp: int, tp: int, pp: int, mbs: int, gbs: int) -> Strategy:
    return Strategy(dp=dp, tp=tp, pp=pp, mbs=mbs, gbs=gbs)


def _candidate_key(candidate: Candidate) -> Strategy:
    return candidate.strategy


def usable_step_time(step_time_s: float | None) -> bool:
    """Whether a measured step time can enter the model: positive and finite. The one rule for heartbeats
    (`observe`), saved models and `cona profile` records (`absorb`, `checked_measurement`): an infinite time (JSON
    reads `Infinity`) would become the median and make a strategy look dead; zero, negative or NaN ones are not
    measurements (a heartbeat before the first step reports 0)."""
    return step_time_s is not None and math.isfinite(step_time_s) and step_time_s > 0


def _number(value: Any) -> bool:
    """A JSON number: not a bool (`true` would read as 1 s), not a string."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def positive_number(value: Any) -> float | None:
    """`value` as a float when it is a positive, finite JSON number, else None: for what is read back from a file
    (a step time or prediction of `cona profile`'s records, a noise scale in state.json), which may be null, a
    bool, a string, NaN, infinite or negative."""
    return float(value) if _number(value) and 0 < value < math.inf else None


def checked_measurement(entry: dict[str, Any]) -> dict[str, Any]:
    """One entry of `ThroughputModel.to_dict()["measured"]` read back from a file (`absorb`'s input), checked: a
    strategy, at least one positive, finite step time, a `count` (when given) of at least that many observations
    and a `predicted_s` (when given) that is a positive, finite time or null; ValueError/KeyError/TypeError naming
    the strategy and the field otherwise. The model divides by `predicted_s` and the policy reads `count`: a bad
    one broke a run at its first save, far from the file it came from."""
    strategy = Strategy.from_dict(entry["strategy"])
    raw = entry["times"]
    if not isinstance(raw, list) or not raw or not all(positive_number(t) is not None for t in raw):
        raise ValueError(f"{strategy.short()}: step times must be positive and finite, got {raw!r}"[:300])
    times = [float(t) for t in raw]
    checked = {**entry, "strategy": strategy.to_dict(), "times": times}
    if "count" in entry:
        count = entry["count"]
        if not (_number(count) and float(count).is_integer() and count >= len(times)):
            raise ValueError(f"{strategy.short()}: count must be an integer of at least its {len(times)} step times "
                             f"(the observations behind them), got {count!r}"[:300])  # fmt: skip
        checked["count"] = int(count)
    predicted = entry.get("predicted_s")
    if predicted is not None:
        if positive_number(predicted) is None:
            raise ValueError(f"{strategy.short()}: predicted_s must be a positive, finite number or null, got "
                             f"{predicted!r}"[:300])  # fmt: skip
        checked["predicted_s"] = float(predicted)
    return checked


def checked_measurements(entries: Any) -> list[dict[str, Any]]:
    """A whole `measured` list read back from a file, each entry `checked_measurement`, and no strategy twice: which
    of two would count is an accident of their order (`absorb` keeps the last), so the file is refused instead."""
    if not isinstance(entries, list):
        raise TypeError(f"`measured` must be a list of measured strategies, got {type(entries).__name__}")
    checked: list[dict[str, Any]] = []
    first: dict[Strategy, int] = {}
    for i, entry in enumerate(entries):
        checked.append(checked_measurement(entry))
        strategy = Strategy.from_dict(checked[-1]["strategy"])
        if strategy in first:
            raise ValueError(f"entries {first[strategy]} and {i} both measure {strategy.short()}; keep one")
        first[strategy] = i
    return checked


class _Measurement:
    """Recent step times of one strategy, and the cost model's prediction for it (when known)."""

    def __init__(self, *, window: int, predicted_s: float | None) -> None:
        self.times: deque[float] = deque(maxlen=window)
        self.count = 0
        self.predicted_s = predicted_s

    @property
    def time_s(self) -> float:
        return undisturbed_time_s(self.times)


class ThroughputModel:
    """Calibrated iteration time and samples/s of every candidate, from the cost model and measured step times."""

    def __init__(self, *, candidates: list[Candidate], window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError(f"throughput window must be at least 1, got {window}")
        self.window = int(window)
        self._measured: dict[Strategy, _Measurement] = {}
        self._predicted: dict[Strategy, float] = {}
        self._cached: tuple[int, Any] | None = None  # (version, calibration()): estimates run per candidate
        self._version = 0
        self.set_candidates(candidates)

    def set_candidates(self, candidates: list[Candidate]) -> None:
        """Replace the candidate list (for example after the device count changed); measurements are kept."""
        self._version += 1
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
        if not usable_step_time(step_time_s):
            return
        key = _key(strategy.dp, strategy.tp, strategy.pp, strategy.mbs, strategy.gbs)
        m = self._measured.get(key)
        if m is None:
            m = self._measured[key] = _Measurement(window=self.window, predicted_s=self._predicted.get(key))
        m.times.append(float(step_time_s))
        m.count += 1
        self._version += 1

    def measured_time_s(self, strategy: Strategy) -> float | None:
        """The measured step time of exactly this strategy, or None if it never ran."""
        m = self._measured.get(strategy)
        return m.time_s if m is not None else None

    def num_observations(self, strategy: Strategy) -> int:
        m = self._measured.get(strategy)
        return m.count if m is not None else 0

    @property
    def calibration_factor(self) -> float:
        """Geometric mean of measured/predicted over measured strategies with a known prediction (1.0 if none):
        how far off the cost model is overall, for reports (the estimates use `calibration`)."""
        logs = [
            math.log(m.time_s / m.predicted_s) for m in self._measured.values() if m.predicted_s is not None
        ]
        return math.exp(sum(logs) / len(logs)) if logs else 1.0

    def model_error(self) -> float:
        """The largest |ln(measured/predicted)| over the measured strategies with a prediction (0 when none): how
        far the uncalibrated cost model has been seen to miss on this machine."""
        errors = [abs(math.log(m.time_s / m.predicted_s)) for m in self._measured.values()
                  if m.predicted_s is not None and m.predicted_s > 0 and m.times]  # fmt: skip
        return max(errors, default=0.0)

    # ------------------------------------------------------------------------------------------ estimating

    def _points(self) -> dict[tuple[int, int, int], list[Point]]:
        """(predicted, measured, gbs) of every measured strategy with a prediction, by layout (dp, tp, pp)."""
        points: dict[tuple[int, int, int], list[Point]] = {}
        for s, m in self._measured.items():
            if m.predicted_s is not None and m.predicted_s > 0:
                points.setdefault(s.layout(), []).append(Point(m.predicted_s, m.time_s, s.gbs))
        return points

    def calibration(self) -> tuple[dict[tuple[int, int, int], Affine], Affine]:
        """The affine calibration of every measured layout, and the one for layouts that never ran."""
        if self._cached is None or self._cached[0] != self._version:
            self._cached = (self._version, self._calibration())
        return self._cached[1]

    def _calibration(self) -> tuple[dict[tuple[int, int, int], Affine], Affine]:
        # A layout fitted on two or more points does not need the prior; the others borrow the fitted ones' scale.
        points = self._points()
        fits = {layout: fit_affine(p, prior_scale=1.0) for layout, p in points.items()}
        if not fits:
            return fits, Affine(0.0, 1.0, False)
        # Medians (module docstring): one layout measured during a load spike must not move the others.
        known = [a.scale for a in fits.values() if a.determined]
        if known:
            prior = _log_median(known)
            fits = {layout: a if a.determined else fit_affine(points[layout], prior_scale=prior)
                    for layout, a in fits.items()}  # fmt: skip
        rest = Affine(statistics.median(a.fixed_s for a in fits.values()),
                      _log_median([a.scale for a in fits.values()]), False)  # fmt: skip
        return fits, rest

    def _calibrate(self, strategy: Strategy, predicted: float | None) -> tuple[float, Source]:
        m = self._measured.get(strategy)
        if m is not None:
            return m.time_s, "measured"
        if predicted is None or not math.isfinite(predicted) or predicted <= 0:
            return math.inf, "none"
        fits, rest = self.calibration()
        fit = fits.get(strategy.layout())
        if fit is None:
            return rest.time_s(predicted), "calibrated"
        return fit.time_s(predicted), "layout" if fit.determined else "degrees"

    def estimate(self, candidate: Candidate) -> tuple[float, Source]:
        """(iteration time in seconds, which tier produced it: `Source`)."""
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
            "calibration": [  # for people reading state.json: measured ≈ fixed_s + scale · predicted per layout
                {"layout": dict(zip(("dp", "tp", "pp"), layout, strict=True)), **dataclasses.asdict(fit)}
                for layout, fit in sorted(self.calibration()[0].items())
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, candidates: list[Candidate]) -> ThroughputModel:
        """Rebuild a model saved by `to_dict` over the (possibly new) candidate list."""
        model = cls(candidates=candidates, window=int(data.get("window", DEFAULT_WINDOW)))
        model.absorb(data.get("measured", []))
        return model

    def absorb(self, measured: list[dict[str, Any]]) -> None:
        """Take in measured strategies as `to_dict` writes them (`measured`): a saved model's, or those of a
        `cona profile` run (`cona run --measured`), which replace what this model measured of the same strategy."""
        for entry in measured:
            strategy = Strategy.from_dict(entry["strategy"])
            times = [float(t) for t in entry.get("times", []) if t is not None and usable_step_time(float(t))]
            if not times:
                continue
            # The record's own prediction only for a strategy this model has none for (not a candidate here), and
            # only a usable one: calibration_factor and model_error divide by it (a state.json edited by hand).
            predicted = entry.get("predicted_s")
            if positive_number(predicted) is None:
                predicted = None
            m = _Measurement(
                window=self.window,
                predicted_s=self._predicted.get(strategy, None if predicted is None else float(predicted)),
            )
            m.times.extend(times)
            # At least the times it holds: the policy counts observations before it trusts a probe's time.
            count = entry.get("count")
            m.count = max(len(times), int(count) if _number(count) and math.isfinite(count) else 0)
            self._measured[strategy] = m
            self._version += 1
