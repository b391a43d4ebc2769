"""Tensor parallelism: `parallelize_module` on every block of a stage, with the plan the model declares.

Which projection is split which way is the model's business and lives next to its modules
(`trainer.model.tp_plan`: q, k, v and the MLP's input projections column-parallel, the attention output and the
MLP output row-parallel, so whole attention heads and whole kv heads go to each tp rank). This module only turns
that plan into DTensor parallel styles on the mesh's tp axis. Embeddings, norms and the head are not in the plan:
they stay replicated across tp.

Applied after the stage is materialised and before FSDP2 (`trainer.parallel`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cona.trainer.model import TpStyle, Transformer, tp_plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


def parallel_style(kind: TpStyle) -> ParallelStyle:
    """The DTensor style of one plan entry."""
    # Imported here, not at the top: runs without tp never load the tensor-parallel package.
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    style = ColwiseParallel() if kind == "colwise" else RowwiseParallel()
    style.src_data_rank = None  # every rank holds the same full weight: slice locally, no scatter
    return style


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Split every block of `model` (one pipeline stage) over `tp_mesh` in place, following `tp_plan`."""
    from torch.distributed.tensor.parallel import parallelize_module

    for block in model.layers.values():
        plan = {name: parallel_style(kind) for name, kind in tp_plan(block).items()}
        parallelize_module(block, tp_mesh, plan)
