"""Data parallelism with FSDP2: `fully_shard` on the dp axis of the mesh, each block and then the stage root.

Each block is its own FSDP unit (one all-gather / reduce-scatter per block, overlapped with the neighbours'
compute); the root unit takes what is left (embeddings, final norm, head). Applied after tensor parallelism, so a
tp-sharded weight is sharded once more along dp (a 2-D DTensor). Skipped when dp = 1: the parameters stay plain
tensors or tp DTensors.

Gradients are reduce-scattered as a mean over dp; the trainer scales the loss so that this mean is the gradient of
the global batch's mean loss (`trainer.parallel`). Gradient statistics hook into the reduce-scatter
(`GradStats.attach_fsdp`) to see each replica's gradient before the reduction.
"""

from __future__ import annotations

from cona.trainer.model import Transformer
from torch.distributed.device_mesh import DeviceMesh


def reshard_after_forward(*, pp: int, sharded_dp: bool) -> bool:
    """Whether FSDP2 frees the gathered parameters after forward (and gathers them again for backward)."""
    # Under pp every micro-batch would all-gather again; keep parameters gathered between forward and
    # backward there (torchtitan's choice), and when sharded_dp is off (ZeRO-2 style).
    return pp == 1 and sharded_dp


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, *, pp: int, sharded_dp: bool) -> None:
    """Shard `model` (one pipeline stage) over `dp_mesh` in place: every block, then the stage root."""
    from torch.distributed.fsdp import fully_shard

    reshard = reshard_after_forward(pp=pp, sharded_dp=sharded_dp)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
