"""A Hugging Face model directory's config.json, read and checked against cona's model section without torch.

`cona run` and `cona profile` check `model.init_from`'s config.json with `config_problem` before the run exists
(`cona.protocol.inputs.check_init_from`), so a model section that does not describe the checkpoint is refused in
one line before a job waits in a queue for it; the trainer checks the tensors too (`cona.trainer.hf`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cona.protocol.job import ModelSpec, RopeScaling

CONFIG = "config.json"

ARCHITECTURES = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForMaskedLM"}
MODEL_TYPES = {"gpt": "gpt2", "llama": "llama", "bert": "bert"}

_GELU_NAMES = {"none": "gelu", "tanh": "gelu_new"}
"""transformers' names of the two GELUs (`gelu_pytorch_tanh` computes the same tanh form)."""
# Every name transformers' ACT2FN gives one of the two: `gelu_python` is the exact erf form written out, and
# `gelu_fast`, `gelu_accurate` and `gelu_python_tanh` are the tanh form of `gelu_new` with the constants folded
# differently (equal in fp32 to ~1e-7). Others (relu, quick_gelu, gelu_10, ...) are other functions.
_GELU_OF_NAME = {"gelu": "none", "gelu_python": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh",
                 "gelu_fast": "tanh", "gelu_accurate": "tanh", "gelu_python_tanh": "tanh"}  # fmt: skip
_SILU_NAMES = ("silu", "swish")
"""transformers' names of SiLU (ACT2FN), llama's gate activation."""
IMPORTED_ARCHITECTURES = {"gpt": ("GPT2LMHeadModel", "GPT2Model"), "llama": ("LlamaForCausalLM",),
                          "bert": ("BertForMaskedLM", "BertForPreTraining")}  # fmt: skip
"""config.json `architectures` whose tensors are cona's model: the family's own class; GPT-2's bare GPT2Model (its
tensors without the `transformer.` prefix, read through aliases; tied, its head is the embedding); BERT's
pretraining model (the MLM head plus the pooler and the next-sentence head, which are ignored). Another class
of the same model_type (a classifier, BertLMHeadModel, remote code) has other heads or computes something else."""



def _rope_of(config: Mapping[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """(rope_theta, the scaling parameters or None) of a config.json of either transformers generation, resolved as
    transformers 5 resolves them (`convert_rope_params_to_dict`, `standardize_rope_params`): a `rope_scaling`
    mapping wins over `rope_parameters`; the theta in that mapping over a top-level `rope_theta` (a config.json
    holding both with different values computes with the mapping's); a scaled type without
    `original_max_position_embeddings` takes `max_position_embeddings`."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))  # transformers' default base
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    scaling = {**params, "rope_type": kind}
    scaling.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return theta, scaling


def _partial_rotary_factor(config: Mapping[str, Any]) -> Any:
    """The fraction of each head that RoPE rotates (1: all), from the RoPE mapping or the top level."""
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    return params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))


def _rope_key(config: Mapping[str, Any]) -> str:
    """The config.json key that holds the RoPE parameters transformers uses (for messages)."""
    return "rope_scaling" if config.get("rope_scaling") else "rope_parameters"


def config_problem(spec: ModelSpec, config: Mapping[str, Any], *, source: str) -> str | None:
    """None when `config` (a config.json) describes the model `spec` builds; else one line: what differs and which
    model field to set."""
    if "model_type" not in config:
        return f"{source}: has no model_type; is it a transformers model's config.json?"
    family = {v: k for k, v in MODEL_TYPES.items()}.get(str(config.get("model_type")))
    if family is None:
        return (f"{source}: model_type {config.get('model_type')!r} is not one cona builds "
                f"({', '.join(MODEL_TYPES.values())})")  # fmt: skip
    if family != spec.family:
        return f"{source}: a {config['model_type']} model, but model.family is {spec.family}; set model.family: {family}"
    # transformers builds the class config.json names; another class of the same model_type has other heads (a
    # classifier's `score`) or computes something else (BertLMHeadModel is causal), so its tensors fitting or not is
    # no test. A config.json without the key (it is optional), or with none listed, is judged by its tensors alone.
    architectures = config.get("architectures")
    if architectures not in (None, []):
        allowed = IMPORTED_ARCHITECTURES[family]
        if not isinstance(architectures, list) or not any(a in allowed for a in architectures):
            return (f"{source}: architectures is {architectures!r}, not a model cona's {family} imports "
                    f"({', '.join(allowed)}); save the {ARCHITECTURES[family]} form of the model")  # fmt: skip
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
    if family == "bert" and not tied:  # model.tie_embeddings: false is no answer: cona's BERT decoder is always tied
        return (f"{source}: tie_word_embeddings is false (an MLM decoder of its own), but cona's bert always ties the "
                "decoder to the word embeddings; it cannot import this model")  # fmt: skip
    if tied != bool(spec.tie_embeddings):
        return f"{source}: tie_word_embeddings is {str(tied).lower()}; set model.tie_embeddings: {str(tied).lower()}"
    if family in ("gpt", "bert"):
        key, default = ("activation_function", "gelu_new") if family == "gpt" else ("hidden_act", "gelu")
        act = config.get(key, default)
        if not isinstance(act, str) or act not in _GELU_OF_NAME:
            return (f"{source}: {key} is {act!r}; cona's {family} implements GELU only, exact ('gelu') or tanh "
                    "('gelu_new'), so it cannot import this model")  # fmt: skip
        if _GELU_OF_NAME[act] != spec.gelu_approximation:
            return f"{source}: {key} is {act!r}; set model.gelu_approximation: {_GELU_OF_NAME[act]}"
    if family == "gpt":
        # Both change the attention scores; transformers reads them and cona has neither (each was imported
        # silently: logits off by 0.6 and 0.03 at two tiny layers). reorder_and_upcast_attn only changes the
        # order of fp32 operations, and is accepted. Each is read as transformers reads it: by its truth.
        if not config.get("scale_attn_weights", True):
            return (f"{source}: scale_attn_weights is {config['scale_attn_weights']!r} (attention scores not scaled "
                    "by 1/sqrt(head_dim)); cona's gpt always scales them, so it cannot import this model")  # fmt: skip
        if config.get("scale_attn_by_inverse_layer_idx"):
            return (f"{source}: scale_attn_by_inverse_layer_idx is {config['scale_attn_by_inverse_layer_idx']!r} "
                    "(attention scores divided by the layer's number); cona's gpt does not, so it cannot import "
                    "this model")  # fmt: skip
    if family == "llama":
        head_dim = config.get("head_dim") or spec.hidden_size // spec.num_heads
        if int(head_dim) != spec.head_dim:
            return (f"{source}: head_dim is {head_dim}, not hidden_size/num_attention_heads = {spec.head_dim}; cona's "
                    "llama derives it from them, so it cannot import this model")  # fmt: skip
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key):
                return f"{source}: {key} is {config[key]!r}; cona's llama has no biases, so it cannot import this model"
        act = config.get("hidden_act", "silu")
        if act not in _SILU_NAMES:
            return f"{source}: hidden_act is {act!r}; cona's llama gates with SiLU ('silu') only, so it cannot import this model"
        theta, scaling = _rope_of(config)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)):
            return f"{source}: rope_theta is {theta!r}, not a number; fix config.json (model.rope_theta)"
        if not math.isclose(float(theta), spec.rope_theta, rel_tol=1e-9):
            return f"{source}: rope_theta is {theta} there but {spec.rope_theta} here; set model.rope_theta: {theta}"
        # transformers 5 rotates only that fraction of each head under llama3 scaling, 4.x under the default RoPE
        # too (5 ignores it there): a model made with it is not cona's, which rotates whole heads.
        partial = _partial_rotary_factor(config)
        if isinstance(partial, bool) or not isinstance(partial, (int, float)) or partial != 1:
            return (f"{source}: partial_rotary_factor is {partial!r}; cona's llama rotates whole heads, so it cannot "
                    "import this model")  # fmt: skip
        problem = _scaling_problem(spec.rope_scaling, scaling, source=source, key=_rope_key(config))
        if problem:
            return problem
    if family == "bert":
        if config.get("position_embedding_type", "absolute") != "absolute":
            return (f"{source}: position_embedding_type is {config['position_embedding_type']!r}; cona's bert has "
                    "absolute position embeddings only, so it cannot import this model")  # fmt: skip
        # A decoder BERT attends causally in transformers (BertForMaskedLM warns and does so): another model over
        # the same tensors (imported silently before: logits off by 0.3).
        if config.get("is_decoder"):
            return (f"{source}: is_decoder is {config['is_decoder']!r} (causal attention); cona's bert attends in "
                    "both directions, so it cannot import this model")  # fmt: skip
    return None


def _scaling_problem(mine: RopeScaling | None, theirs: Mapping[str, Any] | None, *, source: str, key: str) -> str | None:
    """None when the RoPE scaling transformers would use (`_rope_of`) is `mine`; else one line naming `key`'s
    field."""
    if theirs is None:
        return f"{source}: no RoPE scaling there; set model.rope_scaling: null" if mine is not None else None
    kind = theirs["rope_type"]
    if kind != "llama3":
        return (f"{source}: {key}.rope_type is {kind!r}; cona implements RoPE scaling of type 'llama3' only, so it "
                "cannot import this model")  # fmt: skip
    fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    got = {f: theirs.get(f) for f in fields}
    for f, v in got.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            return f"{source}: {key}.{f} is {v!r}, not a number; fix config.json"
    if mine is None or any(v is None or not math.isclose(float(v), float(getattr(mine, f))) for f, v in got.items()):
        values = ", ".join(f"{f}: {v}" for f, v in got.items())
        return f"{source}: llama3 rope scaling {{{values}}} differs from model.rope_scaling; set it to that"
    return None



def _no_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity, which JSON has not: a size or an epsilon of NaN compares unequal to
    # everything, and the message would then advise setting the model's field to nan.
    raise ValueError(f"{name} is not a JSON number")


def read_config(directory: Path | str) -> dict[str, Any]:
    """The config.json of a transformers model directory; ValueError, one line naming the file, when it is missing,
    unreadable, not JSON (NaN and Infinity included) or not an object."""
    path = Path(directory) / CONFIG
    try:
        config = json.loads(path.read_text(), parse_constant=_no_constant)
    except FileNotFoundError:
        raise ValueError(f"{path}: not found; model.init_from must name a transformers model directory") from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:  # a directory of that name, no permission
        raise ValueError(f"{path}: cannot read ({e.strerror}); model.init_from must name a transformers model directory") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return config
