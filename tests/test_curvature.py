"""`benchmarks.curvature`: the pairwise estimator recovers tr(M·Σ)/GᵀMG from sampled small-batch gradients, for the
identity and for a curvature metric, where the answer is known in closed form; and one tiny run of the real
measurement gives the plain and the curvature-weighted values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.curvature import ESTIMATES, Settings, measure, pairwise_estimate


@pytest.mark.parametrize("metric", ["identity", "hessian"])
def test_the_pairwise_estimate_recovers_the_weighted_noise_scale(metric):
    rng = np.random.default_rng(0)
    grad = np.array([0.3, -0.5, 1.0, 2.0])
    sigma = np.array([1.0, 0.5, 2.0, 0.3])  # per-sample standard deviations
    m = np.eye(4) if metric == "identity" else np.diag([4.0, 1.0, 0.25, 0.05])
    small, n, repeats = 4, 64, 400
    values = []
    for _ in range(repeats):
        g = grad + rng.standard_normal((n, 4)) * sigma / np.sqrt(small)
        values.append(pairwise_estimate(torch.from_numpy(g @ m @ g.T), small))
    expected = float(np.trace(m @ np.diag(sigma**2)) / (grad @ m @ grad))
    # The ratio of means is unbiased in numerator and denominator; over 400 draws the mean is within a few percent.
    assert np.mean(values) == pytest.approx(expected, rel=0.05)
    # The curvature metric weighs the noisy directions differently from the identity: the two answers differ.
    other = np.eye(4) if metric == "hessian" else np.diag([4.0, 1.0, 0.25, 0.05])
    assert abs(expected - float(np.trace(other @ np.diag(sigma**2)) / (grad @ other @ grad))) > 0.5 * expected


def test_no_signal_gives_no_estimate():
    assert pairwise_estimate(torch.tensor([[1.0, -0.1], [-0.1, 1.0]]), 4) is None


def test_one_tiny_measurement_gives_every_estimate():
    out = measure(Settings(workload="gpt", states=(64,), batches=4, small=2, curvature_batch=8, repeats=1, seed=0))
    (row,) = out["rows"]
    assert row["state_samples"] == 64 and np.isfinite(row["state_val_loss"])
    assert set(ESTIMATES) <= set(row) and len(row["repeats"]) == 1
    assert all(v is None or (np.isfinite(v) and v > 0) for v in (row[k] for k in ESTIMATES))
