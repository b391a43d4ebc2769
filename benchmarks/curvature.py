"""Is the critical batch the curvature-weighted noise scale? The plain and the Hessian-weighted estimates at one state.

    python -m benchmarks.curvature [--workloads gpt,llama,bert] [--states 2048,8192,24000,32000] [--batches 32]
                                   [--small 4] [--curvature-batch 256] [--repeats 3] [--seed 0]
                                   [--out curvature.json]

cona ranks with the plain noise scale B_simple = tr Σ / |G|² times `critical_batch_factor` (5), because the critical
batch the fixed runs of `benchmarks.ttp` show is 1.2–7× B_simple on GPT but 0.3–1.4× on Llama and 0.1–0.4× on
BERT (docs/benchmarks.md). McCandlish et al. (2018) derive the critical batch as the *curvature-weighted* noise
scale, B_noise = tr(HΣ) / GᵀHG, of which B_simple is the special case H ∝ I; for Adam the step is P·g (P = 1 /
(√v̂ + ε), AdamW's denominator) and the same derivation gives tr(PHPΣ) / (PG)ᵀH(PG). If the factor between the two
explains the workloads' factors, a run could measure its own factor online.

For each tiny workload (`benchmarks/jobs/*.yaml`) the model is trained at its base batch to each of `--states`
samples. At that state, `--batches` independent batches of `--small` samples each give gradients g_i (fresh data
beyond the state) and the Hessian-vector products H·v are exact (double backward, the math attention kernel) on a
separate curvature batch of `--curvature-batch` samples. For a direction set v_i (g_i, or P·g_i) and a metric M (I
or H), E[v_iᵀMv_i] = VᵀMV + tr(M·Cov)/small and E[v_iᵀMv_j] = VᵀMV for i ≠ j, so

    B = small · (mean over i of v_iᵀMv_i − mean over i ≠ j of v_iᵀMv_j) / (mean over i ≠ j of v_iᵀMv_j)

is unbiased in numerator and denominator. Each value is the median over `--repeats` independent draws (batches
and curvature batch), in tiny samples (× 8 for the reference preset's units).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from typing import Any

from benchmarks.common import ints_arg, map_workers, names_arg, print_table, run_main, shown, write_json
from benchmarks.ttp import WORKLOADS as TTP_WORKLOADS

WORKLOADS = {name: w["job"] for name, w in TTP_WORKLOADS.items()}
ESTIMATES = ("plain", "plain_H", "adam", "adam_H")
"""plain: B_simple (directions g_i, metric I); plain_H: tr(HΣ)/GᵀHG; adam: directions P·g_i, metric I (the `adam`
estimator's quantity); adam_H: directions P·g_i, metric H — the critical batch of Adam's step in the quadratic model."""


@dataclasses.dataclass(frozen=True)
class Settings:
    workload: str
    states: tuple[int, ...]
    batches: int
    small: int
    curvature_batch: int
    repeats: int
    seed: int


def pairwise_estimate(gram: Any, small: int) -> float | None:
    """B from the N×N matrix of v_iᵀMv_j (see the module docstring); None when the signal term is not positive."""
    n = gram.shape[0]
    gram = 0.5 * (gram + gram.T)
    diagonal = float(gram.diagonal().mean())
    off = (float(gram.sum()) - float(gram.diagonal().sum())) / (n * (n - 1))
    return small * (diagonal - off) / off if off > 0 else None


def measure(s: Settings) -> dict[str, Any]:
    """Every state of one workload: the four estimates per repeat, their medians and the state's validation loss."""
    import numpy as np
    import torch
    from cona.trainer.model import lm_loss_sum
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from benchmarks.sim import tiny_trainer

    torch.set_num_threads(1)
    sim = tiny_trainer(WORKLOADS[s.workload], seed=s.seed, stats=True)

    def mean_loss(start: int, end: int) -> torch.Tensor:
        batch = sim.batcher.samples(start, end)
        x = torch.from_numpy(np.ascontiguousarray(batch.inputs))
        y = torch.from_numpy(np.ascontiguousarray(batch.labels))
        return lm_loss_sum(part(x), y) / max(1, batch.num_targets)

    def flat(tensors: Any) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in tensors]).double()

    rows = []
    for state in sorted(s.states):
        while sim.samples < state:
            sim.train_step()
        val = sim.evaluate()
        part = sim.model.parts[0]  # the trainer keeps one model per gbs; the base batch's is the one trained (and
        # the one `mean_loss` evaluates)
        params = [p for p in part.parameters() if p.requires_grad]
        optimizer = sim.model.optimizers[0]
        group = optimizer.param_groups[0]
        beta2, eps = group["betas"][1], group["eps"]
        precondition = flat(
            1.0 / ((optimizer.state[p]["exp_avg_sq"] / (1 - beta2 ** float(optimizer.state[p]["step"]))).sqrt() + eps)
            for p in params
        )
        repeats = []
        # Fresh data well past the state: neither the trained samples nor each other's batches.
        offset = sim.samples + 100_000
        for _ in range(s.repeats):
            grads = []
            for i in range(s.batches):
                start = offset + i * s.small
                grads.append(flat(torch.autograd.grad(mean_loss(start, start + s.small), params)))
            offset += s.batches * s.small
            with sdpa_kernel(SDPBackend.MATH):  # the fused CPU kernel has no double backward
                curvature_grad = torch.autograd.grad(mean_loss(offset, offset + s.curvature_batch), params,
                                                     create_graph=True)  # fmt: skip
                offset += s.curvature_batch
                directions = {"plain": torch.stack(grads), "adam": torch.stack(grads) * precondition}
                estimates: dict[str, float | None] = {}
                for kind, vectors in directions.items():
                    hessian_products = []
                    for v in vectors:
                        pieces = []
                        at = 0
                        for p in params:
                            pieces.append(v[at : at + p.numel()].view_as(p).to(p.dtype))
                            at += p.numel()
                        dot = sum((g * piece).sum() for g, piece in zip(curvature_grad, pieces, strict=True))
                        hessian_products.append(flat(torch.autograd.grad(dot, params, retain_graph=True)))
                    estimates[kind] = pairwise_estimate(vectors @ vectors.T, s.small)
                    estimates[f"{kind}_H"] = pairwise_estimate(vectors @ torch.stack(hessian_products).T, s.small)
            repeats.append(estimates)
        medians = {}
        for name in ESTIMATES:
            values = [r[name] for r in repeats if r[name] is not None]
            medians[name] = statistics.median(values) if len(values) * 2 > len(repeats) else None
        rows.append({"state_samples": state, "state_val_loss": val, **medians, "repeats": repeats})
    return {"workload": s.workload, "job": WORKLOADS[s.workload], "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.curvature", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="gpt,llama,bert", help="comma-separated: gpt, llama, bert")
    parser.add_argument("--states", default="2048,8192,24000,32000",
                        help="samples trained at the base batch before each state")
    parser.add_argument("--batches", type=int, default=32, help="independent small batches per repeat (N ≥ 2)")
    parser.add_argument("--small", type=int, default=4, help="samples per small batch (tiny samples)")
    parser.add_argument("--curvature-batch", type=int, default=256, help="samples of the batch the Hessian is taken on")
    parser.add_argument("--repeats", type=int, default=3, help="independent draws per state (the median is shown)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=min(3, os.cpu_count() or 1), help="worker processes")
    parser.add_argument("--out", default="curvature.json", help="JSON name under benchmarks/results")
    args = parser.parse_args(argv)
    names = names_arg(parser, "--workloads", args.workloads, list(WORKLOADS))
    for flag, value, least in (("--batches", args.batches, 2), ("--small", args.small, 1),
                               ("--curvature-batch", args.curvature_batch, 1), ("--repeats", args.repeats, 1)):  # fmt: skip
        if value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
    states = ints_arg(parser, "--states", args.states)
    settings = [Settings(workload=n, states=states, batches=args.batches, small=args.small,
                         curvature_batch=args.curvature_batch, repeats=args.repeats, seed=args.seed)
                for n in names]  # fmt: skip
    started = time.time()
    results = map_workers(measure, settings, jobs=args.jobs)
    report = {"benchmark": "curvature", "wall_s": time.time() - started,
              "settings": {k: v for k, v in dataclasses.asdict(settings[0]).items() if k != "workload"},
              "workloads": results}  # fmt: skip
    path = write_json(args.out, report)

    def shown_value(x: float | None) -> str:
        return "—" if x is None else f"{x:.1f}"

    def ratio(x: float | None, base: float | None) -> str:
        return "—" if x is None or not base else f"{x / base:.2f}"

    table = [[r["workload"], f"{e['state_samples']}, {e['state_val_loss']:.2f}",
              *(shown_value(e[k]) for k in ESTIMATES), ratio(e["plain_H"], e["plain"]), ratio(e["adam_H"], e["plain"])]
             for r in results for e in r["rows"]]  # fmt: skip
    print_table("B (tiny samples) at one state: plain, curvature-weighted, Adam-preconditioned",
                ["workload", "state (samples, val loss)", *ESTIMATES, "plain_H / plain", "adam_H / plain"], table)
    print(f"wall {report['wall_s']:.0f} s; JSON {shown(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
