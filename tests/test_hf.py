"""The Hugging Face format (trainer/hf.py): export from checkpoints of any layout, import into any layout, each
family against transformers itself (GPT2LMHeadModel, LlamaForCausalLM, BertForMaskedLM) at tiny dims.

transformers is a dev dependency: it is the reference here, cona itself needs only safetensors.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from cona.protocol.job import ModelSpec
from cona.protocol.rundir import ExitCode

try:
    from tests.trainer_helpers import REPO, describe, launch, step_records, trainer_env, write_job
except ImportError:  # tests/ is not a package here
    from trainer_helpers import REPO, describe, launch, step_records, trainer_env, write_job

# One tiny model per family, each with what makes its family's mapping special: GPT-2's fused qkv and Conv1D layout
# with an untied head, Llama's GQA with a tied head and Llama 3's RoPE scaling (its original context below seq_len,
# so the scaling moves most frequencies), BERT's token types, eps 1e-12 and tied decoder.
MODELS = {
    "gpt": dict(preset="tiny-gpt", num_layers=2),
    "llama": dict(preset="tiny-llama", num_layers=2, tie_embeddings=True, rope_theta=500000.0,
                  rope_scaling={"factor": 32.0, "original_max_position_embeddings": 16}),
    "bert": dict(preset="tiny-bert", num_layers=2, type_vocab_size=2, norm_eps=1e-12),
}  # fmt: skip
HF_CLASSES = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM"}


def _spec(family: str, **extra) -> ModelSpec:
    return ModelSpec(**{**MODELS.get(family, MODELS["gpt"]), **extra})


def _tokens(spec: ModelSpec, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, spec.vocab_size, (2, spec.seq_len), generator=torch.Generator().manual_seed(seed))


def _hf_model(family: str, directory: Path):
    model = getattr(transformers, HF_CLASSES[family]).from_pretrained(directory, output_loading_info=True)
    model, info = model
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _saved_by_transformers(family: str, directory: Path, spec: ModelSpec) -> Path:
    """A randomly initialised transformers model of `spec`'s architecture, as save_pretrained writes it."""
    from cona.trainer.hf import hf_config

    config = {k: v for k, v in hf_config(spec).items() if k not in ("architectures", "model_type")}
    config_cls = {"gpt": transformers.GPT2Config, "llama": transformers.LlamaConfig, "bert": transformers.BertConfig}
    torch.manual_seed(1)
    model = getattr(transformers, HF_CLASSES[family])(config_cls[family](**config))
    with torch.no_grad():  # norms and biases away from their 1/0 init, so a swapped tensor would show
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(directory)
    return directory


def _cona_model(spec: ModelSpec, *, hf_dir: Path | None = None, state: dict | None = None):
    from cona.trainer import hf
    from cona.trainer.model import build_model, materialize

    model = materialize(build_model(spec, device="meta"), device="cpu", seed=0)
    if hf_dir is not None:
        hf.load_stage(model, spec, hf.check_directory(spec, hf_dir), label=str(hf_dir))
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


@pytest.mark.parametrize("family", ["gpt", "gpt2-layout", "llama", "bert"])
def test_import_from_a_transformers_saved_model_gives_its_logits(tmp_path, family):
    spec = _spec(family)
    if family == "gpt2-layout":  # GPT-2's published form: tied head, tanh GELU ("gelu_new")
        family, spec = "gpt", _spec("gpt", tie_embeddings=True, gelu_approximation="tanh")
    directory = _saved_by_transformers(family, tmp_path / "hf", spec)
    reference = _hf_model(family, directory)
    ours = _cona_model(spec, hf_dir=directory)
    x = _tokens(spec)
    with torch.no_grad():
        want, got = reference(x).logits, ours(x)
    assert (got - want).abs().max().item() < 1e-5
    if family == "llama":  # the scaling is on and matters: without it the logits differ
        plain = _cona_model(_spec(family, rope_scaling=None), hf_dir=None)
        plain.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert (plain(x) - want).abs().max().item() > 1e-3


def test_mismatches_are_one_line_naming_the_field_or_tensor(tmp_path):
    from cona.trainer import hf
    from safetensors.torch import load_file, save_file

    spec = _spec("gpt")
    directory = _saved_by_transformers("gpt", tmp_path / "hf", spec)
    cases = [
        (_spec("gpt", hidden_size=32, num_heads=4), "hidden_size is 64 there but 32 here; set model.hidden_size: 64"),
        (_spec("gpt", tie_embeddings=True), "set model.tie_embeddings: false"),
        (_spec("gpt", gelu_approximation="tanh"), "activation_function is 'gelu'; set model.gelu_approximation: none"),
        (ModelSpec(**{**MODELS["llama"]}), "a gpt2 model, but model.family is llama; set model.family: gpt"),
    ]
    for wrong, expected in cases:
        with pytest.raises(ValueError) as info:
            hf.check_directory(wrong, directory)
        assert expected in str(info.value) and "\n" not in str(info.value)
    tensors = load_file(directory / "model.safetensors")
    tensors["transformer.h.1.mlp.c_fc.weight"] = tensors["transformer.h.1.mlp.c_fc.weight"][:, :128].contiguous()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as info:
        _cona_model(spec, hf_dir=directory)
    message = str(info.value)
    assert "'transformer.h.1.mlp.c_fc.weight' has shape (64, 128), the model needs (64, 256)" in message, message
    assert "\n" not in message
    # Through the trainer: exit CONFIG with that one line, before any process group.
    job = write_job(tmp_path, preset="tiny-gpt", model={"num_layers": 2, "init_from": str(directory)})
    result = launch(tmp_path / "run", nproc=0, strategy="dp=1,mbs=8,gbs=16", job=job, max_steps=1)
    assert result.returncode == ExitCode.CONFIG, describe(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith("cona trainer: error")]
    assert len(errors) == 1 and "model.init_from:" in errors[0] and "c_fc.weight" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def _break_config(**changes):
    def apply(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **changes}))

    return apply


def _truncate(name: str, size: int):
    def apply(directory: Path) -> None:
        with open(directory / name, "r+b") as f:
            f.truncate(size)

    return apply


def _replace_with_directory(name: str):
    def apply(directory: Path) -> None:
        (directory / name).unlink()
        (directory / name).mkdir()

    return apply


def _write_index(index):
    def apply(directory: Path) -> None:
        # Instead of model.safetensors: beside it, the index is not read (by transformers, nor by cona).
        (directory / "model.safetensors").unlink()
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))

    return apply


# Each was a traceback in the trainer (SafetensorError, OSError, AttributeError, TypeError), a codec's or float()'s
# bare message naming no file, or (a string, a bool) taken as a number and compared.
DAMAGED_HF = [
    (_truncate("model.safetensors", 0), "model.safetensors: not a readable safetensors file (Error while deserializing header: header too small); download or export it again"),
    (_truncate("model.safetensors", 20), "model.safetensors: not a readable safetensors file (Error while deserializing header: invalid header length)"),
    (_truncate("model.safetensors", 100_000), "model.safetensors: not a readable safetensors file (Error while deserializing header: incomplete metadata, file not fully covered)"),
    (_replace_with_directory("model.safetensors"), "model.safetensors: not a readable safetensors file"),
    (_replace_with_directory("config.json"), "config.json: cannot read (Is a directory); model.init_from must name"),
    (_write_index({"weight_map": ["model.safetensors"]}), "model.safetensors.index.json: not a safetensors index (its weight_map is no mapping"),
    (_write_index({"weight_map": {"lm_head.weight": 1}}), "model.safetensors.index.json: not a safetensors index (its weight_map is no mapping"),
    (_break_config(n_embd="64"), "config.json: n_embd is '64', not an integer; fix config.json (model.hidden_size)"),
    (_break_config(n_embd=[64]), "config.json: n_embd is [64], not an integer; fix config.json (model.hidden_size)"),
    (_break_config(n_embd=None, n_inner=None), "config.json: has no n_embd (model.hidden_size)"),
    (_break_config(vocab_size=True), "config.json: vocab_size is True, not an integer"),
    (_break_config(layer_norm_epsilon="x"), "config.json: layer_norm_epsilon is 'x', not a number; fix config.json (model.norm_eps)"),
    (_break_config(tie_word_embeddings="no"), "config.json: tie_word_embeddings is 'no', not true or false"),
]  # fmt: skip


@pytest.mark.parametrize(("damage", "expected"), DAMAGED_HF)
def test_a_damaged_or_mistyped_hf_directory_is_one_line_naming_the_file(tmp_path, damage, expected):
    from cona.trainer import hf

    spec = _spec("gpt")
    hf.save_directory(tmp_path / "hf", spec, _cona_model(spec).state_dict())
    damage(tmp_path / "hf")
    with pytest.raises(ValueError) as info:
        hf.check_directory(spec, tmp_path / "hf")
    assert expected in str(info.value) and str(tmp_path / "hf") in str(info.value), info.value
    assert "\n" not in str(info.value)


def test_an_export_under_another_model_spec_is_refused_not_cut_short(tmp_path):
    """`cona export --job` naming fewer layers than the checkpoint wrote a 2-layer model from a 4-layer one without
    a word; other dimensions wrote a config.json its weights do not fit."""
    from cona.trainer import hf

    state = _cona_model(_spec("gpt", num_layers=4)).state_dict()
    with pytest.raises(ValueError, match=r"tensor 'layers\.2\..*' has no place in this model \(32 such; is it a "
                                         r"checkpoint of this model\?\)"):  # fmt: skip
        hf.save_directory(tmp_path / "fewer", _spec("gpt", num_layers=2), state)
    with pytest.raises(ValueError, match=r"tensor 'tok_embeddings\.weight' has shape \(256, 64\), the model needs "
                                         r"\(256, 32\)"):  # fmt: skip
        hf.save_directory(tmp_path / "narrower", _spec("gpt", num_layers=4, hidden_size=32), state)
    assert not (tmp_path / "fewer").exists() and not (tmp_path / "narrower").exists()


def test_mistyped_llama_rope_scaling_is_named():
    from cona.trainer import hf

    spec = _spec("llama")
    config = hf.hf_config(spec)
    config["rope_scaling"] = {**config["rope_scaling"], "factor": "x"}
    assert hf.config_problem(spec, config, source="c.json") == "c.json: rope_scaling.factor is 'x', not a number; fix config.json"
    config["rope_scaling"] = [1]
    assert hf.config_problem(spec, config, source="c.json") == "c.json: rope_scaling is [1], not a mapping; fix config.json"


def _export(run: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """`cona export` through the command line (which runs the data plane's program)."""
    cmd = [sys.executable, "-m", "cona.orchestrator.cli", "export", str(run), "--format", "hf", "--out", str(out), *extra]
    return subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=120)


def _export_here(run: Path, out: Path, *extra: str) -> None:
    """The same program in this process (no interpreter start-up)."""
    from cona.trainer.export import main

    assert main([str(run), "--format", "hf", "--out", str(out), *extra]) == 0


def _check_export_matches_checkpoint(family: str, spec: ModelSpec, run: Path, out: Path) -> None:
    """The export of the run's newest checkpoint loads in transformers with cona's logits for that checkpoint."""
    from cona.trainer.checkpoint import read_checkpoint_tensors
    from cona.trainer.hf import CONFIG

    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    state = {k.removeprefix("model."): v for k, v in read_checkpoint_tensors(newest).items() if k.startswith("model.")}
    ours = _cona_model(spec, state=state)
    reference = _hf_model(family, out)
    assert json.loads((out / CONFIG).read_text())["architectures"] == [HF_CLASSES[family]]
    x = _tokens(spec, seed=3)
    with torch.no_grad():
        assert (ours(x) - reference(x).logits).abs().max().item() < 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("family", "strategy", "nproc"),
    [pytest.param("gpt", "dp=1,tp=2,pp=1,mbs=4,gbs=16", 2, id="gpt-tp2"),
     pytest.param("bert", "dp=2,tp=1,pp=1,mbs=4,gbs=16", 2, id="bert-dp2")],
)  # fmt: skip
def test_export_from_a_layout_loads_in_transformers(tmp_path, family, strategy, nproc):
    spec = _spec(family)
    model = {k: v for k, v in MODELS[family].items() if k != "preset"}
    job = write_job(tmp_path, preset=MODELS[family]["preset"], model=model)
    trained = launch(tmp_path / "run", nproc=nproc, strategy=strategy, job=job, max_steps=2)
    assert trained.returncode == 0 and trained.exit_code == ExitCode.STOPPED, describe(trained)
    out = tmp_path / "exported"
    # Sharded (100 KB shards of a 1 MB model): the index and every shard load in transformers.
    _export_here(tmp_path / "run", out, "--max-shard-size", "100KB")
    assert (out / "model.safetensors.index.json").exists() and not (out / "model.safetensors").exists()
    _check_export_matches_checkpoint(family, spec, tmp_path / "run", out)
    # A damaged checkpoint of the right size (the manifest's sizes hold) and an --out that is a file: one line each.
    from cona.trainer import hf
    from cona.trainer.export import main

    (tmp_path / "a-file").write_text("x")
    assert main([str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "a-file")]) == ExitCode.CONFIG
    # Into the directory it exported before: refused without --overwrite, identical with it.
    digest = hf.directory_digest(out)
    assert main([str(tmp_path / "run"), "--format", "hf", "--out", str(out)]) == ExitCode.CONFIG
    _export_here(tmp_path / "run", out, "--max-shard-size", "100KB", "--overwrite")
    assert hf.directory_digest(out) == digest
    newest = max((tmp_path / "run" / "checkpoints").glob("step-*"))
    # Into a checkpoint (or beside them): it wrote config.json and weights into the DCP directory, with --overwrite.
    before = sorted(p.name for p in newest.iterdir())
    for inside in (newest, tmp_path / "run" / "checkpoints" / "hf"):
        assert main([str(tmp_path / "run"), "--format", "hf", "--out", str(inside), "--overwrite"]) == ExitCode.CONFIG
    assert sorted(p.name for p in newest.iterdir()) == before and not (tmp_path / "run" / "checkpoints" / "hf").exists()
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 4 : len(data) // 2] = bytes(len(data) // 2 - len(data) // 4)
    shard.write_bytes(bytes(data))
    assert main([str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "again")]) == ExitCode.CONFIG
    (newest / ".metadata").write_bytes(bytes((newest / ".metadata").stat().st_size))
    assert main([str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "again")]) == ExitCode.CONFIG


@pytest.mark.parametrize("family", ["gpt", "llama", "bert", "bert-without-token-types"])
def test_import_then_export_is_bit_identical(tmp_path, family):
    """What a run started from a directory holds exports to the same bytes (the trainer's round trip, with DCP in
    between, is in the dp2×pp2 test below)."""
    from cona.trainer import hf

    spec = _spec("bert", type_vocab_size=0) if family == "bert-without-token-types" else _spec(family)
    model = _cona_model(spec)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    hf.save_directory(tmp_path / "first", spec, model.state_dict(), max_shard_bytes=100_000)
    again = _cona_model(spec, hf_dir=tmp_path / "first")
    hf.save_directory(tmp_path / "second", spec, again.state_dict(), max_shard_bytes=100_000)
    assert hf.directory_digest(tmp_path / "first") == hf.directory_digest(tmp_path / "second")
    assert len(list((tmp_path / "first").glob("model-*-of-*.safetensors"))) > 1


@pytest.mark.distributed
def test_a_run_from_imported_weights_continues_alike_under_dp2_pp2(tmp_path):
    """Llama from a transformers-saved model: dp2×pp2 (the tied head's two copies on the first and the last stage)
    trains with the losses of one process from the same weights; its checkpoint exports back to transformers."""
    spec = _spec("llama")
    directory = _saved_by_transformers("llama", tmp_path / "hf", spec)
    model = {k: v for k, v in MODELS["llama"].items() if k != "preset"}
    job = write_job(tmp_path, preset="tiny-llama", model={**model, "init_from": str(directory)})
    single = launch(tmp_path / "single", nproc=0, strategy="dp=1,mbs=16,gbs=16", job=job, max_steps=3)
    assert single.returncode == 0 and single.exit_code == ExitCode.STOPPED, describe(single)
    parallel = launch(tmp_path / "parallel", nproc=4, strategy="dp=2,tp=1,pp=2,mbs=4,gbs=16", job=job, max_steps=3)
    assert parallel.returncode == 0 and parallel.exit_code == ExitCode.STOPPED, describe(parallel)
    assert "starting from the weights in" in parallel.stdout
    want, got = step_records(tmp_path / "single", 0), step_records(tmp_path / "parallel", 0)
    for step in (1, 2, 3):
        assert got[step]["train_loss"] == pytest.approx(want[step]["train_loss"], abs=1e-5), step
    # The first loss is the imported model's, not a random initialisation's: transformers computes it too.
    reference = _hf_model("llama", directory)
    from cona.protocol.job import load_job
    from cona.trainer.data import Batcher, load_corpus

    loaded = load_job(job)
    batch = Batcher(loaded, load_corpus(loaded)).samples(0, 16)
    with torch.no_grad():
        labels = torch.from_numpy(batch.labels)
        logits = reference(torch.from_numpy(batch.inputs)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    assert want[1]["train_loss"] == pytest.approx(loss.item(), abs=1e-5)
    # Its dp2×pp2 checkpoint exports (through the `cona` command line) to transformers with cona's logits ...
    exported = _export(tmp_path / "parallel", tmp_path / "exported")
    assert exported.returncode == 0 and "LlamaForCausalLM" in exported.stdout, exported.stderr
    _check_export_matches_checkpoint("llama", spec, tmp_path / "parallel", tmp_path / "exported")
    # ... and round-trips: a run from the export, checkpointed at step 0 (--max-steps 0), exports the same bytes.
    again_job = write_job(tmp_path, name="again.yaml", preset="tiny-llama",
                          model={**model, "init_from": str(tmp_path / "exported")})  # fmt: skip
    again = launch(tmp_path / "again", nproc=0, strategy="dp=1,mbs=16,gbs=16", job=again_job, max_steps=0)
    assert again.returncode == 0 and again.exit.name == "STOPPED", describe(again)
    _export_here(tmp_path / "again", tmp_path / "second")
    from cona.trainer.hf import directory_digest

    assert directory_digest(tmp_path / "exported") == directory_digest(tmp_path / "second")


def test_export_errors_are_one_line(tmp_path, capsys):
    from cona.trainer.export import main

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    for args, expected in [
        ([str(tmp_path / "nothing")], "no such run directory"),
        ([str(tmp_path / "run")], "no complete checkpoint to export"),
        ([str(tmp_path / "run"), "--step", "3"], "--step 3: no complete checkpoint step-00000003 (complete steps: none)"),
        ([str(tmp_path / "run"), "--max-shard-size", "lots"], "--max-shard-size 'lots'"),
        ([str(tmp_path / "run"), "--step", "-1"], "--step -1: give an optimizer step (0 or more)"),
    ]:
        assert main([*args, "--format", "hf", "--out", str(tmp_path / "out")]) == ExitCode.CONFIG
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err


def test_a_damaged_checkpoint_names_the_intact_one_to_export(tmp_path, capsys):
    """The newest checkpoint cut short: the line says which --step still exports (the one the trainer resumes)."""
    from cona.trainer.export import main

    run = tmp_path / "run"
    for step in (4, 8):
        path = run / "checkpoints" / f"step-{step:08d}"
        path.mkdir(parents=True)
        (path / ".metadata").write_bytes(b"x")
        (path / "trainer_state.json").write_text(json.dumps({"step": step}))
        (path / "COMPLETE").write_text(json.dumps({"step": step, "files": {".metadata": 1, "trainer_state.json": 11}}))
    (run / "checkpoints" / "step-00000008" / ".metadata").write_bytes(b"")
    assert main([str(run), "--format", "hf", "--out", str(tmp_path / "out")]) == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert err.strip().endswith(".metadata has 0 bytes, expected 1 (truncated or overwritten); export an intact one "
                                "with --step 4"), err  # fmt: skip
    (run / "checkpoints" / "step-00000004" / ".metadata").unlink()
    assert main([str(run), "--format", "hf", "--out", str(tmp_path / "out")]) == ExitCode.CONFIG
    assert capsys.readouterr().err.strip().endswith("; the run has no other intact checkpoint")


def test_an_export_that_cannot_be_written_is_one_line_and_leaves_no_torn_model(tmp_path, monkeypatch):
    """A --out under a file, and a disk that fills while the weights are written (safetensors raises its own error
    type, not OSError): both were tracebacks, and the second left config.json beside a torn model.safetensors."""
    import safetensors.torch
    from cona.trainer import hf
    from safetensors import SafetensorError

    spec = _spec("gpt")
    state = _cona_model(spec).state_dict()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError) as info:
        hf.save_directory(tmp_path / "file" / "out", spec, state)
    assert str(info.value).startswith(f"{tmp_path / 'file' / 'out'}: cannot write the model (Not a directory); "
                                      "give a writable directory with 0.5 MB free"), info.value  # fmt: skip

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"torn")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(ValueError) as info:
        hf.save_directory(tmp_path / "out", spec, state)
    assert "cannot write the model (Error while serializing: I/O error: No space left on device" in str(info.value)
    assert "\n" not in str(info.value) and list((tmp_path / "out").iterdir()) == []


def test_the_presets_take_the_published_configs():
    """config.json of Llama 3.2 1B and of BERT-Large (uncased) as published, and GPT-2's layout at GPT-3 XL's size:
    the presets match them as they are (the tensors' shapes follow from the same fields)."""
    from cona.trainer.hf import config_problem

    llama = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
             "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
             "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
             "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
             "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
             "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                              "original_max_position_embeddings": 8192, "rope_type": "llama3"},
             "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
             "vocab_size": 128256}  # fmt: skip
    bert = {"architectures": ["BertForMaskedLM"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
            "hidden_dropout_prob": 0.1, "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 4096,
            "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert", "num_attention_heads": 16,
            "num_hidden_layers": 24, "pad_token_id": 0, "type_vocab_size": 2, "vocab_size": 30522}  # fmt: skip
    assert config_problem(ModelSpec(preset="llama-3.2-1b"), llama, source="llama") is None
    assert config_problem(ModelSpec(preset="bert-large"), bert, source="bert") is None
    from cona.trainer.hf import hf_config

    gpt = ModelSpec(preset="gpt3-1.3b")
    assert config_problem(gpt, hf_config(gpt), source="gpt") is None
    del llama["tie_word_embeddings"]  # transformers' default for Llama is untied
    assert "set model.tie_embeddings: false" in config_problem(ModelSpec(preset="llama-3.2-1b"), llama, source="x")
    llama["tie_word_embeddings"], llama["rope_scaling"] = True, None
    assert "set model.rope_scaling: null" in config_problem(ModelSpec(preset="llama-3.2-1b"), llama, source="x")


class _Collected(list):
    """transformers' log records of WARNING and above (its loggers do not propagate to the root, so caplog misses
    them)."""

    def __enter__(self) -> _Collected:
        import logging

        collected = self

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                collected.append(record.getMessage())

        self._handler = Handler(level=logging.WARNING)
        logging.getLogger("transformers").addHandler(self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        import logging

        logging.getLogger("transformers").removeHandler(self._handler)


@pytest.mark.parametrize("family", ["gpt", "llama", "bert"])
@pytest.mark.parametrize("eos", [None, 3])
def test_config_json_says_the_token_ids_so_transformers_defaults_never_apply(tmp_path, family, eos):
    """config.json without bos/eos took transformers' defaults: GPT-2's 50256, outside a 256-token vocabulary (a
    warning at every load; generation never stops), Llama's 1 and 2 (generation stops on a byte the run never saw as
    an end)."""
    from cona.trainer import hf

    spec = _spec(family)
    hf.save_directory(tmp_path / "hf", spec, _cona_model(spec).state_dict(), eos_token_id=eos)
    with _Collected() as warned:
        model = _hf_model(family, tmp_path / "hf")
    assert not warned, warned
    assert (model.config.bos_token_id, model.config.eos_token_id) == (None, eos)
    if family != "bert":
        generation = model.generation_config
        assert (generation.bos_token_id, generation.eos_token_id) == (None, eos)
        prompt = torch.tensor([[5, 6]])
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
        assert out.shape[1] <= 5


def test_export_takes_the_recorded_model_refuses_another_job_and_names_no_token_it_lacks(tmp_path, capsys):
    """`cona export --job` of another model (norm eps 0.1, tanh GELU) wrote that model over the checkpoint's
    weights with exit 0: logits off by up to 4.3. The recorded model is used, and such a job refused in one line
    naming the fields, as the trainer's resume does."""
    from cona.trainer.export import main

    job = write_job(tmp_path, model={"num_layers": 2})  # byte-level text: no end-of-document token
    trained = launch(tmp_path / "run", nproc=0, strategy="dp=1,mbs=8,gbs=16", job=job, max_steps=1)
    assert trained.returncode == 0 and trained.exit_code == ExitCode.STOPPED, describe(trained)
    other = write_job(tmp_path, name="other.yaml", model={"num_layers": 2, "norm_eps": 0.1, "gelu_approximation": "tanh"})
    args = [str(tmp_path / "run"), "--format", "hf", "--out"]
    assert main([*args, str(tmp_path / "other"), "--job", str(other)]) == ExitCode.CONFIG
    err = capsys.readouterr().err
    assert err.startswith(f"cona: error: --job {other}: ") and len(err.strip().splitlines()) == 1, err
    assert "gelu_approximation 'none' (this job: 'tanh'), norm_eps 1e-05 (this job: 0.1)" in err, err
    assert err.strip().endswith("leave --job out to export the model the checkpoint records"), err
    assert not (tmp_path / "other").exists()

    # The job it was trained with: accepted, and its data (byte-level text) has no end-of-document token.
    assert main([*args, str(tmp_path / "hf"), "--job", str(job)]) == 0
    assert capsys.readouterr().err == ""
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["layer_norm_epsilon"]) == (None, None, 1e-5)
    with _Collected() as warned:
        _check_export_matches_checkpoint("gpt", _spec("gpt"), tmp_path / "run", tmp_path / "hf")
    assert not warned, warned
    capsys.readouterr()  # transformers' progress bar
    # Trained by hand, without run.yaml or --job: the same model, and a warning that the data is not known.
    assert main([*args, str(tmp_path / "again")]) == 0
    err = capsys.readouterr().err
    assert err.startswith("cona export: warning: ") and len(err.strip().splitlines()) == 1, err
    assert "no --job names its data" in err and "config.json says eos_token_id: null" in err, err
    from cona.trainer.hf import directory_digest

    assert directory_digest(tmp_path / "again") == directory_digest(tmp_path / "hf")


def test_the_end_of_document_id_is_the_one_the_run_trained_with(tmp_path):
    """From the tokens.json of `cona data prepare` beside the data of run.yaml's job (else --job's); none for text;
    unknown (a warning) for a raw token file or data that is gone."""
    import yaml
    from cona.protocol.job import job_to_dict, load_job
    from cona.protocol.rundir import RunDir
    from cona.trainer.export import run_eos

    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "tokens.bin").write_bytes(bytes(8))
    (prepared / "tokens.json").write_text(json.dumps({"eos_id": 5, "vocab_size": 300, "token_dtype": "uint16"}))
    (tmp_path / "raw.bin").write_bytes(bytes(8))
    (tmp_path / "text.txt").write_text("to be\n")

    def eos(data_path: str, *, recorded: bool = False, vocab_size: int = 512) -> tuple[int | None, str | None]:
        job = load_job(write_job(tmp_path, data={"path": data_path}))
        run = tmp_path / "run"
        run.mkdir(exist_ok=True)
        (run / "run.yaml").unlink(missing_ok=True)
        if recorded:  # what `cona run` writes; --job is then not asked for the data
            (run / "run.yaml").write_text(yaml.safe_dump({"job": job_to_dict(job)}))
            job = load_job(write_job(tmp_path, name="other.yaml", data={"path": str(tmp_path / "text.txt")}))
        return run_eos(RunDir(run), job, vocab_size=vocab_size)

    assert eos(str(prepared)) == (5, None)
    assert eos(str(prepared / "tokens.bin")) == (5, None)
    assert eos(str(prepared), recorded=True) == (5, None)
    assert eos(str(tmp_path / "text.txt")) == (None, None)
    for path, why in [(str(tmp_path / "raw.bin"), "has no tokens.json beside it"), (str(tmp_path / "gone"), "no longer exists")]:
        value, warning = eos(path)
        assert value is None and why in warning and warning.endswith("config.json says eos_token_id: null (set it "
                                                                     "there if the data has one)"), warning  # fmt: skip
    value, warning = eos(str(prepared), vocab_size=4)
    assert value is None and "end-of-document id 5 is outside the model's vocabulary of 4" in warning


def test_bert_weights_with_token_types_are_refused_before_the_process_group(tmp_path):
    """A transformers BERT (type_vocab_size 2 by default) loaded into a model without token types was refused only
    while the stage was built, after the process group: a traceback, and `cona run` retried it as a crash."""
    from cona.trainer import hf

    directory = _saved_by_transformers("bert", tmp_path / "hf", _spec("bert"))
    with pytest.raises(ValueError, match=r"holds token-type embeddings, which this model lacks; set "
                                         r"model.type_vocab_size: 2"):  # fmt: skip
        hf.check_directory(_spec("bert", type_vocab_size=0), directory)
    hf.check_directory(_spec("bert"), directory)  # with its token types: fine
