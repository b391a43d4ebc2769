"""What a switch costs: predicted per kind before one is measured, then measured per kind."""

from __future__ import annotations

import pytest
from cona.orchestrator.backends.local import LocalBackend
from cona.orchestrator.job import load_job
from cona.orchestrator.profile import load_profile
from cona.orchestrator.scheduler import Scheduler
from cona.orchestrator.switchcost import (
    CHECKPOINT_BYTES_PER_PARAM,
    SwitchCosts,
    SwitchKind,
    checkpoint_bytes,
    predicted_switch_cost_s,
)
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy

from tests.conftest import EXAMPLES, PROFILES


@pytest.fixture
def setup():
    return load_profile(PROFILES / "local-cpu.yaml"), load_job(EXAMPLES / "tiny-gpt.yaml")


def test_prediction_is_step_boundary_save_overhead_and_load(setup):
    profile, job = setup
    profile = profile.model_copy(
        update={"storage": profile.storage.model_copy(update={"write_bandwidth": "1 MB/s", "read_bandwidth": "2 MB/s"})}
    )
    size = checkpoint_bytes(job)
    assert size == CHECKPOINT_BYTES_PER_PARAM * job.model.num_params
    cost = predicted_switch_cost_s(job=job, profile=profile, overhead_s=3.0, step_time_s=0.5)
    assert cost == pytest.approx(0.25 + size / 1e6 + 3.0 + size / 2e6)


def test_measured_cost_of_a_kind_replaces_the_prediction_of_that_kind_only(setup):
    profile, job = setup
    costs = SwitchCosts(job=job, profile=profile)
    in_place, source = costs.cost_s(SwitchKind.IN_PLACE, overhead_s=1.0, step_time_s=0.1)
    relaunch, _ = costs.cost_s(SwitchKind.RELAUNCH, overhead_s=8.0, step_time_s=0.1)
    assert source == "predicted" and relaunch - in_place == pytest.approx(7.0)
    for seconds in (9.0, 2.0, 3.0, 4.0):
        costs.observe(SwitchKind.IN_PLACE, seconds)
    assert costs.cost_s(SwitchKind.IN_PLACE, overhead_s=1.0, step_time_s=0.1) == (3.0, "measured")  # last three
    assert costs.cost_s(SwitchKind.RELAUNCH, overhead_s=8.0, step_time_s=0.1)[1] == "predicted"
    restored = SwitchCosts(job=job, profile=profile).restore(costs.to_dict())
    assert restored.measured_s(SwitchKind.IN_PLACE) == 3.0


def test_a_pinned_cost_stands_until_one_is_measured(setup):
    profile, job = setup
    costs = SwitchCosts(job=job, profile=profile, pinned_s=30.0)
    assert costs.cost_s(SwitchKind.RELAUNCH, overhead_s=8.0, step_time_s=0.1) == (30.0, "pinned")
    costs.observe(SwitchKind.RELAUNCH, 12.0)
    assert costs.cost_s(SwitchKind.RELAUNCH, overhead_s=8.0, step_time_s=0.1) == (12.0, "measured")


def test_the_scheduler_charges_what_the_local_backend_will_pay(setup, tmp_path):
    # Before any switch was measured: in place (same world size) costs about the backend's in-place overhead,
    # a relaunch (another world size, or in-place switching turned off) its relaunch overhead on top.
    profile, job = setup
    run = RunDir(tmp_path / "run")
    sched = Scheduler(run_dir=run, profile=profile, job=job, backend=LocalBackend(run_dir=run, profile=profile, job=job))
    current = Strategy(dp=1, tp=1, pp=4, mbs=4, gbs=16)
    same_world = Strategy(dp=2, tp=1, pp=2, mbs=16, gbs=64)
    other_world = Strategy(dp=2, tp=1, pp=1, mbs=16, gbs=64)
    assert sched.model.switch_kind(current, same_world) is SwitchKind.IN_PLACE
    assert sched.model.switch_kind(current, other_world) is SwitchKind.RELAUNCH
    cheap, dear = sched.model.switch_cost_s(current, same_world), sched.model.switch_cost_s(current, other_world)
    assert LocalBackend.in_place_overhead_s <= cheap < 2 * LocalBackend.in_place_overhead_s
    assert dear - cheap == pytest.approx(LocalBackend.relaunch_overhead_s - LocalBackend.in_place_overhead_s)

    off = job.model_copy(update={"policy": job.policy.model_copy(update={"in_place_switch": False})})
    sched_off = Scheduler(run_dir=run, profile=profile, job=off, backend=LocalBackend(run_dir=run, profile=profile, job=job))
    assert sched_off.model.switch_kind(current, same_world) is SwitchKind.RELAUNCH


def test_a_completed_switch_is_measured_under_its_kind(setup, tmp_path):
    # The run model on its own (no run directory, no clock): a switch started at t=100 s whose new attempt sends
    # its first heartbeat at t=101.5 s cost 1.5 s, measured as an in-place switch.
    from cona.orchestrator.runmodel import RunModel
    from cona.protocol.heartbeat_record import Heartbeat

    profile, job = setup
    backend = LocalBackend(run_dir=RunDir(tmp_path / "run"), profile=profile, job=job)
    sched = Scheduler(run_dir=RunDir(tmp_path / "run"), profile=profile, job=job, backend=backend)
    model = RunModel(profile=profile, job=job, candidates=sched.candidates,
                     switch_kind=lambda a, b: backend.switch_kind(a, b, in_place_allowed=True),
                     switch_overhead_s=backend.switch_overhead_s)  # fmt: skip
    target = Strategy(dp=2, tp=1, pp=2, mbs=16, gbs=64)
    model.switch_started(requested_at=100.0, to_attempt=2, kind=SwitchKind.IN_PLACE, predicted_s=1.0)
    resume = Heartbeat.from_dict({
        "step": 10, "samples": 160, "time": 101.5, "event": "resume", "attempt": 2, "strategy": target.to_dict(),
        "tokens": 0, "train_loss": None, "lr": 0.0, "step_time_s": 0.0, "samples_per_s": 0.0,
    })  # fmt: skip
    (done,) = model.absorb(2, target, [resume])
    assert (done.attempt, done.kind, done.predicted_s) == (2, SwitchKind.IN_PLACE, 1.0)
    assert done.cost_s == pytest.approx(1.5) and model.pending_switch is None
    assert model.switch_costs.measured_s(SwitchKind.IN_PLACE) == pytest.approx(1.5)
    assert model.switch_costs.measured_s(SwitchKind.RELAUNCH) is None
    assert model.live.switches == 1
    # What an orchestrator restart restores: the same measurements.
    again = RunModel(profile=profile, job=job, candidates=sched.candidates, switch_kind=model.switch_kind,
                     switch_overhead_s=backend.switch_overhead_s).restore(model.to_dict())  # fmt: skip
    assert again.switch_costs.measured_s(SwitchKind.IN_PLACE) == pytest.approx(1.5)
