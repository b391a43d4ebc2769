"""The benchmarks' shared argument checks (`benchmarks.common`): a typo or a bad number ends the command with one
line naming the flag, and the valid choices where there are some — never a traceback."""

from __future__ import annotations

import pytest

from benchmarks import endgame, noise_batch, noise_floor, ttp


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
])  # fmt: skip
def test_bad_numbers_and_modes_name_the_flag(module, argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        module.main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {says}")
