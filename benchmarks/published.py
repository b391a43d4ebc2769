"""The cost and memory models against published runs (by default Megatron-LM's, Narayanan et al., SC 2021).

    .venv/bin/python -m benchmarks.published            # prints the tables, writes benchmarks/results/published.json
    .venv/bin/python -m benchmarks.published --record my-runs.yaml --out my-runs.json   # another record

The record (`tests/published/megatron_sc21.yaml`, with its sources) is costed with cona's own model on a shipped
profile (`profile`, with `profile_set` overrides, widened to each run's node count), with the runs' settings:
recomputation (`recompute`, default full), attention (`attention`: `materialized` — unfused, the scores written to
memory, the default — or `sdpa`), sequence parallelism (`sequence_parallel`, default false), the micro-batch, global batch and virtual stages, and the models' vocabulary and
sequence length (`model_defaults`). A model is a GPT unless it says otherwise: `family` (gpt, llama — SwiGLU,
RMSNorm, RoPE — or bert), `kv_heads` (grouped-query attention), `ffn_hidden` (the MLP's width; 4·hidden by
default) and `tie_embeddings` (the output layer shares the embedding: Megatron's default for a GPT and a BERT, and
so here; a Llama's is untied unless it says so). Throughput is reported as TFLOP/s per GPU: a FLOP formula over the predicted iteration time, the
record's `flops` — `megatron-sc21`, the paper's (a GPT's, with full recomputation counted; the default), or
`megatron-core`, Megatron-Core's model FLOPs (three GEMM passes, GQA and SwiGLU counted) for every other model.
A run gives one of `tflops` (per GPU, by the record's formula), `iter_time_s` or `tokens_per_s` (per GPU); a time
or a token rate is converted with the same formula, so the ratio is published over predicted time. A run may give
the `memory_gb` per GPU it published, which is shown beside the memory model's. Every section is optional: `runs`
(or `table_1`) lists runs with their own
model (and, where they differ from the record's, their own `vocab_size`, `seq_len`, `recompute`, `attention` and
`sequence_parallel`),
`table_2` one model at several schemes, `figure_13`/`figure_14`/`figure_16` sweeps whose best configuration
the paper names. A misspelled key is refused with the list of valid ones, a key for what the format cannot say
(context parallelism, experts, a ZeRO stage; `sp` for `sequence_parallel`) with what to do instead, and a run published above the
accelerator's peak (by the record's formula), under 1% of it (milliseconds given as seconds) or with a memory above
the device's (MiB given as GB) in one line naming it; so is a layout no run can have (t not dividing heads,
kv_heads or ffn_hidden, or seq_len under sequence parallelism; fewer layers than p·v stages), while stages of
unequal size (p or p·v not dividing layers, as BLOOM's and Llama 3's) are priced and marked REJECTED; run names are
free text. A second record,
`tests/published/bloom_176b.yaml` (BLOOM-176B and the layouts benchmarked for it), shows the format on another
cluster; `tests/published/` holds more (MT-NLG 530B, GPT-NeoX-20B, Llama 3 405B: tests/test_published_records.py).
`tests/test_costmodel_published.py` asserts the targets on the default record; docs/costmodel.md shows the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from cona.orchestrator.costmodel import Prediction, predict
from cona.orchestrator.job import Job, job_from_dict
from cona.orchestrator.planner import evaluate, layout_reason
from cona.orchestrator.profile import ClusterProfile, load_profile
from cona.protocol.yamlconfig import MAX_INT, ConfigError, load_yaml

from benchmarks.common import REPO, RESULTS, results_path, run_main, shown, write_json

RECORD = REPO / "tests" / "published" / "megatron_sc21.yaml"
VOCAB, SEQ = 51200, 2048
"""The default record's vocabulary and sequence length (`model_defaults` of a record overrides them)."""
SECTIONS = ("runs", "table_1", "table_2", "figure_13", "figure_14", "figure_16")
MODEL_KEYS = ("name", "layers", "hidden", "heads")
MODEL_OPTIONS = ("family", "kv_heads", "ffn_hidden", "tie_embeddings")
"""What a model may say beyond its shape (a GPT with 4·hidden and no GQA when it says nothing)."""
FAMILIES = ("gpt", "llama", "bert")
FLOPS = ("megatron-sc21", "megatron-core")
"""The FLOP formulas a record may count TFLOP/s by (`paper_flops`, `core_flops`)."""
RATES = ("tflops", "iter_time_s", "tokens_per_s")
"""The ways a run may give what was published: TFLOP/s per GPU, seconds per iteration, tokens/s per GPU."""
RUN_SETTINGS = ("vocab_size", "seq_len", "recompute", "attention", "sequence_parallel")
"""What a run may set for itself, over the record's `model_defaults`, `recompute`, `attention` and
`sequence_parallel`."""
RUN_KEYS = (*MODEL_KEYS, *MODEL_OPTIONS, "gpus", "t", "p", "mbs", "gbs", "v", "sharded_dp", *RATES, "memory_gb",
            *RUN_SETTINGS)
TABLE_2_ROW_KEYS = ("scheme", "gpus", "t", "p", "mbs", *RATES, "memory_gb")
FIGURE_KEYS = {
    "figure_13": ("model", "gpus", "mbs", "gbs", "configs", "best"),
    "figure_14": ("model", "gpus", "mbs", "gbs", "pipeline_sizes", "order"),
    "figure_16": ("model", "gpus", "t", "p", "gbs", "mbs", "best_mbs"),
}
RECOMPUTE, ATTENTION = ("none", "selective", "full"), ("materialized", "sdpa")
_CP = "context parallelism is not in cona's cost model (its trainer has none), and a run that used it cannot be " \
      "costed without it (its GPUs are t·p·cp·d); leave the run out of the record (cp: 1 is taken: none)"  # fmt: skip
_SP = "is written sequence_parallel: true (Megatron's --sequence-parallel), for the record or for one run"
_EP = "mixture-of-experts models are not in cona's cost model; leave the run out of the record"
_ZERO = "the ZeRO stage is not a setting of the format: cona's data parallelism shards the optimizer state and " \
        "gradients (ZeRO-1/2) whatever it says; remove the key, and give sharded_dp: true for ZeRO-3"  # fmt: skip
UNSUPPORTED = {
    "cp": _CP, "context_parallel": _CP, "context_parallel_size": _CP, "context_parallelism": _CP,
    "sp": _SP, "sequence_parallelism": _SP,
    "ep": _EP, "expert_parallel": _EP, "expert_parallel_size": _EP, "experts": _EP, "num_experts": _EP,
    "zero": _ZERO, "zero_stage": _ZERO,
}  # fmt: skip
"""Keys a record may reach for that name what the format cannot say: answered with what to do, not as a misspelling
of one of the valid keys (which would send the writer looking for the right spelling of something absent)."""
MIN_PEAK_FRACTION = 0.01
"""A published rate below this fraction of the accelerator's peak is a unit mistyped (milliseconds given as
`iter_time_s`), not a run: the slowest published run of the shipped records is at 14% (ZeRO-3, 1536 GPUs)."""
MIN_MEMORY_FRACTION = 0.01
"""A published memory under this fraction of the device's is a unit mistyped (TB given as GB): no training run of
these models fits in 1% of a GPU."""
MEMORY_SLACK = 1.1
"""A published memory may exceed the profile's nominal memory by GB against GiB and nvidia-smi's total (an 80 GB
A100 shows 81,920 MiB): above this factor it is a unit mistyped (MiB as GB) or the whole node's."""


class RecordError(ValueError):
    """A record that cannot be costed: one line naming the file, the field and what to do."""


def _require(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise RecordError(f"{where}: {what}")


def _positive_int(value: Any) -> bool:
    """A count: a positive integer up to `MAX_INT`, as the trainer's job takes (a larger one was refused by the job
    naming its own field, `batch.max_gbs`, not the record's, or overflowed float arithmetic in a traceback)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_INT


def _shown(value: Any) -> str:
    """`value` for a message: an integer of hundreds of digits by its size, not in full."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:12]}... ({len(text)} characters)"


def _not_int(value: Any) -> str:
    """What is wrong with a count that is not `_positive_int`, and the hint for YAML's e-notation."""
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_INT:
        return f"must be a positive integer of at most 2^53, got {_shown(value)}"
    hint = ""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if value.strip().isdigit():
            hint = " (text, not a number: remove the quotes)"
        elif math.isfinite(number):
            hint = E_NOTATION_HINT
    return f"must be a positive integer, got {_shown(value)}{hint}"


E_NOTATION_HINT = (" (text, not a number: YAML 1.1 reads e-notation without a sign in the exponent, 1.2e4 or 6.4e1, "
                   "as text; write 1.2e+4 or the number in full)")  # fmt: skip
"""Said where a number was given as `1.2e4`: PyYAML takes it for a string (the dot was not the cause)."""


def _text_number_hint(value: Any) -> str:
    try:
        return E_NOTATION_HINT if isinstance(value, str) and math.isfinite(float(value)) else ""
    except ValueError:
        return ""


def _positive_ints(value: Any) -> bool:
    """A non-empty list of positive integers: a figure's sweep (its batch sizes, micro-batches, pipelines)."""
    return isinstance(value, list) and bool(value) and all(_positive_int(x) for x in value)


def _positive_number(value: Any) -> bool:
    """A published number: positive and finite (an infinite time gave no ratio, and the run dropped out of the
    summary; an infinite token rate divided by zero)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:  # an integer of hundreds of digits passed `< math.inf` and overflowed the rate's arithmetic (a traceback)
        return 0 < float(value) < math.inf
    except OverflowError:
        return False


_CP_KEYS = ("cp", "context_parallel", "context_parallel_size", "context_parallelism")


def _unknown(mapping: dict[str, Any], valid: tuple[str, ...]) -> list[str]:
    """The keys of `mapping` that `valid` lacks; a context-parallel degree of 1 (no context parallelism, as Llama 3's
    Table 4 writes its CP=1 rows) is no unknown key but nothing to cost."""
    one = {k for k in _CP_KEYS if k in mapping and mapping[k] == 1 and not isinstance(mapping[k], bool)}
    return sorted(str(k) for k in set(mapping) - set(valid) - one)


def _known_keys(mapping: dict[str, Any], valid: tuple[str, ...], where: str) -> None:
    """A misspelled key is named with the list of valid ones (it would otherwise be ignored, silently)."""
    unknown = _unknown(mapping, valid)
    _unsupported(unknown, where, ".")
    _require(not unknown, f"{where}.{', '.join(unknown)}", f"unknown field; valid: {', '.join(valid)}")


def _unsupported(keys: list[str], where: str, sep: str) -> None:
    """A key for something the format cannot say (context parallelism...) is answered with what to do instead."""
    for key in keys:
        _require(key not in UNSUPPORTED, f"{where}{sep}{key}", UNSUPPORTED.get(key, ""))


def _check_model(model: Any, where: str, *, alone: bool = False) -> None:
    _require(isinstance(model, dict), where, "must be a mapping with name, layers, hidden and heads")
    if alone:  # a section's model (table_2, figures): nothing but the model
        _known_keys(model, (*MODEL_KEYS, *MODEL_OPTIONS), where)
    for key in MODEL_KEYS:
        _require(key in model, f"{where}.{key}", "missing (a model needs name, layers, hidden and heads)")
    name = model["name"]  # the run's label in the tables and the JSON: None, [...] or "" labelled nothing
    # A date (`name: 2021-04-01`) or another value YAML reads as something else is answered with the quotes it needs.
    quote = "" if name is None or isinstance(name, str | list | dict) else " (YAML did not read it as text: quote it)"
    _require(isinstance(name, str | int | float) and not isinstance(name, bool) and str(name).strip() != "",
             f"{where}.name", f"must be a non-empty name, got {name!r}{quote}")  # fmt: skip
    for key in ("layers", "hidden", "heads", *(k for k in ("kv_heads", "ffn_hidden") if k in model)):
        _require(_positive_int(model[key]), f"{where}.{key}", _not_int(model[key]))
    _require(model["hidden"] % model["heads"] == 0, f"{where}.heads",
             f"{model['heads']} heads do not divide hidden = {model['hidden']}; fix heads or hidden")  # fmt: skip
    if "family" in model:
        _require(model["family"] in FAMILIES, f"{where}.family",
                 f"must be one of {', '.join(FAMILIES)}, got {model['family']!r} (a Llama-like model — SwiGLU, "
                 "RMSNorm, RoPE, grouped-query attention — is family: llama)")  # fmt: skip
    if "tie_embeddings" in model:
        _require(isinstance(model["tie_embeddings"], bool), f"{where}.tie_embeddings",
                 f"must be true or false, got {model['tie_embeddings']!r}")  # fmt: skip
        _require(model.get("family", "gpt") != "bert" or model["tie_embeddings"], f"{where}.tie_embeddings",
                 "a BERT's MLM decoder is always tied to its token embedding; remove it")  # fmt: skip
    if "kv_heads" in model:
        _require(model["heads"] % model["kv_heads"] == 0, f"{where}.kv_heads",
                 f"{model['kv_heads']} key/value heads do not divide heads = {model['heads']} (grouped-query "
                 "attention shares each among a whole number of query heads); fix kv_heads or heads")  # fmt: skip


def _check_layout(model: dict[str, Any], *, t: int, p: int, v: int, seq: int, sequence_parallel: bool,
                  at_t: str, at_p: str) -> None:  # fmt: skip
    """What no run can have: tensor parallelism that splits a head or the MLP's width, sequence parallelism that
    splits a sequence unevenly, pipeline stages without a layer. The planner marks such a layout rejected but still
    prices it (as it prices the uneven stages that Megatron-DeepSpeed's BLOOM ran), and the table printed a ratio
    for a run that cannot have been published, with exit status 0."""
    f = model.get("ffn_hidden", 4 * model["hidden"])
    for key, value, what in (("heads", model["heads"], "attention heads"),
                             ("kv_heads", model.get("kv_heads", model["heads"]), "key/value heads"),
                             ("ffn_hidden", f, "columns of the MLP")):  # fmt: skip
        _require(value % t == 0, at_t,
                 f"t = {t} does not divide {key} = {value} (each tensor-parallel rank holds whole {what}); fix t "
                 f"or the model's {key}")  # fmt: skip
    _require(t == 1 or not sequence_parallel or seq % t == 0, at_t,
             f"t = {t} does not divide seq_len = {seq}, which sequence parallelism splits over the t ranks; fix t "
             "or seq_len, or set sequence_parallel: false")  # fmt: skip
    _require(p * v <= model["layers"], at_p,
             f"{f'p·v = {p}·{v}' if v > 1 else f'p = {p}'} pipeline stages need at least {p * v} layers, the model "
             f"has {model['layers']}; fix {'p, v' if v > 1 else 'p'} or layers")  # fmt: skip


def plain_gpt(model: dict[str, Any]) -> bool:
    """Whether `model` is what the SC21 paper's FLOP formula counts: a GPT with a 4·hidden MLP and no GQA."""
    return (model.get("family", "gpt") == "gpt" and model.get("kv_heads", model["heads"]) == model["heads"]
            and model.get("ffn_hidden", 4 * model["hidden"]) == 4 * model["hidden"])  # fmt: skip


def _check_flops(model: dict[str, Any], formula: str, where: str) -> None:
    """The SC21 formula counts a plain GPT only: any other model needs the record's `flops: megatron-core`."""
    _require(formula != "megatron-sc21" or plain_gpt(model), where,
             f"model {model['name']!r} is not a GPT with ffn_hidden = 4·hidden and no GQA, which the paper's FLOP "
             "formula counts; set the record's flops: megatron-core (Megatron-Core's model FLOPs)")  # fmt: skip
    # After the formula's check, which names the record's fix first: the trainer's job refuses GQA in a GPT or
    # BERT too, but names neither the run's place in the record nor what to do.
    family = model.get("family", "gpt")
    _require(family == "llama" or model.get("kv_heads", model["heads"]) == model["heads"], f"{where}.kv_heads",
             f"a {family} has one key/value head per query head ({model['heads']}); grouped-query attention is "
             "family: llama — set it, or remove kv_heads")  # fmt: skip


def _check_settings(mapping: dict[str, Any], where: str, sep: str) -> None:
    """`vocab_size`, `seq_len`, `recompute` and `attention`, where given (a record's or a run's)."""
    for key in ("vocab_size", "seq_len"):
        if key in mapping:
            _require(_positive_int(mapping[key]), f"{where}{sep}{key}", _not_int(mapping[key]))
    if "recompute" in mapping:
        _require(mapping["recompute"] in RECOMPUTE, f"{where}{sep}recompute",
                 f"must be none, selective or full, got {mapping['recompute']!r}")  # fmt: skip
    if "attention" in mapping:
        _require(mapping["attention"] in ATTENTION, f"{where}{sep}attention",
                 f"must be materialized or sdpa, got {mapping['attention']!r}")  # fmt: skip
    if "sequence_parallel" in mapping:
        _require(isinstance(mapping["sequence_parallel"], bool), f"{where}{sep}sequence_parallel",
                 f"must be true or false, got {mapping['sequence_parallel']!r}")  # fmt: skip


def _check_run(row: Any, where: str, *, model: bool, published: bool) -> None:
    """A run: gpus, t, p (d = gpus/(t·p) must be whole), mbs, gbs (a multiple of d·mbs), and what was published."""
    _require(isinstance(row, dict), where, "must be a mapping")
    if model:
        _known_keys(row, RUN_KEYS, where)
        _check_model(row, where)
        _check_settings(row, where, ".")
    for key in ("gpus", "t", "p", "mbs", "gbs", *(("v",) if "v" in row else ())):  # v (virtual stages) is optional
        _require(key in row, f"{where}.{key}", "missing")
        _require(_positive_int(row[key]), f"{where}.{key}", _not_int(row[key]))
    _require(row["gpus"] % (row["t"] * row["p"]) == 0, f"{where}.gpus",
             f"{row['gpus']} GPUs are not a multiple of t·p = {row['t'] * row['p']}; fix t, p or gpus")  # fmt: skip
    d = row["gpus"] // (row["t"] * row["p"])
    _require(row["gbs"] % (d * row["mbs"]) == 0, f"{where}.gbs",
             f"{row['gbs']} is not a multiple of d·mbs = {d}·{row['mbs']} (whole micro-batches per replica); "
             f"fix gbs, mbs or gpus")  # fmt: skip
    # Interleaving splits a pipeline's stages; with p = 1 the planner would cost v > 1 as plain, silently.
    _require(row.get("v", 1) == 1 or row["p"] > 1, f"{where}.v",
             f"{row.get('v')} virtual stages need a pipeline (p > 1); set v: 1 or fix p")  # fmt: skip
    if "sharded_dp" in row:  # bool("no") is True: a string would be costed as ZeRO-3
        _require(isinstance(row["sharded_dp"], bool), f"{where}.sharded_dp",
                 f"must be true or false, got {row['sharded_dp']!r}")  # fmt: skip
    if published:
        given = [k for k in RATES if row.get(k) is not None]
        _require(len(given) == 1, where, "give exactly one of tflops (per GPU), iter_time_s and tokens_per_s (per GPU)")
        for key in (given[0], *(("memory_gb",) if "memory_gb" in row else ())):
            value = row[key]
            _require(_positive_number(value), f"{where}.{key}",
                     f"must be a positive number (finite), got {_shown(value)}{_text_number_hint(value)}")  # fmt: skip


def validate_record(record: Any, path: Path | str) -> dict[str, Any]:
    """The record, checked; raises `RecordError` naming the file and the field."""
    _require(isinstance(record, dict), str(path), "a published record must be a YAML mapping (see tests/published/)")
    where = str(path)
    # An empty file (or one of comments) was answered "profile: missing", as if only the profile were.
    _require(bool(record), where, f"the record is empty: give profile and at least one of {', '.join(SECTIONS)} "
                                  "(see tests/published/)")  # fmt: skip
    top = ("profile", "profile_set", "model_defaults", "recompute", "attention", "sequence_parallel", "flops", *SECTIONS)
    unknown = _unknown(record, top)
    _unsupported(unknown, f"{where}:", " ")
    _require(not unknown, f"{where}: {', '.join(unknown)}", f"unknown field; valid: {', '.join(top)}")
    formula = record.get("flops", FLOPS[0])
    _require(formula in FLOPS, f"{where}: flops", f"must be one of {', '.join(FLOPS)}, got {formula!r}")
    _require(record.get("profile") is not None, f"{where}: profile",
             "missing: the shipped cluster profile the runs are costed on, e.g. slurm/profiles/a100-4x8.yaml")  # fmt: skip
    _require(isinstance(record["profile"], str) and record["profile"].strip() != "", f"{where}: profile",
             f"must be the path of a cluster profile (relative to the repository, or absolute), e.g. "
             f"slurm/profiles/a100-4x8.yaml, got {record['profile']!r}")  # fmt: skip
    overrides = record.get("profile_set", [])
    _require(isinstance(overrides, list), f"{where}: profile_set", "must be a list of key=value")
    # load_profile splits each at "=": a number or a mapping there was an AttributeError traceback.
    for i, item in enumerate(overrides):
        _require(isinstance(item, str) and "=" in item, f"{where}: profile_set[{i}]",
                 f"must be a string key=value, e.g. 'network.inter_node_bandwidth=400 Gbit/s', got {item!r}")  # fmt: skip
    defaults = record.get("model_defaults", {})
    _require(isinstance(defaults, dict), f"{where}: model_defaults", "must be a mapping of vocab_size and seq_len")
    stray = sorted(str(k) for k in set(defaults) - {"vocab_size", "seq_len"})
    _require(not stray, f"{where}: model_defaults.{', '.join(stray)}", "unknown field; valid: vocab_size, seq_len")
    _check_settings(defaults, f"{where}: model_defaults", ".")
    _check_settings(record, where, ": ")
    _require(any(k in record for k in SECTIONS), where, f"no runs: give at least one of {', '.join(SECTIONS)}")
    for section in ("runs", "table_1"):
        if section in record:
            rows = record[section]
            _require(isinstance(rows, list) and rows, f"{where}: {section}", "must be a non-empty list of runs")
            for i, row in enumerate(rows):
                try:
                    _check_run(row, f"{where}: {section}[{i}]", model=True, published=True)
                    _check_flops(row, formula, f"{where}: {section}[{i}]")
                    _check_layout(row, t=row["t"], p=row["p"], v=row.get("v", 1),
                                  seq=row.get("seq_len", defaults.get("seq_len", SEQ)),
                                  sequence_parallel=row.get("sequence_parallel", record.get("sequence_parallel", False)),
                                  at_t=f"{where}: {section}[{i}].t", at_p=f"{where}: {section}[{i}].p")  # fmt: skip
                except RecordError as e:
                    # `runs[7]` alone is hard to find in a record of dozens of runs: add the run's name, if usable.
                    name = row.get("name") if isinstance(row, dict) else None
                    if not (isinstance(name, str) and name.strip()):
                        raise
                    raise RecordError(f"{e} (the run named {name.strip()!r})") from None
    if "table_2" in record:
        spec = record["table_2"]
        _require(isinstance(spec, dict) and isinstance(spec.get("rows"), list), f"{where}: table_2",
                 "must have model, gbs and rows")  # fmt: skip
        _known_keys(spec, ("model", "gbs", "rows"), f"{where}: table_2")
        _check_model(spec.get("model"), f"{where}: table_2.model", alone=True)
        _check_flops(spec["model"], formula, f"{where}: table_2.model")
        _require(_positive_int(spec.get("gbs")), f"{where}: table_2.gbs", _not_int(spec.get("gbs")))
        # An empty table costed nothing and the command exited 0, as if it had compared something.
        _require(bool(spec["rows"]), f"{where}: table_2.rows", "must be a non-empty list of runs")
        for i, row in enumerate(spec["rows"]):
            _require(isinstance(row, dict), f"{where}: table_2.rows[{i}]", "must be a mapping")
            _known_keys(row, TABLE_2_ROW_KEYS, f"{where}: table_2.rows[{i}]")
            _check_run({**row, "gbs": spec["gbs"]}, f"{where}: table_2.rows[{i}]", model=False, published=True)
            _require(row.get("scheme") in ("ptd-p", "zero-3"), f"{where}: table_2.rows[{i}].scheme",
                     "must be ptd-p or zero-3")  # fmt: skip
            _check_layout(spec["model"], t=row["t"], p=row["p"], v=1, seq=defaults.get("seq_len", SEQ),
                          sequence_parallel=record.get("sequence_parallel", False),
                          at_t=f"{where}: table_2.rows[{i}].t", at_p=f"{where}: table_2.rows[{i}].p")  # fmt: skip
    for name in ("figure_13", "figure_14", "figure_16"):
        if name in record:
            _check_figure(record[name], name, f"{where}: {name}", formula, seq=defaults.get("seq_len", SEQ),
                          sequence_parallel=record.get("sequence_parallel", False))  # fmt: skip
    return record


def _check_figure(spec: Any, name: str, where: str, formula: str, *, seq: int, sequence_parallel: bool) -> None:
    """A figure's sweep: every field it is costed from, each combination a layout and a batch a run could have
    (a number where a list goes was a TypeError traceback; an empty list costed nothing, silently)."""
    _require(isinstance(spec, dict), where, "must be a mapping")
    _known_keys(spec, FIGURE_KEYS[name], where)
    _check_model(spec.get("model"), f"{where}.model", alone=True)
    _check_flops(spec["model"], formula, f"{where}.model")
    sweeps = {"figure_13": ("gbs", "configs"), "figure_14": ("gbs", "pipeline_sizes"),
              "figure_16": ("gbs", "mbs")}  # fmt: skip
    for key in FIGURE_KEYS[name][1:]:
        if key in ("best", "order", "best_mbs"):  # what the paper says of the sweep: optional
            continue
        _require(key in spec, f"{where}.{key}", "missing")
        value = spec[key]
        if key == "configs":
            _require(isinstance(value, list) and bool(value), f"{where}.configs",
                     f"must be a non-empty list of [t, p], got {value!r}")  # fmt: skip
        elif key in sweeps[name]:
            _require(_positive_ints(value), f"{where}.{key}",
                     f"must be a non-empty list of positive integers, got {_shown(value)}")  # fmt: skip
        else:
            _require(_positive_int(value), f"{where}.{key}", _not_int(value))
    gpus = spec["gpus"]
    if name == "figure_13":
        layouts = spec["configs"]
    elif name == "figure_14":
        layouts = [[1, q] for q in spec["pipeline_sizes"]]
    else:
        layouts = [[spec["t"], spec["p"]]]
    for layout in layouts:
        ok = (isinstance(layout, list) and len(layout) == 2 and all(_positive_int(x) for x in layout)
              and gpus % (layout[0] * layout[1]) == 0)  # fmt: skip
        _require(ok, where, f"every [t, p] must be positive integers whose product divides gpus = {gpus}, "
                            f"got {layout!r}")  # fmt: skip
    at = {"figure_13": (".configs", ".configs"), "figure_14": (".t", ".pipeline_sizes"), "figure_16": (".t", ".p")}
    for t, p in layouts:
        _check_layout(spec["model"], t=t, p=p, v=1, seq=seq, sequence_parallel=sequence_parallel,
                      at_t=where + at[name][0], at_p=where + at[name][1])  # fmt: skip
    # Whole micro-batches per replica, as a run's batch must be (the figure's were costed as rejected layouts).
    for t, p in layouts:
        d = gpus // (t * p)
        for mbs in spec["mbs"] if isinstance(spec["mbs"], list) else [spec["mbs"]]:
            for gbs in spec["gbs"]:
                _require(gbs % (d * mbs) == 0, f"{where}.gbs",
                         f"{gbs} is not a multiple of d·mbs = {d}·{mbs} at t = {t}, p = {p} (whole micro-batches "
                         "per replica); fix gbs, mbs or the layout")  # fmt: skip
    # What the paper names best must be among what the figure swept (tests/test_costmodel_published.py reads it).
    if "best" in spec:
        _require(spec["best"] in spec.get("configs", []), f"{where}.best",
                 f"{spec['best']!r} is not one of its configs {spec.get('configs')!r}")  # fmt: skip
    if "best_mbs" in spec:
        _require(spec["best_mbs"] in spec["mbs"], f"{where}.best_mbs",
                 f"{spec['best_mbs']!r} is not one of its mbs {spec['mbs']!r}")  # fmt: skip
    if "order" in spec:
        _require(spec["order"] == "decreasing_with_p", f"{where}.order",
                 f"must be decreasing_with_p (the paper's statement of figure 14), got {spec['order']!r}")  # fmt: skip


def load_record(path: Path | str = RECORD) -> dict[str, Any]:
    """Read and check a record; `RecordError` (one line) for a missing file, bad YAML or a bad field."""
    try:
        record = load_yaml(path)  # the same reading, and the same one-line errors, as profiles and jobs
    except ConfigError as e:
        raise RecordError(str(e)) from None
    return validate_record(record, path)


def paper_flops(*, layers: int, hidden: int, gbs: int, seq: int = SEQ, vocab: int = VOCAB) -> float:
    """FLOPs of one iteration as the paper counts them (with recomputation): 96·B·s·l·h²·(1 + s/6h + V/16lh)."""
    return 96 * gbs * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def core_flops(*, layers: int, hidden: int, heads: int, gbs: int, seq: int = SEQ, vocab: int = VOCAB,
               kv_heads: int | None = None, ffn_hidden: int | None = None, gated: bool = False) -> float:  # fmt: skip
    """FLOPs of one iteration as Megatron-Core's `num_floating_point_operations` counts them (model FLOPs: forward
    and backward's two GEMMs, no recomputation, the s×s scores in full): 12·B·s·l·h²·((1 + g/a + s/h) + (f/h)·γ
    + V/2lh), with g key/value heads of a, f the MLP's width and γ = 3/2 for a gated (SwiGLU) MLP. For the GPT of
    the SC21 paper it is its formula without the recomputed forward (72 instead of 96, V/12lh instead of V/16lh)."""
    g = heads if kv_heads is None else kv_heads
    f = 4 * hidden if ffn_hidden is None else ffn_hidden
    return 12 * gbs * seq * layers * hidden**2 * (
        (1 + g / heads + seq / hidden) + (f / hidden) * (1.5 if gated else 1.0) + vocab / (2 * layers * hidden)
    )


def run_flops(model: dict[str, Any], *, formula: str, gbs: int, seq: int, vocab: int) -> float:
    """FLOPs of one iteration of `model` by the record's formula (`FLOPS`)."""
    if formula == "megatron-core":
        return core_flops(layers=model["layers"], hidden=model["hidden"], heads=model["heads"], gbs=gbs, seq=seq,
                          vocab=vocab, kv_heads=model.get("kv_heads"), ffn_hidden=model.get("ffn_hidden"),
                          gated=model.get("family", "gpt") == "llama")  # fmt: skip
    assert plain_gpt(model), model  # validate_record refuses the SC21 formula for any other model
    return paper_flops(layers=model["layers"], hidden=model["hidden"], gbs=gbs, seq=seq, vocab=vocab)


def record_cluster(record: dict[str, Any]) -> ClusterProfile:
    """The record's cluster: a shipped profile (a path relative to the repository, or absolute) with the record's
    overrides."""
    path = REPO / record["profile"]
    if not path.exists():  # a GPU or cluster the repository has no profile for: say what to give instead
        shipped = ", ".join(str(f.relative_to(REPO)) for f in sorted((REPO / "slurm" / "profiles").glob("*.yaml")))
        raise RecordError(f"profile: {record['profile']}: file not found (a relative path is read from the "
                          f"repository, {REPO}); give a shipped profile ({shipped}) with profile_set overrides for "
                          "another accelerator or network (accelerator.peak_tflops, accelerator.memory, "
                          "network.inter_node_bandwidth...), or the absolute path of a profile of your own")  # fmt: skip
    return load_profile(path, record.get("profile_set", []))


def a100_cluster(gpus: int, profile: ClusterProfile) -> ClusterProfile:
    """`profile` with as many nodes as the run used."""
    nodes = max(1, -(-gpus // profile.gpus_per_node))
    return profile.model_copy(update={"nodes": nodes})


def megatron_job(model: dict[str, Any], *, mbs: int, gbs: int, v: int = 1, sharded_dp: bool = False,
                 recompute: str = "full", vocab: int = VOCAB, seq: int = SEQ, sequence_parallel: bool = False) -> Job:  # fmt: skip
    """A cona job for one published run: a model of the run's shape and family, its recompute, batch and schedule."""
    parallel: dict[str, Any] = {"sharded_dp": sharded_dp, "recompute": recompute, "sequence_parallel": sequence_parallel}
    if v > 1:
        parallel.update(pipeline_schedule="interleaved", virtual_stages=v)
    # A record's run names are free text ("72L t8p6 m4", "BLOOM 176B"); a job's name is not.
    name = ("published-" + re.sub(r"[^A-Za-z0-9._-]+", "-", str(model["name"])).strip("-._"))[:63].rstrip("-._")
    return job_from_dict({
        "name": name,
        "model": {"family": model.get("family", "gpt"), "num_layers": model["layers"], "hidden_size": model["hidden"],
                  "num_heads": model["heads"], "num_kv_heads": model.get("kv_heads", model["heads"]),
                  "ffn_hidden_size": model.get("ffn_hidden", 4 * model["hidden"]), "vocab_size": vocab, "seq_len": seq,
                  # Megatron's GPT and BERT tie the output layer to the embedding (`--untie-embeddings-and-output-
                  # weights` unties it); Llama's are untied.
                  "tie_embeddings": model.get("tie_embeddings", model.get("family", "gpt") != "llama")},
        "batch": {"min_gbs": 1, "max_gbs": max(gbs, 1), "base_gbs": gbs, "mbs_choices": [mbs]},
        "parallel": parallel,
    }, source=f"published run {model['name']}")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Case:
    """One published configuration, costed."""

    group: str
    label: str
    gpus: int
    t: int
    p: int
    d: int
    mbs: int
    gbs: int
    published_tflops: float | None
    feasible: bool
    reason: str
    prediction: Prediction | None
    flops: float
    published_memory_gb: float | None = None

    @property
    def predicted_tflops(self) -> float:
        if self.prediction is None:
            return 0.0
        return self.flops / (self.prediction.iter_time_s * self.gpus) / 1e12

    @property
    def ratio(self) -> float | None:
        return self.predicted_tflops / self.published_tflops if self.published_tflops else None

    @property
    def memory_ratio(self) -> float | None:
        """Predicted over published memory per GPU (None when none was published)."""
        if self.prediction is None or not self.published_memory_gb:
            return None
        return self.prediction.memory_gb / self.published_memory_gb

    def to_dict(self) -> dict[str, Any]:
        p = self.prediction
        return {
            "group": self.group, "label": self.label, "gpus": self.gpus, "t": self.t, "p": self.p, "d": self.d,
            "mbs": self.mbs, "gbs": self.gbs, "feasible": self.feasible, "reason": self.reason,
            "published_tflops": self.published_tflops, "predicted_tflops": round(self.predicted_tflops, 2),
            "ratio": None if self.ratio is None else round(self.ratio, 4),
            "iter_time_s": None if p is None else round(p.iter_time_s, 4),
            "memory_gb": None if p is None else round(p.memory_gb, 2),
            "published_memory_gb": self.published_memory_gb,
            "memory_ratio": None if self.memory_ratio is None else round(self.memory_ratio, 4),
        }  # fmt: skip


def cost(group: str, label: str, model: dict[str, Any], *, record: dict[str, Any], cluster: ClusterProfile, gpus: int,
         t: int, p: int, mbs: int, gbs: int, v: int = 1, sharded_dp: bool = False, published: float | None = None,
         published_time_s: float | None = None, published_tokens_per_s: float | None = None,
         published_memory_gb: float | None = None) -> Case:  # fmt: skip
    d = gpus // (t * p)
    assert d * t * p == gpus, (label, gpus, t, p)  # validate_record refuses a record where this fails
    defaults = record.get("model_defaults", {})  # a run's own settings (RUN_SETTINGS) over the record's
    vocab = model.get("vocab_size", defaults.get("vocab_size", VOCAB))
    seq = model.get("seq_len", defaults.get("seq_len", SEQ))
    attention = model.get("attention", record.get("attention", "materialized"))
    recompute = model.get("recompute", record.get("recompute", "full"))
    sequence_parallel = model.get("sequence_parallel", record.get("sequence_parallel", False))
    job = megatron_job(model, mbs=mbs, gbs=gbs, v=v, sharded_dp=sharded_dp, recompute=recompute, vocab=vocab,
                       seq=seq, sequence_parallel=sequence_parallel)  # fmt: skip
    profile = a100_cluster(gpus, cluster)
    problem = layout_reason(job=job, profile=profile, dp=d, tp=t, pp=p, uneven=True)  # what the trainer can run
    c = evaluate(profile=profile, job=job, dp=d, tp=t, pp=p, mbs=mbs, gbs=gbs, layout_problem=problem,
                 attention=attention)  # fmt: skip
    prediction = c.prediction or predict(
        profile=profile, job=job, dp=d, tp=t, pp=p, mbs=mbs, gbs=gbs, attention=attention
    )
    flops = run_flops(model, formula=record.get("flops", FLOPS[0]), gbs=gbs, seq=seq, vocab=vocab)
    if published_tokens_per_s is not None:  # tokens/s per GPU: the iteration's tokens over all GPUs' rate
        published_time_s = gbs * seq / (published_tokens_per_s * gpus)
    if published_time_s is not None:  # the same formula over the published time: the ratio is of times
        published = flops / (published_time_s * gpus) / 1e12
    return Case(group, label, gpus, t, p, d, mbs, gbs, published, c.feasible, c.reason, prediction, flops,
                published_memory_gb)


def _published(row: dict[str, Any]) -> dict[str, float | None]:
    """What a run published, as `cost`'s keyword arguments."""
    return {"published": row.get("tflops"), "published_time_s": row.get("iter_time_s"),
            "published_tokens_per_s": row.get("tokens_per_s"), "published_memory_gb": row.get("memory_gb")}  # fmt: skip


def runs(record: dict[str, Any], cluster: ClusterProfile, section: str = "runs") -> list[Case]:
    return [
        cost(section, str(row["name"]), row, record=record, cluster=cluster, gpus=row["gpus"], t=row["t"], p=row["p"],
             mbs=row["mbs"], gbs=row["gbs"], v=row.get("v", 1), sharded_dp=bool(row.get("sharded_dp", False)),
             **_published(row))
        for row in record.get(section, [])
    ]  # fmt: skip


def table_1(record: dict[str, Any], cluster: ClusterProfile) -> list[Case]:
    return runs(record, cluster, "table_1")


def table_2(record: dict[str, Any], cluster: ClusterProfile) -> list[Case]:
    if "table_2" not in record:
        return []
    spec = record["table_2"]
    return [
        cost("table_2", f"{row['scheme']} {row['gpus']}", spec["model"], record=record, cluster=cluster, gpus=row["gpus"],
             t=row["t"], p=row["p"], mbs=row["mbs"], gbs=spec["gbs"], sharded_dp=row["scheme"] == "zero-3",
             **_published(row))
        for row in spec["rows"]
    ]  # fmt: skip


def figure_13(record: dict[str, Any], cluster: ClusterProfile) -> list[Case]:
    if "figure_13" not in record:
        return []
    spec = record["figure_13"]
    return [
        cost("figure_13", f"t{t} p{p} B{gbs}", spec["model"], record=record, cluster=cluster, gpus=spec["gpus"], t=t, p=p, mbs=spec["mbs"], gbs=gbs)
        for gbs in spec["gbs"] for t, p in spec["configs"]
    ]  # fmt: skip


def figure_14(record: dict[str, Any], cluster: ClusterProfile) -> list[Case]:
    if "figure_14" not in record:
        return []
    spec = record["figure_14"]
    return [
        cost("figure_14", f"p{p} d{spec['gpus'] // p} B{gbs}", spec["model"], record=record, cluster=cluster, gpus=spec["gpus"], t=1, p=p,
             mbs=spec["mbs"], gbs=gbs)
        for gbs in spec["gbs"] for p in spec["pipeline_sizes"]
    ]  # fmt: skip


def figure_16(record: dict[str, Any], cluster: ClusterProfile) -> list[Case]:
    if "figure_16" not in record:
        return []
    spec = record["figure_16"]
    return [
        cost("figure_16", f"mbs{mbs} B{gbs}", spec["model"], record=record, cluster=cluster, gpus=spec["gpus"], t=spec["t"], p=spec["p"], mbs=mbs,
             gbs=gbs)
        for gbs in spec["gbs"] for mbs in spec["mbs"]
    ]  # fmt: skip


def all_cases(record: dict[str, Any] | None = None) -> list[Case]:
    record = record or load_record()
    cluster = record_cluster(record)
    return [c for table in (runs, table_1, table_2, figure_13, figure_14, figure_16) for c in table(record, cluster)]


def implausible(cases: list[Case], cluster: ClusterProfile, *, formula: str) -> str | None:
    """One line for the first run whose published numbers no run can have, or None. A rate above the
    accelerator's dense peak (by the record's FLOP formula) is a rate or unit mistyped (tokens/s of the whole
    cluster given per GPU) or a profile that is not the runs' cluster; one under `MIN_PEAK_FRACTION` of it is
    milliseconds given as `iter_time_s`; a memory above the device's (`MEMORY_SLACK`) is MiB given as GB, or the
    node's. Costed, either would be a ratio off by the unit's factor, printed as if the model were."""
    acc = cluster.accelerator
    peak = acc.peak_tflops
    for c in cases:
        run = f"{c.group}: run {c.label!r}"
        if c.published_tflops is not None and c.published_tflops > peak:
            return (f"{run}: its published rate is {_magnitude(c.published_tflops)} TFLOP/s per GPU by the "
                    f"{formula} formula, above the {acc.name}'s peak of {peak:g} (profile "
                    f"{cluster.name}); check its tflops/tokens_per_s (per GPU) or iter_time_s, and the record's profile")  # fmt: skip
        if c.published_tflops is not None and c.published_tflops < MIN_PEAK_FRACTION * peak:
            return (f"{run}: its published rate is {c.published_tflops:.2g} TFLOP/s per GPU by the {formula} "
                    f"formula, under {MIN_PEAK_FRACTION:.0%} of the {acc.name}'s peak of {peak:g} (profile "
                    f"{cluster.name}); check that iter_time_s is in seconds (not ms), that tflops and tokens_per_s "
                    "are per GPU, and the record's profile")  # fmt: skip
        memory = c.published_memory_gb
        if memory is not None and memory * 1e9 < MIN_MEMORY_FRACTION * acc.memory_bytes:
            return (f"{run}: its published memory of {memory:.2g} GB per GPU is under {MIN_MEMORY_FRACTION:.0%} of the "
                    f"{acc.name}'s {acc.memory} (profile {cluster.name}); check memory_gb is in GB (not TB) per GPU, "
                    "and the record's profile")  # fmt: skip
        if memory is not None and memory * 1e9 > MEMORY_SLACK * acc.memory_bytes:
            return (f"{run}: its published memory of {_magnitude(memory)} GB per GPU is above the "
                    f"{acc.name}'s {acc.memory} (profile {cluster.name}); check memory_gb is in GB per GPU (not "
                    "MiB, nor the node's), and the record's profile")  # fmt: skip
    return None


def _magnitude(x: float) -> str:
    """A number for a message: 28,447, or 1e+30 rather than its 31 digits, or 0.5 rather than 0."""
    return f"{x:,.0f}" if 1 <= x < 1e9 else f"{x:.3g}"


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (no ties expected in the published values)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else 1.0


def print_cases(cases: list[Case]) -> None:
    memory = any(c.published_memory_gb for c in cases)  # the published memory's column only when a run gives one
    w = max([16, *(len(c.label) for c in cases)])  # run names are free text: a longer one would shift its row
    header = f"{'group':<10} {'run':<{w}} {'GPUs':>5} {'t':>3} {'p':>3} {'d':>4} {'mbs':>3} {'gbs':>5} " \
             f"{'mem GB':>7}{' pub GB' if memory else ''} {'TFLOP/s':>8} {'published':>9} {'ratio':>6}"  # fmt: skip
    print(header)
    print("-" * len(header))
    for c in cases:
        mem = f"{c.prediction.memory_gb:7.1f}" if c.prediction else "      -"
        if memory:
            mem += f"{c.published_memory_gb:7.1f}" if c.published_memory_gb else "      -"
        # Below 1 TFLOP/s (a CPU profile) in significant digits: `.0f` printed 0.4 as 0 beside a ratio of 0.94.
        pub = (f"{c.published_tflops:9.0f}" if c.published_tflops >= 1 else f"{c.published_tflops:9.3g}") \
            if c.published_tflops else "        -"  # fmt: skip
        predicted = f"{c.predicted_tflops:8.1f}" if c.predicted_tflops >= 1 else f"{c.predicted_tflops:8.3g}"
        ratio = f"{c.ratio:6.2f}" if c.ratio else "     -"
        flag = "" if c.feasible else f"  REJECTED: {c.reason}"
        print(f"{c.group:<10} {c.label:<{w}} {c.gpus:>5} {c.t:>3} {c.p:>3} {c.d:>4} {c.mbs:>3} {c.gbs:>5} {mem} "
              f"{predicted} {pub} {ratio}{flag}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.published", description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, default=RECORD, help="the published runs (YAML, see the module doc)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON to write; a bare name goes under benchmarks/results (default: published.json for "
                             "the default record, published-<record name>.json for another)")  # fmt: skip
    parser.add_argument("--profile-set", action="append", default=[], metavar="KEY=VALUE",
                        help="override the record's cluster after its profile_set (repeatable), e.g. "
                             "'network.inter_node_bandwidth=135 Gbit/s'")  # fmt: skip
    args = parser.parse_args(argv)
    if args.out is None:  # another record's results never overwrite the shipped published.json
        default = args.record.resolve() == RECORD.resolve()
        args.out = RESULTS / ("published.json" if default else f"published-{args.record.stem}.json")
    if results_path(args.out).is_dir():  # said before the costing, not after its table
        parser.exit(2, f"{parser.prog}: error: --out {args.out}: is a directory; give the path of the JSON file\n")
    try:
        record = load_record(args.record)
    except RecordError as e:  # it names the file
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    own = [item for item in record.get("profile_set", []) if item not in args.profile_set]
    if args.profile_set:  # what the record says, then the command line's
        record = {**record, "profile_set": [*record.get("profile_set", []), *args.profile_set]}
    try:
        cluster = record_cluster(record)
    except RecordError as e:  # a profile that is not there: name the record that names it
        parser.exit(2, f"{parser.prog}: error: {args.record}: {e}\n")
    except ConfigError as e:  # the profile the record names, or its profile_set
        message = str(e)
        for item in own:  # an item of the record's own profile_set, not of the command line
            message = message.replace(f"--profile-set {item}", f"the record's profile_set item {item}")
        parser.exit(2, f"{parser.prog}: error: {args.record}: profile: {message}\n")
    try:
        cases = all_cases(record)
    except ConfigError as e:  # a run's model that the trainer's job refuses (it names the run and the field)
        parser.exit(2, f"{parser.prog}: error: {args.record}: {e}\n")
    problem = implausible(cases, cluster, formula=record.get("flops", FLOPS[0]))
    if problem:
        parser.exit(2, f"{parser.prog}: error: {args.record}: {problem}\n")
    print_cases(cases)
    for group in ("runs", "table_1", "table_2"):
        rows = [c for c in cases if c.group == group and c.ratio]
        if rows:
            worst = max(rows, key=lambda c: abs(math.log(c.ratio or 1)))
            print(f"\n{group}: predicted/published from {min(c.ratio for c in rows):.2f} to "
                  f"{max(c.ratio for c in rows):.2f} (worst {worst.label})")  # fmt: skip
            if len(rows) > 2 and group != "table_2":  # in the published order (a planner needs the order)?
                rho = spearman([c.predicted_tflops for c in rows], [c.published_tflops or 0.0 for c in rows])
                print(f"{group}: rank correlation of predicted and published TFLOP/s {rho:.2f} over {len(rows)} runs")
    with_memory = [c for c in cases if c.memory_ratio]
    if with_memory:
        print(f"memory: predicted/published from {min(c.memory_ratio for c in with_memory):.2f} to "
              f"{max(c.memory_ratio for c in with_memory):.2f} over {len(with_memory)} runs (a published "
              "number may be the allocator's reserved memory or nvidia-smi's, which include its cache)")  # fmt: skip
    t2 = [c for c in cases if c.group == "table_2"]
    if len(t2) > 1:
        print(f"table_2: rank correlation {spearman([c.predicted_tflops for c in t2], [c.published_tflops for c in t2]):.2f}")
    try:
        written = write_json(args.out, {"cases": [c.to_dict() for c in cases], "profile": record["profile"],
                              "profile_set": record.get("profile_set", []), "record": str(args.record)})  # fmt: skip
    except OSError as e:  # a directory, or a folder that cannot be made: a traceback after the table
        parser.exit(2, f"{parser.prog}: error: --out {args.out}: cannot write ({e.strerror or e}); give a file path "
                       "in a writable folder\n")  # fmt: skip
    print(f"wrote {shown(written)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main))
