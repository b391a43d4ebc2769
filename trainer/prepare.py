"""`cona data prepare --tokenizer TOKENIZER --input TEXT... --out DIR`: text to the token file the trainer reads.

The `cona` command line runs this module as a program (`python -m cona.trainer.prepare`): it is the data plane's
tool, and needs Hugging Face `tokenizers` (`pip install cona[data]`), not torch. It writes

    DIR/tokens.bin    every document's token ids back to back, each followed by the EOS id when the tokenizer has
                      one; raw uint16 when the ids fit (below 65,536), else uint32
    DIR/tokens.json   {"tokenizer_sha256", "vocab_sha256", "vocab_size", "eos_id", "token_dtype", "num_tokens",
                      "documents", "dropped_characters", "tokenizer", "inputs"}: the trainer reads the dtype from
                      it, checks the token file's size against it and refuses a model whose vocabulary is smaller
                      than the tokenizer's
                      (`cona.protocol.inputs.read_token_metadata`); `cona run` refuses a `model.init_from` whose
                      tokenizer.json has another vocabulary (`vocab_sha256`, `cona.protocol.inputs.check_tokenizer`)

and `data.path: DIR` trains on it. TOKENIZER is a tokenizer.json, or a model directory that holds one (its
tokenizer_config.json's `eos_token` is the EOS when none of `EOS_CANDIDATES` is a token). `vocab_size` is the
largest id + 1 (a vocabulary may have holes). A document is one input file: a file given, every file a quoted glob
matches, or a directory's `.txt`/`.md` files and files without a suffix, in any case and at any depth, sorted, as
the byte-level reader takes them (`cona.protocol.inputs.corpus_files`: no hidden files or directories). A file is
read as UTF-8 without its byte order mark (bytes that are not UTF-8 become U+FFFD, counted in a warning), gzip, bzip2
and xz files decompressed; UTF-16 text, zstd and a file with a NUL byte (a binary file) are refused before anything
is tokenized, as far as their first 8,000 bytes tell, and a file that changes while it is read afterwards. Line ends
are kept as they are (CRLF too, as the byte-level reader reads them).

Files are read a block at a time and cut into chunks of about `--chunk-mb` that `--workers` processes tokenize
(a progress bar on a terminal): a corpus larger than memory is fine. The tokens are those of each document encoded
whole, whatever `--workers` and `--chunk-mb`:

- A tokenizer may add a prefix on every encode call (ByteLevel's `add_prefix_space`, Metaspace's `prepend_scheme`
  `always` or `first`, a `Prepend` normalizer): inside a document it would insert a space at every chunk. A
  document's first chunk is encoded with the tokenizer as it is, the others with a copy without that prefix
  (`without_call_prefix`).
- Tokens can depend on the text across a cut (GPT-2's pre-tokenizer groups `"  \n"` differently at the end of a
  text than before a letter; `"\n\n\n"` cut after its first line end encodes as three newlines instead of two
  tokens). A chunk ends at the first line end past `--chunk-mb` where cutting changes no token: the text around the
  cut (`_CONTEXT` characters each side) encodes the same whole as in two parts, and the whitespace run across the
  cut ends inside that text (`harmless_cut`).
"""

from __future__ import annotations

import argparse
import bz2
import codecs
import collections
import contextlib
import difflib
import glob
import gzip
import hashlib
import json
import lzma
import math
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import IO, Any, NoReturn

import numpy as np
from cona.protocol.cliargs import OptionParser
from cona.protocol.inputs import TOKENIZER_FILE, corpus_files, vocab_digest
from cona.trainer.data import TEXT_SUFFIXES, TOKENS_FILE, TOKENS_META

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
"""Tokens tried, in order, as the end-of-document token when --eos is not given."""
TOKENIZER_CONFIG = "tokenizer_config.json"
"""A model directory's tokenizer (what a fast tokenizer's save_pretrained writes) and its settings (`eos_token`)."""
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zstd")
"""A directory's compressed text files (a.txt.gz): what a file holds is told by its first bytes, not its name."""
_HEAD = 8000
"""Bytes of every file read before tokenizing starts: a NUL among them marks a binary file (git's test)."""
_BLOCK = 1 << 20
"""Bytes read at a time: a document is held a chunk and its context at a time, not whole."""
_TEXT_KINDS = ", ".join(s or "no suffix" for s in TEXT_SUFFIXES)


class _Parser(OptionParser):
    def fail(self, message: str) -> NoReturn:  # one line, exit 2, as the rest of cona
        print(f"cona: error: {message} (see cona data prepare --help)", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="cona data", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    prepare = sub.add_parser("prepare", help="tokenize text files into DIR/tokens.bin and DIR/tokens.json",
                             description=__doc__.split("\n\n")[0], allow_abbrev=False)  # fmt: skip
    prepare.add_argument("--tokenizer", required=True, type=Path, metavar="TOKENIZER",
                         help="a Hugging Face tokenizer.json (what tokenizer.save() writes), or a model directory "
                         "that holds one (what save_pretrained writes)")  # fmt: skip
    # Several values: an unquoted glob arrives expanded by the shell, a quoted one is expanded here.
    prepare.add_argument("--input", required=True, nargs="+", type=Path, metavar="TEXT",
                         help="text files, directories of them or quoted globs ('corpus/*.txt'); .gz/.bz2/.xz read "
                         "decompressed; each file is a document")  # fmt: skip
    prepare.add_argument("--out", required=True, type=Path, metavar="DIR", help="where tokens.bin and tokens.json go (replaced)")
    prepare.add_argument("--eos", metavar="TOKEN", help=f"end-of-document token (default: the first of {', '.join(EOS_CANDIDATES)} "
                         "the tokenizer knows, else its tokenizer_config.json's eos_token; none if neither)")  # fmt: skip
    prepare.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: all cores)")
    prepare.add_argument("--chunk-mb", type=float, default=1.0, help="text per task, in MB (default 1)")
    return parser.parse_args(argv)


def input_files(paths: Path | Sequence[Path], note: Callable[[str], None] | None = None, *,
                option: str = "--input") -> list[Path]:  # fmt: skip
    """The documents `paths` (given as `option`) name, in order: a file itself, a directory's text files
    (`corpus_files`, what it passes over said through `note`), the files a glob matches (sorted). ValueError for a
    path that names none, or a file named twice (its tokens would be trained on twice)."""
    files: list[Path] = []
    seen: dict[Path, Path] = {}
    for given in [paths] if isinstance(paths, Path) else paths:
        if given.is_file():
            found = [given]
        elif given.is_dir():
            found = _directory_files(given, note, option)
        elif any(c in str(given) for c in "*?["):
            found = []
            for match in map(Path, sorted(glob.glob(str(given), recursive=True))):
                if match.is_file():
                    found.append(match)
                elif match.is_dir():  # one of the directories matched may hold no text: the glob says which
                    found.extend(_directory_files(match, note, option, required=False))
            if not found:
                raise ValueError(f"{option} {given}: no file matches")
        else:
            raise ValueError(f"{option} {given}: no such file or directory")
        for file in found:
            key = file.resolve()
            if key in seen:
                twice = f"{file} is named twice" if seen[key] == file else f"{seen[key]} and {file} are the same file"
                raise ValueError(f"{option}: {twice}; give each file once")
            seen[key] = file
            files.append(file)
    return files


def _directory_files(directory: Path, note: Callable[[str], None] | None, option: str, *,
                     required: bool = True) -> list[Path]:  # fmt: skip
    files, passed = corpus_files(directory, TEXT_SUFFIXES, compressed=COMPRESSED_SUFFIXES)
    if not files and required:
        raise ValueError(f"{option} {directory}: the directory holds no text files ({_TEXT_KINDS}, or those "
                         "compressed); give the files, or a quoted glob that matches them")  # fmt: skip
    if passed and note is not None:  # a corpus of a.TEXT files, or a link to a directory, is not lost without a word
        shown = ", ".join(str(p) for p in passed[:3]) + (", …" if len(passed) > 3 else "")
        note(f"{directory}: passed over {len(passed):,} entries that are not text files ({_TEXT_KINDS}), or are links "
             f"to directories: {shown}")  # fmt: skip
    return files


_CONTEXT = 1000
"""Characters each side of a cut that `harmless_cut` encodes: far more than a pre-token spans in text."""
_TRIES = 64
"""Line ends tried in a row before skipping a chunk's length further, so a tokenizer for which no cut is harmless
(a `Strip` normalizer) costs a bounded number of checks per chunk rather than one per line."""


class Text:
    """A document's text read on demand, by offsets from its start: `chunks` asks for the chunk to send and the text
    around a cut, this reads blocks until it holds them, and `forget` drops what lies before, so a document is held
    a chunk and its context at a time however large its file."""

    def __init__(self, blocks: Iterator[str]) -> None:
        self._blocks = blocks
        self._text = ""
        self._start = 0  # the offset of _text[0] in the document
        self._done = False

    def _read(self, enough: Callable[[str, int], bool]) -> None:
        """Reads blocks until `enough(block, characters held)` or the end; joins once (a very long line arrives in
        many blocks)."""
        parts, held = [self._text], len(self._text)
        for block in self._blocks:
            parts.append(block)
            held += len(block)
            if enough(block, held):
                break
        else:
            self._done = True
        self._text = "".join(parts)

    def _fill(self, stop: int) -> None:
        if not self._done and self._start + len(self._text) < stop:
            self._read(lambda _, held: self._start + held >= stop)

    def get(self, begin: int, end: int) -> str:
        """The text [begin, end), cut at its end."""
        self._fill(end)
        assert begin >= self._start, "forgotten text asked for"
        return self._text[begin - self._start : end - self._start]

    def ends_at(self, offset: int) -> bool:
        """Whether the document ends at `offset` (it holds no character there)."""
        self._fill(offset + 1)
        return self._start + len(self._text) <= offset

    def end(self) -> int:
        """The document's length (reads it to the end)."""
        if not self._done:
            self._read(lambda *_: False)
        return self._start + len(self._text)

    def find_line_end(self, at: int) -> int:
        """The offset of the first "\n" at or after `at`, or -1 when there is none (the rest is read then)."""
        self._fill(at + 1)
        while True:
            found = self._text.find("\n", max(0, at - self._start))
            if found >= 0:
                return self._start + found
            if self._done:
                return -1
            self._read(lambda block, _: "\n" in block)

    def forget(self, before: int) -> None:
        if before > self._start:
            self._text = self._text[before - self._start :]
            self._start = before


def chunks(text: str | Text, size: int, harmless: Callable[[Text, int], bool] | None = None) -> Iterator[str]:
    """`text` cut after a line end near every `size` characters (the whole rest when there is none): the first line
    end from there where `harmless(text, cut)` holds (every one when `harmless` is None)."""
    if isinstance(text, str):
        text = Text(iter([text]))
    start = 0
    while not text.ends_at(start):
        end = _cut(text, start + size, size, harmless)
        yield text.get(start, end)
        text.forget(end - _CONTEXT)  # what a check of the next cut may look at is kept
        start = end


def _cut(text: Text, at: int, size: int, harmless: Callable[[Text, int], bool] | None) -> int:
    tried = 0
    while True:
        line_end = text.find_line_end(at)
        if line_end < 0 or text.ends_at(line_end + 1):
            return text.end()
        cut = line_end + 1
        if harmless is None or harmless(text, cut):
            return cut
        tried += 1
        at = cut if tried % _TRIES else cut + size


def without_call_prefix(tokenizer_json: str) -> str:
    """The tokenizer without the prefix it adds at the start of every encode call (see the module): the one to
    encode the chunks of a document after its first with, where the whole document's encode adds nothing."""
    config = json.loads(tokenizer_json)

    def strip(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        kind = node.get("type")
        if kind == "Prepend":
            return None
        if kind == "ByteLevel":
            return {**node, "add_prefix_space": False}
        if kind == "Metaspace":
            # `first` prepends to the first section of every call, a later chunk's too; mid-document the whole
            # document's encode prepends nothing.
            node = {**node, "prepend_scheme": "never"}
            if "add_prefix_space" in node:  # the field of tokenizers before 0.19
                node["add_prefix_space"] = False
            return node
        for key in ("normalizers", "pretokenizers"):  # Sequence
            if isinstance(node.get(key), list):
                node = {**node, key: [n for n in map(strip, node[key]) if n is not None]}
        return node

    for key in ("normalizer", "pre_tokenizer"):
        config[key] = strip(config.get(key))
    return json.dumps(config)


def harmless_cut(first: Any, rest: Any) -> Callable[[Text, int], bool]:
    """Whether cutting `text` at `cut` leaves the tokens as they are: the text around it encodes the same whole as
    in two parts, the part after the cut as a chunk after the first is (by `rest`; by `first` what starts at the
    document's start, as its first chunk is)."""

    def ids(tokenizer: Any, text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    def check(text: Text, cut: int) -> bool:
        begin = max(0, cut - _CONTEXT)
        left, right = text.get(begin, cut), text.get(cut, cut + _CONTEXT)
        # A whitespace run across the cut that reaches past the text looked at is one pre-token (GPT-2's `\s+`)
        # whose tokens depend on where it starts and ends: cut short there, the check answered for another run
        # (3,001 newlines cut 8 before their end encoded as other tokens).
        if (begin > 0 and left.isspace()) or (right.isspace() and not text.ends_at(cut + len(right))):
            return False
        before = first if begin == 0 else rest
        return ids(before, left + right) == ids(before, left) + ids(rest, right)

    return check


_TOKENIZERS: tuple[Any, Any] | None = None


def _init_worker(first_json: str, rest_json: str) -> None:
    global _TOKENIZERS
    from tokenizers import Tokenizer

    _TOKENIZERS = (Tokenizer.from_str(first_json), Tokenizer.from_str(rest_json))


DROPPED_SHOWN = 5
"""Characters named in the warning about text no token covers."""
_LEFT_OUT: dict[str, bool] = {}
"""Per worker: whether the tokenizer encodes a character to nothing (`_dropped`)."""


def _dropped(text: str, tokenizer: Any) -> collections.Counter[str]:
    """The characters of `text`, whitespace aside, that `tokenizer` (without its per-call prefix) encodes to no
    token: a tokenizer without an unknown token or byte fallback (a BPE trained on other text) leaves out what its
    vocabulary lacks, silently. Each distinct character is encoded alone once per worker (a set of the text is
    cheap next to its encode; the offsets of every token cost half as much again)."""
    counts: collections.Counter[str] = collections.Counter()
    for c in set(text):
        left_out = _LEFT_OUT.get(c)
        if left_out is None:
            left_out = _LEFT_OUT[c] = not c.isspace() and not tokenizer.encode(c, add_special_tokens=False).ids
        if left_out:
            counts[c] = text.count(c)
    return counts


def _encode(task: tuple[str, bool]) -> tuple[np.ndarray, collections.Counter[str]]:
    # No special tokens added per chunk (a chunk is not a document); EOS is appended per document by the caller.
    # Only a document's first chunk takes the prefix the tokenizer adds per call, as the whole document's encode does.
    text, first = task
    assert _TOKENIZERS is not None
    tokenizer = _TOKENIZERS[0] if first else _TOKENIZERS[1]
    ids = np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
    return ids, _dropped(text, _TOKENIZERS[1])


def load_tokenizer(path: Path) -> tuple[Any, bytes, str | None]:
    """(the tokenizer of `path`, its tokenizer.json's bytes, the `eos_token` of a tokenizer_config.json beside it or
    None); ValueError naming --tokenizer and what to give instead."""
    from tokenizers import Tokenizer

    file = path / TOKENIZER_FILE if path.is_dir() else path
    convert = ("give a tokenizers JSON file (transformers: AutoTokenizer.from_pretrained(MODEL_DIR)"
               ".save_pretrained(OUT) writes OUT/tokenizer.json)")  # fmt: skip
    if path.is_dir() and not file.is_file():
        raise ValueError(f"--tokenizer {path}: no {TOKENIZER_FILE} in the directory; {convert}")
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"--tokenizer {path}: no such file") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:  # a sentencepiece .model is a protobuf, tiktoken's files are base64 text
        raise ValueError(f"--tokenizer {path}: a binary file (a sentencepiece .model?), not a tokenizers JSON file; "
                         f"{convert}") from None  # fmt: skip
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises its own exception types for a malformed file
        raise ValueError(f"--tokenizer {path}: not a tokenizers JSON file ({str(e).splitlines()[0]}); {convert}") from None
    return tokenizer, raw, _config_eos(file.parent / TOKENIZER_CONFIG)


def _config_eos(config: Path) -> str | None:
    """tokenizer_config.json's `eos_token` (a string, or an AddedToken's {"content": ...}); None when unreadable."""
    try:
        eos = json.loads(config.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) else None


def _eos_id(tokenizer: Any, eos: str | None, config_eos: str | None, tokenizer_path: Path) -> int | None:
    if eos is None:
        known = (tokenizer.token_to_id(t) for t in (*EOS_CANDIDATES, *([config_eos] if config_eos else [])))
        return next((i for i in known if i is not None), None)
    eos_id = tokenizer.token_to_id(eos)
    if eos_id is None:
        try:
            special = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
        except AttributeError:  # tokenizers before 0.15
            special = []
        close = difflib.get_close_matches(eos, special, n=3, cutoff=0.5) or special[:5]
        hint = f"; its special tokens include {', '.join(map(repr, close))}" if close else ""
        raise ValueError(f"--eos {eos!r}: not a token of {tokenizer_path}{hint}")
    return eos_id


def prepare(tokenizer_path: Path, input_path: Path | Sequence[Path], out: Path, *, eos: str | None = None,
            workers: int = 1, chunk_mb: float = 1.0, progress: bool | None = None) -> dict[str, Any]:  # fmt: skip
    """Tokenize `input_path` (one path or several) into `out` (see the module); returns the metadata written.
    ValueError on bad input."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("cona data prepare needs Hugging Face tokenizers: pip install 'cona[data]'") from None
    # Each named with the value given: one message for both left the user to find which was wrong.
    if workers < 1:
        raise ValueError(f"--workers {workers}: give at least 1 tokenizing process (default: all cores)")
    if not (math.isfinite(chunk_mb) and chunk_mb > 0):
        raise ValueError(f"--chunk-mb {chunk_mb:g}: give a positive, finite size in MB (default 1)")
    tokenizer, raw, config_eos = load_tokenizer(tokenizer_path)
    tokenizer_json = raw.decode("utf-8-sig")
    settings = json.loads(tokenizer_json)
    if isinstance(settings, dict) and (settings.get("truncation") or settings.get("padding")):
        # Saved after `tokenizer(..., truncation=True)`: the settings are for model inputs. On a corpus they kept
        # the first max_length tokens of each document (99.9% of a 2 MB file lost) or padded short ones.
        which = " and ".join(k for k in ("truncation", "padding") if settings.get(k))
        print(f"cona data prepare: note: {tokenizer_path} sets {which} (for model inputs); tokenizing the corpus "
              "without it", file=sys.stderr)  # fmt: skip
        settings["truncation"] = settings["padding"] = None
        tokenizer_json = json.dumps(settings)
        tokenizer = Tokenizer.from_str(tokenizer_json)
    if workers > (cores := os.cpu_count() or 1):
        # All are forked at once: 100000 of them hung the machine before the first chunk.
        print(f"cona data prepare: note: --workers {workers} is more than the {cores} cores; using {cores}",
              file=sys.stderr)  # fmt: skip
        workers = cores
    # The largest id + 1, not the count: a vocabulary with holes (an id above the count) would otherwise be written
    # in a dtype too narrow for it, wrapping around into other tokens, and recorded too small for the model.
    vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if vocab_size == 0:
        raise ValueError(f"--tokenizer {tokenizer_path}: the tokenizer has no tokens")
    eos_id = _eos_id(tokenizer, eos, config_eos, tokenizer_path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: a file, not a directory; give a directory for {TOKENS_FILE} and {TOKENS_META}")
    notes: list[str] = []
    files = input_files(input_path, note=notes.append)
    sizes = [check_text_file(path) for path in files]  # a binary file found now, not after hours of tokenizing
    empty = f"{_shown(input_path)}: no text to tokenize (the input is empty or only whitespace); check the --input path"
    if not any(sizes):
        raise ValueError(empty)
    for line in notes:  # after the refusals, which stay one line
        print(f"cona data prepare: note: {line}", file=sys.stderr)
    if eos_id is None and len(files) > 1:
        print(f"cona data prepare: warning: {tokenizer_path} has no end-of-document token ({', '.join(EOS_CANDIDATES)}); "
              f"the {len(files)} documents are joined without one (give --eos TOKEN to separate them)", file=sys.stderr)  # fmt: skip
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    target, meta_path = out / TOKENS_FILE, out / TOKENS_META
    tmp, meta_tmp = out / f"{TOKENS_FILE}.tmp", out / f"{TOKENS_META}.tmp"
    with _writing_to(out, (tmp, meta_tmp), created=not out.exists()):
        out.mkdir(parents=True, exist_ok=True)
        size = max(1, int(chunk_mb * 1e6))
        rest_json = _rest_tokenizer(tokenizer_json)
        harmless = harmless_cut(tokenizer, Tokenizer.from_str(rest_json))
        from tqdm import tqdm

        total, text_seen = 0, False
        dropped: collections.Counter[str] = collections.Counter()
        # disable=None: tqdm shows the bar on a terminal only (no bar in logs and CI).
        bar = tqdm(total=sum(sizes), unit="B", unit_scale=True, desc="cona data prepare", file=sys.stderr,
                   disable=None if progress is None else not progress)  # fmt: skip
        with bar, open(tmp, "wb") as f, ProcessPoolExecutor(workers, initializer=_init_worker,
                                                            initargs=(tokenizer_json, rest_json)) as pool:  # fmt: skip
            # Chunks are written in the order they are cut, so the file is the same for any number of workers; a few
            # per worker are in flight, so the text held is theirs, not the corpus's.
            pending: collections.deque[tuple[Future, bool, int]] = collections.deque()

            def write_next() -> None:
                nonlocal total
                _check_terminated()
                future, last, done = pending.popleft()
                ids, left_out = future.result()
                dropped.update(left_out)
                if len(ids) and int(ids.max()) >= vocab_size:  # never wrapped into other ids by the cast below
                    raise ValueError(f"--tokenizer {tokenizer_path}: encoded id {int(ids.max())}, beyond its vocabulary "
                                     f"of {vocab_size}")  # fmt: skip
                if last and eos_id is not None:
                    ids = np.append(ids, eos_id)
                f.write(ids.astype(dtype).tobytes())
                total += len(ids)
                bar.update(done - bar.n)

            try:
                for piece, first, last, done in _pieces(files, size, harmless):
                    text_seen = text_seen or not piece.isspace()
                    pending.append((pool.submit(_encode, (piece, first)), last, done))
                    if len(pending) >= 2 * workers:
                        write_next()
                while pending:
                    write_next()
            except (ValueError, OSError):
                raise
            except Exception as e:  # tokenizers raises a bare Exception for text it cannot encode (no unk token)
                line = (str(e).strip().splitlines() or [type(e).__name__])[-1]
                raise ValueError(f"--tokenizer {tokenizer_path}: cannot encode the text ({line}); give a tokenizer "
                                 "that covers every character (an unknown token or byte fallback)") from None  # fmt: skip
            if not text_seen:
                raise ValueError(empty)
            if dropped:
                # Ties by character: the counter's order follows set iteration, which string hashing randomizes.
                ranked = sorted(dropped.items(), key=lambda item: (-item[1], item[0]))[:DROPPED_SHOWN]
                shown = ", ".join(f"{c!r} ×{n:,}" for c, n in ranked)
                print(f"cona data prepare: warning: {sum(dropped.values()):,} characters of the text are in no token "
                      f"({len(dropped):,} distinct: {shown}): {tokenizer_path} has no unknown token or byte fallback "
                      "for them, so they are not in tokens.bin; give a tokenizer that covers them if they matter",
                      file=sys.stderr)  # fmt: skip
            f.flush()
            os.fsync(f.fileno())
        meta = {
            "tokenizer": str(tokenizer_path), "tokenizer_sha256": hashlib.sha256(raw).hexdigest(),
            "vocab_sha256": vocab_digest(settings), "vocab_size": vocab_size,
            "eos_id": eos_id, "token_dtype": np.dtype(dtype).name, "num_tokens": total, "documents": len(files),
            "dropped_characters": sum(dropped.values()),
            "inputs": [str(p) for p in files],
        }  # fmt: skip
        meta_tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        # The old tokens.json goes first: interrupted in between, --out holds a tokens.bin without one, which the
        # trainer refuses, never a token file beside the metadata of another (a uint32 file read as uint16).
        _check_terminated()  # the last moment a SIGTERM can still leave nothing behind
        meta_path.unlink(missing_ok=True)
        os.replace(tmp, target)
        os.replace(meta_tmp, meta_path)
    return meta


def _shown(paths: Path | Sequence[Path]) -> str:
    return str(paths) if isinstance(paths, Path) else " ".join(map(str, paths))


def _pieces(files: list[Path], size: int, harmless: Callable[[Text, int], bool]) -> Iterator[tuple[str, bool, bool, int]]:
    """(chunk, whether first of its document, whether last, bytes of the input files read so far), in order."""
    done = 0
    for path in files:
        with _Document(path) as document:
            held, first = None, True
            for piece in chunks(document.text, size, harmless):
                if held is not None:
                    yield held, first, False, done + document.position()
                    first = False
                held = piece
            document.finish()
        done += document.size
        if held is not None:
            yield held, first, True, done


def text_lines(files: list[Path]) -> Iterator[str]:
    """The lines of `files`, each with its "\n", read as `prepare` reads them (decompressed, UTF-8 without a byte
    order mark): what scripts/train_tokenizer.py trains on, so a tokenizer learns the text it will encode."""
    for path in files:
        with _Document(path) as document:
            for piece in chunks(document.text, _BLOCK):
                start = 0
                while start < len(piece):
                    end = piece.find("\n", start) + 1 or len(piece)
                    yield piece[start:end]
                    start = end
            document.finish()


def _compression(head: bytes) -> str | None:
    """What compressed a file, by its first bytes (none of them starts UTF-8 text, bzip2's block magic aside)."""
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if head.startswith(b"\xfd7zXZ\x00"):
        return "xz"
    if head[:3] == b"BZh" and head[3:4] in b"123456789" and head[4:10] in (b"1AY&SY", b"\x17rE8P\x90"):
        return "bzip2"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "zstd"
    return None


_OPENERS: dict[str, Callable[[IO[bytes]], IO[bytes]]] = {
    "gzip": lambda f: gzip.GzipFile(fileobj=f), "bzip2": bz2.BZ2File, "xz": lzma.LZMAFile,
}  # fmt: skip


def _open_text_bytes(path: Path, raw: IO[bytes]) -> tuple[IO[bytes], str | None]:
    """(the stream of `raw`'s text bytes, decompressed; the compression or None)."""
    kind = _compression(_read(path, raw, None, 10))
    raw.seek(0)
    if kind == "zstd":
        raise ValueError(f"{path}: zstd-compressed, which Python's standard library cannot read; decompress it first "
                         f"(zstd -d {path})")  # fmt: skip
    return (raw, None) if kind is None else (_OPENERS[kind](raw), kind)


def _read(path: Path, stream: IO[bytes], kind: str | None, size: int) -> bytes:
    # Named here: an OSError reaching `prepare` would be taken for a failed write under --out.
    try:
        return stream.read(size)
    except (OSError, EOFError, lzma.LZMAError) as e:  # damaged or cut short compressed data, a failing disk
        if kind is None:
            raise ValueError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
        raise ValueError(f"{path}: {kind} data that does not decompress ({e}); check the file") from None


def _open(path: Path) -> IO[bytes]:
    try:
        return open(path, "rb")
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e.strerror or e})") from None


def _not_text(path: Path, head: bytes, nul: int) -> ValueError:
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        return ValueError(f"{path}: UTF-16 text (it starts with a UTF-16 byte order mark); convert it to UTF-8, e.g. "
                          "with iconv -f UTF-16 -t UTF-8")  # fmt: skip
    return ValueError(f"{path}: a NUL byte at byte {nul:,} of its text, so not text (a binary file, or UTF-16 without a "
                      "byte order mark); leave it out of --input, or strip the NULs if it is text (tr -d '\\000')")  # fmt: skip


def check_text_file(path: Path) -> int:
    """The size of `path` on disk, once its first `_HEAD` bytes of text (decompressed) are no binary file, UTF-16 or
    zstd; ValueError else."""
    with _open(path) as raw:
        stream, kind = _open_text_bytes(path, raw)
        head = _read(path, stream, kind, _HEAD)
        nul = head.find(b"\x00")
        if nul >= 0 or head.startswith((b"\xff\xfe", b"\xfe\xff")):
            raise _not_text(path, head, nul)
        return os.fstat(raw.fileno()).st_size


class _Utf8:
    """UTF-8 to text a block at a time, as bytes.decode("utf-8", "replace") decodes the whole: each invalid sequence
    becomes one U+FFFD; counts them and keeps the first one's byte offset, for the warning."""

    def __init__(self) -> None:
        self._pending = b""  # the start of a character that the next block ends
        self._offset = 0  # of _pending in the file's text
        self.replaced = 0
        self.first_bad: int | None = None
        self.characters = 0

    def decode(self, data: bytes, final: bool) -> str:
        view = memoryview(self._pending + data)
        out, pos = [], 0
        while True:
            try:
                text, used = codecs.utf_8_decode(view[pos:], "strict", final)
            except UnicodeDecodeError as e:  # the valid text before it, one U+FFFD, and on after the bad bytes
                out += [codecs.utf_8_decode(view[pos : pos + e.start], "strict", True)[0], "\ufffd"]
                if self.first_bad is None:
                    self.first_bad = self._offset + pos + e.start
                self.replaced += 1
                pos += e.end
                continue
            out.append(text)
            pos += used
            break
        self._offset += pos
        self._pending = bytes(view[pos:])
        text = "".join(out)
        self.characters += len(text)
        return text


class _Document:
    """One input file read as text a block at a time (`text`): decompressed, UTF-8 without its byte order mark,
    refused on a NUL byte and when the file changes while it is read (`finish`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stack = contextlib.ExitStack()
        self._decoder = _Utf8()

    def __enter__(self) -> _Document:
        with self._stack:  # closed here only when opening fails, else by __exit__
            self._raw = self._stack.enter_context(_open(self.path))
            self._stat = os.fstat(self._raw.fileno())
            self.size = self._stat.st_size
            stream, self._kind = _open_text_bytes(self.path, self._raw)
            self._stream = self._stack.enter_context(contextlib.closing(stream)) if stream is not self._raw else stream
            self.text = Text(self._blocks())
            self._stack = self._stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def position(self) -> int:
        """Bytes of the file read so far (for the progress bar)."""
        return self._raw.tell()

    def _blocks(self) -> Iterator[str]:
        offset, head, begun = 0, b"", False
        while True:
            # No further than the size it had when opened: a file written to all along (a log) would be read for
            # ever; `finish` refuses one that changed.
            left = _BLOCK if self._kind else min(_BLOCK, self.size - offset)
            data = _read(self.path, self._stream, self._kind, left) if left else b""
            head = head or data[:_HEAD]
            nul = data.find(b"\x00")
            if nul >= 0:
                raise _not_text(self.path, head, offset + nul)
            text = self._decoder.decode(data, final=not data)
            if not begun and text:  # the byte order mark: the file's encoding, not its text
                text, begun = text.removeprefix("\ufeff"), True
            offset += len(data)
            if text:
                yield text
            if not data:
                return

    def finish(self) -> None:
        """ValueError when the file changed while it was read (its tokens would be of no one version of it); the
        warning for bytes that are not UTF-8."""
        now = os.fstat(self._raw.fileno())
        if (now.st_size, now.st_mtime_ns) != (self._stat.st_size, self._stat.st_mtime_ns):
            raise ValueError(f"{self.path}: changed while it was read; run cona data prepare again once nothing "
                             "writes to it")  # fmt: skip
        if self._decoder.replaced:
            print(f"cona data prepare: warning: {self.path}: not UTF-8 from byte {self._decoder.first_bad} on; "
                  f"{self._decoder.replaced:,} of {self._decoder.characters:,} characters replaced by U+FFFD (convert "
                  "the file to UTF-8, e.g. with iconv, to keep them)", file=sys.stderr)  # fmt: skip


def _rest_tokenizer(tokenizer_json: str) -> str:
    """`without_call_prefix`, or the tokenizer itself where that copy does not load (a field this version of
    tokenizers reads in some other form): then every cut shows the prefix, none is harmless, and each document is
    encoded in one piece, slower but right."""
    from tokenizers import Tokenizer

    stripped = without_call_prefix(tokenizer_json)
    try:
        Tokenizer.from_str(stripped)
    except Exception:  # tokenizers raises its own exception types
        return tokenizer_json
    return stripped


@contextlib.contextmanager
def _writing_to(out: Path, temporary: tuple[Path, ...], *, created: bool = False) -> Iterator[None]:
    """A write under --out that fails (no room, a read-only file system, a file where a directory belongs) as one
    line naming --out; whatever ends it (that, bad input found on the way, Ctrl-C), without its partial files: a
    corpus's worth of tokens.bin.tmp is no thing to leave behind. OSError's own text names no option, or no file.
    `created`: --out did not exist before, so it goes too when left empty (input found to hold only whitespace
    left an empty directory that looked like a prepared one)."""
    try:
        yield
    except BaseException as e:
        for path in temporary:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        if created:
            with contextlib.suppress(OSError):  # rmdir removes only an empty directory: nothing else is lost
                out.rmdir()
        if isinstance(e, OSError):
            raise ValueError(f"--out {out}: cannot write ({e.strerror or e}); give a writable directory with room "
                             "for the tokens") from None  # fmt: skip
        raise


class _Terminated(BaseException):  # not Exception: no handler of errors may take it for one
    """SIGTERM (a scheduler's or `kill`'s stop): raised in the main thread so that `_writing_to` removes the
    partial files, as for Ctrl-C; Python's default action for it ends the process with nothing cleaned up."""


_TERMINATED = threading.Event()
"""Set by `_terminate`: the raise alone can be lost where Python ignores exceptions (a SIGTERM that lands in an
at-fork hook, as a worker process starts, is printed as "Exception ignored" and the run went on to write tokens.bin)."""


def _terminate(signum: int, frame: Any) -> None:
    _TERMINATED.set()
    raise _Terminated


def _check_terminated() -> None:
    """Raise `_Terminated` for a SIGTERM whose own raise was swallowed (`_TERMINATED`)."""
    if _TERMINATED.is_set():
        raise _Terminated


def main(argv: list[str] | None = None) -> int:
    import signal

    args = parse_args(argv)
    _TERMINATED.clear()
    previous = signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() else None
    try:
        meta = prepare(args.tokenizer, args.input, args.out, eos=args.eos, workers=args.workers, chunk_mb=args.chunk_mb)
    except (OSError, ValueError) as e:
        print(f"cona: error: {e}", file=sys.stderr)
        return 2
    except _Terminated:
        print("cona data prepare: terminated; no partial tokens left", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(f"wrote {args.out / TOKENS_FILE}: {meta['num_tokens']:,} tokens ({meta['token_dtype']}) from "
          f"{meta['documents']} document(s), vocabulary {meta['vocab_size']:,}, EOS id {meta['eos_id']}; "
          f"train on it with data.path: {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
