"""Online calibration of the cost model by measured step times."""

from __future__ import annotations

import json
import math

import pytest
from cona.orchestrator.costmodel import Prediction
from cona.orchestrator.job import load_job
from cona.orchestrator.planner import Candidate, enumerate_candidates
from cona.orchestrator.profile import load_profile
from cona.orchestrator.throughput import ThroughputModel, fit_affine
from cona.protocol.strategy import Strategy

from tests.conftest import EXAMPLES, PROFILES


def candidate(dp: int, tp: int, pp: int, mbs: int, gbs: int, iter_time_s: float) -> Candidate:
    prediction = Prediction(
        compute_s=iter_time_s, tp_comm_s=0.0, pipeline_bubble_s=0.0, p2p_s=0.0, dp_comm_s=0.0, optimizer_s=0.0,
        memory_bytes=1e9, model_state_bytes=5e8, activation_bytes=5e8,
    )  # fmt: skip
    return Candidate(Strategy(dp=dp, tp=tp, pp=pp, mbs=mbs, gbs=gbs), True, "", prediction)


A16 = candidate(4, 1, 1, 2, 16, 0.10)
A32 = candidate(4, 1, 1, 2, 32, 0.18)
A64 = candidate(4, 1, 1, 2, 64, 0.34)
B32 = candidate(2, 2, 1, 2, 32, 0.25)
C32 = candidate(1, 2, 2, 4, 32, 0.40)
ALL = [A16, A32, A64, B32, C32]


def test_uncalibrated_model_returns_predictions():
    model = ThroughputModel(candidates=ALL)
    assert model.calibration_factor == 1.0
    for c in ALL:
        assert model.estimate(c) == (pytest.approx(c.iter_time_s), "calibrated")
        assert model.samples_per_s(c) == pytest.approx(c.gbs / c.iter_time_s)


def test_measured_strategy_returns_its_median_time():
    model = ThroughputModel(candidates=ALL, window=5)
    model.observe(A32.strategy, 2.0)  # warm-up window: an outlier
    for t in (0.50, 0.52, 0.48, 0.51):
        model.observe(A32.strategy, t)
    assert model.estimate(A32) == (pytest.approx(0.51), "measured")  # the outlier does not drag it up
    assert model.measured_time_s(A32.strategy) == pytest.approx(0.51)
    assert model.num_observations(A32.strategy) == 5
    assert model.samples_per_s(A32) == pytest.approx(32 / 0.51)
    assert model.samples_per_s_of(A32.strategy) == pytest.approx(32 / 0.51)
    # The window follows a real change of speed.
    for _ in range(5):
        model.observe(A32.strategy, 0.30)
    assert model.iter_time_s(A32) == pytest.approx(0.30)


def test_bad_observations_are_ignored():
    model = ThroughputModel(candidates=ALL)
    for t in (0.0, -1.0, math.nan, math.inf):
        model.observe(A32.strategy, t)
    assert model.measured_time_s(A32.strategy) is None
    assert model.iter_time_s(A32) == pytest.approx(A32.iter_time_s)


def test_one_measured_point_puts_the_unexplained_time_into_a_fixed_cost():
    model = ThroughputModel(candidates=ALL)
    model.observe(A32.strategy, 0.36)  # 0.18 over the prediction: a fixed cost until shown otherwise
    assert model.estimate(A64) == (pytest.approx(0.18 + 0.34), "degrees")
    assert model.estimate(A16) == (pytest.approx(0.18 + 0.10), "degrees")
    # Other layouts get the measured layouts' fixed cost and scale.
    assert model.estimate(B32) == (pytest.approx(0.18 + 0.25), "calibrated")
    # Faster than predicted: scaled, no negative fixed cost.
    fast = ThroughputModel(candidates=ALL)
    fast.observe(A32.strategy, 0.09)
    assert fast.estimate(A64) == (pytest.approx(0.34 / 2), "degrees")


def test_two_measured_points_separate_the_fixed_from_the_per_sample_cost():
    """Step times from a synthetic fixed + per-sample cost: two batches of one layout recover both exactly."""
    def truth(c: Candidate) -> float:
        return 0.25 + 3.0 * c.iter_time_s

    model = ThroughputModel(candidates=ALL)
    model.observe(A16.strategy, truth(A16))
    model.observe(A32.strategy, truth(A32))
    fits, _ = model.calibration()
    assert fits[(4, 1, 1)].fixed_s == pytest.approx(0.25) and fits[(4, 1, 1)].scale == pytest.approx(3.0)
    assert model.estimate(A64) == (pytest.approx(truth(A64)), "layout")
    assert model.estimate(B32) == (pytest.approx(truth(B32)), "calibrated")  # the only layout measured: its fit
    # A layout measured once borrows the known scale: the rest of its excess is its own fixed cost.
    model.observe(B32.strategy, 0.40 + 3.0 * B32.iter_time_s)
    b64 = candidate(2, 2, 1, 2, 64, 0.45)
    model.set_candidates([*ALL, b64])
    assert model.estimate(b64) == (pytest.approx(0.40 + 3.0 * 0.45), "degrees")


def test_a_fixed_cost_makes_a_larger_batch_faster_per_sample_after_one_measurement():
    """The local Slurm run of issue 15: g8 measured at 18x its prediction must not keep g8 ranked first."""
    g8, g16, g32 = (candidate(4, 1, 1, 2, g, 0.015 * g / 8) for g in (8, 16, 32))
    model = ThroughputModel(candidates=[g8, g16, g32])
    model.observe(g8.strategy, 0.26)
    assert model.samples_per_s(g16) > 1.8 * model.samples_per_s(g8)
    assert model.samples_per_s(g32) > model.samples_per_s(g16)
    # If the time was in fact per sample (18x everything), the second measurement says so and g8 is back even.
    model.observe(g16.strategy, 0.52)
    assert model.samples_per_s(g32) == pytest.approx(model.samples_per_s(g8), rel=1e-6)


def test_fit_keeps_a_positive_per_sample_cost():
    points = [(0.1, 0.5, 16), (0.2, 0.5, 32), (0.4, 0.49, 64)]  # flat (noise): not "a larger batch is free"
    fit = fit_affine(points, prior_scale=1.0)
    assert fit.determined and fit.scale > 0
    assert fit.time_s(0.8) > fit.time_s(0.4)


def test_global_factor_is_the_geometric_mean_of_measured_over_predicted():
    model = ThroughputModel(candidates=ALL)
    model.observe(A32.strategy, 0.18 * 2)
    model.observe(B32.strategy, 0.25 * 8)
    assert model.calibration_factor == pytest.approx(4.0)


def test_candidate_without_prediction_is_infinitely_slow():
    rejected = Candidate(Strategy(dp=4, tp=1, pp=1, mbs=2, gbs=30), False, "gbs=30 is not a multiple of dp·mbs=8", None)
    model = ThroughputModel(candidates=[*ALL, rejected])
    assert model.iter_time_s(rejected) == math.inf and model.samples_per_s(rejected) == 0.0
    assert model.samples_per_s_of(Strategy(dp=8, tp=1, pp=1, mbs=1, gbs=64)) is None  # unknown strategy


def test_state_survives_a_restart_through_json():
    model = ThroughputModel(candidates=ALL, window=4)
    for t in (0.4, 0.5, 0.45):
        model.observe(A32.strategy, t)
    model.observe(B32.strategy, 0.6)
    restored = ThroughputModel.from_dict(json.loads(json.dumps(model.to_dict())), candidates=ALL)
    for c in ALL:
        assert restored.estimate(c) == model.estimate(c)
    assert restored.num_observations(A32.strategy) == 3
    restored.observe(A32.strategy, 0.3)
    model.observe(A32.strategy, 0.3)
    assert restored.iter_time_s(A32) == model.iter_time_s(A32)


def test_calibrates_real_planner_candidates():
    profile = load_profile(PROFILES / "local-cpu.yaml")
    job = load_job(EXAMPLES / "tiny-gpt.yaml")
    feasible = [c for c in enumerate_candidates(profile=profile, job=job) if c.feasible]
    model = ThroughputModel(candidates=feasible)
    running = feasible[0]
    model.observe(running.strategy, running.iter_time_s * 3)
    for c in feasible:
        t, source = model.estimate(c)
        assert 0 < t < math.inf
        same_degrees = (c.dp, c.tp, c.pp) == (running.dp, running.tp, running.pp)
        expected = "measured" if c is running else "degrees" if same_degrees else "calibrated"
        assert source == expected
