"""Edge cases of the throughput model's calibration and of `cona profile`'s records: synthetic step times with a
known fixed and per-sample cost, and step times no measurement can have (infinite, NaN, zero, negative)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cona.orchestrator import profiling
from cona.orchestrator.job import load_job
from cona.orchestrator.planner import Candidate, enumerate_candidates
from cona.orchestrator.profile import load_profile
from cona.orchestrator.throughput import ThroughputModel, checked_measurement
from cona.protocol.yamlconfig import ConfigError

from tests.conftest import REPO

FIXED_S, SCALE = 0.3, 2.0
"""The synthetic machine: every step costs FIXED_S plus SCALE times the cost model's prediction."""


@pytest.fixture(scope="module")
def candidates() -> list[Candidate]:
    profile = load_profile(REPO / "slurm" / "profiles" / "local-cpu.yaml")
    job = load_job(REPO / "examples" / "tiny-gpt.yaml")
    return enumerate_candidates(profile=profile, job=job, num_devices=profile.num_gpus, feasible_only=True)


def synthetic(c: Candidate) -> float:
    return FIXED_S + SCALE * c.iter_time_s


def test_one_layout_at_several_batches_recovers_the_fixed_cost_and_scale(candidates):
    layout = candidates[0].strategy.layout()
    model = ThroughputModel(candidates=candidates)
    for c in [c for c in candidates if c.strategy.layout() == layout][:4]:
        model.observe(c.strategy, synthetic(c))
    fit = model.calibration()[0][layout]
    assert fit.determined and fit.fixed_s == pytest.approx(FIXED_S) and fit.scale == pytest.approx(SCALE)
    # and every other strategy of that layout is then predicted as the machine would run it
    for c in candidates:
        if c.strategy.layout() == layout:
            assert model.iter_time_s(c) == pytest.approx(synthetic(c))


def test_one_measured_point_per_layout_is_not_a_determined_fit(candidates):
    # All at one global batch and micro-batch: one (predicted, measured) point per layout cannot split F from k.
    chosen = {}
    for c in candidates:
        if c.gbs == 16 and c.mbs == 4:
            chosen.setdefault(c.strategy.layout(), c)
    model = ThroughputModel(candidates=candidates)
    for c in chosen.values():
        model.observe(c.strategy, synthetic(c))
    fits, rest = model.calibration()
    assert fits and not any(f.determined for f in fits.values()) and not rest.determined
    for c in chosen.values():  # the measured ones are their own measurements, whatever the split
        assert model.iter_time_s(c) == pytest.approx(synthetic(c))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, -math.inf])
def test_a_heartbeat_time_that_is_no_measurement_is_ignored(candidates, bad):
    model = ThroughputModel(candidates=candidates)
    s = candidates[0].strategy
    model.observe(s, 0.5)
    model.observe(s, bad)
    assert model.measured_time_s(s) == 0.5 and model.num_observations(s) == 1


@pytest.mark.parametrize("bad", [math.inf, math.nan, 0.0, -0.1])
def test_a_saved_time_that_is_no_measurement_is_not_absorbed(candidates, bad):
    # A saved model or measured.json written by hand (JSON reads `Infinity`): an infinite time must not become the
    # median, which would make the strategy look dead (0 samples/s) to the start and every switch.
    s = candidates[0].strategy
    model = ThroughputModel(candidates=candidates)
    model.absorb([{"strategy": s.to_dict(), "times": [bad, 0.5, 0.5]}])
    assert model.measured_time_s(s) == 0.5
    with pytest.raises(ValueError, match="positive and finite"):
        checked_measurement({"strategy": s.to_dict(), "times": [bad, 0.5]})


def test_a_record_with_an_infinite_time_is_one_line_naming_the_file(tmp_path: Path, candidates):
    s = candidates[0].strategy
    path = tmp_path / profiling.MEASURED_FILE
    # json.dumps writes `Infinity` for inf, as a saved model holding one would
    path.write_text(
        json.dumps({"measured": [{"strategy": s.to_dict(), "times": [math.inf]}], "fingerprint": {}})
    )
    expected = r"measured\.json: not a measurement record.*positive and finite"
    with pytest.raises(ConfigError, match=expected) as e:
        profiling.load_measured(tmp_path)
    assert "\n" not in str(e.value)
