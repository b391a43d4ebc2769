"""The cost and memory models against Megatron-LM's published runs (tests/published/megatron_sc21.yaml).

The targets of docs/costmodel.md: every published configuration is feasible, every Table 1 row is predicted
within 15%, Table 2's ranking holds at each GPU count, the figures' best configuration is the model's best (or
within the model's own error of it). Where the model misses, the test asserts the miss as documented, with its
numbers, so a change that fixes it (or makes it worse) is seen.
"""

from __future__ import annotations

import itertools
import math

import pytest
from cona.orchestrator.costmodel import MODEL_ERROR

from benchmarks.published import all_cases, load_record, spearman


@pytest.fixture(scope="module")
def cases():
    return all_cases(load_record())


def group(cases, name):
    return [c for c in cases if c.group == name]


# The published configurations this trainer cannot hold in 80 GB (docs/costmodel.md, "Memory: where the trainer
# needs more than Megatron-LM"): the trainer keeps an fp32 residual stream and fp32 pipeline boundaries under
# autocast, gathers fp32 parameters under FSDP2, queues a second copy of the gradients for the noise statistics
# when dp = 1, and does not split the embedding and head over tp. A change to the trainer or the model that moves
# any configuration in or out of this set must update it (and the doc).
DOES_NOT_FIT = {
    ("table_1", "529.6B"), ("table_1", "1T"), ("table_2", "zero-3 384"),
    *(("figure_13", f"t{t} p{p} B{b}") for t, p in ((2, 32), (4, 16), (8, 8), (16, 4), (32, 2)) for b in (32, 128)),
    ("figure_16", "mbs8 B128"), ("figure_16", "mbs8 B512"),
}  # fmt: skip


def test_published_configurations_fit_except_the_documented_ones(cases):
    rejected = {(c.group, c.label): c for c in cases if not c.feasible}
    assert set(rejected) == DOES_NOT_FIT, {k: c.reason for k, c in rejected.items()}
    for c in rejected.values():
        assert "GB per device" in c.reason, c.reason  # memory, never a rule
        assert c.prediction.memory_gb < 100, (c.label, c.prediction.memory_gb)  # within 25% of the device
    for c in cases:
        if c.feasible:
            assert c.prediction.memory_bytes <= 80e9, f"{c.group} {c.label}: {c.prediction.memory_gb:.1f} GB"


def test_table_1_throughput_within_15_percent(cases):
    rows = group(cases, "table_1")
    assert len(rows) == 10
    table = "\n".join(f"{c.label}: predicted {c.predicted_tflops:.0f} published {c.published_tflops:.0f} "
                      f"({c.ratio:.2f})" for c in rows)  # fmt: skip
    for c in rows:
        assert 0.85 <= c.ratio <= 1.15, table


def test_table_2_ranking_holds_at_each_gpu_count(cases):
    rows = group(cases, "table_2")
    by_gpus: dict[int, dict[str, float]] = {}
    published: dict[int, dict[str, float]] = {}
    for c in rows:
        scheme = c.label.split()[0]
        by_gpus.setdefault(c.gpus, {})[scheme] = c.predicted_tflops
        published.setdefault(c.gpus, {})[scheme] = c.published_tflops
    for gpus, predicted in by_gpus.items():
        want = max(published[gpus], key=published[gpus].get)
        got = max(predicted, key=predicted.get)
        assert got == want, f"{gpus} GPUs: predicted {predicted}, published {published[gpus]}"
    # ZeRO-3 collapses as it scales (the whole model is gathered per micro-batch over ever more devices).
    zero = sorted((c for c in rows if c.label.startswith("zero-3")), key=lambda c: c.gpus)
    assert zero[0].predicted_tflops > zero[1].predicted_tflops > zero[2].predicted_tflops
    assert spearman([c.predicted_tflops for c in rows], [c.published_tflops for c in rows]) >= 0.9


def test_model_error_is_at_least_the_error_against_the_record(cases):
    # Megatron-LM's runs; the ZeRO-3 rows ran DeepSpeed, whose fp16 gathers are half the trainer's fp32 bytes.
    logs = [math.log(c.ratio) for c in cases if c.ratio and not c.label.startswith("zero-3")]
    rms = math.sqrt(sum(x * x for x in logs) / len(logs))
    assert rms - 1e-9 <= MODEL_ERROR, f"MODEL_ERROR={MODEL_ERROR} but the published record gives {rms:.3f}"


def best(rows, key):
    top = max(rows, key=lambda c: c.predicted_tflops)
    ties = [key(c) for c in rows if c.predicted_tflops >= top.predicted_tflops / (1 + MODEL_ERROR)]
    return key(top), ties


def test_figure_13_tensor_parallelism_within_a_node_is_best(cases):
    spec = load_record()["figure_13"]
    for gbs in spec["gbs"]:
        rows = [c for c in group(cases, "figure_13") if c.gbs == gbs]
        top, _ = best(rows, key=lambda c: [c.t, c.p])
        assert top == spec["best"], [(c.label, round(c.predicted_tflops)) for c in rows]
        across = [c for c in rows if c.t > 8]
        assert all(c.predicted_tflops < 0.5 * max(r.predicted_tflops for r in rows) for c in across)


def test_figure_14_longer_pipelines_are_slower(cases):
    rows = [c for c in group(cases, "figure_14") if c.gbs == 512]
    ordered = sorted(rows, key=lambda c: c.p)
    tflops = [c.predicted_tflops for c in ordered]
    # Decreasing with p, up to ties within the model's error at the short end.
    for a, b in itertools.pairwise(tflops):
        assert b <= a * (1 + MODEL_ERROR), [(c.label, round(c.predicted_tflops, 1)) for c in ordered]
    assert tflops[0] > tflops[-1] * 1.3


def test_figure_14_batch_32_is_a_documented_miss(cases):
    # docs/costmodel.md: at batch 32 the data-parallel exchange of 32 replicas of a 5.9B model is charged at each
    # GPU's share of its node's NICs, which Megatron's all-reduce beat; the model puts p = 8 first, the paper p = 2.
    rows = sorted((c for c in group(cases, "figure_14") if c.gbs == 32), key=lambda c: c.p)
    top, _ = best(rows, key=lambda c: c.p)
    assert top == 8, [(c.label, round(c.predicted_tflops, 1), round(c.prediction.dp_comm_s, 3)) for c in rows]
    assert rows[0].prediction.dp_comm_s > rows[0].prediction.compute_s  # the reason: exposed dp communication


def test_figure_16_best_micro_batch(cases):
    spec = load_record()["figure_16"]
    for gbs in spec["gbs"]:
        rows = [c for c in group(cases, "figure_16") if c.gbs == gbs]
        _, ties = best(rows, key=lambda c: c.mbs)
        assert spec["best_mbs"] in ties, [(c.label, round(c.predicted_tflops, 1)) for c in rows]
        if gbs == 128:  # 16 micro-batches through 8 stages: the largest micro-batch pays a bubble the model must see
            assert 8 not in ties
    rows = [c for c in group(cases, "figure_16") if c.gbs == 512]
    assert best(rows, key=lambda c: c.mbs)[0] == spec["best_mbs"]
