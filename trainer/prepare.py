"""`cona data prepare --tokenizer tokenizer.json --input TEXT_FILE_OR_DIR --out DIR`: text to the token file the
trainer reads.

The `cona` command line runs this module as a program (`python -m cona.trainer.prepare`): it is the data plane's
tool, and needs Hugging Face `tokenizers` (`pip install cona[data]`), not torch. It writes

    DIR/tokens.bin    every document's token ids back to back, each followed by the EOS id when the tokenizer has
                      one; raw uint16 when the vocabulary fits (≤ 65,536 ids), else uint32
    DIR/tokens.json   {"tokenizer_sha256", "vocab_size", "eos_id", "token_dtype", "num_tokens", "documents",
                      "tokenizer", "inputs"}: the trainer reads the dtype from it and refuses a model whose
                      vocabulary is smaller than the tokenizer's (`trainer.data.read_token_metadata`)

and `data.path: DIR` trains on it. A document is one input file (a directory's `.txt`/`.md` files and files without
a suffix, sorted, as the byte-level reader takes them). Files are cut into chunks of about `--chunk-mb` at line
ends and the chunks are tokenized by `--workers` processes (a progress bar on a terminal); the chunks depend only
on the text, so the output is the same for any number of workers.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from cona.trainer.data import TEXT_SUFFIXES, TOKENS_FILE, TOKENS_META

EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[SEP]")
"""Tokens tried, in order, as the end-of-document token when --eos is not given."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"cona: error: {message} (see cona data prepare --help)", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="cona data", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    prepare = sub.add_parser("prepare", help="tokenize text files into DIR/tokens.bin and DIR/tokens.json",
                             description=__doc__.split("\n\n")[0], allow_abbrev=False)  # fmt: skip
    prepare.error = parser.error  # type: ignore[method-assign]  # one line, exit 2, as the rest of cona
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


def chunks(text: str, size: int) -> Iterator[str]:
    """`text` cut after a line end near every `size` characters (the whole rest when there is none)."""
    start = 0
    while start < len(text):
        cut = text.find("\n", start + size)
        end = len(text) if cut < 0 else cut + 1
        yield text[start:end]
        start = end


_TOKENIZER: Any = None


def _init_worker(tokenizer_json: str) -> None:
    global _TOKENIZER
    from tokenizers import Tokenizer

    _TOKENIZER = Tokenizer.from_str(tokenizer_json)


def _encode(text: str) -> np.ndarray:
    # No special tokens added per chunk (a chunk is not a document); EOS is appended per document by the caller.
    return np.asarray(_TOKENIZER.encode(text, add_special_tokens=False).ids, dtype=np.int64)


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
        tasks = [(k, piece) for k, text in enumerate(texts) for piece in chunks(text, size)]
        last_of_document = {k: i for i, (k, _) in enumerate(tasks)}  # a document's EOS follows its last chunk
        ends = set(last_of_document.values())
        from tqdm import tqdm

        total = 0
        # disable=None: tqdm shows the bar on a terminal only (no bar in logs and CI).
        bar = tqdm(total=len(tasks), unit="chunk", desc="cona data prepare", file=sys.stderr,
                   disable=None if progress is None else not progress)  # fmt: skip
        with open(tmp, "wb") as f, ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(raw.decode(),)) as pool:
            # map keeps the order of the chunks, so the file is the same for any number of workers.
            for i, ids in enumerate(pool.map(_encode, [piece for _, piece in tasks], chunksize=1)):
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
