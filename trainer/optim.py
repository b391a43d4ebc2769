"""The optimizer of one model part: AdamW, with decoupled weight decay on every tensor of two or more dimensions.

One optimizer per pipeline stage this rank holds (`ParallelModel.optimizers`), built after tensor parallelism and
FSDP2, so it holds the parameters in their final form and its state is sharded the way they are (DTensors under tp
or dp). The learning rate is set on every step by the caller (`ParallelModel.optimizer_step`); the one given here
is only the initial value.

The update runs as `torch._foreach_*` kernels (`foreach=True`): on the CPU torch would otherwise take the
per-tensor loop, whose Python and DTensor dispatch per parameter was a quarter of a tiny model's step. It is the
same arithmetic per element, so the weights are bit-identical to the loop's. A foreach kernel takes only tensors of
one kind — plain tensors, or DTensors on one device mesh (a stage under tp without dp holds both: its norm gains are
plain) — so each decay group is split by that kind; the checkpoint stores the state per parameter name
(`trainer.checkpoint`), not per group, so the split does not change what is saved.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from cona.protocol.job import OptimizerSpec
from torch import nn
from torch.distributed.tensor import DTensor


def _by_kind(params: Iterable[nn.Parameter]) -> list[list[nn.Parameter]]:
    """`params` split into runs a foreach kernel accepts together: plain tensors, and DTensors per device mesh."""
    kinds: dict[Any, list[nn.Parameter]] = {}
    for p in params:
        kinds.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return list(kinds.values())


def build_optimizer(part: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
    """AdamW over `part`'s parameters: weight decay on matrices and embeddings, none on vectors."""
    decay = [p for p in part.parameters() if p.ndim >= 2]
    no_decay = [p for p in part.parameters() if p.ndim < 2]  # biases and norm gains are not decayed
    groups = [{"params": run, "weight_decay": decay_rate}
              for params, decay_rate in ((decay, spec.weight_decay), (no_decay, 0.0)) for run in _by_kind(params)]  # fmt: skip
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps, foreach=True)
