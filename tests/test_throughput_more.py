"""The measured-throughput path's edges: `cona profile` records that are damaged in ways a JSON parser accepts, fits
that one global batch cannot determine, the plan's ≈best next to measured times, and heartbeats that do not measure
the strategy the run model thinks is running."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from cona.orchestrator import profiling
from cona.orchestrator.job import load_job
from cona.orchestrator.planner import enumerate_candidates
from cona.orchestrator.policy import ConaPolicy
from cona.orchestrator.profile import load_profile
from cona.orchestrator.throughput import ThroughputModel, fit_affine
from cona.protocol.heartbeat_record import Heartbeat, throughput_windows, timed_window
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

from tests.conftest import EXAMPLES, PROFILES
from tests.test_throughput import candidate

PROFILE = PROFILES / "local-cpu.yaml"
JOB = EXAMPLES / "tiny-gpt.yaml"
S = Strategy(4, 1, 1, 4, 16)
ELSEWHERE = Strategy(8, 1, 1, 2, 16)
"""A strategy of two nodes: not a candidate of the one-node profile, so its record's own prediction is used."""


@pytest.fixture(scope="module")
def setup():
    profile, job = load_profile(PROFILE), load_job(JOB)
    candidates = enumerate_candidates(profile=profile, job=job, num_devices=profile.num_gpus, feasible_only=True)
    return profile, job, candidates


def entry(strategy: Strategy, time_s: float = 0.1, **fields: object) -> dict:
    return {"strategy": strategy.to_dict(), "times": [time_s] * 9, "count": 12, "predicted_s": 0.05,
            "time_s": time_s, **fields}  # fmt: skip


def write_record(root: Path, measured: list[dict], setup) -> Path:
    profile, job, _ = setup
    run = RunDir(root)
    run.root.mkdir(parents=True, exist_ok=True)
    profiling.write_measured(run, profile=profile, job=job, measured=measured)
    return run.root


# ------------------------------------------------------------------------------------------ damaged records


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"count": None}, "count must be an integer"),  # was a TypeError traceback out of `cona plan`
        ({"count": "x"}, "count must be an integer"),  # was "invalid literal for int()", naming no file
        ({"count": True}, "count must be an integer"),
        ({"count": -3}, "count must be an integer of at least its 9 step times"),  # was a negative count, silently
        ({"count": 2}, "count must be an integer of at least its 9 step times"),
        ({"predicted_s": 0}, "predicted_s must be a positive, finite number or null"),  # ZeroDivisionError in a run
        ({"predicted_s": -1.0}, "predicted_s must be a positive"),  # "math domain error" in a run
        ({"predicted_s": math.inf}, "predicted_s must be a positive"),  # "math domain error" out of `cona plan`
        ({"predicted_s": math.nan}, "predicted_s must be a positive"),
        ({"predicted_s": "x"}, "predicted_s must be a positive"),  # "could not convert string to float", no file
        ({"predicted_s": [1]}, "predicted_s must be a positive"),  # a TypeError traceback
        ({"times": [True]}, "step times must be positive and finite"),  # read as 1.0 s
        ({"times": ["0.5"]}, "step times must be positive and finite"),
        ({"times": "0.5"}, "step times must be positive and finite"),
    ],
)
def test_a_damaged_entry_is_one_line_naming_the_file_and_the_field(tmp_path, setup, fields, message):
    root = write_record(tmp_path / "p", [entry(ELSEWHERE, **fields)], setup)
    with pytest.raises(ConfigError, match=message) as info:
        profiling.load_measured(root)
    assert "\n" not in str(info.value) and str(root / profiling.MEASURED_FILE) in str(info.value)
    assert "d8t1p1 m2 g16" in str(info.value)


def test_plan_with_a_damaged_entry_exits_2_with_one_line(tmp_path, setup, capsys):
    from cona.orchestrator import cli

    root = write_record(tmp_path / "p", [entry(S, count=None)], setup)
    assert cli.main(["plan", "--profile", str(PROFILE), "--job", str(JOB), "--measured", str(root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cona: error: --measured ") and err.count("\n") == 1 and "count must be" in err


def test_a_record_that_measures_a_strategy_twice_is_refused(tmp_path, setup):
    # Which of the two would win is an accident of the order (absorb keeps the last): refuse rather than guess.
    root = write_record(tmp_path / "p", [entry(S, 0.1), entry(ELSEWHERE), entry(S, 0.5)], setup)
    with pytest.raises(ConfigError, match=r"entries 0 and 2 both measure d4t1p1 m4 g16; keep one") as info:
        profiling.load_measured(root)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("predicted", [0, -1.0, math.inf, math.nan, "x"])
def test_a_saved_prediction_that_is_no_time_is_unknown_not_a_crash(predicted):
    # A state.json or record written by hand: the model's saved state (`to_dict`, every save of a run) divided by it.
    model = ThroughputModel(candidates=[])
    model.absorb([{"strategy": ELSEWHERE.to_dict(), "times": [0.1, 0.1], "predicted_s": predicted}])
    saved = model.to_dict()
    assert saved["calibration_factor"] == 1.0 and saved["measured"][0]["predicted_s"] is None
    assert model.model_error() == 0.0


def test_a_saved_count_below_its_times_is_at_least_their_number():
    model = ThroughputModel(candidates=[])
    model.absorb([{"strategy": S.to_dict(), "times": [0.1, 0.1, 0.1], "count": 0}])
    assert model.num_observations(S) == 3


# ------------------------------------------------------------------------------------------ what a fit can tell


def test_micro_batches_of_one_global_batch_do_not_separate_fixed_from_per_sample_cost():
    """Two micro-batches of one global batch train the same samples per step: their predicted times differ by the
    micro-batches' efficiency, not by work per sample, so they cannot tell a per-step cost from a per-sample one.
    Measured equal (noise, or a machine the micro-batch does not matter to), they were read as "a larger batch is
    almost free" (the per-sample cost floored at a tenth) and called fitted."""
    m2, m8, big = candidate(4, 1, 1, 2, 32, 0.12), candidate(4, 1, 1, 8, 32, 0.10), candidate(4, 1, 1, 8, 128, 0.40)
    model = ThroughputModel(candidates=[m2, m8, big])
    model.observe(m2.strategy, 0.50)
    model.observe(m8.strategy, 0.52)
    fit = model.calibration()[0][(4, 1, 1)]
    assert not fit.determined
    # One batch's reading (tier 3): the mean measured time's excess over the mean prediction is the fixed cost.
    assert model.estimate(big) == (pytest.approx(0.51 - 0.11 + 0.40), "degrees")
    assert not fit_affine([(0.12, 0.50, 32), (0.10, 0.52, 32)], prior_scale=1.0).determined
    # A second global batch does separate them.
    model.observe(big.strategy, 0.60)
    assert model.calibration()[0][(4, 1, 1)].determined


def test_the_profile_table_calls_one_batch_of_several_micro_batches_a_guess(tmp_path, setup):
    from types import SimpleNamespace

    profile, job, candidates = setup
    a, b = (next(c for c in candidates if c.strategy.layout() == (4, 1, 1) and c.gbs == 32 and c.mbs == m)
            for m in (2, 8))  # fmt: skip
    assert a.iter_time_s > 1.05 * b.iter_time_s  # distinct predictions: the old rule called them a fit
    model = ThroughputModel(candidates=candidates)
    model.observe(a.strategy, 0.50)
    model.observe(b.strategy, 0.52)
    run = RunDir(tmp_path / "p")
    run.root.mkdir()
    table = profiling.finish_profile(run, profile=profile, job=job,
                                     state=SimpleNamespace(model={"throughput": model.to_dict()}))  # fmt: skip
    assert "layout d4t1p1:" in table and "(one batch measured: the split is a guess)" in table


# ------------------------------------------------------------------------------------------ what is compared


def test_a_record_of_the_same_model_named_otherwise_is_accepted(tmp_path, setup):
    """The preset's name and the weights a run starts from do not change a step time: the same dimensions spelled
    out, or a run from an exported checkpoint, keep the profile's measurements (they were refused as "another
    setup: job.model.preset is None here but 'tiny-gpt'")."""
    profile = setup[0]
    root = write_record(tmp_path / "p", [entry(S)], setup)
    record, source = profiling.load_measured(root)
    spelled = load_job(JOB, ["model.preset=null", "model.family=gpt", "model.num_layers=4", "model.hidden_size=64",
                             "model.num_heads=4", "model.vocab_size=256", "model.seq_len=64"])  # fmt: skip
    profiling.check_compatible(record, source, profile, spelled)
    (tmp_path / "hf").mkdir()
    warm = load_job(JOB, [f"model.init_from={tmp_path / 'hf'}"])
    profiling.check_compatible(record, source, profile, warm)
    # What does change a step time still refuses it.
    with pytest.raises(ConfigError, match=r"job\.model\.hidden_size is 128 here but 64"):
        profiling.check_compatible(record, source, profile, load_job(JOB, ["model.hidden_size=128",
                                                                           "model.ffn_hidden_size=256"]))  # fmt: skip
    with pytest.raises(ConfigError, match=r"job\.model\.ffn_hidden_size is 512 here but 256"):  # follows hidden_size
        profiling.check_compatible(record, source, profile, load_job(JOB, ["model.hidden_size=128"]))


def test_an_older_record_that_holds_the_preset_is_compared_without_it(tmp_path, setup):
    profile, job, _ = setup
    root = write_record(tmp_path / "p", [entry(S)], setup)
    data = json.loads((root / profiling.MEASURED_FILE).read_text())
    data["fingerprint"]["job.model"].update(preset="tiny-gpt", init_from="/somewhere/else")
    (root / profiling.MEASURED_FILE).write_text(json.dumps(data))
    record, source = profiling.load_measured(root)
    profiling.check_compatible(record, source, profile, job)


# ------------------------------------------------------------------------------------------ what to profile


@pytest.mark.parametrize(
    ("strategies", "message"),
    [
        # Measured twice for nothing: the second run of it is one more warm-up and the same numbers.
        ("dp=4,tp=1,pp=1,mbs=4,gbs=16; dp=2,tp=1,pp=2,mbs=8,gbs=32; dp=4,tp=1,pp=1,mbs=4,gbs=16",
         r"--strategies entry 2 \(dp=4,tp=1,pp=1,mbs=4,gbs=16\) repeats entry 0"),
        # Runnable, but no run ranks it (no prediction): its step time would calibrate nothing.
        ("dp=4,tp=1,pp=1,mbs=3,gbs=12",
         r"--strategies entry 0 \(dp=4,tp=1,pp=1,mbs=3,gbs=12\): mbs=3 is not among batch\.mbs_choices \[2, 4, 8, 16\]"),
        ("dp=4,tp=1,pp=1,mbs=4,gbs=48",
         r"--strategies entry 0 \(dp=4,tp=1,pp=1,mbs=4,gbs=48\): gbs=48 is not among the global batches a run ranks"),
    ],
)
def test_a_strategy_profiled_for_nothing_is_refused_before_anything_runs(setup, strategies, message):
    profile, job, _ = setup
    with pytest.raises(ConfigError, match=message) as info:
        profiling.profiling_job(profile, job, top=None, strategies=strategies, steps=None)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------ the plan's ≈best


def test_plan_does_not_call_a_strategy_measured_slowest_within_the_error_of_the_best(tmp_path, setup, capsys):
    """≈best says the model cannot rank these; with measured step times the table ranks by them, and a strategy
    measured ten times slower than the fastest of its batch was still marked ≈best (by the cost model's times)."""
    from cona.orchestrator import cli

    _, job, candidates = setup
    start = ConaPolicy.from_spec(job.policy, base_gbs=job.batch.base_gbs).start(
        candidates=candidates, throughput=ThroughputModel(candidates=candidates))[0]  # fmt: skip
    slow = next(c for c in candidates if c.strategy == start)
    other = min((c for c in candidates if c.gbs == start.gbs and c.strategy.layout() != start.layout()),
                key=lambda c: c.iter_time_s)  # fmt: skip
    root = write_record(tmp_path / "p", [entry(start, 10 * slow.iter_time_s, predicted_s=slow.iter_time_s),
                                         entry(other.strategy, other.iter_time_s, predicted_s=other.iter_time_s)],
                        setup)  # fmt: skip
    argv = ["plan", "--profile", str(PROFILE), "--job", str(JOB), "--json", "--top", "0"]
    assert cli.main([*argv, "--measured", str(root)]) == 0
    rows = {Strategy(r["dp"], r["tp"], r["pp"], r["mbs"], r["gbs"]): r for r in json.loads(capsys.readouterr().out)}
    assert not rows[start]["within_model_error_of_best"]
    fastest = min((r for r in rows.values() if r["gbs"] == start.gbs), key=lambda r: r["calibrated_iter_time_s"])
    assert fastest["within_model_error_of_best"]
    assert cli.main(argv) == 0  # without measurements: the cost model's ties, as before
    plain = {Strategy(r["dp"], r["tp"], r["pp"], r["mbs"], r["gbs"]): r for r in json.loads(capsys.readouterr().out)}
    assert plain[start]["within_model_error_of_best"]


# ------------------------------------------------------------------------------------------ heartbeats


def _beat(step: int, strategy: Strategy, step_time_s: float, event: str | None = None) -> Heartbeat:
    return Heartbeat(time=100.0 + step, attempt=1, strategy=strategy.to_dict(), step=step, samples=strategy.gbs * step,
                     tokens=0, train_loss=2.0, lr=1e-3, step_time_s=step_time_s,
                     samples_per_s=strategy.gbs / step_time_s if step_time_s else 0.0, event=event)  # fmt: skip


def _run_model(setup):
    from cona.orchestrator.runmodel import RunModel
    from cona.orchestrator.switchcost import SwitchKind

    profile, job, _ = setup
    candidates = enumerate_candidates(profile=profile, job=job, feasible_only=True)
    return RunModel(profile=profile, job=job, candidates=candidates, switch_kind=lambda a, b: SwitchKind.RELAUNCH,
                    switch_overhead_s=lambda kind: 1.0)  # fmt: skip


def test_windows_of_another_strategy_do_not_measure_the_attempts(setup):
    """An elastic attempt that started on another node count than planned: the heartbeats read before the backend
    says so are the other strategy's, and were taken as the planned one's step times."""
    planned, ran = Strategy(2, 1, 2, 8, 32), Strategy(4, 1, 1, 4, 16)
    model = _run_model(setup)
    model.attempt_started(1, planned)
    model.absorb(1, planned, [_beat(0, ran, 0.0, "start"), _beat(1, ran, 1.0), _beat(2, ran, 0.05), _beat(3, ran, 0.05)])
    assert model.throughput.measured_time_s(planned) is None
    model.absorb(1, planned, [_beat(4, planned, 0.2), _beat(5, planned, 0.1)])
    assert model.throughput.measured_time_s(planned) == pytest.approx(0.1)  # its own windows, after its warm-up


def test_a_window_with_an_infinite_step_time_is_no_timed_window(setup):
    """A garbage window (JSON reads `Infinity`) measures nothing, as the throughput model already said; counted as
    the attempt's warm-up, it let the real warm-up window in as a measurement."""
    s = Strategy(4, 1, 1, 4, 16)
    garbage = _beat(1, s, math.inf)
    assert not timed_window(garbage)
    beats = [_beat(0, s, 0.0, "start"), garbage, _beat(2, s, 1.5), _beat(3, s, 0.05)]
    assert [hb.step for hb in throughput_windows(beats)] == [3]
    model = _run_model(setup)
    model.attempt_started(1, s)
    model.absorb(1, s, beats)
    assert model.throughput.measured_time_s(s) == pytest.approx(0.05) and model.throughput.num_observations(s) == 1


def test_a_measured_strategy_this_run_could_never_run_is_refused(tmp_path, setup):
    """A record edited by hand: dp=3 with pp=2 on 4 devices, a batch that does not split, was taken in and
    calibrated the model. `cona profile` measures only what ran."""
    profile, job, _ = setup
    for bad, why in ((Strategy(3, 1, 2, 2, 16), "no strategy of this run"),
                     (Strategy(8, 1, 1, 2, 16), "it needs 8 devices, the profile has 4")):  # fmt: skip
        root = write_record(tmp_path / bad.short().replace(" ", "-"), [entry(S), entry(bad)], setup)
        with pytest.raises(ConfigError, match=f"entry 1 \\({bad.short()}\\) is no strategy of this run") as info:
            profiling.load_compatible(root, profile, job)
        assert why in str(info.value) and "\n" not in str(info.value)
    profiling.load_compatible(write_record(tmp_path / "good", [entry(S)], setup), profile, job)
