"""How far from its best learning rate does each batch train? The per-step LR excess, measured along fixed-gbs runs.

    python -m benchmarks.noise_floor [--workloads gpt,llama,bert] [--batches 16,64,128] [--samples N]
                                     [--window 8000] [--seed 0] [--out noise-floor.json]

cona ranks batches by R = X/(B + B_noise), which assumes every batch trains at its best learning rate (McCandlish
et al. 2018). This measures how far the job's LR schedule is from that, at each state of a real run, without a
model of the curvature. Along a run at a fixed gbs (the tiny workloads of `benchmarks/jobs/*.yaml`, their LR rule),
every step t records two unbiased quantities:

- **a = g(θₜ₊₁; bₜ₊₁) · Δₜ**: the next step's gradient (an independent batch, unclipped) along this step's update
  Δₜ = θₜ₊₁ − θₜ. In expectation it is G(θₜ₊₁)·Δ = G(θₜ)·Δ + ΔᵀHΔ.
- **s = L(θₜ₊₁; bₜ₊₁) − L(θₜ; bₜ₊₁)**: the loss change of the step on the next batch (paired: one extra forward of
  bₜ₊₁ before the step), in expectation G(θₜ)·Δ + ½ΔᵀHΔ.

In the quadratic model the step's first-order progress is F = −G·Δ = a − 2s and its curvature-plus-noise cost
½ΔᵀHΔ = a − s, so the loss keeps ρ = −s/F of the first-order progress, and the LR is r = 2(a − s)/(a − 2s) times the
best LR for this batch at this state (r = 1: ρ = ½ and a = 0, the best step; r = 2: ρ = 0, the step's progress is
all lost to noise — the batch trains at its noise floor, and the loss falls only as the schedule decays the LR).
Both are means over windows of `--window` samples (standard errors from the steps' spread).

A second table puts the measured r into the per-step model that R = X/(B + B_noise) rests on, for GPT charged as
gpt3-1.3b on the reference profile (`benchmarks.ttp`'s default scenario): a step of batch B' at r' times its best LR
makes 2r' − r'² of the best step's progress, with r' = r·(f(B')/f(B))·(1 + B_noise/B')/(1 + B_noise/B) for the
running batch B at the measured r (its median over the windows after warm-up), f the job's LR rule — the ranking
`policy.lr_aware` makes, with r measured instead of assumed 1 at the base batch. It prints each batch's R relative
to the running one's for a range of B_noise (preset samples).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from typing import Any

from benchmarks.common import (
    REPO,
    batches_arg,
    map_workers,
    names_arg,
    print_table,
    run_main,
    shown,
    write_json,
)
from benchmarks.ttp import WORKLOADS as TTP_WORKLOADS

WORKLOADS = {name: w["job"] for name, w in TTP_WORKLOADS.items()}
"""The tiny workloads' job files, as `benchmarks.ttp` trains them."""


@dataclasses.dataclass(frozen=True)
class Settings:
    workload: str
    gbs: int
    samples: int | None
    """Samples to train; None: the job's budget (`target.max_samples`, over which its cosine schedule decays)."""
    window: int
    seed: int


def excess(a: float, s: float) -> tuple[float | None, float | None]:
    """(r, ρ) from the window means of a and s: the LR over the best LR for the batch, and the kept fraction of the
    first-order progress; None where the first-order progress is not positive (the quadratic model does not apply)."""
    first_order = a - 2.0 * s
    if first_order <= 0:
        return None, None
    return 2.0 * (a - s) / first_order, -s / first_order


RANK_NOISE_SCALES = (100, 200, 400, 800, 1600)
"""B_noise values (preset samples) of the per-step ranking table: the plain estimate × the default factor 3 spans
about 300 to 1,900 over the reference runs (docs/benchmarks.md)."""


def per_step_ranking(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each GPT run: R(B')/R(B) of every preset batch under the per-step model with the run's measured r."""
    from cona.orchestrator.job import load_job
    from cona.orchestrator.policy import MIN_LR_EFFICIENCY
    from cona.protocol.lr import lr_scale_factor

    from benchmarks.ttp import scenario_cluster

    job = load_job(REPO / WORKLOADS["gpt"])
    cluster = scenario_cluster(job)
    rule = job.optimizer

    def factor(tiny_gbs: int) -> float:
        return lr_scale_factor(gbs=tiny_gbs, base_gbs=job.batch.base_gbs, rule=rule.lr_scaling, cap=rule.lr_scaling_cap)

    rows = []
    for run in results:
        measured = [w["r"] for w in run["windows"][1:] if w["r"] is not None]
        if run["workload"] != "gpt" or not measured:
            continue
        r = statistics.median(measured)
        current = run["gbs"] * cluster.scale
        for noise in RANK_NOISE_SCALES:
            rate = {}
            for gbs, c in cluster.fastest.items():
                r_b = r * factor(gbs // cluster.scale) / factor(run["gbs"]) * (1 + noise / gbs) / (1 + noise / current)
                rate[gbs] = c.samples_per_s / (gbs + noise) * max(MIN_LR_EFFICIENCY, 2 * r_b - r_b * r_b)
            rows.append({"gbs": current, "r": r, "B_noise": noise, "best": max(rate, key=rate.__getitem__),
                         "relative_R": {str(g): v / rate[current] for g, v in rate.items()}})  # fmt: skip
    return rows


def _mean_se(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0)


def measure(s: Settings) -> dict[str, Any]:
    """One fixed-gbs run of one workload: a and s per step, summarised per window."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from benchmarks.sim import tiny_trainer

    sim = tiny_trainer(WORKLOADS[s.workload], seed=s.seed, gbs=s.gbs, stats=False)
    job = sim.job
    params = list(sim.model.parameters())
    max_norm = job.optimizer.grad_clip

    def flat(tensors) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).double() for t in tensors])

    def loss_on(start: int, end: int) -> float:
        batch = sim.batcher.samples(start, end)
        loss_sum, count = sim.model.eval_sums(torch.from_numpy(np.ascontiguousarray(batch.inputs)),
                                              torch.from_numpy(np.ascontiguousarray(batch.labels)))  # fmt: skip
        return loss_sum / max(1.0, count)

    windows: list[dict[str, Any]] = []
    a_values: list[float] = []
    s_values: list[float] = []
    delta = None
    next_at_old = None
    budget = s.samples or job.target.max_samples
    while sim.samples < budget:
        start = sim.samples
        next_loss = loss_on(start + s.gbs, start + 2 * s.gbs)  # bₜ₊₁ at θₜ
        theta = flat(params)
        st = sim.train_step()
        # The step clipped p.grad in place: undo it for the unclipped gradient of this step's batch.
        coefficient = 1.0 if max_norm is None else min(1.0, max_norm / (math.sqrt(st.global_sqnorm) + 1e-6))
        if delta is not None:
            a_values.append(float(flat(p.grad for p in params) @ delta) / coefficient)
            s_values.append(st.loss - next_at_old)
        delta = flat(params) - theta
        next_at_old = next_loss
        if (sim.samples // s.window > start // s.window or sim.samples >= budget) and a_values:
            a, a_se = _mean_se(a_values)
            s_mean, s_se = _mean_se(s_values)
            r, rho = excess(a, s_mean)
            windows.append({
                "samples_end": sim.samples, "steps": len(a_values), "val_loss": sim.evaluate(), "lr": st.lr,
                "a": a, "a_se": a_se, "s": s_mean, "s_se": s_se, "r": r, "rho": rho,
            })  # fmt: skip
            a_values, s_values = [], []
    return {"workload": s.workload, "gbs": s.gbs, "job": WORKLOADS[s.workload], "windows": windows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.noise_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="gpt,llama,bert", help="comma-separated: gpt, llama, bert")
    parser.add_argument("--batches", default="16,64,128", help="global batches, tiny samples (even)")
    parser.add_argument("--samples", type=int, default=None,
                        help="samples each run trains (default: the job's budget, over which its LR schedule decays)")
    parser.add_argument("--window", type=int, default=8000, help="samples per reported window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--out", default="noise-floor.json", help="JSON name under benchmarks/results")
    args = parser.parse_args(argv)
    names = names_arg(parser, "--workloads", args.workloads, list(WORKLOADS))
    batches = batches_arg(parser, "--batches", args.batches)
    if args.window <= 0 or (args.samples is not None and not 0 < args.window <= args.samples):
        parser.error(f"--window must lie in (0, --samples], got {args.window}")
    settings = [Settings(workload=n, gbs=b, samples=args.samples, window=args.window, seed=args.seed)
                for n in names for b in batches]  # fmt: skip
    started = time.time()
    results = map_workers(measure, settings, jobs=args.jobs)
    ranking = per_step_ranking(results)
    report = {"benchmark": "noise_floor", "wall_s": time.time() - started,
              "settings": {"batches": batches, "samples": args.samples, "window": args.window, "seed": args.seed},
              "runs": results, "per_step_ranking": ranking}  # fmt: skip
    path = write_json(args.out, report)

    def fmt(x: float | None, digits: int = 2) -> str:
        return "—" if x is None else f"{x:.{digits}f}"

    table = [
        [r["workload"], str(r["gbs"]), str(w["samples_end"]), f"{w['val_loss']:.3f}", f"{w['lr']:.2e}",
         f"{w['a']:+.2e} ± {w['a_se']:.0e}", f"{w['s']:+.2e} ± {w['s_se']:.0e}", fmt(w["r"]), fmt(w["rho"])]
        for r in results for w in r["windows"]
    ]  # fmt: skip
    print_table("LR over the best LR for the batch (r) and the kept fraction of first-order progress (ρ), per window",
                ["workload", "gbs (tiny)", "samples", "val loss", "lr", "a = g'·Δ", "s (paired ΔL)", "r", "ρ"], table)
    if ranking:
        sizes = list(ranking[0]["relative_R"])
        print_table("GPT on the reference profile: R of each preset gbs over the running one's, per-step model with the "
                    "measured r", ["running gbs", "r", "B_noise", *sizes, "best"],
                    [[str(x["gbs"]), f"{x['r']:.2f}", str(x["B_noise"]), *(f"{x['relative_R'][g]:.2f}" for g in sizes),
                      str(x["best"])] for x in ranking])  # fmt: skip
    print(f"wall {report['wall_s']:.0f} s; JSON {shown(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
