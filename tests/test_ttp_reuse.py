"""`python -m benchmarks.ttp --cona-only`: cona is rerun only against a finished run with the same settings."""

from __future__ import annotations

import json

import pytest

from benchmarks import ttp


def finished(tmp_path, **settings):
    report = {
        "benchmark": "ttp", "quick": True,
        "settings": {"profile": "slurm/profiles/a100-4x8.yaml", "preset": "examples/gpt3-1.3b.yaml",
                     "in_place": True, **settings},
        "workloads": {"gpt": {"runs": [{"workload": "gpt", "seed": 0, "fixed": {"64": {}}, "oracle": {},
                                        "cona": {"ttp_s": {}}, "wall_s": 1.0}]}},
    }  # fmt: skip
    path = tmp_path / "ttp-quick.json"
    path.write_text(json.dumps(report))
    return path


def args(*extra):
    parsed = ttp.argparse.Namespace(profile="slurm/profiles/a100-4x8.yaml", preset="examples/gpt3-1.3b.yaml",
                                    relaunch_only=False, quick=True)  # fmt: skip
    for key, value in extra:
        setattr(parsed, key, value)
    return parsed


def test_reuse_keeps_everything_but_cona(tmp_path):
    runs = ttp._previous_runs(str(finished(tmp_path)), args=args(), names=["gpt"], seeds=[0])
    assert set(runs) == {("gpt", 0)}
    assert "cona" not in runs[("gpt", 0)] and runs[("gpt", 0)]["fixed"] == {"64": {}}


@pytest.mark.parametrize(
    ("extra", "seeds", "message"),
    [
        ((("profile", "slurm/profiles/a100-16x8.yaml"),), [0], "was run with profile='slurm/profiles/a100-4x8.yaml'"),
        ((("relaunch_only", True),), [0], "was run with in_place=True"),
        ((("quick", False),), [0], "was run with --quick"),
        ((), [0, 1], "has no run for gpt seed 1"),
    ],
)
def test_reuse_refuses_a_run_with_other_settings(tmp_path, extra, seeds, message):
    with pytest.raises(SystemExit) as info:
        ttp._previous_runs(str(finished(tmp_path)), args=args(*extra), names=["gpt"], seeds=seeds)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_reuse_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(SystemExit, match=r"nope\.json not found"):
        ttp._previous_runs(str(tmp_path / "nope.json"), args=args(), names=["gpt"], seeds=[0])


def _result(seed: int, cona: float | None, *, oracle: float = 100.0, fixed: float = 110.0) -> dict:
    key = "2.0"
    return {
        "seed": seed,
        "fitted_critical_batch": {key: None},
        "fixed": {"128": {"ttp_s": {key: fixed}, "last_t_s": 400.0}},
        "candidates": [{"strategy": "d8t1p1 m16 g128", "gbs": 128, "ttp_s": {key: fixed}}],
        "cona": {"ttp_s": {key: cona}, "last_t_s": 300.0},
        "oracle": {"ttp_s": {key: oracle}},
    }


def test_a_cona_run_that_misses_the_target_bounds_its_ratios_instead_of_vanishing_from_the_mean():
    """A seed on which cona ran out of samples before the target used to drop out of the means (cona/oracle looked
    better than it was); its last modeled time now bounds it, and the ratios say they are bounds."""
    both = ttp.summarize("gpt", [2.0], [_result(0, 120.0), _result(1, 105.0)], 128)["per_target"]["2.0"]
    assert both["cona_over_oracle"]["mean"] == pytest.approx(1.125) and not both["cona_over_oracle"]["lower_bound"]
    assert both["cona_missed"] == []
    one = ttp.summarize("gpt", [2.0], [_result(0, 120.0), _result(1, None)], 128)["per_target"]["2.0"]
    assert one["cona_missed"] == [1]
    assert one["cona_over_oracle"]["per_seed"] == pytest.approx([1.2, 3.0])  # seed 1: at least its last 300 s
    assert one["cona_over_oracle"]["lower_bound"] and one["best_fixed_over_cona"]["upper_bound"]
    assert one["static_over_cona"]["128"]["upper_bound"] and not one["static_over_cona"]["128"]["lower_bound"]
    assert ttp.bounded_ratio(one["cona_over_oracle"], 3).startswith("≥2.100")
    assert ttp.bounded_ratio(one["best_fixed_over_cona"], 3).startswith("≤")


def test_a_crossing_is_interpolated_over_training_time_not_across_a_switch_pause():
    """Evaluations at 100 s (loss 2.2) and 140 s (1.8) with a 20 s switch pause at 105–125 s between them: 20 s of
    training, the loss crosses 2.0 halfway through it, 5 s after the pause = 130 s (interpolating in modeled time put
    it at 120 s, inside the pause)."""
    points = [ttp.Point(100.0, 1000, 10, 2.2, 128), ttp.Point(140.0, 1200, 12, 1.8, 512)]
    assert ttp.crossing(points, 2.0) == pytest.approx(120.0)
    assert ttp.crossing(points, 2.0, pauses=[(105.0, 125.0)]) == pytest.approx(130.0)
    assert ttp.crossing(points, 2.15, pauses=[(105.0, 125.0)]) == pytest.approx(102.5)  # before the pause
    assert ttp.crossing(points, 2.0, pauses=[(100.0, 120.0)]) == pytest.approx(130.0)  # the switch right at 100 s
    assert ttp.crossing(points, 2.0, pauses=[(10.0, 30.0)]) == pytest.approx(120.0)  # an earlier pause: no effect
    assert ttp.crossing(points, 2.0, what="samples", pauses=[(105.0, 125.0)]) == pytest.approx(1100)


def test_a_json_written_before_pauses_were_recorded_gets_them_from_its_decisions_and_sequence():
    cona = {"sequence": [{"t": 0.0, "gbs": 128}, {"t": 125.0, "gbs": 512}],
            "decisions": [{"t": 60.0, "switch_to": None}, {"t": 105.0, "switch_to": "d8t1p4 m1 g512"}],
            "evals": [[100.0, 1000, 10, 2.2, 128], [140.0, 1200, 12, 1.8, 512]], "ttp_s": {"2.0": 120.0}}
    oracle = {"sequence": [{"t": 0.0, "gbs": 128}, {"t": 125.0, "gbs": 512}],
              "decisions": [{"t": 0.0, "chosen_gbs": 128}, {"t": 50.0, "chosen_gbs": 128},
                            {"t": 105.0, "chosen_gbs": 512}],
              "evals": cona["evals"], "ttp_s": {"2.0": 120.0}}  # fmt: skip
    assert ttp.pauses_of(cona) == ttp.pauses_of(oracle) == [(105.0, 125.0)]
    report = {"workloads": {"gpt": {"targets": [2.0], "runs": [{"cona": cona, "oracle": oracle}]}}}
    ttp.refresh_switching_runs(report)
    assert cona["ttp_s"] == oracle["ttp_s"] == {"2.0": pytest.approx(130.0)}
    assert cona["pauses"] == [[105.0, 125.0]]
