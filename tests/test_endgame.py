"""`benchmarks.endgame`: the branches separate a larger batch from the LR cut its capped LR makes."""

from __future__ import annotations

import math

import pytest
from cona.orchestrator.job import load_job

from benchmarks.common import REPO
from benchmarks.endgame import branches


def test_the_branches_follow_the_jobs_lr_rule():
    job = load_job(REPO / "benchmarks/jobs/gpt.yaml")  # base 16, √ scaling capped at 2×
    got = {name: (gbs, factor) for name, gbs, factor in branches(job, (64, 128))}
    assert got["base 16"] == (16, 1.0)
    assert got["64 (rule ×2.00)"] == (64, None)  # the trainer's own LR at that gbs
    assert got["128 (rule ×2.00)"] == (128, None)  # √8 = 2.83, capped at 2
    assert got["128 (uncapped ×2.83)"] == (128, pytest.approx(math.sqrt(8)))
    assert got["base × 0.71"] == (16, pytest.approx(2 / math.sqrt(8)))
    assert got["base × 0.50"] == (16, 0.5)


def test_no_cut_branch_where_the_cap_does_not_bind():
    job = load_job(REPO / "benchmarks/jobs/gpt.yaml")
    names = [name for name, _, _ in branches(job, (32, 64))]  # √4 = 2: the cap is reached, not exceeded
    assert names == ["base 16", "32 (rule ×1.41)", "64 (rule ×2.00)", "base × 0.50"]


def test_the_samples_to_a_target_are_interpolated_between_evaluations():
    from benchmarks.endgame import _crossing

    assert _crossing([(0, 2.0), (512, 1.9), (1024, 1.7)], 1.8) == pytest.approx(768)
    assert _crossing([(0, 2.0), (512, 1.9)], 1.8) is None
    assert _crossing([(0, 1.7), (512, 1.6)], 1.8) == 0  # the state itself is below it


def test_the_excess_loss_uses_adams_own_preconditioner_and_leaves_the_state_alone():
    """tr(PΣ) weights the gradient variance by P = 1/(√v̂ + ε), not by P² (the `adam` noise statistics' weighting):
    four times the second moments about halve it (not exactly: v̂ is taken after one more step's gradient). The measurement trains nothing: the model, AdamW's moments and the
    data position are as they were."""
    import torch

    from benchmarks.endgame import excess_loss
    from benchmarks.sim import tiny_trainer

    torch.set_num_threads(1)
    sim = tiny_trainer("benchmarks/jobs/gpt.yaml", seed=0, stats=False)
    for _ in range(20):
        sim.train_step()
    before = sim.snapshot()
    first = sim.job.target.max_samples
    got = excess_loss(sim, draws=8, first_sample=first)
    after = sim.snapshot()
    assert (after.gbs, after.samples, after.step) == (before.gbs, before.samples, before.step) == (16, 320, 20)
    assert all(torch.equal(before.model[k], after.model[k]) for k in before.model)
    moments = [s["exp_avg_sq"] for s in sim.model.optimizers[0].state_dict()["state"].values()]
    assert moments and all(torch.equal(m, s["exp_avg_sq"]) for m, s in
                           zip(moments, before.optim["state"].values(), strict=True))  # fmt: skip
    assert got["tr_p_sigma"] > 0 and got["batch"] == 16
    assert got["excess"] == pytest.approx(got["lr"] * got["tr_p_sigma"] / (4 * 16))

    for state in sim.model.optimizers[0].state.values():
        state["exp_avg_sq"].mul_(4.0)
    scaled = excess_loss(sim, draws=8, first_sample=first)  # the same draws
    assert 0.45 < scaled["tr_p_sigma"] / got["tr_p_sigma"] < 0.6  # P² would give about 0.25
