"""The three model families in one readable file (nanoGPT style): GPT-3, Llama and BERT.

Every family is one `Transformer`:

    tok_embeddings [+ pos_embeddings] [+ type_embeddings] [+ emb_norm]  →  layers["0"] … layers["L-1"]
        →  [norm] [mlm head]  →  output

* gpt   — learned positions, pre-LayerNorm, GELU MLP (exact, or GPT-2's tanh form: `model.gelu_approximation`),
  biases, causal attention (GPT-2's layout).
* llama — RoPE (optionally with Llama 3's frequency scaling), pre-RMSNorm, SwiGLU MLP, grouped-query attention,
  no biases.
* bert  — learned positions and token types, embedding LayerNorm, post-LayerNorm blocks, bidirectional attention,
  and an MLM head (dense → GELU → LayerNorm → decoder with bias).

With `model.tie_embeddings` (BERT always; the gpt3-1.3b and llama-3.2-1b presets, as the published models) the
output head is the token embedding's weight: `TiedOutput` holds no copy of it. Under a pipeline the last stage
keeps `tok_embeddings` (for its weight only) and `trainer.pipeline` sums the two partial gradients of the tied
weight across the first and last stage, so both copies stay identical. Under tensor parallelism the embedding and
the head are replicated (not in `tp_plan`), so tying changes nothing there. `trainer.hf` maps these names to and
from the Hugging Face layouts.

Pipeline stages are carved out of the full model: blocks are keyed by their global index in a `ModuleDict`, and
`prune_to_stage` deletes the blocks, embeddings and head a stage does not own (setting them to None), so parameter
names stay those of the full model and checkpoints load across any pipeline split. `forward` skips what is None.

Initialisation does not depend on the layout: each parameter is drawn from its own generator seeded by (seed, its
fully-qualified name), so any stage of any split gets exactly the values of the full model. Build on the meta device
(`build_model(..., device="meta")`), prune, then `materialize` only what the stage owns.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Literal

import torch
import torch.nn.functional as F
from cona.protocol.feasibility import stage_layers
from cona.protocol.job import ModelSpec, RopeScaling
from cona.trainer.data import IGNORE_INDEX
from cona.trainer.recompute import Recompute, checkpointed
from torch import nn

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.family == "llama":
        return RMSNorm(spec.hidden_size, eps=spec.norm_eps)
    return nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)


def rope_frequencies(*, head_dim: int, theta: float, scaling: RopeScaling | None, device: torch.device) -> torch.Tensor:
    """The head_dim/2 rotary frequencies, with Llama 3's scaling when given (transformers' `llama3` rope type)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept, the band between them
    # interpolated smoothly: the context grows without disturbing the local (high-frequency) position signal.
    old_context = scaling.original_max_position_embeddings
    low_wavelen = old_context / scaling.low_freq_factor
    high_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    *, seq_len: int, head_dim: int, theta: float, device: torch.device, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, ...]:
    """cos and sin of the rotary angles, shape [seq_len, head_dim] (each frequency used for a pair of halves)."""
    inv_freq = rope_frequencies(head_dim=head_dim, theta=theta, scaling=scaling, device=device)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [b, s, heads, head_dim] by the position angles (the rotate-half form)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x.float() * cos + rotated.float() * sin).type_as(x)


class Attention(nn.Module):
    """Multi-head attention with grouped-query key/value heads.

    Head counts are read from the projection sizes at run time (`view(..., -1, head_dim)`), so a tensor-parallel
    rank that holds a contiguous slice of the q heads and the matching slice of the kv heads works unchanged.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        bias = spec.family != "llama"
        self.head_dim = spec.head_dim
        self.causal = spec.family != "bert"
        self.wq = nn.Linear(spec.hidden_size, spec.num_heads * spec.head_dim, bias=bias)
        self.wk = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=bias)
        self.wv = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=bias)
        self.wo = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each kv head serves a contiguous group of q heads
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """GELU MLP (gpt, bert: w1 → GELU → w2) or SwiGLU (llama: w2(silu(w1 x) · w3 x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gated = spec.family == "llama"
        self.gelu = spec.gelu_approximation
        bias = not self.gated
        self.w1 = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=bias)
        self.w2 = nn.Linear(spec.ffn_hidden_size, spec.hidden_size, bias=bias)
        self.w3 = nn.Linear(spec.hidden_size, spec.ffn_hidden_size, bias=False) if self.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate=self.gelu))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.post_norm = spec.family == "bert"  # the original BERT normalises after each residual add
        self.attn_norm = _norm(spec)
        self.attn = Attention(spec)
        self.mlp_norm = _norm(spec)
        self.mlp = MLP(spec)
        self.recompute: Recompute = "none"
        """`parallel.recompute`: what backward recomputes (`trainer.recompute`); set by `trainer.parallel`."""

    def _forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        # rope by keyword: a tp plan that prepares the module's inputs (sequence parallelism) sees only x.
        if self.post_norm:
            x = self.attn_norm(x + self.attn(x, rope=rope))
            return self.mlp_norm(x + self.mlp(x))
        x = x + self.attn(self.attn_norm(x), rope=rope)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # Recompute inside the block instead of wrapping it, so parameter names do not change.
        return checkpointed(self._forward, x, rope, mode=self.recompute)


TpStyle = Literal["colwise", "rowwise", "sequence", "gather"]
"""How `trainer.tp` splits one module over the tp ranks: a linear layer by output features or by input features;
under sequence parallelism a norm along the sequence (`sequence`), and a module whose input it gathers whole
(`gather`)."""


def tp_plan(block: Block, *, sequence_parallel: bool = False) -> dict[str, TpStyle]:
    """The block's tensor-parallel plan, keyed by module names relative to the block (`trainer.tp.apply_tp`).

    Megatron's split: q, k, v and the MLP's input projections column-parallel, so each tp rank holds whole
    attention heads and the matching whole kv heads (`Attention` reads the head counts from the projection sizes)
    and a slice of the MLP's hidden units; the attention output and the MLP output row-parallel, so each block
    needs one all-reduce after attention and one after the MLP. Norms stay replicated. With sequence parallelism
    the block's input and output are the rank's slice of the sequence: the norms run on it, attention and the MLP
    gather their input whole, and the row-parallel outputs are reduce-scattered back to slices (the post-norm
    BERT block has the same four modules, so the same plan). Renaming a module here means renaming it in its plan
    too.
    """
    plan: dict[str, TpStyle] = {"attn.wq": "colwise", "attn.wk": "colwise", "attn.wv": "colwise",
                                "attn.wo": "rowwise", "mlp.w1": "colwise", "mlp.w2": "rowwise"}  # fmt: skip
    if block.mlp.w3 is not None:  # SwiGLU's second input projection (llama)
        plan["mlp.w3"] = "colwise"
    if sequence_parallel:
        plan.update({"attn_norm": "sequence", "mlp_norm": "sequence", "attn": "gather", "mlp": "gather"})
    return plan


class TiedOutput(nn.Module):
    """A tied head: logits = x · Eᵀ (+ bias: BERT's decoder) with E the token embedding (passed in, so it is not a
    second copy)."""

    def __init__(self, vocab_size: int, *, bias: bool) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(vocab_size)) if bias else None

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight, self.bias)


class Transformer(nn.Module):
    """One family's full model, or (after `prune_to_stage`) one pipeline stage of it.

    Input: token ids [b, s] on the first stage, hidden states [b, s, h] on later ones.
    Output: logits [b, s, vocab] on the last stage, hidden states otherwise.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab_size, h)
        self.pos_embeddings: nn.Embedding | None = (
            nn.Embedding(spec.seq_len, h) if spec.family in ("gpt", "bert") else None
        )
        self.type_embeddings: nn.Embedding | None = (
            nn.Embedding(spec.type_vocab_size, h) if spec.type_vocab_size else None
        )
        self.emb_norm: nn.Module | None = _norm(spec) if spec.family == "bert" else None
        self.layers = nn.ModuleDict({str(i): Block(spec) for i in range(spec.num_layers)})
        self.norm: nn.Module | None = _norm(spec) if spec.family != "bert" else None
        is_bert = spec.family == "bert"
        self.mlm_dense: nn.Linear | None = nn.Linear(h, h) if is_bert else None
        self.mlm_norm: nn.Module | None = _norm(spec) if is_bert else None
        self.output: nn.Module | None = (
            TiedOutput(spec.vocab_size, bias=is_bert) if spec.tie_embeddings else nn.Linear(h, spec.vocab_size, bias=False)
        )
        self.embed_inputs = True
        """False on a later pipeline stage that keeps `tok_embeddings` only for the tied decoder weight."""
        self.sequence_mesh: Any = None
        """The tp mesh when the blocks run sequence-parallel (`trainer.tp.apply_tp`): the first stage splits the
        embeddings' output along the sequence before its blocks, the last stage gathers it after them."""
        self._rope_cache: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.spec.family != "llama":
            return None
        key = (str(device), seq_len)
        if key not in self._rope_cache:  # a plain cache, not a buffer: nothing to shard, save or materialise
            self._rope_cache[key] = rope_tables(
                seq_len=seq_len, head_dim=self.spec.head_dim, theta=self.spec.rope_theta, device=device,
                scaling=self.spec.rope_scaling,
            )
        return self._rope_cache[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embeds = self.tok_embeddings is not None and self.embed_inputs
        # A later stage under sequence parallelism receives its slice of the sequence; RoPE wants the whole length.
        seq_len = x.shape[1] * (self.sequence_mesh.size() if self.sequence_mesh is not None and not embeds else 1)
        if embeds:
            x = self.tok_embeddings(x)
            if self.pos_embeddings is not None:
                x = x + self.pos_embeddings(torch.arange(seq_len, device=x.device))
            if self.type_embeddings is not None:  # every token is of type 0 (one segment)
                x = x + self.type_embeddings.weight[0]
            if self.emb_norm is not None:
                x = self.emb_norm(x)
            x = self._split_sequence(x)
        rope = self._rope(seq_len, x.device)
        for layer in self.layers.values():
            x = layer(x, rope)
        if self.output is not None:  # the last stage: its norm and head see the whole sequence
            x = self._gather_sequence(x)
        if self.norm is not None:
            x = self.norm(x)
        if self.mlm_dense is not None:
            x = F.gelu(self.mlm_dense(x), approximate=self.spec.gelu_approximation)
        if self.mlm_norm is not None:
            x = self.mlm_norm(x)
        if isinstance(self.output, TiedOutput):
            x = self.output(x, self.tok_embeddings.weight)
        elif self.output is not None:
            x = self.output(x)
        return x

    def _split_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """This tp rank's slice of the sequence of `x` (whole on every tp rank). Through DTensor, so that backward
        gathers the slices' gradients: every rank's embeddings then get the whole sequence's gradient."""
        if self.sequence_mesh is None:
            return x
        from torch.distributed.tensor import DTensor, Replicate, Shard

        whole = DTensor.from_local(x, self.sequence_mesh, [Replicate()], run_check=False)
        return whole.redistribute(self.sequence_mesh, [Shard(1)]).to_local()

    def _gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence from every tp rank's slice (the inverse of `_split_sequence`)."""
        if self.sequence_mesh is None:
            return x
        from torch.distributed.tensor import DTensor, Replicate, Shard

        sliced = DTensor.from_local(x, self.sequence_mesh, [Shard(1)], run_check=False)
        return sliced.redistribute(self.sequence_mesh, [Replicate()]).to_local()

    @property
    def tied_embeddings(self) -> bool:
        return bool(self.spec.tie_embeddings)


def build_model(spec: ModelSpec, *, device: torch.device | str = "meta") -> Transformer:
    """The full model; on the meta device by default (no memory), to be pruned and materialised."""
    with torch.device(device):
        return Transformer(spec)


def stage_layer_ranges(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous blocks per pipeline stage; when they do not divide evenly the first stages get one more."""
    if num_stages > num_layers:
        raise ValueError(f"{num_stages} pipeline stages need at least as many layers, the model has {num_layers}")
    ranges, start = [], 0
    for size in stage_layers(num_layers, num_stages):
        ranges.append(range(start, start + size))
        start += size
    return ranges


def prune_to_stage(model: Transformer, *, stage: int, num_stages: int) -> Transformer:
    """Delete what pipeline stage `stage` of `num_stages` does not own (torchtitan style); names are unchanged."""
    if num_stages == 1:
        return model
    owned = stage_layer_ranges(model.spec.num_layers, num_stages)[stage]
    for name in list(model.layers.keys()):
        if int(name) not in owned:
            del model.layers[name]
    if stage != 0:
        model.pos_embeddings = model.type_embeddings = model.emb_norm = None
        if model.tied_embeddings and stage == num_stages - 1:
            model.embed_inputs = False  # keep the embedding for the tied decoder weight only
        else:
            model.tok_embeddings = None
    if stage != num_stages - 1:
        model.norm = model.mlm_dense = model.mlm_norm = model.output = None
    return model


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def init_parameter(name: str, param: torch.Tensor, *, seed: int, num_layers: int) -> None:
    """GPT-2 style init of one parameter, from its own generator: the values depend only on (seed, name)."""
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    with torch.no_grad():
        if leaf == "bias":
            param.zero_()
            return
        if "norm" in owner:
            param.fill_(1.0)
            return
        std = INIT_STD
        if owner in ("wo", "w2"):  # residual projections: keep the residual stream's variance depth-independent
            std = INIT_STD / math.sqrt(2 * num_layers)
        generator = torch.Generator(device=param.device).manual_seed(_param_seed(seed, name))
        param.normal_(0.0, std, generator=generator)


def materialize(model: Transformer, *, device: torch.device | str, seed: int) -> Transformer:
    """Allocate the (pruned) model on `device` and initialise it from `seed`, independent of the layout."""
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        init_parameter(name, param, seed=seed, num_layers=model.spec.num_layers)
    return model


def lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of token cross-entropies over positions whose label is not IGNORE_INDEX (fp32 for stability)."""
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
