"""Time to target validation loss: static vs every fixed strategy vs cona vs the oracle sequence.

    python -m benchmarks.ttp [--quick] [--scenario reference|a100-16x8|h100-8x8] [--workloads gpt,llama,bert] [--seeds 0,1,2,3]
                             [--profile slurm/profiles/a100-4x8.yaml] [--preset examples/gpt3-1.3b.yaml]
                             [--policy-set KEY=VALUE ...] [--out NAME.json]

Real training of tiny models (`benchmarks/jobs/*.yaml`: byte-level GPT, Llama and BERT on the Shakespeare plays)
where every statistic is real and every iteration's time is the cost model's for the chosen strategy of a full-size
preset on a cluster profile (`benchmarks.sim` explains the simulated-time driver, the batch mapping and the
modeled switch cost). On the same seeds:

- **fixed**: every feasible candidate of the preset. Candidates with the same gbs train exactly the same tiny-model
  trajectory (the loss is layout-invariant), so one run per gbs is trained and each candidate's time to a target
  is its step count times its own iteration time.
- **static**: what an offline searcher picks — the fastest strategy at a base gbs; reported for every base gbs a
  user might pick (the preset's standard batch is its `batch.base_gbs`).
- **cona**: the shipped policy (`cona.orchestrator.policy.ConaPolicy` with the job's `policy` section), fed by the
  shipped noise-scale estimator, throughput model and time-to-target estimate of `cona.orchestrator.scheduler`, deciding
  every `policy.decision_interval_s` of modeled time; each switch costs the modeled switch cost.
- **oracle**: a sequence built with hindsight, by rollouts. At modeled time 0 and then every `--segment-s` modeled
  seconds, from the current state (an in-process checkpoint: model, optimizer, data position) every candidate gbs is
  branched (its fastest layout: slower layouts at the same gbs follow the same trajectory, only slower) and trained
  until the lowest target — a branch that changes the strategy first pays the switch cost — and the oracle follows,
  for the next segment, the branch with the best validation-loss drop per modeled second over its window, the
  window being the rest of the run to the lowest target (that is, the branch that gets there first). At time 0 the
  branches are the fixed runs; staying is the followed branch's own continuation; a branch stops once it can no
  longer be first. By construction the oracle reaches the lowest target no later than the best fixed strategy (it
  optimises that target, not the higher ones). `--greedy-window-s W` also builds the short-window greedy sequence
  (branch every candidate for W seconds, keep the largest drop per second, repeat): on this workload it drifts to
  ever larger batches — a larger batch's immediate loss drop is mostly its lower noise floor, and a smaller batch
  first loses ground (short-horizon bias) — and ends far behind the best fixed strategy, so it is not the default.

Time to target (TTP) is the modeled time at which the validation loss first reaches the target, linearly
interpolated between evaluations (every `eval.interval_samples` samples) over the training time between them: a
switch's pause in between is skipped. Fixed runs stop at the lowest target, the
sample budget or `--cap` × the best fixed time so far; a run that stops first has no TTP ("—"), and a static/cona
ratio that needs it is reported as a lower bound (≥, `lower_bound: true`). A cona run that runs out of samples
before a target counts at its last modeled time: cona/oracle is then a lower bound (≥) and every ratio over cona an
upper bound (≤, `upper_bound: true`; `cona_missed` lists the seeds). `best_fixed_over_cona` uses each seed's
fastest fixed candidate in hindsight; `best_fixed_on_average_over_cona` the one candidate fastest on average.
Workers run the (workload, seed) pairs in parallel (`--jobs`); `--resummarize JSON` redoes tables and plots.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    RESULTS,
    finite,
    fmt_ratio,
    fmt_s,
    ints_arg,
    map_workers,
    names_arg,
    print_table,
    results_path,
    run_main,
    shown,
    spread,
    write_json,
)

WORKLOADS: dict[str, dict[str, Any]] = {
    # Targets in nats per target byte; 1.72 is about examples/tiny-gpt.yaml's val_perplexity 5.5. --quick runs gpt only,
    # to higher targets within a smaller sample budget (its LR schedule decays over that budget).
    "gpt": {"job": "benchmarks/jobs/gpt.yaml", "targets": [2.0, 1.85, 1.72], "quick_targets": [2.1, 1.95],
            "quick_max_samples": 20000},
    "llama": {"job": "benchmarks/jobs/llama.yaml", "targets": [1.9, 1.75, 1.65], "quick_targets": [2.0, 1.85],
              "quick_max_samples": 16000},
    # The masked-LM loss of a 2-layer byte-level BERT falls slowly after a fast start: two targets on that slope.
    "bert": {"job": "benchmarks/jobs/bert.yaml", "targets": [3.1, 3.03], "quick_targets": [3.1],
             "quick_max_samples": 16000},
}  # fmt: skip


SCENARIOS: dict[str, tuple[str, str]] = {
    # name: (profile, preset whose times are charged). The reference workload's throughput grows slowly with the
    # batch; on the two others a small batch cannot feed the devices, so it needs tensor or pipeline parallelism
    # and runs far below peak, and the fastest degrees change with the batch.
    "reference": ("slurm/profiles/a100-4x8.yaml", "examples/gpt3-1.3b.yaml"),
    "a100-16x8": ("slurm/profiles/a100-16x8.yaml", "examples/gpt3-1.3b.yaml"),
    "h100-8x8": ("slurm/profiles/h100-8x8.yaml", "examples/llama-3.2-1b.yaml"),
}


def scenario_cluster(tiny_job: Any, scenario: str = "reference", **kwargs: Any) -> Any:
    """The `ModeledCluster` of `scenario` (its profile and the preset whose times are charged) for `tiny_job`."""
    from cona.orchestrator.job import load_job
    from cona.orchestrator.profile import load_profile

    from benchmarks.sim import ModeledCluster

    profile_path, preset_path = SCENARIOS[scenario]
    return ModeledCluster(profile=load_profile(REPO / profile_path), preset_job=load_job(REPO / preset_path),
                          tiny_job=tiny_job, **{"restart_s": 0.0, **kwargs})  # fmt: skip


@dataclasses.dataclass
class Settings:
    workload: str
    seed: int
    job_path: str
    targets: list[float]
    max_samples: int
    profile_path: str
    preset_path: str
    restart_s: float
    segment_s: float
    greedy_window_s: float | None
    cap: float
    in_place: bool = True
    """Switches at the same world size are charged in place (`--relaunch-only`: every switch a relaunch)."""
    policy_overrides: tuple[str, ...] = ()
    """`KEY=VALUE` settings of the jobs' `policy` section (`--policy-set`)."""
    reuse: dict[str, Any] | None = None
    """This workload and seed's result of an earlier run (`--cona-only`): its fixed runs, candidates, oracle and
    fitted critical batch are kept and only cona is run again."""


@dataclasses.dataclass
class Point:
    """One validation measurement of a run."""

    t: float
    """Modeled seconds since the start."""
    samples: int
    """Tiny-model samples consumed."""
    step: int
    val: float
    gbs: int
    """The preset gbs running when it was measured."""


@dataclasses.dataclass
class Run:
    name: str
    points: list[Point] = dataclasses.field(default_factory=list)
    sequence: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """[{t, strategy, gbs}] each time a strategy starts (after its switch cost)."""
    switches: int = 0
    pauses: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    """[(start, end)] of each switch's pause in modeled time: no training, so no loss change, in between."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def ttp(self, target: float, time_scale: float = 1.0) -> float | None:
        return crossing(self.points, target, time_scale, pauses=self.pauses)

    def to_dict(self, targets: list[float]) -> dict[str, Any]:
        return {
            "ttp_s": {str(t): finite(self.ttp(t)) for t in targets},
            "last_t_s": self.points[-1].t if self.points else None,
            "switches": self.switches,
            "pauses": [[round(a, 3), round(b, 3)] for a, b in self.pauses],
            "sequence": self.sequence,
            "evals": [[round(p.t, 3), p.samples, p.step, round(p.val, 5), p.gbs] for p in self.points],
            **self.extra,
        }


def crossing(points: list[Point], target: float, time_scale: float = 1.0, *, what: str = "t",
             pauses: list[tuple[float, float]] | tuple[()] = ()) -> float | None:
    """Modeled time (or `what`: samples) at which the validation loss first reaches `target`, interpolated
    linearly between the two evaluations around it — over the training time between them: a switch's pause
    (`pauses`, modeled [start, end]) in that interval trains nothing, so the loss cannot cross during it
    (interpolating in modeled time across a pause counted it as training and could put the crossing inside it)."""
    for i, p in enumerate(points):
        if p.val <= target:
            if i == 0:
                return getattr(p, what) * time_scale
            q = points[i - 1]
            frac = (q.val - target) / (q.val - p.val) if q.val > p.val else 1.0
            if what != "t":
                a, b = getattr(q, what), getattr(p, what)
                return (a + frac * (b - a)) * time_scale
            return _after_training(q.t, frac * _training_s(q.t, p.t, pauses), pauses) * time_scale
    return None


def _training_s(a: float, b: float, pauses) -> float:
    """The modeled seconds between `a` and `b` that are not a switch's pause."""
    return (b - a) - sum(max(0.0, min(b, end) - max(a, start)) for start, end in pauses)


def _after_training(t: float, seconds: float, pauses) -> float:
    """The modeled time at which `seconds` of training after `t` have passed, the pauses skipped."""
    for start, end in sorted(pauses):
        if end <= t:
            continue
        if start > t:
            if t + seconds <= start:
                break
            seconds -= start - t
        t = max(t, end)
    return t + seconds


def pauses_of(run: dict[str, Any]) -> list[tuple[float, float]] | None:
    """A stored run's switch pauses: recorded (`pauses`), or, in JSONs written before they were, each switch's
    decision time (cona's `decisions` with `switch_to`, the oracle's with a new `chosen_gbs`) to its strategy's
    start in `sequence`; None where neither tells (the greedy-window run)."""
    if "pauses" in run:
        return [(float(a), float(b)) for a, b in run["pauses"]]
    decisions = run.get("decisions")
    if decisions is None:
        return None
    starts, chosen = [], run["sequence"][0]["gbs"]
    for d in decisions:
        if d.get("switch_to"):
            starts.append(d["t"])
        elif "chosen_gbs" in d and d["chosen_gbs"] != chosen:
            starts.append(d["t"])
            chosen = d["chosen_gbs"]
    ends = [e["t"] for e in run["sequence"][1:]]
    assert len(starts) == len(ends), "every switch has a decision and a start"
    return list(zip(starts, ends, strict=True))


def refresh_switching_runs(report: dict[str, Any]) -> None:
    """Recompute the switching runs' (cona, oracle) times to target from their evaluations and pauses, in place: a
    JSON written before pauses were excluded from the interpolation has them across a pause (`--resummarize`)."""
    for w in report["workloads"].values():
        targets = w.get("targets") or w["summary"]["targets"]
        for r in w["runs"]:
            for name in ("cona", "oracle", "greedy_window"):
                run = r.get(name)
                pauses = pauses_of(run) if run else None
                if pauses is None:
                    continue
                points = [Point(t, samples, step, val, gbs) for t, samples, step, val, gbs in run["evals"]]
                run["pauses"] = [[a, b] for a, b in pauses]
                run["ttp_s"] = {str(t): finite(crossing(points, t, pauses=pauses)) for t in targets}


def fitted_critical_batch(samples_at: dict[int, float]) -> float | None:
    """B_crit from samples-to-target at several batch sizes: E(B) = E_min·(1 + B/B_crit) (McCandlish et al. 2018)
    is linear in B, E = a + b·B with a = E_min and b = E_min/B_crit; least squares, B_crit = a/b."""
    points = [(b, e) for b, e in samples_at.items() if e is not None]
    if len(points) < 2:
        return None
    n = len(points)
    mb = sum(b for b, _ in points) / n
    me = sum(e for _, e in points) / n
    var = sum((b - mb) ** 2 for b, _ in points)
    slope = sum((b - mb) * (e - me) for b, e in points) / var
    intercept = me - slope * mb
    return intercept / slope if slope > 0 and intercept > 0 else None


# ---------------------------------------------------------------------------------------------------- one worker


class _Context:
    """Everything one (workload, seed) needs, built inside the worker process."""

    def __init__(self, s: Settings) -> None:
        import torch

        torch.set_num_threads(1)
        from cona.orchestrator.job import load_job
        from cona.orchestrator.profile import load_profile
        from cona.trainer.data import Batcher, load_corpus
        from cona.trainer.distributed import init_distributed

        from benchmarks.sim import ModeledCluster

        self.s = s
        overrides = [f"seed={s.seed}", f"target.max_samples={s.max_samples}", *(f"policy.{o}" for o in s.policy_overrides)]
        self.job = load_job(REPO / s.job_path, overrides)
        if not Path(self.job.data.path).is_absolute():
            self.job.data.path = str(REPO / self.job.data.path)
        self.profile = load_profile(REPO / s.profile_path)
        self.preset = load_job(REPO / s.preset_path)
        self.cluster = ModeledCluster(profile=self.profile, preset_job=self.preset, tiny_job=self.job,
                                      restart_s=s.restart_s, in_place=s.in_place)  # fmt: skip
        self.env = init_distributed()
        self.batcher = Batcher(self.job, load_corpus(self.job))
        self.lowest = min(s.targets)
        self.eval_interval = self.job.eval.interval_samples

    def trainer(self, gbs: int, *, stats: bool):
        from benchmarks.sim import SimTrainer

        return SimTrainer(self.job, self.batcher, self.env, gbs=gbs, stats=stats)

    def eval_due(self, before: int, after: int) -> bool:
        return after // self.eval_interval > before // self.eval_interval


@dataclasses.dataclass
class Rollout:
    """One candidate trained from a state until the lowest target (or a deadline, or the sample budget)."""

    gbs: int
    points: list[Point]
    ttp: float | None
    """Modeled time at which the lowest target was reached, None if it was not."""
    snaps: dict[float, tuple[Any, float]]
    """For each requested decision time: (the state at the first step boundary at or after it, that boundary's t)."""
    stopped: str = ""


def rollout(ctx: _Context, sim, *, start=None, t0: float = 0.0, prev: Point | None = None, switch_from=None,
            gbs: int, deadline: float | None = None, snap_times: tuple[float, ...] = ()) -> Rollout:
    """Train the fastest layout at `gbs` from `start` (None: from scratch) at modeled time `t0`; `switch_from` (a
    strategy) charges the switch from it first."""
    cluster = ctx.cluster
    dt = cluster.fastest[gbs].iter_time_s
    if start is not None:
        sim.restore(start)
    sim.set_gbs(gbs // cluster.scale)
    t = t0 + (cluster.switch_s(switch_from, cluster.fastest[gbs].strategy) if switch_from is not None else 0.0)
    pauses = [(t0, t)] if t > t0 else []
    points: list[Point] = []
    if start is None:
        points.append(Point(0.0, 0, 0, sim.evaluate(), gbs))
    pending = sorted(x for x in snap_times if x > t0)
    snaps: dict[float, tuple[Any, float]] = {}
    stopped = ""
    while True:
        if sim.samples >= ctx.job.target.max_samples:
            stopped = "sample budget"
            break
        before = sim.samples
        sim.train_step()
        t += dt
        while pending and t >= pending[0]:
            snaps[pending.pop(0)] = (sim.snapshot(), t)
        if ctx.eval_due(before, sim.samples):
            points.append(Point(t, sim.samples, sim.step, sim.evaluate(), gbs))
            if points[-1].val <= ctx.lowest:
                break
        if deadline is not None and t > deadline:
            stopped = f"deadline {deadline:.0f} s"
            break
    ttp = crossing(([prev] if prev is not None else []) + points, ctx.lowest, pauses=pauses)
    return Rollout(gbs=gbs, points=points, ttp=ttp, snaps=snaps, stopped=stopped)


def run_fixed(ctx: _Context, gbs: int, cap_s: float | None, snap_times: tuple[float, ...]) -> tuple[Run, Rollout]:
    """The fastest layout at `gbs` (every other layout at this gbs: the same points, times scaled)."""
    c = ctx.cluster.fastest[gbs]
    sim = ctx.trainer(gbs // ctx.cluster.scale, stats=False)
    r = rollout(ctx, sim, gbs=gbs, deadline=cap_s, snap_times=snap_times)
    run = Run(name=f"fixed gbs={gbs}", points=r.points,
              sequence=[{"t": 0.0, "strategy": c.strategy.short(), "gbs": gbs}])  # fmt: skip
    run.extra["iter_time_s"] = c.iter_time_s
    if r.stopped:
        run.extra["stopped"] = r.stopped
    return run, r


def run_oracle(ctx: _Context, fixed: dict[int, Rollout], segment_s: float) -> Run:
    """The hindsight rollout sequence (see the module docstring)."""
    cluster = ctx.cluster
    sim = ctx.trainer(cluster.gbs_values[0] // cluster.scale, stats=False)
    # t = 0: the rollouts from scratch are the fixed runs.
    gbs = min(fixed, key=lambda g: (fixed[g].ttp is None, fixed[g].ttp or 0.0, -fixed[g].points[-1].samples))
    chosen = fixed[gbs]
    run = Run(name="oracle", sequence=[{"t": 0.0, "strategy": cluster.fastest[gbs].strategy.short(), "gbs": gbs}])
    decisions = [{"t": 0.0, "ttp_s": {str(g): r.ttp for g, r in fixed.items()}, "chosen_gbs": gbs}]
    k = 1
    while True:
        tk = k * segment_s
        if (chosen.ttp is not None and chosen.ttp <= tk) or tk not in chosen.snaps:
            break  # the target is reached within this segment (or the budget ran out first)
        state, t_now = chosen.snaps[tk]
        run.points.extend(p for p in chosen.points if p.t <= t_now and (not run.points or p.t > run.points[-1].t))
        prev = run.points[-1]
        # Staying is the chosen rollout's own continuation: already known.
        stay = Rollout(gbs=gbs, points=[p for p in chosen.points if p.t > t_now], ttp=chosen.ttp,
                       snaps={x: v for x, v in chosen.snaps.items() if x > tk})  # fmt: skip
        best, times = stay, {str(gbs): stay.ttp}
        for g in cluster.gbs_values:
            if g == gbs:
                continue
            r = rollout(ctx, sim, start=state, t0=t_now, prev=prev, switch_from=cluster.fastest[gbs].strategy, gbs=g,
                        deadline=best.ttp,
                        snap_times=tuple((k + j) * segment_s for j in range(1, 64)))
            times[str(g)] = r.ttp
            if r.ttp is not None and (best.ttp is None or r.ttp < best.ttp):
                best = r
        decisions.append({"t": round(t_now, 2), "ttp_s": times, "chosen_gbs": best.gbs})
        if best.gbs != gbs:
            run.switches += 1
            cost = cluster.switch_s(cluster.fastest[gbs].strategy, cluster.fastest[best.gbs].strategy)
            gbs = best.gbs
            run.pauses.append((t_now, t_now + cost))
            run.sequence.append({"t": round(t_now + cost, 2),
                                 "strategy": cluster.fastest[gbs].strategy.short(), "gbs": gbs})  # fmt: skip
        chosen = best
        k += 1
    run.points.extend(p for p in chosen.points if not run.points or p.t > run.points[-1].t)
    run.extra["decisions"] = decisions
    run.extra["segment_s"] = segment_s
    return run


def _run_model(ctx: _Context):
    """The shipped run model (statistics, policy, ETA, switch costs), for the preset job with the tiny job's
    policy/target, driven by simulated heartbeats."""
    from cona.orchestrator.planner import enumerate_candidates
    from cona.orchestrator.runmodel import RunModel
    from cona.orchestrator.scheduler import device_counts
    from cona.protocol.job import TargetSpec

    target = TargetSpec(val_perplexity=math.exp(ctx.lowest), max_samples=ctx.job.target.max_samples * ctx.cluster.scale)
    # The tiny job's LR rule in preset samples (its base batch × the batch mapping), for `policy.lr_aware`.
    batch = ctx.preset.batch.model_copy(update={"base_gbs": ctx.job.batch.base_gbs * ctx.cluster.scale})
    job = ctx.preset.model_copy(
        update={"policy": ctx.job.policy, "target": target, "optimizer": ctx.job.optimizer, "batch": batch}
    )
    candidates = [c for devices in device_counts(ctx.profile, job)
                  for c in enumerate_candidates(profile=ctx.profile, job=job, num_devices=devices) if c.feasible]  # fmt: skip
    # The kinds and overheads the benchmark charges (benchmarks.sim.ModeledCluster): in place at the same world size.
    return RunModel(profile=ctx.profile, job=job, candidates=candidates, switch_kind=ctx.cluster.switch_kind,
                    switch_overhead_s=ctx.cluster.overhead_s)  # fmt: skip


def run_cona(ctx: _Context) -> Run:
    from cona.orchestrator.noise import NoiseScaleEstimator
    from cona.protocol.heartbeat_record import Heartbeat

    tmp = Path(tempfile.mkdtemp(prefix="cona-ttp-"))
    try:
        model = _run_model(ctx)
        noise, throughput, cluster = model.noise, model.throughput, ctx.cluster
        scale = cluster.scale
        pol = ctx.job.policy
        strategy = model.initial_strategy()
        sim = ctx.trainer(cluster.tiny_gbs(strategy), stats=True)
        run = Run(name="cona", sequence=[{"t": 0.0, "strategy": strategy.short(), "gbs": strategy.gbs}])
        run.points.append(Point(0.0, 0, 0, sim.evaluate(), strategy.gbs))
        t, since, attempt = 0.0, 0.0, 1
        next_decision = pol.decision_interval_s
        window: list = []
        decisions: list[dict[str, Any]] = []
        noise_series: list[list[float]] = []
        hb_interval = ctx.job.heartbeat.interval_steps
        # Both estimator kinds on the same heartbeats, for the record (the policy uses `noise`, its own kind).
        side = {kind: NoiseScaleEstimator(ema=pol.noise_ema, kind=kind, min_updates=pol.min_noise_samples)
                for kind in ("plain", "adam")}  # fmt: skip
        used = None
        while sim.samples < ctx.job.target.max_samples:
            before = sim.samples
            st = sim.train_step()
            dt = cluster.iter_time_s(strategy)
            t += dt
            window.append(st)
            if sim.step % hb_interval == 0:
                hb = _heartbeat(window, strategy=strategy, step=sim.step, samples=sim.samples * scale, t=t,
                                dt=dt, scale=scale, attempt=attempt, cls=Heartbeat)  # fmt: skip
                window = []
                throughput.observe(strategy, dt)
                noise.update(hb)
                for est in side.values():
                    est.update(hb)
            if ctx.eval_due(before, sim.samples):
                v = sim.evaluate()
                run.points.append(Point(t, sim.samples, sim.step, v, strategy.gbs))
                model.val_history.append({"time": t, "samples": sim.samples * scale, "val_loss": v})
                noise_series.append([round(t, 2), round(v, 4), side["plain"].value, side["adam"].value, used])
                if v <= ctx.lowest:
                    break
            if t < next_decision:
                continue
            next_decision = t + pol.decision_interval_s
            model.live.samples = sim.samples * scale
            plan = model.decide(now=t, current=strategy, strategy_since=since, elapsed_s=0.0)
            m = (model.last_decision or {}).get("metrics", {})
            used = m.get("B_noise")
            decisions.append({"t": round(t, 2), "samples": sim.samples, "B_noise_used": m.get("B_noise"),
                              "B_noise_estimate": m.get("B_noise_estimate"), "source": m.get("noise_source"),
                              "best_gbs": (m.get("best") or {}).get("gbs"),
                              "switch_to": plan.target.short() if plan else None})  # fmt: skip
            if plan is None:
                continue
            # The trainer checkpoints at the next step boundary and goes on in place, or exits and is relaunched.
            cost = cluster.switch_s(strategy, plan.target)
            run.pauses.append((t, t + cost))
            t += cost
            model.switch_costs.observe(plan.kind, cost)
            strategy = plan.target
            sim.set_gbs(cluster.tiny_gbs(strategy))
            since, attempt = t, attempt + 1
            next_decision = t + pol.decision_interval_s
            window = []
            run.switches += 1
            run.sequence.append({"t": round(t, 2), "strategy": strategy.short(), "gbs": strategy.gbs,
                                 "reason": plan.decision.reason})  # fmt: skip
        run.extra["decisions"] = decisions
        run.extra["noise"] = noise_series
        run.extra["noise_final"] = {"value": noise.value, "kind": noise.kind, "updates": noise.num_updates}
        return run
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _heartbeat(window, *, strategy, step, samples, t, dt, scale, attempt, cls):
    """A heartbeat as `trainer.heartbeat.HeartbeatWriter` writes it, batch sizes in preset samples."""

    def mean(values):
        present = [v for v in values if v is not None]
        return sum(present) / len(present) if present else None

    return cls(
        time=t, attempt=attempt, strategy=strategy.to_dict(), step=step, samples=samples, tokens=0,
        train_loss=mean([w.loss for w in window]), lr=window[-1].lr, step_time_s=dt,
        samples_per_s=strategy.gbs / dt,
        local_sqnorm=mean([w.local_sqnorm for w in window]), local_batch=window[-1].local_batch * scale,
        global_sqnorm=mean([w.global_sqnorm for w in window]), global_batch=window[-1].global_batch * scale,
        adam_local_sqnorm=mean([w.adam_local_sqnorm for w in window]),
        adam_global_sqnorm=mean([w.adam_global_sqnorm for w in window]),
    )  # fmt: skip


def run_greedy_window(ctx: _Context, horizon_end_s: float, window_s: float) -> Run:
    """A greedy short-window sequence, for comparison only (--greedy-window-s): from the current state branch every
    candidate gbs for `window_s` modeled seconds (a branch that changes the strategy spends the switch cost in its
    window), keep the branch with the largest validation-loss drop per modeled second of training, a switch's cost
    spread over the remaining time (`horizon_end_s` − now, in hindsight), and repeat. Short windows reward the
    immediate loss drop of a larger batch (less gradient noise acts like a lower learning rate) and punish the
    transient rise of a smaller one, so this sequence drifts to ever larger batches (short-horizon bias)."""
    cluster = ctx.cluster
    sim = ctx.trainer(cluster.gbs_values[0] // cluster.scale, stats=False)
    run = Run(name="greedy window")
    v0 = sim.evaluate()
    run.points.append(Point(0.0, 0, 0, v0, 0))
    t, current, v_now = 0.0, None, v0
    windows: list[dict[str, Any]] = []
    while sim.samples < ctx.job.target.max_samples and v_now > ctx.lowest:
        start = sim.snapshot()
        remaining = max(window_s, horizon_end_s - t)
        branches = []
        for gbs in cluster.gbs_values:
            c = cluster.fastest[gbs]
            sim.restore(start)
            sim.set_gbs(gbs // cluster.scale)
            switching = current is not None and c.strategy != current
            cost = cluster.switch_s(current, c.strategy) if switching else 0.0
            tb = t + cost
            points: list[Point] = []
            dt = c.iter_time_s
            steps = 0
            while sim.samples < ctx.job.target.max_samples and (steps == 0 or tb + dt <= t + window_s):
                before = sim.samples
                sim.train_step()
                steps += 1
                tb += dt
                if ctx.eval_due(before, sim.samples):
                    points.append(Point(tb, sim.samples, sim.step, sim.evaluate(), gbs))
            if not points or points[-1].step != sim.step:
                points.append(Point(tb, sim.samples, sim.step, sim.evaluate(), gbs))
            trained_s = tb - t - cost
            rate = (v_now - points[-1].val) / trained_s
            # Staying trains the whole remaining time; switching loses `cost` of it.
            score = rate * (1.0 - cost / remaining) if switching else rate
            branches.append({"gbs": gbs, "score": score, "t_end": tb, "points": points, "cost": cost,
                             "state": sim.snapshot(), "switching": switching, "strategy": c.strategy})  # fmt: skip
        best = max(branches, key=lambda b: b["score"])
        windows.append({"t": round(t, 2), "chosen_gbs": best["gbs"], "remaining_s": round(remaining, 1),
                        "scores": {str(b["gbs"]): b["score"] for b in branches}})  # fmt: skip
        if best["strategy"] != current:
            if current is not None:
                run.switches += 1
                run.pauses.append((t, t + best["cost"]))
            run.sequence.append({"t": round(t + best["cost"], 2),
                                 "strategy": best["strategy"].short(), "gbs": best["gbs"]})  # fmt: skip
        current = best["strategy"]
        run.points.extend(best["points"])
        sim.restore(best["state"])
        t, v_now = best["t_end"], best["points"][-1].val
    run.extra["windows"] = windows
    run.extra["window_s"] = window_s
    run.extra["horizon_end_s"] = horizon_end_s
    return run


def run_workload_seed(s: Settings) -> dict[str, Any]:
    """Every fixed gbs, cona and the oracle for one workload and seed (one process)."""
    started = time.time()
    cpu0 = time.process_time()
    ctx = _Context(s)
    cluster = ctx.cluster
    if s.reuse is not None:
        # Fixed runs and the oracle do not depend on the policy: only cona is run again.
        cona = run_cona(ctx)
        _log(s, f"cona: switches {cona.switches}, TTP({ctx.lowest})={fmt_s(cona.ttp(ctx.lowest))}")
        return {**s.reuse, "cona": cona.to_dict(s.targets), "wall_s": time.time() - started,
                "cpu_s": time.process_time() - cpu0, "cluster": cluster.describe()}  # fmt: skip
    fixed: dict[int, Run] = {}
    rollouts: dict[int, Rollout] = {}
    best: float | None = None
    # The tiny job's base batch first, then outwards: the earlier runs set the cap for the later ones.
    base = ctx.job.batch.base_gbs * cluster.scale
    order = sorted(cluster.gbs_values, key=lambda g: (abs(math.log(g / base)), g))
    snap_times = tuple(k * s.segment_s for k in range(1, 64))
    for gbs in order:
        cap = s.cap * best if best is not None else None
        fixed[gbs], rollouts[gbs] = run_fixed(ctx, gbs, cap, snap_times)
        ttp = fixed[gbs].ttp(ctx.lowest)
        if ttp is not None:
            best = ttp if best is None else min(best, ttp)
        _log(s, f"fixed gbs={gbs}: {fixed[gbs].points[-1].samples} samples, TTP({ctx.lowest})={fmt_s(ttp)}")
    cona = run_cona(ctx)
    _log(s, f"cona: switches {cona.switches}, TTP({ctx.lowest})={fmt_s(cona.ttp(ctx.lowest))}")
    oracle = run_oracle(ctx, rollouts, s.segment_s)
    del rollouts
    _log(s, f"oracle: switches {oracle.switches}, TTP({ctx.lowest})={fmt_s(oracle.ttp(ctx.lowest))}")
    greedy = None
    if s.greedy_window_s:
        greedy = run_greedy_window(ctx, best if best is not None else math.inf, s.greedy_window_s)
        _log(s, f"greedy window: switches {greedy.switches}, TTP({ctx.lowest})={fmt_s(greedy.ttp(ctx.lowest))}")

    # Every fixed candidate: the run of its gbs, timed with its own iteration time.
    candidates = []
    for c in cluster.candidates:
        if c.gbs not in fixed:
            continue
        ratio = c.iter_time_s / cluster.fastest[c.gbs].iter_time_s
        candidates.append({"strategy": c.strategy.short(), "gbs": c.gbs, "iter_time_s": c.iter_time_s,
                           "ttp_s": {str(t): finite(fixed[c.gbs].ttp(t, ratio)) for t in s.targets}})  # fmt: skip
    critical = {}
    for target in s.targets:
        tiny = {g // cluster.scale: crossing(fixed[g].points, target, what="samples") for g in fixed}
        b = fitted_critical_batch(tiny)
        critical[str(target)] = None if b is None else b * cluster.scale
    return {
        "workload": s.workload,
        "seed": s.seed,
        "fitted_critical_batch": critical,
        "fixed": {str(g): r.to_dict(s.targets) for g, r in sorted(fixed.items())},
        "candidates": candidates,
        "cona": cona.to_dict(s.targets),
        "oracle": oracle.to_dict(s.targets),
        **({"greedy_window": greedy.to_dict(s.targets)} if greedy is not None else {}),
        "wall_s": time.time() - started,
        "cpu_s": time.process_time() - cpu0,
        "cluster": cluster.describe(),
    }


def _log(s: Settings, text: str) -> None:
    print(f"[{s.workload} seed {s.seed}] {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- summary


def _ratios(a: list[float | None], b: list[float | None]) -> list[float | None]:
    return [x / y if x is not None and y is not None and y > 0 else None for x, y in zip(a, b, strict=True)]


def summarize(workload: str, targets: list[float], results: list[dict[str, Any]], preset_base: int) -> dict[str, Any]:
    """Ratios per target over seeds: static (every base gbs) / cona, cona / oracle, best fixed in hindsight / cona.

    A static run that stopped (sample budget or time cap) before the target gives a lower bound on its ratio: its
    last modeled time over cona's (`lower_bound: true`)."""
    out: dict[str, Any] = {"targets": targets, "standard_batch": preset_base, "per_target": {}}
    gbs_values = sorted(int(g) for g in results[0]["fixed"])
    for target in targets:
        key = str(target)
        cona_reached = [r["cona"]["ttp_s"][key] for r in results]
        # A cona run that ran out of samples before the target: its last modeled time bounds its time from below,
        # so cona/oracle is a lower bound and every ratio over cona an upper bound (said, never averaged away).
        cona = [t if t is not None else r["cona"]["last_t_s"] for t, r in zip(cona_reached, results, strict=True)]
        missed = any(t is None for t in cona_reached)
        oracle = [r["oracle"]["ttp_s"][key] for r in results]
        best_fixed, best_fixed_which = [], []
        for r in results:
            reached = [(c["ttp_s"][key], c["strategy"]) for c in r["candidates"] if c["ttp_s"][key] is not None]
            t, which = min(reached) if reached else (None, None)
            best_fixed.append(t)
            best_fixed_which.append(which)
        # The one fixed candidate with the lowest mean time over the seeds (what a user who must pick one would pick
        # knowing these runs); the per-seed minimum above also profits from each seed's luck.
        by_candidate: dict[str, list[float | None]] = {}
        for r in results:
            for c in r["candidates"]:
                by_candidate.setdefault(c["strategy"], []).append(c["ttp_s"][key])
        complete = {k: v for k, v in by_candidate.items() if len(v) == len(results) and None not in v}
        mean_best = min(complete, key=lambda k: sum(complete[k]), default=None)
        mean_best_ttp = complete[mean_best] if mean_best else [None] * len(results)
        static_ttp, static_ratio = {}, {}
        for g in gbs_values:
            runs = [r["fixed"][str(g)] for r in results]
            static_ttp[str(g)] = spread([f["ttp_s"][key] for f in runs])
            bounded = [f["ttp_s"][key] if f["ttp_s"][key] is not None else f["last_t_s"] for f in runs]
            static_ratio[str(g)] = {**spread(_ratios(bounded, cona)),
                                    "lower_bound": any(f["ttp_s"][key] is None for f in runs), "upper_bound": missed}  # fmt: skip
        out["per_target"][key] = {
            "ttp_s": {"cona": spread(cona_reached), "oracle": spread(oracle), "best_fixed": spread(best_fixed),
                      "static": static_ttp},
            "cona_missed": [r["seed"] for t, r in zip(cona_reached, results, strict=True) if t is None],
            "best_fixed_strategy": best_fixed_which,
            "static_over_cona": static_ratio,
            "static_over_cona_at_standard_batch": static_ratio[str(preset_base)],
            "cona_over_oracle": {**spread(_ratios(cona, oracle)), "lower_bound": missed},
            "best_fixed_over_cona": {**spread(_ratios(best_fixed, cona)), "upper_bound": missed},
            "best_fixed_on_average": mean_best,
            "best_fixed_on_average_over_cona": {**spread(_ratios(mean_best_ttp, cona)), "upper_bound": missed},
            "fitted_critical_batch": spread([r["fitted_critical_batch"][key] for r in results]),
        }  # fmt: skip
        greedy = [r["greedy_window"]["ttp_s"][key] for r in results if "greedy_window" in r]
        if len(greedy) == len(results):
            out["per_target"][key]["ttp_s"]["greedy_window"] = spread(greedy)
    return out


def bounded_ratio(stats: dict[str, Any], digits: int = 2) -> str:
    """A ratio with its bound: ≥ when its numerator's run stopped short of the target, ≤ when its denominator's (cona)
    did, ? when both did (no bound)."""
    low, high = stats.get("lower_bound", False), stats.get("upper_bound", False)
    return ("?" if low and high else "≥" if low else "≤" if high else "") + fmt_ratio(stats, digits)


def mean_s(stats: dict[str, Any]) -> str:
    """A mean time over seeds, with how many seeds it is over when some never reached the target (`3 of 4`): the
    mean of the others alone, printed bare, read as every seed's."""
    per_seed = stats.get("per_seed") or []
    reached = sum(v is not None for v in per_seed)
    shown = fmt_s(stats.get("mean"))
    return shown if stats.get("mean") is None or reached == len(per_seed) else f"{shown} ({reached} of {len(per_seed)} seeds)"


def print_summary(workload: str, summary: dict[str, Any], results: list[dict[str, Any]]) -> None:
    targets = summary["targets"]
    gbs_values = sorted(int(g) for g in results[0]["fixed"])
    seeds = [r["seed"] for r in results]
    seq_rows = []
    for r in results:
        for name in ("cona", "oracle", "greedy_window"):
            if name in r:
                seq = " → ".join(f"{e['gbs']}@{e['t']:.0f}s" for e in r[name]["sequence"])
                seq_rows.append([f"seed {r['seed']} {name}", str(r[name]["switches"]), seq])
    print_table(f"{workload}: strategy sequences (preset gbs @ modeled start time)", ["run", "switches", "sequence"],
                seq_rows)  # fmt: skip
    rows = []
    for target in targets:
        p = summary["per_target"][str(target)]
        ttp = p["ttp_s"]
        rows.append([f"{target:.2f}", *(mean_s(ttp["static"][str(g)]) for g in gbs_values),
                     mean_s(ttp["best_fixed"]), mean_s(ttp["cona"]), mean_s(ttp["oracle"])])
    print_table(f"{workload}: modeled time to target, mean over seeds {seeds} (static@g: the fastest layout at gbs g)",
                ["target loss", *(f"static@{g}" for g in gbs_values), "best fixed", "cona", "oracle"], rows)
    rows = []
    for target in targets:
        p = summary["per_target"][str(target)]
        statics = [bounded_ratio(p["static_over_cona"][str(g)]) for g in gbs_values]
        rows.append([f"{target:.2f}", *statics, bounded_ratio(p["cona_over_oracle"], 3),
                     bounded_ratio(p["best_fixed_over_cona"], 3), bounded_ratio(p["best_fixed_on_average_over_cona"], 3)])
    std = summary["standard_batch"]
    print_table(f"{workload}: ratios, mean [min–max] over seeds {seeds}; the preset's standard batch is {std}; best fixed: "
                "per seed in hindsight / the one with the lowest mean",
                ["target loss", *(f"static@{g}/cona" for g in gbs_values), "cona/oracle", "best fixed/cona",
                 "best mean fixed/cona"], rows)  # fmt: skip


def plot(workload: str, results: list[dict[str, Any]], targets: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = results[0]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for g, run in r["fixed"].items():
        ev = run["evals"]
        ax.plot([e[0] for e in ev], [e[3] for e in ev], lw=0.8, alpha=0.7, label=f"fixed gbs {g}")
    for name, style in (("cona", "-"), ("oracle", "--")):
        ev = r[name]["evals"]
        ax.plot([e[0] for e in ev], [e[3] for e in ev], style, lw=2, color="k" if name == "cona" else "tab:red",
                label=name)  # fmt: skip
    for t in targets:
        ax.axhline(t, color="grey", lw=0.5, ls=":")
    ax.set_ylim(min(targets) - 0.1, max(targets) + 0.5)
    ax.set_xlabel("modeled time (s)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(f"{workload}, seed {r['seed']}")
    ax.legend(fontsize=7)
    ax = axes[1]
    for name, color in (("cona", "k"), ("oracle", "tab:red")):
        ev = r[name]["evals"]
        ax.step([e[0] for e in ev], [e[4] for e in ev], where="post", color=color, label=name)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("modeled time (s)")
    ax.set_ylabel("preset global batch")
    ax.set_title("strategy sequence")
    ax.legend(fontsize=7)
    ax = axes[2]
    noise = r["cona"].get("noise") or []
    for column, label, color in ((2, "plain estimate", "tab:blue"), (3, "Adam estimate", "tab:orange"),
                                 (4, "B_noise cona used", "k")):  # fmt: skip
        pts = [(n[1], n[column]) for n in noise if n[column] is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, label=label)
    crit = [(float(t), b) for t, b in r["fitted_critical_batch"].items() if b is not None]
    if crit:
        ax.plot([c[0] for c in crit], [c[1] for c in crit], "s", color="tab:green", label="fitted critical batch")
    ax.invert_xaxis()
    ax.set_yscale("log")
    ax.set_xlabel("validation loss")
    ax.set_ylabel("preset samples")
    ax.set_title(f"noise scale (seed {r['seed']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ttp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="GPT only, higher targets, a smaller budget (< 5 min)")
    parser.add_argument("--workloads", help="comma-separated: gpt, llama, bert (default: all; --quick: gpt)")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2,3; --quick: 0,1)")
    parser.add_argument("--scenario", choices=list(SCENARIOS), default=None,
                        help="a shipped (profile, preset) pair; results go to ttp[-quick]-<scenario>.json "
                             "(default: the reference pair, ttp[-quick].json)")
    parser.add_argument("--profile", default=None, help="cluster profile (default: the scenario's; another one's results go to "
                             "ttp[-quick]-<profile>-<preset>.json)")
    parser.add_argument("--preset", default=None, help="the full-size job whose times are charged (default: the scenario's)")
    parser.add_argument("--restart-s", type=float, default=20.0,
                        help="modeled restart part of a switch: process start, rendezvous, model build (s)")
    parser.add_argument("--relaunch-only", action="store_true",
                        help="charge every switch a relaunch (default: in place when the world size stays)")
    parser.add_argument("--segment-s", type=float, default=None,
                        help="the oracle decides every this many modeled seconds (default 500; --quick 200)")
    parser.add_argument("--greedy-window-s", type=float, default=None,
                        help="also build the greedy short-window sequence with this window (modeled s; costly)")
    parser.add_argument("--cap", type=float, default=2.0, help="stop a fixed run at this × the best fixed time")
    parser.add_argument("--policy-set", action="append", default=[], metavar="KEY=VALUE",
                        help="set a field of the jobs' policy section for cona, e.g. lr_aware=true (repeatable)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--out", default=None, help="JSON name under benchmarks/results (default ttp[-quick].json)")
    parser.add_argument("--resummarize", metavar="JSON", help="recompute tables, plots and ratios of a finished run")
    parser.add_argument("--cona-only", metavar="JSON",
                        help="rerun only cona (current code, --policy-set) against the fixed runs and oracle of a "
                             "finished run with the same workloads, seeds, scenario and budget")
    args = parser.parse_args(argv)
    for flag, value, low, strict in (("--jobs", args.jobs, 1, False), ("--cap", args.cap, 1.0, True),
                                     ("--restart-s", args.restart_s, 0.0, False),
                                     ("--segment-s", args.segment_s, 0.0, True),
                                     ("--greedy-window-s", args.greedy_window_s, 0.0, True)):  # fmt: skip
        if value is not None and (not math.isfinite(value) or value < low or (strict and value == low)):
            parser.error(f"{flag}: must be {'above' if strict else 'at least'} {low:g}, got {value:g}")
    if args.resummarize:
        path = Path(args.resummarize)
        # Back into the file given (it went to benchmarks/results/ under its name, wherever it was), or --out.
        finish(_read_report(path, "--resummarize"), args.out or path.resolve(), keep_header=True)
        return 0

    scenario_profile, scenario_preset = SCENARIOS[args.scenario or "reference"]
    args.profile = args.profile or scenario_profile
    args.preset = args.preset or scenario_preset
    if args.out is None:
        args.out = default_out(args.quick, args.scenario, args.profile, args.preset)
    # `is None`, not `or`: an empty --seeds "" was taken as "the defaults" and started training.
    names = names_arg(parser, "--workloads", ("gpt" if args.quick else "gpt,llama,bert") if args.workloads is None
                      else args.workloads, list(WORKLOADS))  # fmt: skip
    seeds = list(ints_arg(parser, "--seeds", ("0,1" if args.quick else "0,1,2,3") if args.seeds is None else args.seeds))
    segment_s = args.segment_s or (200.0 if args.quick else 500.0)
    previous = _previous_runs(args.cona_only, args=args, names=names, seeds=seeds) if args.cona_only else {}
    _check_cluster(parser, args, names)
    settings = []
    for name in names:
        w = WORKLOADS[name]
        from cona.orchestrator.job import load_job
        from cona.protocol.yamlconfig import ConfigError

        try:
            job = load_job(REPO / w["job"], [f"policy.{o}" for o in args.policy_set])
        except ConfigError as e:
            parser.error(f"--policy-set: {e}")
        settings += [
            Settings(workload=name, seed=seed, job_path=w["job"],
                     targets=w["quick_targets"] if args.quick else w["targets"],
                     max_samples=w["quick_max_samples"] if args.quick else job.target.max_samples,
                     profile_path=args.profile, preset_path=args.preset, restart_s=args.restart_s,
                     segment_s=segment_s, greedy_window_s=args.greedy_window_s, cap=args.cap,
                     in_place=not args.relaunch_only, policy_overrides=tuple(args.policy_set),
                     reuse=previous.get((name, seed)))
            for seed in seeds
        ]  # fmt: skip
    started = time.time()
    results = map_workers(run_workload_seed, settings, jobs=args.jobs)
    wall = time.time() - started
    out = results_path(args.out)
    raw = out.with_name(out.name + ".raw")
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps({"wall_s": wall, "results": results}, default=str))  # kept if the summary fails

    report: dict[str, Any] = {
        "benchmark": "ttp", "quick": args.quick, "wall_s": wall,
        "settings": {"profile": args.profile, "preset": args.preset, "restart_s": args.restart_s,
                     "in_place": not args.relaunch_only, "oracle_segment_s": segment_s, "greedy_window_s": args.greedy_window_s, "fixed_cap": args.cap,
                     "policy_set": args.policy_set, "cona_only_from": args.cona_only,
                     "seeds": seeds, "jobs": args.jobs},
        "cluster": results[0]["cluster"],
        "workloads": {name: {"job": WORKLOADS[name]["job"], "runs": [r for r in results if r["workload"] == name],
                             "targets": settings[[s.workload for s in settings].index(name)].targets}
                      for name in names},
    }  # fmt: skip
    for r in results:
        r.pop("cluster", None)
    path = finish(report, args.out)
    raw.unlink(missing_ok=True)
    return 0 if path else 1


def default_out(quick: bool, scenario: str | None, profile: str, preset: str) -> str:
    """The JSON a run writes without `--out`: `ttp[-quick].json` for the reference pair, `ttp[-quick]-<scenario>.json`
    for another shipped scenario, and named after the profile and preset (their file stems) when either is not the
    scenario's — such a run wrote the shipped results of the scenario it was not (`--profile X` alone overwrote
    `ttp-quick.json`)."""
    scenario_profile, scenario_preset = SCENARIOS[scenario or "reference"]
    def same(a: str, b: str) -> bool:  # relative to the repository, with ./, or absolute alike
        return (REPO / a).resolve() == (REPO / b).resolve()

    if not same(profile, scenario_profile) or not same(preset, scenario_preset):
        parts = [Path(profile).stem, Path(preset).stem]
    else:
        parts = [scenario] if scenario not in (None, "reference") else []
    return "-".join(["ttp" + ("-quick" if quick else ""), *parts]) + ".json"


def _previous_runs(path: str, *, args: argparse.Namespace, names: list[str], seeds: list[int]
                   ) -> dict[tuple[str, int], dict[str, Any]]:
    """The runs of a finished JSON by (workload, seed), checked to match this invocation's settings."""
    file = Path(path) if Path(path).exists() else RESULTS / path
    if not file.exists():
        raise SystemExit(f"--cona-only: {path} not found (a JSON written by an earlier run of this benchmark)")
    report = _read_report(file, "--cona-only")
    settings = report.get("settings", {})
    for key, want in (("profile", args.profile), ("preset", args.preset), ("in_place", not args.relaunch_only)):
        if settings.get(key) != want:
            raise SystemExit(f"--cona-only: {file.name} was run with {key}={settings.get(key)!r}, not {want!r}")
    if bool(report.get("quick")) != bool(args.quick):
        raise SystemExit(f"--cona-only: {file.name} was {'' if report.get('quick') else 'not '}run with --quick")
    runs = {(r["workload"], int(r["seed"])): r for w in report.get("workloads", {}).values() for r in w["runs"]}
    missing = [f"{n} seed {s}" for n in names for s in seeds if (n, s) not in runs]
    if missing:
        raise SystemExit(f"--cona-only: {file.name} has no run for {', '.join(missing)}")
    return {key: {k: v for k, v in r.items() if k not in ("cona", "wall_s", "cpu_s")} for key, r in runs.items()}


def _read_report(path: Path, flag: str) -> dict[str, Any]:
    """A finished run's JSON, or the command ends in one line naming the file (not a traceback from the parser)."""
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"{flag}: {path} not found (a JSON written by an earlier run of this benchmark)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise SystemExit(f"{flag}: {path} is not a JSON file this benchmark wrote ({e})") from None
    if not (isinstance(report, dict) and report.get("benchmark") == "ttp" and isinstance(report.get("workloads"), dict)
            and isinstance(report.get("settings"), dict)):  # fmt: skip
        raise SystemExit(f"{flag}: {path} is not a result of benchmarks.ttp (no \"benchmark\": \"ttp\" with its "
                         "settings and workloads)")  # fmt: skip
    return report


def _check_cluster(parser: argparse.ArgumentParser, args: argparse.Namespace, names: list[str]) -> None:
    """Build each workload's modeled cluster here, before any worker starts: a missing or invalid profile or preset,
    or a preset whose batches do not map onto the tiny job's, ends the command in one line naming it (in a worker it
    would end in the pool's traceback, after the other workers had started training)."""
    from cona.orchestrator.job import load_job
    from cona.orchestrator.profile import load_profile
    from cona.protocol.yamlconfig import ConfigError

    from benchmarks.sim import ModeledCluster

    try:
        profile = load_profile(REPO / args.profile)
    except ConfigError as e:
        parser.error(f"--profile: {e}")
    try:
        preset = load_job(REPO / args.preset)
    except ConfigError as e:
        parser.error(f"--preset: {e}")
    for name in names:
        try:
            ModeledCluster(profile=profile, preset_job=preset, tiny_job=load_job(REPO / WORKLOADS[name]["job"]),
                           restart_s=args.restart_s)  # fmt: skip
        except ValueError as e:
            parser.error(f"--profile {args.profile} --preset {args.preset}, workload {name}: {e}")


def _switch_costs(cluster: dict[str, Any]) -> str:
    relaunch = f"{cluster['switch_cost_s']:.1f} s by relaunch"
    in_place = cluster.get("in_place_switch_cost_s")
    return f"{in_place:.1f} s in place, {relaunch}" if in_place is not None else relaunch


def finish(report: dict[str, Any], name: str | Path, *, keep_header: bool = False) -> Path:
    """Summaries, plots, JSON and the tables, from the raw runs in `report`."""
    from cona.orchestrator.job import load_job

    preset_base = load_job(REPO / report["settings"]["preset"]).batch.base_gbs
    refresh_switching_runs(report)
    for workload, w in report["workloads"].items():
        targets = w.get("targets") or w["summary"]["targets"]
        w["summary"] = summarize(workload, targets, w["runs"], preset_base)
        png = results_path(name).parent / f"{Path(name).stem}-{workload}.png"  # ttp-gpt.png, <--out>-gpt.png beside the JSON
        plot(workload, w["runs"], targets, png)
        w["plot"] = shown(png)
    if keep_header:  # --resummarize: the machine and command are those of the run that trained
        path = results_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        report["resummarized"] = time.strftime("%Y-%m-%d %H:%M:%S")
        path.write_text(json.dumps(report, default=str) + "\n")
    else:
        path = write_json(name, report, indent=None)  # one line: every run's evaluations make it long
    c = report["cluster"]
    print(f"cluster: {c['preset']} ({c['preset_params'] / 1e6:,.0f}M) on {c['profile']}, {c['num_candidates']} "
          f"candidates, tiny gbs = preset gbs / {c['gbs_scale']}, switch {_switch_costs(c)} modeled; "
          f"wall {report['wall_s']:.0f} s; JSON {shown(path)}")  # fmt: skip
    rows = [[str(g), f["strategy"], f"{f['samples_per_s']:,.1f}" if f.get("samples_per_s") else "—",
             f"{f['iter_time_s']:.3f} s", "standard" if int(g) == preset_base else ""]
            for g, f in sorted(c["fastest_per_gbs"].items(), key=lambda item: int(item[0]))]  # fmt: skip
    print_table(f"the fastest strategy at each gbs ({c['preset']} on {c['profile']}, cost model)",
                ["gbs", "strategy", "samples/s", "iteration", ""], rows)  # fmt: skip
    for workload, w in report["workloads"].items():
        print_summary(workload, w["summary"], w["runs"])
    return path


if __name__ == "__main__":
    raise SystemExit(run_main(main))
