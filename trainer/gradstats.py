"""Gradient statistics for the gradient noise scale (docs/architecture.md), at the cost of a few scalars per step.

Definitions (the loss is the mean over the global batch's target tokens, see `trainer.parallel`):

* **global**: |G_big|², the squared norm of the gradient the optimizer sees (after the dp reduction), B_big = gbs.
* **local** with dp > 1: |G_small|² averaged over the dp replicas, where G_small is the gradient of the mean loss
  over one replica's gbs/dp samples *before* the dp reduction; B_small = gbs/dp. FSDP2 hands every rank's
  unreduced (micro-batch-accumulated) gradients to a custom reduce-scatter (`StatsReduceScatter`), which takes
  their squared norm and then reduces as usual.
* **local** with dp = 1: the micro-batch gradients are the small batches: B_small = mbs and local = mean over the
  step's micro-batches of |G_micro|², G_micro the gradient of the mean loss over one micro-batch. Parameter hooks
  see each micro-batch's gradient before it is accumulated. With a single micro-batch (gbs = mbs) there is no
  small batch and the local fields are omitted.
* **Adam variants**: the same norms with every element divided by the denominator AdamW would apply to that
  gradient: sqrt(v̂) + eps with v̂ = (β₂·exp_avg_sq + (1 − β₂)·g²) / (1 − β₂^(t+1)), t the optimizer steps so far
  and g the element of the gradient being measured (global, replica or micro-batch).
  Omitted before the first optimizer step. Under sharded dp a rank holds v̂ only for its own shard, so
  `adam_local` sums, over the dp ranks, the rank's own replica's preconditioned gradient restricted to its own shard:
  every element comes from exactly one replica, so it is an unbiased estimate of E|P·G_small|² (the same
  expectation the plain local norm has) without moving a gradient-sized tensor.

Under tp and pp the squared norms are sums over shards and stages of the local pieces; a parameter replicated over
r ranks (a LayerNorm under tp, a bias of a row-parallel linear) is weighted 1/r, so it counts once. The replication
of a DTensor parameter is dp·tp over the product of the mesh sizes along which it is *not* Replicate (FSDP2's
`_StridedShard` is a shard: `is_shard()` is False for it, which is why placements are tested for Replicate).
A plain tensor is replicated over all dp·tp ranks of its stage. The per-rank pieces ride on the trainer's single
per-step all-reduce (a SUM); normalisation happens after it (`finalize`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from cona.protocol.strategy import measures_noise
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

try:  # the hook FSDP2 calls with the unreduced gradients of one parameter group
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
except ImportError:  # pragma: no cover - other torch versions: local statistics under dp > 1 are omitted
    DefaultReduceScatter = None  # type: ignore[assignment,misc]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own piece of a (D)Tensor."""
    return t._local_tensor if isinstance(t, DTensor) else t


def replication(param: torch.Tensor, *, dp: int, tp: int) -> int:
    """On how many ranks of one pipeline stage the same values of this parameter's local piece live."""
    shards = 1
    if isinstance(param, DTensor):
        for dim, placement in enumerate(param.placements):
            if not isinstance(placement, Replicate):
                shards *= param.device_mesh.size(dim)
    return max(1, (dp * tp) // shards)


@dataclasses.dataclass
class AdamView:
    """Reads AdamW's preconditioner for a parameter (its local piece)."""

    optimizers: list[torch.optim.Optimizer]

    def __post_init__(self) -> None:
        self._group: dict[int, tuple[torch.optim.Optimizer, dict]] = {}
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    self._group[id(param)] = (optimizer, group)

    def preconditioned_sqnorm(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        weights: list[float],
        *,
        grad_scale: float = 1.0,
    ) -> torch.Tensor:
        """Σ weight·|g / denominator|² over the pairs, in float64; pairs without optimizer state are skipped.

        `denominator` is AdamW's for this step if grad_scale·g (same number of elements as the parameter's local
        piece) were the gradient: this step's g² enters the second moment before Adam divides, so
        v = β₂·v_prev + (1−β₂)·(grad_scale·g)². Using v_prev alone would let a coordinate that saw no gradient for
        many steps (a rare byte's embedding row, whose v decayed towards 0) explode the norm, although Adam never
        divides by that stale value. The work is batched with `torch._foreach_*` (a handful of kernels for all
        pairs rather than about ten per parameter: on small models the per-call overhead is the whole cost).
        """
        previous, pieces, kept, beta2s, squares, corrections, eps = [], [], [], [], [], [], []
        for param, grad, weight in zip(params, grads, weights, strict=True):
            found = self._group.get(id(param))
            if found is None:
                continue
            optimizer, group = found
            state = optimizer.state.get(param, {})
            if "exp_avg_sq" not in state:
                continue
            beta2 = group["betas"][1]
            moment = local_tensor(state["exp_avg_sq"]).float()
            previous.append(moment if moment.shape == grad.shape else moment.reshape(grad.shape))
            pieces.append(grad.float())
            kept.append(weight)
            beta2s.append(beta2)
            squares.append((1.0 - beta2) * grad_scale * grad_scale)
            corrections.append(1.0 / (1.0 - beta2 ** (float(state["step"]) + 1.0)))
            eps.append(group["eps"])
        if not pieces:
            return torch.zeros((), dtype=torch.float64)
        second = torch._foreach_mul(previous, beta2s)
        torch._foreach_addcmul_(second, pieces, pieces, squares)
        torch._foreach_mul_(second, corrections)
        torch._foreach_sqrt_(second)
        torch._foreach_add_(second, eps)
        return weighted_sqnorm(torch._foreach_div(pieces, second), kept)


def weighted_sqnorm(tensors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
    """Σ weight·|t|² in float64, with one batched norm kernel for all tensors."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).double()
    scale = torch.tensor(weights, dtype=torch.float64, device=norms.device)
    return (norms.square() * scale).sum()


PENDING_LIMIT = 256
"""Micro-batch gradients queued before their norms are taken in one batch: bounds the memory they hold."""


class GradStats:
    """Collects the local pieces of one step's gradient statistics on this rank."""

    def __init__(self, *, dp: int, tp: int, num_microbatches: int, device: torch.device) -> None:
        self.dp, self.tp = dp, tp
        self.num_microbatches = num_microbatches
        self.device = device
        self.micro_mode = dp == 1
        self.adam: AdamView | None = None
        self.use_adam = False
        self.enabled = True
        """False with `heartbeat.gradient_stats: false`: no local or Adam norms, only the global one (clipping)."""
        self.local_sq = torch.zeros((), dtype=torch.float64, device=device)
        self.local_adam = torch.zeros((), dtype=torch.float64, device=device)
        self._hooks: list = []
        self._weights: dict[int, float] = {}
        self._pending: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._pending_ids: set[int] = set()

    @property
    def has_local(self) -> bool:
        """Whether this layout has a small batch at all (dp > 1, or dp = 1 with several micro-batches)."""
        return self.enabled and measures_noise(dp=self.dp, microbatches=self.num_microbatches)

    def begin_step(self, *, use_adam: bool) -> None:
        self._pending, self._pending_ids = [], set()
        self.local_sq.zero_()
        self.local_adam.zero_()
        self.use_adam = use_adam and self.enabled and self.adam is not None

    # dp = 1: per-micro-batch parameter hooks ---------------------------------------------------------------

    def attach_param_hooks(self, params: Iterable[nn.Parameter]) -> None:
        for param in params:
            self._weights[id(param)] = 1.0 / replication(param, dp=self.dp, tp=self.tp)
            self._hooks.append(param.register_hook(self._make_hook(param)))

    def _make_hook(self, param: nn.Parameter) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            # Queue the micro-batch gradient and reduce queued ones in batches (`flush`). A queued tensor may become
            # the parameter's .grad, which the next micro-batch accumulates into in place — but only after this
            # parameter's hook has fired again, and a repeat flushes first.
            if id(param) in self._pending_ids or len(self._pending) >= PENDING_LIMIT:
                self.flush()
            self._pending.append((param, local_tensor(grad)))
            self._pending_ids.add(id(param))

        return hook

    def flush(self) -> None:
        """Add the queued micro-batch gradients' (and their Adam variants') squared norms to the local sums."""
        if not self._pending:
            return
        params = [param for param, _ in self._pending]
        pieces = [piece for _, piece in self._pending]
        self._pending, self._pending_ids = [], set()
        weights = [self._weights[id(param)] for param in params]
        with torch.no_grad():
            self.local_sq += weighted_sqnorm(pieces, weights).to(self.device)
            if self.use_adam:
                # The hook sees ∂(loss_k / global count); the micro-batch's own gradient is M times that.
                self.local_adam += self.adam.preconditioned_sqnorm(  # type: ignore[union-attr]
                    params, pieces, weights, grad_scale=float(self.num_microbatches)
                ).to(self.device)

    # dp > 1: FSDP2's reduce-scatter input ---------------------------------------------------------------------

    def attach_fsdp(self, module: nn.Module) -> bool:
        """Install `StatsReduceScatter` on every FSDP module under `module`; False if this torch lacks the hook."""
        from torch.distributed.fsdp import FSDPModule

        if DefaultReduceScatter is None:
            return False
        for sub in module.modules():
            if isinstance(sub, FSDPModule):
                sub.set_custom_reduce_scatter(StatsReduceScatter(self, sub))
        return True

    def observe_unreduced(self, module: nn.Module, flat: torch.Tensor, group: dist.ProcessGroup) -> None:
        """Add the squared norm of this rank's unreduced gradients of one FSDP parameter group.

        FSDP2 lays the flat input out as [dp rows] × [for each parameter: its padded dim-0 chunk for that row].
        """
        fsdp_params = module._get_fsdp_state()._fsdp_param_groups[0].fsdp_params
        rows = flat.view(group.size(), -1)
        own_row = rows[group.rank()]
        with torch.no_grad():
            weights = [1.0 / replication(fp.sharded_param, dp=self.dp, tp=self.tp) for fp in fsdp_params]
            uniform = all(w == 1.0 for w in weights)
            if uniform:  # one pass over the buffer (padding is zero-filled by FSDP's chunk_cat)
                self.local_sq += flat.float().pow(2).sum() / self.dp
            offset = 0
            params, owns, own_weights = [], [], []
            for fp, weight in zip(fsdp_params, weights, strict=True):
                width = fp.padded_sharded_param_size.numel()
                if not uniform:
                    self.local_sq += weight * rows[:, offset : offset + width].float().pow(2).sum() / self.dp
                numel = local_tensor(fp.sharded_param).numel()
                if self.use_adam and numel:
                    # The loss is scaled by dp/count, so the unreduced buffer already holds the replica's G_small.
                    params.append(fp.sharded_param)
                    owns.append(own_row[offset : offset + numel])
                    own_weights.append(weight)
                offset += width
            if offset != rows.shape[1]:
                raise RuntimeError(f"FSDP reduce-scatter layout changed: {offset} != {rows.shape[1]} per row")
            if params:
                self.local_adam += self.adam.preconditioned_sqnorm(params, owns, own_weights).to(self.device)  # type: ignore[union-attr]

    # After the reduction --------------------------------------------------------------------------------------

    def global_terms(self, params: Iterable[nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's weighted pieces of |G_big|² and its Adam-preconditioned variant."""
        with_grad = [param for param in params if param.grad is not None]
        pieces = [local_tensor(param.grad) for param in with_grad]
        weights = [1.0 / replication(param, dp=self.dp, tp=self.tp) for param in with_grad]
        with torch.no_grad():
            # |G_big|² sets the clipping factor, so it is summed exactly as before the statistics were batched: a
            # change in its last bits would change the training (losses bit-identical under a fixed seed).
            sq = torch.zeros((), dtype=torch.float64, device=self.device)
            for piece, weight in zip(pieces, weights, strict=True):
                sq += weight * piece.float().pow(2).sum()
            adam = torch.zeros((), dtype=torch.float64, device=self.device)
            if self.use_adam:
                adam = self.adam.preconditioned_sqnorm(with_grad, pieces, weights).to(self.device)  # type: ignore[union-attr]
        return sq, adam

    def local_terms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's pieces of the local norms, already divided so that the world SUM is the final value."""
        self.flush()
        if self.micro_mode:
            # Hooks saw g_k = ∂(loss_k / global count); G_micro = M·g_k, and local = mean_k |G_micro|² = M·Σ|g_k|².
            scale = float(self.num_microbatches)
            return self.local_sq * scale, self.local_adam * scale
        return self.local_sq, self.local_adam

    def local_batch(self, *, gbs: int, mbs: int) -> int:
        """B_small: the micro-batch under dp = 1, else one replica's share of the global batch."""
        return mbs if self.micro_mode else gbs // self.dp


if DefaultReduceScatter is not None:

    class StatsReduceScatter(DefaultReduceScatter):  # type: ignore[misc,valid-type]
        """FSDP2's default reduce-scatter, after taking the statistics of its (unreduced) input."""

        def __init__(self, stats: GradStats, module: nn.Module) -> None:
            super().__init__()
            self.stats = stats
            self.module = module

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[override]
            self.stats.observe_unreduced(self.module, input_tensor, group)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)
