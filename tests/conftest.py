"""Shared test fixtures. Paths are absolute so tests run from any directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
PROFILES = REPO / "slurm" / "profiles"


def assert_golden(path: Path, text: str, *, what: str) -> None:
    """`text` equals the golden file `path`; `UPDATE_GOLDEN=1` rewrites it instead. `what` names the text."""
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden file {path}; run with UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path} differs from {what}; rerun with UPDATE_GOLDEN=1 if intended"


def run_cona(*args: str, cwd: Path | None = None, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real `cona` entry point in a subprocess (as a user would)."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "cona.orchestrator.cli", *args],
        cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout, env=full_env,
    )  # fmt: skip


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def k8s():
    """The Kubernetes API emulator (`tests/k8s_emulator.py`), started for one test and stopped after it."""
    from tests.k8s_emulator import running_emulator

    with running_emulator() as emulator:
        yield emulator


# The tests that drive the local Slurm cluster share its two nodes (a job of one would wait for, or be taken for,
# another's), so under pytest-xdist (`make test` runs two workers with `--dist loadgroup`) they are one unit of
# work: they run one after another on one worker while the other runs the rest, test by test. The fault suite is
# among them (its quick Slurm run). A scheduler of our own, not `xdist_group` markers: xdist 3.8 groups by renaming
# `item._nodeid`, which pytest 9 no longer reads, so the markers alone would let two Slurm tests run at once.
SLURM_MODULES = ("test_slurm_", "test_faults.py")
# A module whose tests share a costly module-scoped fixture is one unit of work as well: a worker sets such a
# fixture up for the first of its tests that needs it, so tests handed out one by one set it up on both workers
# (test_memorymodel_tp.py's torchrun measurement ran twice, 71 and 73 s; test_trainer_families.py's one-process
# references are shared by its parallel layouts).
ONE_WORKER_MODULES = ("test_memorymodel_tp.py", "test_trainer_families.py")


def work_unit(nodeid: str) -> str:
    """What the scheduler hands to one worker at once: the Slurm tests together, each module of
    `ONE_WORKER_MODULES` whole, every other test alone."""
    module = Path(nodeid.split("::")[0]).name
    if module.startswith(SLURM_MODULES):
        return "slurm"
    return module if module in ONE_WORKER_MODULES else nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    # xdist hands out the units with the most tests first (`--loadscope-reorder`, its default): the Slurm tests and
    # the modules above, then the single tests in collection order (`pytest_collection_modifyitems`).
    class UnitsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return UnitsTogether(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked `slow` go first: the two workers then end on short tests, together, instead of one of them
    idling while the other finishes a run of minutes that it picked up last. The Slurm tests, one unit of work
    that starts first anyway, keep their order among themselves."""

    def later(item: pytest.Item) -> bool:
        return item.get_closest_marker("slow") is None and not item.path.name.startswith(SLURM_MODULES)

    items.sort(key=later)  # stable: each kind keeps its order


# `CONA_TEST_TIMELINE=FILE` appends one JSON line per test phase (nodeid, phase, worker, start, stop) as the run
# goes: what each worker ran when, and how long it sat idle, which `--durations` cannot tell (`python -m tests.timeline`).
TIMELINE = os.environ.get("CONA_TEST_TIMELINE")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not TIMELINE or os.environ.get("PYTEST_XDIST_WORKER"):  # the controller writes, once per phase
        return
    import json

    node = getattr(report, "node", None)
    worker = node.gateway.id if node is not None else "main"
    with open(TIMELINE, "a") as f:
        f.write(json.dumps({"test": report.nodeid, "phase": report.when, "worker": worker,
                            "start": report.start, "stop": report.stop}) + "\n")  # fmt: skip


HOSTILE_IMAGE = "registry.example/cona:v1\"';$(id)"
"""An image reference with shell metacharacters (the Kubernetes tests' hostile value)."""


@pytest.fixture
def renderer_without_image_check(monkeypatch):
    """The profile check refuses a hostile image outright (`render.image_problem`); the tests that use this go past
    it to show the renderer's own defence: such a value, were one to get through, stays one inert string."""
    from cona.orchestrator.backends.kubernetes import render

    assert render.image_problem(HOSTILE_IMAGE) is not None
    monkeypatch.setattr(render, "image_problem", lambda image: None)
