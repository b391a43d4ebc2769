"""What sequence parallelism costs in step time and saves in activations, side by side in one run.

    python -m benchmarks.sequence_parallel [--steps 40] [--repeats 3]

**Step time** (the real trainer under torchrun, gloo on CPU, the tiny GPT of examples/tiny-gpt.yaml): each tp layout
trained for `--steps` steps from scratch with `parallel.sequence_parallel` false and true, interleaved `--repeats`
times (the order alternates each round, so a slow spell of the machine does not land on one setting). The step time
is the training loop's (the `start` heartbeat → the final checkpoint starting) over the steps; the table shows the
medians over the repeats and their ratio.

**Activations** (the memory model, which `tests/test_memorymodel_tp.py` checks against what the trainer's blocks
save on each rank): per GPU, for the shipped full-size examples at tp 8 and their standard micro-batch, without and
with sequence parallelism, under each recompute mode.

**Plans** (the planner, no training): for the shipped profile and job pairs, whether the fastest strategy at any
global batch, or its predicted time, changes when the job turns sequence parallelism on.

Writes benchmarks/results/sequence-parallel.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, loop_time, print_table, run_main, shown, write_json

LAYOUTS = {"dp=1 tp=2": ("dp=1,tp=2,pp=1,mbs=8,gbs=32", 2), "dp=2 tp=2": ("dp=2,tp=2,pp=1,mbs=8,gbs=32", 4)}
COMMON = [
    "eval.interval_samples=100000000", "eval.num_windows=2", "eval.batch_size=2", "checkpoint.interval_steps=100000000",
    "target.max_samples=100000000", "heartbeat.interval_steps=1",
]  # fmt: skip
MODELS = {"gpt3-1.3b": "examples/gpt3-1.3b.yaml", "llama-3.2-1b": "examples/llama-3.2-1b.yaml"}
PAIRS = [
    ("slurm/profiles/a100-4x8.yaml", "examples/gpt3-1.3b.yaml"), ("slurm/profiles/a100-16x8.yaml", "examples/gpt3-1.3b.yaml"),
    ("slurm/profiles/a100-4x8.yaml", "examples/bert-large.yaml"), ("slurm/profiles/a100-16x8.yaml", "examples/llama-3.2-1b.yaml"),
    ("slurm/profiles/h100-2x8.yaml", "examples/llama-3.2-1b.yaml"), ("slurm/profiles/h100-8x8.yaml", "examples/llama-3.2-1b.yaml"),
    ("manifests/profiles/h100-k8s.yaml", "examples/gpt3-1.3b.yaml"), ("slurm/profiles/local-cpu.yaml", "examples/tiny-gpt.yaml"),
    ("slurm/profiles/local-slurm.yaml", "examples/tiny-gpt.yaml"),
]  # fmt: skip
"""The shipped profiles with the shipped jobs they are meant for."""


def _train(strategy: str, world: int, sequence_parallel: bool, steps: int) -> float:
    """Seconds per step of one fresh run."""
    (REPO / "runs").mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-sp-", dir=REPO / "runs"))
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc-per-node={world}",
               "-m", "cona.trainer", "--run-dir", str(root), "--job", str(REPO / "examples/tiny-gpt.yaml"),
               "--strategy", strategy, "--max-steps", str(steps), "--attempt", "1",
               "--set", f"data.path={REPO / 'data/shakespeare.txt'}",
               "--set", f"parallel.sequence_parallel={str(sequence_parallel).lower()}"]  # fmt: skip
        for override in COMMON:
            cmd += ["--set", override]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode not in (0, 1) or not (root / "attempts" / "1" / "exit.json").exists():
            raise RuntimeError(f"trainer failed ({strategy}, sequence_parallel={sequence_parallel}): {proc.stderr[-2000:]}")
        return loop_time(root, steps) / steps
    finally:
        shutil.rmtree(root, ignore_errors=True)


def step_times(*, steps: int, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout, (strategy, world) in LAYOUTS.items():
        times: dict[str, list[float]] = {"off": [], "on": []}
        for r in range(repeats):
            for name in (["off", "on"] if r % 2 == 0 else ["on", "off"]):
                times[name].append(_train(strategy, world, name == "on", steps))
                print(f"sequence_parallel: {layout} {name}: {times[name][-1] * 1e3:.1f} ms/step", file=sys.stderr,
                      flush=True)  # fmt: skip
        med = {name: statistics.median(values) for name, values in times.items()}
        out[layout] = {"strategy": strategy, "step_time_s": times, "median_step_time_s": med,
                       "on_over_off": med["on"] / med["off"]}  # fmt: skip
    return out


def activations() -> dict[str, Any]:
    """Modelled activation bytes per GPU (the memory model's) of the full-size examples at tp 8, pp 1."""
    from cona.orchestrator.job import load_job
    from cona.orchestrator.memorymodel import estimate_memory

    out: dict[str, Any] = {}
    for name, path in MODELS.items():
        job = load_job(REPO / path)
        mbs = min(job.batch.mbs_choices)
        for mode in ("none", "selective", "full"):
            row = {}
            for sp in (False, True):
                parallel = job.parallel.model_copy(update={"recompute": mode, "sequence_parallel": sp})
                memory = estimate_memory(model=job.model, parallel=parallel, dp=1, tp=8, pp=1, mbs=mbs,
                                         num_microbatches=1, device="cuda")  # fmt: skip
                row["on" if sp else "off"] = memory.activations
            out[f"{name} {mode}"] = {"mbs": mbs, "activations_bytes": row, "on_over_off": row["on"] / row["off"]}
    return out


def plans() -> dict[str, Any]:
    """Per shipped pair, the global batches whose fastest feasible strategy (or its predicted time) differs with
    sequence parallelism on."""
    from cona.orchestrator.job import load_job
    from cona.orchestrator.planner import enumerate_candidates
    from cona.orchestrator.profile import load_profile

    out: dict[str, Any] = {}
    for profile_path, job_path in PAIRS:
        profile = load_profile(REPO / profile_path)
        fastest: dict[bool, dict[int, tuple[str, float]]] = {}
        for sp in (False, True):
            job = load_job(REPO / job_path, [f"parallel.sequence_parallel={str(sp).lower()}"])
            best: dict[int, tuple[str, float]] = {}
            for c in enumerate_candidates(profile=profile, job=job, feasible_only=True):
                time_s = c.iter_time_s
                if c.strategy.gbs not in best or time_s < best[c.strategy.gbs][1]:
                    best[c.strategy.gbs] = (str(c.strategy), time_s)
            fastest[sp] = best
        changed = sorted(g for g in set(fastest[False]) | set(fastest[True])
                         if fastest[False].get(g) != fastest[True].get(g))  # fmt: skip
        out[f"{profile_path} + {job_path}"] = {"batches": len(fastest[False]), "changed": changed,
                                               "off": fastest[False], "on": fastest[True]}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sequence_parallel", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per layout and setting (default 3)")
    parser.add_argument("--out", default="sequence-parallel.json", help="JSON to write: a bare name goes under "
                        "benchmarks/results (default sequence-parallel.json)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps: must be at least 2, got {args.steps}")
    if args.repeats < 1:
        parser.error(f"--repeats: must be at least 1, got {args.repeats}")
    times = step_times(steps=args.steps, repeats=args.repeats)
    print_table("Step time, tiny GPT on CPU (gloo): median ms per step", ["layout", "off", "on", "on / off"], [
        [layout, f"{r['median_step_time_s']['off'] * 1e3:.1f}", f"{r['median_step_time_s']['on'] * 1e3:.1f}",
         f"{r['on_over_off']:.2f}"] for layout, r in times.items()])  # fmt: skip
    modelled = activations()
    print_table("Activations per GPU at tp 8 (memory model, bf16 on cuda, one micro-batch)",
                ["model, recompute", "mbs", "off (GB)", "on (GB)", "on / off"], [
        [key, str(r["mbs"]), f"{r['activations_bytes']['off'] / 1e9:.2f}", f"{r['activations_bytes']['on'] / 1e9:.2f}",
         f"{r['on_over_off']:.2f}"] for key, r in modelled.items()])  # fmt: skip
    planned = plans()
    print_table("Plans: global batches whose fastest strategy changes with sequence parallelism on",
                ["profile + job", "batches", "changed"],
                [[key, str(r["batches"]), ", ".join(map(str, r["changed"])) or "none"] for key, r in planned.items()])
    path = write_json(args.out, {"step_times": times, "activations": modelled, "plans": planned,
                                                 "steps": args.steps, "repeats": args.repeats})  # fmt: skip
    print(f"wrote {shown(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
