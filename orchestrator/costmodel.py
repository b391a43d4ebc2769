"""Analytical iteration time and memory of a strategy on a cluster (docs/architecture.md).

The formulas follow the 3-D cost models of Megatron, AMP, Galvatron and Metis: compute from FLOPs at a fraction
of peak, tensor-parallel all-reduces on the link the TP group sits on, the pipeline's fill/drain bubble and
point-to-point activations, the part of the data-parallel gradient reduction not hidden behind backward, and the
optimizer step. They are meant to rank strategies, then be calibrated online by measured step times.
"""

from __future__ import annotations

import dataclasses

from cona.orchestrator.job import Job
from cona.orchestrator.profile import ClusterProfile

BYTES_PER_PARAM_STATE = 16  # bf16 param + fp32 master + bf16 grad... (Megatron/ZeRO's 16 bytes per parameter)
BYTES_PER_ELEMENT = 2  # bf16 activations and gradients on the wire
USABLE_MEMORY_FRACTION = 0.9  # allocator fragmentation, workspace, CUDA context


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where a strategy's process groups sit on the cluster's nodes (ranks laid out pp-major, tp-minor)."""

    tp_crosses_nodes: bool
    dp_crosses_nodes: bool
    pp_crosses_nodes: bool


def layout_of(*, dp: int, tp: int, pp: int, gpus_per_node: int) -> Layout:
    return Layout(
        tp_crosses_nodes=tp > gpus_per_node,
        dp_crosses_nodes=dp * tp > gpus_per_node,
        pp_crosses_nodes=pp > 1 and dp * tp * pp > gpus_per_node,
    )


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted seconds per optimizer step, by part, and bytes of memory per device."""

    compute_s: float
    tp_comm_s: float
    pipeline_bubble_s: float
    p2p_s: float
    dp_comm_s: float
    """Exposed data-parallel communication (the part not hidden behind backward)."""
    optimizer_s: float
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


def predict(*, profile: ClusterProfile, job: Job, dp: int, tp: int, pp: int, mbs: int, gbs: int) -> Prediction:
    """Iteration time and per-device memory of (dp, tp, pp, mbs, gbs) for `job` on `profile`."""
    model = job.model
    num_params = model.num_params
    num_layers, hidden, seq, heads, vocab = (
        model.num_layers,
        model.hidden_size,
        model.seq_len,
        model.num_heads,
        model.vocab_size,
    )
    acc, net = profile.accelerator, profile.network
    layout = layout_of(dp=dp, tp=tp, pp=pp, gpus_per_node=profile.gpus_per_node)
    intra_bw, inter_bw = net.intra_node_bytes_per_s, net.inter_node_bytes_per_s
    intra_lat, inter_lat = net.intra_node_latency_us * 1e-6, net.inter_node_latency_us * 1e-6
    # Cross-node collectives of all devices on a node share its NICs.
    inter_bw_per_device = inter_bw / profile.gpus_per_node
    num_micro = max(1, gbs // (dp * mbs))
    layers_per_stage = num_layers / pp

    # Compute of one micro-batch on one stage (forward + backward = 3 forward passes of 2 FLOPs per param·token).
    flops = mbs * seq * (6 * num_params + 12 * num_layers * hidden * seq) / pp
    if job.parallel.activation_checkpointing:
        flops *= 4 / 3  # one more forward
    compute_per_micro = flops / (tp * acc.peak_tflops * 1e12 * acc.mfu) + acc.microbatch_overhead_ms * 1e-3

    # Tensor parallelism: 4 all-reduces of b·s·h per layer (2 forward, 2 backward), ring factor 2(t−1)/t.
    tp_per_micro = 0.0
    if tp > 1:
        bw, lat = (inter_bw_per_device, inter_lat) if layout.tp_crosses_nodes else (intra_bw, intra_lat)
        volume = 4 * 2 * (tp - 1) / tp * BYTES_PER_ELEMENT * mbs * seq * hidden
        tp_per_micro = layers_per_stage * (volume / bw + 4 * 2 * (tp - 1) * lat)

    # Pipeline: (m + p − 1) slots of one micro-batch's stage time; the p − 1 extra are the bubble.
    bubble_slots = pp - 1
    if job.parallel.pipeline_schedule == "interleaved" and pp > 1:
        bubble_slots = (pp - 1) / 2  # two virtual stages per device halve the bubble
    stage_time = compute_per_micro + tp_per_micro
    compute_s = num_micro * compute_per_micro
    tp_comm_s = num_micro * tp_per_micro
    bubble_s = bubble_slots * stage_time
    p2p_s = 0.0
    if pp > 1:
        bw, lat = (inter_bw_per_device, inter_lat) if layout.pp_crosses_nodes else (intra_bw, intra_lat)
        activation = BYTES_PER_ELEMENT * mbs * seq * hidden / tp
        p2p_s = (num_micro + pp - 1) * 2 * (activation / bw + lat)

    # Data parallelism: gradient reduction of this device's 1/(t·p) of the model; sharded DP also all-gathers
    # parameters (reduce-scatter + all-gather = all-reduce volume, plus one extra gather for backward).
    dp_comm = 0.0
    if dp > 1:
        bw, lat = (inter_bw_per_device, inter_lat) if layout.dp_crosses_nodes else (intra_bw, intra_lat)
        shard_bytes = BYTES_PER_ELEMENT * num_params / (tp * pp)
        factor = 3.0 if job.parallel.sharded_dp else 2.0
        dp_comm = factor * (dp - 1) / dp * shard_bytes / bw
        # Sharded DP gathers each layer's parameters again for every micro-batch (forward and backward);
        # on slow-latency links (gloo on CPU) these per-layer collectives dominate small models.
        units = layers_per_stage + 1  # one FSDP unit per block, plus the embedding or head of the stage
        num_collectives = 3 * num_micro * units if job.parallel.sharded_dp else units
        dp_comm += num_collectives * (dp - 1) * lat
    hidden_behind_backward = (2 / 3) * compute_per_micro  # overlap with the last micro-batch's backward
    dp_comm_s = max(0.0, dp_comm - hidden_behind_backward)

    # Optimizer: AdamW streams the model states of its shard through memory about three times.
    state_bytes = BYTES_PER_PARAM_STATE * num_params / (tp * pp)
    if job.parallel.sharded_dp:
        state_bytes /= dp
    optimizer_s = 3 * state_bytes / acc.memory_bandwidth_bytes

    # Memory: model states, plus one gathered layer under sharded DP, plus activations in flight.
    gathered_layer = (
        BYTES_PER_ELEMENT * 2 * num_params / num_layers / tp if job.parallel.sharded_dp and dp > 1 else 0.0
    )
    per_layer_act = seq * mbs * hidden * (34 + 5 * heads * seq / hidden) / tp
    if job.parallel.activation_checkpointing:
        stage_act = BYTES_PER_ELEMENT * seq * mbs * hidden * layers_per_stage + per_layer_act
    else:
        stage_act = per_layer_act * layers_per_stage
    if pp == 1:
        in_flight = 1
    elif job.parallel.pipeline_schedule == "gpipe":
        in_flight = num_micro
    else:
        in_flight = min(pp, num_micro)
    logits = 4 * mbs * seq * vocab / tp  # fp32 logits on the last stage
    activation_bytes = stage_act * in_flight + logits
    memory = state_bytes + gathered_layer + activation_bytes
    return Prediction(
        compute_s=compute_s,
        tp_comm_s=tp_comm_s,
        pipeline_bubble_s=bubble_s,
        p2p_s=p2p_s,
        dp_comm_s=dp_comm_s,
        optimizer_s=optimizer_s,
        memory_bytes=memory,
        model_state_bytes=state_bytes,
        activation_bytes=activation_bytes,
    )


def usable_memory_bytes(profile: ClusterProfile) -> float:
    return profile.accelerator.memory_bytes * USABLE_MEMORY_FRACTION
