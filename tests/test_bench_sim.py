"""The time-to-perplexity benchmark charges each switch what the cluster backend would pay (benchmarks.sim)."""

from __future__ import annotations

import pytest
from cona.orchestrator.job import load_job
from cona.orchestrator.profile import load_profile
from cona.orchestrator.switchcost import SwitchKind
from cona.protocol.strategy import Strategy

from benchmarks.sim import ModeledCluster
from tests.conftest import EXAMPLES, PROFILES

REPO_JOB = EXAMPLES.parent / "benchmarks" / "jobs" / "gpt.yaml"  # the reference TTP workload


@pytest.fixture(scope="module")
def parts():
    return load_profile(PROFILES / "a100-4x8.yaml"), load_job(EXAMPLES / "gpt3-1.3b.yaml"), load_job(REPO_JOB)


def test_switches_at_the_same_world_size_are_charged_in_place(parts):
    profile, preset, tiny = parts
    cluster = ModeledCluster(profile=profile, preset_job=preset, tiny_job=tiny, restart_s=20.0)
    bytes_ = 12 * preset.model.num_params
    save, load = bytes_ / 2e9, bytes_ / 4e9  # the profile's 2 GB/s write and 4 GB/s read
    a, b = cluster.fastest[64].strategy, cluster.fastest[512].strategy
    assert a.world_size == b.world_size == profile.num_gpus
    assert cluster.switch_kind(a, b) is SwitchKind.IN_PLACE
    assert cluster.switch_s(a, b) == pytest.approx(save + 1.0 + load)
    other = Strategy(dp=a.dp // 2, tp=a.tp, pp=a.pp, mbs=a.mbs, gbs=a.gbs)  # half the devices: a relaunch
    assert cluster.switch_kind(a, other) is SwitchKind.RELAUNCH
    assert cluster.switch_s(a, other) == pytest.approx(save + 20.0 + load) == pytest.approx(cluster.switch_cost_s)
    relaunch_only = ModeledCluster(profile=profile, preset_job=preset, tiny_job=tiny, restart_s=20.0, in_place=False)
    assert relaunch_only.switch_s(a, b) == pytest.approx(save + 20.0 + load)
    assert relaunch_only.describe()["in_place_switch_cost_s"] is None
    assert cluster.describe()["in_place_switch_cost_s"] == pytest.approx(save + 1.0 + load)
