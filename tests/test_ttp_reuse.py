"""`python -m benchmarks.ttp --cona-only`: cona is rerun only against a finished run with the same settings."""

from __future__ import annotations

import json

import pytest

from benchmarks import ttp


def finished(tmp_path, **settings):
    report = {
        "quick": True,
        "settings": {"profile": "slurm/profiles/a100-4x8.yaml", "preset": "examples/gpt3-1.3b.yaml",
                     "in_place": True, **settings},
        "workloads": {"gpt": {"runs": [{"workload": "gpt", "seed": 0, "fixed": {"64": {}}, "oracle": {},
                                        "cona": {"ttp_s": {}}, "wall_s": 1.0}]}},
    }  # fmt: skip
    path = tmp_path / "ttp-quick.json"
    path.write_text(json.dumps(report))
    return path


def args(*extra):
    parsed = ttp.argparse.Namespace(profile="slurm/profiles/a100-4x8.yaml", preset="examples/gpt3-1.3b.yaml",
                                    relaunch_only=False, quick=True)  # fmt: skip
    for key, value in extra:
        setattr(parsed, key, value)
    return parsed


def test_reuse_keeps_everything_but_cona(tmp_path):
    runs = ttp._previous_runs(str(finished(tmp_path)), args=args(), names=["gpt"], seeds=[0])
    assert set(runs) == {("gpt", 0)}
    assert "cona" not in runs[("gpt", 0)] and runs[("gpt", 0)]["fixed"] == {"64": {}}


@pytest.mark.parametrize(
    ("extra", "seeds", "message"),
    [
        ((("profile", "slurm/profiles/a100-16x8.yaml"),), [0], "was run with profile='slurm/profiles/a100-4x8.yaml'"),
        ((("relaunch_only", True),), [0], "was run with in_place=True"),
        ((("quick", False),), [0], "was run with --quick"),
        ((), [0, 1], "has no run for gpt seed 1"),
    ],
)
def test_reuse_refuses_a_run_with_other_settings(tmp_path, extra, seeds, message):
    with pytest.raises(SystemExit) as info:
        ttp._previous_runs(str(finished(tmp_path)), args=args(*extra), names=["gpt"], seeds=seeds)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_reuse_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(SystemExit, match=r"nope\.json not found"):
        ttp._previous_runs(str(tmp_path / "nope.json"), args=args(), names=["gpt"], seeds=[0])
