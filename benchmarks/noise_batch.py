"""Does the noise-scale estimate depend on the batch being trained? The same state, measured at several batches.

    python -m benchmarks.noise_batch [--workloads gpt,llama,bert] [--batches 16,64,256] [--states 2048,8192]
                                     [--steps 300] [--modes held,trained] [--seed 0]
                                     [--out noise-batch.json]

B_noise = tr Σ / |G|² is a property of the model's state and the data, not of the batch that measures it; the
policy compares candidate batches against it, so an estimate that grows with the batch being trained is a feedback
loop (a larger batch makes the estimate larger, which makes a larger batch look better), not a measurement.

For each tiny workload (`benchmarks/jobs/*.yaml`) the model is trained at its base batch to each of `--states`
samples; from that state (an in-process checkpoint: model, AdamW moments, data position) each batch of
`--batches` runs `--steps` steps two ways:

- **held**: the learning rate is 0, so the parameters stay at the state while AdamW's moments (the `adam`
  estimator's preconditioner) follow the gradients of the batch being trained, as they would in training. Both
  estimators then measure the same state; any difference between batches is the estimator's own batch dependence
  (plus sampling noise, which the steps average away).
- **trained**: the job's LR rule, as in a real run after a switch to that batch. The state moves (a larger batch
  covers more samples in the same steps and the noise scale grows as the loss falls), so this mixes the two effects;
  it is reported for context.

Each estimate is the two-batch estimator of `cona.orchestrator.noise` on the steps' mean squared norms (the ratio of
means that its EMA approximates), the first `--warmup` steps left out so AdamW's second moment (β₂ = 0.95, about 20
steps) has adapted to the batch. The spread of a row is max/min − 1 over the batches.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

from benchmarks.common import (
    batches_arg,
    ints_arg,
    map_workers,
    names_arg,
    positive_int,
    print_table,
    run_main,
    shown,
    write_json,
)
from benchmarks.ttp import WORKLOADS as TTP_WORKLOADS

WORKLOADS = {name: w["job"] for name, w in TTP_WORKLOADS.items()}
"""The tiny workloads' job files, as `benchmarks.ttp` trains them."""
KINDS = ("plain", "adam")
MODES = ("held", "trained")


@dataclasses.dataclass(frozen=True)
class Settings:
    workload: str
    states: tuple[int, ...]
    batches: tuple[int, ...]
    steps: int
    warmup: int
    seed: int
    modes: tuple[str, ...] = MODES


def estimate(stats: list[Any], kind: str) -> float | None:
    """B_noise (samples) from the steps' mean squared norms, or None if the big-batch norm is not the smaller."""
    from cona.orchestrator.noise import two_batch_estimates

    if kind == "adam":
        pairs = [(s.adam_local_sqnorm, s.adam_global_sqnorm) for s in stats if s.adam_global_sqnorm is not None]
    else:
        pairs = [(s.local_sqnorm, s.global_sqnorm) for s in stats]
    if not pairs:
        return None
    small = sum(p[0] for p in pairs) / len(pairs)
    big = sum(p[1] for p in pairs) / len(pairs)
    g2, trace = two_batch_estimates(small_sqnorm=small, small_batch=stats[0].local_batch, big_sqnorm=big,
                                    big_batch=stats[0].global_batch)  # fmt: skip
    return trace / g2 if g2 > 0 and trace > 0 else None


def measure(s: Settings) -> dict[str, Any]:
    """Every (state, mode, batch) of one workload: the plain and Adam estimates and the loss, in tiny samples."""
    import torch

    torch.set_num_threads(1)
    from benchmarks.sim import tiny_trainer

    sim = tiny_trainer(WORKLOADS[s.workload], seed=s.seed, stats=True)
    job = sim.job
    rows = []
    for state in sorted(s.states):
        while sim.samples < state:
            sim.train_step()
        snap = sim.snapshot()
        val = sim.evaluate()
        for mode in s.modes:
            for batch in s.batches:
                sim.restore(snap)
                sim.set_gbs(batch)
                stats = [sim.train_step(lr=0.0 if mode == "held" else None) for _ in range(s.steps)][s.warmup:]
                rows.append({
                    "state_samples": state, "state_val_loss": val, "mode": mode, "batch": batch,
                    "small_batch": stats[0].local_batch,
                    "plain": estimate(stats, "plain"), "adam": estimate(stats, "adam"),
                    "train_loss": sum(x.loss for x in stats) / len(stats),
                })  # fmt: skip
        sim.restore(snap)
        sim.set_gbs(job.batch.base_gbs)
    return {"workload": s.workload, "job": WORKLOADS[s.workload], "rows": rows}


def spreads(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """max/min − 1 of each estimator over the batches, per (state, mode)."""
    out = []
    for key in sorted({(r["state_samples"], r["mode"]) for r in rows}):
        group = [r for r in rows if (r["state_samples"], r["mode"]) == key]
        entry: dict[str, Any] = {"state_samples": key[0], "mode": key[1], "state_val_loss": group[0]["state_val_loss"]}
        for kind in KINDS:
            values = [r[kind] for r in group]
            entry[kind] = {str(r["batch"]): r[kind] for r in group}
            entry[f"{kind}_spread"] = (max(values) / min(values) - 1.0) if all(v is not None for v in values) else None
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.noise_batch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="gpt,llama,bert", help="comma-separated: gpt, llama, bert")
    parser.add_argument("--batches", default="16,64,256", help="batches measured from each state (tiny samples)")
    parser.add_argument("--states", default="2048,8192", help="samples trained at the base batch before each state")
    parser.add_argument("--steps", type=positive_int, default=300, help="steps per (state, mode, batch)")
    parser.add_argument("--warmup", type=int, default=50, help="first steps left out of each estimate")
    parser.add_argument("--modes", default="held,trained", help="comma-separated: held, trained")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=positive_int, default=min(3, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--out", default="noise-batch.json", help="JSON name under benchmarks/results")
    args = parser.parse_args(argv)
    names = names_arg(parser, "--workloads", args.workloads, list(WORKLOADS))
    ints_arg(parser, "--seed", str(args.seed))  # a seed the job refuses ended a worker in a traceback
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must lie in [0, --steps), got {args.warmup}")
    modes = tuple(names_arg(parser, "--modes", args.modes, list(MODES)))
    batches = batches_arg(parser, "--batches", args.batches)
    states = ints_arg(parser, "--states", args.states)
    settings = [Settings(workload=n, states=states, batches=batches,
                         steps=args.steps, warmup=args.warmup, seed=args.seed, modes=modes)
                for n in names]  # fmt: skip
    started = time.time()
    results = map_workers(measure, settings, jobs=args.jobs)
    for r in results:
        r["spreads"] = spreads(r["rows"])
    report = {"benchmark": "noise_batch", "wall_s": time.time() - started,
              "settings": {"batches": list(batches), "states": list(settings[0].states), "steps": args.steps,
                           "warmup": args.warmup, "seed": args.seed, "modes": list(modes)},
              "workloads": results}  # fmt: skip
    path = write_json(args.out, report)
    columns = ["workload", "state (samples, val loss)", "mode", *(f"{k} @ {b}" for k in KINDS for b in batches),
               "plain spread", "adam spread"]  # fmt: skip
    table = []
    for r in results:
        for e in r["spreads"]:
            table.append([r["workload"], f"{e['state_samples']}, {e['state_val_loss']:.2f}", e["mode"],
                          *(f"{e[k][str(b)]:.1f}" if e[k][str(b)] is not None else "—" for k in KINDS for b in batches),
                          *(f"{e[f'{k}_spread']:.2f}" if e[f"{k}_spread"] is not None else "—" for k in KINDS)])  # fmt: skip
    print_table("B_noise (tiny samples) measured at each batch from the same state", columns, table)
    print(f"wall {report['wall_s']:.0f} s; JSON {shown(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
