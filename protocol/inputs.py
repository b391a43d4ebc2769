"""What the trainer reads besides the job — the corpus at `data.path` and the model directory of `model.init_from`
— checked without torch or numpy, in one place for both planes.

The trainer opens its corpus through `data_files` and `check_split` (`cona.trainer.data.load_corpus`) and checks
`model.init_from` with `check_init_from` before it starts its process group (`cona.trainer.main`); `cona run` and
`cona profile` call `check_inputs` — the same functions, on the files' sizes — before they create a run directory,
so an empty data file, a directory without text files, a `.bin` cut mid-token, a tokens.bin that disagrees with
its tokens.json (or has none), an evaluation set larger than the held-out split or a model directory without
config.json is refused before a run exists (a run's job is fixed once it does).

Every refusal is an `InputRefused`: one line naming the field or file, and in `fix` where the fix lies — a job
field (`FIX_JOB`: the run's job cannot change, so the fix is a new run with the corrected job), the files on disk
(`FIX_FILES`: fix them and resume the run), or either (`FIX_EITHER`). The trainer writes it into the exit record of
an attempt that refused its input (`ExitRecord.fix`), and the orchestrator's advice follows it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cona.protocol.rundir import FIX_EITHER, FIX_FILES, FIX_JOB, FIXES
from cona.protocol.yamlconfig import ConfigError

if TYPE_CHECKING:
    from cona.protocol.job import JobSpec

TOKEN_SUFFIXES = (".bin", ".npy")
"""Token files: raw `data.token_dtype` ids (`.bin`) or a NumPy array (`.npy`)."""
TEXT_SUFFIXES = (".txt", ".md", "")
"""The files of a directory that are read as text (the byte-level reader, `cona data prepare`), in any case."""
TOKENS_FILE = "tokens.bin"
TOKENS_META = "tokens.json"
"""What `cona data prepare` writes (`trainer.prepare`): the token file and its metadata, side by side."""
MODEL_CONFIG = "config.json"
"""A Hugging Face model directory's configuration (`trainer.hf`)."""
TOKENIZER_FILE = "tokenizer.json"
"""A Hugging Face tokenizer (the `tokenizers` library's JSON), alone or in a model directory."""
DEFAULT_TEXT_PATH = "data/shakespeare.txt"
"""`data.path`'s default: the Shakespeare corpus that `scripts/fetch_shakespeare.py` fetches."""

_ITEMSIZE = {"uint16": 2, "uint32": 4}


class InputRefused(ConfigError):
    """The trainer's input cannot be used: one line naming the field or file; `fix` says where the fix lies
    (`FIX_JOB`, `FIX_FILES` or `FIX_EITHER`)."""

    def __init__(self, message: str, *, fix: str = FIX_EITHER) -> None:
        super().__init__(message)
        self.fix = fix if fix in FIXES else FIX_EITHER


def fix_of(error: BaseException) -> str:
    """Where the fix of a refusal lies: an `InputRefused`'s `fix`, `FIX_EITHER` for any other error."""
    return error.fix if isinstance(error, InputRefused) else FIX_EITHER


def missing_data_hint(path: str) -> str:
    """What to do about a `data.path` that does not exist, by what it names: the default text corpus (fetch it),
    token data (a `.bin`/`.npy` file or a directory: tokenize a corpus with `cona data prepare`), another text file.
    Always also: point the job at data that exists."""
    other = "or give existing data with --set data.path=PATH"
    given = Path(path)
    if given.name == Path(DEFAULT_TEXT_PATH).name:
        return f"for the Shakespeare corpus run `python scripts/fetch_shakespeare.py {path}`, {other}"
    if given.suffix in TOKEN_SUFFIXES:
        return (f"tokenize a corpus with `cona data prepare --tokenizer TOKENIZER.json --input TEXT --out DIR` "
                f"(it writes DIR/{TOKENS_FILE}) and set data.path to DIR, {other}")  # fmt: skip
    if given.suffix == "":  # a directory (what `cona data prepare` writes), or a text file without a suffix
        return (f"tokenize a corpus into it with `cona data prepare --tokenizer TOKENIZER.json --input TEXT --out "
                f"{path}`, {other}")  # fmt: skip
    return "give an existing text file, directory of text files or token file with --set data.path=PATH"


def corpus_files(directory: Path, suffixes: tuple[str, ...], *, compressed: tuple[str, ...] = ()) -> tuple[list[Path], list[Path]]:
    """(the files of `directory` a reader takes, sorted by path; the entries it passes over, for a note), the one
    rule of the trainer's readers and `cona data prepare`: files at any depth whose suffix, in any case (README.TXT),
    is one of `suffixes`, or is after dropping one of `compressed` (`cona data prepare` reads a.txt.gz). Hidden
    files and everything under a hidden directory are left out, unlisted: a `.git` holds files without a suffix
    (its objects, compressed binaries) that are no corpus. A symbolic link to a file is read; one to a directory is
    passed over (a link back up would loop), and so is a broken link or anything else that is not a file."""
    taken: list[Path] = []
    passed: list[Path] = []
    # os.walk descends into no link to a directory; an unreadable directory is passed over, not silently skipped.
    for root, dirs, names in os.walk(directory, onerror=lambda e: passed.append(Path(e.filename))):
        base = Path(root)
        passed.extend(base / d for d in dirs if not d.startswith(".") and (base / d).is_symlink())
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if name.startswith("."):
                continue
            path = base / name
            suffix = path.suffix.lower()
            if suffix in compressed:
                suffix = Path(path.stem).suffix.lower()
            (taken if suffix in suffixes and path.is_file() else passed).append(path)
    return sorted(taken), sorted(passed)


@dataclasses.dataclass(frozen=True)
class DataFiles:
    """The files `data.path` names, as the trainer reads them (`data_files`)."""

    source: str
    """`data.path` as the job gives it (for messages)."""
    path: Path
    """The file or directory read: `data.path`, or the tokens.bin of a `cona data prepare` directory."""
    fmt: str
    """`tokens` or `bytes` (`data.format` with `auto` decided)."""
    token_dtype: str
    """The dtype of raw `.bin` ids: `data.token_dtype`, or tokens.json's."""
    files: tuple[Path, ...]
    """The files read, in order."""
    meta: dict[str, Any] | None
    """tokens.json of a `cona data prepare` output (`read_token_metadata`), or None."""

    def num_tokens(self) -> int | None:
        """The token count from the files' sizes; None when a `.npy` is among them (its header says, not its
        size)."""
        if self.fmt == "bytes":
            return sum(p.stat().st_size for p in self.files)
        if any(p.suffix.lower() == ".npy" for p in self.files):
            return None
        return sum(p.stat().st_size // _ITEMSIZE[self.token_dtype] for p in self.files)


def read_token_metadata(path: Path, job: JobSpec) -> dict[str, Any] | None:
    """The metadata `cona data prepare` wrote for `path` (its directory, or its tokens.bin), checked against the
    model: None when there is none; `InputRefused` when it is unreadable, says something impossible, or the model's
    vocabulary cannot hold the tokenizer's ids."""
    meta_path = (path if path.is_dir() else path.parent) / TOKENS_META
    if not meta_path.exists() or (path.is_file() and path.name != TOKENS_FILE):
        return None
    again = "run cona data prepare again"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise InputRefused(f"{meta_path}: unreadable ({e}); {again}", fix=FIX_FILES) from None
    if not isinstance(meta, dict):
        raise InputRefused(f"{meta_path}: not a JSON object; {again}", fix=FIX_FILES)
    vocab, dtype, count = meta.get("vocab_size"), meta.get("token_dtype"), meta.get("num_tokens", 0)
    for key, value in (("vocab_size", vocab), ("num_tokens", count)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (key == "vocab_size"):
            raise InputRefused(f"{meta_path}: {key} {value!r} is not a {'positive' if key == 'vocab_size' else 'whole'} "
                               f"number; {again}", fix=FIX_FILES)  # fmt: skip
    if dtype not in _ITEMSIZE:
        raise InputRefused(f"{meta_path}: token_dtype {dtype!r} is neither uint16 nor uint32; {again}", fix=FIX_FILES)
    if dtype == "uint16" and vocab > 2**16:  # its ids would have wrapped around: the tokens are not the text's
        raise InputRefused(f"{meta_path}: a vocabulary of {vocab} does not fit token_dtype uint16; {again}", fix=FIX_FILES)
    if job.model.family == "bert" and vocab >= job.model.vocab_size:
        # The mask id is vocab_size - 1: a token of the tokenizer there (`Ġhe`, 6,311 times in the corpus) would be
        # read as a mask, and masked positions as that token. (Byte-level text never holds 0xFF: no such clash.)
        raise InputRefused(
            f"model.vocab_size={job.model.vocab_size}: BERT masks with id vocab_size - 1, which must be no token of the "
            f"vocabulary of {vocab} that {meta_path.parent} was tokenized with; set model.vocab_size: {vocab + 1}",
            fix=FIX_JOB,
        )  # fmt: skip
    if vocab > job.model.vocab_size:
        raise InputRefused(
            f"model.vocab_size={job.model.vocab_size} is smaller than the vocabulary of {vocab} that {meta_path.parent} "
            f"was tokenized with (tokenizer {str(meta.get('tokenizer_sha256', '?'))[:12]}); set model.vocab_size: "
            f"{vocab}", fix=FIX_JOB,
        )  # fmt: skip
    return meta


def data_files(job: JobSpec) -> DataFiles:
    """The files `job.data.path` names, checked as far as their names and sizes tell: the path exists, a `cona
    data prepare` directory is whole, a directory holds files of the format, a raw `.bin` is a whole number of
    `data.token_dtype` ids, a byte-level corpus has a vocabulary of 256. Raises `InputRefused`."""
    spec = job.data
    path = Path(spec.path)
    if not path.exists():
        raise InputRefused(f"data.path {spec.path!r} does not exist; {missing_data_hint(spec.path)}")
    fmt, dtype = spec.format, spec.token_dtype
    meta = read_token_metadata(path, job)
    if meta is not None:  # a `cona data prepare` output: its tokens, in its dtype
        tokens = path / TOKENS_FILE if path.is_dir() else path
        if not tokens.exists():
            raise InputRefused(f"data.path {spec.path!r}: {TOKENS_META} but no {TOKENS_FILE}; run cona data prepare "
                               "again", fix=FIX_FILES)  # fmt: skip
        _check_prepared(tokens, meta)
        fmt, dtype, path = "tokens", str(meta["token_dtype"]), tokens
    elif path.name == TOKENS_FILE and fmt != "bytes" and "token_dtype" not in spec.model_fields_set:
        # What `cona data prepare` wrote, without the tokens.json that says its dtype: read as the default uint16,
        # uint32 ids would silently become other tokens.
        raise InputRefused(f"data.path {spec.path!r}: no {TOKENS_META} beside it, which says the dtype and vocabulary "
                           f"cona data prepare wrote it with; copy {TOKENS_META} along or run cona data prepare "
                           "again, or set data.token_dtype to read it as raw ids")  # fmt: skip
    if fmt == "auto":
        fmt = "tokens" if path.is_file() and path.suffix.lower() in TOKEN_SUFFIXES else "bytes"
    if path.is_dir():
        files, _ = corpus_files(path, TOKEN_SUFFIXES if fmt == "tokens" else TEXT_SUFFIXES)
        if not files and (path / TOKENS_FILE).is_file():  # a `cona data prepare` output that lost its tokens.json
            raise InputRefused(f"data.path {spec.path!r}: {TOKENS_FILE} but no {TOKENS_META}, which says the dtype and "
                               f"vocabulary cona data prepare wrote it with; run cona data prepare again, or set "
                               f"data.path to {path / TOKENS_FILE} and data.token_dtype to read it as raw ids")  # fmt: skip
        if not files:
            kind = f"token files ({', '.join(TOKEN_SUFFIXES)})" if fmt == "tokens" else "text files (.txt, .md, no suffix)"
            raise InputRefused(f"data.path {spec.path!r}: the directory holds no {kind}; put the corpus there, or "
                               "set data.path to a file or directory that holds it")  # fmt: skip
    else:
        files = [path]
        if fmt == "tokens" and path.suffix.lower() in (".txt", ".md"):
            # Text read as raw ids becomes ids far beyond the vocabulary: the trainer would refuse it only after
            # the run exists.
            raise InputRefused(f"data.path {spec.path!r} is a text file, but data.format is tokens (raw token ids); "
                               "set data.format: auto or bytes, or tokenize it with `cona data prepare`", fix=FIX_JOB)  # fmt: skip
    if fmt == "bytes" and job.model.vocab_size < 256:
        raise InputRefused(f"model.vocab_size={job.model.vocab_size}: a byte-level corpus needs at least 256; set "
                           "model.vocab_size: 256", fix=FIX_JOB)  # fmt: skip
    if fmt == "tokens":
        for file in files:
            size = file.stat().st_size
            if file.suffix.lower() != ".npy" and size % _ITEMSIZE[dtype]:
                raise InputRefused(f"{file}: size {size} is not a multiple of {_ITEMSIZE[dtype]} bytes; check "
                                   f"data.token_dtype (now {dtype}), or whether the file was cut short")  # fmt: skip
    return DataFiles(source=spec.path, path=path, fmt=fmt, token_dtype=dtype, files=tuple(files), meta=meta)


def _check_prepared(tokens: Path, meta: dict[str, Any]) -> None:
    """`InputRefused` unless `tokens` holds the `num_tokens` ids of `meta`'s dtype: a file cut short by a whole
    number of ids, or metadata of another tokenization (a copy of one beside the other's), would train on other
    tokens than prepared, or on ids read in the wrong width, without a word."""
    dtype, count = str(meta["token_dtype"]), meta.get("num_tokens")
    size = tokens.stat().st_size
    if count is not None and size != count * _ITEMSIZE[dtype]:
        raise InputRefused(f"{tokens}: {size} bytes, but {TOKENS_META} says {count} {dtype} ids ({count * _ITEMSIZE[dtype]} "
                           "bytes): cut short, or not the file it describes; run cona data prepare again",
                           fix=FIX_FILES)  # fmt: skip


def check_split(job: JobSpec, num_tokens: int, *, source: str) -> None:
    """`InputRefused` unless a corpus of `num_tokens` tokens splits into a training part of two sample windows and
    a held-out part of at least one, and the held-out part holds `eval.num_windows` windows side by side (more
    only overlap, and made the first evaluation run for hours)."""
    spec = job.data
    n_val = int(num_tokens * spec.val_fraction)
    window = job.model.seq_len + 1
    if num_tokens - n_val < 2 * window or n_val < window:
        raise InputRefused(f"data.path {source!r}: {num_tokens} tokens are too few for seq_len={job.model.seq_len} "
                           f"with val_fraction={spec.val_fraction}; use a larger corpus or a shorter model.seq_len")  # fmt: skip
    eval_window = job.model.seq_len if job.model.family == "bert" else window
    most = n_val // eval_window
    if job.eval.num_windows > most:
        raise InputRefused(
            f"eval.num_windows={job.eval.num_windows}: the held-out split of data.path {source!r} ({n_val} tokens, "
            f"data.val_fraction={spec.val_fraction}) holds {most} windows of {eval_window} tokens; set "
            f"eval.num_windows to at most {most}", fix=FIX_JOB,
        )  # fmt: skip


def check_init_from(job: JobSpec) -> None:
    """`InputRefused` unless `model.init_from` (when set) is a directory with a config.json that describes the job's
    model (`hfconfig.config_problem`): a mismatch is found before a job waits in a queue for it. The tensors are the
    trainer's to check (`trainer.hf.check_directory`)."""
    if job.model.init_from is None:
        return
    directory = Path(job.model.init_from)
    if not directory.is_dir():
        raise InputRefused(f"model.init_from {job.model.init_from!r}: no such directory; give a Hugging Face model "
                           f"directory ({MODEL_CONFIG} + model.safetensors)")  # fmt: skip
    if not (directory / MODEL_CONFIG).is_file():
        raise InputRefused(f"model.init_from {job.model.init_from!r}: no {MODEL_CONFIG} in it; give a Hugging Face "
                           f"model directory ({MODEL_CONFIG} + model.safetensors, as save_pretrained writes)")  # fmt: skip
    from cona.protocol.hfconfig import config_problem, read_config

    try:
        config = read_config(directory)
    except ValueError as e:  # unreadable, not JSON
        raise InputRefused(f"model.init_from: {e}", fix=FIX_FILES) from None
    problem = config_problem(job.model, config, source=str(directory / MODEL_CONFIG))
    if problem:  # the model section, or the directory it names
        raise InputRefused(f"model.init_from: {problem}", fix=FIX_EITHER)


def vocab_digest(tokenizer: Any) -> str | None:
    """sha256 of what a tokenizer.json's ids mean: its model's vocabulary (a mapping of token to id, or Unigram's
    list of [token, score] by id) with its added tokens, as sorted (id, token) pairs; None when it holds none of
    these. Two files of one vocabulary give one digest whatever else differs (a truncation setting, a newer
    `tokenizers`'s formatting), which a hash of the file's bytes does not."""
    model = tokenizer.get("model") if isinstance(tokenizer, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    meaning: dict[int, str] = {}
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel
        meaning.update((i, str(token)) for token, i in vocab.items() if isinstance(i, int))
    elif isinstance(vocab, list):  # Unigram
        meaning.update((i, str(e[0])) for i, e in enumerate(vocab) if isinstance(e, list) and e)
    else:
        return None
    for added in tokenizer.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            meaning[added["id"]] = str(added.get("content"))
    text = json.dumps(sorted(meaning.items()), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _file_vocab_digest(path: Path) -> str | None:
    """`vocab_digest` of a tokenizer.json file; None when it cannot be read as one."""
    try:
        return vocab_digest(json.loads(path.read_bytes().decode("utf-8-sig")))
    except (OSError, ValueError):
        return None


def check_tokenizer(job: JobSpec, files: DataFiles) -> None:
    """`InputRefused` when `model.init_from` holds a tokenizer.json whose vocabulary is not the one the data's ids
    come from: they would train the pretrained embeddings of other tokens, silently (a vocabulary size check cannot
    see it: GPT-2's 50,257 ids fit Llama's 128,256). Text read byte by byte (ids 0–255) is refused beside such a
    model; prepared data whose vocabulary differs too. Data prepared before the digest was recorded is judged by the
    tokenizer file it names, while that file is still the one it was (its sha256); raw token files are not judged."""
    if job.model.init_from is None:
        return
    model_tokenizer = Path(job.model.init_from) / TOKENIZER_FILE
    if not model_tokenizer.is_file():
        return
    if files.fmt == "bytes":
        raise InputRefused(
            f"data.path {job.data.path!r} is text, read byte by byte (ids 0-255), but model.init_from was trained "
            f"with {model_tokenizer}: tokenize the data with it first (`cona data prepare --tokenizer "
            f"{model_tokenizer} --input TEXT --out DIR`, then data.path: DIR)",
            fix=FIX_EITHER,
        )  # fmt: skip
    meta = files.meta
    if meta is None:
        return
    theirs = meta.get("vocab_sha256")
    if not isinstance(theirs, str):
        used = Path(str(meta.get("tokenizer", "")))
        used = used / TOKENIZER_FILE if used.is_dir() else used
        try:
            same_file = hashlib.sha256(used.read_bytes()).hexdigest() == meta.get("tokenizer_sha256")
        except OSError:
            return
        theirs = _file_vocab_digest(used) if same_file else None
    mine = _file_vocab_digest(model_tokenizer)
    if theirs is None or mine is None or theirs == mine:
        return
    raise InputRefused(
        f"data.path {job.data.path!r} was tokenized with another vocabulary than {model_tokenizer} (the model of "
        f"model.init_from): its ids would mean other tokens to the pretrained weights; prepare the data with `cona "
        f"data prepare --tokenizer {model_tokenizer} ...`, or start from a model of that tokenizer",
        fix=FIX_EITHER,
    )


def check_inputs(job: JobSpec, *, source: str | None = None) -> None:
    """What can be checked of the trainer's input without reading it (`data_files`, `check_split` on the files'
    sizes, `check_init_from`, `check_tokenizer`), for a run before it is created; `source` (the job file) heads the message.
    Raises `InputRefused`."""
    try:
        files = data_files(job)
        count = files.num_tokens()
        if count is not None:
            check_split(job, count, source=files.source)
        check_init_from(job)
        check_tokenizer(job, files)
    except InputRefused as e:
        if source is None:
            raise
        raise InputRefused(f"{source}: {e}", fix=e.fix) from None
