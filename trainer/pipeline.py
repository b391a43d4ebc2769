"""Pipeline parallelism: which stages a pp rank holds, their `PipelineStage`s and schedule, and the tied weight.

**Split.** `num_stages = pp` (or pp·`parallel.virtual_stages` for the interleaved schedule,
`trainer.distributed.num_virtual_stages`); stage s lives on pp rank s mod pp, so rank r holds stages r, r + pp, …
Each stage is the full model pruned on the meta device (`trainer.model.prune_to_stage`), so parameter names stay
those of the full model.

**Schedule.** `torch.distributed.pipelining`: `PipelineStage` with static shapes (no shape-inference pass), and
GPipe, 1F1B (as GPipe when the replica has fewer micro-batches than stages: `one_f_one_b_runs_as_gpipe`) or
interleaved 1F1B over the replica's micro-batches. The schedule calls `ScaledLoss` on the last stage;
`scale_grads=False` because the loss scale already normalises the gradients (`trainer.parallel`).

**A tied head under pp** (BERT's decoder; GPT and Llama with `model.tie_embeddings`). The last stage keeps
`tok_embeddings.weight` for its head. After backward the two partial gradients are summed across the first and last stage (a small all-reduce of the sharded gradient), so
both copies receive identical updates and the checkpoint holds one tensor under one name. For the statistics the
two partial gradients count as two parameters (both in local and in global norms, consistently); the clipping norm
uses the true summed gradient.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from cona.protocol.job import JobSpec
from cona.protocol.strategy import Strategy
from cona.trainer.gradstats import local_tensor, replication
from cona.trainer.model import Transformer, lm_loss_sum
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule


class ScaledLoss:
    """The pipeline's loss function: the summed token loss times the step's scale; also keeps the raw sum."""

    def __init__(self) -> None:
        self.scale = 1.0
        self.raw_sum: torch.Tensor | float = 0.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = lm_loss_sum(logits, labels)
        self.raw_sum = self.raw_sum + loss.detach()
        return loss * self.scale


def stage_ids_this_rank(pp_rank: int, *, pp: int, virtual: int) -> list[int]:
    """The pipeline stages pp rank `pp_rank` holds, in order: stage s on pp rank s mod pp ("loop" style)."""
    return [pp_rank + j * pp for j in range(virtual)]


def build_schedule(
    parts: list[Transformer], stage_ids: list[int], *, num_stages: int, job: JobSpec, strategy: Strategy,
    device: torch.device, group: dist.ProcessGroup, loss_fn: ScaledLoss,
) -> _PipelineSchedule:  # fmt: skip
    """This rank's `PipelineStage`s (one per part) and the job's schedule over them."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    spec, mbs = job.model, strategy.mbs
    # Between stages under sequence parallelism each tp rank sends and receives its slice of the sequence.
    between = spec.seq_len // strategy.tp if job.parallel.sequence_parallel else spec.seq_len
    act_dtype = torch.float32
    logit_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    stages = []
    for stage_id, part in zip(stage_ids, parts, strict=True):
        if stage_id == 0:
            example_in = torch.empty(mbs, spec.seq_len, dtype=torch.long, device="meta")
        else:
            example_in = torch.empty(mbs, between, spec.hidden_size, dtype=act_dtype, device="meta")
        if stage_id == num_stages - 1:
            example_out = torch.empty(mbs, spec.seq_len, spec.vocab_size, dtype=logit_dtype, device="meta")
        else:
            example_out = torch.empty(mbs, between, spec.hidden_size, dtype=act_dtype, device="meta")
        # Static shapes (no inference pass); requires_grad marks the activations whose gradients flow back.
        if example_in.is_floating_point():
            example_in.requires_grad_(True)
        example_out.requires_grad_(True)
        stage = PipelineStage(
            part, stage_id, num_stages, device, input_args=example_in, output_args=example_out, group=group
        )
        stages.append(stage)
    num_microbatches = strategy.num_microbatches
    kind = job.parallel.pipeline_schedule
    if kind == "interleaved":
        return ScheduleInterleaved1F1B(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
    gpipe = kind == "gpipe" or one_f_one_b_runs_as_gpipe(num_microbatches, pp=num_stages)
    cls = ScheduleGPipe if gpipe else Schedule1F1B
    return cls(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)


def one_f_one_b_runs_as_gpipe(num_microbatches: int, *, pp: int) -> bool:
    """Whether a 1F1B step runs as GPipe: with fewer micro-batches than stages, which torch's `Schedule1F1B`
    refuses ("Number of microbatches (m) must be greater than or equal to the number of stages (pp)").

    Nothing is lost by it. With m < pp the step takes m + pp − 1 slots under either schedule (the same bubble), and
    1F1B's warm-up of min(pp − rank − 1, m) forwards (Megatron's) already puts every micro-batch's forward in flight
    before the first backward on the first stage, which holds the most activations: the peak is m micro-batches'
    activations in both. The gradients are the same sums in the same order per stage.
    """
    return num_microbatches < pp


def tied_embedding_group(mesh: DeviceMesh, *, num_stages: int, rank: int) -> dist.ProcessGroup | None:
    """The group of the first and last stage's ranks with this rank's (dp, tp) coordinates (None off both ends).

    Every rank creates every group, in the same order (`new_group` is collective over the world), and keeps the
    one it belongs to.
    """
    pp, dp, tp = mesh.mesh.shape
    last_pp = (num_stages - 1) % pp
    mine = None
    for dp_i in range(dp):
        for tp_i in range(tp):
            ranks = sorted({int(mesh.mesh[0, dp_i, tp_i]), int(mesh.mesh[last_pp, dp_i, tp_i])})
            group = dist.new_group(ranks)  # every rank creates every group, in the same order
            if rank in ranks:
                mine = group
    return mine


def tied_parameters(parts: list[Transformer], stage_ids: list[int], *, num_stages: int) -> list[nn.Parameter]:
    """The copies of the tied embedding weight this rank holds (on the first and the last stage)."""
    params = []
    for stage_id, part in zip(stage_ids, parts, strict=True):
        if stage_id in (0, num_stages - 1) and part.tok_embeddings is not None:
            params.append(part.tok_embeddings.weight)
    return params


def sync_tied_grads(
    params: list[nn.Parameter], group: dist.ProcessGroup | None, *, dp: int, tp: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the tied weight's partial gradients over `group`; returns (this rank's pre, post) weighted |g|².

    Zeros without a group (no tied weight, or a rank on neither end stage).
    """
    pre = torch.zeros((), dtype=torch.float64, device=device)
    post = torch.zeros((), dtype=torch.float64, device=device)
    if group is None:
        return pre, post
    for param in params:
        grad = local_tensor(param.grad) if param.grad is not None else None
        if grad is None:
            raise RuntimeError("the tied embedding has no gradient on a pipeline end stage")
        weight = 1.0 / replication(param, dp=dp, tp=tp)
        pre += weight * grad.float().pow(2).sum()
        dist.all_reduce(grad, group=group)
        post += weight * grad.float().pow(2).sum() / 2  # held by two stages: count once
    return pre, post
