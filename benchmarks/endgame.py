"""What a jump to a larger batch buys late in a run, per sample: the batch, or the learning rate it gets?

    python -m benchmarks.endgame [--workloads gpt,llama] [--seeds 0,1] [--states 24000,32000] [--samples 8192]
                                 [--batches 64,128] [--to-target] [--draws 96]
                                 [--out endgame.json]

The TTP oracle (`benchmarks.ttp`) ends every reference seed with a jump to the largest batch, and R = X/(B + B_noise)
does not predict it. This separates the two things such a jump changes. Each tiny workload (`benchmarks/jobs/*.yaml`)
is trained at its base batch to each of `--states` samples; from that state (an in-process checkpoint: model, AdamW
moments, data position) each branch trains the same `--samples` further samples and is judged by its validation loss
there — per sample, not per modeled second, so throughput plays no part:

- **base**: the base batch, the job's LR schedule (staying);
- **B (rule)**: each of `--batches` with the LR the job's rule gives it, as the trainer computes it (√ scaling
  of the peak from the base batch, capped at `optimizer.lr_scaling_cap`; the same cosine and `min_lr`);
- **B (uncapped)**: the largest batch at the base batch's LR times the √ factor without the cap;
- **base × c**: the base batch at its LR times c = (the capped factor / the uncapped one) of the largest batch,
  the LR cut the cap makes there, and times 0.5.

If the batch itself mattered, the largest batch would beat staying whatever its LR; if only the LR it gets matters
(Adam's √ rule keeps batches equivalent per sample below the critical batch), the uncapped branch matches staying and
the capped one matches the base batch at the same LR cut.

At each state it also measures what the stationary theory of preconditioned SGD predicts an LR cut buys: with
AdamW's preconditioner P = 1/(√v̂ + ε) (the state's second moments after one more step), an LR η and a batch B, the loss sits
E = η·tr(PΣ)/(4B) above the bottom of its valley (Σ: the per-sample gradient covariance, from `--draws` gradients
of 4 fresh samples each, never trained on by any branch), so a cut of the LR by a factor f predicts a drop of
(1 − f)·E once the iterates have settled. The 8,192-sample table prints the measured drop of each LR-cut branch
over that prediction (`realized`): a run could measure E online, so this says how far it would predict the end
game.

Any LR cut gains over a short horizon. `--to-target` judges each branch where the TTP oracle judges its own: it
trains until the validation loss reaches the workload's lowest `benchmarks.ttp` target (evaluated every
`eval.interval_samples`, interpolated; or the job's budget), and reports the samples to it and the modeled seconds
on the reference profile (`benchmarks.ttp`'s default scenario: each branch at its batch's fastest layout).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import os
import statistics
import time
from typing import Any

from benchmarks.common import (
    REPO,
    batches_arg,
    ints_arg,
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
    seed: int
    states: tuple[int, ...]
    samples: int
    batches: tuple[int, ...]
    target: float | None = None
    """Train each branch to this validation loss instead of `samples` samples."""
    draws: int = 96
    """Gradients of `EXCESS_BATCH` fresh samples each for tr(PΣ) at each state (`excess_loss`)."""


def branches(job: Any, batches: tuple[int, ...]) -> list[tuple[str, int, float | None]]:
    """(name, gbs, LR factor) of every branch; a factor of None is the job's own rule at that gbs, any other
    multiplies the base batch's LR."""
    from cona.protocol.lr import lr_scale_factor

    base, rule, cap = job.batch.base_gbs, job.optimizer.lr_scaling, job.optimizer.lr_scaling_cap
    largest = max(batches)
    capped = lr_scale_factor(gbs=largest, base_gbs=base, rule=rule, cap=cap)
    uncapped = lr_scale_factor(gbs=largest, base_gbs=base, rule=rule, cap=math.inf)
    cut = capped / uncapped
    out: list[tuple[str, int, float | None]] = [(f"base {base}", base, 1.0)]
    out += [(f"{b} (rule ×{lr_scale_factor(gbs=b, base_gbs=base, rule=rule, cap=cap):.2f})", b, None) for b in batches]
    if cut < 1.0:
        out.append((f"{largest} (uncapped ×{uncapped:.2f})", largest, uncapped))
        out.append((f"base × {cut:.2f}", base, cut))
    out.append(("base × 0.50", base, 0.5))
    return out


def _crossing(points: list[tuple[int, float]], target: float) -> float | None:
    """Samples at which the loss first reaches `target`, linearly interpolated between evaluations; None if never."""
    if points and points[0][1] <= target:
        return points[0][0]
    for (n0, v0), (n1, v1) in itertools.pairwise(points):
        if v1 <= target:
            return n0 + (n1 - n0) * (v0 - target) / (v0 - v1)
    return None


def modeled_seconds(rows: list[dict[str, Any]], workload: str) -> None:
    """Add `modeled_s_to_target`: the samples to the target at the branch's batch on the reference profile's fastest
    layout (tiny samples × the batch mapping / that layout's samples per second)."""
    from cona.orchestrator.job import load_job

    from benchmarks.ttp import scenario_cluster

    cluster = scenario_cluster(load_job(REPO / WORKLOADS[workload]))
    for row in rows:
        n = row.get("samples_to_target")
        fastest = cluster.fastest.get(row["gbs"] * cluster.scale)
        row["modeled_s_to_target"] = None if n is None or fastest is None else n * cluster.scale / fastest.samples_per_s


EXCESS_BATCH = 4
"""Samples per gradient draw of `excess_loss` (small: the draws' spread is then mostly noise, not signal)."""


def excess_loss(sim: Any, *, draws: int, first_sample: int) -> dict[str, float]:
    """tr(PΣ) at the trainer's current state and the excess loss E = η·tr(PΣ)/(4B) it implies at the base batch B and
    the job's LR there. P = 1/(√v̂ + ε) is the denominator AdamW divides the next step by: the state's second moments
    after one more base-batch gradient, v̂' = (β₂·v + (1 − β₂)·E[g_B²]) / (1 − β₂^(t+1)). Taking v̂ alone, a
    coordinate that has seen no gradient for many steps (a rare byte's embedding row, v decayed towards 0) made
    tr(PΣ) 5–100× larger on some states, although Adam never divides by that stale value. Σ and E[g_B²] are
    estimated unbiasedly from `draws` gradients of `EXCESS_BATCH` samples starting at `first_sample` (each
    coordinate's sample variance is Σᵢᵢ/EXCESS_BATCH). The state is left as it was."""
    import torch
    from cona.protocol.lr import job_learning_rate

    job, base, snap = sim.job, sim.gbs, sim.snapshot()
    sim.set_gbs(EXCESS_BATCH)
    model = sim.model
    (optimizer,) = model.optimizers
    params = [p for p in model.parameters() if p in optimizer.state and "exp_avg_sq" in optimizer.state[p]]
    assert params, "excess_loss needs a state with AdamW moments (trained at least one step)"
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    squares = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for k in range(draws):
        start = first_sample + k * EXCESS_BATCH
        batch = sim.batcher.samples(start, start + EXCESS_BATCH)
        model.zero_grad()
        model.forward_backward(torch.from_numpy(batch.inputs.copy()), torch.from_numpy(batch.labels.copy()),
                               scale=1.0 / max(1, batch.num_targets))  # fmt: skip
        for t, q, p in zip(total, squares, params, strict=True):
            g = p.grad.double()
            t += g
            q += g * g
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    trace = 0.0
    for t, q, p in zip(total, squares, params, strict=True):
        state, group = optimizer.state[p], group_of[id(p)]
        beta2, step = group["betas"][1], float(state["step"])
        variance = (q - t * t / draws) / (draws - 1)  # per coordinate: Σᵢᵢ / EXCESS_BATCH
        mean_sq = (t / draws) ** 2 - variance / draws  # unbiased |G|² per coordinate
        expected_sq = (mean_sq + variance * EXCESS_BATCH / base).clamp(min=0)  # E[g_B²] at the base batch
        v_next = (beta2 * state["exp_avg_sq"].double() + (1 - beta2) * expected_sq) / (1 - beta2 ** (step + 1))
        trace += float((variance / (v_next.sqrt() + group["eps"])).sum()) * EXCESS_BATCH
    model.zero_grad()
    sim.restore(snap)
    lr = job_learning_rate(job, samples=snap.samples, gbs=base)
    return {"tr_p_sigma": trace, "lr": lr, "batch": base, "excess": lr * trace / (4 * base)}


def measure(s: Settings) -> dict[str, Any]:
    """Every branch from every state of one (workload, seed): the validation loss after `samples` samples."""
    import torch

    torch.set_num_threads(1)
    from cona.protocol.lr import job_learning_rate

    from benchmarks.sim import tiny_trainer

    sim = tiny_trainer(WORKLOADS[s.workload], seed=s.seed, stats=False)
    job = sim.job
    base = job.batch.base_gbs
    interval = job.eval.interval_samples
    rows = []
    for state in sorted(s.states):
        sim.set_gbs(base)
        while sim.samples < state:
            sim.train_step()
        snap, val = sim.snapshot(), sim.evaluate()
        # Fresh samples: past the job's budget, where no branch trains.
        excess = excess_loss(sim, draws=s.draws, first_sample=job.target.max_samples + state) if s.draws else None
        for name, gbs, factor in branches(job, s.batches):
            sim.restore(snap)
            sim.set_gbs(gbs)
            end = job.target.max_samples if s.target is not None else state + s.samples
            points = [(0, val)]
            while sim.samples < end:
                before = sim.samples
                rule = job_learning_rate(job, samples=sim.samples, gbs=gbs if factor is None else base)
                sim.train_step(lr=rule if factor is None else factor * rule)
                if s.target is not None and sim.samples // interval > before // interval:
                    points.append((sim.samples - state, sim.evaluate()))
                    if points[-1][1] <= s.target:
                        break
            row = {"state_samples": state, "state_val_loss": val, "branch": name, "gbs": gbs, "lr_factor": factor,
                   "samples": sim.samples - state, "val_loss": points[-1][1] if s.target is not None else sim.evaluate()}  # fmt: skip
            if excess is not None:
                row["excess"] = excess
            if s.target is not None:
                row["target"] = s.target
                row["samples_to_target"] = _crossing(points, s.target)
            rows.append(row)
        sim.restore(snap)
    return {"workload": s.workload, "seed": s.seed, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.endgame", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="gpt,llama", help="comma-separated: gpt, llama, bert")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--states", default="24000,32000", help="samples trained at the base batch before each state")
    parser.add_argument("--samples", type=int, default=8192, help="samples each branch trains from the state")
    parser.add_argument("--batches", default="64,128", help="larger batches (tiny samples), the last the largest")
    parser.add_argument("--to-target", action="store_true",
                        help="train each branch to the workload's lowest benchmarks.ttp target instead of --samples")
    parser.add_argument("--draws", type=int, default=96,
                        help="gradients of 4 fresh samples for tr(PΣ) at each state (0: skip that measurement)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--out", default=None, help="JSON name under benchmarks/results (default: endgame.json, "
                                                    "endgame-to-target.json with --to-target)")
    args = parser.parse_args(argv)
    names = names_arg(parser, "--workloads", args.workloads, list(WORKLOADS))
    batches = batches_arg(parser, "--batches", args.batches)
    if list(batches) != sorted(batches):  # the last is the largest: its uncapped and cut branches are built from it
        parser.error(f"--batches: give them in increasing order (the last the largest), got {args.batches!r}")
    states = ints_arg(parser, "--states", args.states)
    seeds = ints_arg(parser, "--seeds", args.seeds)
    if args.samples < max(batches):
        parser.error(f"--samples must cover at least one step of the largest batch ({max(batches)})")
    if args.draws == 1 or args.draws < 0:
        parser.error("--draws must be 0 (skip) or at least 2 (a variance needs two draws)")
    settings = [Settings(workload=n, seed=seed, states=states, samples=args.samples, batches=batches, draws=args.draws,
                         target=min(TTP_WORKLOADS[n]["targets"]) if args.to_target else None)
                for n in names for seed in seeds]  # fmt: skip
    started = time.time()
    results = map_workers(measure, settings, jobs=args.jobs)
    if args.to_target:
        for r in results:
            modeled_seconds(r["rows"], r["workload"])
    report = {"benchmark": "endgame", "wall_s": time.time() - started,
              "settings": {"seeds": args.seeds, "states": args.states, "samples": args.samples,
                           "batches": list(batches), "to_target": args.to_target,
                           "draws": args.draws, "excess_batch": EXCESS_BATCH},
              "results": results}  # fmt: skip
    path = write_json(args.out or ("endgame-to-target.json" if args.to_target else "endgame.json"), report)
    if args.to_target:
        return _print_to_target(results, report, path)
    table = []
    for r in results:
        for state in sorted({row["state_samples"] for row in r["rows"]}):
            group = [row for row in r["rows"] if row["state_samples"] == state]
            stay = group[0]["val_loss"]
            table.append([r["workload"], str(r["seed"]), f"{state}, {group[0]['state_val_loss']:.3f}",
                          *(f"{row['val_loss']:.4f} ({row['val_loss'] - stay:+.4f})" for row in group)])  # fmt: skip
    header = [row["branch"] for row in results[0]["rows"] if row["state_samples"] == results[0]["rows"][0]["state_samples"]]
    print_table(f"validation loss {args.samples} samples after the state (change against staying at the base batch)",
                ["workload", "seed", "state (samples, val)", *header], table)  # fmt: skip
    deltas: dict[str, list[float]] = {}
    for r in results:
        for state in sorted({row["state_samples"] for row in r["rows"]}):
            group = [row for row in r["rows"] if row["state_samples"] == state]
            for row in group[1:]:
                deltas.setdefault(row["branch"], []).append(row["val_loss"] - group[0]["val_loss"])
    print_table("mean change against staying, over workloads, seeds and states",
                ["branch", "mean", "min", "max"],
                [[k, f"{statistics.fmean(v):+.4f}", f"{min(v):+.4f}", f"{max(v):+.4f}"] for k, v in deltas.items()])  # fmt: skip
    _print_excess(results)
    print(f"wall {report['wall_s']:.0f} s; JSON {shown(path)}")
    return 0


def _print_excess(results: list[dict[str, Any]]) -> None:
    """Each LR-cut branch's measured drop against staying, over the drop (1 − f)·E the stationary theory predicts."""
    table = []
    for r in results:
        for state in sorted({row["state_samples"] for row in r["rows"]}):
            group = [row for row in r["rows"] if row["state_samples"] == state]
            excess = group[0].get("excess")
            if not excess:
                continue
            cells = []
            for row in group[1:]:
                if row["gbs"] != group[0]["gbs"] or row["lr_factor"] is None:
                    continue  # a batch branch: its preconditioner is not the state's
                predicted = (1.0 - row["lr_factor"]) * excess["excess"]
                drop = group[0]["val_loss"] - row["val_loss"]
                cells.append(f"{row['branch']}: {drop:.4f} / {predicted:.4f} = {drop / predicted:.2f}")
            table.append([r["workload"], str(r["seed"]), f"{state}", f"{excess['lr']:.2e}",
                          f"{excess['tr_p_sigma']:,.0f}", f"{excess['excess']:.4f}", "; ".join(cells)])  # fmt: skip
    if table:
        print_table("LR cuts: measured drop / predicted (1 − f)·E, E = η·tr(PΣ)/(4B) at the state (realized fraction)",
                    ["workload", "seed", "state", "η", "tr(PΣ)", "E", "branch: measured / predicted = realized"],
                    table)  # fmt: skip


def _print_to_target(results: list[dict[str, Any]], report: dict[str, Any], path: Any) -> int:
    def ratio(row: dict[str, Any], stay: dict[str, Any], key: str) -> str:
        if row.get(key) is None or not stay.get(key):
            return "—"
        return f"{row[key]:,.0f} ({row[key] / stay[key]:.3f})"

    for key, what in (("samples_to_target", "samples"), ("modeled_s_to_target", "modeled seconds on the reference")):
        table = []
        header: list[str] = []
        for r in results:
            for state in sorted({row["state_samples"] for row in r["rows"]}):
                group = [row for row in r["rows"] if row["state_samples"] == state]
                header = header or [row["branch"] for row in group]
                table.append([r["workload"], str(r["seed"]), f"{state}, {group[0]['state_val_loss']:.3f}",
                              f"{group[0]['target']}", *(ratio(row, group[0], key) for row in group)])  # fmt: skip
        print_table(f"{what} from the state to the lowest TTP target (ratio to staying at the base batch)",
                    ["workload", "seed", "state (samples, val)", "target", *header], table)  # fmt: skip
    print(f"wall {report['wall_s']:.0f} s; JSON {shown(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
