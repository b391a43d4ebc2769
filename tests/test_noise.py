"""The gradient noise scale estimator against synthetic gradients with a known noise scale."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from cona.orchestrator.noise import NoiseScaleEstimator, two_batch_estimates
from cona.protocol.heartbeat_record import Heartbeat

D = 512  # parameters


def heartbeat(**stats) -> Heartbeat:
    return Heartbeat(
        time=0.0, attempt=0, strategy={}, step=0, samples=0, tokens=0, train_loss=0.0, lr=0.0,
        step_time_s=1.0, samples_per_s=1.0, **stats,
    )  # fmt: skip


class Synthetic:
    """Per-sample gradients gᵢ = G + εᵢ, εᵢ ~ N(0, diag σ²); replicas of B_small samples, reduced over dp.

    The mean of B samples is G + N(0, diag σ²/B), drawn directly. `precond` is a diagonal preconditioner P
    (Adam's 1/(√v + ε)²): the preconditioned squared norm is Σ pᵢ gᵢ².
    """

    def __init__(
        self, *, grad: np.ndarray, sigma2: np.ndarray, precond: np.ndarray | None = None, seed: int = 0
    ):
        self.grad, self.sigma2, self.precond = grad, sigma2, precond
        self.rng = np.random.default_rng(seed)

    @property
    def true_noise_scale(self) -> float:
        return float(self.sigma2.sum() / (self.grad @ self.grad))

    @property
    def true_adam_noise_scale(self) -> float:
        assert self.precond is not None
        return float((self.precond * self.sigma2).sum() / (self.precond * self.grad**2).sum())

    def heartbeat(self, *, dp: int, local_batch: int) -> Heartbeat:
        replicas = self.grad + self.rng.normal(size=(dp, D)) * np.sqrt(self.sigma2 / local_batch)
        reduced = replicas.mean(axis=0)
        stats = dict(
            local_sqnorm=float((replicas**2).sum(axis=1).mean()), local_batch=local_batch,
            global_sqnorm=float(reduced @ reduced), global_batch=dp * local_batch,
        )  # fmt: skip
        if self.precond is not None:
            stats["adam_local_sqnorm"] = float((replicas**2 * self.precond).sum(axis=1).mean())
            stats["adam_global_sqnorm"] = float((reduced**2 * self.precond).sum())
        return heartbeat(**stats)


def isotropic(noise_scale: float, *, seed: int = 0) -> Synthetic:
    rng = np.random.default_rng(1000 + seed)
    grad = rng.normal(size=D)
    grad /= np.linalg.norm(grad)  # |G|² = 1, so tr Σ = d·σ² = noise_scale
    return Synthetic(grad=grad, sigma2=np.full(D, noise_scale / D), seed=seed)


def test_two_batch_formulas_are_exact_in_expectation():
    g2, trace, b_small, b_big = 2.0, 300.0, 8, 64
    g2_hat, trace_hat = two_batch_estimates(
        small_sqnorm=g2 + trace / b_small, small_batch=b_small, big_sqnorm=g2 + trace / b_big, big_batch=b_big
    )
    assert g2_hat == pytest.approx(g2) and trace_hat == pytest.approx(trace)
    with pytest.raises(ValueError, match="B_small < B_big"):
        two_batch_estimates(small_sqnorm=1, small_batch=8, big_sqnorm=1, big_batch=8)


@pytest.mark.parametrize(("noise_scale", "dp", "local_batch"), [(40.0, 4, 8), (400.0, 8, 16), (5.0, 2, 4)])
def test_plain_estimate_converges_to_known_noise_scale(noise_scale, dp, local_batch):
    synth = isotropic(noise_scale)
    est = NoiseScaleEstimator(ema=0.95, kind="plain", min_updates=8)
    for _ in range(400):
        est.update(synth.heartbeat(dp=dp, local_batch=local_batch))
    assert est.num_updates == 400
    assert est.value == pytest.approx(synth.true_noise_scale, rel=0.15)
    assert est.grad_sqnorm == pytest.approx(1.0, rel=0.15)
    assert est.trace_sigma == pytest.approx(noise_scale, rel=0.15)
    assert est.stable


def test_adam_variant_uses_preconditioned_norms():
    rng = np.random.default_rng(8)
    # Coordinates differ in scale by orders of magnitude, as across a transformer's layers.
    grad = rng.normal(size=D) * np.exp(rng.normal(size=D)) / math.sqrt(D)
    sigma2 = np.exp(2 * rng.normal(size=D)) * 50 / D
    precond = 1.0 / (np.sqrt(grad**2 + sigma2) + 1e-8) ** 2  # Adam's v ≈ E[g²] = G² + σ²
    synth = Synthetic(grad=grad, sigma2=sigma2, precond=precond, seed=3)
    plain = NoiseScaleEstimator(ema=0.95, kind="plain", min_updates=8)
    adam = NoiseScaleEstimator(ema=0.95, kind="adam", min_updates=8)
    for _ in range(400):
        hb = synth.heartbeat(dp=4, local_batch=8)
        plain.update(hb)
        adam.update(hb)
    assert synth.true_adam_noise_scale < 0.5 * synth.true_noise_scale  # the two really differ here
    assert adam.value == pytest.approx(synth.true_adam_noise_scale, rel=0.1)
    # Noise-dominated coordinates make the plain estimate itself noisier; it still lands near its own truth.
    assert plain.value == pytest.approx(synth.true_noise_scale, rel=0.25)
    assert plain.value > 2 * adam.value


def test_bias_correction_makes_early_estimates_unbiased():
    # Constant inputs: the corrected average equals them from the first record on (an uncorrected EMA would
    # report (1 − β^t) of them: 10% after one record with β = 0.9).
    est = NoiseScaleEstimator(ema=0.9, kind="plain", min_updates=1)
    hb = heartbeat(local_sqnorm=1.0 + 100 / 8, local_batch=8, global_sqnorm=1.0 + 100 / 64, global_batch=64)
    est.update(hb)
    assert est.grad_sqnorm == pytest.approx(1.0) and est.trace_sigma == pytest.approx(100.0)
    est.update(hb)
    est.update(hb)
    assert est.grad_sqnorm == pytest.approx(1.0) and est.value == pytest.approx(100.0)
    # Noisy inputs: after 3 records the corrected averages are unbiased (mean over independent runs).
    g2s, traces = [], []
    for seed in range(200):
        synth = isotropic(40.0, seed=seed)
        run = NoiseScaleEstimator(ema=0.9, kind="plain", min_updates=1)
        for _ in range(3):
            run.update(synth.heartbeat(dp=4, local_batch=8))
        g2s.append(run.grad_sqnorm)
        traces.append(run.trace_sigma)
    assert np.mean(g2s) == pytest.approx(1.0, rel=0.05)
    assert np.mean(traces) == pytest.approx(40.0, rel=0.05)


def test_records_without_usable_statistics_are_skipped():
    est = NoiseScaleEstimator(ema=0.9, kind="plain", min_updates=1)
    est.update(heartbeat())  # no statistics at all
    est.update(heartbeat(local_sqnorm=2.0, local_batch=8, global_sqnorm=2.0, global_batch=8))  # dp = 1
    est.update(
        heartbeat(local_sqnorm=2.0, local_batch=16, global_sqnorm=1.0, global_batch=8)
    )  # B_small>B_big
    est.update(heartbeat(local_sqnorm=math.nan, local_batch=8, global_sqnorm=1.0, global_batch=64))
    est.update(heartbeat(local_sqnorm=2.0, local_batch=8, global_sqnorm=None, global_batch=64))
    assert est.num_updates == 0 and est.num_skipped == 5
    assert est.value is None and est.grad_sqnorm is None and not est.stable
    # The Adam kind needs the preconditioned norms; plain ones alone do not count.
    adam = NoiseScaleEstimator(ema=0.9, kind="adam", min_updates=1)
    adam.update(heartbeat(local_sqnorm=13.5, local_batch=8, global_sqnorm=2.5, global_batch=64))
    assert adam.num_updates == 0


def test_value_is_none_until_both_averages_are_positive():
    est = NoiseScaleEstimator(ema=0.9, kind="plain", min_updates=1)
    # The big batch came out noisier than the small one: tr Σ estimate < 0.
    est.update(heartbeat(local_sqnorm=1.0, local_batch=8, global_sqnorm=2.0, global_batch=64))
    assert est.num_updates == 1 and est.trace_sigma < 0 and est.value is None and not est.stable
    # |G|² estimate < 0 (noise dominates a single step).
    est = NoiseScaleEstimator(ema=0.9, kind="plain", min_updates=1)
    est.update(heartbeat(local_sqnorm=20.0, local_batch=8, global_sqnorm=1.0, global_batch=64))
    assert est.grad_sqnorm < 0 and est.value is None


def test_changing_batch_sizes_mid_stream_keeps_the_estimate():
    synth = isotropic(60.0, seed=1)
    est = NoiseScaleEstimator(ema=0.95, kind="plain", min_updates=8)
    for _ in range(300):
        est.update(synth.heartbeat(dp=4, local_batch=4))  # gbs 16
    before = est.value
    after_switch = []
    for _ in range(300):
        est.update(synth.heartbeat(dp=2, local_batch=64))  # gbs 128 on fewer replicas
        after_switch.append(est.value)
    assert before == pytest.approx(60.0, rel=0.15)
    assert all(v == pytest.approx(before, rel=0.25) for v in after_switch[:20])  # no jump at the switch
    assert est.value == pytest.approx(60.0, rel=0.15)


def test_stability_needs_enough_records_and_agreeing_estimates():
    synth = isotropic(40.0, seed=2)
    est = NoiseScaleEstimator(ema=0.9, kind="plain", min_updates=12)
    for _ in range(11):
        est.update(synth.heartbeat(dp=4, local_batch=8))
    assert est.value is not None and not est.stable  # too few records
    est.update(synth.heartbeat(dp=4, local_batch=8))
    assert est.stable
    # Estimates that still jump around (β = 0 keeps only the latest record) are not stable.
    jumpy = NoiseScaleEstimator(ema=0.0, kind="plain", min_updates=2)
    for i in range(10):
        trace = 100.0 if i % 2 else 20.0
        jumpy.update(
            heartbeat(
                local_sqnorm=1 + trace / 8, local_batch=8, global_sqnorm=1 + trace / 64, global_batch=64
            )
        )
    assert jumpy.value is not None and jumpy.relative_spread > 1 and not jumpy.stable


def test_state_survives_a_restart_through_json():
    synth = isotropic(40.0, seed=4)
    whole = NoiseScaleEstimator(ema=0.9, kind="plain", min_updates=8)
    first = NoiseScaleEstimator(ema=0.9, kind="plain", min_updates=8)
    beats = [synth.heartbeat(dp=4, local_batch=8) for _ in range(40)]
    for hb in beats[:25]:
        whole.update(hb)
        first.update(hb)
    second = NoiseScaleEstimator.from_dict(json.loads(json.dumps(first.to_dict())))
    assert second.value == pytest.approx(first.value) and second.stable == first.stable
    for hb in beats[25:]:
        whole.update(hb)
        second.update(hb)
    assert second.value == pytest.approx(whole.value, rel=1e-12)
    assert second.num_updates == whole.num_updates and second.stable == whole.stable


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="EMA"):
        NoiseScaleEstimator(ema=1.0, kind="plain", min_updates=1)
    with pytest.raises(ValueError, match="kind"):
        NoiseScaleEstimator(ema=0.9, kind="sgd", min_updates=1)  # type: ignore[arg-type]
