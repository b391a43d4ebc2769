"""Bytes per device of one strategy, counted the way the trainer allocates them (torch-free; `cona plan` uses it).

The peak of a training step is the largest of its phases, for the pipeline rank that needs the most:

* **forward/backward** — model states (parameters, gradients, AdamW's two moments, as FSDP2 shards them over dp),
  the parameters FSDP2 holds gathered, the activations every micro-batch in flight keeps for backward, the logits
  and the loss's buffers on the last stage, and on top the transient working set of *one* layer's backward (its
  recomputation under `parallel.recompute` included): layers are backwarded one at a time, so it is counted once,
  not per micro-batch;
* **optimizer step** — the states and the reduced gradients, plus AdamW's temporaries, with the activations gone.

Every count follows the trainer's code (`trainer/model.py`, `trainer/parallel.py`, `trainer/fsdp.py`,
`trainer/pipeline.py`, `trainer/optim.py`) and says which line of it makes the tensor. On `cuda` the trainer runs
bf16 autocast over fp32 parameters: a linear layer's input and weight are cast to bf16 (the weight's cast is cached
for the autocast region, an activation's is cast again at every use), matmul and attention outputs are bf16, while
LayerNorm/softmax/log-softmax upcast to fp32 and the residual stream, embeddings and RMSNorm stay fp32 (an fp32
tensor plus a bf16 one is fp32). On `cpu` everything is fp32.

Per-layer activation counts were measured on CPU with a dispatch mode that follows every tensor storage
(tests/test_memorymodel.py); the bf16 counts are the same lists of tensors with autocast's dtypes, and on an H200
`torch.cuda.max_memory_allocated` was 0.95-1.00 of `allocated` for 27 strategies of the three families
(`python -m benchmarks.gpu`, tests/test_gpu_check.py re-predicts them). What the model cannot know: the caching allocator's fragmentation (a
fraction), cuBLAS/NCCL workspaces and the CUDA context (a fixed amount), kernels that pick another SDPA backend,
and the exact moment gradients and activations overlap inside one layer's backward.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from cona.protocol.feasibility import stage_layers
from cona.protocol.job import ModelSpec, ParallelSpec

Device = Literal["cuda", "cpu"]
Attention = Literal["sdpa", "materialized"]

FP32 = 4
BF16 = 2
INDEX = 8  # int64 token ids and labels
STATE_BYTES = {"param": FP32, "grad": FP32, "adam": 2 * FP32}
"""fp32 parameters, fp32 gradients and AdamW's two fp32 moments on either device (autocast casts, it does not store
bf16 parameters)."""
OVERHEAD_FRACTION: dict[str, float] = {"cuda": 0.05, "cpu": 0.0}
"""Caching-allocator fragmentation and block rounding on top of what tensors occupy: `max_memory_reserved` runs a few
percent above `max_memory_allocated` in steady, static-shape training. glibc's allocator on CPU: not modelled."""
CUDA_CONTEXT_BYTES = 1.0e9
"""The CUDA context and kernel images (~0.5 GB), cuBLAS workspaces and NCCL's communicator buffers: device memory
that `torch.cuda.max_memory_allocated` does not see but the device must have."""
STATS_PENDING_LIMIT = 256
"""`trainer.gradstats.PENDING_LIMIT`: micro-batch gradient tensors the statistics queue before taking their norms."""


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device at the peak of a training step, for the pipeline rank whose total is largest."""

    params: float
    """fp32 parameters this device stores: its pipeline stages' share, split by tp (norms, embeddings and the head
    stay replicated over tp) and sharded by FSDP2 over dp."""
    grads: float
    """fp32 gradients alive at the peak: none yet when the peak comes before any backward finished (one
    micro-batch); FSDP2's unsharded accumulation buffers (the whole stage, tp-local) while it accumulates without
    reducing (every micro-batch under pp, all but the last one without pp); otherwise the sharded ones."""
    optimizer: float
    """AdamW's two fp32 moments, sharded like the parameters."""
    gathered: float
    """Unsharded fp32 parameters FSDP2 holds at the peak: the root unit (embeddings and head, never resharded after
    forward) plus the current and the prefetched block when it reshards after forward (pp == 1 and sharded_dp), or
    the whole stage when it does not; 0 without dp."""
    activations: float
    """Saved for backward, all micro-batches in flight at this rank: per layer per micro-batch, the stage's boundary
    activations, the embedding and head layers' saved tensors, and on cuda autocast's bf16 weight copies (saved by
    each matmul for backward, or held by the autocast cache across the pipeline schedule)."""
    working: float
    """Transient peak on top, counted once: one layer's backward working set (its recomputation under selective or
    full recompute, its gradient buffers) beyond what the logits' transient frees by then, or the optimizer step's
    temporaries beyond everything the forward/backward phase held, whichever is larger."""
    logits: float
    """The last stage's logits (bf16 on cuda, fp32 on cpu; vocabulary not split by tp: the head is replicated), the
    loss's fp32 log-softmax per micro-batch in flight, and the gradient pair of the loss's backward."""
    overhead: float
    """Allocator fragmentation (`OVERHEAD_FRACTION` of the rest) and, on cuda, the CUDA context, cuBLAS and NCCL
    workspaces (`CUDA_CONTEXT_BYTES`), which `max_memory_allocated` does not see; none on cpu."""

    @property
    def total(self) -> float:
        return (
            self.params + self.grads + self.optimizer + self.gathered + self.activations + self.working
            + self.logits + self.overhead
        )  # fmt: skip

    @property
    def allocated(self) -> float:
        """What `torch.cuda.max_memory_allocated` (or the trainer's live tensors on CPU) should show: all but the
        overhead."""
        return self.total - self.overhead


# Parameters ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Params:
    """Parameter counts of one piece of a stage on one tp rank: all of them, and those autocast casts to bf16."""

    total: float
    cast: float
    largest: float
    """The largest single tensor (AdamW's single-tensor temporaries on CPU are as large as it)."""

    def __add__(self, other: _Params) -> _Params:
        return _Params(self.total + other.total, self.cast + other.cast, max(self.largest, other.largest))

    def times(self, k: float) -> _Params:
        return _Params(self.total * k, self.cast * k, self.largest if k else 0.0)


_NONE = _Params(0.0, 0.0, 0.0)


def _kv(model: ModelSpec) -> int:
    return model.num_kv_heads * model.head_dim


def _layer_params(model: ModelSpec, tp: int) -> _Params:
    """One block on one tp rank (`trainer.model.Block`, split by `tp_plan`)."""
    h, f, kv = model.hidden_size, model.ffn_hidden_size, _kv(model)
    llama = model.family == "llama"
    # q, k, v and the MLP's input projections are column-parallel (weights and biases split), wo and w2 row-parallel
    # (weights split, biases replicated); norms are replicated.
    matrices = (2 * h * h + 2 * h * kv + (3 if llama else 2) * h * f) / tp
    col_bias = 0 if llama else (h + 2 * kv + f) / tp
    row_bias = 0 if llama else 2 * h
    norms = 2 * h if llama else 4 * h  # RMSNorm: a gain; LayerNorm: gain and bias
    cast = matrices + col_bias + row_bias  # what F.linear casts under autocast
    return _Params(matrices + col_bias + row_bias + norms, cast, max(h * f, h * h) / tp)


def _embedding_params(model: ModelSpec) -> _Params:
    """The first stage's embeddings (replicated over tp; an embedding lookup is not autocast)."""
    h, v = model.hidden_size, model.vocab_size
    total = v * h
    if model.family in ("gpt", "bert"):
        total += model.seq_len * h  # learned positions
    if model.family == "bert":
        total += 2 * h + (model.type_vocab_size or 0) * h  # embedding LayerNorm, token types
    return _Params(total, 0.0, v * h)


def _head_params(model: ModelSpec, *, tied_copy: bool) -> _Params:
    """The last stage's head (replicated over tp). A tied head (BERT's, `model.tie_embeddings`) keeps the token
    embedding on the last stage too when that is not the first stage (`trainer.model.prune_to_stage`)."""
    h, v = model.hidden_size, model.vocab_size
    if model.family != "bert":
        norm = 2 * h if model.family == "gpt" else h  # final LayerNorm (gain, bias) or RMSNorm (gain)
        if not model.tie_embeddings:
            return _Params(norm + v * h, v * h, v * h)
        copy = v * h if tied_copy else 0
        return _Params(norm + copy, v * h, v * h)  # the head's matmul casts the embedding under autocast
    # BERT: MLM dense (+bias), its LayerNorm, the decoder bias; the decoder weight is the token embedding
    own = h * h + h + 2 * h + v
    cast = h * h + h + v * h + v  # the dense layer and the decoder (weight and bias) run under autocast
    return _Params(own + (v * h if tied_copy else 0), cast, v * h if tied_copy else h * h)


def _num_tensors(model: ModelSpec, layers: int, first: bool, last: bool) -> int:
    """Parameter tensors of a stage (weights, biases, norm gains)."""
    per_layer = 9 if model.family == "llama" else 16
    first_n = {"gpt": 2, "llama": 1, "bert": 4 + bool(model.type_vocab_size)}[model.family] if first else 0
    last_n = {"gpt": 3, "llama": 2, "bert": 6}[model.family] if last else 0
    return max(1, layers * per_layer + first_n + last_n)


# Activations per token ------------------------------------------------------------------------------------------


def _elem(device: Device) -> int:
    """Bytes of a matmul's or attention's output: bf16 under autocast, fp32 on CPU."""
    return BF16 if device == "cuda" else FP32


def _attention_extra(model: ModelSpec, *, device: Device, tp: int, attention: Attention) -> tuple[float, float]:
    """(what an unfused attention adds to a layer's saved set per token, of which a selective recompute keeps)."""
    if attention == "sdpa":
        return 0.0, 0.0
    # Scores and softmax output (a·s per token each) plus the dropout mask (1 byte): Megatron's 5·a·s² per sample
    # at half precision; a selective recompute keeps the scores (a bmm output) and recomputes softmax and mask.
    e, heads_s = _elem(device), model.num_heads / tp * model.seq_len
    return heads_s * (2 * e + 1), heads_s * e


def _lse(model: ModelSpec, tp: int, attention: Attention) -> float:
    """SDPA's fp32 logsumexp per head (kept for its backward)."""
    return FP32 * model.num_heads / tp if attention == "sdpa" else 0.0


def _layer_none(model: ModelSpec, *, device: Device, tp: int, attention: Attention, sp: int = 1) -> float:
    """Bytes per token one block saves for backward without recompute (tensors listed as `Block` makes them).

    `sp`: the tp degree when the block runs sequence-parallel (`parallel.sequence_parallel`), else 1. The norms then
    keep slices of the sequence (their inputs, normalised values and statistics: / sp), while each projection keeps
    the whole input attention or the MLP gathered, as without it (torch's tensor-parallel linears save their input;
    Megatron's would gather it again in backward)."""
    h, f = model.hidden_size, model.ffn_hidden_size
    e, cuda = _elem(device), device == "cuda"
    if model.family == "llama":
        # RMSNorm keeps its input and the normalised x (fp32: x.float() · rsqrt), then each projection keeps its input:
        # one fp32 tensor on CPU, on cuda a bf16 cast per projection (autocast casts activations at every use).
        # attention: x, normed, n (3 casts) | MLP: x1, normed, n (2 casts: w1 and w3)
        norms, inputs = FP32 * 4 * h, (5 * BF16 if cuda else 2 * FP32) * h
        replicated = norms / sp + inputs
        # SDPA keeps q, k, v, output; after RoPE (its products with constant cos/sin save nothing) and
        # repeat_interleave, k and v have all heads' width: h each, even under grouped-query attention.
        # SwiGLU keeps w1's output (silu), silu's output and w3's output (the product), the product (w2).
        split = (e * 4 * h + e * 4 * f) / tp
        stats = 2 * FP32 / sp  # two rsqrt columns
    else:
        # gpt (pre-norm): block input x (LayerNorm), normed n1 (q, k, v), x1 = x + attn (LayerNorm), normed n2 (w1);
        # bert (post-norm): x (q, k, v), r1 = x + attn (LayerNorm), x1 (w1), r2 = x1 + mlp (LayerNorm).
        # On cuda the three projections each keep a bf16 cast of their shared input and w1 one of its own, while
        # the LayerNorm inputs stay fp32 (the residual stream is fp32): 4h+6h+4h+2h bytes, as many as 4 fp32 tensors.
        norms, inputs = 2 * FP32 * h, (4 * BF16 if cuda else 2 * FP32) * h
        replicated = norms / sp + inputs
        kv = _kv(model)
        # SDPA keeps q, k, v and its output (wo reads that output without a copy); GELU keeps its input, w2 GELU's output.
        split = (e * (2 * h + 2 * kv) + e * 2 * f) / tp
        stats = 2 * 2 * FP32 / sp  # mean and rstd of two LayerNorms
    return replicated + split + stats + _lse(model, tp, attention) + _attention_extra(
        model, device=device, tp=tp, attention=attention
    )[0]


def _layer_selective(model: ModelSpec, *, device: Device, tp: int, attention: Attention, sp: int = 1) -> float:
    """Bytes per token one block keeps under selective recompute (`trainer.recompute.SAVE_OPS`): the checkpoint's
    input, every matmul's output, attention's output and logsumexp, and tp's collectives' outputs (`sp`: see
    `_layer_none`)."""
    h, f, kv = model.hidden_size, model.ffn_hidden_size, _kv(model)
    e = _elem(device)
    mlp_in = (2 if model.family == "llama" else 1) * f
    saved = FP32 * h / sp  # the block's input (fp32 residual stream), kept by the checkpoint to replay the block
    saved += e * (h + 2 * kv + h + mlp_in) / tp  # q, k, v, attention output, MLP input projection(s): split by tp
    saved += e * 2 * h  # wo's and w2's outputs: row-parallel, full width on every tp rank (partial sums)
    if sp > 1:
        saved += e * 2 * h / sp  # their reduce-scattered slices (the gathered inputs are gathered again in backward)
    elif tp > 1:
        saved += e * 2 * h  # and their all-reduced sums
    return saved + _lse(model, tp, attention) + _attention_extra(model, device=device, tp=tp, attention=attention)[1]


def _layer_saved(model: ModelSpec, *, mode: str, device: Device, tp: int, attention: Attention, sp: int = 1) -> float:
    if mode == "full":
        return FP32 * model.hidden_size / sp  # the block's input only (fp32 residual stream; a slice under sp)
    if mode == "selective":
        return _layer_selective(model, device=device, tp=tp, attention=attention, sp=sp)
    return _layer_none(model, device=device, tp=tp, attention=attention, sp=sp)


def _layer_working(model: ModelSpec, *, mode: str, device: Device, tp: int, attention: Attention, sp: int = 1) -> float:
    """Bytes per token of one block's backward beyond what it saved: the gradient buffers alive at once and, under
    recompute, what the replayed forward saves again."""
    h, f = model.hidden_size, model.ffn_hidden_size
    e = _elem(device)
    # The residual gradient coming in and going out (fp32), and the MLP's hidden-width gradients: two for GELU,
    # three for SwiGLU (its product's two inputs and w1's output).
    grads = 2 * FP32 * h + (3 if model.family == "llama" else 2) * e * f / tp
    # Under sp the residual gradients are slices, but the gathered inputs' gradients are whole until reduce-scattered:
    # the same bound.
    none = _layer_none(model, device=device, tp=tp, attention=attention, sp=sp)
    if mode == "full":
        return grads + none - FP32 * h / sp  # the replay saves everything again but the input it started from
    if mode == "selective":
        # The replay saves everything `none` does, except what the first forward kept (read from the cache).
        shared = _layer_selective_shared(model, device=device, tp=tp, attention=attention, sp=sp)
        return grads + max(0.0, none - shared)
    return grads


def _layer_selective_shared(model: ModelSpec, *, device: Device, tp: int, attention: Attention, sp: int = 1) -> float:
    """The part of a block's `none` saved set that selective recompute keeps from the first forward (cached)."""
    h, f, kv = model.hidden_size, model.ffn_hidden_size, _kv(model)
    e = _elem(device)
    if model.family == "llama":  # the input, attention's output, w1's and w3's outputs (q, k, v pass RoPE first)
        shared = FP32 * h / sp + e * (h + 2 * f) / tp
    else:  # q, k, v (SDPA reads the matmuls' outputs), the attention output, w1's output; and the fp32 input x
        shared = e * (2 * h + 2 * kv + f) / tp
        # bert on cuda keeps only bf16 casts of its input in `none`; under sp the projections' whole inputs are
        # gathered again in the replay, not kept from the first forward.
        if sp == 1 and (device == "cpu" or model.family == "gpt"):
            shared += FP32 * h
    return shared + _lse(model, tp, attention) + _attention_extra(model, device=device, tp=tp, attention=attention)[1]


def _embedding_saved(model: ModelSpec) -> float:
    """Bytes per token the first stage's embedding layers save: the token ids (embedding backward), and BERT's
    embedding LayerNorm its fp32 input and statistics (its output is the first block's input, counted there)."""
    saved = float(INDEX)
    if model.family == "bert":
        saved += FP32 * model.hidden_size + 2 * FP32
    return saved


def _head_saved(model: ModelSpec, *, device: Device) -> float:
    """Bytes per token the last stage's head saves before the logits."""
    h = model.hidden_size
    cuda = device == "cuda"
    if model.family == "gpt":  # final LayerNorm's fp32 input, the output layer's input (bf16 cast on cuda)
        return FP32 * h + (BF16 if cuda else FP32) * h + 2 * FP32
    if model.family == "llama":  # RMSNorm's input and normalised x, the output layer's input
        return 2 * FP32 * h + (BF16 if cuda else FP32) * h + FP32
    # BERT: mlm_dense's input, its output (GELU), GELU's output (LayerNorm, upcast to fp32 on cuda), the decoder's input
    if cuda:
        return BF16 * h + BF16 * h + (BF16 + FP32) * h + BF16 * h + 2 * FP32
    return 4 * FP32 * h + 2 * FP32


def _logits_per_micro(model: ModelSpec, *, device: Device) -> tuple[float, float, float]:
    """Bytes per token of (the logits held until backward, the loss's log-softmax kept for its backward, the loss
    backward's transient gradients).

    `lm_loss_sum`: `logits.float()` (a copy on cuda, the same tensor on cpu), cross-entropy = log-softmax (keeps
    its fp32 output) + NLL; in backward the NLL's gradient and log-softmax's input gradient (fp32 each) are alive
    together. The output layer's own output (bf16 on cuda) is held by the caller (`ParallelModel.forward_backward`,
    the pipeline stage's output cache) until the micro-batch's backward is done.
    """
    v = model.vocab_size
    held = (BF16 if device == "cuda" else FP32) * v
    return held, FP32 * v, 2 * FP32 * v


# Schedules ------------------------------------------------------------------------------------------------------


def in_flight(*, schedule: str, pp: int, rank: int, num_microbatches: int, virtual: int = 1) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, in units of all its layers' share.

    * no pipeline: 1 — gradient accumulation backwards each micro-batch before the next forward;
    * GPipe: all m — every forward runs before the first backward;
    * 1F1B: min(pp − rank, m) — rank r runs pp − r forwards before its first backward, then one forward per
      backward (torch's `Schedule1F1B`), so rank 0 holds the most;
    * interleaved 1F1B with v chunks per rank (Narayanan et al. 2021, §2.2.2, and torch's
      `ScheduleInterleaved1F1B`): rank r warms up with (v − 1)·pp + 2·(pp − 1 − r) chunk-forwards — the first
      pp micro-batches through every chunk but the last, and two per later rank so that each rank's first backward
      finds its successor's ready — then holds one more in the steady state: (v − 1)·pp + 2·(pp − 1 − r) + 1
      chunk-micro-batches, each 1/v of the rank's layers. For rank 0 that is (pp + (pp − 1)/v) micro-batches of its
      layers (Korthikanti et al. 2022, §4.2.3: a factor 1 + (pp − 1)/(pp·v) over 1F1B's pp), capped by the m·v
      chunk-micro-batches there are.
    """
    m = num_microbatches
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved":
        chunks = (virtual - 1) * pp + 2 * (pp - 1 - rank) + 1
        return min(chunks, m * virtual) / virtual
    return float(min(pp - rank, m))


# The estimate -----------------------------------------------------------------------------------------------------


def estimate_memory(
    *, model: ModelSpec, parallel: ParallelSpec, dp: int, tp: int, pp: int, mbs: int, num_microbatches: int,
    device: Device = "cuda", attention: Attention = "sdpa",
) -> MemoryBreakdown:  # fmt: skip
    """Peak bytes per device of training `model` under (dp, tp, pp, mbs) with `num_microbatches` per replica.

    `device="cuda"` is what the trainer does on GPUs (bf16 autocast over fp32 states), `"cpu"` fp32 throughout.
    `attention="materialized"` costs an unfused attention that stores its s² scores and softmax (published runs
    from before fused attention, such as Megatron's of 2021); the trainer itself uses SDPA.
    """
    schedule = parallel.pipeline_schedule
    virtual = 1
    if schedule == "interleaved" and pp > 1:
        virtual = parallel.virtual_stages
    num_stages = pp * virtual
    per_stage = stage_layers(model.num_layers, num_stages)
    tokens = mbs * model.seq_len
    mode = parallel.recompute
    best: MemoryBreakdown | None = None
    seen: set[tuple[int, bool, bool, bool]] = set()
    for rank in range(pp):
        # A rank's memory depends on it only through its blocks, whether it holds the first or the last stage,
        # and the micro-batches it holds in flight (and so whether some backward has finished): more in flight,
        # more activations, all else equal. `in_flight` never grows with the rank, so of the ranks alike in the
        # rest only the first can be the peak — 4 to 6 ranks to cost, not pp (a 2,048-node elastic range builds
        # its candidates 3x faster; the result is the same).
        mine = [rank + j * pp for j in range(virtual)]
        flight = in_flight(schedule=schedule, pp=pp, rank=rank, num_microbatches=num_microbatches, virtual=virtual)
        alike = (sum(per_stage[s] for s in mine), 0 in mine, num_stages - 1 in mine, flight < num_microbatches)
        if alike in seen:
            continue
        seen.add(alike)
        breakdown = _rank_memory(
            model=model, parallel=parallel, mode=mode, dp=dp, tp=tp, pp=pp, rank=rank, stages=per_stage,
            virtual=virtual, tokens=tokens, num_microbatches=num_microbatches, device=device, attention=attention,
        )  # fmt: skip
        if best is None or breakdown.total > best.total:
            best = breakdown
    assert best is not None
    return best


def _rank_memory(
    *, model: ModelSpec, parallel: ParallelSpec, mode: str, dp: int, tp: int, pp: int, rank: int, stages: list[int],
    virtual: int, tokens: int, num_microbatches: int, device: Device, attention: Attention,
) -> MemoryBreakdown:  # fmt: skip
    num_stages = len(stages)
    sp = tp if tp > 1 and parallel.sequence_parallel else 1  # what a sequence-parallel block's slices divide by
    my_stages = [rank + j * pp for j in range(virtual)]  # stage s on pp rank s mod pp
    has_first, has_last = 0 in my_stages, num_stages - 1 in my_stages
    layer = _layer_params(model, tp)
    my_layers = sum(stages[s] for s in my_stages)
    blocks = layer.times(my_layers)
    emb = _embedding_params(model) if has_first else _NONE
    head = _head_params(model, tied_copy=num_stages > 1 and not has_first) if has_last else _NONE
    root = emb + head  # FSDP2's root unit: what is not a block
    params_rank = blocks + root

    cuda = device == "cuda"

    # Micro-batches in flight, and whether some backward already finished when the peak comes (then the gradients
    # of the whole stage exist): without pp from the second micro-batch on; under pp when the rank's warm-up is
    # shorter than its micro-batches (the steady state runs a forward after each backward).
    m = num_microbatches
    flight = in_flight(schedule=parallel.pipeline_schedule, pp=pp, rank=rank, num_microbatches=m, virtual=virtual)
    grads_exist = m > 1 if pp == 1 else flight < m

    # Model states. FSDP2 (dp > 1) shards every parameter of the stage over dp; AdamW's state follows.
    shard = 1.0 / dp
    params = STATE_BYTES["param"] * params_rank.total * shard
    optimizer = STATE_BYTES["adam"] * params_rank.total * shard
    reshard = pp == 1 and parallel.sharded_dp  # trainer.fsdp.reshard_after_forward
    gathered = 0.0
    if dp > 1:
        # The root unit (embeddings, head) is not resharded after forward (it would be gathered again at once);
        # with resharding the blocks are gathered one at a time, the next one prefetched; without it all stay.
        # FSDP2 gathers the fp32 parameters (autocast casts after the gather).
        gathered = FP32 * (root.total + 2 * layer.total) if reshard else FP32 * params_rank.total

    # Gradients at the two moments that can be the forward/backward peak: (A) the loss's backward on the last
    # stage, (B) the first block's backward after it, at its MLP (the f-wide gradients), when the block's w2 (its
    # largest tensor) has its gradient and the others not yet.
    if dp > 1:
        # Without a reduction (pp: every micro-batch, the pipeline reduces once at the end; no pp: all but the last
        # micro-batch) FSDP2 accumulates unsharded gradients; otherwise a block's unsharded gradient lives until it
        # is reduce-scattered.
        grads_a = grads_b = FP32 * params_rank.total if grads_exist else FP32 * layer.total
    else:
        # Without dp the gradient-noise statistics' hooks (`trainer.gradstats`, on by default) queue each
        # micro-batch's gradients (at most `STATS_PENDING_LIMIT` tensors) before autograd accumulates them, so
        # the first micro-batch's are cloned into .grad and both copies live until the next micro-batch's first
        # gradient flushes the queue: two copies at (A), one plus the block's new gradient at (B).
        queued = min(1.0, STATS_PENDING_LIMIT / _num_tensors(model, my_layers, has_first, has_last))
        if grads_exist:
            grads_a = FP32 * params_rank.total * (1 + queued)
            grads_b = FP32 * (params_rank.total + head.total + layer.largest)
        else:  # the first backward: no gradient yet at (A); the head's and the block's w2, queued twice, at (B)
            grads_a, grads_b = 0.0, 2 * FP32 * (head.total + layer.largest)

    # Activations of one micro-batch on this rank.
    per_micro = tokens * my_layers * _layer_saved(model, mode=mode, device=device, tp=tp, attention=attention, sp=sp)
    if has_first:
        per_micro += tokens * _embedding_saved(model)
    if has_last:
        per_micro += tokens * _head_saved(model, device=device)
    # A pipeline stage's output (fp32, full width; its slice of the sequence under sp) stays in the stage's cache
    # until its backward.
    per_micro += tokens * FP32 * model.hidden_size / sp * sum(1 for s in my_stages if s != num_stages - 1)
    activations = flight * per_micro
    if cuda:
        # autocast's bf16 weight copies. Without recompute every matmul saves its cast weight for backward; under
        # pp the whole schedule runs in one autocast region, whose cache keeps every cast weight until the step
        # ends. Without pp and with recompute the cache dies with the forward's autocast region: only the head's
        # (outside the checkpoints) survive, and the replay casts one block again (`working`).
        activations += BF16 * (params_rank.cast if mode == "none" or pp > 1 else root.cast)

    # Logits: the held output and log-softmax per micro-batch in flight at the last stage (1 under 1F1B's last
    # stage, all under GPipe), and one loss backward's gradient pair; by (B) that micro-batch's log-softmax and
    # gradient pair are gone.
    logits_a = logits_b = 0.0
    if has_last:
        held, log_softmax, backward = _logits_per_micro(model, device=device)
        last_flight = float(m) if parallel.pipeline_schedule == "gpipe" and pp > 1 else 1.0
        logits_a = tokens * (last_flight * (held + log_softmax) + backward)
        logits_b = logits_a - tokens * (log_softmax + backward)

    # (B): one block's backward on top; on cuda a weight gradient is made in bf16 before it is added to the fp32
    # one, and without pp a replayed block casts its weights again.
    layer_work = tokens * _layer_working(model, mode=mode, device=device, tp=tp, attention=attention, sp=sp)
    if cuda:
        layer_work += BF16 * layer.largest
        if mode != "none" and pp == 1:
            layer_work += BF16 * layer.cast
    states = params + optimizer + gathered + activations
    if has_last and states + grads_a + logits_a >= states + grads_b + logits_b + layer_work:
        grads, logits, working = grads_a, logits_a, 0.0
    else:
        grads, logits, working = grads_b, logits_b, layer_work

    # (C) the optimizer step: activations and gathered parameters are gone, gradients reduced (sharded) or plain.
    # AdamW on cuda runs its foreach kernels: one fp32 temporary as large as the rank's moments' shard (sqrt of
    # the second moment); on CPU its single-tensor loop: two temporaries of the largest tensor.
    step_grads = FP32 * params_rank.total * shard
    temp = FP32 * params_rank.total * shard if cuda else 2 * FP32 * params_rank.largest * (shard if dp > 1 else 1)
    step = params + optimizer + step_grads + temp
    fwd_bwd = states + grads + logits + working
    working += max(0.0, step - fwd_bwd)

    allocated = fwd_bwd + max(0.0, step - fwd_bwd)
    overhead = OVERHEAD_FRACTION[device] * allocated + (CUDA_CONTEXT_BYTES if cuda else 0.0)
    return MemoryBreakdown(
        params=params, grads=grads, optimizer=optimizer, gathered=gathered, activations=activations,
        working=working, logits=logits, overhead=overhead,
    )  # fmt: skip


def describe(breakdown: MemoryBreakdown) -> str:
    """One line, in GB, for logs and assertion messages."""
    fields = [f.name for f in dataclasses.fields(breakdown)]
    parts = [f"{name} {getattr(breakdown, name) / 1e9:.2f}" for name in fields]
    return f"total {breakdown.total / 1e9:.2f} GB = " + " + ".join(parts)
