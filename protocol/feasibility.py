"""Whether a strategy can run a job's model, and why not: the one place that decides it. Torch-free.

The planner asks it for every candidate (and adds what is a choice rather than a constraint: the job's batch bounds,
`parallel.max_tp`/`max_pp`, equal stages at each global batch where the devices allow them and equal chunks under
the interleaved schedule, the memory model); the trainer asks it before building a strategy it was given; the
backends use `placement` to spread a world over nodes. Each answer is one line that names the value at fault and
says what to change.

What can run:
- tensor parallelism splits attention heads, key/value heads and the MLP: tp divides each of them; on a cluster
  each tp group (consecutive ranks: the mesh is pp-major, tp-minor) lies inside one node or on whole nodes, so tp
  divides the devices per node or is a multiple of them (across nodes it runs, slower: the cost model charges it);
- each pipeline stage (each of the `parallel.virtual_stages` chunks per rank of the interleaved schedule) holds at
  least one layer; stages that do not divide the layers are split as evenly as they can be (`stage_layers`);
- the global batch splits into whole micro-batches on every replica: gbs is a multiple of dp·mbs;
- the interleaved schedule (torch's `ScheduleInterleaved1F1B`) runs its m = gbs/(dp·mbs) micro-batches in
  max(1, m // pp) rounds and needs m to be a multiple of them. Fewer micro-batches than stages run under every
  schedule, with the larger bubble the cost model charges (1F1B then runs as GPipe: `trainer.pipeline`);
- dp·tp·pp processes: exactly the world's size (checked last, so a strategy that only needs another world size can be
  told apart from one that cannot run at all).
"""

from __future__ import annotations

from cona.protocol.job import JobSpec
from cona.protocol.strategy import Strategy


def stage_layers(num_layers: int, num_stages: int) -> list[int]:
    """Blocks per pipeline stage (chunk), in stage order: contiguous and as equal as they can be, the first stages
    one more when the stages do not divide the layers (how the trainer splits the model, `trainer.model`; the
    cost and memory models count the same split)."""
    assert num_stages > 0, num_stages
    base, extra = divmod(num_layers, num_stages)
    return [base + (1 if stage < extra else 0) for stage in range(num_stages)]


def virtual_stages(job: JobSpec, pp: int) -> int:
    """Model chunks per pipeline rank: `parallel.virtual_stages` under the interleaved schedule with pp > 1, else 1."""
    return job.parallel.virtual_stages if job.parallel.pipeline_schedule == "interleaved" and pp > 1 else 1


def layout_problem(job: JobSpec, *, tp: int, pp: int, gpus_per_node: int | None = None) -> str:
    """Why the degrees tp and pp cannot split this model (on nodes of `gpus_per_node` devices), or ''."""
    model = job.model
    for name, value in (
        ("model.num_heads", model.num_heads),
        ("model.num_kv_heads", model.num_kv_heads),
        ("model.ffn_hidden_size", model.ffn_hidden_size),
    ):
        if value % tp:
            return f"tp={tp} does not divide {name}={value}; choose a tp that divides it"
    if tp > 1 and job.parallel.sequence_parallel and model.seq_len % tp:
        return (f"tp={tp} does not divide model.seq_len={model.seq_len}, which sequence parallelism splits over the "
                "tp ranks; choose a tp that divides it or set parallel.sequence_parallel: false")  # fmt: skip
    # A tp group is tp consecutive ranks: on full nodes it lies inside one or on whole ones only when tp divides
    # gpus_per_node or is a multiple of it; otherwise groups straddle node boundaries, each split differently.
    if gpus_per_node is not None and gpus_per_node % tp and tp % gpus_per_node:
        return (f"tp={tp} neither divides nor is a multiple of gpus_per_node={gpus_per_node}, so its groups "
                f"would straddle nodes unevenly; choose a tp that divides {gpus_per_node} or is a multiple of "
                f"it")  # fmt: skip
    virtual = virtual_stages(job, pp)
    stages = pp * virtual
    if stages > model.num_layers:
        smaller = "a smaller pp or parallel.virtual_stages" if virtual > 1 else "a smaller pp"
        return (f"{stages} pipeline stages need at least {stages} layers but model.num_layers={model.num_layers}; "
                f"choose {smaller}")  # fmt: skip
    return ""


def batch_problem(job: JobSpec, strategy: Strategy) -> str:
    """Why the batch sizes do not split over the strategy's replicas and stages, or ''."""
    return split_problem(job, dp=strategy.dp, pp=strategy.pp, mbs=strategy.mbs, gbs=strategy.gbs)


def split_problem(job: JobSpec, *, dp: int, pp: int, mbs: int, gbs: int) -> str:
    """`batch_problem` on the degrees themselves: the planner asks it of millions of combinations on a large elastic
    range before it builds a `Strategy` for the few that pass (building one costs more than the rule)."""
    if gbs % (dp * mbs):
        return f"gbs={gbs} is not a multiple of dp·mbs={dp * mbs}; choose gbs, dp and mbs so that it is"
    micro = gbs // (dp * mbs)
    # No rule for fewer micro-batches than stages: every schedule runs them (trainer.pipeline), paying the bubble.
    rounds = max(1, micro // pp)
    if pp > 1 and job.parallel.pipeline_schedule == "interleaved" and micro % rounds:
        return (f"interleaved 1F1B runs gbs/(dp·mbs)={micro} micro-batches in max(1, {micro}//pp)={rounds} "
                f"rounds (pp={pp}) and needs a multiple of its {rounds} rounds; choose gbs so that gbs/(dp·mbs) is "
                f"a multiple of pp={pp} or below 2·pp={2 * pp}")  # fmt: skip
    return ""


def strategy_problem(job: JobSpec, strategy: Strategy, *, gpus_per_node: int | None = None) -> str:
    """Why `strategy` cannot run `job`'s model at all (whatever the world size), or ''."""
    return layout_problem(job, tp=strategy.tp, pp=strategy.pp, gpus_per_node=gpus_per_node) or batch_problem(
        job, strategy
    )


def world_problem(strategy: Strategy, world_size: int) -> str:
    """Why `strategy` does not fit a world of `world_size` processes, or ''."""
    if strategy.world_size != world_size:
        return (f"needs dp·tp·pp = {strategy.world_size} processes but the world has {world_size}; launch "
                f"{strategy.world_size} processes or choose a strategy for {world_size}")  # fmt: skip
    return ""


def placement(strategy: Strategy, gpus_per_node: int, max_nodes: int | None = None) -> tuple[int, int]:
    """(nodes, processes per node) for a strategy: the fewest nodes that hold dp·tp·pp processes evenly, with every
    tensor-parallel group inside one node or on whole nodes.

    Node i holds the consecutive ranks [i·per_node, (i+1)·per_node) (torchrun numbers each node's processes
    together) and a tp group is tp consecutive ranks (`trainer.distributed.build_mesh`), so a tp group straddles no
    node boundary when per_node is a multiple of tp or tp a multiple of per_node. Raises ValueError when no such
    spread exists within `max_nodes`."""
    world, tp = strategy.world_size, strategy.tp

    def fits(nnodes: int) -> bool:
        per_node = world // nnodes
        return not world % nnodes and (not per_node % tp or not tp % per_node)

    nnodes = -(-world // gpus_per_node)
    while nnodes <= world and not fits(nnodes):
        nnodes += 1
    if nnodes > world or world // nnodes > gpus_per_node:
        raise ValueError(f"strategy {strategy}: {world} processes cannot be spread evenly over nodes of "
                         f"{gpus_per_node} devices")  # fmt: skip
    if max_nodes is not None and nnodes > max_nodes:
        raise ValueError(f"strategy {strategy}: needs {nnodes} nodes but the profile has {max_nodes}")
    return nnodes, world // nnodes
