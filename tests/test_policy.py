"""The policies: cona's metric and switch rule, and the static, fixed and schedule baselines."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from cona.orchestrator.costmodel import Prediction
from cona.orchestrator.job import job_from_dict, job_to_dict, load_job
from cona.orchestrator.planner import Candidate, enumerate_candidates, static_choice
from cona.orchestrator.policy import (
    MIN_LR_EFFICIENCY,
    ConaPolicy,
    DecisionContext,
    FixedPolicy,
    LrRule,
    SchedulePolicy,
    StaticPolicy,
    make_policy,
    progress_rate,
)
from cona.orchestrator.profile import load_profile
from cona.orchestrator.throughput import ThroughputModel
from cona.protocol.strategy import Strategy

from tests.conftest import EXAMPLES, PROFILES

# ---------------------------------------------------------------------------------------------------- fixtures

A, B = 0.1, 0.01  # iteration time a + b·gbs: a fixed overhead makes small batches less efficient


def candidate(
    gbs: int, *, dp: int = 4, tp: int = 1, pp: int = 1, mbs: int = 2, slowdown: float = 1.0
) -> Candidate:
    t = (A + B * gbs) * slowdown
    prediction = Prediction(
        compute_s=t, tp_comm_s=0.0, pipeline_bubble_s=0.0, p2p_s=0.0, dp_comm_s=0.0, optimizer_s=0.0,
        memory_bytes=1e9, model_state_bytes=5e8, activation_bytes=5e8,
    )  # fmt: skip
    return Candidate(Strategy(dp=dp, tp=tp, pp=pp, mbs=mbs, gbs=gbs), True, "", prediction)


FAMILY = [candidate(g) for g in (8, 16, 32, 64, 128)]
G = {c.gbs: c for c in FAMILY}
# With X(g) = g/(a + b·g), R(g) = X/(g + B_noise) peaks at g* = √(a·B_noise/b) = √(10·B_noise).
TIE_32_64 = 204.8  # the B_noise at which gbs 32 and 64 have the same R
NOISE_32 = 60  # gbs 32 stays best at this B_noise when its measured time has a fixed cost the model missed






def cona(**overrides) -> ConaPolicy:
    settings = dict(
        prior_noise_scale=100.0, min_gain=0.05, persistence=2, min_dwell_s=10.0, decision_interval_s=5.0,
        horizon_intervals=12.0, blend_evaluations=1,
    )  # fmt: skip
    settings.update(overrides)
    return ConaPolicy(**settings)


def context(
    current: Strategy, *, now: float = 1000.0, since: float = 0.0, noise: float | None = None, stable: bool = True,
    cost: float = 5.0, remaining: float | None = None, samples: int = 0, throughput: ThroughputModel | None = None,
    candidates: list[Candidate] | None = None,
) -> DecisionContext:  # fmt: skip
    candidates = FAMILY if candidates is None else candidates
    return DecisionContext(
        now=now, samples=samples, current=current, candidates=candidates,
        throughput=throughput or ThroughputModel(candidates=candidates), noise_scale=noise, noise_stable=stable,
        switch_cost_s=lambda target: cost, last_switch_time=since, remaining_time_s=remaining,
    )  # fmt: skip


def best_gbs(noise_scale: float, candidates: list[Candidate] = FAMILY) -> int:
    tm = ThroughputModel(candidates=candidates)
    return max(candidates, key=lambda c: progress_rate(c, tm, noise_scale)).gbs


# ---------------------------------------------------------------------------------------------------- the metric


def test_progress_rate_is_throughput_over_batch_plus_noise_scale():
    tm = ThroughputModel(candidates=FAMILY)
    c = G[32]
    assert progress_rate(c, tm, 50.0) == pytest.approx((32 / (A + B * 32)) / (32 + 50.0))
    with pytest.raises(ValueError):
        progress_rate(c, tm, -1.0)


def test_small_noise_favours_small_batches_and_large_noise_large_ones():
    assert best_gbs(1.0) == 8
    assert best_gbs(100.0) == 32
    assert best_gbs(400.0) == 64
    assert best_gbs(5000.0) == 128
    ordered = [best_gbs(b) for b in (1, 10, 30, 100, 300, 1000, 3000, 10000)]
    assert ordered == sorted(ordered)  # the best batch grows with the noise scale


def test_throughput_matters():
    fast, slow = candidate(32), candidate(32, dp=2, tp=2, slowdown=1.5)
    tm = ThroughputModel(candidates=[fast, slow])
    assert progress_rate(fast, tm, 100.0) > progress_rate(slow, tm, 100.0)
    # Measurements override the cost model: the "fast" one turns out slow on this machine.
    tm.observe(fast.strategy, 3 * fast.iter_time_s)
    tm.observe(slow.strategy, slow.iter_time_s)
    assert progress_rate(fast, tm, 100.0) < progress_rate(slow, tm, 100.0)
    # A slow layout loses even at its best batch size: X counts, not only gbs.
    family = [*FAMILY, candidate(32, dp=2, tp=2, slowdown=1.2)]
    assert cona()._ranked(family, ThroughputModel(candidates=family), 100.0, None)[0][1] is G[32]


def test_lr_efficiency_follows_the_quadratic_model():
    sqrt = LrRule(base_gbs=32, rule="sqrt", cap=2.0)
    for noise in (0.0, 10.0, 1e3, 1e6):
        assert sqrt.efficiency(32, noise) == pytest.approx(1.0)  # optimizer.lr is the best LR at base_gbs
    # Noise-free, the best LR does not depend on the batch: a sqrt rule's 2× at 4·base_gbs is twice too large.
    assert sqrt.efficiency(128, 0.0) == pytest.approx(MIN_LR_EFFICIENCY)
    # Noise-dominated, the best LR grows linearly with the batch: 2× at 4·base_gbs is half of it (2r − r² = 0.75).
    assert sqrt.efficiency(128, 1e9) == pytest.approx(0.75, rel=1e-6)
    # Below base_gbs the same rule over-steps: r = 0.5·(1 + B/8)/(1 + B/32) → 2 as B → ∞.
    assert sqrt.efficiency(8, 1e9) == pytest.approx(MIN_LR_EFFICIENCY)
    linear = LrRule(base_gbs=32, rule="linear", cap=100.0)
    assert linear.efficiency(128, 1e9) == pytest.approx(1.0, rel=1e-6)  # linear scaling is right when noise dominates
    for gbs in (8, 16, 64, 128):
        for noise in (1.0, 100.0, 1e4):
            assert MIN_LR_EFFICIENCY <= sqrt.efficiency(gbs, noise) < 1.0


def test_lr_aware_ranking_prefers_the_batches_the_lr_rule_serves():
    tm = ThroughputModel(candidates=FAMILY)
    rule = LrRule(base_gbs=32, rule="sqrt", cap=2.0)
    plain = max(FAMILY, key=lambda c: progress_rate(c, tm, 5000.0))
    aware = max(FAMILY, key=lambda c: progress_rate(c, tm, 5000.0, lr_rule=rule))
    assert plain.gbs == 128 and aware.gbs == 64  # 128 would get half the LR a noise-dominated step wants
    assert progress_rate(G[32], tm, 5000.0, lr_rule=rule) == pytest.approx(progress_rate(G[32], tm, 5000.0))


def test_cold_start_picks_the_best_rate_under_the_prior():
    tm = ThroughputModel(candidates=FAMILY)
    assert cona(prior_noise_scale=100.0).initial(candidates=FAMILY, throughput=tm, samples=0).gbs == 32
    assert cona(prior_noise_scale=2000.0).initial(candidates=FAMILY, throughput=tm, samples=0).gbs == 128
    assert cona(prior_noise_scale=0.5).initial(candidates=FAMILY, throughput=tm, samples=0).gbs == 8


def test_without_a_prior_cona_starts_at_the_base_batch_and_holds_it_until_the_noise_is_measured():
    tm = ThroughputModel(candidates=FAMILY)
    slow_layout = candidate(32, dp=2, tp=2, slowdown=1.5)
    family = [*FAMILY, slow_layout]
    # Under a prior of 50, R(g) peaks at √(10·50) ≈ 22: gbs 16 ranks first, but only 0.4% ahead of the base batch
    # 32, within δ, so cona starts where the user's LR was tuned, on the fastest layout there.
    assert cona(prior_noise_scale=50.0).initial(candidates=family, throughput=tm, samples=0).gbs == 16
    policy = cona(prior_noise_scale=50.0, start_batch=32)
    assert policy.initial(candidates=family, throughput=tm, samples=0) == G[32].strategy
    # A batch ahead of the base batch by more than δ under the prior is where it starts (R(16)/R(32) = 1.077 at 32).
    assert cona(prior_noise_scale=32.0, start_batch=32).initial(candidates=family, throughput=tm, samples=0).gbs == 16
    # No estimate yet: a clearly better batch is not taken, a faster layout at the same batch is.
    for now in (1000.0, 1005.0, 1010.0):
        d = policy.decide(context(slow_layout.strategy, noise=None, now=now, throughput=tm, candidates=family))
        assert d.metrics["batch_held"] and "batch held" in d.reason
        if d.switch_to is not None:
            break
    assert d.switch_to == G[32].strategy
    held = cona(prior_noise_scale=1e5, start_batch=32)
    for now in (1000.0, 1005.0, 1010.0):
        assert held.decide(context(G[32].strategy, noise=None, now=now, throughput=tm)).switch_to is None
    # Once the estimate is in, every batch competes again.
    d1 = held.decide(context(G[32].strategy, noise=1600.0, now=1015.0, throughput=tm))
    d2 = held.decide(context(G[32].strategy, noise=1600.0, now=1020.0, throughput=tm))
    assert not d1.metrics["batch_held"] and d2.switch_to == G[128].strategy
    # A base batch no candidate has (e.g. outside the planner's range) falls back to the ranking under the prior.
    assert cona(prior_noise_scale=100.0, start_batch=24).initial(candidates=FAMILY, throughput=tm, samples=0).gbs == 32


def test_the_start_batch_is_held_through_the_blend_of_the_prior_with_the_first_estimates():
    """The first estimates of a run are its smallest (the noise scale grows as the loss falls): blended into the
    prior they would move the batch down for a few evaluations, and the full estimate back up (a loaded demo did,
    and the local Slurm run). The batch is held until the estimate is fully in; then every batch competes."""
    tm = ThroughputModel(candidates=FAMILY)
    policy = cona(prior_noise_scale=1600.0, start_batch=32, blend_evaluations=3, persistence=1, min_dwell_s=0.0)
    small = 2.0  # B_noise 2: R ranks gbs 8 first by far
    decisions = [policy.decide(context(G[32].strategy, noise=small, now=1000.0 + 5 * i, throughput=tm)) for i in range(3)]
    assert [d.metrics["noise_source"] for d in decisions] == ["blend", "blend", "estimate"]
    assert [d.metrics["batch_held"] for d in decisions] == [True, True, False]
    assert [d.switch_to for d in decisions[:2]] == [None, None]
    assert decisions[2].switch_to is not None and decisions[2].switch_to.gbs == 8
    # An explicit prior ranks every batch, blend included, from the start.
    free = cona(prior_noise_scale=1600.0, blend_evaluations=3, persistence=1, min_dwell_s=0.0)
    first = free.decide(context(G[32].strategy, noise=small, now=1000.0, throughput=tm))
    assert not first.metrics["batch_held"] and first.metrics["noise_source"] == "blend"


# ---------------------------------------------------------------------------------------------------- switch rule


def test_clear_gain_switches_after_persistence():
    policy = cona(persistence=2)
    tm = ThroughputModel(candidates=FAMILY)
    first = policy.decide(context(G[8].strategy, noise=1600.0, throughput=tm))
    assert first.switch_to is None and "won 1/2" in first.reason
    second = policy.decide(context(G[8].strategy, noise=1600.0, throughput=tm, now=1005.0))
    assert second.switch_to == G[128].strategy
    assert second.reason.startswith("switch d4t1p1 m2 g8 → d4t1p1 m2 g128")
    m = second.metrics
    assert m["ratio"] >= m["threshold"] == pytest.approx(1.05 * 60 / 55)
    assert m["best"] == G[128].strategy.to_dict() and m["wins"] == 2 and m["B_noise"] == 1600.0
    json.dumps(m)  # events.jsonl material


@pytest.mark.parametrize(("cost", "switches"), [(2.0, True), (20.0, False)])
def test_gain_must_outweigh_the_switch_cost(cost, switches):
    # B_noise 1600: R(128)/R(32) ≈ 1.15, above δ = 5%; the threshold is 1.05·H/(H − C) with H = 60 s.
    policy = cona()
    decisions = [
        policy.decide(context(G[32].strategy, noise=1600.0, cost=cost, now=1000.0 + 5 * i)) for i in range(6)
    ]
    switched = [d for d in decisions if d.switch_to is not None]
    assert bool(switched) == switches
    if not switches:
        assert all("threshold" in d.reason for d in decisions)
        assert decisions[-1].metrics["ratio"] == pytest.approx(1.15, abs=0.01)


def test_small_gain_below_min_gain_never_switches():
    policy = cona(min_gain=0.05)
    for i in range(10):  # R(128)/R(64) ≈ 1.03 at B_noise 1600, even with a free switch
        d = policy.decide(context(G[64].strategy, noise=1600.0, cost=0.0, now=1000.0 + 5 * i))
        assert d.switch_to is None
    assert d.metrics["ratio"] == pytest.approx(1.033, abs=0.005)


@pytest.mark.parametrize(
    ("remaining", "cost", "horizon_intervals"),
    [(4.0, 5.0, 12.0), (None, 60.0, 12.0), (None, 20.0, 3.0), (0.0, 0.0, 12.0)],
)
def test_no_switch_when_the_cost_exceeds_the_horizon(remaining, cost, horizon_intervals):
    policy = cona(horizon_intervals=horizon_intervals)
    for i in range(5):  # a huge gain (B_noise 10⁵ makes gbs 128 ≈ 2× better than gbs 8)
        d = policy.decide(
            context(G[8].strategy, noise=1e5, cost=cost, remaining=remaining, now=1000.0 + 5 * i)
        )
        assert d.switch_to is None and "horizon" in d.reason
        assert d.metrics["threshold"] is None and d.metrics["ratio"] > 2


def test_short_remaining_time_raises_the_threshold():
    policy = cona()
    d = policy.decide(context(G[32].strategy, noise=1600.0, cost=2.0, remaining=10.0))
    assert d.metrics["H_s"] == 10.0 and d.metrics["threshold"] == pytest.approx(1.05 * 10 / 8)
    assert d.switch_to is None


def test_dwell_time_is_respected_and_wins_keep_counting():
    policy = cona(min_dwell_s=30.0, persistence=2)
    decisions = [
        policy.decide(context(G[8].strategy, noise=1600.0, since=1000.0, now=1000.0 + 5 * i))
        for i in range(6)
    ]
    assert [d.switch_to for d in decisions] == [None] * 6  # dwell 0..25 s < 30 s
    assert "dwell" in decisions[-1].reason and decisions[-1].metrics["wins"] == 6
    d = policy.decide(context(G[8].strategy, noise=1600.0, since=1000.0, now=1030.0))
    assert d.switch_to == G[128].strategy  # the moment dwell passes


def test_persistence_counts_consecutive_wins_only():
    policy = cona(persistence=3)
    noises = [1600.0, 1600.0, 10.0, 1600.0, 1600.0, 1600.0]  # the third evaluation interrupts the streak
    outcomes = [
        policy.decide(context(G[8].strategy, noise=n, now=1000.0 + 5 * i)).switch_to
        for i, n in enumerate(noises)
    ]
    assert outcomes[:5] == [None] * 5
    assert outcomes[5] == G[128].strategy


def test_equivalent_winners_do_not_reset_each_others_wins():
    # Two near-identical strategies at gbs 128 alternate at the top (measurement noise); each is an equivalent
    # winner, so the switch happens after `persistence` evaluations anyway.
    twin = candidate(128, dp=2, tp=2)
    candidates = [*FAMILY, twin]
    tm = ThroughputModel(candidates=candidates, window=1)
    policy = cona(persistence=2)
    outcomes = []
    for i in range(2):
        faster, slower = (G[128], twin) if i % 2 else (twin, G[128])
        tm.observe(faster.strategy, 1.38 * 0.99)
        tm.observe(slower.strategy, 1.38 * 1.01)
        outcomes.append(
            policy.decide(context(G[8].strategy, noise=1600.0, throughput=tm, now=1000.0 + 5 * i))
        )
    assert outcomes[0].switch_to is None
    assert outcomes[1].switch_to in (G[128].strategy, twin.strategy)


def simulate(policy: ConaPolicy, *, evaluations: int, noise_of, start: Candidate, seed: int, cost: float = 5.0,
             throughput_noise: float = 0.1, noise_noise: float = 0.3,
             candidates: list[Candidate] = FAMILY) -> list[tuple[int, Strategy]]:  # fmt: skip
    """A scheduler loop in miniature: each evaluation observes the running strategy's step time (±10 %) and
    gets a B_noise estimate that wobbles ±30 % independently (rougher than a real EMA); switches take effect at
    once. Returns the (evaluation, strategy) switches."""
    rng = np.random.default_rng(seed)
    tm = ThroughputModel(candidates=candidates)
    current, since, switches = start.strategy, 0.0, []
    by_strategy = {c.strategy: c for c in candidates}
    for i in range(evaluations):
        now = 5.0 * i
        tm.observe(current, by_strategy[current].iter_time_s * math.exp(rng.normal(0, throughput_noise)))
        noise = noise_of(i) * math.exp(rng.normal(0, noise_noise))
        d = policy.decide(context(current, noise=noise, cost=cost, throughput=tm, now=now, since=since,
                                  candidates=candidates))  # fmt: skip
        if d.switch_to is not None:
            switches.append((i, d.switch_to))
            current, since = d.switch_to, now
    return switches


def test_no_flapping_on_noisy_inputs_around_a_tie():
    # gbs 32 and 64 tie at B_noise 204.8; the estimate wobbles ±30 % and step times ±10 % around it.
    pair = [G[32], G[64]]
    switches = simulate(cona(persistence=2), evaluations=400, noise_of=lambda i: TIE_32_64, start=G[32], seed=0,
                        candidates=pair)  # fmt: skip
    assert len(switches) <= 1
    # The same inputs make a naive argmax policy (no margin, no persistence, free switches) flap again and again
    # (13 times with these inputs and seed).
    naive = cona(min_gain=0.0, persistence=1, min_dwell_s=0.0)
    flaps = simulate(naive, evaluations=400, noise_of=lambda i: TIE_32_64, start=G[32], seed=0, cost=0.0,
                     candidates=pair)  # fmt: skip
    assert len(flaps) >= 10


def test_chains_to_larger_batches_as_the_noise_scale_grows():
    # B_noise grows 100× over the run: the chain goes up in gbs a few times and never back down. (Window-mean
    # step times ±5 %, an EMA estimate ±15 %: with the rougher inputs of the tie test a near-tie right after a
    # switch can, rarely, send it one step back.)
    switches = simulate(cona(), evaluations=300, noise_of=lambda i: 10.0 * 100 ** (i / 300), start=G[8], seed=1,
                        throughput_noise=0.05, noise_noise=0.15)  # fmt: skip
    sizes = [s.gbs for _, s in switches]
    assert 2 <= len(sizes) <= 5
    assert sizes == sorted(sizes) and sizes[-1] >= 32  # at the end 64 beats 32 by 10 %: below the threshold


def test_noise_scale_blends_from_prior_to_estimate():
    policy = cona(prior_noise_scale=100.0, blend_evaluations=3)
    used = []
    for i, (noise, stable) in enumerate([(1e4, False), (1e4, True), (1e4, True), (1e4, False), (1e4, True),
                                         (1e4, True), (None, True)]):  # fmt: skip
        d = policy.decide(context(G[32].strategy, noise=noise, stable=stable, now=1000.0 + 5 * i))
        used.append(d.metrics["B_noise"])
    assert used[0] == 100.0  # unstable: the prior
    assert used[1] == pytest.approx(100.0 ** (2 / 3) * 1e4 ** (1 / 3))
    assert used[2] == pytest.approx(100.0 ** (1 / 3) * 1e4 ** (2 / 3))
    assert used[3] == used[2]  # an unsettled estimate does not move the weight back
    assert used[4] == pytest.approx(1e4) and used[5] == pytest.approx(1e4)
    # The estimate undefined once trusted (the |G|² average ≤ 0: noise dominates): its last value, not the prior.
    assert used[6] == pytest.approx(1e4)


def test_current_strategy_outside_the_candidates_switches_at_once():
    stray = Strategy(dp=8, tp=1, pp=1, mbs=1, gbs=64)
    d = cona().decide(context(stray, noise=None, since=999.0))
    assert d.switch_to == G[32].strategy and "not a feasible candidate" in d.reason


def test_wins_survive_an_orchestrator_restart():
    policy = cona(persistence=2)
    assert policy.decide(context(G[8].strategy, noise=1600.0)).switch_to is None
    saved = json.loads(json.dumps(policy.to_dict()))
    restored = cona(persistence=2).from_dict(saved)
    assert restored.decide(context(G[8].strategy, noise=1600.0, now=1005.0)).switch_to == G[128].strategy
    with pytest.raises(ValueError, match="static"):
        cona().from_dict({"name": "static"})


# ---------------------------------------------------------------------------------------------------- baselines


@pytest.fixture(scope="module")
def setup():
    profile = load_profile(PROFILES / "local-cpu.yaml")
    job = load_job(EXAMPLES / "tiny-gpt.yaml")
    candidates = [c for c in enumerate_candidates(profile=profile, job=job) if c.feasible]
    return profile, job, candidates


def with_policy(job, **policy):
    data = job_to_dict(job)
    data["policy"].update(policy)
    return job_from_dict(data)


def test_make_policy_cona_uses_the_job_settings(setup):
    profile, job, candidates = setup
    policy = make_policy(job, profile=profile, candidates=candidates)
    assert isinstance(policy, ConaPolicy)
    expected_prior = job.policy.prior_noise_scale or job.policy.critical_batch_factor * job.batch.base_gbs
    assert policy.prior_noise_scale == expected_prior and policy.persistence == job.policy.persistence
    unset = make_policy(with_policy(job, prior_noise_scale=None), profile=profile, candidates=candidates)
    # The documented default: the base batch, taken as the estimator's value, through the critical-batch factor.
    assert unset.prior_noise_scale == job.policy.critical_batch_factor * job.batch.base_gbs
    assert unset.start_batch == job.batch.base_gbs  # no prior given: start at the base batch and hold it
    pinned = make_policy(with_policy(job, prior_noise_scale=77.0), profile=profile, candidates=candidates)
    assert pinned.prior_noise_scale == 77.0 and pinned.start_batch is None
    tm = ThroughputModel(candidates=candidates)
    first = policy.initial(candidates=candidates, throughput=tm, samples=0)
    assert first in [c.strategy for c in candidates]
    assert policy.lr_rule is None  # policy.lr_aware is off by default
    aware = make_policy(with_policy(job, lr_aware=True), profile=profile, candidates=candidates)
    assert aware.lr_rule == LrRule(base_gbs=job.batch.base_gbs, rule=job.optimizer.lr_scaling, cap=job.optimizer.lr_scaling_cap)


def test_static_is_the_planners_choice_and_never_switches(setup):
    profile, job, candidates = setup
    policy = make_policy(with_policy(job, name="static"), profile=profile, candidates=candidates)
    assert isinstance(policy, StaticPolicy)
    expected = static_choice(profile=profile, job=job).strategy
    tm = ThroughputModel(candidates=candidates)
    assert policy.initial(candidates=candidates, throughput=tm, samples=0) == expected
    assert expected.gbs == job.batch.base_gbs
    for noise in (None, 1.0, 1e6):
        ctx = context(expected, noise=noise, cost=0.0, throughput=tm, candidates=candidates)
        assert policy.decide(ctx).switch_to is None


def test_fixed_keeps_its_strategy(setup):
    profile, job, candidates = setup
    chosen = candidates[len(candidates) // 2].strategy
    policy = make_policy(
        with_policy(job, name="fixed", strategy=str(chosen)), profile=profile, candidates=candidates
    )
    assert isinstance(policy, FixedPolicy)
    tm = ThroughputModel(candidates=candidates)
    assert policy.initial(candidates=candidates, throughput=tm, samples=0) == chosen
    d = policy.decide(context(chosen, noise=1e6, cost=0.0, throughput=tm, candidates=candidates))
    assert d.switch_to is None and "fixed" in d.reason


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "dp=1,tp=3,pp=1,mbs=2,gbs=16",
            "policy.strategy dp=1,tp=3,pp=1,mbs=2,gbs=16: tp=3 does not divide model.num_heads=4",
        ),
        ("dp=2,tp=1,pp=1,mbs=2,gbs=16", "dp·tp·pp=2 but the profile's one node has 4 devices and a strategy uses "
                                        "them all; choose dp, tp and pp whose product is 4"),
        ("dp=4,tp=1,pp=1,mbs=2,gbs=4096", "gbs=4096 outside batch bounds"),
        (
            "dp=4,tp=1,pp=1,mbs=3,gbs=16",
            "policy.strategy dp=4,tp=1,pp=1,mbs=3,gbs=16: gbs=16 is not a multiple of dp·mbs=12",
        ),
        ("dp=4,tq=1,mbs=2,gbs=16", "unknown field 'tq'"),
    ],
)
def test_bad_fixed_strategy_is_a_one_line_error(setup, text, message):
    profile, job, candidates = setup
    with pytest.raises(ValueError) as info:
        make_policy(with_policy(job, name="fixed", strategy=text), profile=profile, candidates=candidates)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_fixed_accepts_1f1b_with_fewer_micro_batches_than_stages(setup):
    # 2 micro-batches over 4 stages: a larger bubble (the cost model's), not a reason to refuse the strategy.
    profile, job, candidates = setup
    text = "dp=1,tp=1,pp=4,mbs=8,gbs=16"
    policy = make_policy(with_policy(job, name="fixed", strategy=text), profile=profile, candidates=candidates)
    assert str(policy.initial(candidates=candidates, throughput=ThroughputModel(candidates=candidates), samples=0)) == text


def test_schedule_follows_its_entries(setup):
    profile, job, candidates = setup
    s1, s2, s3 = (candidates[i].strategy for i in (0, len(candidates) // 2, -1))
    schedule = [{"samples": 0, "strategy": str(s1)}, {"samples": 1000, "strategy": str(s2)},
                {"samples": 5000, "strategy": str(s3)}]  # fmt: skip
    policy = make_policy(
        with_policy(job, name="schedule", schedule=schedule), profile=profile, candidates=candidates
    )
    assert isinstance(policy, SchedulePolicy)
    tm = ThroughputModel(candidates=candidates)
    assert policy.initial(candidates=candidates, throughput=tm, samples=0) == s1
    assert policy.initial(candidates=candidates, throughput=tm, samples=1200) == s2  # a restart mid-run

    def decide(current, samples):
        return policy.decide(context(current, samples=samples, throughput=tm, candidates=candidates))

    assert decide(s1, 999).switch_to is None
    d = decide(s1, 1000)
    assert d.switch_to == s2 and "1000" in d.reason
    assert decide(s2, 4000).switch_to is None
    assert decide(s1, 6000).switch_to == s3  # two thresholds passed at once: straight to the latest
    assert decide(s3, 10**6).switch_to is None


def test_bad_schedule_entry_is_named(setup):
    profile, job, candidates = setup
    good = str(candidates[0].strategy)
    schedule = [{"samples": 0, "strategy": good}, {"samples": 100, "strategy": "dp=1,tp=3,pp=1,mbs=2,gbs=16"}]
    with pytest.raises(ValueError, match=r"policy.schedule\[1\] \(samples=100\) .*tp=3 does not divide"):
        make_policy(
            with_policy(job, name="schedule", schedule=schedule), profile=profile, candidates=candidates
        )


def test_each_candidate_is_charged_its_own_switch_cost():
    # Two equivalent winners at B_noise 1600 (R(128)/R(32) ≈ 1.15, R(64)/R(32) ≈ 1.12): the better one is
    # only reachable by a dear switch (a relaunch, 20 s against H = 60 s), the other by a cheap one (in place).
    policy = cona(min_gain=0.05)
    dear = {G[128].strategy: 20.0}

    def cost(target: Strategy) -> float:
        return dear.get(target, 1.0)

    decisions = []
    for i in range(4):
        ctx = context(G[32].strategy, noise=1600.0, now=1000.0 + 5 * i)
        ctx.switch_cost_s = cost
        decisions.append(policy.decide(ctx))
    switched = [d for d in decisions if d.switch_to is not None]
    assert switched and switched[0].switch_to == G[64].strategy, [d.reason for d in decisions]
    assert switched[0].metrics["switch_cost_target_s"] == 1.0
    assert switched[0].metrics["threshold_target"] == pytest.approx(1.05 * 60 / 59)
    assert "C_sw=1s" in switched[0].reason


# ---------------------------------------------------------------------------------------------------- probing


def test_probe_finds_a_layout_the_cost_model_ranks_too_low():
    # The cost model says pp=2 is 1.5× slower at gbs 32; on this machine it is 2× faster.
    fast_here = candidate(32, dp=2, pp=2, slowdown=1.5)
    family = [*FAMILY, fast_here]
    tm = ThroughputModel(candidates=family)
    cur = G[32].strategy
    tm.observe(cur, G[32].iter_time_s)
    # A cost model that predicted every measured step exactly has earned trust: nothing is probed.
    trusted = cona(probe_layouts=1, horizon_intervals=24.0)
    assert trusted.decide(context(cur, now=20.0, noise=NOISE_32, throughput=tm, candidates=family, cost=1.0,
                                  remaining=1e6)).switch_to is None  # fmt: skip
    tm = ThroughputModel(candidates=family)
    tm.observe(cur, 1.3 * G[32].iter_time_s)  # this machine is 30% slower than the model says
    policy = cona(probe_layouts=1, horizon_intervals=24.0)
    # Before the dwell: no probe.
    assert policy.decide(context(cur, now=5.0, since=0.0, noise=NOISE_32, throughput=tm, candidates=family,
                                 cost=1.0, remaining=1e6)).switch_to is None  # fmt: skip
    d = policy.decide(context(cur, now=20.0, since=0.0, noise=NOISE_32, throughput=tm, candidates=family, cost=1.0,
                              remaining=1e6))  # fmt: skip
    assert d.switch_to == fast_here.strategy and d.metrics["probe"] and d.reason.startswith("probe ")
    # While it is measured, the policy stays; then the rule sees the measurement and keeps the faster layout.
    tm.observe(fast_here.strategy, 1.3 * G[32].iter_time_s / 2)
    d = policy.decide(context(fast_here.strategy, now=25.0, since=21.0, noise=NOISE_32, throughput=tm,
                              candidates=family, cost=1.0, remaining=1e6))  # fmt: skip
    assert d.switch_to is None and "probing" in d.reason
    for _ in range(2):
        tm.observe(fast_here.strategy, 1.3 * G[32].iter_time_s / 2)
    d = policy.decide(context(fast_here.strategy, now=30.0, since=21.0, noise=NOISE_32, throughput=tm,
                              candidates=family, cost=1.0, remaining=1e6))  # fmt: skip
    assert d.switch_to is None and not d.reason.startswith("probe")
    # One probe per allowance: no second probe of anything.
    d = policy.decide(context(fast_here.strategy, now=100.0, since=21.0, noise=NOISE_32, throughput=tm,
                              candidates=family, cost=1.0, remaining=1e6))  # fmt: skip
    assert d.switch_to is None


def test_a_slower_probe_is_left_at_once_and_dear_switches_are_not_probed():
    slow_here = candidate(32, dp=2, pp=2, slowdown=1.2)
    family = [*FAMILY, slow_here]
    tm = ThroughputModel(candidates=family)
    cur = G[32].strategy
    tm.observe(cur, 1.3 * G[32].iter_time_s)
    # A switch of 1 s against H = 60 s (12 intervals of 5 s): 2 s ≤ 3% of 60 s fails; of H = 120 s passes.
    assert cona(probe_layouts=1).decide(context(cur, now=20.0, noise=NOISE_32, throughput=tm, candidates=family,
                                                cost=1.0, remaining=1e6)).switch_to is None  # fmt: skip
    policy = cona(probe_layouts=1, horizon_intervals=24.0)
    d = policy.decide(context(cur, now=20.0, noise=NOISE_32, throughput=tm, candidates=family, cost=1.0,
                              remaining=1e6))  # fmt: skip
    assert d.switch_to == slow_here.strategy
    for _ in range(3):
        tm.observe(slow_here.strategy, 2.6 * G[32].iter_time_s)  # twice slower than where it came from
    d = policy.decide(context(slow_here.strategy, now=26.0, since=21.0, noise=NOISE_32, throughput=tm,
                              candidates=family, cost=1.0, remaining=1e6))  # fmt: skip
    # Back without dwell or persistence (the best candidate at this noise scale is gbs 32 or 64 on the old layout).
    assert d.switch_to is not None and d.switch_to.layout() == cur.layout()
    saved = json.loads(json.dumps(policy.to_dict()))
    again = cona(probe_layouts=1, horizon_intervals=24.0).from_dict(saved)
    assert again._probes_used == 1 and again._probing is None


# ---------------------------------------------------------------------------------------------------- growth


def test_noise_growth_ranks_with_the_noise_scale_expected_over_the_horizon():
    policy = cona(noise_growth=True, min_dwell_s=0.0)
    tm = ThroughputModel(candidates=FAMILY)
    cur = G[32].strategy
    # A noise scale that doubles every 10,000 samples, seen at ten evaluations.
    for i in range(10):
        policy.decide(context(cur, now=10.0 * i, samples=1000 * i, noise=100.0 * 2 ** (i / 10), throughput=tm,
                              remaining=1e6))  # fmt: skip
    assert policy.growth_per_sample() == pytest.approx(math.log(2) / 10_000, rel=1e-6)
    d = policy.decide(context(cur, now=100.0, samples=10_000, noise=200.0, throughput=tm, remaining=1e6))
    assert d.metrics["B_noise_now"] == pytest.approx(200.0)
    advance = tm.samples_per_s(G[32]) * policy.horizon_s(1e6)
    assert d.metrics["B_noise"] == pytest.approx(min(2.0, 2 ** (advance / 20_000)) * 200.0)
    assert d.metrics["B_noise"] > d.metrics["B_noise_now"]
    # A shrinking estimate is not extrapolated; off, today's value is used.
    shrinking = cona(noise_growth=True)
    for i in range(10):
        shrinking.decide(context(cur, now=10.0 * i, samples=1000 * i, noise=100.0 / (1 + i), throughput=tm))
    assert shrinking.growth_per_sample() == 0.0
    off = cona()
    d = off.decide(context(cur, now=100.0, samples=10_000, noise=200.0, throughput=tm, remaining=1e6))
    assert d.metrics["B_noise"] == pytest.approx(200.0)


def test_noise_monotone_ranks_a_dip_at_the_largest_trusted_estimate_and_survives_a_restart():
    tm = ThroughputModel(candidates=FAMILY)
    cur = G[32].strategy
    policy = cona(noise_monotone=True)
    for i, noise in enumerate([100.0, 400.0, 150.0]):  # the last evaluation dips below the one before
        d = policy.decide(context(cur, now=10.0 * i, samples=1000 * i, noise=noise, throughput=tm, remaining=1e6))
    assert d.metrics["B_noise"] == d.metrics["B_noise_peak"] == pytest.approx(400.0)
    assert d.metrics["B_noise_estimate"] == pytest.approx(150.0)
    restored = cona(noise_monotone=True).from_dict(json.loads(json.dumps(policy.to_dict())))
    d = restored.decide(context(cur, now=30.0, samples=3000, noise=90.0, throughput=tm, remaining=1e6))
    assert d.metrics["B_noise"] == pytest.approx(400.0)
    d = restored.decide(context(cur, now=40.0, samples=4000, noise=500.0, throughput=tm, remaining=1e6))
    assert d.metrics["B_noise"] == pytest.approx(500.0)  # a rise is taken at once
    off = cona()
    for i, noise in enumerate([100.0, 400.0, 150.0]):
        d = off.decide(context(cur, now=10.0 * i, samples=1000 * i, noise=noise, throughput=tm, remaining=1e6))
    assert d.metrics["B_noise"] == pytest.approx(150.0)


def test_the_start_says_why():
    """The launch line says why the run starts where it does: the base batch, or another batch and by how much."""
    tm = ThroughputModel(candidates=FAMILY)
    held = cona(prior_noise_scale=50.0, start_batch=32)
    assert held.start(candidates=FAMILY, throughput=tm)[1] == "the base batch g32's fastest layout (the prior B_noise=50)"
    moved = cona(prior_noise_scale=32.0, start_batch=32)
    assert moved.initial(candidates=FAMILY, throughput=tm, samples=0).gbs == 16
    assert moved.start(candidates=FAMILY, throughput=tm)[1] == (
        "R 1.077× the base batch g32's under the prior B_noise=32, above the margin 1.05×"
    )
    assert cona(prior_noise_scale=32.0).start(candidates=FAMILY, throughput=tm)[1] == "best R under the prior B_noise=32"


def test_cona_never_ranks_a_layout_that_measures_no_noise_scale_while_another_runs():
    """On one device the fastest layout at a batch is the whole batch as one micro-batch (m8 g8), whose steps have
    no smaller batch to measure the noise scale from: a run there stayed on the prior for 15,000 samples and never
    changed its batch. cona ranks only layouts that measure it while any runs."""
    profile = load_profile(PROFILES / "local-cpu.yaml", ["gpus_per_node=1"])
    job = load_job(EXAMPLES / "tiny-gpt.yaml")
    candidates = enumerate_candidates(profile=profile, job=job, feasible_only=True)
    blind = [c for c in candidates if not c.strategy.measures_noise]
    assert blind and all(c.dp == 1 and c.mbs == c.gbs for c in blind)
    policy = ConaPolicy.from_spec(job.policy, base_gbs=job.batch.base_gbs)
    throughput = ThroughputModel(candidates=candidates)
    start = policy.initial(candidates=candidates, throughput=throughput, samples=0)
    assert start.measures_noise and start.num_microbatches > 1, start
    for noise in (1.0, 80.0, 1e4):
        assert policy.best(candidates, throughput, noise).measures_noise
    # Nothing else runs (a job whose micro-batch is its only batch): the layout is ranked after all.
    only = [c for c in candidates if c.gbs == 8 and c.mbs == 8]
    assert policy.best(only, ThroughputModel(candidates=only), 80.0) == only[0].strategy
    # The trainer measures by the same rule (`trainer.gradstats` asks `measures_noise` too).
    assert not Strategy.parse("dp=1,tp=1,pp=1,mbs=8,gbs=8").measures_noise
    assert Strategy.parse("dp=1,tp=1,pp=1,mbs=4,gbs=8").measures_noise
    assert Strategy.parse("dp=2,tp=1,pp=1,mbs=4,gbs=8").measures_noise
