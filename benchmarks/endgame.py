"""What a jump to a larger batch buys late in a run, per sample: the batch, or the learning rate it gets?

    python -m benchmarks.endgame [--workloads gpt,llama] [--seeds 0,1] [--states 24000,32000] [--samples 8192]
                                 [--batches 64,128] [--to-target] [--out endgame.json]

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
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--out", default=None, help="JSON name under benchmarks/results (default: endgame.json, "
                                                    "endgame-to-target.json with --to-target)")
    args = parser.parse_args(argv)
    names = names_arg(parser, "--workloads", args.workloads, list(WORKLOADS))
    batches = batches_arg(parser, "--batches", args.batches)
    states = ints_arg(parser, "--states", args.states)
    seeds = ints_arg(parser, "--seeds", args.seeds)
    if args.samples < max(batches):
        parser.error(f"--samples must cover at least one step of the largest batch ({max(batches)})")
    settings = [Settings(workload=n, seed=seed, states=states, samples=args.samples, batches=batches,
                         target=min(TTP_WORKLOADS[n]["targets"]) if args.to_target else None)
                for n in names for seed in seeds]  # fmt: skip
    started = time.time()
    results = map_workers(measure, settings, jobs=args.jobs)
    if args.to_target:
        for r in results:
            modeled_seconds(r["rows"], r["workload"])
    report = {"benchmark": "endgame", "wall_s": time.time() - started,
              "settings": {"seeds": args.seeds, "states": args.states, "samples": args.samples,
                           "batches": list(batches), "to_target": args.to_target},
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
    print(f"wall {report['wall_s']:.0f} s; JSON {shown(path)}")
    return 0


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
    raise SystemExit(main())
