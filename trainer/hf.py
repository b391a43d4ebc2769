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

Reading checks the architecture against the job first (`config_problem`: family, class, sizes, norms, activation,
tying, RoPE, and every setting transformers reads that cona's model lacks) and then every tensor's shape and dtype,
and fails with one line naming the field or the tensor and what to set. It reads what `from_pretrained` reads
(model.safetensors before an index; RoPE parameters resolved as transformers 5 does), so a run starts from the
model transformers computes, and never opens a pickle (pytorch_model.bin).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from cona.protocol.hfconfig import (  # noqa: F401  (re-exported: the format's names live with its config checks)
    _GELU_NAMES,
    ARCHITECTURES,
    CONFIG,
    IMPORTED_ARCHITECTURES,
    MODEL_TYPES,
    config_problem,
    read_config,
)
from cona.protocol.job import ModelSpec

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3
"""transformers' own default shard size (5 GB)."""

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


_TIED_COPIES = {"gpt": {"lm_head.weight": "transformer.wte.weight"},
                "llama": {"lm_head.weight": "model.embed_tokens.weight"},
                "bert": {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
                         "cls.predictions.decoder.bias": "cls.predictions.bias"}}  # fmt: skip
"""The tensors of a tied head that a checkpoint may also carry as copies, and the tensor each is a copy of."""


def _tied_copy_problem(spec: ModelSpec, source: TensorSource, *, where: str) -> str | None:
    """None unless a tied head's copy in the checkpoint differs from what it is tied to. transformers 5 then leaves
    the two untied and computes with both (`tie_weights`: "both are present in the checkpoints with different
    values, so we will NOT tie them"); cona, reading only the embedding, would compute another model."""
    if not spec.tie_embeddings:
        return None
    names = set(source.names())
    for copy, original in _TIED_COPIES[spec.family].items():
        if copy not in names:
            continue
        same = source.shape(copy) == source.shape(original)
        if same:  # read only where a copy is there, which save_pretrained does not write
            a, b = source.get(copy), source.get(original)
            assert a is not None and b is not None  # both named
            same = torch.equal(a.to(torch.float32), b.to(torch.float32))
        if not same:
            fix = ("cona's bert always ties its decoder, so it cannot import this model" if spec.family == "bert" else
                   "set tie_word_embeddings: false in config.json and model.tie_embeddings: false")  # fmt: skip
            return (f"{where}: tensor {copy!r} differs from {original!r}, which config.json ties it to (transformers "
                    f"then unties them and computes with both); {fix}")  # fmt: skip
    return None


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


_PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
"""Weights in the formats cona does not read: a pickle can run code when it is loaded, so it is never opened."""
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
"""safetensors dtypes read into the fp32 parameters (F16 and BF16 exactly); an integer, boolean or 8-bit float
tensor is a quantized or damaged checkpoint, whose values are not the weights."""


class TensorSource:
    """The tensors of a transformers directory (one file or shards), opened lazily: `get` reads one tensor."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX
        single = self.directory / WEIGHTS
        self._index: Path | None = None
        # transformers reads model.safetensors when both are there (a stale index beside it, or stale shards): so
        # does cona, or the two would start from different weights.
        if single.exists():
            with _open_safetensors(single) as f:
                self.files = dict.fromkeys(f.keys(), single)
        elif index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e})") from None
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError(f"{index}: not a safetensors index (its weight_map is no mapping of tensor names to "
                                 "file names)")  # fmt: skip
            # Shards are files of this directory; a name that leaves it would read another model's weights.
            outside = next((f for f in weight_map.values() if Path(f).is_absolute() or ".." in Path(f).parts), None)
            if outside is not None:
                raise ValueError(f"{index}: names the file {outside!r}, outside the model directory; download or "
                                 "export the model again")  # fmt: skip
            self.files = {name: self.directory / file for name, file in weight_map.items()}
            self._index = index
        else:
            pickles = [name for name in _PICKLES if (self.directory / name).exists()]
            if pickles:
                raise ValueError(f"{self.directory}: holds {pickles[0]}, not {WEIGHTS}; cona reads safetensors only "
                                 "(loading a pickle can run code): convert it where you trust its source, e.g. "
                                 "transformers' from_pretrained then save_pretrained")  # fmt: skip
            raise ValueError(f"{self.directory}: no {WEIGHTS} or {INDEX}; is it a transformers model directory?")
        self._open: dict[Path, Any] = {}
        self._keys: dict[Path, set[str]] = {}
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
            self._keys[path] = set(self._open[path].keys())
        if name not in self._keys[path]:  # the index and the shards disagree: safetensors' own error, a traceback
            raise ValueError(f"{self._index}: names {path.name} for tensor {name!r}, which that file does not hold; "
                             "download or export the model again")  # fmt: skip
        return self._open[path], name

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The tensor's shape from the file's header (nothing is read), or None when there is no such tensor."""
        found = self._file(name)
        return None if found is None else tuple(found[0].get_slice(found[1]).get_shape())

    def dtype(self, name: str) -> str | None:
        """The tensor's safetensors dtype ("F32", "BF16", ...) from the file's header, or None when there is none."""
        found = self._file(name)
        return None if found is None else str(found[0].get_slice(found[1]).get_dtype())

    def get(self, name: str) -> torch.Tensor | None:
        found = self._file(name)
        return None if found is None else found[0].get_tensor(found[1])


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
        dtype = source.dtype(entry.hf)
        if dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{directory}: tensor {entry.hf!r} is {dtype}, not a floating-point weight (a quantized "
                             "or damaged checkpoint?); give the model's F32, BF16 or F16 weights")  # fmt: skip
    problem = _tied_copy_problem(spec, source, where=str(directory))
    if problem:
        raise ValueError(problem)
    if spec.family == "bert" and not spec.type_vocab_size:
        # One small tensor's values, read here rather than in `from_hf` only: there the refusal came after the
        # process group, as a traceback, and a run retried it as a crash.
        types = source.get(_NO_TYPES)
        if types is not None and bool(types.to(torch.float32)[0].abs().max() > 0):
            raise ValueError(f"{directory}: tensor {_NO_TYPES!r} holds token-type embeddings, which this model "
                             f"lacks; set model.type_vocab_size: {types.shape[0]}")  # fmt: skip
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
        # The weights of whatever model was there, and its generation_config.json: transformers takes the token ids
        # of that file over config.json's, so an export over the model a run started from generated with that
        # model's bos/eos ids, not the run's.
        for stale in [directory / WEIGHTS, directory / INDEX, *directory.glob("model-*-of-*.safetensors"),
                      directory / GENERATION_CONFIG]:  # fmt: skip
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
