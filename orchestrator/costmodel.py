"""Analytical iteration time and memory of a strategy on a cluster (docs/costmodel.md).

One optimizer step of (dp, tp, pp, mbs, gbs) is costed as what the trainer does on each device:

- **matmuls** — the FLOPs of every linear layer, the attention kernel and the output head, forward, backward and
  the recomputed forward, at a fraction of the device's peak that grows with the tokens of one micro-batch
  (`AcceleratorSpec.matmul_efficiency`, `matmul_half_tokens`): small GEMMs do not fill the device;
- **memory-bound kernels** — norms, residual adds, activations, RoPE, layout copies and, when attention is not
  fused, the softmax over the s×s scores: bytes moved at the device's memory bandwidth. They cost a fixed share of
  the per-token work of width h, so their weight against the matmuls (width h²/t) grows as h/t shrinks: this, not
  one efficiency constant, is why small models and wide tensor parallelism reach a lower fraction of peak;
- **tensor parallelism** — all-reduces of the activations, two per layer per pass, on the slowest link of the tp
  group (NVLink inside a node, the node's NICs shared by its devices across nodes);
- **pipeline** — (m + (p − 1)/v) slots of the slowest stage: the p − 1 fill/drain slots (divided by the v virtual
  stages of the interleaved schedule) are the bubble, whatever the ratio of micro-batches m to stages p;
  point-to-point sends of the activations and their gradients;
- **data parallelism** — FSDP2's all-gathers (per micro-batch when parameters are resharded after forward, once
  per step otherwise) and the gradient reduce-scatter, in the parameters' dtype, partly hidden behind compute;
- **optimizer** — AdamW streaming its fp32 states through memory.

Collectives run at `NetworkSpec.bandwidth_efficiency` of the nominal link bandwidth plus a latency per ring step.
The memory of the strategy comes from `cona.orchestrator.memorymodel`. The constants below are counted from the
trainer's kernels; the efficiencies in the profiles are fitted to published measurements (docs/costmodel.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from cona.orchestrator.job import Job
from cona.orchestrator.memorymodel import estimate_memory
from cona.orchestrator.profile import ClusterProfile
from cona.protocol.feasibility import stage_layers, virtual_stages
from cona.protocol.job import ModelSpec

Attention = Literal["sdpa", "materialized"]
"""How attention runs: `sdpa` is the trainer's (a fused kernel that never stores the s×s scores, and skips the
masked half of a causal product); `materialized` writes the scores and the softmax to memory (unfused attention, as
in Megatron-LM's published runs of 2021)."""

MEMORY_BANDWIDTH_EFFICIENCY = 0.8
"""Fraction of the device's nominal memory bandwidth that elementwise kernels reach (streaming reads and writes)."""
DP_OVERLAP = 0.7
"""Fraction of the compute during which FSDP2's prefetched all-gathers and reduce-scatters run that actually hides
them: the collectives share the device's memory bandwidth and SMs with the compute they overlap."""
MODEL_ERROR = 0.05
"""Relative error of a predicted iteration time: the RMS of log(predicted/published) over Megatron-LM's published
runs of Tables 1 and 2 (`python -m benchmarks.published`; a test keeps it at least that). Table 2's ZeRO-3 rows
ran DeepSpeed, which gathers half the bytes the trainer's FSDP2 gathers (docs/costmodel.md). Strategies whose
predictions differ by less than this are ties as far as the model can tell."""
SELECTIVE_HOST_FORWARDS = 2.6
"""Host cost of a block under selective recompute, in forwards: the forward, its replay, and the dispatch mode
that decides per op what to save (about 1.6 forwards of Python on its own; fitted with `host_layer_ms` to the
step times `python -m benchmarks.gpu` measured on an H200, docs/benchmarks.md)."""
OPTIMIZER_BYTES_PER_PARAM = 28
"""AdamW (foreach) per parameter: reads fp32 param, grad, exp_avg, exp_avg_sq (16 bytes), writes three (12)."""


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted seconds per optimizer step, by part, and bytes of memory per device."""

    compute_s: float
    """Matmuls and memory-bound kernels of the m micro-batches on the slowest stage."""
    tp_comm_s: float
    pipeline_bubble_s: float
    p2p_s: float
    dp_comm_s: float
    """Exposed data-parallel communication (the part not hidden behind compute)."""
    optimizer_s: float
    """AdamW's pass over its fp32 states, plus the step's host overhead (`AcceleratorSpec.step_overhead_ms`)."""
    memory_bytes: float
    model_state_bytes: float
    activation_bytes: float

    @property
    def iter_time_s(self) -> float:
        return (
            self.compute_s + self.tp_comm_s + self.pipeline_bubble_s + self.p2p_s + self.dp_comm_s + self.optimizer_s
        )

    @property
    def memory_gb(self) -> float:
        return self.memory_bytes / 1e9


# ------------------------------------------------------------------------------------------------- the model's work


def matmul_params_per_layer(model: ModelSpec) -> int:
    """Weights of one block that take part in matmuls (q, k, v, o and the MLP), as `trainer.model` builds it."""
    h, f = model.hidden_size, model.ffn_hidden_size
    kv = model.num_kv_heads * model.head_dim
    mlp = 3 * h * f if model.family == "llama" else 2 * h * f
    return 2 * h * h + 2 * h * kv + mlp


def head_params(model: ModelSpec) -> int:
    """Weights of the output head's matmuls (BERT adds its MLM transform)."""
    h, v = model.hidden_size, model.vocab_size
    return h * v + (h * h if model.family == "bert" else 0)


def attention_flops_per_token(model: ModelSpec, attention: Attention) -> float:
    """Forward FLOPs per token of one layer's score and value products (QKᵀ and PV), before any tp split."""
    full = 4 * model.seq_len * model.hidden_size
    causal = model.family != "bert"
    # A fused causal kernel skips the blocks above the diagonal; a materialised product computes them all.
    return full / 2 if causal and attention == "sdpa" else full


def elementwise_elements_per_token(model: ModelSpec, tp: int, attention: Attention) -> float:
    """Elements read plus written per token by one layer's memory-bound forward kernels on one tp rank.

    Counted from `trainer.model`: norms (read and write h; RMSNorm runs as four unfused passes) and residual adds
    (read 2h, write h) are replicated on every tp rank; the MLP activation (GELU: read and write f; SwiGLU: SiLU
    then a product, 5f), RoPE on q and k, and the copies around the attention kernel are split over tp. Unfused
    attention also writes the scores, reads them into the softmax, writes the probabilities and reads them again:
    four passes over the a·s scores per token.
    """
    h, f, a, s = model.hidden_size, model.ffn_hidden_size, model.num_heads, model.seq_len
    kv = model.num_kv_heads * model.head_dim
    if model.family == "llama":
        replicated = 2 * 8 * h + 2 * 3 * h  # two RMSNorms, two residual adds
        split = 5 * f + 6 * (h + kv) + 2 * (h + 2 * kv) + 2 * h  # SwiGLU, RoPE, attention in/out copies
    else:
        replicated = 2 * 2 * h + 2 * 3 * h  # two LayerNorms, two residual adds
        split = 2 * f + 2 * (h + 2 * kv) + 2 * h  # GELU, attention in/out copies
    elements = replicated + split / tp
    if attention == "materialized":
        elements += 4 * a * s / tp
    return elements


# ------------------------------------------------------------------------------------------------- the prediction


def collective_time(
    *, nbytes: float, ranks: int, per_node: int, kind: Literal["all_reduce", "gather"], intra: tuple[float, float],
    inter: tuple[float, float], nodes: int | None = None,
) -> float:
    """Seconds of one ring collective of `nbytes` over `ranks` devices, `per_node` of them on each node, on `nodes`
    nodes (default: as few as hold `per_node` each; more when the group straddles node boundaries).

    All-gather and reduce-scatter move (n−1)/n of the buffer through every device, all-reduce twice that. A group
    inside one node runs at NVLink speed; a group that spans nodes runs at each device's share of its node's NICs,
    because every device of the node is in some group communicating at the same time, and never faster than the
    links inside the node, which its ring crosses too (PCIe-only nodes with fast NICs). (A hierarchical collective
    could do better when several of the group's devices share a node; measured large-scale sharded data
    parallelism does not: docs/costmodel.md.) `intra`/`inter` are (bytes/s per device, latency per step)."""
    if ranks <= 1:
        return 0.0
    factor = 2.0 if kind == "all_reduce" else 1.0
    k = max(1, min(per_node, ranks))
    nodes = nodes or -(-ranks // k)
    (intra_bw, intra_lat), (inter_bw, inter_lat) = intra, inter
    if nodes == 1:
        return factor * (ranks - 1) * (nbytes / ranks / intra_bw + intra_lat)
    ring_bw = min(inter_bw, intra_bw) if k > 1 else inter_bw
    return factor * ((ranks - 1) / ranks * nbytes / ring_bw + (k - 1) * intra_lat + (nodes - 1) * inter_lat)


def data_parallel_nodes(*, dp: int, tp: int, pp: int, gpus_per_node: int) -> int:
    """Nodes that the data-parallel group spanning the most of them lies on.

    Ranks are pp-major and tp-minor (`trainer.distributed.build_mesh`): stage s holds the dp·tp consecutive ranks
    from s·dp·tp, and each of its dp groups is dp ranks tp apart. When dp·tp neither divides gpus_per_node nor is
    a multiple of it, some stages start inside a node and their groups straddle a boundary: on two racks of 72
    with dp·tp = 16, stage 4 holds ranks 64–79, and its gradient collectives cross the network although 16 ranks
    fit in one rack."""
    g = gpus_per_node
    if dp <= 1:
        return 1
    if tp >= g:  # tp groups fill whole nodes (`feasibility.layout_problem`): every dp peer on nodes of its own
        return dp
    stage = dp * tp
    if g % stage == 0:  # every stage inside one node
        return 1
    last = (dp - 1) * tp  # the group's last rank, from its first
    # Stages start at the same offsets into a node every g / gcd(stage, g) stages: those cover every group.
    starts = (s * stage for s in range(min(pp, g // math.gcd(stage, g))))
    return max((start + last) // g - start // g + 1 for start in starts)


def predict(
    *, profile: ClusterProfile, job: Job, dp: int, tp: int, pp: int, mbs: int, gbs: int, attention: Attention = "sdpa"
) -> Prediction:
    """Iteration time and per-device memory of (dp, tp, pp, mbs, gbs) for `job` on `profile`.

    `attention` is the trainer's fused kernel unless a caller costs another system's run (docs/costmodel.md)."""
    model, par = job.model, job.parallel
    acc, net = profile.accelerator, profile.network
    h, s, num_layers = model.hidden_size, model.seq_len, model.num_layers
    gpus = profile.gpus_per_node
    eff = net.bandwidth_efficiency
    intra = (net.intra_node_bytes_per_s * eff, net.intra_node_latency_us * 1e-6)
    # Cross-node collectives of all devices of a node share its NICs.
    inter = (net.inter_node_bytes_per_s * eff / gpus, net.inter_node_latency_us * 1e-6)
    act_bytes = acc.activation_bytes
    num_micro = max(1, gbs // (dp * mbs))
    chunks = virtual_stages(job, pp)
    layers_per_stage = num_layers / pp  # an average rank's blocks
    # Rank r holds chunks r, r + pp, …; when the chunks do not divide the layers the first ones hold one more
    # (`stage_layers`, as the trainer splits them): the first rank holds the most blocks, the last one the head.
    split = stage_layers(num_layers, pp * chunks)
    layers_first, layers_last = sum(split[0::pp]), sum(split[pp - 1 :: pp])
    tokens = mbs * s
    recompute = par.recompute

    # Matmuls: 3 passes (forward, and backward's two products), 4 when full recompute runs the forward again.
    matmul_eff = acc.matmul_efficiency * tokens / (tokens + acc.matmul_half_tokens)
    flop_rate = acc.peak_tflops * 1e12 * matmul_eff
    passes = 4 if recompute == "full" else 3
    layer_flops = tokens * (2 * matmul_params_per_layer(model) + attention_flops_per_token(model, attention)) / tp
    layer_time = passes * layer_flops / flop_rate
    # Memory-bound kernels: backward moves about twice the forward's bytes; any recompute repeats the forward's.
    mem_passes = 4 if recompute in ("full", "selective") else 3
    layer_time += (
        mem_passes * tokens * elementwise_elements_per_token(model, tp, attention) * act_bytes
        / (acc.memory_bandwidth_bytes * MEMORY_BANDWIDTH_EFFICIENCY)
    )  # fmt: skip
    # Tensor parallelism: one all-reduce after attention and one after the MLP, in forward and again in backward
    # (and in the recomputed forward). Sequence parallelism moves the same bytes as an all-gather before attention
    # and the MLP and a reduce-scatter after them (half an all-reduce each), and under selective recompute gathers
    # the two inputs again in backward (one all-reduce's worth more).
    tp_layer = 0.0
    if tp > 1:
        all_reduces = 6 if recompute == "full" else 5 if recompute == "selective" and par.sequence_parallel else 4
        tp_layer = all_reduces * collective_time(nbytes=act_bytes * tokens * h, ranks=tp, kind="all_reduce",
                                                 per_node=min(tp, gpus), intra=intra, inter=inter)  # fmt: skip
    # The host issues every block's kernels; on a GPU it runs ahead of the device, which hides the larger of the two
    # behind the other (an eager trainer at small micro-batches is host-bound); on a CPU the two add.
    host_forwards = {"none": 1.0, "full": 2.0, "selective": SELECTIVE_HOST_FORWARDS}[recompute]
    host_layer = host_forwards * acc.host_layer_ms * 1e-3
    layer_time = layer_time + host_layer if acc.device == "cpu" else max(layer_time, host_layer)
    # The output head (and the loss) on the last stage: 3 passes of its matmul, never recomputed.
    head_time = 3 * tokens * 2 * head_params(model) / tp / flop_rate
    overhead = acc.microbatch_overhead_ms * 1e-3
    compute_stage = layers_first * layer_time + overhead
    comm_stage = layers_first * tp_layer
    # The slowest stage sets the pipeline's pace: the last (the head's) unless the first holds more blocks.
    last_compute = max(compute_stage, layers_last * layer_time + overhead + head_time)
    average_stage = (layers_per_stage * layer_time + overhead) + layers_per_stage * tp_layer + head_time / pp

    # Pipeline: m slots of the slowest stage, plus (p − 1)/v fill/drain slots of an average one.
    compute_s = num_micro * last_compute
    tp_comm_s = num_micro * comm_stage
    bubble_s = (pp - 1) / chunks * average_stage if pp > 1 else 0.0
    p2p_s = 0.0
    if pp > 1:
        # Ranks are laid out pp-major: stage boundaries cross nodes once the whole world spans more than one.
        bw, lat = inter if dp * tp * pp > gpus else intra
        message = act_bytes * tokens * h  # every tp rank sends its (replicated) activation to its peer
        # Each micro-batch crosses every chunk boundary forward and backward; a rank waits for its own sends.
        p2p_s = (num_micro + pp - 1) * chunks * 2 * (message / bw + lat)

    # Data parallelism (FSDP2): parameters are all-gathered in fp32 (autocast casts after the gather) and
    # gradients reduce-scattered in fp32 once per step. Resharded after forward
    # (pp = 1 with sharded_dp), each micro-batch gathers twice (forward, backward); otherwise once per step.
    dp_comm_s = 0.0
    if dp > 1:
        stage_params = (model.num_params / pp) / tp
        units = layers_per_stage * chunks + 1  # one FSDP unit per block, plus the stage's root
        gathers = 2 * num_micro if (pp == 1 and par.sharded_dp) else 1
        # dp peers are tp ranks apart: gpus/tp of them on a node, unless a stage straddles a node boundary.
        dp_nodes = data_parallel_nodes(dp=dp, tp=tp, pp=pp, gpus_per_node=gpus)

        def collective(nbytes: float) -> float:
            return collective_time(nbytes=nbytes, ranks=dp, per_node=-(-dp // dp_nodes), kind="gather", intra=intra,
                                   inter=inter, nodes=dp_nodes)  # fmt: skip

        # The latency of every unit's collective; the bandwidth term is the same however the buffer is split.
        latency = (gathers + 1) * (units - 1) * collective(0.0)
        comm = (gathers + 1) * collective(4 * stage_params) + latency
        # Hidden behind the compute it runs alongside: every micro-batch when gathering per micro-batch, else the
        # first forward (the gather) and the last backward (the reduce-scatter).
        window = compute_s if gathers > 1 else last_compute
        dp_comm_s = max(comm - DP_OVERLAP * min(comm, window), comm / units)  # one unit is never hidden

    # Optimizer: AdamW over this device's shard of the fp32 states.
    shard = model.num_params / (tp * pp) / (dp if dp > 1 else 1)
    optimizer_s = OPTIMIZER_BYTES_PER_PARAM * shard / acc.memory_bandwidth_bytes + acc.step_overhead_ms * 1e-3

    memory = estimate_memory(model=model, parallel=par, dp=dp, tp=tp, pp=pp, mbs=mbs, num_microbatches=num_micro,
                             device=acc.device, attention=attention)  # fmt: skip
    return Prediction(
        compute_s=compute_s,
        tp_comm_s=tp_comm_s,
        pipeline_bubble_s=bubble_s,
        p2p_s=p2p_s,
        dp_comm_s=dp_comm_s,
        optimizer_s=optimizer_s,
        memory_bytes=memory.total,
        model_state_bytes=memory.params + memory.grads + memory.optimizer,
        activation_bytes=memory.activations + memory.working + memory.logits,
    )
