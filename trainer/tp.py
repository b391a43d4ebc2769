"""Tensor parallelism: `parallelize_module` on every block of a stage, with the plan the model declares.

Which projection is split which way is the model's business and lives next to its modules
(`trainer.model.tp_plan`: q, k, v and the MLP's input projections column-parallel, the attention output and the
MLP output row-parallel, so whole attention heads and whole kv heads go to each tp rank). This module only turns
that plan into DTensor parallel styles on the mesh's tp axis. Embeddings and the head are not in the plan: they
stay replicated across tp; so do the norms, unless `parallel.sequence_parallel` splits them along the sequence.

Applied after the stage is materialised and before FSDP2 (`trainer.parallel`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cona.trainer.model import TpStyle, Transformer, tp_plan

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle


def parallel_style(kind: TpStyle, *, sequence_parallel: bool = False) -> ParallelStyle:
    """The DTensor style of one plan entry (torchtitan's, for sequence parallelism)."""
    # Imported here, not at the top: runs without tp never load the tensor-parallel package.
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    if kind == "sequence":
        # A local slice out: the post-norm BERT block adds the norm's output to a row-parallel output (local too).
        return SequenceParallel(sequence_dim=1, use_local_output=True)
    if kind == "gather":
        # attention(x, rope) and mlp(x): x gathered whole as a DTensor, so that the column-parallel layers' input
        # gradients (partial sums over the tp ranks) are reduce-scattered straight back to slices in backward.
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    if kind == "colwise":
        style: ParallelStyle = ColwiseParallel()
    else:
        style = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
    style.src_data_rank = None  # every rank holds the same full weight: slice locally, no scatter
    return style


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> None:
    """Split every block of `model` (one pipeline stage) over `tp_mesh` in place, following `tp_plan`; with
    `sequence_parallel`, the blocks take and give slices of the sequence (`Transformer.sequence_mesh`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    for block in model.layers.values():
        plan = {name: parallel_style(kind, sequence_parallel=sequence_parallel)
                for name, kind in tp_plan(block, sequence_parallel=sequence_parallel).items()}  # fmt: skip
        parallelize_module(block, tp_mesh, plan)
    if sequence_parallel:
        model.sequence_mesh = tp_mesh
