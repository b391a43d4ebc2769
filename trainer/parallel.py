"""The parallel layout of one strategy: device mesh, pipeline split, tensor parallelism, FSDP2 and one step.

One mesh ("pp", "dp", "tp") from `init_device_mesh`. Each rank builds the stages it owns from the full model on the
meta device (`trainer.model`), materialises and initialises them (values depend only on the seed and parameter
names), then applies, in this order:

1. **pp split** — `num_stages = pp` (or 2·pp for the interleaved schedule; stage s lives on pp rank s mod pp);
2. **TP** — `parallelize_module` on every block: q, k, v and the MLP's input projections column-parallel (so whole
   attention heads and whole kv heads go to each tp rank), the attention output and MLP output row-parallel.
   Embeddings, norms and the head stay replicated across tp;
3. **FSDP2** — `fully_shard` on the dp axis, each block and then the stage root (skipped when dp = 1).

Pipelines use `torch.distributed.pipelining` (`PipelineStage` with static shapes; GPipe, 1F1B or interleaved
1F1B). Gradient accumulation runs gbs/(dp·mbs) micro-batches per replica.

**Loss scaling.** The reported and optimised loss is the mean over the global batch's target tokens (all
next-token targets; for BERT the masked positions of the whole global batch). Every micro-batch's summed token
loss is multiplied by dp / (global target count) before backward and FSDP averages over dp, so the optimizer
gets exactly ∂(mean loss) whatever the layout, and each replica's unreduced gradient is the gradient of the mean
loss over its own samples (normalised by the mean count per replica), which is what the local gradient statistics
need (`trainer.gradstats`).

**BERT's tied decoder under pp.** The last stage keeps `tok_embeddings.weight` for its decoder. After backward the
two partial gradients are summed across the first and last stage (a small all-reduce of the sharded gradient), so
both copies receive identical updates and the checkpoint holds one tensor under one name. For the statistics the
two partial gradients count as two parameters (both in local and in global norms, consistently); the clipping norm
uses the true summed gradient.
"""

from __future__ import annotations

import dataclasses
import math
import os
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
from cona.protocol.feasibility import strategy_problem, virtual_stages, world_problem
from cona.protocol.job import JobSpec
from cona.protocol.strategy import Strategy
from cona.trainer.data import IGNORE_INDEX
from cona.trainer.gradstats import AdamView, GradStats, local_tensor
from cona.trainer.model import Transformer, build_model, lm_loss_sum, materialize, prune_to_stage
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class LayoutError(ValueError):
    """The strategy cannot run this job (a one-line reason); `bad_world` when only the world size is wrong."""

    def __init__(self, message: str, *, bad_world: bool = False) -> None:
        super().__init__(message)
        self.bad_world = bad_world


@dataclasses.dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def init_distributed() -> DistEnv:
    """Join the process group torchrun set up (or a single-process one without torchrun)."""
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, device_id=device if use_cuda else None)
        else:  # `python -m cona.trainer` without torchrun: a world of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistEnv(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device, backend=backend
    )


def num_virtual_stages(job: JobSpec, strategy: Strategy) -> int:
    return virtual_stages(job, strategy.pp)


def check_layout(job: JobSpec, strategy: Strategy, *, world_size: int) -> None:
    """Raise LayoutError when `strategy` cannot run `job` on `world_size` processes (`cona.protocol.feasibility`).

    A strategy that cannot run this job at all is bad input; one that merely needs another world size is
    `bad_world` (checked last), so the orchestrator replans for the processes it has.
    """
    problem = strategy_problem(job, strategy)
    if problem:
        raise LayoutError(f"strategy {strategy}: {problem}")
    problem = world_problem(strategy, world_size)
    if problem:
        raise LayoutError(f"strategy {strategy} {problem}", bad_world=True)


class ScaledLoss:
    """The pipeline's loss function: the summed token loss times the step's scale; also keeps the raw sum."""

    def __init__(self) -> None:
        self.scale = 1.0
        self.raw_sum: torch.Tensor | float = 0.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = lm_loss_sum(logits, labels)
        self.raw_sum = self.raw_sum + loss.detach()
        return loss * self.scale


def _tp_plan(block: nn.Module) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def colwise() -> ColwiseParallel:
        style = ColwiseParallel()
        style.src_data_rank = None  # every rank holds the same full weight: slice locally, no scatter
        return style

    def rowwise() -> RowwiseParallel:
        style = RowwiseParallel()
        style.src_data_rank = None
        return style

    plan = {"attn.wq": colwise(), "attn.wk": colwise(), "attn.wv": colwise(), "attn.wo": rowwise(),
            "mlp.w1": colwise(), "mlp.w2": rowwise()}  # fmt: skip
    if block.mlp.w3 is not None:
        plan["mlp.w3"] = colwise()
    return plan


class ParallelModel:
    """This rank's model stages under one strategy, their optimizers, and the forward/backward of one step."""

    def __init__(self, job: JobSpec, strategy: Strategy, env: DistEnv) -> None:
        check_layout(job, strategy, world_size=env.world_size)
        self.job, self.strategy, self.env = job, strategy, env
        self.device = env.device
        self.mesh: DeviceMesh = init_device_mesh(
            env.device.type, (strategy.pp, strategy.dp, strategy.tp), mesh_dim_names=("pp", "dp", "tp")
        )
        self.pp_rank = self.mesh.get_local_rank("pp")
        self.dp_rank = self.mesh.get_local_rank("dp")
        self.tp_rank = self.mesh.get_local_rank("tp")
        self.num_microbatches = strategy.num_microbatches
        virtual = num_virtual_stages(job, strategy)
        self.num_stages = strategy.pp * virtual
        self.stage_ids = [self.pp_rank + j * strategy.pp for j in range(virtual)]
        self.stats = GradStats(
            dp=strategy.dp, tp=strategy.tp, num_microbatches=self.num_microbatches, device=self.device
        )

        self.parts: list[Transformer] = [self._build_stage(stage) for stage in self.stage_ids]
        self.optimizers = [self._optimizer(part) for part in self.parts]
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
        self.schedule = self._schedule() if strategy.pp > 1 else None
        self._tied_group, self.tied_params = self._tied_setup()

    # Construction ---------------------------------------------------------------------------------------------

    def _build_stage(self, stage: int) -> Transformer:
        model = build_model(self.job.model, device="meta")
        prune_to_stage(model, stage=stage, num_stages=self.num_stages)
        materialize(model, device=self.device, seed=self.job.seed)
        for block in model.layers.values():
            block.activation_checkpointing = self.job.parallel.activation_checkpointing
        if self.strategy.tp > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            tp_mesh = self.mesh["tp"]
            for block in model.layers.values():
                parallelize_module(block, tp_mesh, _tp_plan(block))
        if self.strategy.dp > 1:
            from torch.distributed.fsdp import fully_shard

            dp_mesh = self.mesh["dp"]
            # Under pp every micro-batch would all-gather again; keep parameters gathered between forward and
            # backward there (torchtitan's choice), and when sharded_dp is off (ZeRO-2 style).
            reshard = self.strategy.pp == 1 and self.job.parallel.sharded_dp
            for block in model.layers.values():
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
        return model

    def _optimizer(self, part: nn.Module) -> torch.optim.Optimizer:
        spec = self.job.optimizer
        decay = [p for p in part.parameters() if p.ndim >= 2]
        no_decay = [p for p in part.parameters() if p.ndim < 2]  # biases and norm gains are not decayed
        groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        return torch.optim.AdamW(groups, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps)

    def _schedule(self):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        spec, mbs = self.job.model, self.strategy.mbs
        act_dtype = torch.float32
        logit_dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        stages = []
        for stage_id, part in zip(self.stage_ids, self.parts, strict=True):
            if stage_id == 0:
                example_in = torch.empty(mbs, spec.seq_len, dtype=torch.long, device="meta")
            else:
                example_in = torch.empty(mbs, spec.seq_len, spec.hidden_size, dtype=act_dtype, device="meta")
            if stage_id == self.num_stages - 1:
                example_out = torch.empty(mbs, spec.seq_len, spec.vocab_size, dtype=logit_dtype, device="meta")
            else:
                example_out = torch.empty(mbs, spec.seq_len, spec.hidden_size, dtype=act_dtype, device="meta")
            # Static shapes (no inference pass); requires_grad marks the activations whose gradients flow back.
            if example_in.is_floating_point():
                example_in.requires_grad_(True)
            example_out.requires_grad_(True)
            stage = PipelineStage(
                part, stage_id, self.num_stages, self.device,
                input_args=example_in, output_args=example_out, group=self.mesh.get_group("pp"),
            )  # fmt: skip
            stages.append(stage)
        kind = self.job.parallel.pipeline_schedule
        if kind == "interleaved":
            return ScheduleInterleaved1F1B(stages, self.num_microbatches, loss_fn=self.loss, scale_grads=False)
        cls = Schedule1F1B if kind == "1f1b" else ScheduleGPipe
        return cls(stages[0], self.num_microbatches, loss_fn=self.loss, scale_grads=False)

    def _tied_setup(self) -> tuple[dist.ProcessGroup | None, list[nn.Parameter]]:
        """BERT under pp: the group of the first and last stage's ranks with the same (dp, tp) coordinates."""
        if not (self.job.model.family == "bert" and self.strategy.pp > 1):
            return None, []
        last_pp = (self.num_stages - 1) % self.strategy.pp
        mine = None
        for dp_i in range(self.strategy.dp):
            for tp_i in range(self.strategy.tp):
                ranks = sorted({int(self.mesh.mesh[0, dp_i, tp_i]), int(self.mesh.mesh[last_pp, dp_i, tp_i])})
                group = dist.new_group(ranks)  # every rank creates every group, in the same order
                if self.env.rank in ranks:
                    mine = group
        params = []
        for stage_id, part in zip(self.stage_ids, self.parts, strict=True):
            if stage_id in (0, self.num_stages - 1) and part.tok_embeddings is not None:
                params.append(part.tok_embeddings.weight)
        return mine, params

    def own_process_groups(self) -> list[dist.ProcessGroup]:
        """The process groups this model created that this rank belongs to (not the default group): what an
        in-place switch destroys once the model is gone, so communicators do not pile up across switches."""
        default = dist.distributed_c10d._get_default_group()
        groups = [self.mesh.get_group(name) for name in ("pp", "dp", "tp")]
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
                part.set_requires_gradient_sync(k == len(micro_inputs) - 1)
            with self.autocast():
                logits = part(x)
            loss = lm_loss_sum(logits, y)
            (loss * scale).backward()
            total += loss.detach()
        return total

    def sync_tied(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum BERT's tied-weight gradient across first/last stage; returns (this rank's pre, post) weighted |g|²."""
        pre = torch.zeros((), dtype=torch.float64, device=self.device)
        post = torch.zeros((), dtype=torch.float64, device=self.device)
        if self._tied_group is None:
            return pre, post
        from cona.trainer.gradstats import replication

        for param in self.tied_params:
            grad = local_tensor(param.grad) if param.grad is not None else None
            if grad is None:
                raise RuntimeError("the tied embedding has no gradient on a pipeline end stage")
            weight = 1.0 / replication(param, dp=self.strategy.dp, tp=self.strategy.tp)
            pre += weight * grad.float().pow(2).sum()
            dist.all_reduce(grad, group=self._tied_group)
            post += weight * grad.float().pow(2).sum() / 2  # held by two stages: count once
        return pre, post

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
