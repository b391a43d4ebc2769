"""What the benchmarks print and write beside their numbers: where a result goes, how a mean over the seeds that
reached a target is shown, tables that fit their headers, and the commit that ran."""

from __future__ import annotations

import pytest

from benchmarks import common, ttp
from tests.conftest import REPO


@pytest.mark.parametrize(("quick", "scenario", "profile", "preset", "name"), [
    (True, None, "slurm/profiles/a100-4x8.yaml", "examples/gpt3-1.3b.yaml", "ttp-quick.json"),
    (False, "reference", "./slurm/profiles/a100-4x8.yaml", str(REPO / "examples/gpt3-1.3b.yaml"), "ttp.json"),
    (True, "h100-8x8", "slurm/profiles/h100-8x8.yaml", "examples/llama-3.2-1b.yaml", "ttp-quick-h100-8x8.json"),
    # Another profile or preset than the scenario's: named after them, never the scenario's shipped results.
    (True, None, "slurm/profiles/h100-2x8.yaml", "examples/gpt3-1.3b.yaml", "ttp-quick-h100-2x8-gpt3-1.3b.json"),
    (False, "a100-16x8", "slurm/profiles/h100-2x8.yaml", "examples/gpt3-1.3b.yaml", "ttp-h100-2x8-gpt3-1.3b.json"),
    (False, "h100-8x8", "slurm/profiles/h100-8x8.yaml", "examples/gpt3-1.3b.yaml", "ttp-h100-8x8-gpt3-1.3b.json"),
])  # fmt: skip
def test_a_run_without_out_writes_a_file_named_for_what_it_ran(quick, scenario, profile, preset, name):
    assert ttp.default_out(quick, scenario, profile, preset) == name


def test_a_mean_over_the_seeds_that_reached_the_target_says_how_many():
    assert ttp.mean_s(common.spread([170.0, None, 172.0, 171.0])) == "171 s (3 of 4 seeds)"
    assert ttp.mean_s(common.spread([170.0, 172.0])) == "171 s"
    assert ttp.mean_s(common.spread([None, None])) == "—"


def test_a_wide_table_prints_every_header_whole(capsys):
    columns = ["target loss", *(f"static@{g}/cona" for g in (64, 128, 256, 512, 1024, 2048)), "cona/oracle",
               "best fixed/cona", "best mean fixed/cona"]  # fmt: skip
    rows = [["2.10", *["1.35 [1.24–1.46]"] * 6, "0.977 [0.962–0.993]", "0.994 [0.988–1.000]", "1.000"]]
    common.print_table("h100-8x8: ratios", columns, rows)
    out = capsys.readouterr().out
    assert all(c in out for c in columns) and "…" not in out
    assert sum("0.977 [0.962–0.993]" in line for line in out.splitlines()) == 1  # no cell wrapped over two lines


def test_a_result_names_the_commit_it_started_at(monkeypatch):
    monkeypatch.setitem(common._AT_START, "git_commit", "abc1234")
    monkeypatch.setattr(common, "_git_commit", lambda: "def5678")  # committed while the benchmark ran
    info = common.machine()
    assert info["git_commit"] == "abc1234" and info["git_commit_at_end"] == "def5678"
    monkeypatch.setattr(common, "_git_commit", lambda: "abc1234")
    assert "git_commit_at_end" not in common.machine()
