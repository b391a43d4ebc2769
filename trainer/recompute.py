"""Activation recomputation (`parallel.recompute`): what a block keeps for backward and what it recomputes.

* `none` — autograd keeps every activation it saves.
* `full` — `torch.utils.checkpoint` around the whole block: only the block's input is kept; backward runs the
  block's forward again, then its backward.
* `selective` — torchtitan's op-level selective activation checkpointing: the same checkpoint, with a policy
  (`create_selective_checkpoint_contexts`) that keeps the outputs of the matmuls and of attention from the first
  forward, so the recompute in backward replays only the cheap elementwise ops (norms, GELU/SiLU, RoPE, residual
  adds, dtype casts) and reads the expensive results from the cache.

The policy works at the aten level, under the DTensor (tensor parallel) and FSDP2 layers: a column-parallel
projection is an `aten.mm`/`addmm` of the local shards like any other, and FSDP2 gathers a block's parameters in
its pre-forward hook, outside the checkpointed function. Collectives issued inside the block (the all-reduce after
a row-parallel projection) are kept too, so recomputation never communicates again.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, Literal

import torch

Recompute = Literal["none", "selective", "full"]


def _ops(*names: str) -> set[Any]:
    """The default overloads of the named ops that exist in this torch build (an op a build lacks is skipped)."""
    found = set()
    for name in names:
        namespace, _, op = name.rpartition(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.add(packet.default)
    return found


SAVE_OPS: frozenset[Any] = frozenset(
    _ops(
        # matmuls: linear decomposes to mm (no bias, or 3-D inputs) or addmm (2-D with bias); bmm for batched ones
        "aten.mm", "aten.addmm", "aten.bmm", "aten.linear",
        # fused attention, on every backend SDPA may pick (its output and logsumexp are what backward needs)
        "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
        "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
        # tensor parallelism's collectives whose outputs are slices or needed anyway: recomputing them would
        # communicate again. Not sequence parallelism's all-gathers: their whole-sequence outputs are gathered again
        # in backward (torchtitan's and Megatron's choice), so a block keeps slices only.
        "_c10d_functional.all_reduce", "_c10d_functional.reduce_scatter_tensor",
    )
)  # fmt: skip
"""The ops whose outputs selective recomputation keeps from the first forward."""


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Keep what `SAVE_OPS` produce; recompute everything else (the elementwise ops between them)."""
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(fn: Callable[..., torch.Tensor], *args: Any, mode: Recompute) -> torch.Tensor:
    """`fn(*args)` under the recompute `mode` (no checkpoint for `none` or without grad, e.g. in evaluation)."""
    if mode == "none" or not torch.is_grad_enabled():
        return fn(*args)
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if mode == "full":
        return checkpoint(fn, *args, use_reentrant=False)
    context_fn = partial(create_selective_checkpoint_contexts, selective_policy)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)
