"""What watching the training costs: heartbeats and gradient statistics as a fraction of step time, and the planner.

    python -m benchmarks.overhead [--steps 300] [--repeats 3]

**End to end** (the real trainer under torchrun, gloo on CPU, the tiny GPT of examples/tiny-gpt.yaml): the same
strategy trained for `--steps` steps from scratch under four settings, interleaved `--repeats` times in one run
(the order rotates each round, so a slow spell of the machine does not land on one setting):

    full              heartbeat every step (heartbeat.interval_steps=1) with gradient statistics, including the
                      Adam-preconditioned norms (policy.noise_estimator=adam, the default)
    plain statistics  the same with policy.noise_estimator=plain: no Adam-preconditioned norms are computed
    no statistics  heartbeat every step, heartbeat.gradient_stats=false
    neither        heartbeat.interval_steps=10^9 and heartbeat.gradient_stats=false

The mean step time is the training loop's time (the `start` heartbeat → the final checkpoint starting, from
trainer_state.json) over the steps; costs are differences of medians over the repeats. Two layouts: dp=2 (the
statistics come from FSDP2's reduce-scatter hook) and dp=1 with 4 micro-batches (per-micro-batch gradient hooks).

**Direct** (in this process, to resolve what end-to-end noise cannot): the time of one heartbeat write
(`trainer.heartbeat.HeartbeatWriter.write`) and of one step's statistics (`ParallelModel`, world of one; statistics
off, plain, and with the Adam variants, in alternating blocks).

**Planner**: `enumerate_candidates` + `rank_by_iter_time` for about 10^4 candidates (gpt3-1.3b on a100-4x8 grown to
32 nodes, 6 micro-batch sizes, 40 global batch sizes), and the ranking cona does at every decision
(`cona.orchestrator.policy.progress_rate` over every feasible candidate).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, fmt_s, loop_time, positive_int, print_table, run_main, shown, write_json

SETTINGS = {
    "full": ["heartbeat.interval_steps=1", "heartbeat.gradient_stats=true", "policy.noise_estimator=adam"],
    "plain statistics": ["heartbeat.interval_steps=1", "heartbeat.gradient_stats=true", "policy.noise_estimator=plain"],
    "no statistics": ["heartbeat.interval_steps=1", "heartbeat.gradient_stats=false"],
    "neither": ["heartbeat.interval_steps=1000000000", "heartbeat.gradient_stats=false"],
}
LAYOUTS = {"dp=2": "dp=2,tp=1,pp=1,mbs=8,gbs=32", "dp=1": "dp=1,tp=1,pp=1,mbs=8,gbs=32"}
COMMON = [
    "eval.interval_samples=100000000", "eval.num_windows=2", "eval.batch_size=2", "checkpoint.interval_steps=100000000",
    "target.max_samples=100000000",
]  # fmt: skip


def end_to_end(*, steps: int, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    names = list(SETTINGS)
    for layout, strategy in LAYOUTS.items():
        world = 2 if layout == "dp=2" else 1
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                root = Path(tempfile.mkdtemp(prefix="bench-overhead-", dir=REPO / "runs"))
                try:
                    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                           f"--nproc-per-node={world}", "-m", "cona.trainer", "--run-dir", str(root), "--job",
                           str(REPO / "examples/tiny-gpt.yaml"), "--strategy", strategy, "--max-steps", str(steps),
                           "--attempt", "1", "--set", f"data.path={REPO / 'data/shakespeare.txt'}"]  # fmt: skip
                    for o in [*COMMON, *SETTINGS[name]]:
                        cmd += ["--set", o]
                    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
                    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
                    if proc.returncode not in (0, 1) or not (root / "attempts" / "1" / "exit.json").exists():
                        raise RuntimeError(f"trainer failed ({name}, {layout}): {proc.stderr[-2000:]}")
                    times[name].append(loop_time(root, steps) / steps)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
                print(f"overhead: {layout} {name}: {times[name][-1] * 1e3:.2f} ms/step", file=sys.stderr, flush=True)
        med = {n: statistics.median(v) for n, v in times.items()}
        out[layout] = {
            "strategy": strategy, "step_time_s": times, "median_step_time_s": med,
            "statistics_fraction": (med["full"] - med["no statistics"]) / med["neither"],
            "plain_statistics_fraction": (med["plain statistics"] - med["no statistics"]) / med["neither"],
            "heartbeat_fraction": (med["no statistics"] - med["neither"]) / med["neither"],
            "both_fraction": (med["full"] - med["neither"]) / med["neither"],
        }  # fmt: skip
    return out


def direct(*, steps: int) -> dict[str, Any]:
    """Heartbeat write cost and per-step statistics cost, measured in this process."""
    import torch

    torch.set_num_threads(1)
    from cona.orchestrator.job import load_job
    from cona.protocol.rundir import RunDir
    from cona.protocol.strategy import Strategy
    from cona.trainer.data import Batcher, load_corpus
    from cona.trainer.distributed import init_distributed
    from cona.trainer.heartbeat import HeartbeatWriter, StepRecord
    from cona.trainer.parallel import ParallelModel

    root = Path(tempfile.mkdtemp(prefix="bench-overhead-", dir=REPO / "runs"))
    try:
        writer = HeartbeatWriter(run_dir=RunDir(root), attempt=1, strategy={"dp": 1}, enabled=True)
        record = StepRecord(loss=1.0, step_time_s=0.01, local_sqnorm=1.0, local_batch=8, global_sqnorm=1.0,
                            global_batch=32, adam_local_sqnorm=1.0, adam_global_sqnorm=1.0)  # fmt: skip
        n = 2000
        started = time.perf_counter()
        for i in range(n):
            writer.add_step(record)
            writer.write(step=i, samples=i, tokens=i, lr=1e-3, peak_memory_gb=0.1)
        heartbeat_s = (time.perf_counter() - started) / n
    finally:
        shutil.rmtree(root, ignore_errors=True)

    env = init_distributed()

    def stepper(mode: str):
        enabled = mode != "off"
        job = load_job(REPO / "examples/tiny-gpt.yaml",
                       [f"data.path={REPO / 'data/shakespeare.txt'}", f"heartbeat.gradient_stats={str(enabled).lower()}"])
        model = ParallelModel(job, Strategy(dp=1, tp=1, pp=1, mbs=8, gbs=32), env)
        batch = Batcher(job, load_corpus(job)).samples(0, 32)
        x, y = torch.from_numpy(batch.inputs), torch.from_numpy(batch.labels)

        def step(k: int) -> None:  # what Trainer.step does around the statistics
            model.zero_grad()
            model.stats.begin_step(use_adam=mode == "adam" and k > 0)
            model.forward_backward(x, y, scale=1.0 / y.numel())
            g, ga = model.stats.global_terms(model.parameters())
            lo, la = model.stats.local_terms()
            torch.stack([g, ga, lo, la]).tolist()
            model.optimizer_step(1e-3)

        for k in range(3):
            step(k)
        return step

    modes = ("adam", "plain", "off")
    steppers = {mode: stepper(mode) for mode in modes}
    block = max(5, steps // 20)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(10):  # alternate blocks of steps so drift affects all settings alike
        for mode, step in steppers.items():
            started = time.process_time()
            for k in range(block):
                step(k + 1)
            times[mode].append((time.process_time() - started) / block)
    med = {mode: statistics.median(v) for mode, v in times.items()}
    return {"heartbeat_write_s": heartbeat_s, "step_cpu_s_with_statistics": med["adam"],
            "step_cpu_s_with_plain_statistics": med["plain"], "step_cpu_s_without": med["off"],
            "statistics_fraction": (med["adam"] - med["off"]) / med["off"],
            "plain_statistics_fraction": (med["plain"] - med["off"]) / med["off"], "blocks": times,
            "strategy": "dp=1,tp=1,pp=1,mbs=8,gbs=32 (world of one, in process)"}  # fmt: skip


def planner() -> dict[str, Any]:
    from cona.orchestrator.job import load_job
    from cona.orchestrator.planner import enumerate_candidates, rank_by_iter_time
    from cona.orchestrator.policy import progress_rate
    from cona.orchestrator.profile import load_profile
    from cona.orchestrator.throughput import ThroughputModel

    profile = load_profile(REPO / "slurm/profiles/a100-4x8.yaml", ["nodes=32"])
    gbs = [64 * k for k in range(1, 41)]
    job = load_job(REPO / "examples/gpt3-1.3b.yaml", ["batch.max_gbs=2560", "batch.mbs_choices=[1,2,4,8,16,32]",
                                                     f"batch.gbs_choices={json.dumps(gbs)}"])  # fmt: skip
    runs = []
    for _ in range(3):
        started = time.perf_counter()
        candidates = enumerate_candidates(profile=profile, job=job)
        ranked = rank_by_iter_time(candidates)
        runs.append(time.perf_counter() - started)
    feasible = [c for c in candidates if c.feasible]
    throughput = ThroughputModel(candidates=feasible)
    rank = []
    for _ in range(3):
        started = time.perf_counter()
        sorted(feasible, key=lambda c: -progress_rate(c, throughput, 512.0))
        rank.append(time.perf_counter() - started)
    return {"profile": f"{profile.name} with nodes=32 ({profile.num_gpus} GPUs)", "num_candidates": len(candidates),
            "num_feasible": len(ranked), "enumerate_and_rank_s": statistics.median(runs),
            "cona_ranking_s": statistics.median(rank), "samples": {"enumerate": runs, "rank": rank}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=300, help="steps per end-to-end run")
    parser.add_argument("--repeats", type=positive_int, default=3, help="rounds of the four settings")
    parser.add_argument("--out", default="overhead.json", help="JSON to write: a bare name goes under "
                        "benchmarks/results (default overhead.json)")
    args = parser.parse_args(argv)
    (REPO / "runs").mkdir(exist_ok=True)
    plan = planner()
    e2e = end_to_end(steps=args.steps, repeats=args.repeats)
    inproc = direct(steps=args.steps)
    path = write_json(args.out, {"benchmark": "overhead", "steps": args.steps, "repeats": args.repeats,
                                        "end_to_end": e2e, "direct": inproc, "planner": plan})  # fmt: skip
    print(f"planner: {plan['num_candidates']:,} candidates ({plan['num_feasible']:,} feasible) on {plan['profile']}: "
          f"enumerate + rank {fmt_s(plan['enumerate_and_rank_s'])}; cona's ranking of the feasible ones "
          f"{fmt_s(plan['cona_ranking_s'])}")  # fmt: skip
    off = inproc["step_cpu_s_without"]
    print(f"direct: one heartbeat write {fmt_s(inproc['heartbeat_write_s'])}; statistics with the Adam variants "
          f"{(inproc['step_cpu_s_with_statistics'] - off) * 1e3:.2f} ms ({inproc['statistics_fraction'] * 100:.1f}%), "
          f"plain {(inproc['step_cpu_s_with_plain_statistics'] - off) * 1e3:.2f} ms "
          f"({inproc['plain_statistics_fraction'] * 100:.1f}%) of a {off * 1e3:.1f} ms step (world of one)")
    print(f"JSON {shown(path)}")
    rows = []
    for layout, r in e2e.items():
        med = r["median_step_time_s"]
        spread = {n: f"{min(v) * 1e3:.1f}–{max(v) * 1e3:.1f}" for n, v in r["step_time_s"].items()}
        rows.append([f"{layout} ({r['strategy']})", *(f"{med[n] * 1e3:.2f} ms [{spread[n]}]" for n in SETTINGS),
                     f"{r['heartbeat_fraction'] * 100:+.1f}%", f"{r['statistics_fraction'] * 100:+.1f}%",
                     f"{r['plain_statistics_fraction'] * 100:+.1f}%", f"{r['both_fraction'] * 100:+.1f}%"])  # fmt: skip
    print_table(f"step time, median [min–max] of {args.repeats} runs × {args.steps} steps; cost as a fraction of the "
                "bare step", ["layout", *SETTINGS, "heartbeat", "statistics", "plain statistics", "both"], rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
