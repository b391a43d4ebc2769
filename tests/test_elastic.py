"""Elastic runs without a cluster: the planning table (a strategy for every node count of [min_nodes, nodes]),
what `cona status` shows of it, and the decision to grow (a candidate switch like any other: taken when it pays)."""

from __future__ import annotations

import pytest
from cona.orchestrator.backends.slurm import SlurmBackend
from cona.orchestrator.elastic import ElasticPlan, is_elastic, node_range, plan_table, read_plan, write_plan
from cona.orchestrator.job import load_job
from cona.orchestrator.profile import load_profile
from cona.orchestrator.runmodel import RunModel
from cona.orchestrator.scheduler import Scheduler, device_counts
from cona.orchestrator.switchcost import SwitchKind
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

from tests.conftest import REPO

PROFILE = REPO / "slurm" / "profiles" / "local-slurm.yaml"  # 2 nodes × 2 processes
TINY = REPO / "examples" / "tiny-gpt.yaml"


def _model(tmp_path, *job_sets: str, min_nodes: int = 1) -> tuple[RunModel, SlurmBackend]:
    profile = load_profile(PROFILE, [f"min_nodes={min_nodes}"])
    job = load_job(TINY, list(job_sets))
    backend = SlurmBackend(run_dir=RunDir(tmp_path / "run"), profile=profile, job=job)
    sched = Scheduler(run_dir=RunDir(tmp_path / "run"), profile=profile, job=job, backend=backend)
    return sched.model, backend


def test_the_planning_table_has_a_strategy_for_every_node_count(tmp_path):
    model, _ = _model(tmp_path)
    profile = model.profile
    assert is_elastic(profile) and node_range(profile) == [1, 2]
    assert device_counts(profile, model.job) == [4, 2]
    plan = plan_table(model, reason="start", time=1.0)
    assert (plan.min_nodes, plan.max_nodes) == (1, 2) and [p.nodes for p in plan.plans] == [1, 2]
    one, two = plan.strategy_for(1), plan.strategy_for(2)
    assert one is not None and two is not None
    assert (one.world_size, two.world_size) == (2, 4)  # each world's own degrees
    assert all(p.feasible > 1 for p in plan.plans)
    # The cona policy's choice for each world, under the prior before any measurement: its initial strategy on
    # that world's candidates, and on all devices the run's initial strategy.
    assert two == model.initial_strategy()
    pool = [c for c in model.candidates if c.strategy.world_size == 2]
    assert one == model.policy.initial(candidates=pool, throughput=model.throughput, samples=0)
    assert plan.noise_scale == model.ranking_noise_scale() > 0
    # What `cona status` reads back.
    write_plan(RunDir(tmp_path), plan)
    again = read_plan(RunDir(tmp_path))
    assert again == plan and ElasticPlan.from_dict(plan.to_dict()) == plan
    assert plan.by_nodes(up_to=1) == {1: one}


def test_a_policy_that_names_its_strategy_is_planned_the_fastest_elsewhere(tmp_path):
    fixed = "dp=4,tp=1,pp=1,mbs=4,gbs=16"
    model, _ = _model(tmp_path, "policy.name=fixed", f"policy.strategy={fixed}")
    plan = plan_table(model, reason="start", time=1.0)
    assert plan.strategy_for(2) == Strategy.parse(fixed) and plan.noise_scale is None
    one = plan.strategy_for(1)
    assert one is not None and one.world_size == 2 and one.gbs == model.job.batch.base_gbs


def test_a_profile_without_min_nodes_is_not_elastic(tmp_path):
    model, _ = _model(tmp_path, min_nodes=2)
    assert not is_elastic(model.profile) and node_range(model.profile) == [2]
    assert device_counts(model.profile, model.job) == [4]
    with pytest.raises(ConfigError, match="min_nodes=3 exceeds nodes=2"):
        load_profile(PROFILE, ["min_nodes=3"])


GROW = ("policy.persistence=1", "policy.min_dwell_s=0", "policy.min_gain=0.01", "policy.probe_layouts=0")


@pytest.mark.parametrize("cost_s, grows", [(0, True), (1e6, False)])
def test_growing_is_a_switch_taken_only_when_it_pays(tmp_path, cost_s, grows):
    """On 1 node with a second one idle, the 2-node world is a candidate: its predicted throughput is larger, so
    with a free switch (`policy.switch_cost_s: 0`) the policy grows, as a resubmission; when the switch costs more
    than the horizon can pay back it stays. Without the idle node (worlds = the current one) it never grows."""
    model, backend = _model(tmp_path, *GROW, f"policy.switch_cost_s={cost_s}")
    current = plan_table(model, reason="start", time=0.0).strategy_for(1)
    assert current is not None
    model.attempt_started(1, current)
    plan = model.decide(now=100.0, current=current, strategy_since=0.0, elapsed_s=100.0, worlds={2, 4})
    if grows:
        assert plan is not None and plan.target.world_size == 4, model.last_decision
        assert plan.kind is SwitchKind.RESUBMIT == backend.switch_kind(current, plan.target, in_place_allowed=True)
    else:
        assert plan is None or plan.target.world_size == 2, plan
    alone = model.decide(now=200.0, current=current, strategy_since=0.0, elapsed_s=200.0, worlds={2})
    assert alone is None or alone.target.world_size == 2


def test_the_table_follows_the_policy_on_when_the_noise_estimate_counts(tmp_path, monkeypatch):
    """An estimate that exists but that the policy does not trust yet (blend weight 0) changes nothing: each world
    is planned at the start batch, as the policy itself holds it; once trusted, the estimate ranks every batch."""
    model, _ = _model(tmp_path)
    before = plan_table(model, reason="start", time=1.0)
    monkeypatch.setattr(type(model.noise), "value", property(lambda self: 1e5))  # a huge B_noise: larger batches
    assert model.policy.noise_weight == 0
    held = plan_table(model, reason="estimate not trusted", time=2.0)
    assert held.plans == before.plans
    assert all(p.strategy is not None and p.strategy.gbs == model.job.batch.base_gbs for p in held.plans)
    model.policy._noise_weight = 1.0  # what the policy's evaluations set once the estimate is stable
    trusted = plan_table(model, reason="estimate trusted", time=3.0)
    assert all(p.strategy is not None and p.strategy.gbs > model.job.batch.base_gbs for p in trusted.plans)


def test_render_starts_on_all_devices_without_planning_every_node_count(monkeypatch):
    """`cona render`/`submit` show the run's first strategy: on all devices when anything fits there, as the run
    starts (`RunModel.initial_strategy`); the thousands of smaller node counts of a wide elastic range are planned
    only when nothing fits on all of them (a 2,048-node range took 21 s before)."""
    import cona.orchestrator.planner as planner
    from cona.orchestrator.cli import first_strategy

    job = load_job(REPO / "examples" / "gpt3-1.3b.yaml")
    profile = load_profile(REPO / "slurm" / "profiles" / "a100-4x8.yaml", ["nodes=2048", "min_nodes=1"])
    planned = []
    enumerate_all = planner.enumerate_candidates

    def counting(**kwargs):
        planned.append(kwargs.get("num_devices"))
        return enumerate_all(**kwargs)

    monkeypatch.setattr(planner, "enumerate_candidates", counting)
    assert first_strategy(profile, job).world_size == profile.num_gpus
    assert planned == [profile.num_gpus]
    # Nothing fits on all 3 × 6 devices (gpt3-1.3b's batches hold no factor 9): the smaller node counts are planned
    # and the run starts on the fastest of them.
    planned.clear()
    small = load_profile(REPO / "slurm" / "profiles" / "a100-4x8.yaml", ["nodes=3", "gpus_per_node=6", "min_nodes=1"])
    start = first_strategy(small, job)
    assert planned == [18, 12, 6] and start.world_size in (12, 6)
