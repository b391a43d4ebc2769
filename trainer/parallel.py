"""One strategy's model on this rank: the parallelisms composed in a fixed order, and the steps that use them.

`ParallelModel` builds the mesh (`trainer.distributed`), then every pipeline stage this rank owns
(`trainer.pipeline`) from the full model on the meta device (`trainer.model`), in this order:

1. `build_model` on meta → `prune_to_stage` → `materialize` (values depend only on the seed and parameter names,
   so any layout starts from the same model), or the weights of `model.init_from` (`trainer.hf.load_stage`) on a
   run without a checkpoint → each block's recompute mode (`trainer.recompute`);
2. **TP** — `trainer.tp.apply_tp` with the model's own plan (`trainer.model.tp_plan`), when tp > 1;
3. **FSDP2** — `trainer.fsdp.apply_fsdp` on the dp axis, when dp > 1;

then one AdamW per stage (`trainer.optim`), the gradient statistics hooks (`trainer.gradstats`), the pipeline
schedule when pp > 1 and, for a tied head under pp, the tied-weight group. Keep this order: every rank must create the
mesh's and the tied groups' communicators in the same sequence, parameters are initialised in full before TP and
FSDP2 shard them (so every layout starts from the same values), and the optimizers must see the parameters in
their final, sharded form. Gradient accumulation runs gbs/(dp·mbs) micro-batches per replica, through the pipeline
schedule when pp > 1 and a plain loop otherwise.

**Loss scaling.** The reported and optimised loss is the mean over the global batch's target tokens (all
next-token targets; for BERT the masked positions of the whole global batch). Every micro-batch's summed token
loss is multiplied by dp / (global target count) before backward and FSDP averages over dp, so the optimizer
gets exactly ∂(mean loss) whatever the layout, and each replica's unreduced gradient is the gradient of the mean
loss over its own samples (normalised by the mean count per replica), which is what the local gradient statistics
need (`trainer.gradstats`).
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from cona.protocol.job import JobSpec
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError
from cona.trainer.data import IGNORE_INDEX
from cona.trainer.distributed import (
    MESH_DIMS,
    DistEnv,
    bound_collectives,
    build_mesh,
    check_layout,
    num_virtual_stages,
)
from cona.trainer.fsdp import apply_fsdp
from cona.trainer.gradstats import AdamView, GradStats, local_tensor
from cona.trainer.model import Transformer, build_model, lm_loss_sum, materialize, prune_to_stage
from cona.trainer.optim import build_optimizer
from cona.trainer.pipeline import (
    ScaledLoss,
    build_schedule,
    stage_ids_this_rank,
    sync_tied_grads,
    tied_embedding_group,
    tied_parameters,
)
from cona.trainer.tp import apply_tp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule


class ParallelModel:
    """This rank's model stages under one strategy, their optimizers, and the forward/backward of one step."""

    def __init__(self, job: JobSpec, strategy: Strategy, env: DistEnv, *, init_from: str | None = None) -> None:
        """`init_from`: a Hugging Face model directory whose weights replace the random initialisation
        (`trainer.hf`; the caller passes it only for a run without a checkpoint)."""
        check_layout(job, strategy, world_size=env.world_size)
        self.job, self.strategy, self.env = job, strategy, env
        self._init_source = None
        if init_from is not None:
            from cona.trainer import hf

            try:
                self._init_source = hf.check_directory(job.model, init_from)
            except ValueError as e:  # checked before the process group too (trainer.main); a file changed since
                raise ConfigError(f"model.init_from: {e}") from None
        self.device = env.device
        self.mesh: DeviceMesh = build_mesh(strategy, env.device)
        self.pp_rank = self.mesh.get_local_rank("pp")
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.tp_rank = self.mesh.get_local_rank("tp")
        self.num_microbatches = strategy.num_microbatches
        virtual = num_virtual_stages(job, strategy)
        self.num_stages = strategy.pp * virtual
        self.stage_ids = stage_ids_this_rank(self.pp_rank, pp=strategy.pp, virtual=virtual)
        self.stats = GradStats(
            dp=strategy.dp, tp=strategy.tp, num_microbatches=self.num_microbatches, device=self.device
        )

        self.parts: list[Transformer] = [self._build_stage(stage) for stage in self.stage_ids]
        # After TP and FSDP2: the optimizer state follows the parameters' final (sharded) form.
        self.optimizers = [build_optimizer(part, job.optimizer) for part in self.parts]
        self.stats.adam = AdamView(self.optimizers)
        self.stats.enabled = job.heartbeat.gradient_stats
        if not self.stats.enabled:
            pass  # no hooks: only the global norm, for clipping
        elif strategy.dp > 1:
            for part in self.parts:
                self.stats.attach_fsdp(part)
        else:
            for part in self.parts:
                self.stats.attach_param_hooks(part.parameters())

        self.has_first = 0 in self.stage_ids
        self.has_last = self.num_stages - 1 in self.stage_ids
        self.loss = ScaledLoss()
        self.schedule: _PipelineSchedule | None = None
        if strategy.pp > 1:
            self.schedule = build_schedule(
                self.parts, self.stage_ids, num_stages=self.num_stages, job=job, strategy=strategy,
                device=self.device, group=self.mesh.get_group("pp"), loss_fn=self.loss,
            )  # fmt: skip
        self._tied_group: dist.ProcessGroup | None = None
        self.tied_params: list[nn.Parameter] = []
        # A tied head's weight (BERT's decoder, a tied GPT/Llama head) lives on the first and the last stage: their
        # gradients are summed after backward.
        if job.model.tie_embeddings and strategy.pp > 1:
            self._tied_group = tied_embedding_group(self.mesh, num_stages=self.num_stages, rank=env.rank)
            self.tied_params = tied_parameters(self.parts, self.stage_ids, num_stages=self.num_stages)
        # The world's group too: it is created before any job is read, and this model trains on it.
        bound_collectives([dist.distributed_c10d._get_default_group(), *self.own_process_groups()],
                          job.parallel.collective_timeout_s)  # fmt: skip

    # Construction ---------------------------------------------------------------------------------------------

    def _build_stage(self, stage: int) -> Transformer:
        """Pipeline stage `stage`, materialised and parallelised; the order of these steps is fixed (see above)."""
        model = build_model(self.job.model, device="meta")
        prune_to_stage(model, stage=stage, num_stages=self.num_stages)
        materialize(model, device=self.device, seed=self.job.seed)
        if self._init_source is not None:  # before TP and FSDP2 split it: every layout loads the same full tensors
            from cona.trainer import hf

            hf.load_stage(model, self.job.model, self._init_source, label=str(self._init_source.directory))
        for block in model.layers.values():
            block.recompute = self.job.parallel.recompute
        if self.strategy.tp > 1:
            apply_tp(model, self.mesh["tp"], sequence_parallel=self.job.parallel.sequence_parallel)
        if self.strategy.dp > 1:
            apply_fsdp(model, self.mesh["dp"], pp=self.strategy.pp, sharded_dp=self.job.parallel.sharded_dp)
        return model

    def own_process_groups(self) -> list[dist.ProcessGroup]:
        """The process groups this model created that this rank belongs to (not the default group): what an
        in-place switch destroys once the model is gone, so communicators do not pile up across switches."""
        default = dist.distributed_c10d._get_default_group()
        groups = [self.mesh.get_group(name) for name in MESH_DIMS]
        if self._tied_group is not None:
            groups.append(self._tied_group)
        unique: list[dist.ProcessGroup] = []
        for group in groups:
            if group is not default and all(group is not g for g in unique):
                unique.append(group)
        return unique

    # Steps ----------------------------------------------------------------------------------------------------

    def autocast(self) -> AbstractContextManager:
        """bf16 autocast on GPUs (parameters, gradients, optimizer and reductions stay fp32); nothing on CPU."""
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return nullcontext()

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    @property
    def computes_loss(self) -> bool:
        """Whether this rank evaluates the loss (the last stage, or every rank without pp)."""
        return self.has_last

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, *, scale: float) -> torch.Tensor:
        """Accumulate the gradient of `scale` × summed token loss over this replica's samples.

        `inputs`/`labels` are the replica's gbs/dp samples. Returns the raw summed token loss this rank computed
        (zero on ranks without the last stage).
        """
        if self.schedule is not None:
            self.loss.scale, self.loss.raw_sum = scale, 0.0
            args = (inputs,) if self.has_first else ()
            target = labels if self.has_last else None
            with self.autocast():
                self.schedule.step(*args, target=target, losses=[] if self.has_last else None)
            return torch.as_tensor(self.loss.raw_sum, dtype=torch.float64, device=self.device).detach()
        part = self.parts[0]
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        micro_inputs = inputs.split(self.strategy.mbs)
        micro_labels = labels.split(self.strategy.mbs)
        for k, (x, y) in enumerate(zip(micro_inputs, micro_labels, strict=True)):
            if self.strategy.dp > 1:  # accumulate locally; reduce-scatter once, after the last micro-batch
                last = k == len(micro_inputs) - 1
                part.set_requires_gradient_sync(last)
                if not self.job.parallel.sharded_dp:
                    # Keep the gathered parameters until the last backward, as the pipeline schedule does: FSDP2
                    # otherwise frees them after each backward and gathers them again for the next micro-batch's
                    # forward. One all-gather per block and step, what the cost model charges; the memory model
                    # already holds the whole stage gathered at the peak.
                    part.set_reshard_after_backward(last)
            with self.autocast():
                logits = part(x)
            loss = lm_loss_sum(logits, y)
            (loss * scale).backward()
            total += loss.detach()
        return total

    def sync_tied(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum the tied weight's gradient across first/last stage; returns (this rank's pre, post) weighted |g|²."""
        return sync_tied_grads(
            self.tied_params, self._tied_group, dp=self.strategy.dp, tp=self.strategy.tp, device=self.device
        )

    def clip_and_step(self, *, grad_sqnorm: float, max_norm: float | None, lr: float) -> None:
        """Scale the gradients down to `max_norm` (given their global squared norm, reduced by the caller) and step."""
        if max_norm is not None:
            coefficient = max_norm / (math.sqrt(grad_sqnorm) + 1e-6)
            if coefficient < 1.0:
                with torch.no_grad():
                    for param in self.parameters():
                        if param.grad is not None:
                            local_tensor(param.grad).mul_(coefficient)
        self.optimizer_step(lr)

    def optimizer_step(self, lr: float) -> None:
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()

    @torch.no_grad()
    def eval_sums(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
        """Summed token loss and target count over this replica's eval windows (zeros off the last stage)."""
        rows = self.strategy.mbs * self.num_microbatches if self.schedule is not None else self.job.eval.batch_size
        pad = (-len(inputs)) % rows
        if pad:  # padded rows carry no target, so they add nothing to either sum
            inputs = torch.cat([inputs, inputs.new_zeros(pad, inputs.shape[1])])
            labels = torch.cat([labels, labels.new_full((pad, labels.shape[1]), IGNORE_INDEX)])
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for start in range(0, len(inputs), rows):
            x, y = inputs[start : start + rows], labels[start : start + rows]
            with self.autocast():
                if self.schedule is not None:
                    self.loss.scale, self.loss.raw_sum = 1.0, 0.0
                    self.schedule.eval(
                        *((x,) if self.has_first else ()),
                        target=y if self.has_last else None,
                        losses=[] if self.has_last else None,
                    )
                    loss_sum += torch.as_tensor(self.loss.raw_sum, dtype=torch.float64, device=self.device)
                else:
                    loss_sum += lm_loss_sum(self.parts[0](x), y).double()
        count = float((labels != IGNORE_INDEX).sum()) if self.computes_loss else 0.0
        return (float(loss_sum) if self.computes_loss else 0.0), count
