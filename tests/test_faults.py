"""Exact schedule switch points and the quick part of the seeded fault suite (`tests/faults.py`), on the local
backend: real `cona run`, torchrun and gloo. The long part (N ≥ 20) is `python -m tests.faults --count 20`
(docs/reliability.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from cona.protocol.rundir import RunDir

from tests import faults

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


def test_slurm_backend_is_refused_with_one_line(capsys):
    assert faults.main(["--backend", "slurm"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "not wired yet" in err


def test_a_kind_of_another_backend_is_refused_with_the_valid_ones(capsys):
    assert faults.main(["--backend", "local", "--kinds", "pod-delete"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "pod-delete: not a local fault kind" in err and "worker-kill" in err
    assert faults.main(["--backend", "kubernetes", "--kinds", "worker-kill", "bogus"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "bogus: not a kubernetes fault kind" in err and "pod-delete" in err
