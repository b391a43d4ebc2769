"""Time to target validation loss: static vs every fixed strategy vs cona vs the oracle sequence.

    python -m benchmarks.ttp [--quick] [--workloads gpt,llama,bert] [--seeds 0,1]
                             [--profile slurm/profiles/a100-4x8.yaml] [--preset examples/gpt3-1.3b.yaml]

Real training of tiny models (`benchmarks/jobs/*.yaml`: byte-level GPT, Llama and BERT on the Shakespeare plays)
where every statistic is real and every iteration's time is the cost model's for the chosen strategy of a full-size
preset on a cluster profile (`benchmarks.sim` explains the simulated-time driver, the batch mapping and the
modeled switch cost). On the same seeds:

- **fixed**: every feasible candidate of the preset. Candidates with the same gbs train exactly the same tiny-model
  trajectory (the loss is layout-invariant), so one run per gbs is trained and each candidate's time to a target
  is its step count times its own iteration time.
- **static**: what an offline searcher picks — the fastest strategy at a base gbs; reported for every base gbs a
  user might pick (the preset's standard batch is its `batch.base_gbs`).
- **cona**: the shipped policy (`orchestrator.policy.ConaPolicy` with the job's `policy` section), fed by the
  shipped noise-scale estimator, throughput model and time-to-target estimate of `orchestrator.scheduler`, deciding
  every `policy.decision_interval_s` of modeled time; each switch costs the modeled switch cost.
- **oracle**: a greedy sequence built with hindsight. From the current state (an in-process checkpoint: model,
  optimizer, data position), branch every candidate gbs (its fastest layout; slower layouts at the same gbs follow
  the same trajectory more slowly) for a window of `--window-s` modeled seconds — a branch that changes the strategy
  spends the switch cost inside its window — measure the validation loss at the window's end, keep the branch with
  the largest validation-loss drop per modeled second, and repeat from its end state until the lowest target is
  reached. The first window starts from the initial launch (no switch cost for any branch).

Time to target (TTP) is the modeled time at which the validation loss first reaches the target, linearly
interpolated between evaluations (every `eval.interval_samples` samples, and at every oracle window's end).
Fixed runs stop at the lowest target or at `--cap` × the best fixed time so far; a run that never gets there is
reported as not reaching the target ("—"), and ratios that need it are left out.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, RESULTS, finite, fmt_ratio, fmt_s, print_table, spread, write_json

WORKLOADS: dict[str, dict[str, Any]] = {
    # targets in nats per target byte; the last is examples/tiny-*.yaml's val_perplexity 5.5 for GPT
    "gpt": {"job": "benchmarks/jobs/gpt.yaml", "targets": [2.0, 1.85, 1.72], "quick_targets": [2.1, 1.95],
            "quick_max_samples": 24000},
    "llama": {"job": "benchmarks/jobs/llama.yaml", "targets": [2.0, 1.85, 1.72], "quick_targets": [2.1, 1.95],
              "quick_max_samples": 24000},
    "bert": {"job": "benchmarks/jobs/bert.yaml", "targets": [2.4, 2.2, 2.05], "quick_targets": [2.5, 2.3],
             "quick_max_samples": 24000},
}  # fmt: skip


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
    window_s: float
    cap: float


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
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def ttp(self, target: float, time_scale: float = 1.0) -> float | None:
        return crossing(self.points, target, time_scale)

    def to_dict(self, targets: list[float]) -> dict[str, Any]:
        return {
            "ttp_s": {str(t): finite(self.ttp(t)) for t in targets},
            "switches": self.switches,
            "sequence": self.sequence,
            "evals": [[round(p.t, 3), p.samples, p.step, round(p.val, 5), p.gbs] for p in self.points],
            **self.extra,
        }


def crossing(points: list[Point], target: float, time_scale: float = 1.0, *, what: str = "t") -> float | None:
    """Modeled time (or `what`: samples) at which the validation loss first reaches `target`, interpolated
    linearly between the two evaluations around it."""
    for i, p in enumerate(points):
        if p.val <= target:
            if i == 0:
                return getattr(p, what) * time_scale
            q = points[i - 1]
            frac = (q.val - target) / (q.val - p.val) if q.val > p.val else 1.0
            a, b = getattr(q, what), getattr(p, what)
            return (a + frac * (b - a)) * time_scale
    return None


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
        from benchmarks.sim import ModeledCluster
        from orchestrator.profile import load_profile
        from trainer.data import Batcher, load_corpus
        from trainer.job import load_job
        from trainer.parallel import init_distributed

        self.s = s
        overrides = [f"seed={s.seed}", f"target.max_samples={s.max_samples}"]
        self.job = load_job(REPO / s.job_path, overrides)
        if not Path(self.job.data.path).is_absolute():
            self.job.data.path = str(REPO / self.job.data.path)
        self.profile = load_profile(REPO / s.profile_path)
        self.preset = load_job(REPO / s.preset_path)
        self.cluster = ModeledCluster(profile=self.profile, preset_job=self.preset, tiny_job=self.job,
                                      restart_s=s.restart_s)  # fmt: skip
        self.env = init_distributed()
        self.batcher = Batcher(self.job, load_corpus(self.job))
        self.lowest = min(s.targets)
        self.eval_interval = self.job.eval.interval_samples

    def trainer(self, gbs: int, *, stats: bool):
        from benchmarks.sim import SimTrainer

        return SimTrainer(self.job, self.batcher, self.env, gbs=gbs, stats=stats)

    def eval_due(self, before: int, after: int) -> bool:
        return after // self.eval_interval > before // self.eval_interval


def run_fixed(ctx: _Context, gbs: int, cap_s: float | None) -> Run:
    """The fastest layout at `gbs` (every other layout at this gbs: the same points, times scaled)."""
    c = ctx.cluster.fastest[gbs]
    dt = c.iter_time_s
    sim = ctx.trainer(gbs // ctx.cluster.scale, stats=False)
    run = Run(name=f"fixed gbs={gbs}", sequence=[{"t": 0.0, "strategy": c.strategy.short(), "gbs": gbs}])
    run.points.append(Point(0.0, 0, 0, sim.evaluate(), gbs))
    while sim.samples < ctx.job.target.max_samples:
        before = sim.samples
        sim.train_step()
        t = sim.step * dt
        if ctx.eval_due(before, sim.samples):
            run.points.append(Point(t, sim.samples, sim.step, sim.evaluate(), gbs))
            if run.points[-1].val <= ctx.lowest:
                break
        if cap_s is not None and t >= cap_s:
            run.extra["stopped"] = f"modeled time cap {cap_s:.0f} s"
            break
    run.extra["iter_time_s"] = dt
    return run


def _scheduler(ctx: _Context, tmp: Path):
    """The shipped scheduler's statistics, policy and ETA, for the preset job with the tiny job's policy/target."""
    from orchestrator.backends.base import Attempt, Backend, Outcome
    from orchestrator.scheduler import Scheduler
    from trainer.job import TargetSpec
    from trainer.rundir import RunDir

    class NoBackend(Backend):
        name = "simulated"

        def launch(self, *, attempt: int, strategy, previous=None) -> Attempt:  # pragma: no cover - never called
            raise RuntimeError("simulated runs launch nothing")

        def poll(self, attempt: Attempt) -> Outcome:  # pragma: no cover
            raise RuntimeError("simulated runs poll nothing")

        def cancel(self, attempt: Attempt) -> None:  # pragma: no cover
            pass

    target = TargetSpec(val_perplexity=math.exp(ctx.lowest), max_samples=ctx.job.target.max_samples * ctx.cluster.scale)
    job = ctx.preset.model_copy(update={"policy": ctx.job.policy, "target": target})
    run_dir = RunDir(tmp)
    return Scheduler(run_dir=run_dir, profile=ctx.profile, job=job, backend=NoBackend(run_dir=run_dir))


def run_cona(ctx: _Context) -> Run:
    from orchestrator.backends.base import Attempt
    from orchestrator.noise import NoiseScaleEstimator
    from orchestrator.policy import DecisionContext
    from trainer.heartbeat_record import Heartbeat

    tmp = Path(tempfile.mkdtemp(prefix="cona-ttp-"))
    try:
        sched = _scheduler(ctx, tmp)
        policy, noise, throughput, cluster = sched.policy, sched.noise, sched.throughput, ctx.cluster
        scale = cluster.scale
        pol = ctx.job.policy
        strategy = policy.initial(candidates=sched.candidates, throughput=throughput, samples=0)
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
                sched.state.setdefault("val_history", []).append({"time": t, "samples": sim.samples * scale, "val_loss": v})
                noise_series.append([round(t, 2), round(v, 4), side["plain"].value, side["adam"].value, used])
                if v <= ctx.lowest:
                    break
            if t < next_decision:
                continue
            next_decision = t + pol.decision_interval_s
            sched.live.samples = sim.samples * scale
            current = Attempt(number=attempt, strategy=strategy, started_at=since)
            dc = DecisionContext(
                now=t, samples=sim.samples * scale, current=strategy, candidates=sched.candidates,
                throughput=throughput, noise_scale=noise.value, noise_stable=noise.stable,
                switch_cost_s=sched._switch_cost(), last_switch_time=since,
                remaining_time_s=sched._remaining_time(current),
            )  # fmt: skip
            decision = policy.decide(dc)
            m = decision.metrics
            used = m.get("B_noise")
            decisions.append({"t": round(t, 2), "samples": sim.samples, "B_noise_used": m.get("B_noise"),
                              "B_noise_estimate": m.get("B_noise_estimate"), "source": m.get("noise_source"),
                              "best_gbs": (m.get("best") or {}).get("gbs"),
                              "switch_to": decision.switch_to.short() if decision.switch_to else None})  # fmt: skip
            if decision.switch_to is None or decision.switch_to == strategy:
                continue
            # The trainer checkpoints at the next step boundary, exits, and the new attempt resumes.
            t += cluster.switch_cost_s
            sched.state.setdefault("switch_costs", []).append(cluster.switch_cost_s)
            strategy = decision.switch_to
            sim.set_gbs(cluster.tiny_gbs(strategy))
            since, attempt = t, attempt + 1
            next_decision = t + pol.decision_interval_s
            window = []
            run.switches += 1
            run.sequence.append({"t": round(t, 2), "strategy": strategy.short(), "gbs": strategy.gbs,
                                 "reason": decision.reason})  # fmt: skip
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


def run_oracle(ctx: _Context, horizon_end_s: float) -> Run:
    """The greedy hindsight sequence (see the module docstring); `horizon_end_s` is when the run ends in hindsight
    (the best fixed strategy's time to the lowest target), over which a switch's cost is spread."""
    cluster = ctx.cluster
    window_s, cost = ctx.s.window_s, cluster.switch_cost_s
    sim = ctx.trainer(cluster.gbs_values[0] // cluster.scale, stats=False)
    run = Run(name="oracle")
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
            tb = t + (cost if switching else 0.0)
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
            trained_s = tb - t - (cost if switching else 0.0)
            rate = (v_now - points[-1].val) / trained_s
            # Staying trains the whole remaining time; switching loses `cost` of it.
            score = rate * (1.0 - cost / remaining) if switching else rate
            branches.append({"gbs": gbs, "score": score, "t_end": tb, "points": points,
                             "state": sim.snapshot(), "switching": switching, "strategy": c.strategy})  # fmt: skip
        best = max(branches, key=lambda b: b["score"])
        windows.append({"t": round(t, 2), "chosen_gbs": best["gbs"], "remaining_s": round(remaining, 1),
                        "scores": {str(b["gbs"]): b["score"] for b in branches}})  # fmt: skip
        if best["strategy"] != current:
            if current is not None:
                run.switches += 1
            run.sequence.append({"t": round(t + (cost if best["switching"] else 0.0), 2),
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
    fixed: dict[int, Run] = {}
    best: float | None = None
    # The tiny job's base batch first, then outwards: the earlier runs set the cap for the later ones.
    base = ctx.job.batch.base_gbs * cluster.scale
    order = sorted(cluster.gbs_values, key=lambda g: (abs(math.log(g / base)), g))
    for gbs in order:
        cap = s.cap * best if best is not None else None
        fixed[gbs] = run_fixed(ctx, gbs, cap)
        ttp = fixed[gbs].ttp(ctx.lowest)
        if ttp is not None:
            best = ttp if best is None else min(best, ttp)
        _log(s, f"fixed gbs={gbs}: {fixed[gbs].points[-1].samples} samples, TTP({ctx.lowest})={fmt_s(ttp)}")
    cona = run_cona(ctx)
    _log(s, f"cona: switches {cona.switches}, TTP({ctx.lowest})={fmt_s(cona.ttp(ctx.lowest))}")
    oracle = run_oracle(ctx, best if best is not None else math.inf)
    _log(s, f"oracle: switches {oracle.switches}, TTP({ctx.lowest})={fmt_s(oracle.ttp(ctx.lowest))}")

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
        "wall_s": time.time() - started,
        "cpu_s": time.process_time() - cpu0,
        "cluster": cluster.describe(),
    }


def _log(s: Settings, text: str) -> None:
    print(f"[{s.workload} seed {s.seed}] {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- summary


def summarize(workload: str, targets: list[float], results: list[dict[str, Any]], preset_base: int) -> dict[str, Any]:
    """Ratios per target over seeds: static (every base gbs) / cona, cona / oracle, best fixed in hindsight / cona."""
    out: dict[str, Any] = {"targets": targets, "per_target": {}}
    gbs_values = sorted(int(g) for g in results[0]["fixed"])
    for target in targets:
        key = str(target)
        cona = [r["cona"]["ttp_s"][key] for r in results]
        oracle = [r["oracle"]["ttp_s"][key] for r in results]
        best_fixed = []
        best_fixed_which = []
        for r in results:
            reached = [(c["ttp_s"][key], c["strategy"]) for c in r["candidates"] if c["ttp_s"][key] is not None]
            t, which = min(reached) if reached else (None, None)
            best_fixed.append(t)
            best_fixed_which.append(which)
        static = {str(g): [r["fixed"][str(g)]["ttp_s"][key] for r in results] for g in gbs_values}

        def ratio(a: list[float | None], b: list[float | None]) -> list[float | None]:
            return [x / y if x is not None and y is not None and y > 0 else None for x, y in zip(a, b, strict=True)]

        out["per_target"][key] = {
            "ttp_s": {
                "cona": spread(cona), "oracle": spread(oracle), "best_fixed": spread(best_fixed),
                "static": {g: spread(v) for g, v in static.items()},
            },
            "best_fixed_strategy": best_fixed_which,
            "static_over_cona": {g: spread(ratio(v, cona)) for g, v in static.items()},
            "static_over_cona_at_standard_batch": spread(ratio(static[str(preset_base)], cona)),
            "cona_over_oracle": spread(ratio(cona, oracle)),
            "best_fixed_over_cona": spread(ratio(best_fixed, cona)),
            "fitted_critical_batch": spread([r["fitted_critical_batch"][key] for r in results]),
        }  # fmt: skip
    return out


def print_summary(workload: str, summary: dict[str, Any], results: list[dict[str, Any]], preset_base: int) -> None:
    targets = summary["targets"]
    gbs_values = sorted(int(g) for g in results[0]["fixed"])
    rows = []
    for target in targets:
        p = summary["per_target"][str(target)]
        ttp = p["ttp_s"]
        row = [f"{target:.2f}"]
        row += [fmt_s(ttp["static"][str(g)]["mean"]) for g in gbs_values]
        row += [fmt_s(ttp["best_fixed"]["mean"]), fmt_s(ttp["cona"]["mean"]), fmt_s(ttp["oracle"]["mean"])]
        row += [fmt_ratio(p["static_over_cona_at_standard_batch"]), fmt_ratio(p["cona_over_oracle"], 3),
                fmt_ratio(p["best_fixed_over_cona"], 3)]  # fmt: skip
        rows.append(row)
    columns = ["target loss"] + [f"static@{g}" for g in gbs_values]
    columns += ["best fixed", "cona", "oracle", f"static@{preset_base}/cona", "cona/oracle", "best fixed/cona"]
    print_table(f"{workload}: modeled time to target (mean over seeds {[r['seed'] for r in results]}; "
                "ratios mean [min–max])", columns, rows)  # fmt: skip
    seq_rows = []
    for r in results:
        for name in ("cona", "oracle"):
            seq = " → ".join(f"{e['gbs']}@{e['t']:.0f}s" for e in r[name]["sequence"])
            seq_rows.append([f"seed {r['seed']} {name}", str(r[name]["switches"]), seq])
    print_table(f"{workload}: strategy sequences (preset gbs @ modeled start time)", ["run", "switches", "sequence"],
                seq_rows)  # fmt: skip


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
    ax.set_title("noise scale (seed 0)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ttp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="GPT only, higher targets, a smaller budget (< 5 min)")
    parser.add_argument("--workloads", help="comma-separated: gpt, llama, bert (default: all; --quick: gpt)")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds (default 0,1)")
    parser.add_argument("--profile", default="slurm/profiles/a100-4x8.yaml")
    parser.add_argument("--preset", default="examples/gpt3-1.3b.yaml", help="the full-size job whose times are charged")
    parser.add_argument("--restart-s", type=float, default=20.0,
                        help="modeled restart part of a switch: process start, rendezvous, model build (s)")
    parser.add_argument("--window-s", type=float, default=None, help="oracle window, modeled s (default 120; quick 60)")
    parser.add_argument("--cap", type=float, default=2.0, help="stop a fixed run at this × the best fixed time")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--out", default=None, help="JSON name under benchmarks/results (default ttp[-quick].json)")
    args = parser.parse_args(argv)

    names = (args.workloads or ("gpt" if args.quick else "gpt,llama,bert")).split(",")
    for name in names:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; valid: {', '.join(WORKLOADS)}")
    seeds = [int(x) for x in args.seeds.split(",")]
    window_s = args.window_s or (60.0 if args.quick else 120.0)
    settings = []
    for name in names:
        w = WORKLOADS[name]
        from trainer.job import load_job

        job = load_job(REPO / w["job"])
        settings += [
            Settings(workload=name, seed=seed, job_path=w["job"],
                     targets=w["quick_targets"] if args.quick else w["targets"],
                     max_samples=w["quick_max_samples"] if args.quick else job.target.max_samples,
                     profile_path=args.profile, preset_path=args.preset, restart_s=args.restart_s,
                     window_s=window_s, cap=args.cap)
            for seed in seeds
        ]  # fmt: skip
    started = time.time()
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            results = pool.map(run_workload_seed, settings, chunksize=1)
    else:
        results = [run_workload_seed(s) for s in settings]
    wall = time.time() - started

    from trainer.job import load_job

    preset_base = load_job(REPO / args.preset).batch.base_gbs
    report: dict[str, Any] = {
        "benchmark": "ttp", "quick": args.quick, "wall_s": wall,
        "settings": {"profile": args.profile, "preset": args.preset, "restart_s": args.restart_s,
                     "oracle_window_s": window_s, "fixed_cap": args.cap, "seeds": seeds, "jobs": args.jobs},
        "cluster": results[0]["cluster"], "workloads": {},
    }  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    for name in names:
        mine = [r for r in results if r["workload"] == name]
        targets = settings[[s.workload for s in settings].index(name)].targets
        summary = summarize(name, targets, mine, preset_base)
        png = RESULTS / f"ttp{suffix}-{name}.png"
        plot(name, mine, targets, png)
        for r in mine:
            r.pop("cluster", None)
        report["workloads"][name] = {"job": WORKLOADS[name]["job"], "summary": summary, "runs": mine,
                                     "plot": str(png.relative_to(REPO))}  # fmt: skip
    path = write_json(args.out or f"ttp{suffix}.json", report)
    c = report["cluster"]
    print(f"cluster: {c['preset']} ({c['preset_params'] / 1e6:,.0f}M) on {c['profile']}, {c['num_candidates']} "
          f"candidates, tiny gbs = preset gbs / {c['gbs_scale']}, switch {c['switch_cost_s']:.1f} s modeled; "
          f"wall {wall:.0f} s; JSON {path.relative_to(REPO)}")  # fmt: skip
    for name in names:
        print_summary(name, report["workloads"][name]["summary"], report["workloads"][name]["runs"], preset_base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
