"""The cost and memory models against Megatron-LM's published runs (Narayanan et al., SC 2021).

    .venv/bin/python -m benchmarks.published            # prints the tables, writes benchmarks/results/published.json

The record (`tests/published/megatron_sc21.yaml`, with its sources) is costed with cona's own model on the
shipped DGX A100 profile (`slurm/profiles/a100-4x8.yaml` widened to each run's node count), with the run's
settings: full recomputation, unfused attention (`attention="materialized"`), the paper's micro-batch, global batch
and virtual stages. Throughput is reported the paper's way: its FLOP formula over the predicted iteration time.
`tests/test_costmodel_published.py` asserts the targets on the same numbers; docs/costmodel.md shows the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path
from typing import Any

import yaml
from cona.orchestrator.costmodel import Prediction, predict
from cona.orchestrator.job import Job, job_from_dict
from cona.orchestrator.planner import evaluate, layout_reason
from cona.orchestrator.profile import ClusterProfile, load_profile

from benchmarks.common import REPO, RESULTS, write_json

RECORD = REPO / "tests" / "published" / "megatron_sc21.yaml"
VOCAB, SEQ = 51200, 2048


def load_record(path: Path = RECORD) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def paper_flops(*, layers: int, hidden: int, gbs: int, seq: int = SEQ, vocab: int = VOCAB) -> float:
    """FLOPs of one iteration as the paper counts them (with recomputation): 96·B·s·l·h²·(1 + s/6h + V/16lh)."""
    return 96 * gbs * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def record_cluster(record: dict[str, Any]) -> ClusterProfile:
    """The record's cluster: a shipped profile with the record's overrides."""
    return load_profile(REPO / record["profile"], record.get("profile_set", []))


def a100_cluster(gpus: int, profile: ClusterProfile) -> ClusterProfile:
    """`profile` with as many nodes as the run used."""
    nodes = max(1, -(-gpus // profile.gpus_per_node))
    return profile.model_copy(update={"nodes": nodes})


def megatron_job(model: dict[str, Any], *, mbs: int, gbs: int, v: int = 1, sharded_dp: bool = False) -> Job:
    """A cona job for one published run: a GPT of the run's shape, full recompute, its batch and schedule."""
    parallel: dict[str, Any] = {"sharded_dp": sharded_dp, "recompute": "full"}
    if v > 1:
        parallel.update(pipeline_schedule="interleaved", virtual_stages=v)
    return job_from_dict({
        "name": f"megatron-{model['name']}",
        "model": {"family": "gpt", "num_layers": model["layers"], "hidden_size": model["hidden"],
                  "num_heads": model["heads"], "vocab_size": VOCAB, "seq_len": SEQ},
        "batch": {"min_gbs": 1, "max_gbs": max(gbs, 1), "base_gbs": gbs, "mbs_choices": [mbs]},
        "parallel": parallel,
    }, source=f"published run {model['name']}")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    """One published configuration, costed."""

    group: str
    label: str
    gpus: int
    t: int
    p: int
    d: int
    mbs: int
    gbs: int
    published_tflops: float | None
    feasible: bool
    reason: str
    prediction: Prediction | None
    flops: float

    @property
    def predicted_tflops(self) -> float:
        if self.prediction is None:
            return 0.0
        return self.flops / (self.prediction.iter_time_s * self.gpus) / 1e12

    @property
    def ratio(self) -> float | None:
        return self.predicted_tflops / self.published_tflops if self.published_tflops else None

    def to_dict(self) -> dict[str, Any]:
        p = self.prediction
        return {
            "group": self.group, "label": self.label, "gpus": self.gpus, "t": self.t, "p": self.p, "d": self.d,
            "mbs": self.mbs, "gbs": self.gbs, "feasible": self.feasible, "reason": self.reason,
            "published_tflops": self.published_tflops, "predicted_tflops": round(self.predicted_tflops, 2),
            "ratio": None if self.ratio is None else round(self.ratio, 4),
            "iter_time_s": None if p is None else round(p.iter_time_s, 4),
            "memory_gb": None if p is None else round(p.memory_gb, 2),
        }  # fmt: skip


def cost(group: str, label: str, model: dict[str, Any], *, cluster: ClusterProfile, gpus: int, t: int, p: int,
         mbs: int, gbs: int, v: int = 1, sharded_dp: bool = False, published: float | None = None) -> Case:  # fmt: skip
    d = gpus // (t * p)
    assert d * t * p == gpus, (label, gpus, t, p)
    job = megatron_job(model, mbs=mbs, gbs=gbs, v=v, sharded_dp=sharded_dp)
    profile = a100_cluster(gpus, cluster)
    problem = layout_reason(job=job, profile=profile, dp=d, tp=t, pp=p)
    c = evaluate(profile=profile, job=job, dp=d, tp=t, pp=p, mbs=mbs, gbs=gbs, layout_problem=problem,
                 attention="materialized")  # fmt: skip
    prediction = c.prediction or predict(
        profile=profile, job=job, dp=d, tp=t, pp=p, mbs=mbs, gbs=gbs, attention="materialized"
    )
    return Case(group, label, gpus, t, p, d, mbs, gbs, published, c.feasible, c.reason, prediction,
                paper_flops(layers=model["layers"], hidden=model["hidden"], gbs=gbs))  # fmt: skip


def table_1(record: dict[str, Any], cluster: ClusterProfile) -> list[Case]:
    return [
        cost("table_1", row["name"], row, cluster=cluster, gpus=row["gpus"], t=row["t"], p=row["p"], mbs=row["mbs"], gbs=row["gbs"],
             v=row["v"], published=row["tflops"])
        for row in record["table_1"]
    ]  # fmt: skip


def table_2(record: dict[str, Any], cluster: ClusterProfile) -> list[Case]:
    spec = record["table_2"]
    return [
        cost("table_2", f"{row['scheme']} {row['gpus']}", spec["model"], cluster=cluster, gpus=row["gpus"], t=row["t"], p=row["p"],
             mbs=row["mbs"], gbs=spec["gbs"], sharded_dp=row["scheme"] == "zero-3", published=row["tflops"])
        for row in spec["rows"]
    ]  # fmt: skip


def figure_13(record: dict[str, Any], cluster: ClusterProfile) -> list[Case]:
    spec = record["figure_13"]
    return [
        cost("figure_13", f"t{t} p{p} B{gbs}", spec["model"], cluster=cluster, gpus=spec["gpus"], t=t, p=p, mbs=spec["mbs"], gbs=gbs)
        for gbs in spec["gbs"] for t, p in spec["configs"]
    ]  # fmt: skip


def figure_14(record: dict[str, Any], cluster: ClusterProfile) -> list[Case]:
    spec = record["figure_14"]
    return [
        cost("figure_14", f"p{p} d{spec['gpus'] // p} B{gbs}", spec["model"], cluster=cluster, gpus=spec["gpus"], t=1, p=p,
             mbs=spec["mbs"], gbs=gbs)
        for gbs in spec["gbs"] for p in spec["pipeline_sizes"]
    ]  # fmt: skip


def figure_16(record: dict[str, Any], cluster: ClusterProfile) -> list[Case]:
    spec = record["figure_16"]
    return [
        cost("figure_16", f"mbs{mbs} B{gbs}", spec["model"], cluster=cluster, gpus=spec["gpus"], t=spec["t"], p=spec["p"], mbs=mbs,
             gbs=gbs)
        for gbs in spec["gbs"] for mbs in spec["mbs"]
    ]  # fmt: skip


def all_cases(record: dict[str, Any] | None = None) -> list[Case]:
    record = record or load_record()
    cluster = record_cluster(record)
    return [c for table in (table_1, table_2, figure_13, figure_14, figure_16) for c in table(record, cluster)]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (no ties expected in the published values)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else 1.0


def print_cases(cases: list[Case]) -> None:
    header = f"{'group':<10} {'run':<16} {'GPUs':>5} {'t':>3} {'p':>3} {'d':>4} {'mbs':>3} {'gbs':>5} " \
             f"{'mem GB':>7} {'TFLOP/s':>8} {'published':>9} {'ratio':>6}"  # fmt: skip
    print(header)
    print("-" * len(header))
    for c in cases:
        mem = f"{c.prediction.memory_gb:7.1f}" if c.prediction else "      -"
        pub = f"{c.published_tflops:9.0f}" if c.published_tflops else "        -"
        ratio = f"{c.ratio:6.2f}" if c.ratio else "     -"
        flag = "" if c.feasible else f"  REJECTED: {c.reason}"
        print(f"{c.group:<10} {c.label:<16} {c.gpus:>5} {c.t:>3} {c.p:>3} {c.d:>4} {c.mbs:>3} {c.gbs:>5} {mem} "
              f"{c.predicted_tflops:8.1f} {pub} {ratio}{flag}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "published.json")
    args = parser.parse_args(argv)
    record = load_record()
    cases = all_cases(record)
    print_cases(cases)
    t1 = [c for c in cases if c.group == "table_1"]
    worst = max(t1, key=lambda c: abs(math.log(c.ratio or 1)))
    print(f"\nTable 1: predicted/published from {min(c.ratio for c in t1):.2f} to {max(c.ratio for c in t1):.2f} "
          f"(worst {worst.label}); Table 2 rank correlation "
          f"{spearman([c.predicted_tflops for c in cases if c.group == 'table_2'], [c.published_tflops for c in cases if c.group == 'table_2']):.2f}")  # fmt: skip
    write_json(args.out, {"cases": [c.to_dict() for c in cases], "profile": record["profile"]})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
