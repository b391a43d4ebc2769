"""`benchmarks.published` with a record other than Megatron-LM's: its own profile, vocabulary, sequence length,
attention and recompute, runs given by time instead of TFLOP/s; and records it cannot cost, refused in one line that
names the file and the field."""

from __future__ import annotations

import pytest
import yaml

from benchmarks.common import REPO
from benchmarks.published import (
    all_cases,
    core_flops,
    load_record,
    main,
    megatron_job,
    paper_flops,
    record_cluster,
    runs,
)

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
    assert "rank correlation" not in text  # two runs rank nothing
    three = {**RECORD, "runs": [*RECORD["runs"], {**RECORD["runs"][0], "name": "2.7B-b", "iter_time_s": 9.0}]}
    assert main(["--record", str(write(tmp_path, three, "three.yaml")), "--out", str(out)]) == 0
    # Published 3.0 s and 9.0 s for the same run: the one published 3x faster ranks first, the model ties them.
    assert "runs: rank correlation of predicted and published TFLOP/s" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"runs": [{**RECORD["runs"][0], "gpus": 15}]}, "runs[0].gpus: 15 GPUs are not a multiple of t·p = 2"),
        ({"tabel_1": []}, "tabel_1: unknown field; valid: profile"),
        ({"profile": None}, "profile: missing"),
        ({"runs": [{**RECORD["runs"][0], "tflops": 100}]}, "runs[0]: give exactly one of tflops"),
        ({"runs": [{**RECORD["runs"][0], "heads": "many"}]}, "runs[0].heads: must be a positive integer"),
        ({"attention": "flash"}, "attention: must be materialized or sdpa"),
        ({"model_defaults": {"vocab": 3}}, "model_defaults.vocab: unknown field; valid: vocab_size, seq_len"),
        ({"runs": [], "table_2": None}, "runs: must be a non-empty list"),
        ({"profile": "slurm/profiles/nope.yaml"}, "nope.yaml"),
        ({"figure_13": {"model": {"name": "x", "layers": 2, "hidden": 64, "heads": 2}, "gpus": 64, "mbs": 1,
                        "gbs": [32], "configs": [[3, 8]]}}, "figure_13: every [t, p] must be positive integers"),
        # A misspelled key is answered with the valid ones (it used to be ignored: `vv: 2` ran without virtual stages).
        ({"runs": [{**RECORD["runs"][0], "vv": 2}]}, "runs[0].vv: unknown field; valid: name, layers, hidden, heads"),
        ({"runs": [{**RECORD["runs"][0], "seq": 2048}]}, "runs[0].seq: unknown field; valid: name,"),
        ({"table_2": {"model": {"name": "x", "layers": 2, "hidden": 64, "heads": 2}, "gbs": 8,
                      "rows": [{"scheme": "ptd-p", "t": 1, "p": 1, "gpus": 8, "mbs": 1, "tflop": 9}]}},
         "table_2.rows[0].tflop: unknown field; valid: scheme, gpus, t, p, mbs, tflops, iter_time_s"),
        ({"figure_16": {"model": {"name": "x", "layers": 2, "hidden": 64, "heads": 2}, "gpus": 8, "t": 1, "p": 1,
                        "gbs": [8], "mbs": [1], "best_mb": 1}}, "figure_16.best_mb: unknown field; valid: model,"),
        ({"figure_14": {"model": {"name": "x", "layers": 2, "hidden": 64, "heads": 2, "vocab": 8}, "gpus": 8,
                        "mbs": 1, "gbs": [8], "pipeline_sizes": [2]}}, "figure_14.model.vocab: unknown field"),
        # The model's shape and the batch, refused before costing, naming the run's field (a model the trainer's job
        # refused was reported as the record's "profile").
        ({"runs": [{**RECORD["runs"][0], "heads": 100}]}, "runs[0].heads: 100 heads do not divide hidden = 2560"),
        ({"runs": [{**RECORD["runs"][0], "gbs": 100}]}, "runs[0].gbs: 100 is not a multiple of d·mbs = 8·2"),
        ({"runs": [{**RECORD["runs"][0], "recompute": "some"}]}, "runs[0].recompute: must be none, selective or full"),
        ({"runs": [{**RECORD["runs"][0], "vocab_size": 0}]}, "runs[0].vocab_size: must be a positive integer"),
        ({"recompute": "all"}, "record.yaml: recompute: must be none, selective or full"),
        # Models other than the SC21 paper's GPT, and what a run published.
        ({"runs": [{**RECORD["runs"][0], "family": "llama"}]},
         "runs[0]: model '2.7B' is not a GPT with ffn_hidden = 4·hidden and no GQA, which the paper's FLOP formula "
         "counts; set the record's flops: megatron-core"),
        ({"flops": "6nd"}, "record.yaml: flops: must be one of megatron-sc21, megatron-core, got '6nd'"),
        ({"flops": "megatron-core", "runs": [{**RECORD["runs"][0], "family": "mamba"}]},
         "runs[0].family: must be one of gpt, llama, bert, got 'mamba'"),
        ({"flops": "megatron-core", "runs": [{**RECORD["runs"][0], "kv_heads": 5}]},
         "runs[0].kv_heads: 5 key/value heads do not divide heads = 32"),
        ({"flops": "megatron-core", "runs": [{**RECORD["runs"][0], "ffn_hidden": 0}]},
         "runs[0].ffn_hidden: must be a positive integer, got 0"),
        ({"runs": [{**RECORD["runs"][0], "tokens_per_s": 3000}]},
         "runs[0]: give exactly one of tflops (per GPU), iter_time_s and tokens_per_s (per GPU)"),
        ({"runs": [{**RECORD["runs"][0], "memory_gb": "40 GB"}]}, "runs[0].memory_gb: must be a positive number"),
        ({"runs": [{**RECORD["runs"][0], "tie_embeddings": "yes"}]}, "runs[0].tie_embeddings: must be true or false"),
        ({"flops": "megatron-core", "runs": [{**RECORD["runs"][0], "family": "bert", "tie_embeddings": False}]},
         "runs[0].tie_embeddings: a BERT's MLM decoder is always tied"),
        ({"runs": [{**RECORD["runs"][0], "cp": 2}]}, "runs[0].cp: context parallelism is not in cona's cost model"),
        # A record's own profile_set item is named as the record's, not as a command-line flag no one gave.
        ({"profile_set": ["network.bandwidth_efficiency=80"]},
         "the record's profile_set item network.bandwidth_efficiency=80"),
        ({"table_2": {"model": {"name": "x", "layers": 2, "hidden": 64, "heads": 2, "kv_heads": 1}, "gbs": 8,
                      "rows": [{"scheme": "ptd-p", "t": 1, "p": 1, "gpus": 8, "mbs": 1, "tflops": 9}]}},
         "table_2.model: model 'x' is not a GPT"),
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


def test_a_model_the_trainer_refuses_is_named_by_its_run_not_as_the_profile(tmp_path, capsys):
    path = write(tmp_path, {**RECORD, "runs": [{**RECORD["runs"][0], "seq_len": 1}]})  # a job needs seq_len > 1
    with pytest.raises(SystemExit) as exit_:
        main(["--record", str(path), "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{path}: published run 2.7B" in err and "seq_len" in err and "profile" not in err, err


def test_a_published_rate_above_the_accelerators_peak_is_refused_in_one_line(tmp_path, capsys):
    """Tokens/s of the whole cluster given as per GPU (a rate 16× too high here) would be costed as a run the model
    is 16× too slow for; no run can beat the peak, so the record is refused, naming the run and what to check."""
    run = {**RECORD["runs"][0], "tokens_per_s": 40000}
    run.pop("iter_time_s")
    path = write(tmp_path, {**RECORD, "runs": [run, RECORD["runs"][1]]})
    with pytest.raises(SystemExit) as exit_:
        main(["--record", str(path), "--out", str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{path}: runs: run '2.7B': its published rate is " in err and "above the H100-SXM-80GB's peak of 989" in err, err
    assert "tokens_per_s (per GPU)" in err and not (tmp_path / "x.json").exists(), err
    # The same run at a rate per GPU (2,500 tokens/s: about 200 TFLOP/s) is costed.
    run["tokens_per_s"] = 2500
    assert main(["--record", str(write(tmp_path, {**RECORD, "runs": [run]})), "--out", str(tmp_path / "x.json")]) == 0


def test_a_run_sets_its_own_vocabulary_sequence_recompute_and_attention(tmp_path):
    """A record mixing runs of several settings (another tokenizer, context, selective recompute) in one list."""
    own = {**RECORD["runs"][0], "name": "BLOOM 176B t4 p12 (final)", "vocab_size": 250880, "seq_len": 2048,
           "recompute": "full", "attention": "materialized"}  # fmt: skip
    record = load_record(write(tmp_path, {**RECORD, "runs": [RECORD["runs"][0], own]}))
    plain, mine = all_cases(record)
    # A free-text name (spaces, parentheses) is the label; the job gets a name it accepts.
    assert mine.label == "BLOOM 176B t4 p12 (final)" and mine.prediction is not None
    job = megatron_job(own, mbs=2, gbs=256)
    assert job.name == "published-BLOOM-176B-t4-p12-final"
    # The run's settings, not the record's (32,000 / 4,096 / none / sdpa), are costed: the same run with the
    # record's settings is plain, and the paper's FLOP count uses the run's vocabulary and sequence length.
    assert mine.prediction.iter_time_s != pytest.approx(plain.prediction.iter_time_s, rel=0.05)
    assert mine.flops == pytest.approx(paper_flops(layers=32, hidden=2560, gbs=256, seq=2048, vocab=250880))
    same = all_cases(load_record(write(tmp_path, {**RECORD, "model_defaults": {"vocab_size": 250880, "seq_len": 2048},
                                                  "recompute": "full", "attention": "materialized",
                                                  "runs": [RECORD["runs"][0]]}, "same.yaml")))  # fmt: skip
    assert same[0].prediction.iter_time_s == pytest.approx(mine.prediction.iter_time_s)


def test_the_bloom_record_loads_and_its_training_run_is_costed():
    """tests/published/bloom_176b.yaml (docs/costmodel.md, "Another record: BLOOM-176B"): every row is a run given
    by its time on 384 GPUs; the training run itself is predicted within 15% of its published time."""
    record = load_record(REPO / "tests" / "published" / "bloom_176b.yaml")
    rows = record["runs"]
    assert len(rows) == 26 and all("iter_time_s" in r and r["gpus"] == 384 for r in rows)
    final = [r for r in rows if r["name"] == "BLOOM-176B"]
    (case,) = runs({**record, "runs": final}, record_cluster(record))
    assert (case.t, case.p, case.d, case.mbs, case.gbs) == (4, 12, 8, 2, 2048)
    assert 0.85 < case.ratio < 1.15, case.ratio


def test_the_command_line_overrides_the_records_cluster(tmp_path, capsys):
    """`--profile-set` after the record's own (a reviewer's other bandwidth, without editing the record); a bad
    override is one line naming the profile."""
    import json

    path, out = write(tmp_path, RECORD), tmp_path / "slow.json"
    assert main(["--record", str(path), "--out", str(tmp_path / "base.json")]) == 0
    assert main(["--record", str(path), "--out", str(out), "--profile-set", "network.inter_node_bandwidth=10 Gbit/s"]) == 0
    base, slow = (json.loads((tmp_path / n).read_text()) for n in ("base.json", "slow.json"))
    assert slow["profile_set"] == ["network.inter_node_bandwidth=10 Gbit/s"] and base["profile_set"] == []
    # 16 GPUs over two nodes: the data-parallel exchange crosses the slower network.
    assert slow["cases"][0]["iter_time_s"] > base["cases"][0]["iter_time_s"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["--record", str(path), "--out", str(out), "--profile-set", "network.inter_node_bandwith=1 Gbit/s"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and f"{path}: profile:" in err, err


LLAMA = {
    "profile": "slurm/profiles/h100-8x8.yaml",
    "flops": "megatron-core",
    "model_defaults": {"vocab_size": 128256, "seq_len": 8192},
    "attention": "sdpa",
    "recompute": "full",
    "runs": [
        {"name": "8B tok", "family": "llama", "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8,
         "ffn_hidden": 14336, "gpus": 64, "t": 1, "p": 1, "mbs": 1, "gbs": 64, "sharded_dp": True,
         "tokens_per_s": 5000, "memory_gb": 60},
        {"name": "8B time", "family": "llama", "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8,
         "ffn_hidden": 14336, "gpus": 64, "t": 1, "p": 1, "mbs": 1, "gbs": 64, "sharded_dp": True,
         "iter_time_s": 64 * 8192 / (5000 * 64)},
        {"name": "8B as a GPT", "layers": 32, "hidden": 4096, "heads": 32, "gpus": 64, "t": 1, "p": 1, "mbs": 1,
         "gbs": 64, "sharded_dp": True, "tflops": 400},
    ],
}  # fmt: skip


def test_a_llama_record_with_gqa_swiglu_token_rates_and_memory(tmp_path, capsys):
    """Another family in a record: grouped-query attention, a SwiGLU MLP of its own width, Megatron-Core's FLOP
    count, a run given by tokens/s per GPU and its published memory."""
    import json

    tok, timed, gpt = all_cases(load_record(write(tmp_path, LLAMA)))
    # The job is the run's model: a Llama with 8 key/value heads and a 14,336-wide gated MLP.
    job = megatron_job(LLAMA["runs"][0], mbs=1, gbs=64, recompute="full", vocab=128256, seq=8192)
    assert (job.model.family, job.model.num_kv_heads, job.model.ffn_hidden_size) == ("llama", 8, 14336)
    # Costed as such: 3·h·f MLP weights and a quarter of the key/value projections, 218M weights per layer
    # against the 4h-wide GPT's 201M (+8%; the s×s scores are the same), and SwiGLU's and RoPE's memory-bound passes.
    assert 1.05 < tok.prediction.compute_s / gpt.prediction.compute_s < 1.2
    assert tok.feasible and gpt.feasible, (tok.reason, gpt.reason)
    # Megatron-Core's count by hand: 12·B·s·l·h²·((1 + g/a + s/h) + (f/h)·3/2 + V/2lh).
    b, s_, l_, h = 64, 8192, 32, 4096
    by_hand = 12 * b * s_ * l_ * h * h * ((1 + 8 / 32 + s_ / h) + (14336 / h) * 1.5 + 128256 / (2 * l_ * h))
    assert tok.flops == pytest.approx(by_hand, rel=1e-12)
    # For the SC21 paper's GPT it is the paper's formula without the recomputed forward.
    gpt_core = core_flops(layers=l_, hidden=h, heads=32, gbs=b, seq=s_, vocab=128256)
    assert gpt_core == pytest.approx(72 * b * s_ * l_ * h * h * (1 + s_ / (6 * h) + 128256 / (12 * l_ * h)))
    # 5,000 tokens/s per GPU is the same run as its time: 64 · 8,192 tokens over 64 GPUs.
    assert tok.published_tflops == pytest.approx(timed.published_tflops)
    assert tok.published_tflops == pytest.approx(by_hand / (64 * 8192 / (5000 * 64)) / 64 / 1e12)
    assert tok.ratio == pytest.approx(timed.ratio) and tok.memory_ratio == pytest.approx(tok.prediction.memory_gb / 60)
    assert timed.memory_ratio is None
    out = tmp_path / "llama.json"
    assert main(["--record", str(write(tmp_path, LLAMA)), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "pub GB" in text and "memory: predicted/published from" in text and "over 1 runs" in text, text
    saved = json.loads(out.read_text())["cases"][0]
    assert saved["published_memory_gb"] == 60 and saved["memory_ratio"] == pytest.approx(tok.memory_ratio, abs=1e-4)


def test_tied_embeddings_a_cp_of_one_and_where_another_record_is_written(tmp_path, capsys, monkeypatch):
    """Megatron's GPTs tie the output layer to the embedding, which the format could not say (every GPT was costed
    untied: a run that trained in 80 GB was REJECTED); `cp: 1` (Llama 3's rows) was refused as context parallelism;
    `--record` without `--out` overwrote the shipped published.json."""
    tied, untied = (all_cases(load_record(write(tmp_path, {**RECORD, "runs": [{**RECORD["runs"][0], **extra}]},
                                               f"{i}.yaml")))[0] for i, extra in enumerate(({}, {"tie_embeddings": False})))  # fmt: skip
    assert tied.prediction.memory_gb < untied.prediction.memory_gb  # one copy of V·h fewer, with its grads and moments
    one = all_cases(load_record(write(tmp_path, {**RECORD, "runs": [{**RECORD["runs"][0], "cp": 1}]}, "cp1.yaml")))
    assert one[0].prediction.iter_time_s == pytest.approx(tied.prediction.iter_time_s)
    import benchmarks.common as common
    import benchmarks.published as published

    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(published, "RESULTS", tmp_path / "results")
    assert main(["--record", str(write(tmp_path, RECORD, "mine.yaml"))]) == 0
    assert (tmp_path / "results" / "published-mine.json").exists()
    assert not (tmp_path / "results" / "published.json").exists()
    assert "0.5" in published._magnitude(0.5) and published._magnitude(28447.2) == "28,447"
