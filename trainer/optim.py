"""The optimizer of one model part: AdamW, with decoupled weight decay on every tensor of two or more dimensions.

One optimizer per pipeline stage this rank holds (`ParallelModel.optimizers`), built after tensor parallelism and
FSDP2, so it holds the parameters in their final form and its state is sharded the way they are (DTensors under tp
or dp). The learning rate is set on every step by the caller (`ParallelModel.optimizer_step`); the one given here
is only the initial value.
"""

from __future__ import annotations

import torch
from cona.protocol.job import OptimizerSpec
from torch import nn


def build_optimizer(part: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
    """AdamW over `part`'s parameters: weight decay on matrices and embeddings, none on vectors."""
    decay = [p for p in part.parameters() if p.ndim >= 2]
    no_decay = [p for p in part.parameters() if p.ndim < 2]  # biases and norm gains are not decayed
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]  # a stage may hold no vector (or no matrix) at all
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(spec.beta1, spec.beta2), eps=spec.eps)
