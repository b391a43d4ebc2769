"""`benchmarks.published` against more records: the ones added under tests/published/ (MT-NLG 530B, GPT-NeoX-20B,
Llama 3 405B) load and cost; and the bad records a reviewer's hand-written one can be — a figure's list given as a
number, an empty section, a flag given as a string, an infinite or mistyped unit, a setting the format cannot say —
are refused in one line naming the file, the run and the field, where they used to end in a traceback or be
costed silently wrong (tests/test_published_record.py holds the first such cases)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from benchmarks.common import REPO
from benchmarks.published import all_cases, load_record, main

PUBLISHED = REPO / "tests" / "published"
NEW_RECORDS = ("mt_nlg_530b.yaml", "gpt_neox_20b.yaml", "llama3_405b.yaml")

BASE = {
    "profile": "slurm/profiles/a100-4x8.yaml",
    "profile_set": ["network.inter_node_bandwidth=1600 Gbit/s"],
    "model_defaults": {"vocab_size": 51200, "seq_len": 2048},
}
RUN = {"name": "1.7B", "layers": 24, "hidden": 2304, "heads": 24, "t": 1, "p": 1, "gpus": 32, "mbs": 16, "gbs": 512,
       "tflops": 137}  # fmt: skip  (Table 1's first row of the SC21 paper)
MODEL = {"name": "x", "layers": 24, "hidden": 2304, "heads": 24}
FIG13 = {"model": MODEL, "gpus": 32, "mbs": 1, "gbs": [32], "configs": [[1, 1]]}
FIG14 = {"model": MODEL, "gpus": 32, "mbs": 1, "gbs": [64], "pipeline_sizes": [2]}
FIG16 = {"model": MODEL, "gpus": 32, "t": 1, "p": 1, "gbs": [64], "mbs": [1]}


def refused(tmp_path, capsys, text: str) -> tuple[str, str]:
    """The CLI's one line for the record `text`, and the record's path (which the line must name)."""
    path = tmp_path / "record.yaml"
    path.write_text(text)
    out = tmp_path / "x.json"
    with pytest.raises(SystemExit) as exit_:
        main(["--record", str(path), "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert "Traceback" not in err and str(path) in err and not out.exists(), err
    return err, str(path)


def run(**change):
    return {**RUN, **change}


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        # A figure's sweep given as one number, or with a bad element, ended in a TypeError traceback or in the
        # trainer's job naming `batch.mbs_choices` of a run "x" instead of the figure's field.
        ({"figure_13": {**FIG13, "gbs": 32}}, "figure_13.gbs: must be a non-empty list of positive integers, got 32"),
        ({"figure_14": {**FIG14, "gbs": 64}}, "figure_14.gbs: must be a non-empty list of positive integers"),
        ({"figure_16": {**FIG16, "mbs": 1}}, "figure_16.mbs: must be a non-empty list of positive integers, got 1"),
        ({"figure_16": {**FIG16, "mbs": [0]}}, "figure_16.mbs: must be a non-empty list of positive integers"),
        ({"figure_13": {**FIG13, "gbs": ["32"]}}, "figure_13.gbs: must be a non-empty list of positive integers"),
        ({"figure_13": {**FIG13, "mbs": "one"}}, "figure_13.mbs: must be a positive integer, got 'one'"),
        ({"figure_16": {**FIG16, "t": "one"}}, "figure_16.t: must be a positive integer, got 'one'"),
        ({"figure_14": {**FIG14, "pipeline_sizes": 2}},
         "figure_14.pipeline_sizes: must be a non-empty list of positive integers, got 2"),
        # An empty sweep or table costed nothing and exited 0, silently.
        ({"figure_13": {**FIG13, "configs": []}}, "figure_13.configs: must be a non-empty list of [t, p]"),
        ({"figure_13": {**FIG13, "gbs": []}}, "figure_13.gbs: must be a non-empty list of positive integers"),
        ({"table_2": {"model": MODEL, "gbs": 512, "rows": []}}, "table_2.rows: must be a non-empty list of runs"),
        # A figure's batch that is not whole micro-batches per replica was costed (as a rejected layout) where a
        # run's is refused.
        ({"figure_13": {**FIG13, "gbs": [33]}},
         "figure_13.gbs: 33 is not a multiple of d·mbs = 32·1 at t = 1, p = 1 (whole micro-batches per replica)"),
        ({"figure_14": {**FIG14, "gbs": [10]}}, "figure_14.gbs: 10 is not a multiple of d·mbs = 16·1 at t = 1, p = 2"),
        # What the figure says is best must be one of what it swept (tests/test_costmodel_published.py reads it).
        ({"figure_13": {**FIG13, "best": [3, 3]}}, "figure_13.best: [3, 3] is not one of its configs"),
        ({"figure_16": {**FIG16, "best_mbs": 2}}, "figure_16.best_mbs: 2 is not one of its mbs [1]"),
        ({"figure_14": {**FIG14, "order": "increasing"}}, "figure_14.order: must be decreasing_with_p"),
        # profile_set items that are not strings reached load_profile and ended in an AttributeError traceback.
        ({"profile_set": [1600]}, "profile_set[0]: must be a string key=value"),
        ({"profile_set": [{"network.inter_node_bandwidth": "1600 Gbit/s"}]}, "profile_set[0]: must be a string key=value"),
        # A profile that is not a path was reported as missing.
        ({"profile": 5}, "profile: must be the path of a cluster profile"),
        # A profile the repository lacks (another GPU): what to do instead.
        ({"profile": "slurm/profiles/h800-8x8.yaml"},
         "profile: slurm/profiles/h800-8x8.yaml: file not found (a relative path is read from the repository, "),
        # `sharded_dp: 'no'` was bool('no') = True: the run was costed as ZeRO-3, silently.
        ({"runs": [run(sharded_dp="no")]}, "runs[0].sharded_dp: must be true or false, got 'no'"),
        # Virtual stages without a pipeline were ignored silently.
        ({"runs": [run(v=2)]}, "runs[0].v: 2 virtual stages need a pipeline (p > 1)"),
        # An infinite time or memory: no ratio (the run silently left out of the summary), a ZeroDivisionError
        # traceback, or "inf" printed as the published memory.
        ({"runs": [{**run(iter_time_s=math.inf), "tflops": None}]}, "runs[0].iter_time_s: must be a positive number (finite)"),
        ({"runs": [{**run(tokens_per_s=math.inf), "tflops": None}]}, "runs[0].tokens_per_s: must be a positive number (finite)"),
        ({"runs": [run(memory_gb=math.inf)]}, "runs[0].memory_gb: must be a positive number (finite)"),
        # PyYAML reads 1.2e4 (no sign in the exponent) as text; the hint blamed a missing dot.
        ({"runs": [{**run(tokens_per_s="1.2e4"), "tflops": None}]},
         "runs[0].tokens_per_s: must be a positive number (finite), got '1.2e4' (text, not a number: YAML 1.1 reads "
         "e-notation without a sign in the exponent"),
        ({"model_defaults": {"vocab_size": 51200, "seqlen": 2048}, "runs": [RUN]},
         "model_defaults.seqlen: unknown field; valid: vocab_size, seq_len"),
        # A run without a usable name was labelled "None" or "['a']" or "".
        ({"runs": [run(name=None)]}, "runs[0].name: must be a non-empty name, got None"),
        ({"runs": [run(name="")]}, "runs[0].name: must be a non-empty name, got ''"),
        ({"runs": [run(name=["a"])]}, "runs[0].name: must be a non-empty name, got ['a']"),
        # What the format cannot say is named as such, not as a misspelling of one of the valid keys.
        ({"runs": [run(cp=16)]}, "runs[0].cp: context parallelism is not in cona's cost model"),
        ({"runs": [run(sp=True)]}, "runs[0].sp: is written sequence_parallel: true (Megatron's --sequence-parallel)"),
        ({"runs": [run(sequence_parallel="yes")]}, "runs[0].sequence_parallel: must be true or false, got 'yes'"),
        ({"sequence_parallel": 1, "runs": [RUN]}, "record.yaml: sequence_parallel: must be true or false, got 1"),
        ({"cp": 16, "runs": [RUN]}, "record.yaml: cp: context parallelism is not in cona's cost model"),
        # Grouped-query attention on a GPT was refused by the trainer's job as "field 'model'" of the run's name.
        ({"flops": "megatron-core", "runs": [run(kv_heads=8)]},
         "runs[0].kv_heads: a gpt has one key/value head per query head (24); grouped-query attention is family: llama"),
        ({"flops": "megatron-core", "runs": [run(family="mistral")]},
         "runs[0].family: must be one of gpt, llama, bert, got 'mistral' (a Llama-like model"),
    ],
)  # fmt: skip
def test_a_bad_record_is_refused_in_one_line_naming_the_field(tmp_path, capsys, change, expected):
    record = {**BASE, **change}
    if not any(k in change for k in ("runs", "table_2", "figure_13", "figure_14", "figure_16")):
        record["runs"] = [RUN]
    for row in record.get("runs", []):
        for key in [k for k, v in row.items() if v is None and k != "name"]:
            del row[key]
    err, _ = refused(tmp_path, capsys, yaml.safe_dump(record))
    assert expected in err, err


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_an_empty_record_is_called_empty(tmp_path, capsys, text):
    """An empty file was answered "profile: missing", as if only the profile were."""
    err, path = refused(tmp_path, capsys, text)
    assert f"{path}: the record is empty: give profile and at least one of runs, table_1" in err, err


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        # nvidia-smi's MiB given as GB: 1000x the memory, printed beside the model's as a ratio of 0.00.
        ({"memory_gb": 76000}, "runs: run '1.7B': its published memory of 76,000 GB per GPU is above the "
                               "A100-80GB's 80 GB (profile a100-4x8); check memory_gb is in GB per GPU"),
        # Terabytes given as GB: a ratio of 7,694 printed as if the memory model were that far off.
        ({"memory_gb": 0.04}, "runs: run '1.7B': its published memory of 0.04 GB per GPU is under 1% of the "
                              "A100-80GB's 80 GB (profile a100-4x8); check memory_gb is in GB (not TB) per GPU"),
        # Milliseconds given as seconds: a run 1000x slower than published, costed as a model 640x too fast.
        ({"iter_time_s": 2100, "tflops": None}, "runs: run '1.7B': its published rate is 0.23 TFLOP/s per GPU by the "
                                                "megatron-sc21 formula, under 1% of the A100-80GB's peak of 312"),
    ],
)  # fmt: skip
def test_a_published_number_in_the_wrong_unit_is_refused(tmp_path, capsys, change, expected):
    row = {k: v for k, v in run(**change).items() if v is not None}
    err, _ = refused(tmp_path, capsys, yaml.safe_dump({**BASE, "runs": [row]}))
    assert expected in err, err
    assert "iter_time_s is in seconds" in err or "not MiB" in err or "not TB" in err, err


@pytest.mark.parametrize("name", NEW_RECORDS)
def test_the_new_records_load_and_cost(tmp_path, capsys, name):
    """Each added record loads, every run is costed (a prediction and a ratio) and the CLI writes its JSON. No
    accuracy target is asserted: what each is off by, and why, is in the record."""
    record = load_record(PUBLISHED / name)
    cases = all_cases(record)
    assert len(cases) == len(record["runs"]) >= 1
    for c in cases:
        assert c.prediction is not None and c.ratio is not None and 0.2 < c.ratio < 5, (c.label, c.ratio)
    out = tmp_path / "out.json"
    assert main(["--record", str(PUBLISHED / name), "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert [c["label"] for c in saved["cases"]] == [str(r["name"]) for r in record["runs"]]
    assert "predicted/published from" in capsys.readouterr().out


def test_a_sequence_parallel_run_is_costed_with_its_memory(tmp_path):
    """`sequence_parallel: true` (a run's or the record's) reaches the job the run is costed with: under tp its
    activations are slices of the sequence (less memory), the same bytes cross the tp links under full recompute."""
    runs = [run(name="plain", t=8, gpus=64), run(name="sp", t=8, gpus=64, sequence_parallel=True)]
    path = tmp_path / "record.yaml"
    path.write_text(yaml.safe_dump({**BASE, "runs": runs}))
    plain, sp = all_cases(load_record(path))
    assert sp.prediction.activation_bytes < plain.prediction.activation_bytes
    assert sp.prediction.tp_comm_s == plain.prediction.tp_comm_s
    path.write_text(yaml.safe_dump({**BASE, "sequence_parallel": True, "runs": runs[:1]}))
    (whole,) = all_cases(load_record(path))
    assert whole.prediction.activation_bytes == sp.prediction.activation_bytes


def test_the_mt_nlg_runs_are_the_papers_own_tflops():
    """The MT-NLG record gives iteration times; by the SC21 formula they are the paper's 126, 121 and 113 TFLOP/s
    per GPU (a check that the record's shape, batch and vocabulary are the paper's)."""
    cases = all_cases(load_record(PUBLISHED / "mt_nlg_530b.yaml"))
    assert [round(c.published_tflops) for c in cases] == [126, 120, 113]  # 120.4: the paper rounds to 121
    assert [(c.t, c.p, c.d, c.gbs) for c in cases] == [(8, 35, 8, 1920), (8, 35, 10, 1920), (8, 35, 12, 1920)]


def test_a_missing_profile_names_the_shipped_ones(tmp_path, capsys):
    """A GPU the repository has no profile for: the line says what to give instead (it said "file not found")."""
    err, _ = refused(tmp_path, capsys, yaml.safe_dump({**BASE, "profile": "slurm/profiles/h800-8x8.yaml", "runs": [RUN]}))
    assert "give a shipped profile (slurm/profiles/a100-16x8.yaml, slurm/profiles/a100-4x8.yaml" in err, err
    assert "with profile_set overrides for another accelerator or network" in err, err


def test_a_long_run_name_keeps_the_table_aligned(tmp_path, capsys):
    """Run names are free text ("MT-NLG 530B 280 nodes"): a name longer than the column shifted its row."""
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump({**BASE, "runs": [RUN, run(name="a run name longer than the column")]}))
    assert main(["--record", str(path), "--out", str(tmp_path / "x.json")]) == 0
    header, _, *rows = capsys.readouterr().out.splitlines()[:4]
    end = header.index("GPUs") + len("GPUs")
    assert all(row[end - 2 : end] == "32" for row in rows), [header, *rows]


def test_a_bad_run_is_named_by_its_position_and_its_name(tmp_path):
    """A record of dozens of runs: `runs[1]` and the run's own name, to find it by either."""
    from benchmarks.published import RecordError, load_record

    record = tmp_path / "r.yaml"
    record.write_text(
        "profile: slurm/profiles/a100-4x8.yaml\n"
        "runs:\n"
        "  - {name: ok, layers: 2, hidden: 64, heads: 4, gpus: 8, t: 1, p: 1, mbs: 1, gbs: 8, tflops: 10}\n"
        "  - {name: 'GPT 2B, 64 GPUs', layers: 2, hidden: 64, heads: 4, gpus: 8, t: 3, p: 1, mbs: 1, gbs: 8, tflops: 10}\n"
    )
    with pytest.raises(RecordError) as raised:
        load_record(record)
    assert "runs[1].gpus" in str(raised.value) and "(the run named 'GPT 2B, 64 GPUs')" in str(raised.value)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        # A layout no run can have was costed as a rejected row with a ratio, and the command exited 0.
        ({"runs": [run(t=5, gpus=40)]}, "runs[0].t: t = 5 does not divide heads = 24 (each tensor-parallel rank holds "
                                        "whole attention heads); fix t or the model's heads"),
        ({"flops": "megatron-core", "runs": [run(family="llama", kv_heads=4, t=8, gpus=64, heads=24)]},
         "runs[0].t: t = 8 does not divide kv_heads = 4"),
        ({"flops": "megatron-core", "runs": [run(ffn_hidden=6001, t=2, gpus=64)]},
         "runs[0].t: t = 2 does not divide ffn_hidden = 6001"),
        ({"runs": [run(t=8, gpus=64, seq_len=2052, sequence_parallel=True)]},
         "runs[0].t: t = 8 does not divide seq_len = 2052, which sequence parallelism splits over the t ranks"),
        ({"runs": [run(p=32, gpus=32, gbs=512)]}, "runs[0].p: p = 32 pipeline stages need at least 32 layers, the "
                                                  "model has 24; fix p or layers"),
        ({"runs": [run(p=8, v=4, gpus=32, gbs=512)]}, "runs[0].p: p·v = 8·4 pipeline stages need at least 32 layers"),
        ({"table_2": {"model": MODEL, "gbs": 512, "rows": [{"scheme": "ptd-p", "gpus": 40, "t": 5, "p": 1, "mbs": 1,
                                                             "tflops": 100}]}},
         "table_2.rows[0].t: t = 5 does not divide heads = 24"),
        ({"figure_13": {**FIG13, "gpus": 36, "gbs": [36], "configs": [[9, 1]]}},
         "figure_13.configs: t = 9 does not divide heads = 24"),
        ({"figure_14": {**FIG14, "pipeline_sizes": [32], "gbs": [32]}},
         "figure_14.pipeline_sizes: p = 32 pipeline stages need at least 32 layers, the model has 24"),
        # An integer past 2^53 was refused by the trainer's job as its own field (batch.max_gbs), or overflowed the
        # rate's float arithmetic in a traceback; hundreds of digits are not printed.
        ({"runs": [run(gbs=512 * 10**400)]}, "runs[0].gbs: must be a positive integer of at most 2^53, got 512000000000"),
        ({"runs": [run(tflops=10**400)]}, "runs[0].tflops: must be a positive number (finite), got 100000000000..."),
        ({"runs": [run(memory_gb=10**400)]}, "runs[0].memory_gb: must be a positive number (finite)"),
        ({"runs": [{**run(tokens_per_s=10**400), "tflops": None}]}, "runs[0].tokens_per_s: must be a positive number"),
        # Text where a count goes: the hint for quotes and for YAML's e-notation without a signed exponent.
        ({"runs": [run(layers="24")]}, "runs[0].layers: must be a positive integer, got '24' (text, not a number: "
                                       "remove the quotes)"),
        ({"runs": [run(gbs="5e2")]}, "runs[0].gbs: must be a positive integer, got '5e2' (text, not a number: YAML "
                                     "1.1 reads e-notation without a sign in the exponent"),
    ],
)  # fmt: skip
def test_a_layout_or_number_no_run_can_have_is_refused(tmp_path, capsys, change, expected):
    record = {**BASE, **change}
    for row in record.get("runs", []):
        for key in [k for k, v in row.items() if v is None]:
            del row[key]
    err, _ = refused(tmp_path, capsys, yaml.safe_dump(record))
    assert expected in err, err
    assert len(err) < 400, err


def test_a_huge_published_rate_is_shown_by_its_magnitude(tmp_path, capsys):
    """A rate of 1e30 TFLOP/s was printed with its 31 digits."""
    err, _ = refused(tmp_path, capsys, yaml.safe_dump({**BASE, "runs": [run(tflops=1e30)]}))
    assert "its published rate is 1e+30 TFLOP/s per GPU" in err, err


def test_a_date_as_a_run_name_says_to_quote_it(tmp_path, capsys):
    """`name: 2021-04-01` is a date to YAML: the line says so."""
    text = yaml.safe_dump({**BASE, "runs": [run(name="NAME")]}).replace("name: NAME", "name: 2021-04-01")
    err, _ = refused(tmp_path, capsys, text)
    assert "runs[0].name: must be a non-empty name, got datetime.date(2021, 4, 1) (YAML did not read it as text: " \
           "quote it)" in err, err  # fmt: skip


@pytest.mark.parametrize("out", ["dir", "missing/x.json"])
def test_an_out_that_cannot_be_written_is_one_line(tmp_path, capsys, out):
    """--out a directory, or under a file: an IsADirectoryError or NotADirectoryError traceback after the table."""
    (tmp_path / "missing").write_text("a file, not a folder")
    (tmp_path / "dir").mkdir()
    record = tmp_path / "record.yaml"
    record.write_text(yaml.safe_dump({**BASE, "runs": [RUN]}))
    with pytest.raises(SystemExit) as exit_:
        main(["--record", str(record), "--out", str(tmp_path / out)])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"--out {tmp_path / out}: " in err, err


def test_a_table_2_section_gets_its_ratio_line_as_runs_and_table_1_do(tmp_path, capsys):
    # It printed only a rank correlation: the range of predicted/published was in the table's rows alone.
    rows = [{"scheme": "ptd-p", "gpus": 32, "t": 2, "p": 2, "mbs": 1, "tflops": 120},
            {"scheme": "zero-3", "gpus": 32, "t": 1, "p": 1, "mbs": 1, "tflops": 90}]  # fmt: skip
    path = tmp_path / "record.yaml"
    path.write_text(yaml.safe_dump({**BASE, "table_2": {"model": MODEL, "gbs": 512, "rows": rows}}))
    assert main(["--record", str(path), "--out", str(tmp_path / "x.json")]) == 0
    out = capsys.readouterr().out
    ratios = [c["ratio"] for c in json.loads((tmp_path / "x.json").read_text())["cases"]]
    line = next(x for x in out.splitlines() if x.startswith("table_2: predicted/published"))
    assert line.startswith(f"table_2: predicted/published from {min(ratios):.2f} to {max(ratios):.2f} (worst "), line
    assert "table_2: rank correlation" in out
