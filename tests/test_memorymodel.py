"""The memory model against what the trainer allocates (CPU) and its own invariants."""

from __future__ import annotations

import pytest
import torch
from cona.orchestrator.memorymodel import estimate_memory, layer_activation_bytes_per_token
from cona.protocol.job import ModelSpec, ParallelSpec
from cona.trainer.model import build_model, materialize, rope_tables


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for backward while `fn` runs."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


# Sequences of 128 and more: below that, CPU torch runs SDPA's unfused math kernel, which keeps the a·s scores
# (docs/costmodel.md).
SHAPES = [  # (family, hidden, heads, kv heads, ffn, seq, mbs)
    ("gpt", 128, 4, 4, 512, 128, 4),
    ("gpt", 96, 3, 3, 256, 256, 2),
    ("llama", 128, 4, 2, 384, 128, 4),
    ("llama", 64, 4, 2, 160, 256, 3),
    ("bert", 128, 4, 4, 512, 128, 4),
]


@pytest.mark.parametrize("family,hidden,heads,kv,ffn,seq,mbs", SHAPES)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["none", "full"])
def test_block_activations_match_what_autograd_saves(family, hidden, heads, kv, ffn, seq, mbs, checkpointing):
    spec = ModelSpec(family=family, num_layers=2, hidden_size=hidden, num_heads=heads, num_kv_heads=kv,
                     ffn_hidden_size=ffn, vocab_size=256, seq_len=seq)  # fmt: skip
    model = build_model(spec, device="meta")
    materialize(model, device=torch.device("cpu"), seed=0)
    block = model.layers["0"]
    block.activation_checkpointing = checkpointing
    rope = (rope_tables(seq_len=seq, head_dim=spec.head_dim, theta=spec.rope_theta, device=torch.device("cpu"))
            if family == "llama" else None)  # fmt: skip
    x = torch.randn(mbs, seq, hidden, requires_grad=True)
    measured = saved_bytes(lambda: block(x, rope))
    tokens = mbs * seq
    if checkpointing:  # only the block's input (and RoPE's shared tables) stay
        assert measured == pytest.approx(4 * hidden * tokens, rel=0.05)
        return
    modelled = tokens * layer_activation_bytes_per_token(spec, tp=1, device="cpu")
    assert modelled == pytest.approx(measured, rel=0.10), f"modelled {modelled:,.0f} B, measured {measured:,.0f} B"


def gpt(**kw) -> ModelSpec:
    return ModelSpec(family="gpt", num_layers=24, hidden_size=2048, num_heads=16, vocab_size=50257, seq_len=2048, **kw)


def memory(parallel: ParallelSpec, **kw):
    args = dict(model=gpt(), parallel=parallel, dp=8, tp=1, pp=1, mbs=1, num_microbatches=4)
    args.update(kw)
    return estimate_memory(**args)


def test_fsdp_shards_states_and_resharding_gathers_two_blocks():
    sharded = memory(ParallelSpec(sharded_dp=True))
    single = memory(ParallelSpec(sharded_dp=True), dp=1)
    assert sharded.params == pytest.approx(single.params / 8) and sharded.optimizer == pytest.approx(single.optimizer / 8)
    kept = memory(ParallelSpec(sharded_dp=False))
    assert sharded.gathered < kept.gathered  # resharded after forward: two blocks, not the whole stage


def test_recompute_keeps_block_inputs_and_counts_the_working_set_once():
    none = memory(ParallelSpec(activation_checkpointing=False), pp=4, num_microbatches=16)
    full = memory(ParallelSpec(activation_checkpointing=True), pp=4, num_microbatches=16)
    assert full.activations < none.activations / 10
    assert full.working > none.working  # one recomputed block, not one per micro-batch in flight
    one_block = memory(ParallelSpec(activation_checkpointing=True), pp=4, num_microbatches=4).working
    assert full.working == pytest.approx(one_block)


def test_micro_batches_in_flight_follow_the_schedule():
    def acts(schedule, m, **kw):
        return memory(ParallelSpec(pipeline_schedule=schedule), pp=4, num_microbatches=m, **kw).activations

    assert acts("gpipe", 16) == pytest.approx(4 * acts("1f1b", 16))  # GPipe holds all 16, 1F1B pp = 4
    assert acts("1f1b", 2) == pytest.approx(acts("gpipe", 2))  # fewer micro-batches than stages: all in flight
    assert acts("interleaved", 16, chunks=2) > acts("1f1b", 16)


def test_materialized_attention_adds_the_score_terms():
    spec = gpt()
    sdpa = layer_activation_bytes_per_token(spec, tp=8, device="cuda")
    unfused = layer_activation_bytes_per_token(spec, tp=8, device="cuda", attention="materialized")
    assert unfused - sdpa == pytest.approx(5 * spec.num_heads * spec.seq_len / 8)


def test_megatrons_one_trillion_parameter_run_fits_in_80_gb():
    spec = ModelSpec(family="gpt", num_layers=128, hidden_size=25600, num_heads=160, vocab_size=51200, seq_len=2048)
    m = estimate_memory(model=spec, parallel=ParallelSpec(activation_checkpointing=True, sharded_dp=False), dp=6,
                        tp=8, pp=64, mbs=1, num_microbatches=512, device="cuda", attention="materialized")  # fmt: skip
    assert m.total < 80e9, m
