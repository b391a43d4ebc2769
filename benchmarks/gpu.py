"""The CUDA path on one machine: each family's step time, throughput and peak memory next to what the cost and
memory models predict, then real `cona` runs that switch in place and by relaunch, checked against one that never
switches.

    python -m benchmarks.gpu [--out DIR] [--budget-s 420]     # on a GPU machine (bf16 autocast, NCCL)
    python -m benchmarks.gpu --cpu [--out DIR]                # the same on the CPU: tiny presets, fp32, gloo
    python -m benchmarks.gpu --fit DIR/gpu-check.json         # calibrate the cost model from a saved measurement
    scripts/gpu-check.sh                                      # a bare GPU machine: wheels, paths, then the above

Three parts, each written to `<out>/gpu-check.json` as soon as it is measured (a run cut short keeps what it has):

1. **device** — what the machine is, the ceilings measured on it (a bf16 8192³ matmul's TFLOP/s, a device copy's
   GB/s) and the profile the predictions use: the device's published peak and bandwidth with the cost model's
   default efficiencies, which is what a user who writes a profile for this device gets.
2. **steps** — for each family at a size that fills a good part of the device (gpt3-1.3b and llama-3.2-1b at
   sequence 2048, bert-large at 512; `--cpu`: the tiny presets), a few optimizer steps of the real trainer
   (`cona.trainer.train.Trainer.step`: gradient statistics, clipping and AdamW included) at several micro-batch
   sizes, two micro-batches per step, with and without recompute. Per strategy: the median step time, tokens/s,
   achieved TFLOP/s and MFU by the model FLOPs

       FLOPs per token = 3 · (2 · (L · P_block + P_head) + L · A),   A = 4 · s · h (bidirectional) or 2 · s · h (causal)

   (P_block the matmul weights of one block, P_head the output head's, A the forward attention products per layer;
   recomputation is not counted), and the peak of `torch.cuda.max_memory_allocated` — each next to the cost
   model's step time and the memory model's allocated bytes for that strategy.
3. **switch** — three real runs through the orchestrator and the local backend (torchrun, exactly what `cona run`
   does) on the same samples: one that never switches, and the same `schedule` policy (micro-batch switch, micro-
   batch switch, global-batch switch) once in place and once by relaunch. Checked: every run consumed samples
   0…N−1 exactly once and in order; until the global-batch switch every step's loss matches the never-switched
   run's (the same math; the micro-batch split only reorders the sums); after it, in place and relaunch match each
   other; every switch resumed from the DCP checkpoint the previous strategy wrote.

`--fit` refits `accelerator.matmul_efficiency`, `matmul_half_tokens`, `host_layer_ms` and `step_overhead_ms` to the
measured step times and reports how the fit carries to a family it did not see (`benchmarks.gpu_fit`,
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO,
    command_line,
    fmt_s,
    fmt_tflops,
    json_default,
    machine,
    print_table,
    run_main,
)

RESULT_FILE = "gpu-check.json"
# The switch runs use one process, on the CPU as on the GPU (a lent machine has one): the CPU version checks what
# the GPU will run. Multi-process switches are the end-to-end tests' (tests/test_orchestrator_e2e.py).
SWITCH_WORLD = 1

# (preset, micro-batch sizes): sizes that fill a good part of an 80-141 GB device without recompute.
GPU_FAMILIES: list[tuple[str, list[int]]] = [
    ("gpt3-1.3b", [1, 2, 4, 8]),
    ("llama-3.2-1b", [1, 2, 4, 8]),
    ("bert-large", [4, 8, 16, 32]),
]
# On the CPU the check rehearses the paths, not the device: every family and recompute mode once, two sizes of one.
CPU_FAMILIES: list[tuple[str, list[int]]] = [("tiny-gpt", [2, 8]), ("tiny-llama", [8]), ("tiny-bert", [8])]
MICROBATCHES = 2
"""Micro-batches per step: gradient accumulation and the statistics' queued copy are part of what is measured."""

# Published dense bf16 peak (TFLOP/s) and memory bandwidth (GB/s) by device name (vendors' datasheets, SXM parts).
KNOWN_DEVICES: dict[str, tuple[float, float]] = {
    "H200": (989.0, 4800.0),
    "H100": (989.0, 3350.0),
    "A100": (312.0, 2039.0),
}


# ----------------------------------------------------------------------------------------------------- the results


class Results:
    """`<out>/gpu-check.json`, rewritten after every measurement."""

    def __init__(self, out: Path, *, mode: str) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / RESULT_FILE
        self.data: dict[str, Any] = {
            "benchmark": "gpu-check", "mode": mode, "command": command_line(), "machine": machine(),
            "written": None, "device": None, "steps": [], "switch": None, "errors": [], "skipped": [],
        }  # fmt: skip
        self.save()

    def save(self) -> None:
        self.data["written"] = time.strftime("%Y-%m-%d %H:%M:%S")
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=json_default) + "\n")
        tmp.replace(self.path)


# ------------------------------------------------------------------------------------------------------- the device


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_device(device: Any) -> dict[str, Any]:
    """Name, memory, and the ceilings measured here: a square bf16 matmul's rate and a device copy's bandwidth."""
    import torch

    info: dict[str, Any] = {"type": device.type, "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}", count=torch.cuda.device_count(),
                    cuda=torch.version.cuda)  # fmt: skip
        n, dtype, repeats = 8192, torch.bfloat16, 10
    else:
        info.update(name="cpu", memory_bytes=None, count=1, threads=torch.get_num_threads())
        n, dtype, repeats = 512, torch.float32, 3
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    info["matmul_tflops"] = 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12
    src = torch.empty(1 << (30 if device.type == "cuda" else 26), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    info["copy_gb_per_s"] = 2 * src.numel() * repeats / (time.perf_counter() - start) / 1e9  # read + write
    del a, b, src, dst
    # The (tokens × h)·(h × 4h) GEMM of a block at the families' width, over tokens per micro-batch: what the cost
    # model's matmul efficiency curve describes (benchmarks.calibrate).
    from benchmarks.calibrate import measure

    sweep = [128, 256, 512, 1024, 2048, 4096, 8192, 16384] if device.type == "cuda" else [32, 128, 512]
    info["gemm_sweep"] = measure(device=str(device), hidden=2048 if device.type == "cuda" else 256, tokens=sweep,
                                 repeats=20 if device.type == "cuda" else 2)  # fmt: skip
    return info


def device_profile(info: dict[str, Any]) -> Any:
    """The cluster profile a user would write for this machine: the device's published peak and bandwidth, the
    cost model's default efficiencies (local backend, one node, every device of it)."""
    from cona.orchestrator.profile import ClusterProfile, load_profile

    if info["type"] != "cuda":
        return load_profile(REPO / "slurm/profiles/local-cpu.yaml")
    known = next((v for k, v in KNOWN_DEVICES.items() if k in info["name"]), None)
    # An unknown device: the measured square matmul is a lower bound of the peak (it reaches ~80% of it on Hopper).
    peak, bandwidth = known or (info["matmul_tflops"] / 0.8, info["copy_gb_per_s"])
    return ClusterProfile.model_validate({
        "name": f"local-{info['name'].replace(' ', '-').lower()}", "backend": "local", "nodes": 1,
        "gpus_per_node": info["count"],
        "accelerator": {"name": info["name"], "peak_tflops": peak, "memory": f"{info['memory_bytes']} B",
                        "memory_bandwidth": f"{bandwidth} GB/s", "device": "cuda"},
        "network": {"intra_node_bandwidth": "450 GB/s", "inter_node_bandwidth": "400 Gbit/s"},
        "storage": {"run_root": "runs"},
    })  # fmt: skip


# -------------------------------------------------------------------------------------------------------- the steps


def model_flops_per_token(model: Any) -> float:
    """Training FLOPs per token by the formula in the module docstring (recomputation not counted)."""
    from cona.orchestrator.costmodel import attention_flops_per_token, head_params, matmul_params_per_layer

    forward = 2 * (model.num_layers * matmul_params_per_layer(model) + head_params(model))
    forward += model.num_layers * attention_flops_per_token(model, "sdpa")
    return 3 * forward


def synthetic_corpus(directory: Path, *, vocab: int, tokens: int) -> Path:
    """Uniform random token ids (the step's cost does not depend on what the tokens say)."""
    import numpy as np

    path = directory / f"tokens-{vocab}.bin"
    if not path.exists():
        dtype = np.uint16 if vocab <= 65535 else np.uint32
        rng = np.random.default_rng(0)
        rng.integers(0, vocab - 1, size=tokens, dtype=dtype).tofile(path)  # vocab-1 is BERT's mask id
    return path


def _job(preset: str, *, data: Path, recompute: str, overrides: list[str] = ()) -> Any:
    from cona.orchestrator.job import job_from_dict
    from cona.protocol.job import PRESETS

    vocab = PRESETS[preset]["vocab_size"]
    data_spec: dict[str, Any] = {"path": str(data)}
    if data.suffix == ".bin":
        data_spec.update(format="tokens", token_dtype="uint16" if vocab <= 65535 else "uint32")
    raw = {
        "name": f"gpu-check-{preset}", "seed": 0, "model": {"preset": preset}, "data": data_spec,
        "batch": {"min_gbs": 1, "max_gbs": 4096, "base_gbs": 16, "mbs_choices": [1, 2, 4, 8, 16, 32]},
        "parallel": {"recompute": recompute},
        "target": {"val_perplexity": None, "max_samples": 10**9},
        "eval": {"interval_samples": 10**9, "num_windows": 4, "batch_size": 2},
        "checkpoint": {"interval_steps": 10**6, "keep": 2},
        "heartbeat": {"interval_steps": 1},
        "policy": {"name": "static"},
    }  # fmt: skip
    from cona.protocol.yamlconfig import apply_overrides

    return job_from_dict(apply_overrides(raw, list(overrides)), source=f"benchmarks.gpu job {preset}")


def measure_steps(*, job: Any, strategy: Any, env: Any, corpus: Any, run_root: Path, warmup: int, timed: int,
                  profile_to: Path | None = None) -> dict:  # fmt: skip
    """Median step time and peak allocated memory of `timed` steps after `warmup` of the real trainer; with
    `profile_to`, one more step under `torch.profiler`, its table written there."""
    import torch
    import torch.distributed as dist
    from cona.protocol.rundir import RunDir
    from cona.trainer.train import Trainer

    device = env.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    root = Path(tempfile.mkdtemp(prefix="run-", dir=run_root))
    trainer = Trainer(job=job, strategy=strategy, run_dir=RunDir(root), attempt=0, env=env, corpus=corpus)
    times: list[float] = []
    try:
        for i in range(warmup + timed):
            _sync(device)
            start = time.perf_counter()
            trainer.step()  # ends with a host read of the all-reduced scalars: the step's work is done
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        result: dict[str, Any] = {"step_s": statistics.median(times), "step_s_all": times}
        if profile_to is not None:
            result["profile"] = profile_step(trainer, device, profile_to)
        if device.type == "cuda":
            result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device) - base
            result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        return result
    finally:
        groups = trainer.model.own_process_groups()
        del trainer
        gc.collect()
        for group in groups:
            dist.destroy_process_group(group)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        shutil.rmtree(root, ignore_errors=True)


def profile_step(trainer: Any, device: Any, path: Path) -> dict[str, Any]:
    """One step under `torch.profiler`: the wall time of the trainer's named phases (`cona.*`, CPU side: with CUDA
    the host runs ahead until `cona.all_reduce` reads the result back), the device's busy time and the kernels
    launched. The table, sorted by CPU time, goes to `path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        trainer.step()
        _sync(device)
    wall = time.perf_counter() - start
    averages = prof.key_averages()
    path.write_text(averages.table(sort_by="cpu_time_total", row_limit=40))
    cuda_type = torch.autograd.DeviceType.CUDA
    busy = sum(getattr(e, "self_device_time_total", 0.0) for e in averages if e.device_type == cuda_type)
    phases = {e.key: e.cpu_time_total / 1e6 for e in averages if e.key.startswith("cona.")}
    launches = sum(e.count for e in averages if "LaunchKernel" in e.key)
    return {"wall_s": wall, "device_busy_s": busy / 1e6, "phases_s": phases, "kernel_launches": launches,
            "table": path.name}  # fmt: skip


OVERHEAD_CASES = {"cuda": [("bert-large", 4), ("gpt3-1.3b", 1), ("gpt3-1.3b", 8)], "cpu": [("tiny-bert", 2)]}
OVERHEAD_VARIANTS: dict[str, tuple[list[str], int]] = {  # name: (job overrides, micro-batches per step)
    "default": ([], MICROBATCHES),
    "no_gradient_stats": (["heartbeat.gradient_stats=false"], MICROBATCHES),
    "8_microbatches": ([], 8),  # splits a per-step cost from a per-micro-batch one
}


def run_overhead(results: Results, *, profile: Any, env: Any, work: Path, out: Path) -> None:
    """Part 2b: where a step's time goes when the model's work is small: the step with and without the gradient
    statistics, and one profiled step (phases, device busy time, kernel launches)."""
    from cona.protocol.job import PRESETS
    from cona.protocol.strategy import Strategy
    from cona.trainer.data import load_corpus

    rows = results.data.setdefault("overhead", [])
    for preset, mbs in OVERHEAD_CASES[env.device.type]:
        spec = PRESETS[preset]
        data = synthetic_corpus(work, vocab=spec["vocab_size"], tokens=max(1 << 20, 80 * mbs * (spec["seq_len"] + 1)))
        for variant, (overrides, micro) in OVERHEAD_VARIANTS.items():
            job = _job(preset, data=data, recompute="none", overrides=overrides)
            strategy = Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=mbs * micro)
            print(f"gpu-check: overhead: {preset} mbs={mbs} {variant} ...", file=sys.stderr, flush=True)
            table = out / f"profile-{preset}-mbs{mbs}.txt" if variant == "default" else None
            row = {"preset": preset, "variant": variant, "strategy": strategy.to_dict()}
            row.update(measure_steps(job=job, strategy=strategy, env=env, corpus=load_corpus(job), run_root=work,
                                     warmup=2, timed=5, profile_to=table))  # fmt: skip
            rows.append(row)
            results.save()


def run_steps(results: Results, *, families: list[tuple[str, list[int]]], recomputes: list[str], profile: Any,
              env: Any, work: Path, warmup: int, timed: int, deadline: float) -> None:  # fmt: skip
    """Part 2: every (family, mbs, recompute) measured and predicted, appended to the results as it goes."""
    import torch
    from cona.orchestrator.costmodel import predict
    from cona.orchestrator.memorymodel import estimate_memory
    from cona.protocol.job import PRESETS
    from cona.protocol.strategy import Strategy
    from cona.trainer.data import load_corpus

    for preset, sizes in families:
        spec = PRESETS[preset]
        window = spec["seq_len"] + 1
        largest = max(sizes) * MICROBATCHES * (warmup + timed)
        data = synthetic_corpus(work, vocab=spec["vocab_size"], tokens=max(1 << 20, 4 * largest * window))
        for i, mbs in enumerate(sizes):
            # Selective recompute at one size per family (the second, or the only one): it sits between the other
            # two (docs/costmodel.md).
            for recompute in [r for r in recomputes if r != "selective" or i == min(1, len(sizes) - 1)]:
                if time.time() > deadline:
                    results.data["skipped"].append(f"steps: --budget-s reached before {preset} mbs={mbs} {recompute}")
                    results.save()
                    return
                job = _job(preset, data=data, recompute=recompute)
                strategy = Strategy(dp=1, tp=1, pp=1, mbs=mbs, gbs=mbs * MICROBATCHES)
                corpus = load_corpus(job)
                pred = predict(profile=profile, job=job, dp=1, tp=1, pp=1, mbs=mbs, gbs=strategy.gbs)
                mem = estimate_memory(model=job.model, parallel=job.parallel, dp=1, tp=1, pp=1, mbs=mbs,
                                      num_microbatches=MICROBATCHES, device=profile.accelerator.device)  # fmt: skip
                row: dict[str, Any] = {
                    "preset": preset, "family": job.model.family, "num_params": job.model.num_params,
                    "seq_len": job.model.seq_len, "recompute": recompute, "strategy": strategy.to_dict(),
                    "tokens_per_step": strategy.gbs * job.model.seq_len,
                    "model_flops_per_token": model_flops_per_token(job.model),
                    "predicted_step_s": pred.iter_time_s, "predicted_parts_s": {
                        "compute": pred.compute_s, "optimizer": pred.optimizer_s},
                    "predicted_allocated_bytes": mem.allocated, "predicted_total_bytes": mem.total,
                    "predicted_memory": dataclasses.asdict(mem),
                }  # fmt: skip
                label = f"{preset} mbs={mbs} gbs={strategy.gbs} recompute={recompute}"
                print(f"gpu-check: steps: {label} ...", file=sys.stderr, flush=True)
                try:
                    row.update(measure_steps(job=job, strategy=strategy, env=env, corpus=corpus, run_root=work,
                                             warmup=warmup, timed=timed))  # fmt: skip
                except torch.OutOfMemoryError as e:
                    row["error"] = f"out of memory: {str(e).splitlines()[0]}"
                    gc.collect()
                    torch.cuda.empty_cache()
                if "step_s" in row:
                    tokens_s = row["tokens_per_step"] / row["step_s"]
                    row["tokens_per_s"] = tokens_s
                    row["achieved_tflops"] = tokens_s * row["model_flops_per_token"] / 1e12
                    row["mfu"] = row["achieved_tflops"] / profile.accelerator.peak_tflops
                    row["time_ratio"] = row["step_s"] / row["predicted_step_s"]
                    if "peak_allocated_bytes" in row:
                        row["memory_ratio"] = row["peak_allocated_bytes"] / row["predicted_allocated_bytes"]
                results.data["steps"].append(row)
                results.save()


def steps_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    columns = ["strategy", "step", "predicted", "meas/pred", "tokens/s", "TFLOP/s", "MFU", "peak alloc",
               "predicted", "meas/pred"]  # fmt: skip
    out = []
    for r in rows:
        s = r["strategy"]
        label = f"{r['preset']} mbs={s['mbs']} gbs={s['gbs']} {r['recompute']}"
        if "step_s" not in r:
            out.append([label, r.get("error", "—"), fmt_s(r["predicted_step_s"]), *["—"] * 5,
                        f"{r['predicted_allocated_bytes'] / 1e9:.1f} GB", "—"])  # fmt: skip
            continue
        peak = r.get("peak_allocated_bytes")
        out.append([
            label, fmt_s(r["step_s"]), fmt_s(r["predicted_step_s"]), f"{r['time_ratio']:.2f}",
            f"{r['tokens_per_s']:,.0f}", fmt_tflops(r['achieved_tflops']), f"{100 * r['mfu']:.1f}%",
            f"{peak / 1e9:.1f} GB" if peak is not None else "—", f"{r['predicted_allocated_bytes'] / 1e9:.1f} GB",
            f"{r['memory_ratio']:.2f}" if peak is not None else "—",
        ])  # fmt: skip
    return columns, out


# ------------------------------------------------------------------------------------------------------- the switch


def _switch_job(*, cuda: bool, data: Path, schedule: list[tuple[int, str]] | None, in_place: bool, samples: int,
                fixed: str | None = None) -> Any:  # fmt: skip
    from cona.orchestrator.job import job_from_dict, job_to_dict, load_job

    model = ["model.num_layers=8", "model.hidden_size=512", "model.num_heads=8", "model.num_kv_heads=8",
             "model.ffn_hidden_size=2048", "model.seq_len=256"] if cuda else []  # fmt: skip
    job = load_job(REPO / "examples/tiny-gpt.yaml", [
        *model, f"data.path={data}", f"target.max_samples={samples}", "target.val_perplexity=null",
        f"eval.interval_samples={samples // 2}", "eval.num_windows=8", "eval.batch_size=8",
        "checkpoint.interval_steps=1000000", "checkpoint.keep=8", "heartbeat.interval_steps=1",
        "policy.decision_interval_s=0.5", "policy.min_dwell_s=0", f"policy.in_place_switch={str(in_place).lower()}",
        "batch.min_gbs=8", "batch.max_gbs=64",
    ])  # fmt: skip
    data_dict = job_to_dict(job)
    data_dict["name"] = "gpu-check-switch"
    if schedule is not None:
        data_dict["policy"]["name"] = "schedule"
        data_dict["policy"]["schedule"] = [{"samples": n, "strategy": s} for n, s in schedule]
    else:
        data_dict["policy"]["name"] = "fixed"
        data_dict["policy"]["strategy"] = fixed
    return job_from_dict(data_dict, source="benchmarks.gpu switch job")


def _run(job: Any, profile: Any, root: Path) -> dict[str, Any]:
    """One run through the scheduler and the local backend; its per-step losses, sample log and attempts."""
    from cona.orchestrator.backends import make_backend
    from cona.orchestrator.runstate import create_run, read_events
    from cona.orchestrator.scheduler import Scheduler
    from cona.protocol.rundir import RunDir
    from cona.protocol.strategy import Strategy

    run_dir = RunDir(root)
    create_run(run_dir=run_dir, profile=profile, job=job)
    started = time.time()
    state = Scheduler(run_dir=run_dir, profile=profile, job=job,
                      backend=make_backend(profile=profile, run_dir=run_dir)).run()  # fmt: skip
    wall = time.time() - started
    losses: dict[int, float] = {}
    strategy: dict[int, str] = {}  # the strategy each step ran under
    for path in sorted(run_dir.root.glob("heartbeats/*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                hb = json.loads(line)
                # Periodic and evaluation heartbeats carry the step's loss (checkpoint ones repeat it).
                if hb.get("event") in (None, "eval") and hb.get("train_loss") is not None:
                    losses[int(hb["step"])] = float(hb["train_loss"])
                    strategy[int(hb["step"])] = Strategy.from_dict(hb["strategy"]).short()
    events = read_events(run_dir)
    switches = [e for e in events if e["event"] == "switch"]
    starts = [json.loads(p.read_text()) for p in sorted(run_dir.root.glob("attempts/*/startup.json"))]
    return {
        "status": state.status, "reason": state.reason, "wall_s": wall, "losses": losses,
        "strategy_by_step": strategy,
        "samples": _samples_consumed(run_dir), "switches": len(switches),
        "in_place": sum(1 for s in starts if s.get("in_place")),
        "resumed_from_checkpoint": sum(1 for s in starts if s.get("resumed_step") is not None),
        "run_dir": str(root),
    }  # fmt: skip


def _samples_consumed(run_dir: Any) -> list[tuple[int, int]] | str:
    """The run's per-step sample ranges (`cona.protocol.samples_log.audit_samples`), or why the audit failed."""
    from cona.protocol.samples_log import SamplesAuditError, audit_samples

    try:
        return audit_samples(run_dir)
    except SamplesAuditError as e:
        return str(e)


def run_switch(results: Results, *, cuda: bool, profile: Any, work: Path, data: Path) -> None:
    """Part 3: never switched, switched in place, switched by relaunch; the checks in the module docstring."""
    world = SWITCH_WORLD
    a = f"dp={world},tp=1,pp=1,mbs=4,gbs=16"
    b = f"dp={world},tp=1,pp=1,mbs=8,gbs=16"  # a micro-batch switch: the same math
    c = f"dp={world},tp=1,pp=1,mbs=2,gbs=16"
    d = f"dp={world},tp=1,pp=1,mbs=4,gbs=32"  # a global-batch switch
    # Switch points far apart against the orchestrator's decision interval (0.5 s), which is ~30 steps on a GPU.
    total, at = (4096, [1024, 2048, 3072]) if cuda else (640, [160, 320, 480])
    schedule = [(0, a), (at[0], b), (at[1], c), (at[2], d)]
    runs = {}
    for name, kwargs in (("never", {"schedule": None, "fixed": a, "in_place": True}),
                         ("never_mbs8", {"schedule": None, "fixed": b, "in_place": True}),
                         ("in_place", {"schedule": schedule, "in_place": True}),
                         ("relaunch", {"schedule": schedule, "in_place": False})):  # fmt: skip
        print(f"gpu-check: switch: {name} ...", file=sys.stderr, flush=True)
        job = _switch_job(cuda=cuda, data=data, samples=total, **kwargs)
        runs[name] = _run(job, profile, work / f"switch-{name}")
    results.data["switch"] = {
        "schedule": schedule, "samples": total, "tolerance": 1e-3 if cuda else 1e-5,
        "checks": switch_checks(runs, total=total),
        "runs": {name: {**{k: v for k, v in run.items() if k != "samples"}, "samples_end": _end(run["samples"])}
                 for name, run in runs.items()},
    }  # fmt: skip
    results.save()


def switch_checks(runs: dict[str, dict[str, Any]], *, total: int) -> dict[str, Any]:
    """What the switch runs show (module docstring, part 3).

    The orchestrator switches at its first decision after the scheduled sample, so runs switch at slightly
    different steps; each comparison is made where the two runs trained the same samples under the same weights:

    - before its first switch a run is the never-switched run (bit-identical: same strategy, same seed);
    - the first step after the first switch starts from the weights and optimizer state the checkpoint carried
      across, and differs from the never-switched step only by the micro-batch split of its sums;
    - in place and by relaunch are bit-identical while they ran the same strategy at every step;
    - over the whole run before the global-batch switch, the distance to the never-switched run is reported next
      to the distance between two never-switched runs at the two micro-batch sizes (`never_mbs8`): what changing
      the micro-batch does by itself, switch or no switch (bf16 rounding grows along training).
    """
    checks: dict[str, Any] = {}
    for name, run in runs.items():
        end = _end(run["samples"])
        checks[f"{name}_samples_exact"] = isinstance(end, int) and end >= total
        if isinstance(run["samples"], str):
            checks[f"{name}_samples_audit"] = run["samples"]
        checks[f"{name}_status"] = run["status"]

    def max_diff(x: dict[int, float], y: dict[int, float], steps: range) -> float | None:
        diffs = [abs(x[k] - y[k]) for k in steps if k in x and k in y]
        return max(diffs) if diffs and len(diffs) == len(steps) else None

    never = runs["never"]["losses"]
    first = runs["never"]["strategy_by_step"].get(1)
    for n in ("in_place", "relaunch"):
        by_step = runs[n]["strategy_by_step"]
        switch = min((k for k, v in by_step.items() if v != first), default=None)
        gbs_switch = min((k for k, v in by_step.items() if not v.endswith("g16")), default=max(by_step, default=0) + 1)
        checks[f"{n}_first_switch_step"] = switch
        checks[f"{n}_before_switch_max_loss_diff"] = max_diff(runs[n]["losses"], never, range(1, (switch or 1)))
        checks[f"{n}_at_switch_loss_diff"] = max_diff(runs[n]["losses"], never, range(switch, switch + 1)) if switch else None
        checks[f"{n}_whole_max_loss_diff"] = max_diff(runs[n]["losses"], never, range(1, gbs_switch))
        checks[f"{n}_whole_steps"] = gbs_switch - 1
    floor_steps = min(checks["in_place_whole_steps"], checks["relaunch_whole_steps"])
    checks["mbs_floor_max_loss_diff"] = max_diff(runs["never_mbs8"]["losses"], never, range(1, floor_steps + 1))
    a, b = runs["in_place"]["strategy_by_step"], runs["relaunch"]["strategy_by_step"]
    same = 0
    while same + 1 in a and a.get(same + 1) == b.get(same + 1):
        same += 1
    checks["in_place_vs_relaunch_same_strategy_steps"] = same
    checks["in_place_vs_relaunch_max_loss_diff"] = max_diff(runs["in_place"]["losses"], runs["relaunch"]["losses"],
                                                            range(1, same + 1))  # fmt: skip
    checks["switches"] = {name: run["switches"] for name, run in runs.items()}
    checks["in_place_attempts"] = {name: run["in_place"] for name, run in runs.items()}
    checks["resumed_from_checkpoint"] = {name: run["resumed_from_checkpoint"] for name, run in runs.items()}
    return checks


def _end(ranges: list[tuple[int, int]] | str) -> int | str | None:
    """The sample the audited history ends at, or the audit's error."""
    return ranges if isinstance(ranges, str) else (ranges[-1][1] if ranges else None)


def switch_passed(switch: dict[str, Any]) -> list[str]:
    """What failed in part 3 (empty when everything holds)."""
    checks, tol = switch["checks"], switch["tolerance"]
    failed = []
    for name in ("never", "never_mbs8", "in_place", "relaunch"):
        if checks[f"{name}_status"] != "done":
            failed.append(f"{name} run ended {checks[f'{name}_status']}")
        if not checks[f"{name}_samples_exact"]:
            failed.append(f"{name} run did not consume samples 0..N-1 exactly once in order")
    exact = ["in_place_before_switch_max_loss_diff", "relaunch_before_switch_max_loss_diff",
             "in_place_vs_relaunch_max_loss_diff"]  # fmt: skip
    for key in exact:
        if checks[key] is None or checks[key] != 0.0:
            failed.append(f"{key} = {checks[key]} (expected bit-identical)")
    for key in ("in_place_at_switch_loss_diff", "relaunch_at_switch_loss_diff"):
        if checks[key] is None or checks[key] > tol:
            failed.append(f"{key} = {checks[key]} (tolerance {tol})")
    if checks["switches"]["in_place"] != 3 or checks["switches"]["relaunch"] != 3:
        failed.append(f"expected 3 switches per switched run, got {checks['switches']}")
    if checks["in_place_attempts"]["in_place"] != 3 or checks["in_place_attempts"]["relaunch"] != 0:
        failed.append(f"in-place attempts {checks['in_place_attempts']} (expected 3 and 0)")
    return failed


# --------------------------------------------------------------------------------------------------------- the main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (tiny presets, gloo) even with a GPU")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for gpu-check.json (default: $OUT, else benchmarks/results)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new step measurements after this many seconds (the switch part runs after); "
                             "default 420 on a GPU (a lent machine's time is short), none with --cpu (its few tiny "
                             "steps must all run, however loaded the machine)")  # fmt: skip
    parser.add_argument("--parts", default="device,steps,overhead,switch",
                        help="comma-separated: device, steps, overhead, switch")
    parser.add_argument("--fit", type=Path, metavar="JSON", help="calibrate from a saved gpu-check.json and exit")
    args = parser.parse_args(argv)
    if args.fit is not None:
        from benchmarks.gpu_fit import report_fit

        return report_fit(args.fit)
    parts = args.parts.split(",")
    for part in parts:
        if part not in ("device", "steps", "overhead", "switch"):
            parser.error(f"unknown part {part!r}; valid: device, steps, overhead, switch")
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "benchmarks" / "results")
    started = time.time()

    if args.cpu:  # before torch looks: the trainer (and torchrun's workers) take a GPU whenever they see one
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import torch
    from cona.trainer.distributed import init_distributed

    cuda = torch.cuda.is_available() and not args.cpu
    if not cuda and not args.cpu:
        print("gpu-check: no CUDA device found; running the CPU version (--cpu)", file=sys.stderr)
    results = Results(out, mode="cuda" if cuda else "cpu")
    work = Path(tempfile.mkdtemp(prefix="cona-gpu-check-"))
    try:
        env = init_distributed()  # a world of one, in this process
        device = env.device
        info = measure_device(device)
        profile = device_profile(info)
        info["profile"] = profile.model_dump(mode="json")
        results.data["device"] = info
        results.save()
        print(f"gpu-check: {info['name']}: matmul {info['matmul_tflops']:.1f} TFLOP/s, copy "
              f"{info['copy_gb_per_s']:.0f} GB/s", file=sys.stderr, flush=True)  # fmt: skip
        def part(name: str, run: Any) -> None:
            """One part; a part that breaks is reported and the next one still runs."""
            if name not in parts:
                return
            try:
                run()
            except Exception as e:
                results.data["errors"].append(f"{name}: {type(e).__name__}: {e}")
                results.save()
                import traceback

                traceback.print_exc()

        families = GPU_FAMILIES if cuda else CPU_FAMILIES
        budget_s = args.budget_s if args.budget_s is not None else (420.0 if cuda else math.inf)
        part("steps", lambda: run_steps(
            results, families=families, recomputes=["none", "selective", "full"], profile=profile, env=env, work=work,
            warmup=2 if cuda else 1, timed=3 if cuda else 2, deadline=started + budget_s))  # fmt: skip
        part("overhead", lambda: run_overhead(results, profile=profile, env=env, work=work, out=out))
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        part("switch", lambda: run_switch(results, cuda=cuda, profile=switch_profile(profile, cuda=cuda), work=work,
                                          data=synthetic_text(work)))  # fmt: skip
    except Exception as e:  # keep what was measured; say what broke
        results.data["errors"].append(f"{type(e).__name__}: {e}")
        results.save()
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results.data["wall_s"] = time.time() - started
    results.save()
    return report(results.data, results.path)


def synthetic_text(work: Path) -> Path:
    """A byte corpus for the switch runs: the Shakespeare plays when `data/` has them, else pseudo-text."""
    shakespeare = REPO / "data" / "shakespeare.txt"
    if shakespeare.exists():
        return shakespeare
    import random

    rng = random.Random(0)
    words = ["the", "king", "of", "and", "to", "my", "lord", "thou", "art", "in", "love", "what", "is", "a", "night"]
    path = work / "text.txt"
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(40_000)))
    return path


def switch_profile(profile: Any, *, cuda: bool) -> Any:
    """The profile of the switch runs: this machine, as many processes as the runs use."""
    data = profile.model_dump(mode="json")
    data["gpus_per_node"] = SWITCH_WORLD
    data["backend"] = "local"
    data["storage"]["run_root"] = "runs"
    return type(profile).model_validate(data)


def _g(value: float | None) -> str:
    return "—" if value is None else f"{value:.2g}"


def report(data: dict[str, Any], path: Path) -> int:
    info = data["device"]
    print(f"JSON {path}")
    print(f"device: {info['name']} (torch {info['torch']}), measured ceilings: matmul {info['matmul_tflops']:.1f} "
          f"TFLOP/s, copy {info['copy_gb_per_s']:.0f} GB/s; profile: peak {info['profile']['accelerator']['peak_tflops']} "
          f"TFLOP/s, matmul_efficiency {info['profile']['accelerator']['matmul_efficiency']}")  # fmt: skip
    if data["steps"]:
        columns, rows = steps_table(data["steps"])
        print_table("steps: measured next to the cost model (step time) and the memory model (peak allocated)", columns, rows)
    if data.get("overhead"):
        rows = []
        for r in data["overhead"]:
            prof = r.get("profile") or {}
            phases = prof.get("phases_s", {})
            rows.append([f"{r['preset']} mbs={r['strategy']['mbs']} gbs={r['strategy']['gbs']} {r['variant']}",
                         fmt_s(r["step_s"]), fmt_s(prof.get("device_busy_s")), str(prof.get("kernel_launches", "—")),
                         *(fmt_s(phases.get(f"cona.{k}")) for k in ("batch", "forward_backward", "statistics",
                                                                     "all_reduce", "optimizer"))])  # fmt: skip
        print_table("overhead: one step's wall time, the device's busy time in a profiled step, and the host time of "
                    "the trainer's phases (the host waits for the device in all_reduce)",
                    ["case", "step", "device busy", "launches", "batch", "fwd+bwd", "statistics", "all_reduce",
                     "optimizer"], rows)  # fmt: skip
    failed: list[str] = []
    if data["switch"] is not None:
        sw = data["switch"]
        c = sw["checks"]
        rows = [[n.replace("_", " "), str(c[f"{n}_first_switch_step"]), _g(c[f"{n}_before_switch_max_loss_diff"]),
                 _g(c[f"{n}_at_switch_loss_diff"]), f"{_g(c[f'{n}_whole_max_loss_diff'])} (1-{c[f'{n}_whole_steps']})",
                 _g(c["mbs_floor_max_loss_diff"]), str(c[f"{n}_samples_exact"])]
                for n in ("in_place", "relaunch")]  # fmt: skip
        print_table(f"switch: |Δloss| against the never-switched run (tolerance {sw['tolerance']}); in place vs "
                    f"relaunch over the {c['in_place_vs_relaunch_same_strategy_steps']} steps of equal strategies: "
                    f"{_g(c['in_place_vs_relaunch_max_loss_diff'])}",
                    ["run", "1st switch", "before it", "1st step after", "whole run (steps)", "mbs 4 vs 8 unswitched",
                     "samples exact"], rows)  # fmt: skip
        failed = switch_passed(sw)
        for reason in failed:
            print(f"gpu-check: FAILED: {reason}")
    for note in data["skipped"]:
        print(f"gpu-check: skipped: {note}")
    for error in data["errors"]:
        print(f"gpu-check: error: {error}")
    return 1 if failed or data["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
