"""The Hugging Face format: cona's parameter names to and from transformers' GPT2LMHeadModel, LlamaForCausalLM and
BertForMaskedLM, `config.json`, and `model.safetensors` (sharded with an index above a size).

A directory in this format is what `transformers` `from_pretrained` reads and `save_pretrained` writes:

    config.json                                  the architecture (`hf_config`)
    model.safetensors                            every tensor, fp32, under transformers' names; or, above
    model-0000k-of-0000n.safetensors             `max_shard_bytes`, shards and the index that says which tensor
    model.safetensors.index.json                 is in which shard

Only `safetensors` is needed (no transformers): `cona export` writes the format from a DCP checkpoint of any
layout (`export_checkpoint`, one process, no process group: `torch.distributed.checkpoint` loads the model's
tensors offline), and `model.init_from` reads it into each pipeline stage as it is built (`load_stage`), before
tensor parallelism and FSDP2 split it, so any layout starts from the same weights.

**The mapping** (`_entries`) is one table per family. Each entry is one transformers tensor made of one or more cona
tensors concatenated along dim 0, transposed for GPT-2's Conv1D layers (which store [in, out]): GPT-2's fused
`c_attn` is cona's q, k and v. A tied head (BERT always; gpt/llama with `model.tie_embeddings`) is not written:
transformers ties it to the embedding itself, from config.json's `tie_word_embeddings`. A BERT without token types
(tiny-bert) is written with a one-row token-type table of zeros, which adds nothing (transformers' BERT always
has one), and such a table is accepted back.

Reading checks the architecture against the job first (`config_problem`: family, sizes, norms, activation, tying,
RoPE) and then every tensor's shape, and fails with one line naming the field or the tensor and what to set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from cona.protocol.job import ModelSpec, RopeScaling

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
"""transformers' own default shard size (5 GB)."""

ARCHITECTURES = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM"}
MODEL_TYPES = {"gpt": "gpt2", "llama": "llama", "bert": "bert"}
# Tensors a transformers checkpoint may carry that hold nothing of cona's: attention-mask buffers of old GPT-2
# files, RoPE caches and BERT's position ids (the copies of a tied head are `unused_tensors`' business), and the
# parts of a pretraining BERT that masked-LM training does not use (the pooler, the next-sentence head).
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq", "embeddings.position_ids")
_IGNORED_PREFIXES = ("bert.pooler.", "cls.seq_relationship.")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One transformers tensor: `hf` is the concatenation along dim 0 of the cona tensors `cona` (transposed when
    `transpose`)."""

    hf: str
    cona: tuple[str, ...]
    transpose: bool = False


def _entries(spec: ModelSpec) -> list[Entry]:
    """The whole model's mapping, in transformers' order."""
    L = range(spec.num_layers)
    if spec.family == "gpt":
        out = [Entry("transformer.wte.weight", ("tok_embeddings.weight",)),
               Entry("transformer.wpe.weight", ("pos_embeddings.weight",))]  # fmt: skip
        for i in L:
            h, c = f"transformer.h.{i}.", f"layers.{i}."
            qkv = ("attn.wq", "attn.wk", "attn.wv")
            out += [
                Entry(h + "ln_1.weight", (c + "attn_norm.weight",)), Entry(h + "ln_1.bias", (c + "attn_norm.bias",)),
                Entry(h + "attn.c_attn.weight", tuple(c + n + ".weight" for n in qkv), transpose=True),
                Entry(h + "attn.c_attn.bias", tuple(c + n + ".bias" for n in qkv)),
                Entry(h + "attn.c_proj.weight", (c + "attn.wo.weight",), transpose=True),
                Entry(h + "attn.c_proj.bias", (c + "attn.wo.bias",)),
                Entry(h + "ln_2.weight", (c + "mlp_norm.weight",)), Entry(h + "ln_2.bias", (c + "mlp_norm.bias",)),
                Entry(h + "mlp.c_fc.weight", (c + "mlp.w1.weight",), transpose=True),
                Entry(h + "mlp.c_fc.bias", (c + "mlp.w1.bias",)),
                Entry(h + "mlp.c_proj.weight", (c + "mlp.w2.weight",), transpose=True),
                Entry(h + "mlp.c_proj.bias", (c + "mlp.w2.bias",)),
            ]  # fmt: skip
        out += [Entry("transformer.ln_f.weight", ("norm.weight",)), Entry("transformer.ln_f.bias", ("norm.bias",))]
        if not spec.tie_embeddings:
            out.append(Entry("lm_head.weight", ("output.weight",)))
        return out
    if spec.family == "llama":
        out = [Entry("model.embed_tokens.weight", ("tok_embeddings.weight",))]
        for i in L:
            h, c = f"model.layers.{i}.", f"layers.{i}."
            out += [
                Entry(h + "self_attn.q_proj.weight", (c + "attn.wq.weight",)),
                Entry(h + "self_attn.k_proj.weight", (c + "attn.wk.weight",)),
                Entry(h + "self_attn.v_proj.weight", (c + "attn.wv.weight",)),
                Entry(h + "self_attn.o_proj.weight", (c + "attn.wo.weight",)),
                Entry(h + "mlp.gate_proj.weight", (c + "mlp.w1.weight",)),
                Entry(h + "mlp.up_proj.weight", (c + "mlp.w3.weight",)),
                Entry(h + "mlp.down_proj.weight", (c + "mlp.w2.weight",)),
                Entry(h + "input_layernorm.weight", (c + "attn_norm.weight",)),
                Entry(h + "post_attention_layernorm.weight", (c + "mlp_norm.weight",)),
            ]
        out.append(Entry("model.norm.weight", ("norm.weight",)))
        if not spec.tie_embeddings:
            out.append(Entry("lm_head.weight", ("output.weight",)))
        return out
    emb = "bert.embeddings."
    out = [Entry(emb + "word_embeddings.weight", ("tok_embeddings.weight",)),
           Entry(emb + "position_embeddings.weight", ("pos_embeddings.weight",))]  # fmt: skip
    if spec.type_vocab_size:
        out.append(Entry(emb + "token_type_embeddings.weight", ("type_embeddings.weight",)))
    out += [Entry(emb + "LayerNorm.weight", ("emb_norm.weight",)), Entry(emb + "LayerNorm.bias", ("emb_norm.bias",))]
    pairs = [("attention.self.query", "attn.wq"), ("attention.self.key", "attn.wk"), ("attention.self.value", "attn.wv"),
             ("attention.output.dense", "attn.wo"), ("attention.output.LayerNorm", "attn_norm"),
             ("intermediate.dense", "mlp.w1"), ("output.dense", "mlp.w2"), ("output.LayerNorm", "mlp_norm")]  # fmt: skip
    for i in L:
        for hf_name, cona_name in pairs:
            for leaf in ("weight", "bias"):
                out.append(Entry(f"bert.encoder.layer.{i}.{hf_name}.{leaf}", (f"layers.{i}.{cona_name}.{leaf}",)))
    head = "cls.predictions."
    out += [Entry(head + "bias", ("output.bias",)),
            Entry(head + "transform.dense.weight", ("mlm_dense.weight",)),
            Entry(head + "transform.dense.bias", ("mlm_dense.bias",)),
            Entry(head + "transform.LayerNorm.weight", ("mlm_norm.weight",)),
            Entry(head + "transform.LayerNorm.bias", ("mlm_norm.bias",))]  # fmt: skip
    return out


_NO_TYPES = "bert.embeddings.token_type_embeddings.weight"
"""Written as one row of zeros for a BERT without token types (transformers' BERT always has the table)."""


def _shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    from cona.trainer.model import build_model

    return {name: tuple(p.shape) for name, p in build_model(spec, device="meta").named_parameters()}


# config.json ----------------------------------------------------------------------------------------------------


def hf_config(spec: ModelSpec, *, eos_token_id: int | None = None, bos_token_id: int | None = None) -> dict[str, Any]:
    """config.json for `spec`: what transformers needs to build the same model (dropout off, fp32), and the
    end- and beginning-of-document ids the model was trained with (null: none)."""
    common: dict[str, Any] = {
        "architectures": [ARCHITECTURES[spec.family]], "model_type": MODEL_TYPES[spec.family],
        "vocab_size": spec.vocab_size, "tie_word_embeddings": bool(spec.tie_embeddings), "torch_dtype": "float32",
        # Written even when null: transformers fills a missing one with its family's default (GPT-2's 50256, outside
        # a byte-level vocabulary, warned about at every load; Llama's 1 and 2), and generation would stop on a
        # token the model never learned as an end, or never.
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id,
    }  # fmt: skip
    if spec.family == "gpt":
        return {**common, "n_layer": spec.num_layers, "n_embd": spec.hidden_size, "n_head": spec.num_heads,
                "n_inner": spec.ffn_hidden_size, "n_positions": spec.seq_len, "layer_norm_epsilon": spec.norm_eps,
                "activation_function": _GELU_NAMES[spec.gelu_approximation], "resid_pdrop": 0.0,
                "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
                "reorder_and_upcast_attn": False}  # fmt: skip
    if spec.family == "llama":
        config = {**common, "num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden_size,
                  "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
                  "head_dim": spec.head_dim, "intermediate_size": spec.ffn_hidden_size, "hidden_act": "silu",
                  "rms_norm_eps": spec.norm_eps, "rope_theta": spec.rope_theta, "attention_bias": False,
                  "mlp_bias": False, "attention_dropout": 0.0, "max_position_embeddings": spec.seq_len}  # fmt: skip
        if spec.rope_scaling is not None:
            scaling = spec.rope_scaling
            config["rope_scaling"] = {
                "rope_type": scaling.type, "factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position_embeddings,
            }
            # The scaled frequencies reach past the original context; say so, as Llama 3's own config does.
            config["max_position_embeddings"] = max(spec.seq_len, scaling.original_max_position_embeddings)
        return config
    return {**common, "num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden_size,
            "num_attention_heads": spec.num_heads, "intermediate_size": spec.ffn_hidden_size,
            "hidden_act": _GELU_NAMES[spec.gelu_approximation],
            "max_position_embeddings": spec.seq_len, "type_vocab_size": max(1, spec.type_vocab_size or 0),
            "layer_norm_eps": spec.norm_eps, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
            "position_embedding_type": "absolute"}  # fmt: skip


_GELU_NAMES = {"none": "gelu", "tanh": "gelu_new"}
"""transformers' names of the two GELUs (`gelu_pytorch_tanh` computes the same tanh form)."""
_GELU_OF_NAME = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


def _rope_of(config: Mapping[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, llama3 scaling parameters or None) from a config.json of either transformers generation."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))  # transformers' default base
    return theta, scaling


def config_problem(spec: ModelSpec, config: Mapping[str, Any], *, source: str) -> str | None:
    """None when `config` (a config.json) describes the model `spec` builds; else one line: what differs and which
    model field to set."""
    family = {v: k for k, v in MODEL_TYPES.items()}.get(str(config.get("model_type")))
    if family is None:
        return (f"{source}: model_type {config.get('model_type')!r} is not one cona builds "
                f"({', '.join(MODEL_TYPES.values())})")  # fmt: skip
    if family != spec.family:
        return f"{source}: a {config['model_type']} model, but model.family is {spec.family}; set model.family: {family}"
    names = {"gpt": {"num_layers": "n_layer", "hidden_size": "n_embd", "num_heads": "n_head", "seq_len": "n_positions",
                     "norm_eps": "layer_norm_epsilon"},
             "llama": {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "num_heads": "num_attention_heads",
                       "num_kv_heads": "num_key_value_heads", "ffn_hidden_size": "intermediate_size",
                       "norm_eps": "rms_norm_eps"},
             "bert": {"num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "num_heads": "num_attention_heads",
                      "ffn_hidden_size": "intermediate_size", "seq_len": "max_position_embeddings",
                      "norm_eps": "layer_norm_eps"}}[family]  # fmt: skip
    # A value of the wrong type is named before any comparison: int("64") would take a string transformers cannot
    # build from, True would pass as 1, and int([64]) or float("x") would fail naming no field.
    typed = {**names, "vocab_size": "vocab_size", "ffn_hidden_size": "n_inner" if family == "gpt" else names.get(
        "ffn_hidden_size", "intermediate_size"), "head_dim": "head_dim", "rope_theta": "rope_theta"}  # fmt: skip
    for field, key in typed.items():
        value = config.get(key)
        real = field in ("norm_eps", "rope_theta")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float) if real else int)):
            field_hint = "" if field == "head_dim" else f" (model.{field})"  # head_dim is derived, not a model field
            return f"{source}: {key} is {value!r}, not {'a number' if real else 'an integer'}; fix config.json{field_hint}"
    for key in ("tie_word_embeddings",):
        if not isinstance(config.get(key, False), bool):
            return f"{source}: {key} is {config[key]!r}, not true or false; fix config.json"
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(config.get(key) or {}, dict):
            return f"{source}: {key} is {config[key]!r}, not a mapping; fix config.json"
    wanted = {field: config.get(key) for field, key in names.items()}
    wanted["vocab_size"] = config.get("vocab_size")
    if family == "gpt":
        wanted["ffn_hidden_size"] = config.get("n_inner") or 4 * int(config.get("n_embd") or 0)
    if family == "llama" and config.get("num_key_value_heads") is None:
        wanted["num_kv_heads"] = config.get("num_attention_heads")
    for field, value in wanted.items():
        mine = getattr(spec, field)
        if value is None:
            return f"{source}: has no {typed[field]} (model.{field}); is it a transformers model's config.json?"
        if (field == "norm_eps" and not math.isclose(float(value), mine, rel_tol=1e-9)) or (
            field != "norm_eps" and int(value) != mine
        ):
            return f"{source}: {field} is {value} there but {mine} here; set model.{field}: {value}"
    # transformers' own default when config.json omits it: tied for GPT-2 and BERT, untied for Llama.
    tied = bool(config.get("tie_word_embeddings", family != "llama"))
    if tied != bool(spec.tie_embeddings):
        return f"{source}: tie_word_embeddings is {str(tied).lower()}; set model.tie_embeddings: {str(tied).lower()}"
    if family in ("gpt", "bert"):
        key, default = ("activation_function", "gelu_new") if family == "gpt" else ("hidden_act", "gelu")
        act = config.get(key, default)
        if act not in _GELU_OF_NAME:
            return f"{source}: {key} {act!r}; cona's {family} uses GELU, exact ('gelu') or tanh ('gelu_new')"
        if _GELU_OF_NAME[act] != spec.gelu_approximation:
            return f"{source}: {key} is {act!r}; set model.gelu_approximation: {_GELU_OF_NAME[act]}"
    if family == "llama":
        head_dim = config.get("head_dim") or spec.hidden_size // spec.num_heads
        if int(head_dim) != spec.head_dim:
            return f"{source}: head_dim {head_dim} is not hidden_size/num_attention_heads; cona cannot build it"
        if config.get("attention_bias") or config.get("mlp_bias") or config.get("hidden_act", "silu") != "silu":
            return f"{source}: attention/MLP biases or hidden_act other than silu; cona's llama has neither"
        theta, scaling = _rope_of(config)
        if theta is not None and not math.isclose(float(theta), spec.rope_theta, rel_tol=1e-9):
            return f"{source}: rope_theta is {theta} there but {spec.rope_theta} here; set model.rope_theta: {theta}"
        problem = _scaling_problem(spec.rope_scaling, scaling, source=source)
        if problem:
            return problem
    if family == "bert" and config.get("position_embedding_type", "absolute") != "absolute":
        return f"{source}: position_embedding_type {config['position_embedding_type']!r}; cona's bert has absolute ones"
    return None


def _scaling_problem(mine: RopeScaling | None, theirs: Mapping[str, Any] | None, *, source: str) -> str | None:
    if theirs is None or theirs.get("rope_type", theirs.get("type")) in (None, "default"):
        return f"{source}: no RoPE scaling there; set model.rope_scaling: null" if mine is not None else None
    kind = theirs.get("rope_type", theirs.get("type"))
    if kind != "llama3":
        return f"{source}: rope scaling {kind!r}; cona implements 'llama3' only"
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    got = {f: theirs.get(f) for f in fields}
    for f, v in got.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            return f"{source}: rope_scaling.{f} is {v!r}, not a number; fix config.json"
    if mine is None or any(v is None or not math.isclose(float(v), float(getattr(mine, f))) for f, v in got.items()):
        values = ", ".join(f"{f}: {v}" for f, v in got.items())
        return f"{source}: llama3 rope scaling {{{values}}} differs from model.rope_scaling; set it to that"
    return None


# cona ⇄ transformers tensors ------------------------------------------------------------------------------------


def to_hf(spec: ModelSpec, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole model's tensors (cona names, as `Transformer.state_dict()` or a checkpoint's `model.*`) under
    transformers' names, contiguous fp32 CPU tensors."""
    missing = [name for entry in _entries(spec) for name in entry.cona if name not in state]
    if missing:
        raise ValueError(f"the checkpoint has no tensor {missing[0]!r} (is it a checkpoint of this model?)")
    # A spec that is not the checkpoint's (`cona export --job` of another model) must not write a model that looks
    # right: fewer layers dropped the rest silently, other dimensions wrote a config.json its weights do not fit.
    shapes = _shapes(spec)
    wrong = next((n for n, shape in shapes.items() if tuple(state[n].shape) != shape), None)
    if wrong is not None:
        raise ValueError(f"the checkpoint's tensor {wrong!r} has shape {tuple(state[wrong].shape)}, the model needs "
                         f"{shapes[wrong]} (is it a checkpoint of this model?)")  # fmt: skip
    extra = sorted(set(state) - set(shapes))
    if extra:
        raise ValueError(f"the checkpoint's tensor {extra[0]!r} has no place in this model ({len(extra)} such; is it "
                         "a checkpoint of this model?)")  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    for entry in _entries(spec):
        parts = [state[name].detach().to("cpu", torch.float32) for name in entry.cona]
        tensor = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
        out[entry.hf] = (tensor.t() if entry.transpose else tensor).contiguous()
    if spec.family == "bert" and not spec.type_vocab_size:
        out[_NO_TYPES] = torch.zeros(1, spec.hidden_size)
    return out


def from_hf(
    spec: ModelSpec, read: TensorSource, *, names: set[str] | None = None, source: str = "the checkpoint"
) -> dict[str, torch.Tensor]:
    """cona tensors (all, or those in `names`) from a transformers checkpoint; ValueError (one line naming the
    tensor) on a missing tensor or a shape that differs from the model's."""
    shapes = _shapes(spec)
    out: dict[str, torch.Tensor] = {}
    for entry in _entries(spec):
        if names is not None and not any(n in names for n in entry.cona):
            continue
        want_rows, _ = _check_shape(entry, shapes, read.shape(entry.hf), source=source)
        tensor = read.get(entry.hf)
        assert tensor is not None  # _check_shape saw it
        tensor = tensor.to(torch.float32)
        if entry.transpose:
            tensor = tensor.t()
        for name, piece in zip(entry.cona, tensor.split(want_rows, dim=0), strict=True):
            if names is None or name in names:
                out[name] = piece.contiguous()
    if spec.family == "bert" and not spec.type_vocab_size and (names is None or "tok_embeddings.weight" in names):
        types = read.get(_NO_TYPES)
        if types is not None and bool(types.to(torch.float32)[0].abs().max() > 0):
            raise ValueError(f"{source}: tensor {_NO_TYPES!r} holds token-type embeddings, which this model lacks; "
                             f"set model.type_vocab_size: {types.shape[0]}")  # fmt: skip
    return out


def _check_shape(
    entry: Entry, shapes: Mapping[str, tuple[int, ...]], shape: tuple[int, ...] | None, *, source: str
) -> tuple[list[int], tuple[int, ...]]:
    """(rows of each cona tensor, the transformers tensor's shape) when `shape` is what `entry` needs; else a
    ValueError naming the tensor."""
    want_rows = [shapes[n][0] for n in entry.cona]
    want = (sum(want_rows), *shapes[entry.cona[0]][1:])
    if entry.transpose:
        want = (want[1], want[0])
    if shape is None:
        raise ValueError(f"{source}: no tensor {entry.hf!r} (for {entry.cona[0]}); is it a checkpoint of this "
                         "architecture?")  # fmt: skip
    if tuple(shape) != want:
        raise ValueError(f"{source}: tensor {entry.hf!r} has shape {tuple(shape)}, the model needs {want} (for "
                         f"{', '.join(entry.cona)}); check the model section against config.json")  # fmt: skip
    return want_rows, want


def unused_tensors(spec: ModelSpec, names: list[str]) -> list[str]:
    """Tensors of a transformers checkpoint that the mapping does not read (nor knows to be redundant)."""
    used = {e.hf for e in _entries(spec)} | {_NO_TYPES}
    tied_copies = {"lm_head.weight", "cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    return [n for n in names if n not in used and n not in tied_copies and not n.endswith(_IGNORED_SUFFIXES)
            and not n.startswith(_IGNORED_PREFIXES)]  # fmt: skip


# Files ----------------------------------------------------------------------------------------------------------


def _open_safetensors(path: Path) -> Any:
    """`safe_open(path)`, with a damaged file (empty, cut short, not safetensors, a directory) as one ValueError naming
    it: safetensors raises its own error type, or OSError, which the trainer would print as a traceback."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(path, framework="pt")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e}); download or export it again") from None


class TensorSource:
    """The tensors of a transformers directory (one file or shards), opened lazily: `get` reads one tensor."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX
        single = self.directory / WEIGHTS
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError(f"{index}: not a safetensors index (its weight_map is no mapping of tensor names to "
                                 "file names)")  # fmt: skip
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        elif single.exists():
            with _open_safetensors(single) as f:
                self.files = dict.fromkeys(f.keys(), single)
        else:
            raise ValueError(f"{self.directory}: no {WEIGHTS} or {INDEX}; is it a transformers model directory?")
        self._open: dict[Path, Any] = {}
        # Old GPT-2 files name their tensors without the `transformer.` prefix.
        self._aliases = {f"transformer.{n}": n for n in self.files if n.split(".")[0] in ("wte", "wpe", "h", "ln_f")}

    def names(self) -> list[str]:
        return [next((a for a, n in self._aliases.items() if n == name), name) for name in self.files]

    def _file(self, name: str) -> tuple[Any, str] | None:
        name = self._aliases.get(name, name)
        path = self.files.get(name)
        if path is None:
            return None
        if path not in self._open:
            if not path.exists():
                raise ValueError(f"{path}: missing (named by {self.directory / INDEX})")
            self._open[path] = _open_safetensors(path)
        return self._open[path], name

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The tensor's shape from the file's header (nothing is read), or None when there is no such tensor."""
        found = self._file(name)
        return None if found is None else tuple(found[0].get_slice(found[1]).get_shape())

    def get(self, name: str) -> torch.Tensor | None:
        found = self._file(name)
        return None if found is None else found[0].get_tensor(found[1])


def read_config(directory: Path | str) -> dict[str, Any]:
    path = Path(directory) / CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: not found; model.init_from must name a transformers model directory") from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:  # a directory of that name, no permission
        raise ValueError(f"{path}: cannot read ({e.strerror}); model.init_from must name a transformers model directory") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config


def check_directory(spec: ModelSpec, directory: Path | str) -> TensorSource:
    """Open a transformers directory for `spec` after checking its config and its tensors' names and shapes (the
    values are not read); ValueError, one line, on any mismatch."""
    directory = Path(directory)
    problem = config_problem(spec, read_config(directory), source=str(directory / CONFIG))
    if problem:
        raise ValueError(problem)
    source = TensorSource(directory)
    extra = unused_tensors(spec, source.names())
    if extra:
        raise ValueError(f"{directory}: tensor {extra[0]!r} has no place in this model "
                         f"({len(extra)} such); check the model section against config.json")  # fmt: skip
    shapes = _shapes(spec)
    for entry in _entries(spec):
        _check_shape(entry, shapes, source.shape(entry.hf), source=str(directory))
    return source


def load_stage(model: torch.nn.Module, spec: ModelSpec, source: TensorSource, *, label: str) -> None:
    """Copy the weights of a transformers directory into the parameters `model` (a pipeline stage, not yet split
    by tp or dp) holds."""
    params = dict(model.named_parameters())
    tensors = from_hf(spec, source, names=set(params), source=label)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name])


def _shards(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names in order, cut into shards of at most `max_bytes` (a larger tensor is a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def save_directory(
    directory: Path | str, spec: ModelSpec, state: Mapping[str, torch.Tensor], *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, eos_token_id: int | None = None, bos_token_id: int | None = None,
) -> list[Path]:  # fmt: skip
    """Write config.json and the weights of the model `state` (cona names) in the transformers format; returns the
    files written. The bytes depend only on the tensors, the spec and the token ids (no times), so an export is
    reproducible."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    directory = Path(directory)
    tensors = to_hf(spec, state)
    shards = _shards(tensors, max_shard_bytes)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    written: list[Path] = []
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for stale in [directory / WEIGHTS, directory / INDEX, *directory.glob("model-*-of-*.safetensors")]:
            stale.unlink(missing_ok=True)
        written.append(directory / CONFIG)
        config = hf_config(spec, eos_token_id=eos_token_id, bos_token_id=bos_token_id)
        written[-1].write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if len(shards) == 1:
            written.append(directory / WEIGHTS)
            save_file(tensors, written[-1], metadata={"format": "pt"})
            return written
        weight_map = {}
        for k, names in enumerate(shards, start=1):
            written.append(directory / f"model-{k:05d}-of-{len(shards):05d}.safetensors")
            save_file({n: tensors[n] for n in names}, written[-1], metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, written[-1].name))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        written.append(directory / INDEX)
        written[-1].write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return written
    # No room, a read-only file system, a file where a directory belongs (safetensors reports its I/O errors as its
    # own type): one line, and no torn model left behind that would look like an export.
    except (OSError, SafetensorError) as e:
        for path in written:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        detail = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(f"{directory}: cannot write the model ({detail}); give a writable directory with "
                         f"{total / 1e6:,.1f} MB free") from None  # fmt: skip


# DCP checkpoints --------------------------------------------------------------------------------------------------


def checkpoint_model_tensors(path: Path | str) -> dict[str, torch.Tensor]:
    """The model's tensors of a DCP checkpoint written under any layout, by one process without a process group
    (the optimizer state is not read). ValueError, in one line, for a checkpoint whose files are damaged."""
    from cona.trainer.checkpoint import read_failure
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    try:
        keys = {k for k in FileSystemReader(str(path)).read_metadata().state_dict_metadata if k.startswith("model.")}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            state = _load_state_dict_from_keys(keys, checkpoint_id=str(path))
    # torch's reader raises whatever a damaged file gives it (pickle, struct, ...), wrapped by DCP in a
    # CheckpointException, which is no Exception.
    except (Exception, CheckpointException) as error:
        raise ValueError(f"{path}: unreadable checkpoint ({read_failure(error)}); use an older one (cona export --step K)") from None
    return dict(state["model"])


def directory_digest(directory: Path | str) -> str:
    """sha256 over the files of an exported directory (names and bytes), to compare two exports."""
    digest = hashlib.sha256()
    for path in sorted(Path(directory).iterdir()):
        if path.is_file():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def export_checkpoint(
    checkpoint: Path | str, out: Path | str, *, spec: ModelSpec, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    eos_token_id: int | None = None, bos_token_id: int | None = None,
) -> list[Path]:  # fmt: skip
    """Write the model of a DCP checkpoint (any layout) to `out` in the transformers format."""
    state = checkpoint_model_tensors(checkpoint)
    return save_directory(out, spec, state, max_shard_bytes=max_shard_bytes, eos_token_id=eos_token_id,
                          bos_token_id=bos_token_id)  # fmt: skip
