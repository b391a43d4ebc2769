"""`cona data prepare --tokenizer tokenizer.json --input TEXT_FILE_OR_DIR --out DIR`: text to the token file the
trainer reads.

The `cona` command line runs this module as a program (`python -m cona.trainer.prepare`): it is the data plane's
tool, and needs Hugging Face `tokenizers` (`pip install cona[data]`), not torch. It writes

    DIR/tokens.bin    every document's token ids back to back, each followed by the EOS id when the tokenizer has
                      one; raw uint16 when the vocabulary fits (≤ 65,536 ids), else uint32
    DIR/tokens.json   {"tokenizer_sha256", "vocab_size", "eos_id", "token_dtype", "num_tokens", "documents",
                      "tokenizer", "inputs"}: the trainer reads the dtype from it and refuses a model whose
                      vocabulary is smaller than the tokenizer's (`cona.protocol.inputs.read_token_metadata`)

and `data.path: DIR` trains on it. A document is one input file (a directory's `.txt`/`.md` files and files without
a suffix, sorted, as the byte-level reader takes them). Files are cut into chunks of about `--chunk-mb` and the
chunks are tokenized by `--workers` processes (a progress bar on a terminal). The tokens are those of each document
encoded whole, whatever `--workers` and `--chunk-mb`:

- A tokenizer may add a prefix on every encode call (ByteLevel's `add_prefix_space`, Metaspace's `prepend_scheme`
  `always` or `first`, a `Prepend` normalizer): inside a document it would insert a space at every chunk. A
  document's first chunk is encoded with the tokenizer as it is, the others with a copy without that prefix
  (`without_call_prefix`).
- Tokens can depend on the text across a cut (GPT-2's pre-tokenizer groups `"  \n"` differently at the end of a
  text than before a letter; `"\n\n\n"` cut after its first line end encodes as three newlines instead of two
  tokens). A chunk ends at the first line end past `--chunk-mb` where cutting changes no token: the text around the
  cut (`_CONTEXT` characters each side) encodes the same whole as in two parts (`harmless_cut`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from cona.protocol.cliargs import OptionParser
from cona.trainer.data import TEXT_SUFFIXES, TOKENS_FILE, TOKENS_META

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
"""Tokens tried, in order, as the end-of-document token when --eos is not given."""


class _Parser(OptionParser):
    def fail(self, message: str) -> NoReturn:  # one line, exit 2, as the rest of cona
        print(f"cona: error: {message} (see cona data prepare --help)", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="cona data", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    prepare = sub.add_parser("prepare", help="tokenize text files into DIR/tokens.bin and DIR/tokens.json",
                             description=__doc__.split("\n\n")[0], allow_abbrev=False)  # fmt: skip
    prepare.add_argument("--tokenizer", required=True, type=Path, metavar="tokenizer.json",
                         help="a Hugging Face tokenizers file (what tokenizer.save() or save_pretrained writes)")  # fmt: skip
    prepare.add_argument("--input", required=True, type=Path, metavar="TEXT_FILE_OR_DIR", help="a text file or a directory of them")
    prepare.add_argument("--out", required=True, type=Path, metavar="DIR", help="where tokens.bin and tokens.json go")
    prepare.add_argument("--eos", metavar="TOKEN", help=f"end-of-document token (default: the first of {', '.join(EOS_CANDIDATES)} "
                         "the tokenizer knows; none if it knows none)")  # fmt: skip
    prepare.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes (default: all cores)")
    prepare.add_argument("--chunk-mb", type=float, default=1.0, help="text per task, in MB (default 1)")
    return parser.parse_args(argv)


def input_files(path: Path) -> list[Path]:
    """The documents under `path`: the file itself, or a directory's text files sorted by path."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"--input {path}: no such file or directory")
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".") and p.suffix in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"--input {path}: the directory holds no text files ({', '.join(s or 'no suffix' for s in TEXT_SUFFIXES)})")
    return files


_CONTEXT = 1000
"""Characters each side of a cut that `harmless_cut` encodes: far more than a pre-token spans in text."""
_TRIES = 64
"""Line ends tried in a row before skipping a chunk's length further, so a tokenizer for which no cut is harmless
(a `Strip` normalizer) costs a bounded number of checks per chunk rather than one per line."""


def chunks(text: str, size: int, harmless: Callable[[str, int], bool] | None = None) -> Iterator[str]:
    """`text` cut after a line end near every `size` characters (the whole rest when there is none): the first line
    end from there where `harmless(text, cut)` holds (every one when `harmless` is None)."""
    start = 0
    while start < len(text):
        end = _cut(text, start + size, size, harmless)
        yield text[start:end]
        start = end


def _cut(text: str, at: int, size: int, harmless: Callable[[str, int], bool] | None) -> int:
    tried = 0
    while True:
        line_end = text.find("\n", at)
        if line_end < 0 or line_end + 1 == len(text):
            return len(text)
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


def harmless_cut(first: Any, rest: Any) -> Callable[[str, int], bool]:
    """Whether cutting `text` at `cut` leaves the tokens as they are: the text around it encodes the same whole as
    in two parts, the part after the cut as a chunk after the first is (by `rest`; by `first` what starts at the
    document's start, as its first chunk is)."""

    def ids(tokenizer: Any, text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    def check(text: str, cut: int) -> bool:
        begin = max(0, cut - _CONTEXT)
        before = first if begin == 0 else rest
        left, right = text[begin:cut], text[cut : cut + _CONTEXT]
        return ids(before, left + right) == ids(before, left) + ids(rest, right)

    return check


_TOKENIZERS: tuple[Any, Any] | None = None


def _init_worker(first_json: str, rest_json: str) -> None:
    global _TOKENIZERS
    from tokenizers import Tokenizer

    _TOKENIZERS = (Tokenizer.from_str(first_json), Tokenizer.from_str(rest_json))


def _encode(task: tuple[str, bool]) -> np.ndarray:
    # No special tokens added per chunk (a chunk is not a document); EOS is appended per document by the caller.
    # Only a document's first chunk takes the prefix the tokenizer adds per call, as the whole document's encode does.
    text, first = task
    assert _TOKENIZERS is not None
    tokenizer = _TOKENIZERS[0] if first else _TOKENIZERS[1]
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)


def prepare(tokenizer_path: Path, input_path: Path, out: Path, *, eos: str | None = None, workers: int = 1,
            chunk_mb: float = 1.0, progress: bool | None = None) -> dict[str, Any]:  # fmt: skip
    """Tokenize `input_path` into `out` (see the module); returns the metadata written. ValueError on bad input."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("cona data prepare needs Hugging Face tokenizers: pip install 'cona[data]'") from None
    if workers < 1 or chunk_mb <= 0:
        raise ValueError("--workers must be at least 1 and --chunk-mb positive")
    try:
        raw = tokenizer_path.read_bytes()
        tokenizer = Tokenizer.from_str(raw.decode())
    except FileNotFoundError:
        raise ValueError(f"--tokenizer {tokenizer_path}: no such file") from None
    except Exception as e:  # tokenizers raises its own exception types for a malformed file
        raise ValueError(f"--tokenizer {tokenizer_path}: not a tokenizers JSON file ({str(e).splitlines()[0]})") from None
    files = input_files(input_path)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if eos is not None:
        eos_id = tokenizer.token_to_id(eos)
        if eos_id is None:
            raise ValueError(f"--eos {eos!r}: not a token of {tokenizer_path}")
    else:
        eos_id = next((i for i in map(tokenizer.token_to_id, EOS_CANDIDATES) if i is not None), None)
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: a file, not a directory; give a directory for {TOKENS_FILE} and {TOKENS_META}")
    texts = [_read_text(path) for path in files]
    if not any(t.strip() for t in texts):
        raise ValueError(f"{input_path}: no text to tokenize (the input is empty); check the --input path")
    target = out / TOKENS_FILE
    tmp = target.with_suffix(".bin.tmp")
    with _writing_to(out, tmp):
        out.mkdir(parents=True, exist_ok=True)
        size = max(1, int(chunk_mb * 1e6))
        rest_json = _rest_tokenizer(raw.decode())
        harmless = harmless_cut(tokenizer, Tokenizer.from_str(rest_json))
        tasks = [(k, piece) for k, text in enumerate(texts) for piece in chunks(text, size, harmless)]
        last_of_document = {k: i for i, (k, _) in enumerate(tasks)}  # a document's EOS follows its last chunk
        ends = set(last_of_document.values())
        firsts = {i for i, (k, _) in enumerate(tasks) if i == 0 or tasks[i - 1][0] != k}
        from tqdm import tqdm

        total = 0
        # disable=None: tqdm shows the bar on a terminal only (no bar in logs and CI).
        bar = tqdm(total=len(tasks), unit="chunk", desc="cona data prepare", file=sys.stderr,
                   disable=None if progress is None else not progress)  # fmt: skip
        with open(tmp, "wb") as f, ProcessPoolExecutor(workers, initializer=_init_worker,
                                                       initargs=(raw.decode(), rest_json)) as pool:  # fmt: skip
            # map keeps the order of the chunks, so the file is the same for any number of workers.
            work = [(piece, i in firsts) for i, (_, piece) in enumerate(tasks)]
            for i, ids in enumerate(pool.map(_encode, work, chunksize=1)):
                if i in ends and eos_id is not None:
                    ids = np.append(ids, eos_id)
                f.write(ids.astype(dtype).tobytes())
                total += len(ids)
                bar.update(1)
            f.flush()
            os.fsync(f.fileno())
        bar.close()
        os.replace(tmp, target)
        meta = {
            "tokenizer": str(tokenizer_path), "tokenizer_sha256": hashlib.sha256(raw).hexdigest(), "vocab_size": vocab_size,
            "eos_id": eos_id, "token_dtype": np.dtype(dtype).name, "num_tokens": total, "documents": len(files),
            "inputs": [str(p) for p in files],
        }  # fmt: skip
        (out / TOKENS_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return meta


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
def _writing_to(out: Path, tmp: Path) -> Iterator[None]:
    """A write under --out that fails (no room, a read-only file system, a file where a directory belongs) as one
    line naming --out, without its partial token file: OSError's own text names no option, or no file at all."""
    try:
        yield
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise ValueError(f"--out {out}: cannot write ({e.strerror or e}); give a writable directory with room for "
                         "the tokens") from None  # fmt: skip


def _read_text(path: Path) -> str:
    """The file as UTF-8 text; bytes that are not UTF-8 become U+FFFD, and how many is said on stderr (a corpus with
    a few stray bytes is still worth training on; a binary file given by mistake shows up as mostly replaced)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        text = data.decode("utf-8", errors="replace")
        bad = text.count("\ufffd")
        print(f"cona data prepare: warning: {path}: not UTF-8 from byte {e.start} on; {bad:,} of {len(text):,} "
              "characters replaced by U+FFFD (convert the file to UTF-8, e.g. with iconv, to keep them)",
              file=sys.stderr)  # fmt: skip
        return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        meta = prepare(args.tokenizer, args.input, args.out, eos=args.eos, workers=args.workers, chunk_mb=args.chunk_mb)
    except (OSError, ValueError) as e:
        print(f"cona: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out / TOKENS_FILE}: {meta['num_tokens']:,} tokens ({meta['token_dtype']}) from "
          f"{meta['documents']} document(s), vocabulary {meta['vocab_size']:,}, EOS id {meta['eos_id']}; "
          f"train on it with data.path: {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
