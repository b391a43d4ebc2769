"""Bytes per device of a strategy, as the trainer allocates them (docs/costmodel.md). Torch-free.

The peak of one step on the worst pipeline stage is

    model states (parameters, gradients, AdamW's two moments; FSDP2 shards them over dp)
  + parameters FSDP2 holds gathered (and, on GPUs, autocast's cached bf16 copies of the weights in use)
  + activations saved for backward × micro-batches in flight under the schedule
  + the working set of one layer's backward (and of its recomputed forward), counted once
  + the last stage's logits, their fp32 log-softmax and its gradient
  + allocator overhead (fragmentation) and, on GPUs, the CUDA context that max_memory_allocated does not see.

Activations are counted from the trainer's kernels (`trainer.model`) with fused attention (SDPA keeps q, k, v, its
output and a log-sum-exp per head: no s×s term); `tests/test_memorymodel.py` holds the counts against the bytes
the trainer's autograd graph really saves. `attention="materialized"` adds what unfused attention stores (the
scores' softmax and dropout mask, 5·a·s bytes per token in 16-bit, Korthikanti et al. 2022), to cost published runs
of systems that did not fuse it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from cona.protocol.job import ModelSpec, ParallelSpec

FRAGMENTATION = 0.10
"""Share of allocated bytes the caching allocator holds on top (fragmentation, workspaces, rounding)."""
CUDA_CONTEXT_BYTES = 1.0e9
"""The CUDA context and library handles of one process (not visible to torch.cuda.max_memory_allocated)."""


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device at the step's peak, on the worst pipeline stage."""

    params: float
    """Parameters at rest (fp32; the dp shard under FSDP2)."""
    grads: float
    """Gradients (fp32): unsharded while micro-batches accumulate, the dp shard otherwise."""
    optimizer: float
    """AdamW's exp_avg and exp_avg_sq (fp32, the dp shard)."""
    gathered: float
    """Unsharded parameters FSDP2 holds at the peak (two blocks when it reshards after forward, the whole stage
    otherwise; bf16 on GPUs); without FSDP on GPUs, autocast's bf16 copies of the weights."""
    activations: float
    """Saved for backward by every micro-batch in flight."""
    working: float
    """One layer's backward working set (with recompute: its recomputed activations), counted once."""
    logits: float
    """The last stage's logits, their fp32 log-softmax and its gradient, for one micro-batch."""
    overhead: float
    """Allocator fragmentation, and the CUDA context on GPUs."""

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.gathered + self.activations + self.working
                + self.logits + self.overhead)  # fmt: skip


def recompute_mode(parallel: ParallelSpec) -> str:
    """`none` or `full` (the trainer's per-block activation checkpointing)."""
    return "full" if parallel.activation_checkpointing else "none"


def layer_activation_bytes_per_token(
    model: ModelSpec, *, tp: int, device: Literal["cuda", "cpu"], attention: Literal["sdpa", "materialized"] = "sdpa"
) -> float:
    """Bytes one transformer block saves for backward per token on one tp rank, without recompute.

    Counted from `trainer.model`'s forward. The residual stream and the norms' inputs are fp32 (autocast runs norms
    in fp32); on GPUs every linear layer saves its own bf16 cast of its input, other activations are bf16; on CPU
    everything is fp32 and the q/k/v projections share one saved input. Terms split over tp carry /tp; the norms
    and the projections' inputs are replicated. Grouped-query attention repeats k and v to every head before SDPA
    (HF's repeat_kv), so SDPA saves four h-wide operands in every family; its kernel keeps about 2h more elements
    of its own (measured)."""
    h, f, a, s = model.hidden_size, model.ffn_hidden_size, model.num_heads, model.seq_len
    cuda = device == "cuda"
    act = 2 if cuda else 4
    llama = model.family == "llama"
    # fp32, replicated: each norm's input (RMSNorm also keeps its normalised x).
    fp32 = 4 * (2 * h if not llama else 4 * h)
    # Inputs of the linear layers fed by a norm (replicated): q, k, v and the MLP's input projection(s).
    mlp_inputs = 2 if llama else 1
    replicated = act * h * ((3 + mlp_inputs) if cuda else 2)
    # Split over tp: attention's q, k, v, output (and SDPA's layout copies), the output projection's input,
    # the MLP's activations.
    attention_bytes = act * (4 * h + 2 * h) + 4 * a  # q, k, v, output, the kernel's own; fp32 log-sum-exp per head
    mlp = act * (4 * f if llama else 2 * f)
    split = attention_bytes + act * h + mlp
    if attention == "materialized":
        split += 5 * a * s  # 16-bit scores' softmax (2), its dropout output (2) and mask (1), per head and key
    return fp32 + replicated + split / tp


def _in_flight(parallel: ParallelSpec, *, pp: int, num_microbatches: int, chunks: int) -> float:
    """Micro-batches whose activations the first stage holds at once (the worst stage)."""
    if pp == 1:
        return 1.0
    if parallel.pipeline_schedule == "gpipe":
        return float(num_microbatches)
    held = float(min(pp, num_microbatches))  # 1F1B: pp − stage warm-up forwards before the first backward
    if chunks > 1:
        # Interleaved 1F1B warms up (pp − 1)·2 + (v − 1)·pp chunks of L/(pp·v) layers before its first backward:
        # (1 + (pp − 1)/(pp·v)) times 1F1B's activations (Narayanan et al. 2021, §2.2.2).
        held *= 1 + (pp - 1) / (pp * chunks)
    return held


def estimate_memory(
    *, model: ModelSpec, parallel: ParallelSpec, dp: int, tp: int, pp: int, mbs: int, num_microbatches: int,
    chunks: int = 1, device: Literal["cuda", "cpu"] = "cuda", attention: Literal["sdpa", "materialized"] = "sdpa",
) -> MemoryBreakdown:  # fmt: skip
    """The memory of (dp, tp, pp, mbs) with `num_microbatches` per replica and `chunks` model chunks per pipeline
    rank (`cona.protocol.feasibility.virtual_stages`), on its worst stage."""

    h, v, s, num_layers = model.hidden_size, model.vocab_size, model.seq_len, model.num_layers
    tokens = mbs * s
    layer_params = (model.num_params - 2 * v * h) / num_layers  # blocks only (embeddings and head apart)
    layers = num_layers / pp
    # The first stage holds the embeddings, the last the head; with one stage, both.
    ends = 2 * v * h if pp == 1 else v * h
    stage_params = (layers * layer_params + ends) / tp
    fsdp = dp > 1
    shard = stage_params / dp if fsdp else stage_params
    params = 4 * shard
    accumulating = num_microbatches > 1 or pp > 1
    grads = 4 * (stage_params if (accumulating or not fsdp) else shard)
    optimizer = 8 * shard
    reshard = pp == 1 and parallel.sharded_dp
    gathered = 0.0
    param_bytes = 2 if device == "cuda" else 4  # FSDP2 gathers bf16 on GPUs (trainer.fsdp), fp32 on CPU
    if fsdp:
        gathered = param_bytes * (2 * layer_params / tp if reshard else stage_params)
    elif device == "cuda":
        gathered = 2 * stage_params  # without FSDP, autocast's bf16 copies of the weights are saved for backward

    per_layer = tokens * layer_activation_bytes_per_token(model, tp=tp, device=device, attention=attention)
    in_flight = _in_flight(parallel, pp=pp, num_microbatches=num_microbatches, chunks=chunks)
    if recompute_mode(parallel) == "full":
        # Each block keeps only its fp32 input; backward recomputes one block at a time.
        activations = in_flight * layers * tokens * 4 * h
        working = per_layer
    else:
        activations = in_flight * layers * per_layer
        working = 0.0
    working += tokens * 4 * h * 2  # the gradient of the residual stream flowing back, and its partner
    act = 2 if device == "cuda" else 4
    logits = tokens * v / tp * (act + 4 + 4)  # logits, fp32 log-softmax saved by the loss, its gradient
    allocated = params + grads + optimizer + gathered + activations + working + logits
    overhead = FRAGMENTATION * allocated + (CUDA_CONTEXT_BYTES if device == "cuda" else 0.0)
    return MemoryBreakdown(params, grads, optimizer, gathered, activations, working, logits, overhead)
