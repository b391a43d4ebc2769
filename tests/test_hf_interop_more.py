"""More of the Hugging Face interop (trainer/hf.py) against transformers itself: configs that differ from the
defaults, the files a downloaded or hand-made directory can hold, and an export over an existing model.

Every case was found by saving a tiny model with transformers' own `save_pretrained` and importing it through the
trainer's path (`check_directory` then `load_stage`). A config.json setting cona does not implement must be
refused in one line naming the field, never imported as a model that computes something else; a setting that
computes what cona computes must be imported with transformers' logits.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from cona.protocol.job import ModelSpec

try:
    from tests.test_hf import HF_CLASSES, _cona_model, _hf_model, _tokens
except ImportError:  # tests/ is not a package here
    from test_hf import HF_CLASSES, _cona_model, _hf_model, _tokens

# Two layers of the tiny presets, with transformers' config fields for the same model.
SPECS = {
    "gpt": dict(preset="tiny-gpt", num_layers=2),
    "llama": dict(preset="tiny-llama", num_layers=2),
    "bert": dict(preset="tiny-bert", num_layers=2, type_vocab_size=2, norm_eps=1e-12),
}
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt": dict(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=256, activation_function="gelu",
                tie_word_embeddings=False),
    "llama": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=192, vocab_size=256, max_position_embeddings=64, rms_norm_eps=1e-5,
                  tie_word_embeddings=False),
    "bert": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256, vocab_size=256,
                 max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu"),
}  # fmt: skip
CONFIG_CLASSES = {"gpt": "GPT2Config", "llama": "LlamaConfig", "bert": "BertConfig"}


def _save(family: str, directory: Path, *, model_class: str | None = None, dtype: torch.dtype | None = None,
          **config: Any) -> Path:  # fmt: skip
    """A random transformers model of `family` with `config` over the tiny defaults, saved by save_pretrained."""
    config_cls = getattr(transformers, CONFIG_CLASSES[family])
    torch.manual_seed(1)
    # A copy: transformers fills defaults into the rope mapping it is given, which is the test's parameter.
    config = copy.deepcopy({**CONFIGS[family], "bos_token_id": None, "eos_token_id": None, **config})
    model = getattr(transformers, model_class or HF_CLASSES[family])(config_cls(**config))
    with torch.no_grad():  # norms and biases away from their 1/0 init, so a swapped tensor would show
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(directory)
    return directory


def _edit_config(directory: Path, **changes: Any) -> None:
    """Set (or, with None, remove) keys of a saved config.json, as a hand-edited or older file has them."""
    config = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))


def _max_logit_difference(family: str, spec: ModelSpec, directory: Path) -> float:
    """cona's logits against transformers' for a directory saved by any class of the family; only tensors the
    family's LM class does not hold (BertForPreTraining's pooler and next-sentence head) may be left over."""
    reference, info = getattr(transformers, HF_CLASSES[family]).from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    reference = reference.float().eval()
    ours = _cona_model(spec, hf_dir=directory)
    x = _tokens(spec)
    with torch.no_grad():
        return (ours(x) - reference(x).logits).abs().max().item()


def _refusal(spec: ModelSpec, directory: Path) -> str:
    from cona.trainer import hf

    with pytest.raises(ValueError) as info:
        hf.check_directory(spec, directory)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# (family, config.json over the tiny defaults, what the one line must say). Each of the first five was imported
# without a word as a model that computes something else: GPT-2's unscaled attention (logits off by 0.6), its
# scores divided by the layer number (0.03), a causal BERT (0.3), RoPE that rotates half of each head.
# The others were refused, but in a line that named no field ("attention/MLP biases or hidden_act other than
# silu"), or told to set model.tie_embeddings: false, which cona refuses for BERT.
NOT_IMPLEMENTED = [
    ("gpt", dict(scale_attn_weights=False), "config.json: scale_attn_weights is False (attention scores not scaled by 1/sqrt(head_dim)); cona's gpt always scales them"),
    ("gpt", dict(scale_attn_by_inverse_layer_idx=True), "config.json: scale_attn_by_inverse_layer_idx is True (attention scores divided by the layer's number)"),
    ("bert", dict(is_decoder=True), "config.json: is_decoder is True (causal attention); cona's bert attends in both directions"),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16, "partial_rotary_factor": 0.5}),
     "config.json: partial_rotary_factor is 0.5; cona's llama rotates whole heads"),
    # transformers 5 ignores it under the default RoPE, 4.x rotated that fraction: the model may have been made so.
    ("llama", dict(partial_rotary_factor=0.5), "config.json: partial_rotary_factor is 0.5; cona's llama rotates whole heads"),
    ("llama", dict(attention_bias=True), "config.json: attention_bias is True; cona's llama has no biases"),
    ("llama", dict(mlp_bias=True), "config.json: mlp_bias is True; cona's llama has no biases"),
    ("llama", dict(hidden_act="gelu"), "config.json: hidden_act is 'gelu'; cona's llama gates with SiLU ('silu') only"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}),
     "config.json: rope_parameters.rope_type is 'yarn'; cona implements RoPE scaling of type 'llama3' only"),
    ("bert", dict(tie_word_embeddings=False), "config.json: tie_word_embeddings is false (an MLM decoder of its own), but cona's bert always ties"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "config", "expected"), NOT_IMPLEMENTED)
def test_a_setting_cona_does_not_implement_is_refused_naming_the_field(tmp_path, family, config, expected):
    directory = _save(family, tmp_path / "hf", **config)
    message = _refusal(ModelSpec(**SPECS[family]), directory)
    assert expected in message and "cannot import this model" in message, message
    assert "set model.tie_embeddings" not in message, message  # no advice that the model section then refuses


# Settings transformers computes as cona does, each refused before: the other names ACT2FN gives the two GELUs
# and SiLU, a Llama 3 scaling without original_max_position_embeddings (transformers takes max_position_embeddings),
# and the other model classes whose tensors are the same model.
EQUIVALENT = [
    pytest.param("gpt", {}, dict(activation_function="gelu_python"), {}, id="gpt-gelu_python"),
    pytest.param("gpt", {"gelu_approximation": "tanh"}, dict(activation_function="gelu_fast"), {}, id="gpt-gelu_fast"),
    pytest.param("bert", {"gelu_approximation": "tanh"}, dict(hidden_act="gelu_accurate"), {}, id="bert-gelu_accurate"),
    pytest.param("llama", {}, dict(hidden_act="swish"), {}, id="llama-swish"),
    pytest.param("llama", {"rope_scaling": {"factor": 8.0, "original_max_position_embeddings": 64}},
                 dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "rope_theta": 10000.0}),
                 {}, id="llama3-without-original-context"),
    pytest.param("gpt", {"tie_embeddings": True}, dict(tie_word_embeddings=True), dict(model_class="GPT2Model"),
                 id="GPT2Model"),
    pytest.param("bert", {}, {}, dict(model_class="BertForPreTraining"), id="BertForPreTraining"),
    pytest.param("llama", {}, {}, dict(dtype=torch.bfloat16), id="llama-bf16"),
    pytest.param("gpt", {}, {}, dict(dtype=torch.float16), id="gpt-fp16"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "spec_fields", "config", "save"), EQUIVALENT)
def test_an_equivalent_setting_imports_with_transformers_logits(tmp_path, family, spec_fields, config, save):
    directory = _save(family, tmp_path / "hf", **save, **config)
    # Edited after saving: transformers 5 writes rope_parameters in full, an older or hand-made file may not.
    _edit_config(directory, **{k: v for k, v in config.items() if k == "rope_parameters"})
    assert _max_logit_difference(family, ModelSpec(**{**SPECS[family], **spec_fields}), directory) < 1e-5


def test_rope_theta_is_the_one_transformers_computes_with(tmp_path):
    """A config.json with a top-level rope_theta and another in rope_parameters: transformers 5 uses the mapping's.
    cona took the top-level one, so a job with that value imported a model whose logits were not transformers'."""
    directory = _save("llama", tmp_path / "hf")
    _edit_config(directory, rope_theta=1000.0, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    message = _refusal(ModelSpec(**SPECS["llama"], rope_theta=1000.0), directory)
    assert "rope_theta is 500000.0 there but 1000.0 here; set model.rope_theta: 500000.0" in message, message
    assert _max_logit_difference("llama", ModelSpec(**SPECS["llama"], rope_theta=500000.0), directory) < 1e-5


def test_another_model_class_of_the_same_type_is_refused_naming_architectures(tmp_path):
    """A classifier's config.json names LlamaForSequenceClassification: its tensors were refused one by one (or, for
    a class of other code over the same names, not at all); the line now names the class."""
    directory = _save("llama", tmp_path / "hf", tie_word_embeddings=True)
    _edit_config(directory, architectures=["LlamaForSequenceClassification"])
    message = _refusal(ModelSpec(**SPECS["llama"], tie_embeddings=True), directory)
    assert "config.json: architectures is ['LlamaForSequenceClassification'], not a model cona's llama imports " \
           "(LlamaForCausalLM)" in message, message  # fmt: skip


def _sharded(directory: Path) -> Path:
    torch.manual_seed(1)
    config = transformers.LlamaConfig(**CONFIGS["llama"], bos_token_id=None, eos_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="60KB")
    assert len(list(directory.glob("model-*-of-*.safetensors"))) > 2
    return directory


def _edit_index(directory: Path, change) -> None:
    path = directory / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    change(index["weight_map"])
    path.write_text(json.dumps(index))


def test_an_index_that_disagrees_with_its_shards_is_one_line(tmp_path):
    """A tensor the index puts in a shard that does not hold it was safetensors' own error, a traceback in the
    trainer; a shard named outside the directory was read from there."""
    spec = ModelSpec(**SPECS["llama"])
    directory = _sharded(tmp_path / "hf")
    shards = sorted(p.name for p in directory.glob("model-*-of-*.safetensors"))

    def misplace(weight_map: dict[str, str]) -> None:
        name = next(n for n, f in weight_map.items() if f == shards[0])
        weight_map[name] = shards[1]

    _edit_index(directory, misplace)
    message = _refusal(spec, directory)
    assert message.startswith(f"{directory / 'model.safetensors.index.json'}: names {shards[1]} for tensor '"), message
    assert message.endswith("which that file does not hold; download or export the model again"), message

    other = _sharded(tmp_path / "other")
    _edit_index(other, lambda weight_map: weight_map.update({"model.norm.weight": "../hf/" + shards[-1]}))
    assert "names the file '../hf/" in _refusal(spec, other) and "outside the model directory" in _refusal(spec, other)


def test_model_safetensors_beside_a_stale_index_is_what_transformers_reads(tmp_path):
    """transformers reads model.safetensors when an index is there too (say, shards of an older save); cona read
    the index: two different models from one directory."""
    directory = _sharded(tmp_path / "hf")
    _save("llama", tmp_path / "single")  # other weights (perturbed) in one file
    (directory / "model.safetensors").write_bytes((tmp_path / "single" / "model.safetensors").read_bytes())
    assert _max_logit_difference("llama", ModelSpec(**SPECS["llama"]), directory) < 1e-5


def test_weights_cona_does_not_read_are_named(tmp_path):
    """A pickle-only directory is refused without being opened (loading a pickle can run code), with a line that
    says so instead of asking whether it is a transformers directory; an integer tensor was read as weights."""
    from safetensors.torch import load_file, save_file

    spec = ModelSpec(**SPECS["llama"])
    directory = _save("llama", tmp_path / "hf")
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    (directory / "pytorch_model.bin").write_bytes(b"not to be unpickled")
    message = _refusal(spec, directory)
    assert "holds pytorch_model.bin, not model.safetensors; cona reads safetensors only (loading a pickle can run " \
           "code)" in message, message  # fmt: skip
    (directory / "pytorch_model.bin").unlink()
    tensors["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    assert "tensor 'model.norm.weight' is I32, not a floating-point weight" in _refusal(spec, directory)


def test_an_export_over_a_saved_model_leaves_no_generation_config_of_its_own(tmp_path):
    """`cona export --overwrite` into the directory a run started from (written by save_pretrained, with a
    generation_config.json) kept that file, and transformers generated with its token ids, not the run's."""
    from cona.trainer import hf

    spec = ModelSpec(**SPECS["llama"])
    directory = _save("llama", tmp_path / "hf", bos_token_id=1, eos_token_id=2)
    assert (directory / "generation_config.json").exists()
    hf.save_directory(directory, spec, _cona_model(spec).state_dict(), eos_token_id=7)
    model = _hf_model("llama", directory)
    assert (model.generation_config.bos_token_id, model.generation_config.eos_token_id) == (None, 7)


@pytest.mark.parametrize(
    ("family", "copy", "original"),
    [("gpt", "lm_head.weight", "transformer.wte.weight"), ("llama", "lm_head.weight", "model.embed_tokens.weight"),
     ("bert", "cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight"),
     ("bert", "cls.predictions.decoder.bias", "cls.predictions.bias")],
)  # fmt: skip
def test_a_tied_heads_copy_is_read_as_transformers_reads_it(tmp_path, family, copy, original):
    """A checkpoint of a tied model that also carries the head's copy (converters write it; save_pretrained does
    not): transformers 5 ties the two when equal and, when they differ, leaves them untied and computes with both.
    cona ignored the copy, so a differing one gave logits off by ~30 without a word."""
    from safetensors.torch import load_file, save_file

    spec = ModelSpec(**{**SPECS[family], **({} if family == "bert" else {"tie_embeddings": True})})
    directory = _save(family, tmp_path / "hf", **({} if family == "bert" else {"tie_word_embeddings": True}))
    tensors = load_file(directory / "model.safetensors")
    assert copy not in tensors
    tensors[copy] = tensors[original].clone()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    assert _max_logit_difference(family, spec, directory) < 1e-5
    tensors[copy] = tensors[original] + 0.5
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    message = _refusal(spec, directory)
    assert f"tensor {copy!r} differs from {original!r}, which config.json ties it to" in message, message
    fix = "cannot import this model" if family == "bert" else "set tie_word_embeddings: false in config.json and "
    assert fix in message, message
