"""`python -m benchmarks.calibrate`: the fit of the cost model's matmul efficiency, and the command on this CPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.calibrate import fit_efficiency
from tests.conftest import REPO


def test_fit_recovers_the_efficiency_curve():
    e_max, half = 0.8, 300.0
    points = [(t, e_max * t / (t + half)) for t in (128, 256, 512, 1024, 4096)]
    assert fit_efficiency(points) == (pytest.approx(e_max), pytest.approx(half))


def test_fit_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match="at least two"):
        fit_efficiency([(128, 0.5)])
    with pytest.raises(ValueError, match="do not saturate"):
        fit_efficiency([(128, 0.001), (256, 0.5)])  # efficiency growing faster than any saturating curve


def test_calibrate_runs_on_this_cpu(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.calibrate", "--profile", "slurm/profiles/local-cpu.yaml", "--hidden", "64",
         "--tokens", "64,256,1024", "--repeats", "2", "--out", str(tmp_path / "calibrate.json")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "Traceback" not in result.stderr
    assert "matmul on cpu" in result.stdout and "1024" in result.stdout
    # A busy 2-core machine may time too noisily to fit: then one line says so, never a traceback.
    if result.returncode == 0:
        assert "accelerator.matmul_efficiency=" in result.stdout and "streaming copy" in result.stdout
    else:
        assert result.returncode == 1 and result.stderr.strip().startswith("calibrate: ")
