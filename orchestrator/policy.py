"""Policies: which strategy to start with, and when to switch to which (docs/architecture.md).

Every policy answers two questions through one interface, so the scheduler loop does not care which one runs:
`initial` (the first strategy) and `decide` (called every `policy.decision_interval_s` with a `DecisionContext`;
returns a `Decision`, switching or not, with a one-line reason and the numbers behind it for events.jsonl).

- `cona` ranks every feasible candidate by progress per second R(c) = X(c)/(gbs(c) + B_noise) and switches when
  a candidate is clearly better, net of the switch cost (the switch rule below).
- `static` is what an offline searcher picks: the fastest predicted iteration at `batch.base_gbs`; never switches.
- `fixed` keeps `policy.strategy`; never switches.
- `schedule` replays `policy.schedule`: (samples, strategy) pairs, e.g. an oracle sequence found offline.

Torch-free.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from typing import Any

from cona.orchestrator.job import Job, PolicySpec
from cona.orchestrator.planner import Candidate, static_choice, strategy_reason
from cona.orchestrator.profile import ClusterProfile
from cona.orchestrator.throughput import ThroughputModel, positive_number
from cona.protocol.lr import lr_scale_factor
from cona.protocol.strategy import Strategy

DEFAULT_BLEND_EVALUATIONS = 3
"""Evaluations with a stable estimate over which cona moves B_noise from the prior to the estimate."""
GROWTH_HISTORY = 64
"""Trusted estimates (one per evaluation) the growth of B_noise is fitted on."""
GROWTH_MIN_POINTS = 6
"""Trusted estimates needed before a growth is fitted."""
PROBE_MARGIN = 0.6
"""A layout that never ran is probed only if the cost model puts it within this factor of the current strategy's R:
about two RMS log errors of the cost model on a machine it was not fitted to (0.27–0.29 on the 2-core CPU profile,
docs/decisions.md), so a layout the model ranks lower than it is can still be found."""
PROBE_BUDGET = 0.03
"""A probe (a switch there and, if it is slower, one back) may cost at most this fraction of the horizon: an
insurance premium against a wrong cost model, paid only where switches are cheap (in place)."""
PROBE_TRUSTED_ERROR = 0.05
"""While every measured step time is within this relative error of the cost model, the model has earned trust on
this machine and nothing is probed (a simulated cluster whose times are the model's never probes)."""
PROBE_OBSERVATIONS = 3
"""Heartbeats measured on a probed strategy before the rule judges it."""
MAX_HORIZON_GROWTH = 2.0
"""Largest factor by which the expected B_noise over the horizon may exceed today's: an extrapolation, kept short."""
MAX_NOISE_SCALE = 1e15
"""Largest B_noise cona ranks with, in samples: far above any batch a run trains, so it changes no ranking, but an
estimate near the float limit times `critical_batch_factor` (or the horizon's growth) would overflow to inf, and R
is undefined there (`progress_rate` refuses it)."""


@dataclasses.dataclass
class DecisionContext:
    """What the scheduler knows at one evaluation."""

    now: float
    """time.time() of the evaluation."""
    samples: int
    """Samples consumed so far (the data position)."""
    current: Strategy
    """The strategy running now."""
    candidates: list[Candidate]
    """Candidates for the devices present (infeasible ones are ignored)."""
    throughput: ThroughputModel
    noise_scale: float | None
    """The estimator's B_noise, None while undefined (then the prior is used)."""
    noise_stable: bool
    """Whether the estimator considers its value settled (see `cona.orchestrator.noise`)."""
    switch_cost_s: Callable[[Strategy], float]
    """Seconds a switch from `current` to the given strategy costs: measured for its kind (in place, relaunch,
    resubmission), else predicted (`cona.orchestrator.switchcost`)."""
    last_switch_time: float
    """When the current strategy started (time.time())."""
    remaining_time_s: float | None
    """The scheduler's estimate of the time to the target; None when unknown."""


@dataclasses.dataclass
class Decision:
    """The outcome of one evaluation."""

    switch_to: Strategy | None
    """The strategy to switch to, or None to stay."""
    reason: str
    """One line, with the numbers that decided it."""
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Plain JSON values: R(current), R(best), best strategy, ratio, threshold, horizon, B_noise used, wins, ..."""


MIN_LR_EFFICIENCY = 0.05
"""Floor of `LrRule.efficiency`: the quadratic model predicts no progress at twice the best LR; keep R ranked."""


@dataclasses.dataclass(frozen=True)
class LrRule:
    """The job's learning-rate scaling rule, as `policy.lr_aware` ranks with it (see `efficiency`)."""

    base_gbs: int
    """The global batch at which `optimizer.lr` is tuned (`batch.base_gbs`)."""
    rule: str
    """`optimizer.lr_scaling`: none, linear or sqrt."""
    cap: float
    """`optimizer.lr_scaling_cap`."""

    @classmethod
    def of(cls, job: Job) -> LrRule:
        return cls(base_gbs=job.batch.base_gbs, rule=job.optimizer.lr_scaling, cap=job.optimizer.lr_scaling_cap)

    def efficiency(self, gbs: int, noise_scale: float) -> float:
        """Progress per step at the LR this rule gives `gbs`, relative to the best LR for `gbs`, in (0, 1].

        In the quadratic model behind B_noise (McCandlish et al. 2018) the best LR at batch B is
        ε_max/(1 + B_noise/B) and a step at r times the best LR makes 2r − r² of the best step's progress. With
        `optimizer.lr` taken as the best LR at `base_gbs`, the rule's LR at B is r = f(B)·(1 + B_noise/B)/
        (1 + B_noise/base_gbs) times the best, f the rule's scale factor: a sqrt rule capped at 2× under-steps
        batches far above base_gbs once B_noise is large, and over-steps batches below it.
        """
        factor = lr_scale_factor(gbs=gbs, base_gbs=self.base_gbs, rule=self.rule, cap=self.cap)
        r = factor * (1.0 + noise_scale / gbs) / (1.0 + noise_scale / self.base_gbs)
        return max(MIN_LR_EFFICIENCY, 2.0 * r - r * r)


def progress_rate(
    candidate: Candidate, throughput: ThroughputModel, noise_scale: float, *, lr_rule: LrRule | None = None
) -> float:
    """R(c) = X(c) / (gbs(c) + B_noise): the surrogate of optimisation progress per second.

    With B_noise the gradient noise scale, a step of batch B makes 1/(1 + B_noise/B) of the progress of a
    noise-free step (McCandlish et al. 2018), so progress per second is X/B · B/(B + B_noise) = X/(B + B_noise)
    with X the calibrated throughput in samples/s. It ranks exactly as Pollux's goodput.

    That assumes each batch size is trained with its best learning rate. With `lr_rule` (`policy.lr_aware`), R is
    multiplied by how close the job's LR scaling rule comes to that (`LrRule.efficiency`).
    """
    if noise_scale < 0 or not math.isfinite(noise_scale):
        raise ValueError(f"noise scale must be finite and non-negative, got {noise_scale}")
    rate = throughput.samples_per_s(candidate) / (candidate.gbs + noise_scale)
    if lr_rule is not None:
        rate *= lr_rule.efficiency(candidate.gbs, noise_scale)
    return rate


def prior_noise_scale(spec: PolicySpec, *, base_gbs: int) -> float:
    """The B_noise cona ranks with before it has measured one: `policy.prior_noise_scale`, or, unset, the base
    batch taken as the estimator's value and ranked through `critical_batch_factor` like every estimate (a batch
    the user tuned the LR at is guessed to sit at the measured noise scale, not at the critical batch)."""
    if spec.prior_noise_scale is not None:
        return float(spec.prior_noise_scale)
    return float(spec.critical_batch_factor * base_gbs)


def _same(candidate: Candidate, strategy: Strategy) -> bool:
    return (candidate.dp, candidate.tp, candidate.pp, candidate.mbs, candidate.gbs) == (
        strategy.dp,
        strategy.tp,
        strategy.pp,
        strategy.mbs,
        strategy.gbs,
    )


def find_candidate(candidates: list[Candidate], strategy: Strategy) -> Candidate | None:
    """The feasible candidate with exactly these degrees and batch sizes, if any."""
    for c in candidates:
        if c.feasible and _same(c, strategy):
            return c
    return None


def _devices(candidates: list[Candidate], profile: ClusterProfile) -> int:
    return candidates[0].dp * candidates[0].tp * candidates[0].pp if candidates else profile.num_gpus


def strategy_problem(
    strategy: Strategy, *, job: Job, profile: ClusterProfile, candidates: list[Candidate]
) -> str:
    """Why `strategy` cannot run, or '' if it is one of the candidates or the planner would run it (its own words:
    `planner.strategy_reason`)."""
    if find_candidate(candidates, strategy) is not None:
        return ""
    return strategy_reason(strategy, profile=profile, job=job)


def _validated(
    text: str, *, what: str, job: Job, profile: ClusterProfile, candidates: list[Candidate]
) -> Strategy:
    try:
        strategy = Strategy.parse(text)
    except ValueError as e:
        message = str(e)
        if (
            message.startswith("strategy ") and ": " in message
        ):  # drop Strategy's own "strategy <text>: " prefix
            message = message.split(": ", 1)[1]
        raise ValueError(f"{what} {text!r}: {message}") from None
    problem = strategy_problem(strategy, job=job, profile=profile, candidates=candidates)
    if problem:
        raise ValueError(f"{what} {strategy}: {problem}")
    return strategy


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "n/a"
    if not math.isfinite(x):
        return "inf"
    return f"{x:.{digits}g}"


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class Policy(abc.ABC):
    """The interface the scheduler uses."""

    name: str = ""

    @abc.abstractmethod
    def initial(self, *, candidates: list[Candidate], throughput: ThroughputModel, samples: int) -> Strategy:
        """The strategy to start (or restart from scratch) with."""

    @abc.abstractmethod
    def decide(self, ctx: DecisionContext) -> Decision:
        """Switch or stay, with the reason."""

    def start(self, *, candidates: list[Candidate], throughput: ThroughputModel) -> tuple[Strategy, str]:
        """`initial` at sample 0 and why it picks that, in a few words for the launch line ('' when the policy's name
        says it all), from one ranking."""
        return self.initial(candidates=candidates, throughput=throughput, samples=0), ""

    def switch_points(self) -> list[int]:
        """Sample counts at which this policy switches whatever it measures (a fixed schedule): the trainer holds
        there for the decision, so the switch lands at the same step in every run. None for measuring policies."""
        return []

    def strategy_at(self, samples: int) -> Strategy | None:
        """The strategy this policy prescribes for training from `samples` on, when it depends on nothing else (a
        fixed schedule); None when the policy decides from measurements."""
        return None

    def to_dict(self) -> dict[str, Any]:
        """The policy's running state as plain JSON data (settings come from the job, not from here)."""
        return {"name": self.name}

    def from_dict(self, data: dict[str, Any]) -> Policy:
        """Restore the state saved by `to_dict` into this policy (built from the same job); returns self."""
        if data.get("name", self.name) != self.name:
            raise ValueError(f"saved policy state is for {data.get('name')!r}, not {self.name!r}")
        return self


# ---------------------------------------------------------------------------------------------------- cona


class ConaPolicy(Policy):
    """Online strategy chaining: rank by R(c), switch when the gain clearly pays for the switch.

    Switch rule: from the current c to c* only if

    - R(c*)/R(c) ≥ (1 + δ)·H/(H − C_sw(c*)), with H = min(remaining time, horizon_intervals·decision_interval_s)
      and C_sw(c*) the cost of switching to c* (an in-place switch costs less than a relaunch): over the horizon,
      c* must make δ more progress than c even though it trains only H − C_sw of the H seconds. No switch to c*
      when H ≤ C_sw(c*) (the switch could never pay back);
    - c* has cleared that threshold in `persistence` consecutive evaluations ("wins"). Any candidate whose R is
      within a factor (1 + δ) of the best counts as an equivalent winner, so two near-identical candidates that
      alternate at the top do not reset each other's streaks; among equivalent candidates with enough wins the
      one with the highest R now is chosen;
    - at least `min_dwell_s` has passed since the last switch (wins keep counting while dwelling).

    The batch before the noise scale is measured: with `start_batch` set (the default: `policy.prior_noise_scale`
    unset, so the base batch through the critical-batch factor stands in for it), cona starts at that batch, on its
    fastest layout as an offline searcher would, unless another batch's R under the prior beats it by δ (where the
    throughput grows steeply with the batch: more devices than the base batch can feed); it then changes only the
    layout until the estimate is in — while B_noise is the prior or a blend of it with the first estimates: the
    prior is a guess, the first estimates are the smallest of the run (the noise scale grows as the loss falls,
    and the growth over the horizon is fitted only on trusted estimates), and a batch chosen on either (one that a
    switch would then have to undo a few evaluations later) costs more than the few evaluations until the
    estimate is in. With an explicit prior it ranks every batch under it, and the blend, from the start.

    B_noise: the prior `prior_noise_scale` until the estimate is stable; then a geometric blend that moves from
    the prior to the estimate over `blend_evaluations` evaluations with a stable estimate (1 = jump at once).
    The weight never moves back: once trusted, even a momentarily unsettled EMA estimate is closer to the truth
    than a guess made before training, and falling back to the prior late in training would pull towards small
    batches. The blend avoids a step in R the moment the estimator first reports stable. With `noise_monotone`,
    B_noise never falls below the largest trusted value so far (the noise scale grows as the loss falls; a dip is
    noise); with `noise_growth`, it is then extrapolated over the horizon (`expected_noise_scale`).
    """

    name = "cona"

    def __init__(
        self,
        *,
        prior_noise_scale: float,
        min_gain: float,
        persistence: int,
        min_dwell_s: float,
        decision_interval_s: float,
        horizon_intervals: float,
        blend_evaluations: int = DEFAULT_BLEND_EVALUATIONS,
        critical_batch_factor: float = 1.0,
        lr_rule: LrRule | None = None,
        noise_growth: bool = False,
        noise_monotone: bool = False,
        probe_layouts: int = 0,
        start_batch: int | None = None,
    ) -> None:
        if prior_noise_scale <= 0:
            raise ValueError(f"prior_noise_scale must be positive, got {prior_noise_scale}")
        if persistence < 1:
            raise ValueError(f"persistence must be at least 1, got {persistence}")
        if blend_evaluations < 1:
            raise ValueError(f"blend_evaluations must be at least 1, got {blend_evaluations}")
        self.prior_noise_scale = float(prior_noise_scale)
        self.min_gain = float(min_gain)
        self.persistence = int(persistence)
        self.min_dwell_s = float(min_dwell_s)
        self.decision_interval_s = float(decision_interval_s)
        self.horizon_intervals = float(horizon_intervals)
        self.blend_evaluations = int(blend_evaluations)
        self.critical_batch_factor = float(critical_batch_factor)
        self.lr_rule = lr_rule
        self.noise_growth = bool(noise_growth)
        self.noise_monotone = bool(noise_monotone)
        self._peak = 0.0  # the largest trusted B_noise used so far (`noise_monotone`)
        self.probe_layouts = int(probe_layouts)
        self.start_batch = start_batch
        self._probes_used = 0
        self._probing: Strategy | None = None  # the strategy being probed, until it has been measured
        self._waive = False  # a probe was just measured: the next evaluation may leave it at once
        self._history: list[tuple[int, float]] = []  # (samples, B_noise used) while the estimate is trusted
        self._last_estimate: float | None = None  # the estimator's latest defined value once it counts (weight > 0)
        self._wins: dict[Strategy, int] = {}
        self._noise_weight = 0.0
        self._last_current: Strategy | None = None
        self._evaluations = 0
        self._switches = 0

    @classmethod
    def from_spec(
        cls, spec: PolicySpec, *, base_gbs: int, lr_rule: LrRule | None = None,
        blend_evaluations: int = DEFAULT_BLEND_EVALUATIONS,
    ) -> ConaPolicy:
        """The policy `spec` describes; an unset prior is `base_gbs` through the critical-batch factor, and cona
        starts at `base_gbs` unless another batch is ahead by δ under it, and holds the batch it starts at until
        the noise scale is measured; `lr_rule` is used only with `spec.lr_aware`."""
        return cls(
            prior_noise_scale=prior_noise_scale(spec, base_gbs=base_gbs), min_gain=spec.min_gain, persistence=spec.persistence,
            min_dwell_s=spec.min_dwell_s, decision_interval_s=spec.decision_interval_s,
            horizon_intervals=spec.horizon_intervals, blend_evaluations=blend_evaluations,
            critical_batch_factor=spec.critical_batch_factor, lr_rule=lr_rule if spec.lr_aware else None,
            noise_growth=spec.noise_growth, noise_monotone=spec.noise_monotone, probe_layouts=spec.probe_layouts,
            start_batch=base_gbs if spec.prior_noise_scale is None else None,
        )  # fmt: skip

    # ------------------------------------------------------------------------------------------ helpers

    @property
    def noise_weight(self) -> float:
        """How much of the estimate (vs the prior) enters B_noise, in [0, 1]."""
        return self._noise_weight

    @property
    def holds_batch(self) -> bool:
        """Whether only layouts at the running batch compete now: with `start_batch`, until the estimate is fully
        in (the prior, then its blend with the estimate; see the class docstring)."""
        return self.start_batch is not None and self._noise_weight < 1

    def noise_scale_used(self, estimate: float | None) -> float:
        """B_noise for ranking: the prior, the estimate, or their geometric blend at the current weight; at most
        `MAX_NOISE_SCALE`.

        An undefined estimate (None, or not a positive finite number) once the estimate counts is replaced by its last
        defined value, not by the prior: the estimator's value is undefined when the |G|² average is ≤ 0, that is when
        noise dominates the gradient, and the prior — a guess made before training — would pull to small batches
        exactly then (the weight never moves back, see the class docstring)."""
        if positive_number(estimate) is None:
            estimate = self._last_estimate
        if estimate is None or self._noise_weight <= 0:
            return min(MAX_NOISE_SCALE, self.prior_noise_scale)
        estimate *= self.critical_batch_factor
        w = self._noise_weight
        if w < 1:
            estimate = math.exp((1 - w) * math.log(self.prior_noise_scale) + w * math.log(estimate))
        return min(MAX_NOISE_SCALE, estimate)

    def horizon_s(self, remaining_time_s: float | None) -> float:
        """H: the remaining time, capped at `horizon_intervals` decision intervals."""
        cap = self.horizon_intervals * self.decision_interval_s
        return cap if remaining_time_s is None else max(0.0, min(cap, remaining_time_s))

    def growth_per_sample(self) -> float:
        """d ln B_noise / d samples, least squares over the trusted estimates of past evaluations; 0 when it shrinks
        or there are too few (the noise scale grows as the loss falls: McCandlish et al. 2018, section 3)."""
        points = self._history[-GROWTH_HISTORY:]
        if len(points) < GROWTH_MIN_POINTS:
            return 0.0
        xs = [float(p[0]) for p in points]
        ys = [math.log(p[1]) for p in points]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if var <= 0:
            return 0.0
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
        return max(0.0, slope)

    def expected_noise_scale(self, noise: float, *, advance_samples: float) -> float:
        """B_noise expected halfway through the next `advance_samples` samples (the horizon's mean, to first order),
        from the fitted growth; at most `MAX_HORIZON_GROWTH` × today's."""
        growth = math.exp(min(math.log(MAX_HORIZON_GROWTH), self.growth_per_sample() * max(0.0, advance_samples) / 2))
        return min(MAX_NOISE_SCALE, noise * growth)

    def threshold(self, *, horizon_s: float, switch_cost_s: float) -> float | None:
        """(1 + δ)·H/(H − C_sw), or None when H ≤ C_sw (no switch can pay back)."""
        if horizon_s <= switch_cost_s:
            return None
        return (1 + self.min_gain) * horizon_s / (horizon_s - switch_cost_s)

    def _ranked(
        self, candidates: list[Candidate], throughput: ThroughputModel, noise_scale: float, current: Strategy | None
    ) -> list[tuple[float, Candidate]]:
        rated = [
            (progress_rate(c, throughput, noise_scale, lr_rule=self.lr_rule), c) for c in candidates if c.feasible
        ]
        # A layout that measures no noise scale (one replica, the whole batch as one micro-batch: on one device,
        # m8 g8) would leave the run on the prior for good, its batch never changed: ranked only when nothing else
        # runs here.
        seeing = [rc for rc in rated if rc[1].strategy.measures_noise]
        if seeing:
            rated = seeing
        # Highest R first; ties prefer the current strategy (no pointless switch), then simpler layouts.
        rated.sort(
            key=lambda rc: (
                -rc[0], not (current is not None and _same(rc[1], current)),
                rc[1].pp, rc[1].tp, rc[1].mbs, rc[1].gbs, rc[1].dp,
            )
        )  # fmt: skip
        return rated

    # ------------------------------------------------------------------------------------------ policy

    def initial(self, *, candidates: list[Candidate], throughput: ThroughputModel, samples: int) -> Strategy:
        """The best R under the prior noise scale; with `start_batch` set, the fastest layout at that batch (the
        best R there) unless another batch's R under the prior is ahead of it by the switch margin δ: leaving the
        user's batch on a guess needs the gain any switch needs, and where the throughput grows steeply with the
        batch (more devices than a small batch can feed) it is there before a single estimate."""
        return self.start(candidates=candidates, throughput=throughput)[0]

    def start(self, *, candidates: list[Candidate], throughput: ThroughputModel) -> tuple[Strategy, str]:
        """`initial`'s choice and why (the one place that decides it)."""
        ranked = self._ranked(candidates, throughput, self.prior_noise_scale, None)
        if not ranked:
            raise ValueError("no feasible candidate to start with")
        r_best, best = ranked[0]
        b = self.prior_noise_scale
        prior = f"the prior B_noise={b:.0f}" if b >= 10 else f"the prior B_noise={b:.3g}"
        at_start = [(r, c) for r, c in ranked if c.gbs == self.start_batch]
        if not at_start:
            return best.strategy, f"best R under {prior}"
        r_base, base = at_start[0]
        if r_best < (1 + self.min_gain) * r_base:
            return base.strategy, f"the base batch g{base.gbs}'s fastest layout ({prior})"
        return best.strategy, (f"R {r_best / r_base:.3f}× the base batch g{base.gbs}'s under {prior}, above the "
                               f"margin {1 + self.min_gain:.3g}×")  # fmt: skip

    def best(self, candidates: list[Candidate], throughput: ThroughputModel, noise_scale: float) -> Strategy | None:
        """The candidate of highest R under `noise_scale`, or None (an elastic run's replan for another world)."""
        ranked = self._ranked(candidates, throughput, noise_scale, None)
        return ranked[0][1].strategy if ranked else None

    def decide(self, ctx: DecisionContext) -> Decision:
        if self._probing is not None:
            if ctx.current != self._probing:
                self._probing = None  # switched away by other means (a restart, a request)
            elif ctx.throughput.num_observations(ctx.current) < PROBE_OBSERVATIONS:
                self._evaluations += 1
                n = ctx.throughput.num_observations(ctx.current)
                return Decision(None, f"stay on {ctx.current.short()}: probing its layout ({n}/{PROBE_OBSERVATIONS} "
                                      "measurements)", {"probe": True, "current": ctx.current.to_dict()})  # fmt: skip
            else:
                self._probing, self._waive = None, True
        decision = self._decide(ctx)
        self._waive = False
        if decision.switch_to is None:
            probe = self._probe(ctx, decision)
            if probe is not None:
                return probe
        return decision

    def _probe(self, ctx: DecisionContext, decision: Decision) -> Decision | None:
        """Try a layout that never ran, when the cost model might be wrong about it and finding out is cheap.

        The calibration can only correct what it has measured: a layout the cost model ranks below the current one
        is never run, so its error is never seen. Probing starts only once the model has been seen to miss on this
        machine (a measured step time off by more than `PROBE_TRUSTED_ERROR`). A probe runs the best candidate of an
        unmeasured layout at the current batch for `PROBE_OBSERVATIONS` heartbeats; then the rule decides as usual,
        without dwell or persistence for that one evaluation (staying if the probe was faster, going back or on if
        not).
        """
        if self._probes_used >= self.probe_layouts or ctx.now - ctx.last_switch_time < self.min_dwell_s:
            return None
        if ctx.throughput.model_error() <= math.log1p(PROBE_TRUSTED_ERROR):
            return None
        current = find_candidate(ctx.candidates, ctx.current)
        noise = decision.metrics.get("B_noise")
        if current is None or noise is None:
            return None
        r_cur = progress_rate(current, ctx.throughput, noise, lr_rule=self.lr_rule)
        horizon = self.horizon_s(ctx.remaining_time_s)
        unmeasured = [(progress_rate(c, ctx.throughput, noise, lr_rule=self.lr_rule), c) for c in ctx.candidates
                      if c.feasible and c.gbs == current.gbs and ctx.throughput.estimate(c)[1] == "calibrated"]  # fmt: skip
        if not unmeasured or r_cur <= 0:
            return None
        r, best = max(unmeasured, key=lambda rc: rc[0])
        cost = ctx.switch_cost_s(best.strategy)
        # H = 0 (the target or the samples budget reached) leaves nothing to gain, even from a free switch (0 > 0).
        if r < PROBE_MARGIN * r_cur or horizon <= 0 or 2 * cost > PROBE_BUDGET * horizon:
            return None
        self._probes_used += 1
        self._probing = best.strategy
        self._wins = {}
        self._switches += 1
        metrics = {**decision.metrics, "probe": True, "R_probe": r, "R_current": r_cur, "switch_cost_s": cost}
        return Decision(
            best.strategy,
            f"probe {ctx.current.short()} → {best.strategy.short()}: its layout never ran and the cost model puts it "
            f"at {_fmt(r / r_cur, 3)}× current R (probed above {PROBE_MARGIN}×); two switches of {_fmt(cost)}s are "
            f"within {PROBE_BUDGET:.0%} of H={_fmt(horizon)}s (probe {self._probes_used}/{self.probe_layouts})",
            metrics,
        )

    def _decide(self, ctx: DecisionContext) -> Decision:
        self._evaluations += 1
        # A switch happened (or this is the first evaluation): wins are counted against the current strategy.
        if ctx.current != self._last_current:
            self._wins = {}
            self._last_current = ctx.current
        estimate = positive_number(ctx.noise_scale)
        if estimate is not None and ctx.noise_stable:
            self._noise_weight = min(1.0, self._noise_weight + 1.0 / self.blend_evaluations)
        if estimate is not None and self._noise_weight > 0:
            self._last_estimate = estimate
        # Undefined now but counted before: ranked with the last defined estimate (`noise_scale_used`).
        held = estimate is None and self._noise_weight > 0 and self._last_estimate is not None
        noise = self.noise_scale_used(estimate)
        if self._noise_weight <= 0 or (estimate is None and not held):
            source = "prior"
        else:
            source = "estimate" if self._noise_weight >= 1 else "blend"

        if source == "estimate":
            if not held:  # a held value is no new measurement: it would flatten the fitted growth
                self._history.append((int(ctx.samples), noise))
                del self._history[:-GROWTH_HISTORY]
            if self.noise_monotone:  # a dip below an earlier trusted estimate is noise: B_noise grows in training
                self._peak = max(self._peak, noise)
                noise = self._peak
        noise_now = noise
        current_candidate = find_candidate(ctx.candidates, ctx.current)
        if self.noise_growth and current_candidate is not None:
            # Rank with the noise scale expected over the horizon, not today's: it grows as the loss falls, so a
            # batch that is right today is too small for most of the horizon. The samples the horizon covers are
            # those of the strategy running now.
            advance = ctx.throughput.samples_per_s(current_candidate) * self.horizon_s(ctx.remaining_time_s)
            noise = self.expected_noise_scale(noise, advance_samples=advance)
        candidates = ctx.candidates
        hold = self.holds_batch
        if hold:  # no batch change on a guess or a half-trusted estimate: only layouts at the running batch compete
            candidates = [c for c in candidates if c.gbs == ctx.current.gbs] or candidates
        ranked = self._ranked(candidates, ctx.throughput, noise, ctx.current)
        if not ranked:
            return Decision(None, "no feasible candidate: staying", {"B_noise": noise})
        r_best, best = ranked[0]
        rate = {c: r for r, c in ranked}
        metrics: dict[str, Any] = {
            "B_noise": noise,
            "B_noise_now": noise_now,
            "B_noise_peak": self._peak if self.noise_monotone else None,
            "B_noise_growth_per_sample": self.growth_per_sample(),
            "B_noise_estimate": estimate,
            "noise_stable": bool(ctx.noise_stable),
            "noise_source": source,
            "noise_weight": self._noise_weight,
            "batch_held": hold,
            "current": ctx.current.to_dict(),
            "best": best.strategy.to_dict(),
            "R_best": r_best,
            "X_best": ctx.throughput.samples_per_s(best),
            "persistence": self.persistence,
            "dwell_s": ctx.now - ctx.last_switch_time,
            "min_dwell_s": self.min_dwell_s,
        }
        noise_text = (f"B_noise={_fmt(noise)} ({source}{'; the last defined estimate' if held else ''}"
                      f"{'; batch held until it is measured' if hold else ''})")  # fmt: skip

        current = current_candidate
        horizon = self.horizon_s(ctx.remaining_time_s)
        if current is None:
            # The running strategy is not among the feasible candidates (the devices changed, or it was started
            # by hand): no comparison is possible, and staying on it is not an option the planner endorses — unless
            # the run ends before the switch could be done (H ≤ C_sw): then it only costs time.
            self._wins = {}
            cost = ctx.switch_cost_s(best.strategy)
            metrics.update(R_current=None, ratio=None, threshold=None, wins=0, H_s=horizon, switch_cost_s=cost)
            if self.threshold(horizon_s=horizon, switch_cost_s=cost) is None:
                return Decision(
                    None,
                    f"stay on {ctx.current.short()}: it is not a feasible candidate here, but horizon "
                    f"H={_fmt(horizon)}s ≤ switch cost {_fmt(cost)}s to {best.strategy.short()}; {noise_text}",
                    metrics,
                )
            self._switches += 1
            return Decision(
                best.strategy,
                f"switch {ctx.current.short()} → {best.strategy.short()}: the current strategy is not a feasible "
                f"candidate here; best R={_fmt(r_best)} at {noise_text}",
                metrics,
            )

        r_cur = rate[current]
        costs: dict[Strategy, float] = {}

        def cost_of(s: Strategy) -> float:
            if s not in costs:
                costs[s] = ctx.switch_cost_s(s)
            return costs[s]

        def threshold_of(s: Strategy) -> float | None:
            return self.threshold(horizon_s=horizon, switch_cost_s=cost_of(s))

        threshold = threshold_of(best.strategy)
        ratio = r_best / r_cur if r_cur > 0 else math.inf
        metrics.update(
            R_current=r_cur, X_current=ctx.throughput.samples_per_s(current), ratio=_finite(ratio),
            threshold=threshold, H_s=horizon, switch_cost_s=cost_of(best.strategy),
        )  # fmt: skip

        # Count wins: every candidate equivalent to the best that clears its own threshold now (its switch cost
        # decides it: an in-place switch pays back sooner than a relaunch).
        wins: dict[Strategy, int] = {}
        if r_cur > 0:
            for r, c in ranked:
                if r * (1 + self.min_gain) < r_best:
                    break  # ranked by R: nothing further down is equivalent to the best either
                s = c.strategy
                t = threshold_of(s) if s != ctx.current else None
                if t is not None and r / r_cur >= t:
                    wins[s] = self._wins.get(s, 0) + 1
        self._wins = wins
        persistence = 1 if self._waive else self.persistence
        ready = [c for _, c in ranked if wins.get(c.strategy, 0) >= persistence]
        target = ready[0] if ready else None
        metrics["wins"] = wins.get((target or best).strategy, 0)
        metrics["target"] = target.strategy.to_dict() if target else None

        gain = f"R {_fmt(ratio, 4)}× current" + (f", threshold {_fmt(threshold, 4)}×" if threshold else "")
        cost = f"H={_fmt(horizon)}s, C_sw={_fmt(cost_of(best.strategy))}s"
        if best.strategy == ctx.current:
            return Decision(
                None, f"stay on {ctx.current.short()}: best R={_fmt(r_best)} at {noise_text}", metrics
            )
        # The best candidate's switch may not pay back (H ≤ C_sw) while an equivalent one's cheaper switch does:
        # its wins count (above), so this stays only when nothing won.
        if not wins and threshold is None:
            return Decision(
                None,
                f"stay on {ctx.current.short()}: best {best.strategy.short()} ({gain}) but horizon "
                f"H={_fmt(horizon)}s ≤ switch cost {_fmt(cost_of(best.strategy))}s; {noise_text}",
                metrics,
            )
        if not wins:
            return Decision(
                None,
                f"stay on {ctx.current.short()}: best {best.strategy.short()} {gain} (δ={self.min_gain}, {cost}); "
                f"{noise_text}",
                metrics,
            )
        if target is None:
            return Decision(
                None,
                f"stay on {ctx.current.short()}: {best.strategy.short()} clears the threshold ({gain}) but has won "
                f"{wins.get(best.strategy, 0)}/{self.persistence} evaluations; {noise_text}",
                metrics,
            )
        dwell = ctx.now - ctx.last_switch_time
        if dwell < self.min_dwell_s and not self._waive:
            return Decision(
                None,
                f"stay on {ctx.current.short()}: {target.strategy.short()} is ready ({gain}) but dwell "
                f"{_fmt(dwell)}s < min_dwell_s={_fmt(self.min_dwell_s)}s",
                metrics,
            )
        r_target = rate[target]
        metrics.update(R_target=r_target, threshold_target=threshold_of(target.strategy),
                       switch_cost_target_s=cost_of(target.strategy))  # fmt: skip
        self._wins = {}
        self._switches += 1
        return Decision(
            target.strategy,
            f"switch {ctx.current.short()} → {target.strategy.short()}: R {_fmt(r_target / r_cur, 4)}× current ≥ "
            f"threshold {_fmt(threshold_of(target.strategy), 4)}× (δ={self.min_gain}, H={_fmt(horizon)}s, "
            f"C_sw={_fmt(cost_of(target.strategy))}s), won {wins[target.strategy]} evaluations in a row "
            f"({persistence} needed)"
            f"{' (the probe was measured: no dwell or persistence)' if self._waive else ''}; "
            f"{noise_text}",
            metrics,
        )

    # ------------------------------------------------------------------------------------------ persistence

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "wins": {str(s): n for s, n in sorted(self._wins.items())},
            "noise_weight": self._noise_weight,
            "last_current": self._last_current.to_dict() if self._last_current else None,
            "evaluations": self._evaluations,
            "switches": self._switches,
            "noise_history": [[n, b] for n, b in self._history],
            "noise_peak": self._peak,
            "last_estimate": self._last_estimate,
            "probes_used": self._probes_used,
            "probing": self._probing.to_dict() if self._probing else None,
        }

    def from_dict(self, data: dict[str, Any]) -> ConaPolicy:
        super().from_dict(data)
        self._wins = {Strategy.parse(s): int(n) for s, n in (data.get("wins") or {}).items()}
        self._noise_weight = min(1.0, positive_number(data.get("noise_weight")) or 0.0)
        last = data.get("last_current")
        self._last_current = Strategy.from_dict(last) if last else None
        self._evaluations = int(data.get("evaluations", 0))
        self._switches = int(data.get("switches", 0))
        # The noise state may come from an older cona (no `noise_peak`, `last_estimate`) or carry odd values (null,
        # NaN, inf): each entry is kept only as a positive finite number, and what is missing is rebuilt from what is
        # there, so a restart neither crashes nor drops the floor and the fallback that the run had.
        self._history = []
        for entry in data.get("noise_history") or []:
            value = positive_number(entry[1]) if isinstance(entry, list | tuple) and len(entry) == 2 else None
            if value is not None and isinstance(entry[0], int | float) and math.isfinite(entry[0]):
                self._history.append((int(entry[0]), min(MAX_NOISE_SCALE, value)))
        trusted = [b for _, b in self._history]
        self._peak = min(MAX_NOISE_SCALE, max([positive_number(data.get("noise_peak")) or 0.0, *trusted]))
        last_estimate = positive_number(data.get("last_estimate"))
        if last_estimate is None and trusted:  # the history holds the estimate times the critical-batch factor
            last_estimate = trusted[-1] / self.critical_batch_factor
        self._last_estimate = last_estimate if self._noise_weight > 0 else None
        self._probes_used = int(data.get("probes_used", 0))
        probing = data.get("probing")
        self._probing = Strategy.from_dict(probing) if probing else None
        return self


# ---------------------------------------------------------------------------------------------------- baselines


class _KeepPolicy(Policy):
    """A policy that runs one strategy and never switches."""

    def __init__(self, strategy: Strategy, *, why: str) -> None:
        self.strategy = strategy
        self._why = why

    def initial(self, *, candidates: list[Candidate], throughput: ThroughputModel, samples: int) -> Strategy:
        return self.strategy

    def decide(self, ctx: DecisionContext) -> Decision:
        metrics = {"policy": self.name, "current": ctx.current.to_dict(), "best": self.strategy.to_dict()}
        return Decision(None, f"{self.name} policy keeps {ctx.current.short()} ({self._why})", metrics)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "strategy": self.strategy.to_dict()}


class StaticPolicy(_KeepPolicy):
    """The offline searcher's choice: lowest predicted iteration time at `batch.base_gbs`; never switches."""

    name = "static"

    def __init__(self, *, job: Job, profile: ClusterProfile, candidates: list[Candidate]) -> None:
        self.job, self.profile = job, profile
        chosen = static_choice(profile=profile, job=job, num_devices=_devices(candidates, profile))
        super().__init__(chosen.strategy, why=f"fastest predicted iteration at base_gbs={job.batch.base_gbs}")

    def initial(self, *, candidates: list[Candidate], throughput: ThroughputModel, samples: int) -> Strategy:
        """Re-pick for the devices at hand (they may differ from those at construction)."""
        devices = _devices(candidates, self.profile)
        if devices != self.strategy.world_size:
            chosen = static_choice(profile=self.profile, job=self.job, num_devices=devices)
            self.strategy = chosen.strategy
        return self.strategy


class FixedPolicy(_KeepPolicy):
    """`policy.strategy`, validated against the planner; never switches."""

    name = "fixed"

    def __init__(self, strategy: Strategy) -> None:
        super().__init__(strategy, why="policy.strategy")


class SchedulePolicy(Policy):
    """Follows `policy.schedule`: from each entry's `samples` on, its strategy."""

    name = "schedule"

    def __init__(self, entries: list[tuple[int, Strategy]]) -> None:
        if not entries:
            raise ValueError("policy 'schedule' needs at least one entry")
        starts = [n for n, _ in entries]
        if starts != sorted(starts) or starts[0] != 0:
            raise ValueError("policy.schedule must start at samples 0 and increase")
        self.entries = list(entries)

    def entry_at(self, samples: int) -> tuple[int, int, Strategy]:
        """(index, threshold, strategy) of the entry in force at `samples`."""
        index = 0
        for i, (start, _) in enumerate(self.entries):
            if samples >= start:
                index = i
        start, strategy = self.entries[index]
        return index, start, strategy

    def initial(self, *, candidates: list[Candidate], throughput: ThroughputModel, samples: int) -> Strategy:
        return self.entry_at(samples)[2]

    def switch_points(self) -> list[int]:
        return [start for (start, strategy), (_, before) in zip(self.entries[1:], self.entries, strict=False)
                if strategy != before]  # fmt: skip

    def strategy_at(self, samples: int) -> Strategy:
        return self.entry_at(samples)[2]

    def decide(self, ctx: DecisionContext) -> Decision:
        index, start, strategy = self.entry_at(ctx.samples)
        metrics = {
            "policy": self.name, "current": ctx.current.to_dict(), "best": strategy.to_dict(),
            "entry": index, "entry_samples": start, "samples": ctx.samples,
        }  # fmt: skip
        if strategy == ctx.current:
            following = self.entries[index + 1][0] if index + 1 < len(self.entries) else None
            nxt = f"; next entry at samples {following}" if following is not None else "; last entry"
            return Decision(None, f"schedule keeps {ctx.current.short()} (entry {index}{nxt})", metrics)
        return Decision(
            strategy,
            f"schedule: samples {ctx.samples} ≥ {start} (entry {index} of {len(self.entries)}) → {strategy.short()}",
            metrics,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "entries": [[n, s.to_dict()] for n, s in self.entries]}


# ---------------------------------------------------------------------------------------------------- factory


def make_policy(job: Job, *, profile: ClusterProfile, candidates: list[Candidate]) -> Policy:
    """The policy `job.policy.name` names, with every strategy it mentions validated up front.

    Raises ValueError with a one-line message naming the bad setting and the planner's reason.
    """
    spec = job.policy
    if spec.name == "cona":
        return ConaPolicy.from_spec(spec, base_gbs=job.batch.base_gbs, lr_rule=LrRule.of(job))
    if spec.name == "static":
        return StaticPolicy(job=job, profile=profile, candidates=candidates)
    if spec.name == "fixed":
        if not spec.strategy:
            raise ValueError("policy 'fixed' needs policy.strategy, e.g. dp=2,tp=1,pp=2,mbs=2,gbs=32")
        strategy = _validated(
            spec.strategy, what="policy.strategy", job=job, profile=profile, candidates=candidates
        )
        return FixedPolicy(strategy)
    if spec.name == "schedule":
        entries = [
            (e.samples, _validated(e.strategy, what=f"policy.schedule[{i}] (samples={e.samples})", job=job,
                                   profile=profile, candidates=candidates))
            for i, e in enumerate(spec.schedule)
        ]  # fmt: skip
        return SchedulePolicy(entries)
    raise ValueError(f"unknown policy {spec.name!r}; valid: cona, static, fixed, schedule")
