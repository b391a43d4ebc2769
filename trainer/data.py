"""Corpora, the sample order and batches.

A corpus is a 1-D sequence of token ids: the bytes of a text file or of a directory of text files (vocab 256), or a
pre-tokenized file (`.bin` raw uint16/uint32, or `.npy`) read through a memory map, such as the tokens.bin that
`cona data prepare` writes next to its tokens.json (whose dtype and vocabulary `read_token_metadata` applies). The last `data.val_fraction` of
it is held out for validation.

**Sample order.** Sample i (counted from the start of the run, over all steps) is a fixed function of
(seed, i), whatever the strategy:

    windows per epoch W = number of seq_len-strided window starts that fit the training split
    epoch e = i // W, j = i % W
    start(i) = shift_e + seq_len · perm_e[j]      perm_e, shift_e drawn from numpy's PCG64 seeded by (seed, e)

A window holds seq_len + 1 tokens for causal models (inputs and next-token targets) and seq_len for BERT. A global
step that begins at sample s consumes samples [s, s + gbs); data-parallel rank r takes the contiguous slice
[s + r·gbs/dp, s + (r+1)·gbs/dp) and micro-batches slice that further, so a resume under any dp/mbs/gbs continues
at exactly the next unseen sample.

**BERT masking** of sample i is a fixed function of (seed, i) too: each position is selected with probability
`model.mlm_probability`; a selected position becomes the mask id (vocab_size - 1; 0xFF never occurs in UTF-8
text) 80% of the time, a random token 10%, and stays unchanged 10%. Labels are the original tokens at selected
positions and IGNORE_INDEX elsewhere.

**Validation** uses `eval.num_windows` fixed windows spread evenly over the held-out split (masked for BERT with
their own (seed, window) streams), the same for every layout.
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import numpy as np
from cona.protocol.inputs import (
    FIX_JOB,
    TEXT_SUFFIXES,
    TOKENS_FILE,
    TOKENS_META,
    InputRefused,
    check_split,
    data_files,
    read_token_metadata,
)
from cona.protocol.job import JobSpec
from cona.protocol.yamlconfig import ConfigError

__all__ = ["TEXT_SUFFIXES", "TOKENS_FILE", "TOKENS_META", "Batcher", "Corpus", "TokenSequence", "load_corpus", "read_token_metadata"]

IGNORE_INDEX = -100
"""Label of positions that carry no loss (unmasked BERT tokens, padding)."""
_MASK_STREAM = 0x6D61736B  # "mask": separates the masking streams from the order streams
_EVAL_STREAM = 0x6576616C  # "eval"


class TokenSequence:
    """A read-only 1-D token sequence, possibly several memory-mapped arrays back to back (a directory)."""

    def __init__(self, parts: list[np.ndarray]) -> None:
        self._parts = [p for p in parts if len(p)]
        self._ends = np.cumsum([len(p) for p in self._parts]) if self._parts else np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def sample_crc32(self, points: int = 256, run: int = 64) -> int:
        """CRC-32 of `points` runs of `run` tokens spread evenly over the sequence (all of it when shorter): a
        fingerprint that reads a few thousand tokens whatever the corpus's size. It tells another corpus of the same
        length, or one edited in many places, from the one a checkpoint trained on; an edit between the sampled
        runs goes unseen."""
        n = len(self)
        if n <= points * run:
            return zlib.crc32(self.slice(0, n).tobytes())
        starts = np.linspace(0, n - run, points).astype(np.int64)
        return zlib.crc32(b"".join(self.slice(int(a), int(a) + run).tobytes() for a in starts))

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as int64, across part boundaries."""
        out = np.empty(stop - start, dtype=np.int64)
        pos, filled = start, 0
        while pos < stop:
            part = int(np.searchsorted(self._ends, pos, side="right"))
            part_start = int(self._ends[part - 1]) if part else 0
            take = min(stop, int(self._ends[part])) - pos
            out[filled : filled + take] = self._parts[part][pos - part_start : pos - part_start + take]
            pos += take
            filled += take
        return out


@dataclasses.dataclass
class Corpus:
    train: TokenSequence
    val: TokenSequence
    vocab_size: int
    """Largest id + 1 the corpus may contain (256 for bytes)."""
    source: str


def _read_tokens(path: Path, token_dtype: str) -> np.ndarray:
    """The ids of one token file (`data_files` checked that a raw one is a whole number of ids)."""
    if path.suffix.lower() == ".npy":
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as e:  # not a .npy file, or one holding pickled objects (never loaded)
            raise InputRefused(f"{path}: not a NumPy array of token ids ({e}); check data.path") from None
        if array.ndim != 1 or array.dtype not in (np.uint16, np.uint32, np.int32, np.int64):
            raise InputRefused(f"{path}: expected a 1-D array of token ids (uint16/uint32), got {array.dtype}{array.shape}")
        least = int(array.min()) if array.dtype.kind == "i" and len(array) else 0  # one scan of the file
        if least < 0:
            # A negative id indexed the embedding from its end, or failed deep in the model ("index out of range").
            raise InputRefused(f"{path}: holds negative token ids (the least is {least}); token ids run "
                               "from 0 to vocab_size - 1: check how the file was written")  # fmt: skip
        return array
    dtype = np.dtype(token_dtype)
    if path.stat().st_size == 0:  # numpy cannot map an empty file; the token count check names the problem
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def load_corpus(job: JobSpec) -> Corpus:
    """Open `job.data.path` and split off the validation tail; raises `InputRefused` (a ConfigError) with what to fix.

    What the files' names and sizes tell is checked where `cona run` checks it before a run exists
    (`cona.protocol.inputs`: `data_files`, `check_split`); here on the token count read."""
    files = data_files(job)
    if files.fmt == "tokens":
        parts = [_read_tokens(p, files.token_dtype) for p in files.files]
        vocab = job.model.vocab_size
    else:
        parts = [np.memmap(p, dtype=np.uint8, mode="r") if p.stat().st_size else np.zeros(0, np.uint8) for p in files.files]
        vocab = 256
    whole = TokenSequence(parts)
    n = len(whole)
    check_split(job, n, source=files.source)
    n_val = int(n * job.data.val_fraction)
    train_parts, val_parts = _split_parts(parts, n - n_val)
    return Corpus(train=TokenSequence(train_parts), val=TokenSequence(val_parts), vocab_size=vocab,
                  source=str(files.path))  # fmt: skip


def _split_parts(parts: list[np.ndarray], at: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    head, tail, pos = [], [], 0
    for part in parts:
        if pos + len(part) <= at:
            head.append(part)
        elif pos >= at:
            tail.append(part)
        else:
            head.append(part[: at - pos])
            tail.append(part[at - pos :])
        pos += len(part)
    return head, tail


class SampleOrder:
    """Token offset of every training sample: a fixed function of (seed, sample index); see the module doc."""

    def __init__(self, *, num_tokens: int, seq_len: int, window_len: int, seed: int) -> None:
        self.seq_len = seq_len
        self.window_len = window_len
        self.seed = seed
        self.num_windows_per_epoch = (num_tokens - window_len - seq_len + 1) // seq_len + 1
        if self.num_windows_per_epoch < 1:
            raise ConfigError(f"the training split ({num_tokens} tokens) is shorter than one sample window")
        self._epochs: dict[int, tuple[int, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        if epoch not in self._epochs:
            rng = np.random.default_rng([self.seed, epoch])
            shift = int(rng.integers(0, self.seq_len))
            perm = rng.permutation(self.num_windows_per_epoch)
            if len(self._epochs) >= 2:
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = (shift, perm)
        return self._epochs[epoch]

    def start(self, index: int) -> int:
        epoch, j = divmod(index, self.num_windows_per_epoch)
        shift, perm = self._epoch(epoch)
        return shift + self.seq_len * int(perm[j])


def mlm_mask(tokens: np.ndarray, *, key: tuple[int, ...], probability: float, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """BERT's masking of one sample, a fixed function of `key`: (masked inputs, labels)."""
    rng = np.random.default_rng(list(key))
    selected = rng.random(len(tokens)) < probability
    choice = rng.random(len(tokens))
    random_tokens = rng.integers(0, vocab_size, len(tokens))
    inputs = tokens.copy()
    inputs[selected & (choice < 0.8)] = vocab_size - 1
    swap = selected & (choice >= 0.8) & (choice < 0.9)
    inputs[swap] = random_tokens[swap]
    labels = np.where(selected, tokens, IGNORE_INDEX)
    return inputs, labels


@dataclasses.dataclass
class Batch:
    """Inputs and labels [b, seq_len] (int64 numpy) of a run of samples."""

    inputs: np.ndarray
    labels: np.ndarray

    @property
    def num_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


class Batcher:
    """Builds training batches by sample index and the fixed validation windows."""

    def __init__(self, job: JobSpec, corpus: Corpus) -> None:
        self.job = job
        self.corpus = corpus
        self.mlm = job.model.family == "bert"
        self.seq_len = job.model.seq_len
        self.window_len = self.seq_len if self.mlm else self.seq_len + 1
        if corpus.vocab_size > job.model.vocab_size:
            raise InputRefused(
                f"model.vocab_size={job.model.vocab_size} is smaller than the corpus's {corpus.vocab_size} token ids; "
                f"set model.vocab_size: {corpus.vocab_size}", fix=FIX_JOB,
            )  # fmt: skip
        self.order = SampleOrder(
            num_tokens=len(corpus.train), seq_len=self.seq_len, window_len=self.window_len, seed=job.seed
        )

    def _make(self, windows: list[np.ndarray], keys: list[tuple[int, ...]]) -> Batch:
        # Checked per batch, not over the whole corpus at start-up (a pass over gigabytes): an id beyond the model's
        # vocabulary would otherwise end in an index error deep inside the embedding.
        top = max((int(w.max()) for w in windows if len(w)), default=-1)
        if top >= self.corpus.vocab_size:
            raise InputRefused(
                f"data.path {self.corpus.source!r} holds token id {top}, beyond model.vocab_size="
                f"{self.corpus.vocab_size}; set model.vocab_size above it or check data.token_dtype", fix=FIX_JOB,
            )  # fmt: skip
        if not self.mlm:
            stacked = np.stack(windows) if windows else np.zeros((0, self.window_len), np.int64)
            return Batch(inputs=stacked[:, :-1], labels=stacked[:, 1:])
        pairs = [
            mlm_mask(w, key=k, probability=self.job.model.mlm_probability, vocab_size=self.job.model.vocab_size)
            for w, k in zip(windows, keys, strict=True)
        ]
        if not pairs:
            empty = np.zeros((0, self.seq_len), np.int64)
            return Batch(inputs=empty, labels=empty)
        return Batch(inputs=np.stack([p[0] for p in pairs]), labels=np.stack([p[1] for p in pairs]))

    def samples(self, start: int, stop: int) -> Batch:
        """Training samples [start, stop) (global sample indices)."""
        windows = []
        for index in range(start, stop):
            offset = self.order.start(index)
            windows.append(self.corpus.train.slice(offset, offset + self.window_len))
        return self._make(windows, [(self.job.seed, _MASK_STREAM, index) for index in range(start, stop)])

    def num_targets(self, start: int, stop: int) -> int:
        """Tokens that carry loss in samples [start, stop): the normaliser of the global-batch mean loss."""
        if not self.mlm:
            return (stop - start) * self.seq_len
        return self.samples(start, stop).num_targets

    def eval_windows(self) -> Batch:
        """The fixed validation set: `eval.num_windows` windows spread evenly over the held-out split."""
        count = self.job.eval.num_windows
        last = len(self.corpus.val) - self.window_len
        starts = [round(w * last / max(1, count - 1)) for w in range(count)]
        windows = [self.corpus.val.slice(s, s + self.window_len) for s in starts]
        return self._make(windows, [(self.job.seed, _EVAL_STREAM, w) for w in range(count)])
