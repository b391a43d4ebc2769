"""Elastic runs without a cluster: the planning table (a strategy for every node count of [min_nodes, nodes]),
what `cona status` shows of it, and the decision to grow (a candidate switch like any other: taken when it pays)."""

from __future__ import annotations

import pytest
from cona.orchestrator.backends.slurm import SlurmBackend
from cona.orchestrator.elastic import (
    ElasticPlan,
    is_elastic,
    node_range,
    plan_table,
    read_plan,
    startable_nodes,
    write_plan,
)
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
    for p in held.plans:  # the policy's start on each world's candidates, under the prior
        pool = [c for c in model.candidates if c.strategy.world_size == p.nodes * model.profile.gpus_per_node]
        assert p.strategy == model.policy.initial(candidates=pool, throughput=model.throughput, samples=0)
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
    # Nothing fits on all 3 × 9 devices (gpt3-1.3b's batches hold no factor 27, nor do 24 layers' stages): the
    # smaller node counts are planned (2 nodes pipeline the 24 layers over 9 uneven stages) and the run starts on
    # the fastest of them.
    planned.clear()
    small = load_profile(REPO / "slurm" / "profiles" / "a100-4x8.yaml", ["nodes=3", "gpus_per_node=9", "min_nodes=1"])
    start = first_strategy(small, job)
    assert planned == [27, 18, 9] and start.world_size in (18, 9)


# -- startable_nodes: the one decision of which node counts can start a run -------------------------------------


def _counting_enumeration(monkeypatch) -> list[int]:
    """The device counts the planner is asked to enumerate from now on, in order."""
    import cona.orchestrator.planner as planner

    planned: list[int] = []
    enumerate_all = planner.enumerate_candidates

    def counting(**kwargs):
        planned.append(kwargs.get("num_devices"))
        return enumerate_all(**kwargs)

    monkeypatch.setattr(planner, "enumerate_candidates", counting)
    return planned


def test_startable_node_counts_skip_an_infeasible_count_and_enumerate_lazily(tmp_path, monkeypatch):
    """1 to 7 nodes of 2 processes: tiny-gpt's power-of-two batches split over 2, 4, 8 devices, and over 6 and 12
    with its 4 layers in 3 uneven pipeline stages, but not over 10 or 14 (factors 5 and 7: more stages than
    layers), so 5 nodes in the middle and 7 at the top cannot start. Read from the top, the generator enumerates
    only as far as the first count that can (what render and submit need)."""
    profile = load_profile(PROFILE, ["nodes=7", "min_nodes=1"])
    job = load_job(TINY)
    found = list(startable_nodes(profile, job))
    assert [n for n, _ in found] == [1, 2, 3, 4, 6]
    for nodes, pool in found:
        devices = nodes * profile.gpus_per_node
        assert pool and all(c.feasible and c.strategy.world_size == devices for c in pool)
    assert all(c.strategy.pp % 3 == 0 for c in dict(found)[3])  # the factor 3 is the pipeline's
    assert [n for n, _ in startable_nodes(profile, job, descending=True)] == [6, 4, 3, 2, 1]
    planned = _counting_enumeration(monkeypatch)
    top = next(startable_nodes(profile, job, descending=True))
    assert top[0] == 6 and planned == [14, 12]
    # A run's own candidates (planned for every count of the range) give the same pools, grouped once.
    model, _ = _model(tmp_path, min_nodes=1)
    assert [(n, [c.strategy for c in pool]) for n, pool in startable_nodes(model.profile, model.job, candidates=model.candidates)] == [
        (n, [c.strategy for c in pool]) for n, pool in startable_nodes(model.profile, model.job)
    ]  # fmt: skip


def test_the_table_render_and_the_start_strategy_agree_on_the_startable_counts(tmp_path):
    """The three callers of `startable_nodes`: the planning table plans exactly the counts that can start (5 nodes
    waits), the Slurm render asks for their range, and render/submit start on the fastest of them (nothing fits on
    all 7 nodes; 4 nodes' data parallelism beats 6 nodes' uneven pipeline)."""
    from cona.orchestrator.cli import first_strategy

    profile = load_profile(PROFILE, ["nodes=7", "min_nodes=1"])
    job = load_job(TINY)
    run_dir = RunDir(tmp_path / "run")
    backend = SlurmBackend(run_dir=run_dir, profile=profile, job=job)
    model = Scheduler(run_dir=run_dir, profile=profile, job=job, backend=backend).model
    plan = plan_table(model, reason="start", time=1.0)
    assert sorted(plan.by_nodes()) == [1, 2, 3, 4, 6] and [p.nodes for p in plan.plans] == [1, 2, 3, 4, 5, 6, 7]
    assert [p.feasible for p in plan.plans if p.strategy is None] == [0, 0]
    start = first_strategy(profile, job)
    assert start.world_size == 8 == plan.by_nodes()[4].world_size
    assert "#SBATCH --nodes=1-6" in backend.render(strategy=start).splitlines()


def test_nothing_startable_is_the_clear_error_of_render(tmp_path):
    """gpt3-1.3b fits on no node count of 1 to 3 CPU "nodes" (4 GB each): nothing can start. render/submit say
    so in one line, naming memory as the cause (not the odd factor 6 devices have: no batch that splits over it would
    fit either); the Slurm script then asks for the strategy's own nodes."""
    from cona.orchestrator.cli import UserError, first_strategy

    profile = load_profile(PROFILE, ["nodes=3", "min_nodes=1"])
    job = load_job(REPO / "examples" / "gpt3-1.3b.yaml")
    assert list(startable_nodes(profile, job)) == [] == list(startable_nodes(profile, job, descending=True))
    with pytest.raises(UserError, match=r"^no feasible strategy for gpt3-1.3b on local-slurm; every strategy the "
                                        r"layout and batch rules allow needs more than accelerator.memory='4 GB'"
                                        r".*run `cona plan --all` to see why$"):  # fmt: skip
        first_strategy(profile, job)
    backend = SlurmBackend(run_dir=RunDir(tmp_path / "run"), profile=profile, job=job)
    rendered = backend.render(strategy=Strategy.parse("dp=2,tp=1,pp=1,mbs=1,gbs=64"))
    assert "#SBATCH --nodes=1" in rendered.splitlines()


def test_a_2048_node_range_plans_only_the_counts_that_can_start(monkeypatch):
    """`cona run` on 1 to 2,048 nodes: the table lists every count, but only those that can start are planned
    (the policy's choice for that world), and the run's candidates are grouped by world once instead of being
    scanned again for each of the 2,048 counts (0.75 s for this table before, 0.01 s now, on a 2-core machine).
    Counted, not timed: the scans of the candidate list (a time limit fails on a loaded machine)."""
    from cona.orchestrator.planner import enumerate_candidates

    class Scans(list):
        """A candidate list that counts how often it is scanned."""

        scans = 0

        def __iter__(self):
            Scans.scans += 1
            return super().__iter__()

    job = load_job(REPO / "examples" / "gpt3-1.3b.yaml")
    profile = load_profile(REPO / "slurm" / "profiles" / "a100-4x8.yaml", ["nodes=2048", "min_nodes=1"])
    # The run plans every count of the range; the powers of two stand for it here (a few other counts can start
    # too: the scheduler's own candidates are the next test's), with thousands of candidates as a real run has.
    counts = [2**k for k in range(12)]
    candidates = Scans(c for n in counts
                       for c in enumerate_candidates(profile=profile, job=job, num_devices=n * 8, feasible_only=True))  # fmt: skip
    model = RunModel(profile=profile, job=job, candidates=candidates, switch_kind=lambda a, b: SwitchKind.RESUBMIT,
                     switch_overhead_s=lambda kind: 0.0)  # fmt: skip
    planned: list[int] = []
    best_for_world = model.best_for_world

    def planning(devices: int) -> Strategy:
        planned.append(devices)
        return best_for_world(devices)

    monkeypatch.setattr(model, "best_for_world", planning)
    assert model.candidates is candidates
    Scans.scans = 0
    plan = plan_table(model, reason="start", time=0.0)
    # Once to group them by world, and at most once per count that can start (the policy's choice on its world):
    # never once per count of the range.
    assert 0 < Scans.scans <= 1 + 2 * len(counts), f"the candidates were scanned {Scans.scans} times"
    assert len(plan.plans) == 2048 and sorted(plan.by_nodes()) == counts
    assert planned == [n * 8 for n in counts]
    assert plan.strategy_for(2048) == model.initial_strategy()


def test_a_2048_node_range_builds_the_schedulers_candidates_in_seconds(tmp_path):
    """`cona run` on 1 to 2,048 nodes plans every count's world (`device_counts`): about 7 million candidates, a
    few thousand of them feasible. The scheduler builds only those (`enumerate_candidates(feasible_only=True)`):
    1.1 CPU-seconds on a 2-core machine, where building every rejected candidate too took 22 s; 3.7-3.9 s since
    the node counts that no even pipeline split fits plan uneven ones (14,523 feasible candidates, not 5,455). The same
    candidates as filtering the full enumeration, checked on a few worlds (the small ones, one with the odd factor
    3, all 16,384 devices)."""
    import time

    from cona.orchestrator.planner import enumerate_candidates

    job = load_job(REPO / "examples" / "gpt3-1.3b.yaml")
    profile = load_profile(REPO / "slurm" / "profiles" / "a100-4x8.yaml", ["nodes=2048", "min_nodes=1"])
    run_dir = RunDir(tmp_path / "run")
    backend = SlurmBackend(run_dir=run_dir, profile=profile, job=job)
    # CPU time of this process, not wall time: other work on a busy machine must not make the test fail.
    began = time.process_time()
    scheduler = Scheduler(run_dir=run_dir, profile=profile, job=job, backend=backend)
    took = time.process_time() - began
    assert took < 8.0, f"the scheduler's candidates for 2,048 node counts took {took:.2f} CPU-seconds"
    by_world: dict[int, list] = {}
    for c in scheduler.candidates:
        by_world.setdefault(c.strategy.world_size, []).append(c)
    assert {2**k * 8 for k in range(12)} <= set(by_world)  # every power of two of nodes can start, and a few more
    for devices in (8, 16, 24, profile.num_gpus):
        full = enumerate_candidates(profile=profile, job=job, num_devices=devices)
        assert by_world.get(devices, []) == [c for c in full if c.feasible], devices
