"""The heartbeat's gradient statistics equal a brute-force single-process computation on the same batch.

The trainer runs two steps under a layout and checkpoints after step 1; this test loads that checkpoint into one
plain model, rebuilds step 2's global batch from the sample order and computes, by brute force:

* global: |∇ mean loss over the global batch|²;
* local: dp > 1 — the mean over replicas of |∇ mean loss over the replica's gbs/dp samples|²;
  dp = 1 — the mean over micro-batches of |∇ mean loss over the micro-batch|²;
* the Adam variants with AdamW's bias-corrected denominator from the checkpoint; under dp > 1 the local one is
  the documented shard estimator (every element taken from the replica whose rank owns that element's FSDP shard).

Layouts: dp (dp2), dp×tp, dp×pp, tp×pp (micro-batch statistics with tp and pp), llama's grouped-query heads under
dp×tp, and the 3-D dp2×tp2×pp2 (8 processes, marked slow).
"""

from __future__ import annotations

import pytest
import torch
from cona.protocol.job import load_job
from cona.protocol.rundir import ExitCode
from cona.protocol.strategy import Strategy
from cona.trainer.checkpoint import read_checkpoint_tensors
from cona.trainer.data import Batcher, load_corpus
from cona.trainer.model import build_model, lm_loss_sum, materialize

try:
    from tests.trainer_helpers import describe, launch, step_records, write_job
except ImportError:  # tests/ is not a package here
    from trainer_helpers import describe, launch, step_records, write_job

_COLWISE = ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")
_ROWWISE = ("attn.wo", "mlp.w2")


def _tp_pieces(name: str, tensor: torch.Tensor, tp: int) -> list[tuple[torch.Tensor, float]]:
    """The tp ranks' local pieces of a parameter (or of a tensor shaped like it) and their 1/replication weights."""
    owner = name.rsplit(".", 1)[0]
    if tp > 1 and owner.endswith(_COLWISE):
        return [(piece, 1.0) for piece in tensor.chunk(tp, dim=0)]
    if tp > 1 and owner.endswith(_ROWWISE) and name.endswith("weight"):
        return [(piece, 1.0) for piece in tensor.chunk(tp, dim=1)]
    return [(tensor, 1.0 / tp)] * tp


def _grads(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (lm_loss_sum(model(inputs), labels) * scale).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _sq(grads: dict[str, torch.Tensor], denom: dict[str, torch.Tensor] | None = None) -> float:
    return sum(float(((g / denom[n]) if denom else g).double().pow(2).sum()) for n, g in grads.items())


def brute_force(run_dir, job_path, strategy: Strategy) -> dict[str, float]:
    job = load_job(job_path)
    state = read_checkpoint_tensors(run_dir / "checkpoints" / "step-00000001")
    model = materialize(build_model(job.model), device="cpu", seed=job.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[f"model.{name}"])
    beta2, eps = job.optimizer.beta2, job.optimizer.eps
    previous = {name: state[f"optim.state.{name}.exp_avg_sq"].double() for name, _ in model.named_parameters()}
    steps = {name: float(state[f"optim.state.{name}.step"]) for name, _ in model.named_parameters()}

    def adam_denominator(name: str, grad: torch.Tensor, v: torch.Tensor | None = None) -> torch.Tensor:
        v = previous[name] if v is None else v
        second = beta2 * v + (1 - beta2) * grad.double() ** 2
        return (second / (1 - beta2 ** (steps[name] + 1))).sqrt() + eps

    def adam_sq(grads: dict[str, torch.Tensor]) -> float:
        return sum(float((g.double() / adam_denominator(n, g)).pow(2).sum()) for n, g in grads.items())

    gbs, dp = strategy.gbs, strategy.dp
    batch = Batcher(job, load_corpus(job)).samples(gbs, 2 * gbs)  # step 2 consumes [gbs, 2·gbs)
    inputs, labels = torch.from_numpy(batch.inputs), torch.from_numpy(batch.labels)
    count = batch.num_targets
    full = _grads(model, inputs, labels, 1.0 / count)
    result = {"global_sqnorm": _sq(full), "adam_global_sqnorm": adam_sq(full)}

    groups = dp if dp > 1 else strategy.num_microbatches
    size = gbs // groups
    local = [
        _grads(model, inputs[i * size : (i + 1) * size], labels[i * size : (i + 1) * size], groups / count)
        for i in range(groups)
    ]
    result["local_sqnorm"] = sum(_sq(g) for g in local) / groups
    if dp == 1:
        result["adam_local_sqnorm"] = sum(adam_sq(g) for g in local) / groups
        return result
    # dp > 1: each rank contributes its own replica's gradient on the elements of its own FSDP shard
    # (dim-0 chunks of the tp-local piece), weighted 1/replication across tp.
    total = 0.0
    for name in full:
        v_pieces = _tp_pieces(name, previous[name], strategy.tp)
        for r in range(dp):
            g_pieces = _tp_pieces(name, local[r][name], strategy.tp)
            for (g_piece, weight), (v_piece, _) in zip(g_pieces, v_pieces, strict=True):
                g_chunks, v_chunks = g_piece.chunk(dp, dim=0), v_piece.chunk(dp, dim=0)
                if r < len(g_chunks):
                    g = g_chunks[r].double()
                    total += weight * float((g / adam_denominator(name, g, v_chunks[r])).pow(2).sum())
    result["adam_local_sqnorm"] = total
    return result


LAYOUTS = [
    pytest.param("tiny-gpt", "dp=2,tp=1,pp=1,mbs=2,gbs=16", 2, id="gpt-dp2"),
    pytest.param("tiny-gpt", "dp=2,tp=2,pp=1,mbs=2,gbs=16", 4, id="gpt-dp2-tp2"),
    pytest.param("tiny-gpt", "dp=2,tp=1,pp=2,mbs=2,gbs=16", 4, id="gpt-dp2-pp2"),
    pytest.param("tiny-gpt", "dp=1,tp=2,pp=2,mbs=2,gbs=16", 4, id="gpt-tp2-pp2-microbatches"),
    pytest.param("tiny-llama", "dp=2,tp=2,pp=1,mbs=4,gbs=16", 4, id="llama-dp2-tp2"),
    pytest.param("tiny-gpt", "dp=2,tp=2,pp=2,mbs=2,gbs=16", 8, id="gpt-dp2-tp2-pp2", marks=pytest.mark.slow),
]


@pytest.mark.distributed
@pytest.mark.parametrize(("preset", "strategy", "nproc"), LAYOUTS)
def test_gradient_statistics_equal_brute_force(tmp_path, preset, strategy, nproc):
    _statistics_equal_brute_force(tmp_path, preset, strategy, nproc)


@pytest.mark.distributed
def test_gradient_statistics_equal_brute_force_under_sequence_parallelism(tmp_path):
    """The norms' weights are DTensors replicated over tp there (their gradients summed over the sequence slices):
    counted once, as every replicated parameter."""
    _statistics_equal_brute_force(tmp_path, "tiny-llama", "dp=2,tp=2,pp=1,mbs=4,gbs=16", 4, sequence_parallel=True)


def _statistics_equal_brute_force(tmp_path, preset: str, strategy: str, nproc: int, *, sequence_parallel: bool = False) -> None:
    # The Adam-preconditioned norms are computed only when asked for (the orchestrator asks for the adam estimator).
    job = write_job(tmp_path, preset=preset, checkpoint={"interval_steps": 1, "keep": 5}, heartbeat={"adam_stats": True},
                    parallel={"sequence_parallel": sequence_parallel})  # fmt: skip
    run = tmp_path / "run"
    result = launch(run, nproc=nproc, strategy=strategy, job=job, max_steps=2)
    assert result.exit_code == ExitCode.STOPPED, describe(result)
    record = step_records(run, 0)[2]
    parsed = Strategy.parse(strategy)
    want = brute_force(run, job, parsed)
    assert record["global_batch"] == parsed.gbs
    assert record["local_batch"] == (parsed.gbs // parsed.dp if parsed.dp > 1 else parsed.mbs)
    for key in ("global_sqnorm", "local_sqnorm"):
        assert record[key] == pytest.approx(want[key], rel=1e-4), key
    for key in ("adam_global_sqnorm", "adam_local_sqnorm"):
        assert record[key] == pytest.approx(want[key], rel=1e-3), key
    assert record["local_sqnorm"] > record["global_sqnorm"], "a smaller batch has a noisier gradient"


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("strategy", "nproc"),
    [
        pytest.param("dp=2,tp=1,pp=1,mbs=2,gbs=16", 2, id="fsdp-reduce-scatter-hook"),
        pytest.param("dp=1,tp=1,pp=2,mbs=2,gbs=16", 2, id="micro-batch-hooks-pp2"),
    ],
)
def test_statistics_do_not_change_the_training(tmp_path, strategy, nproc):
    """Statistics read gradients and never touch the math: the losses are bit-identical with them on or off, and
    the Adam-preconditioned norms are computed only when asked for (`heartbeat.adam_stats`, which the orchestrator
    sets for the adam estimator)."""
    records = {}
    for name, heartbeat in (
        ("adam", {"interval_steps": 1, "gradient_stats": True, "adam_stats": True}),
        ("plain", {"interval_steps": 1, "gradient_stats": True, "adam_stats": False}),
        ("off", {"interval_steps": 1, "gradient_stats": False, "adam_stats": True}),
    ):
        (tmp_path / name).mkdir()
        job = write_job(tmp_path / name, heartbeat=heartbeat)
        result = launch(tmp_path / name / "run", nproc=nproc, strategy=strategy, job=job, max_steps=4)
        assert result.exit_code == ExitCode.STOPPED, describe(result)
        records[name] = step_records(tmp_path / name / "run", 0)
    losses = {name: [records[name][step]["train_loss"] for step in (1, 2, 3, 4)] for name in records}
    assert losses["adam"] == losses["plain"] == losses["off"]
    assert [records["adam"][s]["global_sqnorm"] for s in (1, 2, 3, 4)] == [
        records["off"][s]["global_sqnorm"] for s in (1, 2, 3, 4)
    ]  # the clipping norm, bit for bit
    assert records["adam"][2]["adam_local_sqnorm"] > 0 and records["adam"][2]["adam_global_sqnorm"] > 0
    assert records["plain"][2]["local_sqnorm"] == pytest.approx(records["adam"][2]["local_sqnorm"], rel=1e-6)
    assert records["plain"][2].get("adam_local_sqnorm") is None and records["plain"][2].get("adam_global_sqnorm") is None
    assert records["off"][2].get("local_sqnorm") is None
