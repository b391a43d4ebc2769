"""Measure a device's matmul efficiency and memory bandwidth, and fit the cost model's accelerator fields.

    .venv/bin/python -m benchmarks.calibrate --profile slurm/profiles/a100-4x8.yaml [--hidden 4096] [--device cuda]

On the machine the profile describes (a GPU node, or this CPU for the local profiles), times the GEMMs a
transformer layer runs — (tokens × h) · (h × 4h) in the trainer's compute dtype (bf16 on CUDA, fp32 on CPU) — for a
sweep of tokens per micro-batch, and a streaming copy for the memory bandwidth. It fits

    efficiency(T) = matmul_efficiency · T / (T + matmul_half_tokens)

(least squares on 1/efficiency, which is linear in 1/T) against the profile's `peak_tflops`, prints the
`--profile-set` overrides to use (or to write into the profile), and writes benchmarks/results/calibrate-<name>.json.
The defaults of every profile come from Megatron-LM's published A100 runs (docs/costmodel.md); measured values
are better for your machine.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import positive_int, print_table, run_main, write_json


def fit_efficiency(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(matmul_efficiency, matmul_half_tokens) from (tokens, achieved fraction of peak) pairs.

    1/e = 1/e_max + (T0/e_max)·(1/T): ordinary least squares of 1/e on 1/T."""
    if len(points) < 2:
        raise ValueError("need at least two (tokens, efficiency) points to fit")
    xs = [1.0 / t for t, _ in points]
    ys = [1.0 / e for _, e in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    intercept = my - slope * mx
    if intercept <= 0:
        raise ValueError("the measurements do not saturate; extend the sweep to more tokens")
    e_max = 1.0 / intercept
    half = max(0.0, slope * e_max)
    return min(e_max, 1.0), half


def _timed(fn, *, sync, repeats: int) -> float:
    fn()  # warm-up: kernel selection, allocation
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def measure(*, device: str, hidden: int, tokens: list[int], repeats: int) -> dict[str, Any]:
    """Achieved matmul TFLOP/s per token count, and streaming copy bandwidth, on `device`."""
    import torch

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    weight = torch.randn(hidden, 4 * hidden, device=dev, dtype=dtype)
    rows = []
    for t in tokens:
        x = torch.randn(t, hidden, device=dev, dtype=dtype)
        seconds = _timed(lambda x=x: x @ weight, sync=sync, repeats=repeats)
        rows.append({"tokens": t, "seconds": seconds, "tflops": 2 * t * hidden * 4 * hidden / seconds / 1e12})
    buffer = torch.empty(64 * 2**20 // 4, device=dev, dtype=torch.float32)
    out = torch.empty_like(buffer)
    seconds = _timed(lambda: out.copy_(buffer), sync=sync, repeats=repeats)
    return {"device": str(dev), "dtype": str(dtype), "hidden": hidden, "matmul": rows,
            "copy_bytes_per_s": 2 * buffer.numel() * 4 / seconds}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from cona.orchestrator.profile import load_profile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True, type=Path, help="the profile whose accelerator this machine has")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: the profile's accelerator.device)")
    parser.add_argument("--hidden", type=positive_int, default=None, help="hidden size of the GEMMs (default 4096 on cuda, 512 on cpu)")
    parser.add_argument("--tokens", default=None, help="comma-separated tokens per micro-batch to sweep")
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed repetitions per shape")
    parser.add_argument("--out", type=Path, default=None, help="JSON to write (default benchmarks/results/calibrate-<profile>.json)")
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    device = args.device or profile.accelerator.device
    cuda = device.startswith("cuda")
    hidden = args.hidden or (4096 if cuda else 512)
    default_tokens = "128,256,512,1024,2048,4096,8192,16384" if cuda else "32,64,128,256,512,1024"
    tokens = [int(t) for t in (args.tokens or default_tokens).split(",")]
    result = measure(device=device, hidden=hidden, tokens=tokens, repeats=args.repeats or (20 if cuda else 3))
    peak = profile.accelerator.peak_tflops
    points = [(r["tokens"], r["tflops"] / peak) for r in result["matmul"]]
    try:
        efficiency, half = fit_efficiency(points)
    except ValueError as error:
        efficiency, half = None, None
        problem = str(error)
    print_table(
        f"matmul on {result['device']} ({result['dtype']}, h={hidden}) against peak {peak} TFLOP/s",
        ["tokens", "TFLOP/s", "of peak", "fit"],
        [[str(t), f"{r['tflops']:.3f}", f"{e:.3f}",
          "-" if efficiency is None else f"{efficiency * t / (t + half):.3f}"]
         for (t, e), r in zip(points, result["matmul"], strict=True)],
    )  # fmt: skip
    if efficiency is None:
        print(f"calibrate: {problem} (measured times vary too much on a busy machine: rerun with more --repeats)",
              file=sys.stderr)  # fmt: skip
        return 1
    bandwidth = result["copy_bytes_per_s"] / 1e9
    print(f"streaming copy: {bandwidth:.1f} GB/s (profile: {profile.accelerator.memory_bandwidth})")
    print("use:\n  --profile-set accelerator.matmul_efficiency="
          f"{efficiency:.3f} --profile-set accelerator.matmul_half_tokens={half:.0f}")
    write_json(args.out or f"calibrate-{profile.name}.json", {**result, "peak_tflops": peak, "matmul_efficiency": efficiency,
                                                  "matmul_half_tokens": half})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
