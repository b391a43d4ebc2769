"""`benchmarks.noise_floor`: the LR excess r = 2(a − s)/(a − 2s) is the LR over the best LR for the batch.

On an exact quadratic with a noisy gradient the best LR is known in closed form (McCandlish et al. 2018:
ε_opt = |G|²/(GᵀHG + tr(HΣ)/B)), so the estimate from sampled steps can be checked against it; and one short run
of the real measurement must give finite windows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from benchmarks.noise_floor import Settings, excess, measure


@pytest.mark.parametrize("lr_over_best", [0.5, 1.0, 1.9])
@pytest.mark.parametrize("batch", [4, 64])
def test_r_recovers_the_lr_over_the_best_lr_on_a_noisy_quadratic(lr_over_best, batch):
    rng = np.random.default_rng(0)
    h = np.array([4.0, 1.0, 0.25, 0.05])  # the Hessian's eigenvalues
    x = np.array([0.3, -0.5, 1.0, 2.0])  # the state
    sigma = np.array([1.0, 0.5, 2.0, 0.3])  # per-sample gradient noise
    grad = h * x
    best = grad @ grad / (grad @ (h * grad) + (h * sigma**2).sum() / batch)
    lr = lr_over_best * best
    steps = 200_000
    noise = rng.standard_normal((steps, 4)) * sigma / math.sqrt(batch)
    delta = -lr * (grad + noise)
    following = rng.standard_normal((steps, 4)) * sigma / math.sqrt(batch)
    a = ((h * (x + delta) + following) * delta).sum(axis=1).mean()  # the next step's gradient along this update
    s = (0.5 * h * (x + delta) ** 2 - 0.5 * h * x**2).sum(axis=1).mean()  # the loss change on a fresh batch
    r, rho = excess(a, s)
    assert r is not None and rho is not None
    assert r == pytest.approx(lr_over_best, rel=0.03)
    assert rho == pytest.approx(1 - r / 2, abs=1e-9)  # the quadratic model: the kept fraction is 1 − r/2


def test_no_first_order_progress_gives_no_estimate():
    assert excess(a=-1.0, s=0.0) == (None, None)
    assert excess(a=0.0, s=0.0) == (None, None)


def test_a_short_run_gives_a_window_of_finite_statistics():
    result = measure(Settings(workload="gpt", gbs=16, samples=640, window=320, seed=0))
    windows = result["windows"]
    assert [w["samples_end"] for w in windows] == [320, 640]
    for w in windows:
        assert w["steps"] >= 19
        assert all(math.isfinite(w[k]) for k in ("a", "a_se", "s", "s_se", "val_loss", "lr"))
    # Early in warm-up the LR is far below the best (the loss keeps most of its first-order progress).
    assert windows[0]["r"] is not None and windows[0]["r"] < 1.0
