"""`cona data prepare` and the trainer's readers on the inputs a user's own corpus brings, found by a bug hunt: a byte
order mark, compressed files, binary files and UTF-16, a directory's hidden, upper-case and linked entries, several
inputs and globs, a model directory or a sentencepiece model as the tokenizer, a vocabulary with holes, whitespace
runs longer than the text a cut is checked on, a file read a block at a time, a file that changes while it is read,
a replaced or interrupted --out, and a prepared directory whose tokens.bin and tokens.json disagree.

Tiny inputs and one tiny tokenizer: no trainer process.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cona.protocol.inputs import FIX_FILES, InputRefused, check_inputs, data_files
from cona.protocol.job import job_from_dict
from cona.trainer import prepare as prep

try:
    from tests.trainer_helpers import REPO, corpus_path
except ImportError:  # tests/ is not a package here
    from trainer_helpers import REPO, corpus_path

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n" * 40


def _bpe(text: str, vocab: int = 300, eos: str = "<|endoftext|>", *, lines: bool = True) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(text.splitlines(keepends=True) if lines else [text], trainer=trainer)
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    _bpe(corpus_path().read_text()[:50_000]).save(str(path))
    return path


def _tokens(tokenizer: Path, inputs: Path | list[Path], out: Path, **kw) -> list[int]:
    meta = prep.prepare(tokenizer, inputs, out, workers=kw.pop("workers", 1), progress=False, **kw)
    return np.fromfile(out / "tokens.bin", dtype=meta["token_dtype"]).tolist()


def _error(argv: list[str], capsys) -> str:
    """The one line `cona data prepare ARGV` ends in, with exit status 2."""
    try:
        status = prep.main(["prepare", *argv])
    except SystemExit as e:  # argparse's errors
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_a_byte_order_mark_is_no_token(tmp_path, tokenizer_path):
    """A file saved "UTF-8 with BOM" (Notepad) began its document with the three byte tokens of U+FEFF."""
    (tmp_path / "plain.txt").write_text(TEXT)
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf" + TEXT.encode())
    assert _tokens(tokenizer_path, tmp_path / "bom.txt", tmp_path / "a") == _tokens(tokenizer_path, tmp_path / "plain.txt", tmp_path / "b")


def test_compressed_files_are_read_as_their_text_and_zstd_is_refused(tmp_path, tokenizer_path, capsys):
    """A .gz was tokenized as its compressed bytes (a warning that some were not UTF-8, then garbage tokens)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(TEXT)
    expected = _tokens(tokenizer_path, docs / "a.txt", tmp_path / "plain")
    for name, compress in (("a.txt.gz", gzip.compress), ("b.txt.bz2", bz2.compress), ("c.xz", lzma.compress)):
        (tmp_path / name).write_bytes(compress(TEXT.encode()))
        assert _tokens(tokenizer_path, tmp_path / name, tmp_path / f"out-{name}") == expected, name
    (docs / "a.txt.gz").write_bytes(gzip.compress(TEXT.encode()))  # a directory's compressed text is a document
    assert _tokens(tokenizer_path, docs, tmp_path / "dir") == expected * 2
    (tmp_path / "d.txt.zst").write_bytes(b"\x28\xb5\x2f\xfd" + bytes(20))
    err = _error(["--tokenizer", str(tokenizer_path), "--input", str(tmp_path / "d.txt.zst"), "--out", str(tmp_path / "z")], capsys)
    assert "d.txt.zst: zstd-compressed" in err and "zstd -d" in err
    (tmp_path / "cut.gz").write_bytes(gzip.compress(TEXT.encode())[:-20])
    err = _error(["--tokenizer", str(tokenizer_path), "--input", str(tmp_path / "cut.gz"), "--out", str(tmp_path / "c")], capsys)
    assert "cut.gz: gzip data that does not decompress" in err


def test_binary_files_and_utf16_are_refused_before_anything_is_written(tmp_path, tokenizer_path, capsys):
    """An executable without a suffix in a corpus directory, or a UTF-16 file, became tokens with at most a warning
    that a few bytes were not UTF-8 (NUL bytes are valid UTF-8)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(TEXT)
    (docs / "tool").write_bytes(b"\x7fELF\x02\x01\x01" + bytes(64) + b"text")
    (tmp_path / "utf16.txt").write_bytes(TEXT.encode("utf-16"))  # with its byte order mark
    (tmp_path / "utf16le.txt").write_bytes(TEXT.encode("utf-16-le"))
    for given, expected in [
        (docs, "tool: a NUL byte at byte 7 of its text, so not text"),
        (tmp_path / "utf16.txt", "utf16.txt: UTF-16 text (it starts with a UTF-16 byte order mark); convert it to UTF-8"),
        (tmp_path / "utf16le.txt", "utf16le.txt: a NUL byte at byte 1 of its text"),
    ]:
        out = tmp_path / f"out-{given.name}"
        assert expected in _error(["--tokenizer", str(tokenizer_path), "--input", str(given), "--out", str(out)], capsys)
        assert not out.exists()


def test_a_directory_is_read_as_the_byte_level_reader_reads_it(tmp_path, tokenizer_path, capsys):
    """A `.git` inside a corpus directory was read (its suffix-less files, compressed objects among them), README.TXT
    was passed over without a word, and so were a link to a directory and a file of another suffix."""
    docs = tmp_path / "docs"
    (docs / ".git" / "objects").mkdir(parents=True)
    (docs / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (docs / ".git" / "objects" / "ab12").write_text("blob\n")
    (docs / "sub").mkdir()
    (docs / "README.TXT").write_text("read me\n")
    (docs / "sub" / "b.md").write_text("bee\n")
    (docs / "notes.csv").write_text("a,b\n")
    (docs / ".hidden.txt").write_text("hidden\n")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "c.txt").write_text("sea\n")
    (docs / "linked").symlink_to(tmp_path / "elsewhere")
    expected = [docs / "README.TXT", docs / "sub" / "b.md"]
    meta = prep.prepare(tokenizer_path, docs, tmp_path / "out", progress=False)
    assert meta["inputs"] == [str(p) for p in expected]
    err = capsys.readouterr().err
    assert f"note: {docs}: passed over 2 entries" in err and "linked" in err and "notes.csv" in err, err
    # The trainer's byte-level reader takes the same files.
    job = job_from_dict({"model": {"preset": "tiny-gpt"}, "data": {"path": str(docs)}})
    assert list(data_files(job).files) == expected


def test_several_inputs_and_globs(tmp_path, tokenizer_path, capsys):
    """An unquoted glob (`--input corpus/*.txt`) ended in `unrecognized arguments: corpus/b.txt`, a quoted one in
    `no such file or directory`."""
    docs, outs = tmp_path / "docs", tmp_path / "outs"
    docs.mkdir()
    for name in ("a.txt", "b.txt", "c.md"):
        (docs / name).write_text(f"{name}\n" + TEXT)
    one = {name: _tokens(tokenizer_path, docs / name, outs / name) for name in ("a.txt", "b.txt")}
    both = one["a.txt"] + one["b.txt"]
    assert _tokens(tokenizer_path, [docs / "a.txt", docs / "b.txt"], outs / "two") == both
    assert prep.main(["prepare", "--tokenizer", str(tokenizer_path), "--input", str(docs / "a.txt"),
                      str(docs / "b.txt"), "--out", str(outs / "cli"), "--workers", "1"]) == 0  # fmt: skip
    assert np.fromfile(outs / "cli" / "tokens.bin", dtype=np.uint16).tolist() == both
    assert _tokens(tokenizer_path, [docs / "*.txt"], outs / "glob") == both
    tmp_path = docs
    args = ["--tokenizer", str(tokenizer_path), "--out", str(outs / "x"), "--input"]
    assert _error([*args, str(tmp_path / "*.rst")], capsys).endswith("*.rst: no file matches")
    assert "a.txt is named twice; give each file once" in _error([*args, str(tmp_path / "a.txt"), str(tmp_path / "*.txt")], capsys)


def test_a_model_directory_as_tokenizer_and_a_sentencepiece_model(tmp_path, tokenizer_path, capsys):
    """`--tokenizer MODEL_DIR` said `not a tokenizers JSON file ([Errno 21] Is a directory)`, a sentencepiece .model
    `not a tokenizers JSON file ('utf-8' codec can't decode byte ...)`; an EOS known only to tokenizer_config.json
    (DeepSeek's `<｜end▁of▁sentence｜>`) was none, and the documents ran together."""
    model = tmp_path / "model"
    model.mkdir()
    eos = "<｜end▁of▁sentence｜>"  # its only special token: none of the EOS candidates
    _bpe(corpus_path().read_text()[:20_000], eos=eos).save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": eos}}))
    (tmp_path / "a.txt").write_text(TEXT)
    meta = prep.prepare(model, tmp_path / "a.txt", tmp_path / "out", progress=False)
    assert meta["eos_id"] == 0 and meta["vocab_size"] == 300
    (tmp_path / "spiece.model").write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02\xff\xfe")
    err = _error(["--tokenizer", str(tmp_path / "spiece.model"), "--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "x")], capsys)
    assert "a binary file (a sentencepiece .model?), not a tokenizers JSON file" in err and "save_pretrained" in err
    err = _error(["--tokenizer", str(tmp_path), "--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "x")], capsys)
    assert f"--tokenizer {tmp_path}: no tokenizer.json in the directory" in err
    err = _error(["--tokenizer", str(tokenizer_path), "--input", str(tmp_path / "a.txt"), "--out", str(tmp_path / "x"),
                  "--eos", "<|endoftxt|>"], capsys)  # fmt: skip
    assert err.endswith("not a token of " + str(tokenizer_path) + "; its special tokens include '<|endoftext|>'")


def test_a_vocabulary_with_holes_is_sized_by_its_largest_id(tmp_path):
    """Four tokens with ids up to 70,000: counted as a vocabulary of 4, written as uint16, id 70,000 became 4,464."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "the": 1, "<|endoftext|>": 2, "and": 70_000}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("the and other " * 100)
    meta = prep.prepare(tmp_path / "tokenizer.json", tmp_path / "a.txt", tmp_path / "out", progress=False)
    assert (meta["vocab_size"], meta["token_dtype"]) == (70_001, "uint32")
    assert np.fromfile(tmp_path / "out" / "tokens.bin", dtype=np.uint32).tolist() == [1, 70_000, 0] * 100 + [2]
    job = job_from_dict({"model": {"preset": "tiny-gpt", "vocab_size": 70_001}, "data": {"path": str(tmp_path / "out")},
                         "eval": {"num_windows": 1}})  # fmt: skip
    assert data_files(job).token_dtype == "uint32"


def test_a_whitespace_run_longer_than_the_checked_text_is_not_cut(tmp_path):
    """3,001 newlines: cut a few before their end, the 1,000 characters each side that were checked looked like
    any run of newlines, and the tokens differed from the document's encoded whole."""
    base = corpus_path().read_text()[:5_000]
    rng = random.Random(0)
    runs = "".join(base[i : i + 200] + "\n" * rng.randint(1, 40) + " " * rng.randint(0, 30) for i in range(0, 5_000, 200))
    tokenizer = _bpe(runs * 20, vocab=350, lines=False)  # trained across lines: merges of 2, 4, 8 and 16 newlines
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    text = base + "\n" * 3_001 + base
    (tmp_path / "a.txt").write_text(text)
    whole = [*tokenizer.encode(text, add_special_tokens=False).ids, 0]
    assert _tokens(tmp_path / "tokenizer.json", tmp_path / "a.txt", tmp_path / "out", chunk_mb=1e-6) == whole


def test_a_file_read_a_block_at_a_time_gives_the_tokens_of_its_whole_text(tmp_path, tokenizer_path, monkeypatch):
    """Blocks of 1 and 7 bytes split multi-byte characters, CRLF, the byte order mark and bad bytes between reads."""
    rng = random.Random(0)
    pieces = ["to be ", "\r\n", "\n\n", "é", "日本", "😀", "  \n", "\udcff", "\udcc3"]
    text = "\ufeff" + "".join(rng.choice(pieces) for _ in range(3_000))
    (tmp_path / "a.txt").write_bytes(text.encode("utf-8", "surrogateescape"))
    expected = _tokens(tokenizer_path, tmp_path / "a.txt", tmp_path / "whole", chunk_mb=1e-4)
    for block in (7, 1):
        monkeypatch.setattr(prep, "_BLOCK", block)
        assert _tokens(tokenizer_path, tmp_path / "a.txt", tmp_path / f"out-{block}", chunk_mb=1e-4) == expected
    # ... and those bytes.decode("utf-8", "replace") gives, the first bad byte's offset in the warning.
    data = (tmp_path / "a.txt").read_bytes()
    decoder = prep._Utf8()
    got = "".join(decoder.decode(data[i : i + 3], final=False) for i in range(0, len(data), 3)) + decoder.decode(b"", True)
    assert got == data.decode("utf-8", "replace")
    with pytest.raises(UnicodeDecodeError) as bad:
        data.decode("utf-8")
    assert decoder.first_bad == bad.value.start


def test_a_file_that_changes_while_it_is_read_is_refused(tmp_path, tokenizer_path, monkeypatch):
    (tmp_path / "a.txt").write_text(TEXT)
    read = prep._read

    def appending(path, stream, kind, size):
        data = read(path, stream, kind, size)
        with open(path, "a") as f:  # another program still writing the corpus, after every read
            f.write("more\n")
        return data

    monkeypatch.setattr(prep, "_read", appending)
    with pytest.raises(ValueError, match=r"a\.txt: changed while it was read; run cona data prepare again"):
        prep.prepare(tokenizer_path, tmp_path / "a.txt", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # nothing partial, and the --out it created goes with it


def test_an_out_is_replaced_whole_or_left_as_it_was(tmp_path, tokenizer_path, monkeypatch):
    """Ctrl-C while writing left a corpus's worth of tokens.bin.tmp behind (only OSError cleaned up)."""
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text(TEXT * 2)
    out = tmp_path / "out"
    first = _tokens(tokenizer_path, tmp_path / "a.txt", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(prep.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare(tokenizer_path, tmp_path / "b.txt", out, workers=1, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    monkeypatch.undo()
    assert _tokens(tokenizer_path, tmp_path / "b.txt", out) == first[:-1] * 2 + first[-1:]
    assert sorted(p.name for p in out.iterdir()) == ["tokens.bin", "tokens.json"]


def test_odd_options_are_one_line(tmp_path, tokenizer_path, capsys):
    (tmp_path / "blank.txt").write_text(" \n\t\n")
    (tmp_path / "a.txt").write_text(TEXT)
    args = ["--tokenizer", str(tokenizer_path), "--out", str(tmp_path / "out"), "--input"]
    assert "the input is empty or only whitespace" in _error([*args, str(tmp_path / "blank.txt")], capsys)
    for chunk in ("inf", "nan", "0"):
        assert f"--chunk-mb {chunk}: give a positive, finite size in MB" in _error(
            [*args, str(tmp_path / "a.txt"), "--chunk-mb", chunk], capsys)
    assert "--workers 0: give at least 1 tokenizing process" in _error([*args, str(tmp_path / "a.txt"), "--workers", "0"],
                                                                      capsys)  # fmt: skip


def _job(path: Path, **data) -> object:
    return job_from_dict({"model": {"preset": "tiny-gpt", "vocab_size": 300}, "data": {"path": str(path), **data},
                          "eval": {"num_windows": 1}})  # fmt: skip


def _refusal(job) -> InputRefused:
    with pytest.raises(InputRefused) as info:
        check_inputs(job)
    return info.value


def test_a_prepared_token_file_is_checked_against_its_metadata(tmp_path, tokenizer_path):
    """A tokens.bin cut short by a whole number of ids, or beside another tokenization's tokens.json (uint32 for
    uint16), trained on without a word; a directory without its tokens.json was said to hold no text files, and its
    tokens.bin named alone was read as uint16 whatever it holds."""
    (tmp_path / "a.txt").write_text(TEXT * 5)
    good = tmp_path / "good"
    _tokens(tokenizer_path, tmp_path / "a.txt", good)
    check_inputs(_job(good))
    data = (good / "tokens.bin").read_bytes()
    meta = json.loads((good / "tokens.json").read_text())

    def variant(name: str, tokens: bytes | None = data, **changes) -> Path:
        directory = tmp_path / name
        directory.mkdir()
        if tokens is not None:
            (directory / "tokens.bin").write_bytes(tokens)
        if changes.get("meta", True) is not None:
            text = changes.get("meta") or json.dumps({**meta, **changes})
            (directory / "tokens.json").write_text(text)
        return directory

    count = meta["num_tokens"]
    for directory, expected in [
        (variant("cut", data[:-400]), f"{2 * count - 400} bytes, but tokens.json says {count} uint16 ids ({2 * count} bytes)"),
        (variant("wide", token_dtype="uint32"), f"{2 * count} bytes, but tokens.json says {count} uint32 ids"),
        (variant("list", meta="[]"), "tokens.json: not a JSON object; run cona data prepare again"),
        (variant("negative", vocab_size=-1), "tokens.json: vocab_size -1 is not a positive number"),
        (variant("narrow", vocab_size=70_000), "a vocabulary of 70000 does not fit token_dtype uint16"),
        (variant("lost", meta=None), "tokens.bin but no tokens.json, which says the dtype and vocabulary"),
    ]:
        refused = _refusal(_job(directory))
        assert expected in str(refused), (directory.name, str(refused))
    assert _refusal(_job(tmp_path / "cut")).fix == FIX_FILES
    alone = tmp_path / "lost" / "tokens.bin"
    assert "no tokens.json beside it" in str(_refusal(_job(alone)))
    check_inputs(_job(alone, token_dtype="uint16"))  # named: raw ids, as any .bin


def test_train_tokenizer_reads_as_prepare_reads_and_says_bad_input_in_one_line(tmp_path):
    """A missing file, a directory or Latin-1 text ended in a tokenizers traceback (`Exception: stream did not contain
    valid UTF-8`); the tokenizer is the one `tokenizers` trains on the file itself."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    script = REPO / "scripts" / "train_tokenizer.py"
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "latin1.txt").write_bytes("café\n".encode("latin-1") * 20)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip

    for args, expected in [
        ((str(tmp_path / "missing.txt"),), "text " + str(tmp_path / "missing.txt") + ": no such file or directory"),
        ((str(tmp_path / "a.txt"), "--vocab-size", "100"), "--vocab-size 100: a byte-level BPE has at least 257"),
    ]:
        result = run(*args, str(tmp_path / "t.json"))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {expected}"), result.stderr
    result = run(str(tmp_path / "latin1.txt"), str(tmp_path / "latin1.json"), "--vocab-size", "260")
    assert result.returncode == 0 and "replaced by U+FFFD" in result.stderr, result.stderr
    assert run(str(tmp_path / "a.txt"), str(tmp_path / "t.json"), "--vocab-size", "300").returncode == 0
    own = Tokenizer(models.BPE())
    own.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    own.decoder = decoders.ByteLevel()
    own.train([str(tmp_path / "a.txt")], trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))  # fmt: skip
    assert Tokenizer.from_file(str(tmp_path / "t.json")).to_str() == own.to_str()
