"""`benchmarks.published` with a record other than Megatron-LM's: its own profile, vocabulary, sequence length,
attention and recompute, runs given by time instead of TFLOP/s; and records it cannot cost, refused in one line that
names the file and the field."""

from __future__ import annotations

import pytest
import yaml

from benchmarks.published import all_cases, load_record, main, megatron_job

RECORD = {
    "profile": "slurm/profiles/h100-8x8.yaml",
    "model_defaults": {"vocab_size": 32000, "seq_len": 4096},
    "attention": "sdpa",
    "recompute": "none",
    "runs": [
        {"name": "2.7B", "layers": 32, "hidden": 2560, "heads": 32, "gpus": 16, "t": 2, "p": 1, "mbs": 2, "gbs": 256,
         "iter_time_s": 3.0},
        {"name": "2.7B-tp1", "layers": 32, "hidden": 2560, "heads": 32, "gpus": 16, "t": 1, "p": 1, "mbs": 1,
         "gbs": 256, "tflops": 400},
    ],
}  # fmt: skip


def write(tmp_path, record, name="record.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(record) if not isinstance(record, str) else record)
    return path


def test_another_record_is_costed_with_its_own_settings(tmp_path):
    cases = all_cases(load_record(write(tmp_path, RECORD)))
    assert [c.label for c in cases] == ["2.7B", "2.7B-tp1"] and {c.group for c in cases} == {"runs"}
    timed, rated = cases
    assert (timed.d, timed.t, timed.p) == (8, 2, 1) and timed.feasible, timed.reason
    # A run given by its time: the ratio is the published time over the predicted one.
    assert timed.ratio == pytest.approx(3.0 / timed.prediction.iter_time_s)
    assert rated.published_tflops == 400
    # The record's vocabulary and sequence length reach the job (the default record's are 51,200 and 2,048).
    job = megatron_job(RECORD["runs"][0], mbs=2, gbs=256, recompute="none", vocab=32000, seq=4096)
    assert (job.model.vocab_size, job.model.seq_len, job.parallel.recompute) == (32000, 4096, "none")
    # The same runs under the default record's settings cost differently (longer sequence, no recompute, sdpa).
    plain = all_cases(load_record(write(tmp_path, {k: v for k, v in RECORD.items()
                                                   if k not in ("model_defaults", "attention", "recompute")}, "b.yaml")))
    assert plain[0].prediction.iter_time_s != pytest.approx(timed.prediction.iter_time_s, rel=0.01)


def test_main_writes_the_json_of_another_record(tmp_path, capsys):
    out = tmp_path / "mine.json"
    assert main(["--record", str(write(tmp_path, RECORD)), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "runs: predicted/published from" in text and out.exists()


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"runs": [{**RECORD["runs"][0], "gpus": 15}]}, "runs[0].gpus: 15 GPUs are not a multiple of t·p = 2"),
        ({"tabel_1": []}, "tabel_1: unknown field; valid: profile"),
        ({"profile": None}, "profile: missing"),
        ({"runs": [{**RECORD["runs"][0], "tflops": 100}]}, "runs[0]: give exactly one of tflops"),
        ({"runs": [{**RECORD["runs"][0], "heads": "many"}]}, "runs[0].heads: must be a positive integer"),
        ({"attention": "flash"}, "attention: must be materialized or sdpa"),
        ({"model_defaults": {"vocab": 3}}, "model_defaults: must be a mapping of vocab_size and seq_len"),
        ({"runs": [], "table_2": None}, "runs: must be a non-empty list"),
        ({"profile": "slurm/profiles/nope.yaml"}, "nope.yaml"),
        ({"figure_13": {"model": {"name": "x", "layers": 2, "hidden": 64, "heads": 2}, "gpus": 64, "mbs": 1,
                        "gbs": [32], "configs": [[3, 8]]}}, "figure_13: every [t, p] must be positive integers"),
    ],
)  # fmt: skip
def test_a_record_that_cannot_be_costed_is_refused_in_one_line(tmp_path, capsys, change, expected):
    record = {**RECORD, **change}
    record = {k: v for k, v in record.items() if v is not None}
    path = write(tmp_path, record)
    with pytest.raises(SystemExit) as exit_:
        main(["--record", str(path), "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert str(path) in err and expected in err and "Traceback" not in err


@pytest.mark.parametrize(("text", "expected"), [("runs: [1, 2\n", "invalid YAML"), ("- 1\n", "expected a mapping")])
def test_a_broken_record_file_is_refused_in_one_line(tmp_path, capsys, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit):
        main(["--record", str(path)])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err
    with pytest.raises(SystemExit):
        main(["--record", str(tmp_path / "missing.yaml")])
    assert "missing.yaml: file not found" in capsys.readouterr().err
