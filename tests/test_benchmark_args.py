"""The benchmarks' shared argument checks (`benchmarks.common`): a typo or a bad number ends the command with one
line naming the flag, and the valid choices where there are some — never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import endgame, noise_batch, noise_floor, sequence_parallel, ttp


@pytest.mark.parametrize("module", [endgame, noise_batch, noise_floor, ttp], ids=lambda m: m.__name__)
@pytest.mark.parametrize(("argv", "says"), [
    (["--workloads", "gtp"], "--workloads: unknown 'gtp'; valid: gpt, llama, bert"),
    (["--workloads", ","], "--workloads: empty; valid: gpt, llama, bert"),
])  # fmt: skip
def test_a_misspelled_workload_is_answered_with_the_valid_ones(module, argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith(f"error: {says}"), err


@pytest.mark.parametrize(("module", "argv", "says"), [
    (endgame, ["--batches", "16,x"], "--batches: expected comma-separated integers, got '16,x'"),
    (noise_batch, ["--batches", "15"], "--batches: every batch must be even (two micro-batches per step), got '15'"),
    (noise_floor, ["--batches", "0"], "--batches: every value must be at least 2, got '0'"),
    (endgame, ["--states", "-5"], "--states: every value must be at least 0, got '-5'"),
    (ttp, ["--seeds", "0,a"], "--seeds: expected comma-separated integers, got '0,a'"),
    (noise_batch, ["--modes", "held,x"], "--modes: unknown 'x'; valid: held, trained"),
    (sequence_parallel, ["--steps", "1"], "--steps: must be at least 2, got 1"),
    (sequence_parallel, ["--repeats", "0"], "--repeats: must be at least 1, got 0"),
    # A seed the job refuses ended a worker in a traceback, minutes in; a repeated one trained and counted twice.
    (ttp, ["--seeds", "0,9007199254740993"], "--seeds: every value must be at most 9e+15, got '0,9007199254740993'"),
    (ttp, ["--seeds", "0,0"], "--seeds: a value is given twice, got '0,0'"),
    (ttp, ["--seeds", ""], "--seeds: expected comma-separated integers, got ''"),  # not "the defaults"
    (ttp, ["--workloads", "gpt,gpt"], "--workloads: a name is given twice, got 'gpt,gpt'"),
    (noise_batch, ["--seed", "-1"], "--seed: every value must be at least 0, got '-1'"),
    (noise_batch, ["--jobs", "0"], "argument --jobs: must be at least 1 (and at most 9e+15), got '0'"),
    (endgame, ["--batches", "128,64"], "--batches: give them in increasing order (the last the largest), got '128,64'"),
])  # fmt: skip
def test_bad_numbers_and_modes_name_the_flag(module, argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {says}")


@pytest.mark.parametrize(("argv", "says"), [
    (["--jobs", "0"], "--jobs: must be at least 1, got 0"),
    (["--cap", "0.5"], "--cap: must be above 1, got 0.5"),
    (["--segment-s", "0"], "--segment-s: must be above 0, got 0"),
    (["--restart-s", "nan"], "--restart-s: must be at least 0, got nan"),
    (["--quick", "--profile", "no-such-profile.yaml"], "--profile: "),
    (["--quick", "--preset", "no-such-preset.yaml"], "--preset: "),
])  # fmt: skip
def test_ttp_refuses_bad_settings_before_any_worker_starts(argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        ttp.main(argv)
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: {says}" in last and "Traceback" not in last, last


def test_ttp_names_a_preset_whose_batches_do_not_map_onto_the_tiny_job(tmp_path, capsys):
    from benchmarks.common import REPO

    # A valid job whose largest batch, 192, is no multiple of the tiny GPT's 128: no tiny batch stands for it.
    preset = tmp_path / "odd.yaml"
    text = (REPO / "examples/gpt3-1.3b.yaml").read_text()
    assert "min_gbs: 64\n  max_gbs: 1024\n  base_gbs: 512" in text
    preset.write_text(text.replace("min_gbs: 64\n  max_gbs: 1024\n  base_gbs: 512", "min_gbs: 96\n  max_gbs: 192\n  base_gbs: 192"))
    with pytest.raises(SystemExit) as info:
        ttp.main(["--quick", "--preset", str(preset)])
    assert info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "workload gpt" in last and "--preset" in last, last


@pytest.mark.parametrize(("content", "says"), [
    ("not json", "is not a JSON file this benchmark wrote"),
    ('{"benchmark": "switch"}', "is not a result of benchmarks.ttp"),
    (None, "not found"),
])  # fmt: skip
def test_ttp_resummarize_names_a_file_it_cannot_use(tmp_path, content, says):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as info:
        ttp.main(["--resummarize", str(path)])
    assert says in str(info.value.code) and str(path) in str(info.value.code)


def test_an_out_with_a_directory_goes_where_it_says_and_a_bare_name_under_results():
    """`--out ../x.json` wrote benchmarks/x.json and `--out /tmp/x.json`... under benchmarks/results too."""
    from benchmarks.common import RESULTS, results_path

    assert results_path("ttp.json") == RESULTS / "ttp.json"
    assert results_path("/tmp/x/ttp.json") == Path("/tmp/x/ttp.json")
    assert results_path("out/x.json") == Path("out/x.json") and results_path("../x.json") == Path("../x.json")


def test_resummarize_writes_back_to_the_file_it_read(tmp_path):
    """It wrote benchmarks/results/<the file's name> (and its plots), whatever directory the file was in: a copy of
    someone's ttp.json resummarized from elsewhere overwrote the shipped one."""
    import shutil

    from benchmarks.common import RESULTS

    copy = tmp_path / "theirs.json"
    shutil.copy(RESULTS / "ttp-quick.json", copy)
    before = {p.name: p.stat().st_mtime_ns for p in RESULTS.iterdir()}
    ttp.main(["--resummarize", str(copy)])
    assert (tmp_path / "theirs-gpt.png").exists() and '"resummarized"' in copy.read_text()
    assert {p.name: p.stat().st_mtime_ns for p in RESULTS.iterdir()} == before  # nothing written there


def test_a_profile_or_record_that_cannot_be_loaded_is_one_line(capsys, monkeypatch):
    from benchmarks import switch
    from benchmarks.common import run_main

    monkeypatch.setattr("sys.argv", ["switch.py", "--profile", "slurm/profiles/nope.yaml"])
    assert run_main(lambda: switch.main(["--profile", "slurm/profiles/nope.yaml"])) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("python -m benchmarks.switch: error: ") and last.endswith("nope.yaml: file not found")
