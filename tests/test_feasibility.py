"""`cona.protocol.feasibility` on its own (torch-free): what runs at a cost instead of being forbidden, what is
still impossible and how each answer reads, and how `placement` spreads such worlds over nodes."""

from __future__ import annotations

import pytest
from cona.protocol.feasibility import (
    batch_problem,
    layout_problem,
    placement,
    strategy_problem,
    virtual_stages,
)
from cona.protocol.job import JobSpec, job_from_dict
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError


def _job(preset: str = "gpt3-1.3b", **parallel) -> JobSpec:
    return job_from_dict({"model": {"preset": preset}, "parallel": parallel})


# Tensor parallelism and nodes ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tp", "gpus_per_node"),
    [(1, 8), (4, 8), (8, 8), (16, 8), (8, 4), (16, 4), (4, 2)],
)
def test_tp_inside_a_node_or_on_whole_nodes_runs(tp, gpus_per_node):
    # gpt3-1.3b: 16 heads and an MLP of 8192, so every tp here splits the model; 16 over nodes of 8 is two whole
    # nodes per tp group, slower (the cost model charges it) but not forbidden.
    assert layout_problem(_job(), tp=tp, pp=1, gpus_per_node=gpus_per_node) == ""


@pytest.mark.parametrize(("tp", "gpus_per_node"), [(4, 6), (16, 6), (8, 12), (16, 24)])
def test_tp_straddling_nodes_unevenly_is_one_line_naming_the_fields_and_the_choice(tp, gpus_per_node):
    problem = layout_problem(_job(), tp=tp, pp=1, gpus_per_node=gpus_per_node)
    assert problem == (
        f"tp={tp} neither divides nor is a multiple of gpus_per_node={gpus_per_node}, so its groups would straddle "
        f"nodes unevenly; choose a tp that divides {gpus_per_node} or is a multiple of it"
    )
    assert "\n" not in problem
    # The trainer's check is the same function (without a node size, since it runs on whatever it was given).
    strategy = Strategy(dp=1, tp=tp, pp=1, mbs=1, gbs=1)
    assert strategy_problem(_job(), strategy, gpus_per_node=gpus_per_node) == problem
    assert strategy_problem(_job(), strategy) == ""


def test_the_model_still_bounds_tp_before_the_nodes_do():
    problem = layout_problem(_job(), tp=32, pp=1, gpus_per_node=8)
    assert problem == "tp=32 does not divide model.num_heads=16; choose a tp that divides it"


def test_sequence_parallelism_needs_tp_to_divide_the_sequence():
    """Each tp rank holds seq_len / tp positions of every block's input: a remainder has no rank to go to."""
    odd = {"preset": "gpt3-1.3b", "seq_len": 2046}  # 2 · 3 · 11 · 31: tp 2 divides it, 4 does not
    job = job_from_dict({"model": odd, "parallel": {"sequence_parallel": True}})
    assert layout_problem(job, tp=2, pp=1) == ""
    assert layout_problem(job, tp=4, pp=1) == (
        "tp=4 does not divide model.seq_len=2046, which sequence parallelism splits over the tp ranks; choose a tp "
        "that divides it or set parallel.sequence_parallel: false"
    )
    assert layout_problem(job_from_dict({"model": odd}), tp=4, pp=1) == ""  # without it, any tp that splits the heads


def _node_of_rank(world: int, nnodes: int) -> list[int]:
    per_node = world // nnodes
    return [rank // per_node for rank in range(world)]


@pytest.mark.parametrize(
    ("dp", "tp", "pp", "gpus_per_node", "expected"),
    [
        (2, 16, 1, 8, (4, 8)),  # two tp groups of two whole nodes each
        (1, 16, 2, 8, (4, 8)),  # a pipeline of two stages, each one tp group on two nodes
        (1, 8, 3, 4, (6, 4)),
        (1, 4, 3, 8, (3, 4)),  # 12 processes: 2 nodes of 6 would cut the second tp group in two
        (3, 1, 1, 8, (1, 3)),
        (4, 1, 3, 8, (2, 6)),  # without tp nothing is cut: the fewest nodes, as before
    ],
)
def test_placement_keeps_every_tp_group_inside_a_node_or_on_whole_nodes(dp, tp, pp, gpus_per_node, expected):
    strategy = Strategy(dp=dp, tp=tp, pp=pp, mbs=1, gbs=dp)
    nnodes, per_node = placement(strategy, gpus_per_node)
    assert (nnodes, per_node) == expected
    node = _node_of_rank(strategy.world_size, nnodes)
    # The mesh is ("pp", "dp", "tp"), tp innermost: tp group g is ranks [g·tp, (g+1)·tp).
    for first in range(0, strategy.world_size, tp):
        nodes = {node[rank] for rank in range(first, first + tp)}
        on_whole_nodes = all(node.count(n) == per_node for n in nodes) and len(nodes) * per_node == tp
        assert len(nodes) == 1 or on_whole_nodes, f"tp group at rank {first} straddles nodes {sorted(nodes)}"


def test_placement_of_cross_node_tp_respects_the_profiles_nodes():
    with pytest.raises(ValueError, match="needs 4 nodes but the profile has 2"):
        placement(Strategy(dp=2, tp=16, pp=1, mbs=1, gbs=2), 8, max_nodes=2)


# Pipeline schedules and micro-batches -------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
@pytest.mark.parametrize(("pp", "micro"), [(2, 1), (4, 1), (4, 2), (4, 3), (8, 5)])
def test_fewer_micro_batches_than_stages_run_under_every_schedule(schedule, pp, micro):
    # The bubble grows (the cost model's business); the trainer runs 1F1B as GPipe there (trainer.pipeline).
    job = _job(pipeline_schedule=schedule)
    assert batch_problem(job, Strategy(dp=2, tp=1, pp=pp, mbs=2, gbs=4 * micro)) == ""


@pytest.mark.parametrize(
    ("pp", "micro", "ok"),
    [
        (2, 2, True), (2, 3, True), (2, 4, True), (2, 5, False), (2, 6, True), (2, 7, False),
        (4, 6, True), (4, 7, True), (4, 8, True), (4, 9, False), (4, 10, True), (4, 12, True), (4, 13, False),
    ],
)  # fmt: skip
def test_interleaved_needs_a_multiple_of_its_rounds(pp, micro, ok):
    # torch 2.13's ScheduleInterleaved1F1B: rounds = max(1, m // pp), and m a multiple of them.
    problem = batch_problem(_job(pipeline_schedule="interleaved"), Strategy(dp=1, tp=1, pp=pp, mbs=1, gbs=micro))
    if ok:
        assert problem == ""
        return
    rounds = micro // pp
    assert problem == (
        f"interleaved 1F1B runs gbs/(dp·mbs)={micro} micro-batches in max(1, {micro}//pp)={rounds} rounds "
        f"(pp={pp}) and needs a multiple of its {rounds} rounds; choose gbs so that gbs/(dp·mbs) is a multiple of "
        f"pp={pp} or below 2·pp={2 * pp}"
    )
    assert "\n" not in problem


def test_whole_micro_batches_are_still_required():
    problem = batch_problem(_job(), Strategy(dp=2, tp=1, pp=2, mbs=3, gbs=8))
    assert problem == "gbs=8 is not a multiple of dp·mbs=6; choose gbs, dp and mbs so that it is"


# Virtual stages -----------------------------------------------------------------------------------------------


def test_virtual_stages_is_the_jobs_field_under_the_interleaved_schedule_only():
    assert virtual_stages(_job(pipeline_schedule="interleaved"), 2) == 2  # the default
    assert virtual_stages(_job(pipeline_schedule="interleaved", virtual_stages=3), 2) == 3
    assert virtual_stages(_job(pipeline_schedule="interleaved", virtual_stages=3), 1) == 1  # no pipeline
    assert virtual_stages(_job(pipeline_schedule="1f1b", virtual_stages=3), 4) == 1


def test_virtual_stages_need_a_layer_each():
    job = _job("tiny-gpt", pipeline_schedule="interleaved", virtual_stages=3)  # 4 layers
    assert layout_problem(job, tp=1, pp=2) == (
        "6 pipeline stages need at least 6 layers but model.num_layers=4; choose a smaller pp or "
        "parallel.virtual_stages"
    )
    assert layout_problem(_job("tiny-gpt"), tp=1, pp=8) == (
        "8 pipeline stages need at least 8 layers but model.num_layers=4; choose a smaller pp"
    )


def test_virtual_stages_below_two_is_refused():
    with pytest.raises(ConfigError, match=r"parallel\.virtual_stages"):
        _job(pipeline_schedule="interleaved", virtual_stages=1)
