"""The job spec as the trainer reads it: what to train, on which data, to which target (the orchestrator's
`policy` section is in `cona.orchestrator.job`).

Torch-free, so the orchestrator can load and validate jobs on a login node. Every field is addressable from the
command line as `--set section.field=value`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, TypeVar

import pydantic
from cona.protocol.yamlconfig import (
    ConfigError,
    StrictModel,
    apply_overrides,
    load_yaml,
    unindented,
    validate,
)
from pydantic import Field

ModelFamily = Literal["gpt", "llama", "bert"]

# Full-size presets describe the published architectures, with their parameter counts (tests/test_config.py):
# GPT-3 XL in the GPT-2 layout (1,315,723,264), Llama 3.2 1B (1,235,814,400: tied head, llama3 RoPE scaling),
# BERT-Large (uncased; 334,092,288 in its encoder, 335,141,888 with the pooler we do not build). The `tiny-` ones
# train on a laptop CPU in seconds on a byte-level corpus (vocabulary 256); their layout (untied GPT/Llama heads,
# no token types) is kept as it was, so the benchmarks measured with them stay valid.
LLAMA3_ROPE_SCALING: dict[str, Any] = dict(type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    "gpt3-1.3b": dict(family="gpt", num_layers=24, hidden_size=2048, num_heads=16, num_kv_heads=16,
                      ffn_hidden_size=8192, vocab_size=50257, seq_len=2048, tie_embeddings=True),
    "llama-3.2-1b": dict(family="llama", num_layers=16, hidden_size=2048, num_heads=32, num_kv_heads=8,
                         ffn_hidden_size=8192, vocab_size=128256, seq_len=2048, rope_theta=500000.0,
                         tie_embeddings=True, rope_scaling=LLAMA3_ROPE_SCALING),
    "bert-large": dict(family="bert", num_layers=24, hidden_size=1024, num_heads=16, num_kv_heads=16,
                       ffn_hidden_size=4096, vocab_size=30522, seq_len=512, norm_eps=1e-12, type_vocab_size=2),
    "tiny-gpt": dict(family="gpt", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=4,
                     ffn_hidden_size=256, vocab_size=256, seq_len=64),
    "tiny-llama": dict(family="llama", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=192, vocab_size=256, seq_len=64, rope_theta=10000.0),
    "tiny-bert": dict(family="bert", num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=4,
                      ffn_hidden_size=256, vocab_size=256, seq_len=64),
}  # fmt: skip


class RopeScaling(StrictModel):
    """Llama 3's RoPE frequency scaling (transformers' `llama3` rope type): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are stretched by `factor`, those shorter than
    original_max_position_embeddings / high_freq_factor are kept, and the band between is interpolated."""

    type: Literal["llama3"] = "llama3"
    """The scaling rule; `llama3` is the only one."""
    factor: float = Field(32.0, gt=0)
    """How much the low frequencies are stretched (32 for Llama 3.2)."""
    low_freq_factor: float = Field(1.0, gt=0)
    """Wavelengths above original_max_position_embeddings / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = Field(4.0, gt=0)
    """Wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = Field(8192, gt=0)
    """The context length the model was first trained with (8192 for Llama 3)."""

    @pydantic.model_validator(mode="after")
    def _band(self) -> RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor={self.high_freq_factor} must be larger than low_freq_factor={self.low_freq_factor}"
            )
        return self


class ModelSpec(StrictModel):
    """The architecture. A `preset` fills every dimension; explicit fields override the preset's."""

    preset: str | None = None
    """One of the names in `cona.protocol.job.PRESETS`, or None to give every dimension explicitly."""
    family: ModelFamily | None = None
    """`gpt` (learned positions, LayerNorm, GELU), `llama` (RoPE, RMSNorm, SwiGLU, GQA) or `bert` (MLM encoder)."""
    num_layers: int | None = Field(None, gt=0)
    """Number of transformer blocks."""
    hidden_size: int | None = Field(None, gt=0)
    """Model width h."""
    num_heads: int | None = Field(None, gt=0)
    """Attention heads a; must divide hidden_size."""
    num_kv_heads: int | None = Field(None, gt=0)
    """Key/value heads (grouped-query attention); equals num_heads for GPT and BERT. Unset beside a preset whose key/value
    heads equal its heads, it follows a `num_heads` the file gives; a grouped-query preset keeps its own."""
    ffn_hidden_size: int | None = Field(None, gt=0)
    """Inner width of the MLP (default 4 × hidden_size; beside a preset of a 4× MLP, it follows a `hidden_size` the
    file gives)."""
    vocab_size: int | None = Field(None, gt=0)
    """Vocabulary size; 256 for byte-level corpora."""
    seq_len: int | None = Field(None, gt=1)
    """Training context length s (tokens per sample)."""
    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base (llama only)."""
    rope_scaling: RopeScaling | None = None
    """Llama 3's RoPE frequency scaling (llama only; on in the llama-3.2-1b preset, `null` turns it off)."""
    norm_eps: float = Field(1e-5, gt=0)
    """Epsilon of LayerNorm / RMSNorm (1e-12 in the bert-large preset, as BERT's)."""
    tie_embeddings: bool | None = None
    """The output head uses the token embedding's weight (one tensor, as GPT-2/GPT-3, Llama 3.2 1B and BERT do).
    Default: the preset's value (true for gpt3-1.3b, llama-3.2-1b and every BERT; false for tiny-gpt and
    tiny-llama), else true for bert and false for gpt and llama. BERT's decoder is always tied. Under pipeline
    parallelism the last stage keeps a copy of the embedding whose gradient is summed with the first stage's."""
    gelu_approximation: Literal["none", "tanh"] = "none"
    """The MLP's GELU in gpt and bert: exact (`none`) or the tanh approximation (`tanh`) that GPT-2's published
    weights were trained with (transformers' `gelu_new`); llama uses SiLU."""
    type_vocab_size: int | None = Field(None, ge=0)
    """BERT's token-type (segment) embeddings: how many types (2 in bert-large; 0, none, in tiny-bert and for gpt
    and llama). Training feeds type 0 everywhere, as a single-segment MLM does."""
    mlm_probability: float = Field(0.15, gt=0, lt=1)
    """Fraction of tokens masked for BERT's masked-language-model objective."""
    init_from: str | None = None
    """A local Hugging Face model directory (config.json + model.safetensors, as `save_pretrained` or
    `cona export` writes it) to start from instead of the random initialisation: GPT2LMHeadModel, LlamaForCausalLM
    or BertForMaskedLM whose config matches this section (a mismatch is one line naming the field or tensor). Read
    only when the run has no checkpoint yet, under any layout. A relative path is read from the current directory,
    else next to the job file."""

    @pydantic.field_validator("init_from")
    @classmethod
    def _init_not_empty(cls, value: str | None) -> str | None:
        # Path("") is the current directory: an empty value would be read as a model directory there.
        if value is not None and not value.strip():
            raise ValueError("empty; give a Hugging Face model directory, or null to start from random weights")
        return value

    @pydantic.field_validator("preset")
    @classmethod
    def _known_preset(cls, value: str | None) -> str | None:
        if value is not None and value not in PRESETS:
            import difflib

            close = difflib.get_close_matches(value, list(PRESETS), n=1, cutoff=0.4)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"unknown preset; {hint}valid presets: {', '.join(PRESETS)}")
        return value

    @pydantic.model_validator(mode="after")
    def _fill_from_preset(self) -> ModelSpec:
        if self.preset is not None:
            preset = PRESETS[self.preset]
            # A field the preset derives the default way follows the file's own value of what it derives from:
            # `num_heads: 8` on an MHA preset means 8 key/value heads too, `hidden_size: 512` a 4× MLP.
            derived = {"num_kv_heads": ("num_heads", 1), "ffn_hidden_size": ("hidden_size", 4)}
            follows = {key for key, (source, times) in derived.items()
                       if key in preset and source in preset and preset[key] == times * preset[source]
                       and source in self.model_fields_set and key not in self.model_fields_set}  # fmt: skip
            for key, value in preset.items():
                if key in follows:
                    continue  # left None: filled from the file's value below
                # Fill what the file did not set; a field set to null takes the preset's value, except
                # rope_scaling, where null is how the preset's scaling is turned off.
                unset = key not in self.model_fields_set
                if unset or (getattr(self, key) is None and key not in _NULL_OVERRIDES_PRESET):
                    if key == "rope_scaling":
                        value = RopeScaling(**value)
                    object.__setattr__(self, key, value)
        missing = [
            name
            for name in ("family", "num_layers", "hidden_size", "num_heads", "vocab_size", "seq_len")
            if getattr(self, name) is None
        ]
        if missing:
            raise ValueError(f"give model.preset or all of: {', '.join(missing)}")
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads={self.num_heads} must divide hidden_size={self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            whose = " (the preset's: set model.num_kv_heads too)" if "num_kv_heads" not in self.model_fields_set else ""
            raise ValueError(f"num_kv_heads={self.num_kv_heads}{whose} must divide num_heads={self.num_heads}")
        if self.family != "llama" and self.num_kv_heads != self.num_heads:
            raise ValueError(f"{self.family} uses full multi-head attention: num_kv_heads must equal num_heads")
        if self.tie_embeddings is None:
            object.__setattr__(self, "tie_embeddings", self.family == "bert")
        if self.family == "bert" and not self.tie_embeddings:
            raise ValueError("tie_embeddings: BERT's MLM decoder is always tied to the token embedding; remove the field")
        if self.type_vocab_size is None:
            object.__setattr__(self, "type_vocab_size", 0)
        if self.family != "bert" and self.type_vocab_size:
            raise ValueError(f"type_vocab_size: token-type embeddings are BERT's; {self.family} has none (set 0)")
        if self.family == "llama" and self.gelu_approximation != "none":
            raise ValueError("gelu_approximation: llama's MLP uses SiLU, not GELU; remove the field")
        if self.family != "llama" and self.rope_scaling is not None:
            raise ValueError(f"rope_scaling: only llama uses RoPE; remove it for {self.family}")
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        """Parameter count N, exactly as `trainer.model` builds it (a tied head counts once)."""
        h, f, v, s = self.hidden_size, self.ffn_hidden_size, self.vocab_size, self.seq_len
        kv = self.num_kv_heads * self.head_dim
        head = 0 if self.tie_embeddings else v * h
        if self.family == "llama":  # bias-free, RMSNorm, SwiGLU
            per_layer = 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h
            return v * h + self.num_layers * per_layer + h + head
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # attention, MLP, two LayerNorms
        embeddings = v * h + s * h
        if self.family == "gpt":  # final LayerNorm
            return embeddings + self.num_layers * per_layer + 2 * h + head
        # BERT: token types, embedding LayerNorm, MLM transform (dense + LayerNorm), decoder tied to the embedding
        # + bias
        embeddings += self.type_vocab_size * h
        return embeddings + 2 * h + self.num_layers * per_layer + h * h + h + 2 * h + v


_NULL_OVERRIDES_PRESET = frozenset({"rope_scaling"})
"""ModelSpec fields whose explicit null replaces the preset's value instead of taking it."""


class DataSpec(StrictModel):
    """The training corpus and its held-out split."""

    path: str = "data/shakespeare.txt"
    """A text file, a directory of `.txt` files (byte-level, vocab 256), a token file (`.bin`/`.npy`), or the
    directory `cona data prepare` wrote (tokens.bin + tokens.json: its dtype is used, and model.vocab_size must
    hold the tokenizer's vocabulary)."""
    format: Literal["auto", "bytes", "tokens"] = "auto"
    """`auto` picks `tokens` for `.bin`/`.npy` files and `bytes` otherwise."""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of a raw `.bin` token file."""
    val_fraction: float = Field(0.05, gt=0, lt=0.5)
    """Fraction at the end of the corpus held out for validation."""

    @pydantic.field_validator("path")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        # Path("") is the current directory, which exists: an empty value would train on whatever files are there.
        if not value.strip():
            raise ValueError("empty; give a text file, a directory of .txt files or a token file")
        return value


class OptimizerSpec(StrictModel):
    """AdamW and a learning-rate schedule defined over samples, so it survives batch-size changes."""

    lr: float = Field(1e-3, gt=0)
    """Peak learning rate at `batch.base_gbs`."""
    min_lr: float = Field(1e-4, ge=0)
    """Floor of the cosine decay."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Shape after warmup."""
    warmup_samples: int = Field(1024, ge=0)
    """Linear warmup length, in samples."""
    decay_samples: int | None = Field(None, gt=0)
    """Samples over which cosine decays to min_lr; defaults to target.max_samples."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "sqrt"
    """How the peak LR follows the global batch: lr·(gbs/base_gbs)^k with k = 0, 1 or 1/2."""
    lr_scaling_cap: float = Field(2.0, ge=1.0)
    """Upper bound on the scaling factor (an uncapped rule hurts large batches early)."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW decoupled weight decay."""
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; null disables clipping."""

    @pydantic.model_validator(mode="after")
    def _floor_below_peak(self) -> OptimizerSpec:
        # A floor above the peak turns the cosine decay into a climb.
        if self.min_lr > self.lr:
            default = "" if "min_lr" in self.model_fields_set else " (the default)"
            raise ValueError(f"min_lr={self.min_lr:g}{default} is larger than lr={self.lr:g}; set optimizer.min_lr "
                             "at most lr: it is the floor the schedule decays to")  # fmt: skip
        if self.schedule == "cosine" and self.decay_samples is not None and self.decay_samples <= self.warmup_samples:
            # The cosine runs from the end of the warmup to decay_samples: none left is a drop from peak to floor.
            raise ValueError(f"decay_samples={self.decay_samples} is not past warmup_samples={self.warmup_samples}: "
                             "the cosine decays from the end of the warmup to decay_samples (samples since the "
                             "start); raise optimizer.decay_samples or leave it out (target.max_samples)")  # fmt: skip
        return self


class BatchSpec(StrictModel):
    """Bounds on the global and micro batch sizes the planner may choose."""

    min_gbs: int = Field(8, gt=0)
    """Smallest global batch (samples per optimizer step)."""
    max_gbs: int = Field(512, gt=0)
    """Largest global batch."""
    base_gbs: int = Field(32, gt=0)
    """The batch the LR is tuned for, and the one a static strategy uses."""
    gbs_choices: list[int] | None = None
    """Explicit global batches to consider; default: powers of two within [min_gbs, max_gbs] plus base_gbs."""
    mbs_choices: list[int] = Field(default_factory=lambda: [1, 2, 4, 8])
    """Micro-batch sizes to consider."""

    @pydantic.model_validator(mode="after")
    def _bounds(self) -> BatchSpec:
        if self.min_gbs > self.max_gbs:
            raise ValueError(f"min_gbs={self.min_gbs} is larger than max_gbs={self.max_gbs}")
        if not self.min_gbs <= self.base_gbs <= self.max_gbs:
            raise ValueError(f"base_gbs={self.base_gbs} must lie within [min_gbs, max_gbs]")
        if not self.mbs_choices or any(m <= 0 for m in self.mbs_choices):
            raise ValueError("mbs_choices must be a non-empty list of positive integers")
        if min(self.mbs_choices) > self.max_gbs:
            # A micro-batch is part of a replica's share of one global batch: none of these fits any batch.
            raise ValueError(f"mbs_choices {self.mbs_choices} are all larger than max_gbs={self.max_gbs}: "
                             f"give micro-batch sizes up to the global batch")  # fmt: skip
        if self.gbs_choices is not None:
            outside = [g for g in self.gbs_choices if not self.min_gbs <= g <= self.max_gbs]
            if outside or not self.gbs_choices:
                raise ValueError(
                    f"gbs_choices {self.gbs_choices} must be a non-empty list within [min_gbs, max_gbs] = "
                    f"[{self.min_gbs}, {self.max_gbs}]: {outside} lie outside; change them or the bounds"
                )
        return self

    def candidate_gbs(self) -> list[int]:
        if self.gbs_choices:
            return sorted({g for g in self.gbs_choices if self.min_gbs <= g <= self.max_gbs})
        values = {self.base_gbs}
        g = 1
        while g <= self.max_gbs:
            if g >= self.min_gbs:
                values.add(g)
            g *= 2
        return sorted(values)


class ParallelSpec(StrictModel):
    """Knobs of the parallel layouts the planner may choose."""

    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    """Pipeline schedule. 1F1B with fewer micro-batches per replica than stages runs as GPipe (whose bubble and
    peak activations in flight are then the same); the interleaved schedule's micro-batch rule is in
    `cona.protocol.feasibility`."""
    virtual_stages: int = Field(2, ge=2)
    """Model chunks per pipeline rank under the interleaved schedule (Megatron's
    --num-layers-per-virtual-pipeline-stage expressed as chunks): pp·virtual_stages stages of at least one layer
    each. Ignored by the other schedules."""
    max_tp: int | None = Field(None, gt=0)
    """Upper bound on the tensor-parallel degree (default: none; a tp above the profile's gpus_per_node must be a
    multiple of it, and runs across nodes at the cost the cost model charges)."""
    max_pp: int | None = Field(None, gt=0)
    """Upper bound on the pipeline-parallel degree."""
    sharded_dp: bool = True
    """Whether FSDP2 frees a block's gathered parameters after its forward (`trainer.fsdp`). Parameters, gradients
    and AdamW's state are sharded across data-parallel ranks either way; `false` is not replicated data
    parallelism. `true` (ZeRO-3-like): with pp = 1 each block is gathered for its forward and again for its
    backward (the least memory). `false` (ZeRO-2-like): the gathered parameters are kept from a step's first
    forward to its last backward, one all-gather per block and step instead of two per block and micro-batch, and
    each rank holds its stage's whole fp32 parameters at the peak (about 4 bytes per parameter more). Under pp they are kept either way, and the flag changes nothing."""
    sequence_parallel: bool = False
    """Under tp > 1, split each block's norms and residual stream along the sequence over the tp ranks (Megatron's
    sequence parallelism, torchtitan's `SequenceParallel`): the all-reduce after attention and after the MLP
    becomes a reduce-scatter, the block's inputs an all-gather (the same bytes), and every activation outside
    attention and the MLP is held once per tp group instead of on every rank. Needs tp to divide `model.seq_len`.
    Embeddings, the final norm and the head stay whole on every tp rank."""
    recompute: Literal["none", "selective", "full"] = "none"
    """What backward recomputes instead of keeping from forward (activation checkpointing):

    - `none`: keep every activation autograd saves (the most memory, no extra compute);
    - `selective`: op-level selective checkpointing (torchtitan's): keep the outputs of the matmuls and of
      attention, recompute the cheap elementwise ops (norms, GELU/SiLU, RoPE, residual adds) in backward;
    - `full`: keep only each block's input and recompute the whole block in backward (one extra forward).

    Old files' `activation_checkpointing: true/false` still load, as `full`/`none`."""
    collective_timeout_s: float = Field(600.0, ge=10, le=7 * 24 * 3600)
    """The longest a trainer rank waits in one collective (all-reduce, a pipeline send, a checkpoint's agreement)
    for its peers once training has started. A peer that hangs (SIGSTOP, a deadlock) or whose node is lost without
    closing its connections then ends the others with a crash record naming the failed collective, after this
    long instead of torch's default (30 minutes under gloo); a peer that dies outright ends them at once. It must
    exceed the longest skew between ranks: a checkpoint's shards on slow storage, rank 0 pruning old checkpoints.
    The start-up (the process group's rendezvous) is not bounded by it: `policy.startup_timeout_s` watches that.
    Under `cona run` the orchestrator's `policy.heartbeat_timeout_s` usually ends a hung attempt first; this bounds
    the wait where nothing watches (a trainer started by hand, an orchestrator that is gone). At most a week (604,800
    s): a larger number overflowed the timeout's conversion when the trainer built its model, minutes in."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _legacy_activation_checkpointing(cls, data: Any) -> Any:
        # run.yaml files of runs made before `recompute` existed carry the boolean; map it so they still load.
        if isinstance(data, dict) and "activation_checkpointing" in data:
            data = dict(data)
            legacy = data.pop("activation_checkpointing")
            if not isinstance(legacy, bool):
                raise ValueError(f"activation_checkpointing must be true or false, got {legacy!r}; use recompute")
            if "recompute" in data and data["recompute"] != ("full" if legacy else "none"):
                raise ValueError("give recompute or the old activation_checkpointing, not both")
            data.setdefault("recompute", "full" if legacy else "none")
        return data


class TargetSpec(StrictModel):
    """When the run is done."""

    val_perplexity: float | None = Field(None, gt=1)
    """Stop once validation perplexity reaches this value."""
    max_samples: int = Field(200_000, gt=0)
    """Budget in training samples, in whole steps: training stops at the first step boundary at or past it, so the
    last step may pass it by up to one global batch less one sample."""
    max_time_s: float | None = Field(None, gt=0)
    """Optional wall-clock budget in seconds."""


class EvalSpec(StrictModel):
    """Validation: a fixed set of held-out windows, measured at a fixed interval of samples."""

    interval_samples: int = Field(4096, gt=0)
    """Measure validation loss each time this many more samples have been trained on."""
    num_windows: int = Field(64, gt=0)
    """Number of held-out windows (fixed for the whole run)."""
    batch_size: int = Field(16, gt=0)
    """Windows per forward pass during validation."""


class CheckpointSpec(StrictModel):
    """Periodic checkpoints (a switch, a stop signal and the end of training always write one)."""

    interval_steps: int = Field(100, gt=0)
    """Save every this many optimizer steps."""
    keep: int = Field(2, gt=0)
    """Keep the newest this many complete checkpoints."""


class HeartbeatSpec(StrictModel):
    """Rank 0's progress records for the orchestrator."""

    interval_steps: int = Field(1, gt=0)
    """Append one heartbeat every this many optimizer steps."""
    gradient_stats: bool = True
    """Measure the local (pre-reduction) and Adam-preconditioned gradient norms the noise-scale estimate needs.
    Off, heartbeats carry only the global norm (which clipping computes anyway) and cona keeps its prior noise
    scale; `benchmarks/overhead.py` uses it to measure what the statistics cost."""
    adam_stats: bool = False
    """Also measure the Adam-preconditioned local and global norms (from step 2 on). The orchestrator turns it on
    for `policy.noise_estimator: adam`; off, the step skips their extra pass over the gradients."""


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


class JobSpec(StrictModel):
    """A training job as the trainer reads it. Load with `load_job`; the orchestrator's `cona.orchestrator.job.Job`
    adds the `policy` section."""

    name: str = "cona-job"
    """A short name for run directories and cluster jobs: letters, digits, `.`, `_` and `-`, starting with a letter
    or digit (it becomes a directory name, a Slurm job name and part of Kubernetes object names)."""
    seed: int = Field(0, ge=0)
    """Seeds the initialisation, the data order and BERT's masks."""
    model: ModelSpec
    data: DataSpec = Field(default_factory=DataSpec)
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    batch: BatchSpec = Field(default_factory=BatchSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)
    target: TargetSpec = Field(default_factory=TargetSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    heartbeat: HeartbeatSpec = Field(default_factory=HeartbeatSpec)

    @pydantic.field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError(
                "use 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit (it names the run "
                "directory and the cluster jobs)"
            )
        return value

    @property
    def decay_samples(self) -> int:
        return self.optimizer.decay_samples or self.target.max_samples


ORCHESTRATOR_SECTIONS = ("policy", "metrics")
"""Sections of a job file that only the orchestrator reads (`cona.orchestrator.job`); the trainer sets them aside."""


def job_from_dict(data: dict[str, Any], *, source: str = "job") -> JobSpec:
    """Validate a job given as a mapping (for example `run.yaml`'s `job` section), without the orchestrator's
    sections."""
    return validate(JobSpec, {k: v for k, v in data.items() if k not in ORCHESTRATOR_SECTIONS}, source=source)


JobT = TypeVar("JobT", bound="JobSpec")


def read_job_file(cls: type[JobT], path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobT:
    """Load a job YAML file as `cls`, applying `--set dotted.key=value` overrides; raises `ConfigError`. Keys of
    the sections `cls` does not declare (`ORCHESTRATOR_SECTIONS`) are set aside."""
    data = load_yaml(path)
    data = apply_overrides(data, list(overrides))
    if "model" not in data:
        if "backend" in data and "accelerator" in data:  # the commonest mix-up: a profile given as the job
            raise ConfigError(f"{path}: a cluster profile (it has backend and accelerator), given as --job; did you "
                              "swap --profile and --job?")  # fmt: skip
        raise ConfigError(f"{path}: missing required section 'model' (e.g. model: {{preset: tiny-gpt}})")
    unindented(cls, data, path)
    ignored = [k for k in ORCHESTRATOR_SECTIONS if k not in cls.model_fields]
    job = validate(cls, {k: v for k, v in data.items() if k not in ignored}, source=str(path), overrides=overrides)
    base = Path(path).resolve().parent
    # A relative data path is read relative to the current directory when it exists there, else to the job file.
    data_path = Path(job.data.path)
    if not data_path.is_absolute() and not data_path.exists() and (base / data_path).exists():
        job.data.path = str(base / data_path)
    if job.model.init_from is not None:
        init = Path(job.model.init_from)
        if not init.is_absolute() and not init.exists() and (base / init).exists():
            init = base / init
        if not init.is_dir():
            raise ConfigError(f"{path}: model.init_from {job.model.init_from!r}: no such directory; give a local "
                              "Hugging Face model directory (config.json + model.safetensors)")  # fmt: skip
        job.model.init_from = str(init.resolve())
    return job


def load_job(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> JobSpec:
    """Load and validate a job YAML file as the trainer reads it; raises `ConfigError`."""
    return read_job_file(JobSpec, path, overrides)


def job_to_dict(job: JobSpec) -> dict[str, Any]:
    """The resolved job as plain data (for run.yaml); `job_from_dict` reads it back unchanged."""
    return job.model_dump(mode="json")
