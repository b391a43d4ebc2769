"""The run model: what the orchestrator knows about a run and what it decides, with no I/O.

It absorbs heartbeats (loss, throughput, gradient statistics), keeps the estimators (noise scale, calibrated
throughput, switch costs by kind), estimates the time to the target and asks the policy whether to switch. It reads
no file, writes no file, starts nothing and never looks at the clock: the scheduler loop (`scheduler.py`) feeds it
heartbeats and the time, carries out what it decides and persists `to_dict()` in state.json. The benchmarks drive
the same model on simulated heartbeats (`benchmarks/ttp.py`), and the tests drive it directly.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection
from typing import Any

from cona.orchestrator.elastic import world_candidates
from cona.orchestrator.job import Job
from cona.orchestrator.noise import NoiseScaleEstimator
from cona.orchestrator.planner import Candidate
from cona.orchestrator.policy import ConaPolicy, Decision, DecisionContext, Policy, make_policy
from cona.orchestrator.profile import ClusterProfile
from cona.orchestrator.switchcost import SwitchCosts, SwitchKind
from cona.orchestrator.throughput import ThroughputModel
from cona.protocol.heartbeat_record import (
    MAX_LOSS_FOR_PERPLEXITY,
    Heartbeat,
    HeartbeatEvent,
    measures_throughput,
    perplexity,
    timed_window,
)
from cona.protocol.strategy import Strategy


@dataclasses.dataclass
class LiveStatus:
    """What the live view shows; also the body of `cona status --json`."""

    status: str = "starting"
    attempt: int = 0
    strategy: str = ""
    step: int = 0
    samples: int = 0
    train_loss: float | None = None
    val_loss: float | None = None
    val_perplexity: float | None = None
    val_samples: int | None = None
    """Samples trained at the evaluation `val_loss` comes from: a run that ends between two evaluations (or before
    the first after step 0) shows an older model's perplexity, and says so."""
    noise_scale: float | None = None
    """The B_noise the policy ranks with (prior, blend or the scaled estimate); the estimate for other policies."""
    noise_source: str = "prior"
    noise_estimate: float | None = None
    """The estimator's own value, before `policy.critical_batch_factor`."""
    samples_per_s: float | None = None
    """The current attempt's latest measured window (`measures_throughput`); None until it has one."""
    best: str = ""
    best_gain: float | None = None
    eta_s: float | None = None
    """Seconds to the target at the current attempt's throughput; None until the attempt has measured it."""
    switches: int = 0
    restarts: int = 0
    elapsed_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class SwitchCompleted:
    """A switch whose new strategy sent its first heartbeat: what it cost, against what was predicted."""

    attempt: int
    cost_s: float
    kind: SwitchKind
    predicted_s: float | None


@dataclasses.dataclass(frozen=True)
class SwitchPlan:
    """A decision to switch, with how it will happen and what it is expected to cost."""

    decision: Decision
    target: Strategy
    kind: SwitchKind
    predicted_s: float


SwitchKindOf = Callable[[Strategy, Strategy], SwitchKind]
OverheadOf = Callable[[SwitchKind], float]


class RunModel:
    """Estimators and decisions of one run.

    `switch_kind(current, target)` and `switch_overhead_s(kind)` come from the backend (`Backend.switch_kind` with
    `policy.in_place_switch`, `Backend.switch_overhead_s`): the only things the model needs to know about it.
    """

    def __init__(
        self, *, profile: ClusterProfile, job: Job, candidates: list[Candidate], switch_kind: SwitchKindOf,
        switch_overhead_s: OverheadOf,
    ) -> None:  # fmt: skip
        self.profile = profile
        self.job = job
        self.candidates = candidates
        self._kind_of = switch_kind
        self._overhead_of = switch_overhead_s
        pol = job.policy
        self.noise = NoiseScaleEstimator(ema=pol.noise_ema, kind=pol.noise_estimator, min_updates=pol.min_noise_samples)
        self.throughput = ThroughputModel(candidates=candidates)
        self.policy: Policy = make_policy(job, profile=profile, candidates=candidates)
        self.switch_costs = SwitchCosts(job=job, profile=profile, pinned_s=pol.switch_cost_s)
        self.live = LiveStatus()
        self.val_history: list[dict[str, float]] = []
        """Every evaluation: time, samples, val_loss."""
        self.windows_in_attempt = 0
        """Timed windows of the current attempt so far (`timed_window`; the warm-up ones are no measurement)."""
        self.pending_switch: dict[str, Any] | None = None
        """The switch whose first heartbeat is awaited: request time, attempt it becomes, kind, prediction."""
        self.last_decision: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------ heartbeats

    def attempt_started(self, number: int, strategy: Strategy) -> None:
        """A new attempt (launched or continued in place) runs `strategy`."""
        self.windows_in_attempt = 0
        self.live.attempt, self.live.strategy = number, strategy.short()
        # The previous attempt's samples/s and time to target describe another strategy (or, after a relaunch,
        # another start): shown next to this attempt's number and strategy they would read as its own. None until
        # this attempt's first measured window (`absorb`).
        self.live.samples_per_s = self.live.eta_s = None

    def absorb(self, attempt: int, strategy: Strategy, beats: list[Heartbeat]) -> list[SwitchCompleted]:
        """Fold attempt `attempt`'s heartbeats in; returns the switches they completed."""
        completed = []
        measured_before = measures_throughput(self.windows_in_attempt)
        # The windows that time `strategy`: an elastic attempt that started on another node count than planned
        # writes the other strategy's before the backend says so (`Scheduler._started_as`), and those step times
        # are not this one's (nor its warm-up).
        timing = strategy.to_dict()
        for hb in beats:
            self.live.step, self.live.samples = hb.step, hb.samples
            if hb.train_loss is not None:
                self.live.train_loss = hb.train_loss
            if hb.val_loss is not None:
                self.record_evaluation(time=hb.time, samples=hb.samples, val_loss=hb.val_loss)
            if hb.event in (HeartbeatEvent.START, HeartbeatEvent.RESUME):
                done = self._switch_completed(attempt, hb.time)
                if done is not None:
                    completed.append(done)
                continue
            if timed_window(hb) and hb.strategy == timing:
                # The windows after a launch's warm-up ones (compilation, allocations, first collectives) count.
                self.windows_in_attempt += 1
                if measures_throughput(self.windows_in_attempt):
                    self.throughput.observe(strategy, hb.step_time_s)
                    self.live.samples_per_s = hb.samples_per_s
            self.noise.update(hb)
        if not measured_before and measures_throughput(self.windows_in_attempt):
            # The attempt's first measurement: its time to target now, not at the next decision (a minute away on
            # a large job) — until then the live view shows none rather than a number from before the launch.
            # `live.elapsed_s` is the scheduler's latest pass; it matters only to a time budget.
            self.live.eta_s = self.remaining_time_s(strategy, elapsed_s=self.live.elapsed_s)
        self.live.noise_estimate = self.noise.value
        if self.job.policy.name != "cona":  # no B_noise of its own: show the estimate
            self.live.noise_scale, self.live.noise_source = self.noise.value, "estimate"
        return completed

    def record_evaluation(self, *, time: float, samples: int, val_loss: float) -> None:
        self.live.val_loss, self.live.val_perplexity = val_loss, perplexity(val_loss)
        self.live.val_samples = samples
        self.val_history.append({"time": time, "samples": samples, "val_loss": val_loss})

    def switch_started(self, *, requested_at: float, to_attempt: int, kind: SwitchKind, predicted_s: float | None) -> None:
        """The switch requested at `requested_at` is under way as attempt `to_attempt`."""
        self.pending_switch = {"time": requested_at, "to_attempt": to_attempt, "kind": kind.value,
                               "predicted_s": predicted_s}  # fmt: skip
        self.live.switches += 1

    def _switch_completed(self, attempt: int, at: float) -> SwitchCompleted | None:
        pending = self.pending_switch
        if not pending or pending.get("to_attempt") != attempt:
            return None
        cost = max(0.0, at - pending["time"])
        kind = SwitchKind(pending.get("kind", SwitchKind.RELAUNCH.value))
        self.switch_costs.observe(kind, cost)
        self.pending_switch = None
        return SwitchCompleted(attempt=attempt, cost_s=cost, kind=kind, predicted_s=pending.get("predicted_s"))

    # ------------------------------------------------------------------------------------------ estimates

    def switch_kind(self, current: Strategy, target: Strategy) -> SwitchKind:
        """How a switch from `current` to `target` would happen (the backend decides)."""
        return self._kind_of(current, target)

    def switch_cost_s(self, current: Strategy, target: Strategy) -> float:
        """Seconds a switch from `current` to `target` is expected to cost: measured for its kind, else predicted."""
        kind = self.switch_kind(current, target)
        rate = self.throughput.samples_per_s_of(current)
        step = current.gbs / rate if rate else 0.0
        cost, _ = self.switch_costs.cost_s(kind, overhead_s=self._overhead_of(kind), step_time_s=step)
        return cost

    def remaining_time_s(self, strategy: Strategy, *, elapsed_s: float) -> float | None:
        """Estimated seconds to the target (samples, perplexity or time budget, whichever comes first) on
        `strategy`, `elapsed_s` into the run."""
        target = self.job.target.val_perplexity
        latest = self.val_history[-1].get("val_loss") if self.val_history else None
        if target and isinstance(latest, int | float) and latest <= math.log(target):
            # Reached (at the first evaluation, too, where the fit below has no two points): the trainer stops at
            # that evaluation, and a switch decided now would have nothing left to gain.
            return 0.0
        rate = self.throughput.samples_per_s_of(strategy)
        estimates = []
        if rate and rate > 0:
            estimates.append(max(0, self.job.target.max_samples - self.live.samples) / rate)
        # The first evaluation (untrained model) would make the loss look like it falls far faster than it does.
        history = [h for h in self.val_history if h["samples"] > 0]
        if target and len(history) >= 2 and rate and rate > 0:
            # Loss falls roughly linearly in log(samples): L ≈ a − b·ln(s). Fit it to the last two evaluations
            # and solve for the samples at the target; progress per sample slows down, which a straight line in
            # time would ignore.
            (a, b) = history[-2], history[-1]
            drop = a["val_loss"] - b["val_loss"]
            gap = b["val_loss"] - math.log(target)
            # A diverged evaluation (a loss that is inf or NaN, or above `MAX_LOSS_FOR_PERPLEXITY`: far worse than a
            # uniform guess over any vocabulary) says nothing about the rate of progress: its drop to the next one
            # would put the target at hand.
            diverged = not (a["val_loss"] <= MAX_LOSS_FOR_PERPLEXITY and b["val_loss"] <= MAX_LOSS_FOR_PERPLEXITY)
            if drop > 0 and gap > 0 and b["samples"] > a["samples"] and not diverged:
                slope = drop / math.log(b["samples"] / a["samples"])
                samples_at_target = b["samples"] * math.exp(min(gap / slope, 20.0))
                estimates.append(max(0.0, samples_at_target - self.live.samples) / rate)
        if self.job.target.max_time_s:
            estimates.append(max(0.0, self.job.target.max_time_s - elapsed_s))
        return min(estimates) if estimates else None

    # ------------------------------------------------------------------------------------------ deciding

    def initial_strategy(self) -> Strategy:
        """The strategy the run starts with, on all of the profile's devices (an elastic run may start on fewer
        nodes: then on `best_for_world` of what it got)."""
        return self.initial_choice()[0]

    def initial_choice(self) -> tuple[Strategy, str]:
        """`initial_strategy` and why the policy starts there, for the launch line ('' when its name says it)."""
        full = world_candidates(self.candidates, self.profile.num_gpus) or self.candidates
        return self.policy.start(candidates=full, throughput=self.throughput)

    def ranking_noise_scale(self) -> float | None:
        """The B_noise the cona policy ranks with now (prior, estimate or their blend); None for other policies."""
        return self.policy.noise_scale_used(self.noise.value) if isinstance(self.policy, ConaPolicy) else None

    def best_for_world(self, devices: int) -> Strategy:
        """The strategy to run on `devices` devices (an elastic run's plan for a node count): what the policy would
        start with on that world's candidates until the cona policy ranks batches by the noise estimate (its blend
        weight is above zero and it no longer holds the start batch: until then neither does this plan), and then
        its best R under the
        noise scale it ranks with; another policy's own strategy when it fits that world, else the fastest
        predicted iteration at `batch.base_gbs` there (what `static` would run). Raises ValueError when nothing is
        feasible on that world."""
        pool = world_candidates(self.candidates, devices)
        if not pool:
            raise ValueError(f"no feasible strategy on {devices} devices")
        # The policy, not the estimator, says when the estimate counts: a value that exists but is not yet stable
        # would otherwise rank every batch under the prior here while the policy itself still holds the batch.
        if isinstance(self.policy, ConaPolicy) and self.policy.noise_weight > 0 and not self.policy.holds_batch:
            best = self.policy.best(pool, self.throughput, self.policy.noise_scale_used(self.noise.value))
            if best is not None:
                return best
        own = self.policy.initial(candidates=pool, throughput=self.throughput, samples=self.live.samples)
        if own.world_size == devices:
            return own
        at_base = [c for c in pool if c.gbs == self.job.batch.base_gbs] or pool
        return min(at_base, key=lambda c: (c.iter_time_s / c.gbs, c.pp, c.tp, c.mbs)).strategy

    def decide(
        self, *, now: float, current: Strategy, strategy_since: float, elapsed_s: float,
        worlds: Collection[int] | None = None,
    ) -> SwitchPlan | None:  # fmt: skip
        """One evaluation of the policy at time `now`; a plan when it decided to switch, else None.

        `worlds`: the world sizes (device counts) a switch may go to now — an elastic run's current one and those
        the cluster has nodes for; None: every candidate's. The decision (switch or not) is kept in
        `last_decision` and the live view either way."""
        allowed = self.candidates if worlds is None else [c for c in self.candidates if c.strategy.world_size in worlds]
        ctx = DecisionContext(
            now=now,
            samples=self.live.samples,
            current=current,
            candidates=allowed,
            throughput=self.throughput,
            noise_scale=self.noise.value,
            noise_stable=self.noise.stable,
            switch_cost_s=lambda target: self.switch_cost_s(current, target),
            last_switch_time=strategy_since,
            remaining_time_s=self.remaining_time_s(current, elapsed_s=elapsed_s),
        )
        decision = self.policy.decide(ctx)
        # Shown once the current attempt has measured its throughput: before that, the estimate rests on the cost
        # model's prediction or an older attempt's rate (the policy decides with it all the same).
        self.live.eta_s = ctx.remaining_time_s if measures_throughput(self.windows_in_attempt) else None
        used = decision.metrics.get("B_noise")
        if isinstance(used, int | float):
            self.live.noise_scale = used
            self.live.noise_source = str(decision.metrics.get("noise_source", self.live.noise_source))
        best = decision.metrics.get("best")
        self.live.best = Strategy.from_dict(best).short() if isinstance(best, dict) else ""
        ratio = decision.metrics.get("ratio")
        self.live.best_gain = (ratio - 1.0) if isinstance(ratio, int | float) else None
        self.last_decision = {"time": now, "reason": decision.reason, "metrics": decision.metrics}
        if decision.switch_to is None or decision.switch_to == current:
            return None
        if worlds is not None and decision.switch_to.world_size not in worlds:
            return None  # a schedule's next entry on nodes the cluster does not have now: it waits for them
        target = decision.switch_to
        return SwitchPlan(decision=decision, target=target, kind=self.switch_kind(current, target),
                          predicted_s=ctx.switch_cost_s(target))  # fmt: skip

    # ------------------------------------------------------------------------------------------ persistence

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data: everything an orchestrator restart needs to go on where this one stopped."""
        return {
            "noise": self.noise.to_dict(),
            "throughput": self.throughput.to_dict(),
            "policy": self.policy.to_dict(),
            "switch_costs": self.switch_costs.to_dict(),
            "live": dataclasses.asdict(self.live),
            "val_history": list(self.val_history),
            "windows_in_attempt": self.windows_in_attempt,
            "switch_started": self.pending_switch,
            "last_decision": self.last_decision,
        }

    def restore(self, data: dict[str, Any]) -> RunModel:
        """Load what `to_dict` saved (keys missing from older state files keep their fresh values); returns self."""
        if "noise" in data:
            self.noise = NoiseScaleEstimator.from_dict(data["noise"])
        if "throughput" in data:
            self.throughput = ThroughputModel.from_dict(data["throughput"], candidates=self.candidates)
        if "policy" in data:
            self.policy.from_dict(data["policy"])
        if isinstance(data.get("switch_costs"), dict):
            self.switch_costs.restore(data["switch_costs"])
        if "live" in data:
            known = {f.name for f in dataclasses.fields(LiveStatus)}
            self.live = LiveStatus(**{k: v for k, v in data["live"].items() if k in known})
        self.val_history = list(data.get("val_history") or [])
        self.windows_in_attempt = int(data.get("windows_in_attempt") or 0)
        self.pending_switch = data.get("switch_started")
        self.last_decision = data.get("last_decision")
        return self
