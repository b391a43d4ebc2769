"""Job specs and cluster profiles: every shipped file loads; every bad input gets one clear line."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
from cona.orchestrator.job import load_job
from cona.orchestrator.profile import load_profile
from cona.protocol.feasibility import batch_problem
from cona.protocol.job import PRESETS, ModelSpec
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError, parse_bytes

from tests.conftest import EXAMPLES, PROFILES, REPO, run_cona

ALL_PROFILES = sorted((REPO / "slurm" / "profiles").glob("*.yaml")) + sorted(
    (REPO / "manifests" / "profiles").glob("*.yaml")
)
ALL_JOBS = sorted(EXAMPLES.glob("*.yaml"))


def test_shipped_files_exist():
    names = {p.name for p in ALL_PROFILES}
    assert {"local-cpu.yaml", "h100-k8s.yaml"} <= names
    assert {f"{n}.yaml" for n in ("gpt3-1.3b", "llama-3.2-1b", "bert-large", "tiny-gpt", "tiny-llama", "tiny-bert")} <= {
        p.name for p in ALL_JOBS
    }


@pytest.mark.parametrize("path", ALL_PROFILES, ids=lambda p: p.name)
def test_profiles_load(path):
    profile = load_profile(path)
    assert profile.num_gpus == profile.nodes * profile.gpus_per_node
    assert profile.accelerator.memory_bytes > 0


@pytest.mark.parametrize("path", ALL_JOBS, ids=lambda p: p.name)
def test_jobs_load(path):
    job = load_job(path)
    assert job.model.num_layers > 0
    assert job.batch.min_gbs <= job.batch.base_gbs <= job.batch.max_gbs


def test_presets_have_published_dimensions():
    gpt = ModelSpec(preset="gpt3-1.3b")
    assert (gpt.num_layers, gpt.hidden_size, gpt.num_heads, gpt.seq_len, gpt.vocab_size) == (24, 2048, 16, 2048, 50257)
    llama = ModelSpec(preset="llama-3.2-1b")
    assert (llama.num_layers, llama.hidden_size, llama.num_heads, llama.num_kv_heads, llama.ffn_hidden_size) == (
        16, 2048, 32, 8, 8192,
    )  # fmt: skip
    assert llama.vocab_size == 128256
    bert = ModelSpec(preset="bert-large")
    assert (bert.num_layers, bert.hidden_size, bert.num_heads, bert.seq_len, bert.vocab_size) == (24, 1024, 16, 512, 30522)
    assert 1.2e9 < gpt.num_params < 1.5e9
    assert 3.0e8 < bert.num_params < 3.6e8
    for name in PRESETS:
        if name.startswith("tiny-"):
            assert ModelSpec(preset=name).num_params < 1e6


def test_preset_counts_are_the_published_models_and_the_built_models():
    """The full-size presets hold the published models' parameters, and `num_params` is what the trainer builds."""
    from cona.trainer.model import build_model

    gpt, llama, bert = (ModelSpec(preset=name) for name in ("gpt3-1.3b", "llama-3.2-1b", "bert-large"))
    assert gpt.num_params == 1_315_723_264 and gpt.tie_embeddings  # GPT-3 XL in the GPT-2 layout
    assert llama.num_params == 1_235_814_400 and llama.tie_embeddings  # Llama 3.2 1B
    assert llama.rope_scaling is not None and (llama.rope_scaling.factor, llama.rope_scaling.low_freq_factor,
            llama.rope_scaling.high_freq_factor, llama.rope_scaling.original_max_position_embeddings) == (32, 1, 4, 8192)  # fmt: skip
    assert bert.norm_eps == 1e-12 and bert.type_vocab_size == 2
    h, v = bert.hidden_size, bert.vocab_size
    encoder = bert.num_params - (h * h + h + 2 * h + v)  # without the MLM head (dense, LayerNorm, decoder bias)
    assert encoder == 334_092_288  # BERT-Large without its pooler
    assert encoder + h * h + h == 335_141_888  # with its pooler (BertModel)
    for name in PRESETS:
        spec = ModelSpec(preset=name)
        built = build_model(spec, device="meta")
        assert sum(p.numel() for p in built.parameters()) == spec.num_params, name
    untied = ModelSpec(preset="gpt3-1.3b", tie_embeddings=False)
    assert untied.num_params == gpt.num_params + gpt.vocab_size * gpt.hidden_size
    assert sum(p.numel() for p in build_model(untied, device="meta").parameters()) == untied.num_params
    assert ModelSpec(preset="llama-3.2-1b", rope_scaling=None).rope_scaling is None  # null turns the scaling off


def test_explicit_fields_override_preset():
    spec = ModelSpec(preset="tiny-gpt", num_layers=2)
    assert spec.num_layers == 2 and spec.hidden_size == 64


def test_what_a_preset_derives_the_default_way_follows_the_files_own_value():
    """`num_heads: 8` on a preset with as many key/value heads as heads means 8 of each (it was refused: "num_kv_heads
    must equal num_heads", a field the user never set); `hidden_size` takes a 4× MLP where the preset has one. A
    grouped-query preset keeps its key/value heads, and a count they do not divide names the preset as the cause."""
    assert (ModelSpec(preset="gpt3-1.3b", num_heads=32).num_kv_heads, ModelSpec(preset="bert-large", num_heads=8).num_kv_heads) == (32, 8)
    wide = ModelSpec(preset="tiny-gpt", hidden_size=128)
    assert wide.ffn_hidden_size == 512 and ModelSpec(preset="tiny-gpt", hidden_size=128, ffn_hidden_size=300).ffn_hidden_size == 300
    assert ModelSpec(preset="llama-3.2-1b", num_heads=16).num_kv_heads == 8  # GQA: the preset's, it divides 16
    with pytest.raises(pydantic.ValidationError, match=r"num_kv_heads=8 \(the preset's: set model.num_kv_heads too\)"):
        ModelSpec(preset="llama-3.2-1b", num_heads=4)


def test_set_overrides(tmp_path):
    job = load_job(EXAMPLES / "tiny-gpt.yaml", ["optimizer.lr=3e-4", "batch.max_gbs=64", "policy.name=static"])
    assert job.optimizer.lr == 3e-4 and job.batch.max_gbs == 64 and job.policy.name == "static"


def test_the_trainer_sets_the_policy_aside_and_gets_what_it_needs_as_its_own_field(tmp_path):
    from cona.protocol import job as trainer_job

    path = _write(tmp_path, "model: {preset: tiny-gpt}\npolicy: {name: static, noise_estimator: adam}\n")
    orchestrator_view = load_job(path)
    assert orchestrator_view.policy.noise_estimator == "adam" and orchestrator_view.heartbeat.adam_stats
    trainer_view = trainer_job.load_job(path)
    assert not hasattr(trainer_view, "policy") and not trainer_view.heartbeat.adam_stats
    # run.yaml holds the orchestrator's resolved job: the trainer reads the flag the orchestrator turned on.
    resolved = trainer_job.job_from_dict(orchestrator_view.model_dump(mode="json"))
    assert resolved.heartbeat.adam_stats and not hasattr(resolved, "policy")
    assert not load_job(_write(tmp_path, "model: {preset: tiny-gpt}\n", "plain.yaml")).heartbeat.adam_stats


def _write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


BAD_JOBS = [
    ("model: {preset: tiny-gpt}\noptimiser: {lr: 1}\n", "unknown field 'optimiser'; did you mean 'optimizer'"),
    ("model: {preset: tiny-gpt}\noptimizer: {lrr: 1}\n", "unknown field 'optimizer.lrr'; did you mean 'lr'"),
    ("model: {preset: tiny-gtp}\n", "field 'model.preset': unknown preset; did you mean 'tiny-gpt'"),
    ("model: {preset: tiny-gpt}\nbatch: {min_gbs: many}\n", "field 'batch.min_gbs': Input should be a valid integer"),
    ("model: {preset: tiny-gpt}\nbatch: {min_gbs: 64, max_gbs: 8, base_gbs: 16}\n", "min_gbs=64 is larger than max_gbs=8"),
    ("model: {preset: tiny-gpt}\noptimizer: {lr_scaling: cubic}\n", "field 'optimizer.lr_scaling'"),
    ("model: {preset: tiny-gpt, num_heads: 3}\n", "num_heads=3 must divide hidden_size=64"),
    ("model: {preset: tiny-gpt}\npolicy: {name: fixed}\n", "policy 'fixed' needs policy.strategy"),
    ("model: {preset: tiny-gpt}\npolicy: {nosie_estimator: adam}\n", "unknown field 'policy.nosie_estimator'"),
    ("model: {preset: tiny-gpt}\npolcy: {name: static}\n", "unknown field 'polcy'; did you mean 'policy'"),
    ("seed: 1\n", "missing required section 'model'"),
    ("model: {preset: tiny-gpt\n", "invalid YAML"),
    # A control character has no line/column mark in PyYAML: its offset, not an empty place (`job.yaml::`).
    ("model: {preset: tiny-gpt}\nseed: \x01\n", ": offset 32: invalid YAML: unacceptable character #x0001"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("model: {family: gpt, num_layers: 2}\n", "give model.preset or all of"),
    ("model: {preset: tiny-bert, tie_embeddings: false}\n", "field 'model': tie_embeddings: BERT's MLM"),
    ("model: {preset: tiny-gpt, type_vocab_size: 2}\n", "type_vocab_size: token-type embeddings are BERT's"),
    ("model: {preset: tiny-gpt, rope_scaling: {factor: 8}}\n", "rope_scaling: only llama uses RoPE"),
    ("model: {preset: tiny-llama, rope_scaling: {factr: 8}}\n", "unknown field 'model.rope_scaling.factr'; did you mean 'factor'"),
    # YAML's true/false where a number belongs is a slip, not 1/0.
    ("model: {preset: tiny-gpt}\nbatch: {max_gbs: true}\n", "field 'batch.max_gbs': expects a number"),
    ("model: {preset: tiny-gpt}\nbatch: {mbs_choices: [2, true]}\n", "field 'batch.mbs_choices': expects a number"),
    # YAML 1.1 reads an unquoted no/off as false: a choice or a text field says what it takes and to quote it.
    ("model: {preset: tiny-gpt}\noptimizer: {lr_scaling: no}\n",
     "field 'optimizer.lr_scaling': expects one of 'none', 'linear', 'sqrt', not true/false (YAML reads an unquoted "
     "yes/no/on/off/true/false as a boolean: quote the value)"),
    ("model: {preset: tiny-gpt}\ndata: {path: off}\n", "field 'data.path': expects text, not true/false"),
    # And text or a number in a switch: pydantic would read "false" or 0 as false, "yes" or 1 as true.
    ("model: {preset: tiny-gpt}\nmetrics: {tensorboard: 'false'}\n",
     "field 'metrics.tensorboard': 'false' is not true or false; write true or false without quotes"),
    ("model: {preset: tiny-gpt}\npolicy: {in_place_switch: 0}\n", "field 'policy.in_place_switch': 0 is not true or false"),
    ("model: {preset: tiny-gpt}\nheartbeat: {adam_stats: [true]}\n", "field 'heartbeat.adam_stats': [True] is not true or false"),
    # A section given twice: PyYAML would keep the second one whole, the first one's fields back at their defaults.
    ("model: {preset: tiny-gpt}\nbatch: {max_gbs: 64}\noptimizer: {lr: 0.001}\nbatch: {mbs_choices: [2]}\n",
     "line 4 column 1: invalid YAML: duplicate key 'batch' (first at line 2); merge the two into one"),
    # Path("") is the current directory, which exists: an empty path would train on whatever is there.
    ("model: {preset: tiny-gpt}\ndata: {path: ''}\n", "field 'data.path': empty; give a text file"),
    ("model: {preset: tiny-gpt, init_from: ''}\n", "field 'model.init_from': empty"),
    # Values the trainer cannot run (numpy refuses a negative seed; a zero RoPE base or norm epsilon is NaN at step 0).
    ("model: {preset: tiny-gpt}\nseed: -1\n", "field 'seed': Input should be greater than or equal to 0"),
    ("model: {preset: tiny-llama, rope_theta: 0}\n", "field 'model.rope_theta': Input should be greater than 0"),
    ("model: {preset: tiny-gpt, norm_eps: -1.0e-5}\n", "field 'model.norm_eps': Input should be greater than 0"),
    ("model: {preset: tiny-gpt}\noptimizer: {lr: 1.0e-3, min_lr: 1.0e-2}\n", "min_lr=0.01 is larger than lr=0.001; set optimizer.min_lr at most lr"),
    # A strategy or schedule the named policy never reads is a forgotten name: the run would switch online instead.
    ("model: {preset: tiny-gpt}\npolicy: {strategy: 'dp=2,tp=1,pp=2,mbs=2,gbs=32'}\n",
     "policy.strategy is read only by policy 'fixed', not 'cona'; set policy.name: fixed, or remove policy.strategy"),
    ("model: {preset: tiny-gpt}\npolicy: {name: static, schedule: [{samples: 0, strategy: 'dp=4,tp=1,pp=1,mbs=4,gbs=16'}]}\n",
     "policy.schedule is read only by policy 'schedule', not 'static'"),
    # An unknown key in an item of a list of sections is answered with that section's fields.
    ("model: {preset: tiny-gpt}\npolicy: {name: schedule, schedule: [{samples: 0, stratgy: 'dp=4,tp=1,pp=1,mbs=4,gbs=16'}]}\n",
     "unknown field 'policy.schedule.0.stratgy'; did you mean 'strategy'?; valid fields here: samples, strategy"),
    # A lost indent: the unknown-key message answered "did you mean 'target'?".
    ("name: x\nmodel:\npreset: tiny-gpt\n", "'preset' at the top level after an empty 'model:' section; indent it under 'model:'"),
    ("model: {preset: tiny-gpt}\noptimizer:\nlr: 0.001\nmin_lr: 0.0001\n",
     "'lr', 'min_lr' at the top level after an empty 'optimizer:' section; indent them under 'optimizer:'"),
    # A timeout past a week overflowed its conversion in the trainer, minutes into the run.
    ("model: {preset: tiny-gpt}\nparallel: {collective_timeout_s: 1.0e15}\n",
     "field 'parallel.collective_timeout_s': Input should be less than or equal to 604800"),
    ("model: {preset: tiny-gpt}\nparallel: {collective_timeout_s: 5}\n",
     "field 'parallel.collective_timeout_s': Input should be greater than or equal to 10"),
    # Past 2**53 the cost model's float arithmetic overflows (a traceback from 1e309 on).
    ("model: {preset: tiny-gpt, vocab_size: 100000000000000000000}\n", "field 'model.vocab_size': too large (at most 9e+15)"),
]


@pytest.mark.parametrize(("text", "expected"), BAD_JOBS)
def test_bad_job_messages(tmp_path, text, expected):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_job(path)
    message = str(info.value)
    assert expected in message
    assert str(path) in message
    assert "\n" not in message


def test_a_whole_number_in_e_notation_is_read_as_an_integer(tmp_path):
    """YAML 1.1 reads `1.5e8` as text; where an integer belongs it is the number the user wrote."""
    job = load_job(_write(tmp_path, "model: {preset: tiny-gpt}\ntarget: {max_samples: 1.5e8}\n"))
    assert job.target.max_samples == 150_000_000
    with pytest.raises(ConfigError, match=r"target\.max_samples"):
        load_job(_write(tmp_path, "model: {preset: tiny-gpt}\ntarget: {max_samples: 1.5e-3}\n"))


def test_a_merge_key_may_still_be_overridden(tmp_path):
    """Only a key written twice is refused: YAML's `<<` merge exists to be overridden."""
    text = "base: &b {lr: 1.0e-3, min_lr: 1.0e-4}\nmodel: {preset: tiny-gpt}\noptimizer:\n  <<: *b\n  lr: 2.0e-3\n"
    from cona.protocol.yamlconfig import load_yaml

    assert load_yaml(_write(tmp_path, text))["optimizer"] == {"lr": 2.0e-3, "min_lr": 1.0e-4}


def test_a_name_with_brackets_is_printed_as_text(tmp_path):
    """`cona plan` prints names from the YAML with rich: `[/]` raised a MarkupError, `[old nodes]` vanished."""
    profile = (REPO / "slurm" / "profiles" / "local-cpu.yaml").read_text().replace("name: local-cpu", 'name: "cpu [old nodes] [/]"')
    assert "cpu [old nodes]" in profile
    path = _write(tmp_path, profile, "profile.yaml")
    result = run_cona("plan", "--profile", str(path), "--job", "examples/tiny-gpt.yaml", "--top", "1")
    assert result.returncode == 0, result.stderr
    assert "on cpu [old nodes] [/]: 1 node(s)" in result.stdout


def test_a_yaml_file_that_is_no_text_is_named(tmp_path):
    """A UnicodeDecodeError is a ValueError that names no file: the message must say which one."""
    path = tmp_path / "job.yaml"
    path.write_bytes(b"model: {preset: tiny-gpt}\nname: \xe9t\xe9\n")
    with pytest.raises(ConfigError) as info:
        load_job(path)
    assert str(info.value) == f"{path}: not UTF-8 text (byte 0xe9 at offset 32); save it as UTF-8"


BAD_PROFILES = [
    # YAML 1.1 reads a leading zero as octal: 010 nodes were 8.
    ("name: x\nbackend: local\nnodes: 010\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 8 GB}\n",
     "line 3 column 8: invalid YAML: 010 is an octal number to YAML 1.1 (8); write it without the leading zero"),
    # A lost indent, as in a job: the unknown-key message named the first stray field alone.
    ("name: x\nbackend: local\nnodes: 1\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 8 GB}\nnetwork:\n"
     "intra_node_bandwidth: 300 GB/s\ninter_node_latency_us: 5\n",
     "'intra_node_bandwidth', 'inter_node_latency_us' at the top level after an empty 'network:' section; indent them"),
    ("name: x\nbackend: local\nnodes: 1\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 8 GB}\nnetwork: {intra_node_bandwidth: 300}\n",
     "field 'network.intra_node_bandwidth'"),
    ("name: x\nbackend: locl\nnodes: 1\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 8 GB}\n", "field 'backend'"),
    ("name: x\nbackend: local\nnodes: 0\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 8 GB}\n", "field 'nodes'"),
    ("name: x\nbackend: local\nnodes: 1\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 8 parsecs}\n", "unknown unit"),
    ("name: x\nbackend: local\nnodes: 1\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memroy: 8 GB}\n",
     "unknown field 'accelerator.memroy'; did you mean 'memory'"),
    ("name: x\nbackend: kubernetes\nnodes: 1\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 8 GB}\n",
     "needs a kubernetes: section"),
    ("name: x\nbackend: local\nnodes: true\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 8 GB}\n",
     "field 'nodes': expects a number"),
    ("name: x\nbackend: slurm\nnodes: 1\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 8 GB}\n"
     "slurm: {use_submitit: 'yes'}\n", "field 'slurm.use_submitit': 'yes' is not true or false"),
    # A size in bits is a mistyped GB ("80 gb" would be 10 GB); a number too large for a float is not infinity.
    ("name: x\nbackend: local\nnodes: 1\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 80 gb}\n",
     "'80 gb' is in bits"),
    ("name: x\nbackend: local\nnodes: 1\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 1e400 GB}\n",
     "must be a finite number"),
    ("name: x\nbackend: local\nnodes: 1\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 0 GB}\n",
     "must be positive, got '0 GB'"),
    # A slurm profile without its section: the error must not come out of the default section's assignment, which
    # quoted the whole profile's repr as the value given.
    ("name: x\nbackend: slurm\nnodes: 2\nmin_nodes: 3\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 8 GB}\n",
     "min_nodes=3 exceeds nodes=2; set min_nodes to at most nodes (the run then trains on any node count between them)"),
    # A denormal efficiency divided the cost model by zero; an empty name or run root is no name.
    ("name: x\nbackend: local\nnodes: 1\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 8 GB, matmul_efficiency: 1.0e-320}\n",
     "field 'accelerator.matmul_efficiency': Input should be greater than or equal to 0.001"),
    ("name: ''\nbackend: local\nnodes: 1\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 8 GB}\n", "field 'name'"),
    ("name: x\nbackend: local\nnodes: 1\ngpus_per_node: 2\naccelerator: {peak_tflops: 1, memory: 8 GB}\nstorage: {run_root: ''}\n",
     "field 'storage.run_root'"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "expected"), BAD_PROFILES)
def test_bad_profile_messages(tmp_path, text, expected):
    path = _write(tmp_path, text, "profile.yaml")
    with pytest.raises(ConfigError) as info:
        load_profile(path)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)
    assert str(info.value).count("got") <= 1  # the value is quoted once
    assert "ClusterProfile(" not in str(info.value)  # never the model's repr


def test_units_are_unambiguous():
    assert parse_bytes("80 GB") == 80e9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("200 Gbit/s", per_second=True) == 25e9
    assert parse_bytes("200 Gb/s", per_second=True) == 25e9
    assert parse_bytes("300 GB/s", per_second=True) == 300e9
    with pytest.raises(ValueError):
        parse_bytes("300", per_second=True)
    with pytest.raises(ValueError):
        parse_bytes("300 GB")  # no unit for the number alone is fine, but a rate needs /s
        parse_bytes("300 GB", per_second=True)


def test_strategy_parse_and_errors():
    s = Strategy.parse("dp=2,tp=2,pp=1,mbs=2,gbs=16")
    assert (s.dp, s.tp, s.pp, s.mbs, s.gbs, s.num_microbatches, s.world_size) == (2, 2, 1, 2, 16, 4, 4)
    assert Strategy.parse(str(s)) == s
    with pytest.raises(ValueError, match="did you mean 'dp'"):
        Strategy.parse("db=2,mbs=1,gbs=2")
    # A batch that does not split is a strategy all the same; the feasibility authority says why it cannot run.
    odd = Strategy.parse("dp=4,mbs=4,gbs=8")
    assert "gbs=8 is not a multiple of dp·mbs=16" in batch_problem(load_job(EXAMPLES / "tiny-gpt.yaml"), odd)
    with pytest.raises(ValueError, match="must be a positive integer"):
        Strategy.parse("dp=0,mbs=4,gbs=8")
    # A record's unknown fields (a hand-edited `--measured` file, a newer run's state) are named, not a list repr.
    with pytest.raises(ValueError) as info:
        Strategy.from_dict({**s.to_dict(), "ep": 2, "cp": 1})
    assert str(info.value) == "unknown strategy field(s) 'cp', 'ep'; valid: dp, tp, pp, mbs, gbs"


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["plan", "--profile", "nope.yaml", "--job", "examples/tiny-gpt.yaml"], "nope.yaml: file not found"),
        (["plan", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml", "--set", "batch.mbs_choices=[0]"],
         "mbs_choices"),
        (["plan", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml", "--set", "optimizer.lrr=1"],
         "did you mean 'lr'"),
        (["plan", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml", "--set", "novalue"],
         "expected dotted.key=value"),
        # A value from the command line is named as such: the file is not where to look.
        (["plan", "--profile", "slurm/profiles/a100-4x8.yaml", "--profile-set", "nodes=2.5", "--job", "examples/tiny-gpt.yaml"],
         "field 'nodes': Input should be a valid integer, got a number with a fractional part (got 2.5), set by "
         "--profile-set nodes=2.5"),
        (["plan", "--profile", "slurm/profiles/a100-4x8.yaml", "--job", "examples/tiny-gpt.yaml", "--set", "batch.min_gbs=1000"],
         "min_gbs=1000 is larger than max_gbs=128, with --set batch.min_gbs=1000"),
        (["plan", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml", "--gbs", "0"],
         "--gbs 0: give a positive global batch size"),
        # 5 nodes of 8: the odd factor no power-of-two batch has, nor 4 layers' stages, is named, with batches that
        # have it (3 nodes of 8 pipeline the 4 layers over 3 uneven stages).
        (["plan", "--profile", "slurm/profiles/a100-4x8.yaml", "--profile-set", "nodes=5", "--job", "examples/tiny-gpt.yaml"],
         "40 devices have the factor 5, and none of the global batches [8, 16, 32, 64, 128] is a multiple of it: "
         "give e.g. batch.gbs_choices=[10, 20, 40, 80]"),
        (["render", "slurm", "--profile", "slurm/profiles/a100-4x8.yaml", "--profile-set", "nodes=5", "--job",
          "examples/tiny-gpt.yaml"], "40 devices have the factor 5"),
        # A wide batch range: the batches named are those nearest the base batch, the base among them (the first
        # four, 68 … 544, named a base of 1088 that they do not hold).
        (["plan", "--profile", "slurm/profiles/a100-4x8.yaml", "--profile-set", "nodes=17", "--job",
          "examples/llama-3.2-1b.yaml"], "give e.g. batch.gbs_choices=[136, 272, 544, 1088] with batch.base_gbs=1088"),
        # 3 nodes of 6: the batches named can be split (9 cannot, with micro-batches of 2 or more), and the base
        # batch is named too: with gbs_choices alone the static policy still had nothing to run, and said only
        # the first three reasons sorted (pipeline stages).
        (["plan", "--profile", "slurm/profiles/a100-4x8.yaml", "--profile-set", "nodes=3", "--profile-set",
          "gpus_per_node=6", "--job", "examples/tiny-gpt.yaml"],
         "give e.g. batch.gbs_choices=[18, 36, 72] with batch.base_gbs=18, or use a power-of-two number of devices"),
        (["render", "slurm", "--profile", "slurm/profiles/a100-4x8.yaml", "--profile-set", "nodes=3", "--profile-set",
          "gpus_per_node=6", "--job", "examples/tiny-gpt.yaml", "--set", "batch.gbs_choices=[18, 36, 72]", "--policy",
          "static"],
         "no feasible strategy at batch.base_gbs=16 on 18 devices; 18 devices have the factor 9, and none of the "
         "global batches [16] is a multiple of it: give e.g. batch.gbs_choices=[18, 36, 72] with batch.base_gbs=18"),
        (["render", "slurm", "--profile", "slurm/profiles/a100-4x8.yaml", "--job", "examples/tiny-gpt.yaml",
          "--policy", "statc"], "did you mean 'static'"),
        # A field of the other file: the close-match answer named an unrelated field ("did you mean 'model'?").
        (["plan", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml", "--set", "nodes=2"],
         "--set nodes=2: 'nodes' is a field of the cluster profile, not of the job; give it as --profile-set nodes=2"),
        (["plan", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml", "--profile-set",
          "optimizer.lr=1"], "'optimizer' is a field of the job, not of the cluster profile; give it as --set optimizer.lr=1"),
        # `static:` for `fixed:`: the strategy was dropped and the static policy ran.
        (["render", "local", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml",
          "--policy", "static:dp=1,tp=1,pp=4,mbs=2,gbs=8"],
         "only fixed takes a strategy after ':' (did you mean --policy fixed:dp=1,tp=1,pp=4,mbs=2,gbs=8?)"),
        # The name in capitals had no suggestion; a policy given twice took --policy's without a word.
        (["render", "local", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml",
          "--policy", "CONA"], "--policy 'CONA': did you mean 'cona'?"),
        (["render", "local", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml",
          "--policy", "fixed:dp=4,tp=1,pp=1,mbs=2,gbs=16", "--set", "policy.name=static"],
         "--policy fixed:dp=4,tp=1,pp=1,mbs=2,gbs=16 and --set policy.name=static both set the policy; give it once"),
        # A path into a list, or past a value, says what to give instead; so does an empty field name.
        (["plan", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml", "--set",
          "batch.mbs_choices.0=4"],
         "'batch.mbs_choices' is a list, not a section; give the whole list, e.g. --set batch.mbs_choices=[2, 4, 8, 16]"),
        (["plan", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml", "--set",
          "optimizer.lr.x=1"], "'optimizer.lr' is a value, not a section; set it whole: --set optimizer.lr=VALUE"),
        (["plan", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml", "--set", "=3"],
         "--set '=3': empty field name in ''; expected dotted.key=value"),
        # cona profile replaces the policy and target: a --set of them was dropped (refused before any run dir).
        (["profile", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml", "--set",
          "policy.name=static", "--run-dir", "/nonexistent/profile"],
         "--set policy.name=static: cona profile runs its own schedule"),
        # A run directory is no submitted run's name ("no such run directory" named the directory it was).
        (["submit", "--resume", "./examples"],
         "--resume ./examples: a path, not the name of a submitted run; a run directory is resumed with "
         "`cona run --resume ./examples`"),
        (["submit", "--resume", "Bad_Name"], "--resume Bad_Name: not the name of a submitted run"),
        # -n with a path that exists here: the directory was read and -n dropped.
        (["status", "examples", "-n", "foo"],
         "examples: a path here, but -n/--namespace foo is for a run on Kubernetes; drop -n to use the path"),
        # argparse's own errors are one line too (its usage block came above them), and a misspelled command or
        # choice is answered with the close one.
        (["plan", "--profile", "slurm/profiles/local-cpu.yaml"],
         "cona plan: error: the following arguments are required: --job (see cona plan --help)"),
        (["plam"], "cona: error: argument COMMAND: invalid choice: 'plam'; did you mean 'plan'? (choose from 'plan', "),
        (["render", "slurmm", "--profile", "x", "--job", "y"], "invalid choice: 'slurmm'; did you mean 'slurm'?"),
    ],
)  # fmt: skip
def test_cli_bad_input_is_one_line_exit_2(args, expected):
    result = run_cona(*args)
    assert result.returncode == 2, result.stderr
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_misspelled_option_is_answered_with_the_close_one_and_the_valid_ones():
    """argparse alone says `unrecognized arguments: --tpo 3`; cona names the option meant and lists the command's."""
    typo = run_cona("plan", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml", "--tpo", "3")
    assert typo.returncode == 2 and "Traceback" not in typo.stderr
    assert "cona plan: error: unrecognized arguments: --tpo 3; did you mean --top?; valid options: --all, " in typo.stderr
    listed = typo.stderr.rsplit("valid options: ", 1)[1].removesuffix(" (see cona plan --help)\n").split(", ")
    assert listed == sorted(listed) and {"--gbs", "--job", "--json", "--profile", "--profile-set", "--set", "--top"} <= set(listed)
    render = run_cona("render", "local", "--profile", "slurm/profiles/local-cpu.yaml", "--job", "examples/tiny-gpt.yaml",
                      "--run_dir=x")  # fmt: skip
    assert render.returncode == 2 and "did you mean --run-dir?" in render.stderr, render.stderr
    extra = run_cona("status", "a", "b")  # not an option: argparse's words, no list
    assert extra.returncode == 2 and "unrecognized arguments: b (see cona status --help)\n" in extra.stderr, extra.stderr


def test_version_is_the_installed_packages():
    from importlib.metadata import version

    out = run_cona("--version")
    assert out.returncode == 0 and out.stdout == f"cona {version('cona')}\n", out


@pytest.mark.parametrize(("legacy", "mode"), [(True, "full"), (False, "none")])
def test_old_activation_checkpointing_key_still_loads(tmp_path, legacy, mode):
    from cona.protocol.job import ParallelSpec, job_from_dict

    # run.yaml files of runs made before `parallel.recompute` existed carry the boolean
    job = job_from_dict({"model": {"preset": "tiny-gpt"}, "parallel": {"activation_checkpointing": legacy}})
    assert job.parallel.recompute == mode
    assert "activation_checkpointing" not in job.model_dump()["parallel"]
    assert ParallelSpec(recompute="selective").recompute == "selective"
    with pytest.raises(ValueError, match="not both"):
        ParallelSpec(activation_checkpointing=legacy, recompute="selective")
    with pytest.raises(ValueError, match="recompute"):
        ParallelSpec(recompute="some")


def test_a_dotted_label_key_is_set_quoted_or_escaped(tmp_path):
    """A Kubernetes label key holds dots (`cloud.google.com/gke-accelerator`): `--profile-set` takes it in double
    quotes or with `\\.` (Helm's convention) as one part of the dotted path, not as three nested sections."""
    from cona.protocol.yamlconfig import apply_overrides

    label = "cloud.google.com/gke-accelerator"
    for key in (f'kubernetes.node_selector."{label}"', "kubernetes.node_selector.cloud\\.google\\.com/gke-accelerator"):
        data = apply_overrides({"kubernetes": {"node_selector": {"kubernetes.io/os": "linux"}}}, [f"{key}=nvidia-a100"])
        assert data["kubernetes"]["node_selector"] == {"kubernetes.io/os": "linux", label: "nvidia-a100"}
    # Plain dotted keys are unchanged, and the value may still hold quotes and `=`.
    data = apply_overrides({}, ['optimizer.lr=0.001', 'name="a=b"'])
    assert data == {"optimizer": {"lr": 0.001}, "name": "a=b"}


def test_a_text_field_set_on_the_command_line_takes_the_text_as_written(tmp_path):
    """YAML 1.1 reads `1:00:00` as 3600 (base 60) and `2` as an integer; on the command line the text is what was
    meant (the error's advice, quotes, had to survive the shell). In a file the quotes are asked for, as before
    (a base-60 number as it is read: `test_a_base_60_number_is_no_number_in_any_field`)."""
    profile = load_profile(PROFILES / "local-slurm.yaml", ["slurm.time_limit=1:00:00"])
    assert profile.slurm.time_limit == "1:00:00"
    assert load_profile(PROFILES / "local-slurm.yaml", ["slurm.time_limit=  2 "]).slurm.time_limit == "2"
    assert load_job(EXAMPLES / "tiny-gpt.yaml", ["name=2024"]).name == "2024"
    with pytest.raises(ConfigError, match=r"'80' has no unit; write e.g. '80 GB'.*set by --profile-set accelerator\.memory=80"):
        load_profile(PROFILES / "local-slurm.yaml", ["accelerator.memory=80"])  # the text, judged by its own rule
    with pytest.raises(ConfigError, match=r"field 'batch\.base_gbs'"):
        load_job(EXAMPLES / "tiny-gpt.yaml", ["batch.base_gbs=abc"])  # a number field keeps its own check
    edited = tmp_path / "profile.yaml"
    edited.write_text((PROFILES / "local-slurm.yaml").read_text().replace('time_limit: "01:00:00"', "time_limit: 24:00:00"))
    with pytest.raises(ConfigError, match=r'24:00:00 is a base-60 number to YAML 1\.1 \(86400\); .*quote it if it is text \("24:00:00"'):
        load_profile(edited)


def test_a_base_60_number_is_no_number_in_any_field(tmp_path):
    """YAML 1.1 reads digits separated by colons as one number in base 60: `base_gbs: 1:04` was 64, `1:30:00`
    5400, `env: {FOO: 1:30}` reached the trainers as FOO=90 and `--set batch.max_gbs=2:08` was 128, without a word.
    A file's is refused where it is read, with its line and what to write (quotes keep the text); an override's is
    the text written (`--profile-set slurm.time_limit=1:30:00`, accepted as before), which a number field refuses."""
    job = tmp_path / "job.yaml"
    text = (EXAMPLES / "tiny-gpt.yaml").read_text()
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.strip().startswith("base_gbs:"))
    for written, value in (("1:04", "64"), ("1:30.5", "90.5")):
        job.write_text(text.replace("base_gbs: 16", f"base_gbs: {written}"))
        with pytest.raises(ConfigError) as info:
            load_job(job)
        assert str(info.value) == (f"{job}: line {line} column 13: invalid YAML: {written} is a base-60 number to YAML "
                                   f'1.1 ({value}); write the number itself, or quote it if it is text ("{written}", '
                                   "e.g. a Slurm time)")  # fmt: skip
    profile = tmp_path / "profile.yaml"
    slurm = (PROFILES / "local-slurm.yaml").read_text()
    for edited in (slurm.replace('time_limit: "01:00:00"', "time_limit: 1:30:00"), slurm + "env: {FOO: 1:30}\n"):
        profile.write_text(edited)
        with pytest.raises(ConfigError, match=r"is a base-60 number to YAML 1\.1 \((5400|90)\); .*or quote it"):
            load_profile(profile)
    profile.write_text(slurm.replace('time_limit: "01:00:00"', 'time_limit: "1:30:00"') + 'env: {FOO: "1:30"}\n')
    assert load_profile(profile).slurm.time_limit == "1:30:00" and load_profile(profile).env == {"FOO": "1:30"}

    loaded = load_profile(PROFILES / "local-slurm.yaml", ["slurm.time_limit=1:30:00", "env.FOO=1:30"])
    assert loaded.slurm.time_limit == "1:30:00" and loaded.env == {"FOO": "1:30"}
    with pytest.raises(ConfigError) as info:
        load_job(EXAMPLES / "tiny-gpt.yaml", ["batch.max_gbs=2:08"])
    assert str(info.value) == (f"{EXAMPLES / 'tiny-gpt.yaml'}: field 'batch.max_gbs': '2:08' is not a number here (YAML "
                               "1.1 reads it as base 60, 128); write the number itself, set by --set batch.max_gbs=2:08")  # fmt: skip
    with pytest.raises(ConfigError, match=r"--set 'batch\.mbs_choices=\[1:04\]': 1:04 is a base-60 number"):
        load_job(EXAMPLES / "tiny-gpt.yaml", ["batch.mbs_choices=[1:04]"])  # inside a list: the quotes go there
