"""Edge cases of the decision path, driven by synthetic heartbeats and contexts (no training).

Each test names the input that broke a rule: gradient statistics that are zero, overflow or are undefined, a
B_noise that is huge or restored with odd values, a diverged evaluation, a run whose horizon is gone (the target
reached, nothing left to train), a switch longer than the horizon, a current strategy that is no longer a candidate,
and what `cona status` and the live line show when a value is undefined.
"""

from __future__ import annotations

import json
import math

import pytest
from cona.orchestrator.job import load_job
from cona.orchestrator.live import print_status, status_line, status_summary
from cona.orchestrator.noise import NoiseScaleEstimator
from cona.orchestrator.planner import enumerate_candidates
from cona.orchestrator.profile import load_profile
from cona.orchestrator.runmodel import LiveStatus, RunModel
from cona.orchestrator.runstate import RunState, create_run, write_state
from cona.orchestrator.switchcost import SwitchKind
from cona.orchestrator.throughput import ThroughputModel
from cona.protocol.heartbeat_record import Heartbeat
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy

from tests.conftest import EXAMPLES, PROFILES
from tests.test_policy import FAMILY, G, candidate, cona, context

NOT_SHOWN = "—"


def stats(local: float, glob: float, *, b_small: int = 8, b_big: int = 32) -> Heartbeat:
    return Heartbeat(
        time=0.0, attempt=1, strategy={}, step=0, samples=0, tokens=0, train_loss=0.0, lr=0.0, step_time_s=1.0,
        samples_per_s=1.0, local_sqnorm=local, local_batch=b_small, global_sqnorm=glob, global_batch=b_big,
    )  # fmt: skip


# |G|² = 1 and tr Σ = 24 exactly: B_noise = 24 on every record.
GOOD = stats(4.0, 1.75)


def estimator(**overrides) -> NoiseScaleEstimator:
    settings = dict(ema=0.9, kind="plain", min_updates=8)
    settings.update(overrides)
    return NoiseScaleEstimator(**settings)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- the estimator


def test_a_record_whose_estimates_overflow_is_skipped_and_leaves_the_averages_usable():
    """Finite squared norms near the float limit make B_big·|G_big|² overflow: folded in, the |G|² average became
    NaN (inf − inf) and stayed NaN for the rest of the run, so the estimate was undefined from then on."""
    est = estimator()
    est.update(stats(1e308, 1e308))
    for _ in range(10):
        est.update(GOOD)
    assert est.num_skipped == 1 and est.num_updates == 10
    assert est.value == pytest.approx(24.0)
    assert est.stable


def test_zero_gradient_records_do_not_make_an_estimate_from_one_record_stable():
    """A record with zero squared norms (no gradient measured: Adam's preconditioned norms before the optimizer has
    state, a skipped step) scales both averages alike, so the estimate does not move: counted as an update, it
    filled `min_updates` and the stability window with copies of one real record's estimate."""
    est = estimator()
    est.update(GOOD)
    for _ in range(7):
        est.update(stats(0.0, 0.0))
    assert est.num_updates == 1 and est.num_skipped == 7
    assert not est.stable


def test_an_estimate_that_underflows_to_zero_is_undefined_not_a_division_by_zero():
    """tr Σ / |G|² can round to 0.0; `value` returned it, and the stability check divided by the smallest recent
    estimate (ZeroDivisionError in the orchestrator)."""
    est = NoiseScaleEstimator.from_dict({
        "ema": 0.9, "kind": "plain", "min_updates": 1, "stable_window": 1, "num_updates": 5,
        "ema_grad_sqnorm": 1e10, "ema_trace_sigma": 1e-320, "recent": [],
    })  # fmt: skip
    assert est.value is None
    est._recent.append(est.value)
    assert not est.stable


def test_a_restored_estimator_with_odd_saved_values_rebuilds_its_averages():
    """A state.json whose averages are NaN (or whose recent estimates are 0 or NaN) kept the estimate undefined
    forever, or crashed the stability check; the averages start over and fill again from the next records."""
    est = NoiseScaleEstimator.from_dict({
        "ema": 0.9, "kind": "plain", "min_updates": 4, "num_updates": 40, "num_skipped": 3,
        "ema_grad_sqnorm": math.nan, "ema_trace_sigma": 2.0, "recent": [0.0, None, math.nan, 5.0],
    })  # fmt: skip
    assert est.value is None and not est.stable and est.num_skipped == 3
    for _ in range(6):
        est.update(GOOD)
    assert est.value == pytest.approx(24.0) and est.stable


# ---------------------------------------------------------------------------------------------------- the policy


def test_a_huge_estimate_ranks_with_a_finite_noise_scale():
    """An estimate near the float limit times `critical_batch_factor` overflowed to inf, and ranking with it raised
    ValueError out of the orchestrator's decision."""
    policy = cona(critical_batch_factor=5.0, noise_growth=True, noise_monotone=True)
    decision = policy.decide(context(G[32].strategy, noise=1e308))
    assert math.isfinite(decision.metrics["B_noise"]) and decision.metrics["B_noise"] > 0
    assert decision.metrics["best"]["gbs"] == 128  # a huge noise scale: the largest batch
    assert "inf" not in decision.reason


def test_an_undefined_estimate_after_it_was_trusted_keeps_the_last_one_not_the_prior():
    """Once the estimate is trusted the policy never goes back to the prior (a guess made before training that
    pulls to small batches late in a run). But when the estimator's value became undefined — the |G|² average ≤ 0,
    which happens exactly when noise dominates the gradient — B_noise fell back to the prior."""
    policy = cona(prior_noise_scale=20.0)
    assert policy.decide(context(G[64].strategy, noise=400.0)).metrics["B_noise"] == 400.0
    decision = policy.decide(context(G[64].strategy, noise=None, stable=False))
    assert decision.metrics["B_noise"] == 400.0 and decision.metrics["noise_source"] == "estimate"
    assert policy.noise_scale_used(None) == 400.0  # the elastic plan ranks with the same value
    # Restored by a new orchestrator: the same.
    again = cona(prior_noise_scale=20.0).from_dict(json.loads(json.dumps(policy.to_dict())))
    assert again.decide(context(G[64].strategy, noise=None, stable=False)).metrics["B_noise"] == 400.0


@pytest.mark.parametrize("peak", [None, math.nan, math.inf, -3.0, "high"])
def test_a_restored_noise_peak_with_an_odd_value_neither_crashes_nor_poisons_the_ranking(peak):
    """state.json's `noise_peak` null crashed the restore (TypeError); NaN or inf became the floor of every later
    B_noise and ranking raised ValueError."""
    policy = cona(noise_monotone=True).from_dict({"name": "cona", "noise_weight": 1.0, "noise_peak": peak})
    decision = policy.decide(context(G[32].strategy, noise=50.0))
    assert decision.metrics["B_noise"] == 50.0


def test_a_state_from_before_the_noise_peak_keeps_the_floor_its_history_shows():
    """A state.json of a cona from before `noise_monotone` has the trusted estimates (`noise_history`) but no
    `noise_peak`: restored as 0, the floor was gone and the next dip was ranked at face value."""
    history = [[1000 * i, 300.0 + 10 * i] for i in range(8)]
    policy = cona(noise_monotone=True).from_dict({"name": "cona", "noise_weight": 1.0, "noise_history": history})
    assert policy.decide(context(G[64].strategy, noise=100.0, samples=9000)).metrics["B_noise"] == 370.0


def test_restored_noise_history_with_non_finite_entries_keeps_fitting_the_growth():
    """An inf among the saved trusted estimates passed the restore's filter and made the least-squares slope NaN,
    which `growth_per_sample` turned into 0: no growth fitted for the next 64 evaluations."""
    history = [[1000 * i, 100.0 * 1.1**i] for i in range(8)] + [[9000, math.inf], [9500, math.nan]]
    policy = cona(noise_growth=True).from_dict({"name": "cona", "noise_weight": 1.0, "noise_history": history})
    assert len(policy._history) == 8
    assert policy.growth_per_sample() == pytest.approx(math.log(1.1) / 1000)


def _probing_setup() -> tuple[list, ThroughputModel]:
    other = candidate(32, dp=2, tp=2, slowdown=1.1)  # a layout that never ran, close to the current one's R
    candidates = [*FAMILY, other]
    tm = ThroughputModel(candidates=candidates)
    tm.observe(G[32].strategy, 2 * G[32].iter_time_s)  # the cost model missed: probing is on
    return candidates, tm


def test_no_probe_when_nothing_is_left_to_train():
    """With the horizon at 0 (the target or `max_samples` reached) and a free switch, 2·C_sw > 3% of H was false
    (0 > 0), so cona probed a layout with nothing left to gain."""
    candidates, tm = _probing_setup()
    probe = cona(probe_layouts=2).decide(context(G[32].strategy, remaining=100.0, cost=0.0, throughput=tm,
                                                 candidates=candidates, noise=100.0))  # fmt: skip
    assert probe.metrics.get("probe")  # with time left it probes
    done = cona(probe_layouts=2).decide(context(G[32].strategy, remaining=0.0, cost=0.0, throughput=tm,
                                                candidates=candidates, noise=100.0))  # fmt: skip
    assert done.switch_to is None and not done.metrics.get("probe"), done.reason


def test_a_current_strategy_that_is_no_candidate_is_left_only_while_the_switch_can_pay_back():
    """A running strategy that is not among the candidates (the devices or the planner changed) is left at once,
    without dwell or persistence; but with the horizon shorter than the switch (the run about to end) the switch
    only costs time."""
    stranger = Strategy(dp=4, tp=1, pp=1, mbs=2, gbs=48)
    leave = cona().decide(context(stranger, noise=100.0, remaining=100.0, cost=5.0))
    assert leave.switch_to is not None
    stay = cona().decide(context(stranger, noise=100.0, remaining=3.0, cost=5.0))
    assert stay.switch_to is None and "switch cost" in stay.reason, stay.reason


def test_an_equivalent_candidate_with_a_cheap_switch_wins_when_the_best_ones_switch_cannot_pay_back():
    """Wins count every candidate within δ of the best that clears its own threshold (an in-place switch pays back
    sooner than a relaunch). When the best candidate's switch was longer than the horizon the policy stayed,
    although an equivalent candidate with a cheap switch had won every evaluation."""
    near = candidate(128, dp=2, tp=2, slowdown=1.02)  # 2% slower than G[128], another layout
    candidates = [*FAMILY, near]
    costs = {G[128].strategy: 50.0, near.strategy: 1.0}
    policy = cona(persistence=2, min_dwell_s=0.0)
    decisions = []
    for now in (100.0, 105.0):
        ctx = context(G[32].strategy, noise=5000.0, remaining=30.0, candidates=candidates, now=now)
        ctx.switch_cost_s = lambda s: costs.get(s, 1.0)
        decisions.append(policy.decide(ctx))
    assert decisions[0].metrics["best"]["gbs"] == 128 and decisions[0].metrics["best"]["tp"] == 1
    assert decisions[1].switch_to == near.strategy, decisions[1].reason


# ---------------------------------------------------------------------------------------------------- the run model


def _run_model(*sets: str) -> RunModel:
    profile = load_profile(PROFILES / "local-cpu.yaml")
    job = load_job(EXAMPLES / "tiny-gpt.yaml", list(sets))
    candidates = enumerate_candidates(profile=profile, job=job, feasible_only=True)
    return RunModel(profile=profile, job=job, candidates=candidates, switch_kind=lambda a, b: SwitchKind.IN_PLACE,
                    switch_overhead_s=lambda kind: 1.0)  # fmt: skip


def test_no_switch_once_the_target_perplexity_is_reached():
    """The time-to-target estimate fits the last two evaluations and skipped a loss already at the target (and a
    single evaluation): with the target reached at the first evaluation the horizon was the samples budget's, and
    the policy switched with nothing left to gain (the trainer stops at that evaluation)."""
    model = _run_model("policy.prior_noise_scale=80", "policy.persistence=1", "policy.min_dwell_s=0",
                       "policy.probe_layouts=0")  # fmt: skip
    pool = [c for c in model.candidates if c.strategy.world_size == 4]
    current = min(pool, key=lambda c: c.strategy.gbs / c.iter_time_s / (c.strategy.gbs + 80)).strategy
    model.attempt_started(1, current)
    model.throughput.observe(current, current.gbs / model.throughput.samples_per_s_of(current))
    model.live.samples = 4000
    target = math.log(model.job.target.val_perplexity)

    model.record_evaluation(time=10.0, samples=4000, val_loss=target + 1.0)
    remaining = model.remaining_time_s(current, elapsed_s=10.0)
    assert remaining is not None and remaining > 0
    assert model.decide(now=10.0, current=current, strategy_since=0.0, elapsed_s=10.0) is not None  # worth it

    model.val_history.clear()
    model.record_evaluation(time=10.0, samples=4000, val_loss=target - 0.1)  # the first evaluation: reached
    assert model.remaining_time_s(current, elapsed_s=10.0) == 0.0
    assert model.decide(now=20.0, current=current, strategy_since=0.0, elapsed_s=20.0) is None
    assert model.last_decision is not None and model.last_decision["metrics"]["H_s"] == 0.0


@pytest.mark.parametrize("spike", [math.inf, 1e300])
def test_a_diverged_evaluation_before_the_last_one_does_not_say_the_target_is_reached(spike):
    """The time to target fits the loss through the last two evaluations. After a diverged one (an infinite or
    overflowing loss) the drop to the next was infinite, the fitted slope too, and the target came out as reached
    now: an ETA of 0, and a horizon of 0 that blocks every switch, while the loss is still far above the target."""
    model = _run_model()
    current = model.initial_strategy()
    model.throughput.observe(current, current.gbs / model.throughput.samples_per_s_of(current))
    model.live.samples = 4000
    target = math.log(model.job.target.val_perplexity)
    model.record_evaluation(time=5.0, samples=2000, val_loss=spike)
    model.record_evaluation(time=10.0, samples=4000, val_loss=target + 1.0)
    budget = (model.job.target.max_samples - 4000) / model.throughput.samples_per_s_of(current)
    assert model.remaining_time_s(current, elapsed_s=10.0) == pytest.approx(budget)
    # A loss that goes up, or stays flat, says nothing about when the target comes: the samples budget decides.
    model.record_evaluation(time=15.0, samples=6000, val_loss=target + 1.0)
    model.live.samples = 6000
    flat = model.remaining_time_s(current, elapsed_s=15.0)
    assert flat == pytest.approx((model.job.target.max_samples - 6000) / model.throughput.samples_per_s_of(current))


def test_a_restored_model_state_with_odd_noise_values_still_decides():
    """A state.json with a null noise peak, an inf in the noise history and NaN averages restores without error, and
    the next decision ranks with a finite B_noise."""
    model = _run_model()
    fresh = model.to_dict()
    fresh["policy"].update(noise_peak=None, noise_history=[[100, math.inf], [200, 50.0]], noise_weight=1.0)
    fresh["noise"].update(ema_grad_sqnorm=math.nan)
    model.restore(json.loads(json.dumps(fresh)))
    current = model.initial_strategy()
    model.decide(now=10.0, current=current, strategy_since=0.0, elapsed_s=10.0)
    used = model.last_decision["metrics"]["B_noise"]
    assert math.isfinite(used) and used > 0


# ---------------------------------------------------------------------------------------------------- what is shown


ODD = {"attempt": 2, "step": 10, "samples": 640, "train_loss": math.nan, "val_perplexity": math.nan,
       "noise_scale": -4.0, "noise_source": "estimate", "samples_per_s": math.nan, "strategy": "d4t1p1 m4 g16",
       "switches": 0, "best": "", "best_gain": None}  # fmt: skip


@pytest.mark.parametrize("eta", [-5.0, math.nan, math.inf])
def test_the_live_line_shows_a_dash_for_undefined_values_never_a_negative_or_nan(eta):
    line = status_line({**ODD, "eta_s": eta})
    assert line.endswith(f"ETA {NOT_SHOWN}"), line
    assert "nan" not in line.lower() and "-4" not in line and "-5" not in line and "?" not in line, line
    assert f"{NOT_SHOWN} samples/s" in line and f"B_noise {NOT_SHOWN}" in line
    assert status_line({**ODD, "eta_s": 65.0, "samples_per_s": 200.0}).endswith("ETA 1m05s")
    assert "ETA 0s" in status_line(LiveStatus(eta_s=0.0))


def test_cona_status_shows_a_dash_for_undefined_values_and_its_json_has_no_nan(tmp_path, capsys):
    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(PROFILES / "local-cpu.yaml"), job=load_job(EXAMPLES / "tiny-gpt.yaml"))
    live = {**ODD, "val_loss": math.nan, "eta_s": -3.0}
    write_state(run, RunState(status="running", model={"live": live}))
    summary = status_summary(run)
    json.dumps(summary, allow_nan=False)  # `cona status --json`: strict JSON
    assert summary["eta_s"] is None and summary["noise_scale"] is None and summary["val_perplexity"] is None
    print_status(summary)
    # The run directory's path is in the output and may hold "-4" or "nan" itself (pytest-413, …/nanny/): left out.
    out = capsys.readouterr().out.replace(str(run.root), "RUN")
    assert "nan" not in out.lower() and "-4" not in out, out
    assert f"val perplexity {NOT_SHOWN}" in out and f"B_noise {NOT_SHOWN}" in out


def test_a_val_perplexity_from_before_the_end_says_when_it_was_evaluated(tmp_path, capsys):
    """A run that ended between two evaluations (a budget below eval.interval_samples) showed the step-0 model's
    perplexity beside the end's sample count, as if it were the trained model's."""
    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(PROFILES / "local-cpu.yaml"), job=load_job(EXAMPLES / "tiny-gpt.yaml"))
    live = {"step": 188, "samples": 3008, "val_loss": 5.546, "val_perplexity": 256.24, "val_samples": 0}
    write_state(run, RunState(status="done", model={"live": live}))
    summary = status_summary(run)
    assert summary["val_samples"] == 0
    print_status(summary)
    assert "val perplexity 256.24 at 0 samples" in capsys.readouterr().out
    write_state(run, RunState(status="done", model={"live": {**live, "val_samples": 3008}}))
    print_status(status_summary(run))
    out = capsys.readouterr().out
    assert "val perplexity 256.24" in out and "at 3,008 samples" not in out and "at 0 samples" not in out
