"""Exact schedule switch points and the quick part of the seeded fault suite (`tests/faults.py`): on the local
backend (real `cona run`, torchrun and gloo), and on the local Slurm cluster (real sbatch/srun, the cluster's own
faults; skipped without a cluster like the other Slurm tests, a failure in CI). The long part (N ≥ 20) is
`python -m tests.faults --count 20 [--backend slurm]` (docs/reliability.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cona.protocol.rundir import RunDir

from tests import faults
from tests.test_slurm_cluster import cluster  # noqa: F401 (the fixture: skip, or fail in CI, without a cluster)

pytestmark = pytest.mark.distributed

# The first step boundary at or past each point: 13 steps of 16 reach 208 ≥ 200, then 13 of 32 reach 624 ≥ 600.
EXPECTED = [(0, "d4t1p1 m4 g16"), (208, "d2t1p2 m4 g32"), (624, "d4t1p1 m8 g32")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, tuple[list[tuple[int, str]], dict]]:
    root = tmp_path_factory.mktemp("faults")
    return root, faults.reference_run(root)


def test_switch_points_are_exact(reference):
    """The uninterrupted run switches at the first step boundary at or past each point."""
    root, (sequence, _) = reference
    assert sequence == EXPECTED
    assert RunDir(root / "reference").read_switch_points().samples == (200, 600)


def test_quick_fault_suite_with_slow_decisions(reference):
    """Seed 36's first two faults — the orchestrator killed while the trainer waits for its decision at 200, and
    torchrun killed during the in-place switch at 600 — in one run that decides every 3 s instead of 0.5 s; then
    every promise (`faults.check_run`). Without the trainer's hold at the switch points the slow run would switch
    steps later (it trains about 5 steps a second); with it, it switches at the reference's samples and so must end
    with the same bits, faults and all."""
    root, ref = reference
    drawn = [faults.draw(36, i, faults.KINDS) for i in (0, 1)]
    assert [(f.kind, f.point) for f in drawn] == [("orchestrator-kill", "decision"), ("torchrun-kill", "switch")]
    results = faults.run_group(root, drawn, ref, seed=36, extra=("--set", "policy.decision_interval_s=3"))
    failed = [f"{r.fault.describe()} [{r.hit}]: {r.outcome}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    assert all(r.hit and "between attempts" not in r.hit for r in results), [r.hit for r in results]
    assert all(r.outcome.startswith("bit-identical") for r in results), [r.outcome for r in results]
    assert faults.layout_sequence(root / "run-0-1") == EXPECTED


def test_draw_is_per_fault_and_replayable():
    """Fault i is the same drawn alone or in a batch, so a failure's replay command reproduces it."""
    batch = [faults.draw(3, i, faults.KINDS) for i in range(6)]
    assert faults.draw(3, 4, faults.KINDS) == batch[4]
    assert {f.window for f in batch} == {(0, faults.WINDOW_SPLIT), (faults.WINDOW_SPLIT, faults.MAX_SAMPLES)}
    for f in batch:
        assert f.window[0] <= f.samples < f.window[1]


@pytest.mark.slurm
def test_quick_slurm_faults(reference, cluster):  # noqa: F811 (the imported fixture)
    """Seed 2054's first two Slurm faults in one run on the local cluster: slurmctld stopped and started again while
    the attempt waits in the queue (its job requeued, the partition held DOWN), then `scancel` of the job during
    the in-place switch at 600. The Slurm run trains the same layouts over the same samples as the local reference
    (2 nodes × 2 processes, gloo on one host), so it must end with the same bits; and no job of it may be left."""
    if problem := faults.SlurmCluster.problem():
        pytest.skip(problem)
    root, ref = reference
    drawn = [faults.draw(2054, i, faults.SLURM_KINDS, "slurm") for i in (0, 1)]
    assert [(f.kind, f.point) for f in drawn] == [("slurmctld-restart", "queued"), ("scancel", "switch")]
    results = faults.run_group(root, drawn, ref, seed=2054, backend="slurm")
    failed = [f"{r.fault.describe()} [{r.hit}]: {r.outcome}" for r in results if not r.ok]
    assert not failed, "\n".join(failed)
    assert "queued" in results[0].hit and "started again" in results[0].hit, results[0].hit
    assert "scancel" in results[1].hit and "no job" not in results[1].hit, results[1].hit
    assert all(r.outcome.startswith("bit-identical") for r in results), [r.outcome for r in results]
    assert faults.SlurmCluster.queue(root / "slurm-run-0-1") == {}


def test_slurm_draws_the_queued_moment_only_for_kinds_that_can_strike_it():
    """A queued attempt has no process to kill or signal, and a pending job cannot be requeued; the local draws
    never change (their seeds replay as before)."""
    kinds = faults.BACKEND_KINDS["slurm"]
    drawn = [faults.draw(s, i, kinds, "slurm") for s in range(40) for i in range(4)]
    assert {f.kind for f in drawn if f.point == faults.QUEUED} == set(faults.QUEUED_KINDS)
    assert faults.draw(36, 0, faults.KINDS) == faults.draw(36, 0, faults.KINDS, "local")
    assert all(faults.draw(s, 0, faults.KINDS).point != faults.QUEUED for s in range(100))


def test_bad_kinds_are_refused_with_one_line(capsys):
    assert faults.main(["--backend", "local", "--kinds", "scancel"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "scancel: not a local fault kind" in err and "worker-kill" in err
    assert faults.main(["--backend", "kubernetes", "--kinds", "worker-kill", "bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bogus: not a kubernetes fault kind" in err and "pod-delete" in err
