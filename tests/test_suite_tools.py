"""The suite's own machinery (tests/conftest.py): the slow tests are collected first, the modules that share a
costly fixture go to one worker, and `CONA_TEST_TIMELINE` records each test phase with its worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, pytest_collection_modifyitems, work_unit
from tests.timeline import summarize


class Item:
    def __init__(self, name: str, *, slow: bool = False) -> None:
        self.path = Path("tests") / name.split("::")[0]
        self.name, self.slow = name, slow

    def get_closest_marker(self, marker: str) -> object | None:
        return object() if marker == "slow" and self.slow else None


def test_slow_tests_go_first_and_the_slurm_tests_keep_their_order():
    items = [Item("test_a.py::fast"), Item("test_slurm_e2e.py::first"), Item("test_a.py::slow", slow=True),
             Item("test_b.py::fast"), Item("test_slurm_e2e.py::second", slow=True), Item("test_faults.py::x"),
             Item("test_b.py::slow", slow=True)]  # fmt: skip
    pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    assert [i.name for i in items] == ["test_slurm_e2e.py::first", "test_a.py::slow", "test_slurm_e2e.py::second",
                                       "test_faults.py::x", "test_b.py::slow", "test_a.py::fast", "test_b.py::fast"]  # fmt: skip


def test_a_module_with_a_costly_shared_fixture_goes_to_one_worker():
    """Its module-scoped fixture (a torchrun measurement, one-process references) is then set up once, not once per
    worker that ran one of its tests."""
    module = "tests/test_memorymodel_tp.py"
    ids = [f"{module}::test_a_tp_block_saves_what_the_model_says_on_every_rank[tp-none-gpt]",
           f"{module}::test_a_tp_block_saves_what_the_model_says_on_every_rank[tp-sp-full-bert]",
           f"{module}::test_sequence_parallelism_saves_less_in_every_recompute_mode"]  # fmt: skip
    assert len({work_unit(nodeid) for nodeid in ids}) == 1
    families = "tests/test_trainer_families.py::test_pipelines_match_one_process"
    assert work_unit(f"{families}[llama-gqa-tp2-pp2-gpipe]") == work_unit(f"{families}[llama-uneven-pp3-1f1b]")
    assert work_unit("tests/test_slurm_e2e.py::a") == work_unit("tests/test_faults.py::b[x]") == "slurm"
    assert work_unit("tests/test_a.py::one") != work_unit("tests/test_a.py::two") != work_unit(ids[0])


def test_the_timeline_has_every_phase_of_every_test(tmp_path):
    (tmp_path / "test_tiny.py").write_text("def test_one():\n    pass\n\ndef test_two():\n    assert 1 + 1 == 3\n")
    timeline = tmp_path / "timeline.jsonl"
    # A run of its own, not a worker of this one (under xdist the variable says it is, and workers do not write).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")} | {"CONA_TEST_TIMELINE": str(timeline)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           str(tmp_path / "test_tiny.py")], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=env)  # fmt: skip
    assert done.returncode == 1, done.stdout[-2000:]  # test_two fails, and is recorded all the same
    rows = [json.loads(line) for line in timeline.read_text().splitlines()]
    assert [(r["test"].split("::")[-1], r["phase"]) for r in rows] == [
        (test, phase) for test in ("test_one", "test_two") for phase in ("setup", "call", "teardown")
    ]
    assert all(r["worker"] == "main" and r["start"] <= r["stop"] for r in rows)
    summary = summarize(rows)
    assert list(summary["workers"]) == ["main"] and summary["workers"]["main"]["tests"] == 2
    assert summary["workers"]["main"]["busy_s"] + summary["workers"]["main"]["idle_s"] <= summary["workers"]["main"]["end_s"] + 1e-6
    assert list(summary["files"]) == [rows[0]["test"].split("::")[0]]


def test_the_summary_counts_idle_time_between_a_workers_tests():
    rows = [{"test": "t.py::a", "phase": "call", "worker": "gw0", "start": 100.0, "stop": 110.0},
            {"test": "t.py::b", "phase": "call", "worker": "gw0", "start": 115.0, "stop": 120.0},
            {"test": "u.py::c", "phase": "call", "worker": "gw1", "start": 100.0, "stop": 130.0}]  # fmt: skip
    summary = summarize(rows)
    assert summary["workers"]["gw0"] == {"tests": 2, "busy_s": 15.0, "idle_s": 5.0, "end_s": 20.0}
    assert summary["workers"]["gw1"]["end_s"] == 30.0
    assert summary["files"] == {"u.py": 30.0, "t.py": 15.0} and summary["total_s"] == 45.0
