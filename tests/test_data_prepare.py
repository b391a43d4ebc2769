"""`cona data prepare`: text → tokens.bin + tokens.json with Hugging Face tokenizers, and the trainer reading it.

No hub download: the tokenizer is a small byte-level BPE trained here on the corpus with `tokenizers` itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from cona.protocol.rundir import ExitCode

try:
    from tests.trainer_helpers import (
        REPO,
        corpus_path,
        describe,
        launch,
        step_records,
        trainer_env,
        write_job,
    )
except ImportError:  # tests/ is not a package here
    from trainer_helpers import REPO, corpus_path, describe, launch, step_records, trainer_env, write_job

VOCAB = 512


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(a tokenizer.json trained on the corpus, a directory of two text documents)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("corpus")
    text = corpus_path().read_text()[:400_000]
    docs = root / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(text[:250_000])
    (docs / "b.txt").write_text(text[250_000:])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    path = root / "tokenizer.json"
    tokenizer.save(str(path))
    return path, docs


def _prepare(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cona.orchestrator.cli", "data", "prepare", *args]
    return subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=120)


def test_prepare_writes_what_decodes_back_and_trains(tmp_path, corpus):
    from tokenizers import Tokenizer

    tokenizer_path, docs = corpus
    out = tmp_path / "tokens"
    result = _prepare("--tokenizer", str(tokenizer_path), "--input", str(docs), "--out", str(out), "--workers", "2",
                      "--chunk-mb", "0.05")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "tokens (uint16) from 2 document(s)" in result.stdout
    meta = json.loads((out / "tokens.json").read_text())
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert meta["vocab_size"] == VOCAB and meta["eos_id"] == eos and meta["token_dtype"] == "uint16"
    assert meta["dropped_characters"] == 0 and "no token" not in result.stderr  # byte-level: every character
    import hashlib

    assert meta["tokenizer_sha256"] == hashlib.sha256(tokenizer_path.read_bytes()).hexdigest()
    ids = np.fromfile(out / "tokens.bin", dtype=np.uint16)
    assert len(ids) == meta["num_tokens"] and ids.max() < VOCAB
    # Two documents, each followed by EOS; each decodes back to its text (byte-level BPE is lossless).
    (cut,) = np.flatnonzero(ids[:-1] == eos)
    assert ids[-1] == eos
    assert tokenizer.decode(ids[:cut].tolist()) == (docs / "a.txt").read_text()
    assert tokenizer.decode(ids[cut + 1 : -1].tolist()) == (docs / "b.txt").read_text()
    # The same bytes with one worker: chunks depend on the text only.
    from cona.trainer.prepare import prepare

    prepare(tokenizer_path, docs, tmp_path / "one", workers=1, chunk_mb=0.05, progress=False)
    assert (tmp_path / "one" / "tokens.bin").read_bytes() == (out / "tokens.bin").read_bytes()

    # The trainer reads the directory (dtype from the metadata) with a model whose vocabulary holds the tokenizer's.
    job = write_job(tmp_path, model={"num_layers": 2, "vocab_size": VOCAB}, data={"path": str(out)})
    trained = launch(tmp_path / "run", nproc=0, strategy="dp=1,mbs=8,gbs=16", job=job, max_steps=2)
    assert trained.returncode == 0 and trained.exit_code == ExitCode.STOPPED, describe(trained)
    assert step_records(tmp_path / "run", 0)[1]["train_loss"] == pytest.approx(np.log(VOCAB), abs=0.3)
    # Its export says the data's end-of-document id (the run was trained by hand: --job names the data), not
    # transformers' default for GPT-2 (50256, outside this vocabulary).
    from cona.trainer.export import main as export

    assert export([str(tmp_path / "run"), "--format", "hf", "--out", str(tmp_path / "hf"), "--job", str(job)]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["eos_token_id"], config["bos_token_id"]) == (eos, None)
    # ... and refuses, in one line naming the field, a model whose vocabulary is smaller.
    small = write_job(tmp_path, name="small.yaml", model={"num_layers": 2}, data={"path": str(out)})
    refused = launch(tmp_path / "refused", nproc=0, strategy="dp=1,mbs=8,gbs=16", job=small, max_steps=1)
    assert refused.returncode == ExitCode.CONFIG, describe(refused)
    assert refused.stderr.strip().splitlines() == [
        f"cona trainer: error: model.vocab_size=256 is smaller than the vocabulary of {VOCAB} that {out} was tokenized "
        f"with (tokenizer {meta['tokenizer_sha256'][:12]}); set model.vocab_size: {VOCAB}"
    ]


def test_bad_input_is_one_line(tmp_path, corpus, capsys):
    from cona.trainer.prepare import main

    tokenizer_path, docs = corpus
    (tmp_path / "broken.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank.txt").write_text("")
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "spaces.txt").write_text("  \n\n \n")
    for args, expected in [
        (["--tokenizer", str(tokenizer_path), "--input", str(tmp_path / "blank.txt")], "no text to tokenize"),
        (["--tokenizer", str(tokenizer_path), "--input", str(docs), "--out", str(tmp_path / "a-file")],
         "a file, not a directory"),
        (["--tokenizer", str(tmp_path / "none.json"), "--input", str(docs)], "no such file"),
        (["--tokenizer", str(tmp_path / "broken.json"), "--input", str(docs)], "not a tokenizers JSON file"),
        (["--tokenizer", str(tokenizer_path), "--input", str(tmp_path / "missing")], "no such file or directory"),
        (["--tokenizer", str(tokenizer_path), "--input", str(tmp_path / "empty")], "holds no text files"),
        (["--tokenizer", str(tokenizer_path), "--input", str(docs), "--eos", "<nope>"], "--eos '<nope>': not a token"),
        (["--tokenizer", str(tokenizer_path)], "the following arguments are required: --input, --out"),
        # Whitespace only: found after --out was made, which was left behind empty.
        (["--tokenizer", str(tokenizer_path), "--input", str(tmp_path / "spaces.txt")], "no text to tokenize"),
        # Each of these is named alone, with its value (one message named both).
        (["--tokenizer", str(tokenizer_path), "--input", str(docs), "--workers", "0"],
         "--workers 0: give at least 1 tokenizing process"),
        (["--tokenizer", str(tokenizer_path), "--input", str(docs), "--chunk-mb", "nan"],
         "--chunk-mb nan: give a positive, finite size in MB"),
    ]:
        if "--input" in args and "--out" not in args:
            args = [*args, "--out", str(tmp_path / "out")]
        try:
            status = main(["prepare", *args])
        except SystemExit as e:  # argparse's errors
            status = e.code
        err = capsys.readouterr().err
        assert status == 2 and expected in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "out").exists(), args  # a refusal leaves no --out it made


def test_a_tokenizer_saved_with_truncation_or_padding_tokenizes_the_whole_corpus(tmp_path, corpus, capsys):
    """A tokenizer.json saved after `tokenizer(..., truncation=True)` kept 513 tokens of a 2 MB document (the
    first max_length and the EOS), silently; one with fixed padding padded a 13-byte file to 4,097."""
    from cona.trainer.prepare import main

    tokenizer_path, docs = corpus
    settings = json.loads(tokenizer_path.read_text())
    settings["truncation"] = {"direction": "Right", "max_length": 64, "strategy": "LongestFirst", "stride": 0}
    settings["padding"] = {"strategy": {"Fixed": 4096}, "direction": "Right", "pad_to_multiple_of": None,
                           "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}  # fmt: skip
    truncating = tmp_path / "truncating.json"
    truncating.write_text(json.dumps(settings))
    assert main(["prepare", "--tokenizer", str(tokenizer_path), "--input", str(docs), "--out", str(tmp_path / "a"),
                 "--workers", "1"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["prepare", "--tokenizer", str(truncating), "--input", str(docs), "--out", str(tmp_path / "b"),
                 "--workers", "1"]) == 0  # fmt: skip
    assert "sets truncation and padding (for model inputs); tokenizing the corpus without it" in capsys.readouterr().err
    assert (tmp_path / "a" / "tokens.bin").read_bytes() == (tmp_path / "b" / "tokens.bin").read_bytes()


def test_text_the_tokenizer_cannot_encode_is_one_line(tmp_path, corpus, capsys):
    """A word-level tokenizer without its unknown token raised tokenizers' bare Exception from a worker: two
    tracebacks. More workers than cores are cut to the cores (all were forked at once)."""
    from cona.trainer.prepare import main
    from tokenizers import Tokenizer, models, pre_tokenizers

    _, docs = corpus
    words = Tokenizer(models.WordLevel({"the": 0, "and": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.save(str(tmp_path / "words.json"))
    status = main(["prepare", "--tokenizer", str(tmp_path / "words.json"), "--input", str(docs), "--out",
                   str(tmp_path / "out"), "--workers", "100000"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2 and not (tmp_path / "out").exists(), err
    assert f"--workers 100000 is more than the {os.cpu_count()} cores" in err
    refusal = err.strip().splitlines()[-1]
    assert "cannot encode the text (" in refusal and "give a tokenizer that covers every character" in refusal, err
    assert "Traceback" not in err


def test_an_out_that_cannot_be_written_is_one_line_and_leaves_no_partial_tokens(tmp_path, corpus, capsys, monkeypatch):
    """OSError's own text ("[Errno 28] No space left on device") named neither --out nor the file, and the partial
    tokens.bin.tmp stayed behind."""
    import errno
    import os

    from cona.trainer import prepare

    tokenizer_path, docs = corpus
    (tmp_path / "a-file").write_text("x")
    args = ["prepare", "--tokenizer", str(tokenizer_path), "--input", str(docs), "--workers", "1", "--out"]
    assert prepare.main([*args, str(tmp_path / "a-file" / "out")]) == 2
    assert capsys.readouterr().err == (f"cona: error: --out {tmp_path / 'a-file' / 'out'}: cannot write (Not a "
                                       "directory); give a writable directory with room for the tokens\n")  # fmt: skip

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(prepare.os, "fsync", full_disk)
    assert prepare.main([*args, str(tmp_path / "out")]) == 2
    assert f"--out {tmp_path / 'out'}: cannot write (No space left on device)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # no partial tokens, nor the empty --out it made


def test_bytes_that_are_not_utf8_are_replaced_and_counted(tmp_path, corpus, capsys):
    from cona.trainer.prepare import main

    tokenizer_path, _ = corpus
    (tmp_path / "mixed.txt").write_bytes(b"to be or not to be\n" * 20 + b"\xff\xfe stray bytes\n")
    assert main(["prepare", "--tokenizer", str(tokenizer_path), "--input", str(tmp_path / "mixed.txt"),
                 "--out", str(tmp_path / "out")]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "mixed.txt: not UTF-8 from byte 380 on; 2 of" in err and "U+FFFD" in err, err


# Text where a cut at a line end changes the tokens of GPT-2's pre-tokenizer: markdown's "  \n" line breaks (one
# pre-token "  \n" at the end of a text, "  " and "\n" before a letter) and two blank lines ("\n\n" and "\n" before
# a letter, three newlines when cut after the first).
_TRICKY = "**ROMEO**  \nBut soft!  \nWhat light\n\n\n  through yonder\n\n\n\nwindow breaks?  \n \n"


def _tokenizer_of(kind: str, text: str):
    """A small tokenizer trained on `text`: GPT-2's byte-level BPE, or one of those that add a prefix on every
    encode call (ByteLevel add_prefix_space, Metaspace prepend_scheme always, a Prepend normalizer as Llama 2's)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    special = ["<|endoftext|>"]
    if kind.startswith("byte-level"):
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=kind == "byte-level-prefix-space")
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    elif kind == "metaspace-always":
        tokenizer = Tokenizer(models.Unigram())
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
        trainer = trainers.UnigramTrainer(vocab_size=400, special_tokens=special, show_progress=False)
    else:
        tokenizer = Tokenizer(models.BPE(byte_fallback=True))
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False)
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tokenizer


@pytest.mark.parametrize("kind", ["byte-level", "byte-level-prefix-space", "metaspace-always", "prepend-normalizer"])
def test_the_tokens_are_those_of_each_document_encoded_whole_whatever_the_chunks(tmp_path, kind):
    """Chunks at every line end (a tiny --chunk-mb) gave other tokens than the document encoded whole: a prefix
    space at every chunk for a tokenizer that adds one per encode call (`friend?  \\n It must` at each 1 MB of the
    Shakespeare corpus), and other tokens for GPT-2's byte-level BPE wherever whitespace meets the cut."""
    from cona.trainer.prepare import prepare

    base = corpus_path().read_text()[:6_000]
    docs = tmp_path / "docs"
    docs.mkdir()
    texts = [base[:3_000] + _TRICKY * 3, _TRICKY + base[3_000:] + _TRICKY]
    for k, text in enumerate(texts):
        (docs / f"{k}.txt").write_text(text)
    tokenizer = _tokenizer_of(kind, "".join(texts) * 2)
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    eos = tokenizer.token_to_id("<|endoftext|>")
    whole = [i for text in texts for i in [*tokenizer.encode(text, add_special_tokens=False).ids, eos]]
    for chunk_mb in (1e-6, 1e-3, 1.0):  # every line end a cut; a few; none
        meta = prepare(path, docs, tmp_path / f"out-{chunk_mb}", workers=1, chunk_mb=chunk_mb, progress=False)
        got = np.fromfile(tmp_path / f"out-{chunk_mb}" / "tokens.bin", dtype=np.uint16).tolist()
        assert meta["num_tokens"] == len(whole)
        assert got == whole, f"--chunk-mb {chunk_mb}: {tokenizer.decode(got)!r}"


def test_without_call_prefix_removes_only_the_per_call_prefix():
    from cona.trainer.prepare import without_call_prefix

    config = {
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                           {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True},
    }  # fmt: skip
    out = json.loads(without_call_prefix(json.dumps(config)))
    assert out["normalizer"]["normalizers"] == [config["normalizer"]["normalizers"][1]]
    assert [p.get("add_prefix_space", p.get("prepend_scheme")) for p in out["pre_tokenizer"]["pretokenizers"]] == [False, "never"]
    assert out["decoder"] == config["decoder"]  # decoding is not encoding's business
    assert json.loads(without_call_prefix(json.dumps({"normalizer": {"type": "Prepend", "prepend": "▁"}})))["normalizer"] is None


@pytest.mark.slow
def test_sigterm_to_cona_stops_the_tokenizer_and_leaves_no_partial_tokens(tmp_path, corpus):
    """`cona data prepare` runs the tokenizer in a process of its own: a SIGTERM to `cona` (a job scheduler's stop,
    `kill`) ended cona alone, and the tokenizer went on, orphaned, writing tokens.bin.tmp."""
    import signal
    import time

    tokenizer_path, _ = corpus
    big = tmp_path / "big.txt"
    big.write_text(corpus_path().read_text() * 5)  # about 25 MB: many seconds for one worker
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "cona.orchestrator.cli", "data", "prepare", "--tokenizer",
                             str(tokenizer_path), "--input", str(big), "--out", str(out), "--workers", "1"],
                            cwd=REPO, env=trainer_env(), stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.time() + 60
    while not (out / "tokens.bin.tmp").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert (out / "tokens.bin.tmp").exists(), "the tokenizer never started writing"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "terminated; no partial tokens left" in err and not out.exists(), err
    stray = subprocess.run(["pgrep", "-f", f"cona.trainer.prepare.*{out}"], capture_output=True, text=True)
    assert stray.stdout.strip() == "", "the tokenizer outlived cona"


def test_an_init_from_of_another_vocabulary_is_refused(tmp_path, corpus):
    """Data tokenized with one tokenizer and weights of a model trained with another: every id means another token
    to the pretrained embeddings, and nothing failed (the vocabulary size check passes: both fit the model)."""
    from cona.orchestrator.job import load_job
    from cona.protocol.inputs import InputRefused, check_tokenizer, data_files
    from cona.trainer.hf import hf_config
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer_path, docs = corpus
    out = tmp_path / "tokens"
    assert _prepare("--tokenizer", str(tokenizer_path), "--input", str(docs), "--out", str(out)).returncode == 0
    meta = json.loads((out / "tokens.json").read_text())
    other = Tokenizer(models.BPE())
    other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    other.train_from_iterator(["the other corpus, the other merges"] * 50, trainer=trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))  # fmt: skip
    model = tmp_path / "model"
    model.mkdir()
    args = ["--profile", str(REPO / "slurm/profiles/local-cpu.yaml"), "--job", str(REPO / "examples/tiny-gpt.yaml"),
            "--set", f"data.path={out}", "--set", f"model.vocab_size={VOCAB}", "--set", f"model.init_from={model}"]  # fmt: skip
    job = load_job(REPO / "examples/tiny-gpt.yaml", overrides=args[5::2])
    (model / "config.json").write_text(json.dumps(hf_config(job.model)))
    other.save(str(model / "tokenizer.json"))

    def cona_run(name: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "cona.orchestrator.cli", "run", *args, "--run-dir", str(tmp_path / name)]
        return subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=120)

    refused = cona_run("refused")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"cona: error: {REPO / 'examples/tiny-gpt.yaml'}: data.path {str(out)!r} was tokenized with another vocabulary "
        f"than {model / 'tokenizer.json'} (the model of model.init_from): its ids would mean other tokens to the "
        f"pretrained weights; prepare the data with `cona data prepare --tokenizer {model / 'tokenizer.json'} ...`, "
        "or start from a model of that tokenizer"
    ]
    assert not (tmp_path / "refused" / "run.yaml").exists()
    # Text read byte by byte beside a model with a tokenizer: ids 0-255 are other tokens to it.
    as_text = job.model_copy(update={"data": job.data.model_copy(update={"path": str(docs)})})
    with pytest.raises(InputRefused, match="is text, read byte by byte"):
        check_tokenizer(as_text, data_files(as_text))
    # The same vocabulary in another file (saved with a truncation setting, as transformers leaves it) is no
    # mismatch; nor is data prepared before the digest was recorded, judged by the tokenizer file it names.
    def prepared(tokens_json: dict) -> Any:
        return dataclasses.replace(data_files(job), meta=tokens_json)

    same = json.loads(tokenizer_path.read_text())
    same["truncation"] = {"direction": "Right", "max_length": 512, "strategy": "LongestFirst", "stride": 0}
    (model / "tokenizer.json").write_text(json.dumps(same, indent=1))
    check_tokenizer(job, prepared(meta))
    old = {k: v for k, v in meta.items() if k != "vocab_sha256"}


    check_tokenizer(job, prepared(old))
    other.save(str(model / "tokenizer.json"))
    with pytest.raises(InputRefused, match="another vocabulary"):
        check_tokenizer(job, prepared(old))
    # A tokenizer file changed since the data was prepared no longer tells what the data's ids mean: no verdict.
    check_tokenizer(job, prepared({**old, "tokenizer_sha256": "0" * 64}))
    # A model directory without a tokenizer.json has nothing to compare.
    (model / "tokenizer.json").unlink()
    check_tokenizer(job, prepared(meta))


def test_text_the_tokenizer_leaves_out_is_counted_in_a_warning(tmp_path):
    """A BPE without an unknown token or byte fallback encodes a character it never saw to nothing: the text was
    shorter in tokens.bin than in the corpus, and nothing said so."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    words = Tokenizer(models.BPE())
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(["to be or not to be"] * 20, trainer=trainers.BpeTrainer(
        vocab_size=40, special_tokens=["<|endoftext|>"]))  # fmt: skip
    words.save(str(tmp_path / "words.json"))
    (tmp_path / "text.txt").write_text("to be, or not to be: été\tbe\n")
    result = _prepare("--tokenizer", str(tmp_path / "words.json"), "--input", str(tmp_path / "text.txt"),
                      "--out", str(tmp_path / "out"), "--workers", "1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "no token" in line]
    assert warnings == [
        f"cona data prepare: warning: 4 characters of the text are in no token (3 distinct: 'é' ×2, ',' ×1, ':' ×1): "
        f"{tmp_path / 'words.json'} has no unknown token or byte fallback for them, so they are not in "
        "tokens.bin; give a tokenizer that covers them if they matter"
    ], result.stderr
    assert json.loads((tmp_path / "out" / "tokens.json").read_text())["dropped_characters"] == 4


def test_a_sigterm_whose_raise_python_swallowed_still_stops_the_tokenizer(tmp_path, corpus):
    """A SIGTERM that landed in an at-fork hook as the worker process started was printed as "Exception ignored" and
    lost: the run went on and wrote tokens.bin, exit 0. The flag the handler sets first is checked at every chunk
    and before the final rename, so the partial files go as for a raise that arrived."""
    from cona.trainer import prepare as prep

    tokenizer_path, docs = corpus
    out = tmp_path / "out"
    prep._TERMINATED.set()  # the handler ran; its raise was swallowed
    try:
        with pytest.raises(prep._Terminated):
            prep.prepare(tokenizer_path, docs, out, workers=1, chunk_mb=0.05, progress=False)
    finally:
        prep._TERMINATED.clear()
    assert not out.exists(), sorted(out.iterdir())
