"""Checkpoint rules found by a bug hunt (`trainer.checkpoint`), each in one process (a gloo world of one).

- A checkpoint at step 0 (`--max-steps 0`: the initial weights) leaves AdamW as if it never stepped, in the
  processes that saved it and in a resume: the first update is bit-identical to a run that never checkpointed.
- A save after the resume fell back past a damaged newer checkpoint keeps the one it wrote, whatever `keep`.
- A checkpoint of another seed (another data order) is refused in one line naming the seed.
- So is a checkpoint of another corpus of the same length (a sampled fingerprint of each split).
- A step-0 checkpoint written by earlier cona (AdamW `step` 1) resumes as one that never stepped.
- A checkpoint this user may not read is passed over with a one-line warning saying what to do.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from cona.protocol.job import JobSpec, load_job
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError
from cona.trainer import checkpoint as ckpt
from cona.trainer.data import Corpus, TokenSequence, load_corpus
from cona.trainer.distributed import init_distributed
from cona.trainer.train import Trainer

try:
    from tests.trainer_helpers import write_job
except ImportError:  # tests/ is not a package here
    from trainer_helpers import write_job

ONE = Strategy.parse("dp=1,tp=1,pp=1,mbs=8,gbs=16")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[JobSpec, Corpus]:
    init_distributed()
    job = load_job(write_job(tmp_path_factory.mktemp("job")), [])
    return job, load_corpus(job)


def _trainer(run: Path, job: JobSpec, corpus: Corpus, run_created: float | None = None) -> Trainer:
    run.mkdir(parents=True, exist_ok=True)
    return Trainer(job=job, strategy=ONE, run_dir=RunDir(run), attempt=0, env=init_distributed(), corpus=corpus,
                   run_created=run_created)  # fmt: skip


def _params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def _resumes_at_step_0_as(run: Path, reference: Trainer, job: JobSpec, corpus: Corpus, what: str) -> None:
    """A trainer resumed in `run` loads its step-0 checkpoint and, two steps on, holds `reference`'s weights."""
    resumed = _trainer(run, job, corpus)
    resumed.resume()
    assert resumed.loaded_step == 0
    for _ in range(2):
        resumed.step()
    for got, want in zip(_params(resumed), _params(reference), strict=True):
        assert torch.equal(got, want), f"{what} trained otherwise"


def test_a_checkpoint_at_step_0_leaves_adam_as_if_it_never_stepped(tmp_path, tiny):
    """get_state_dict filled the empty AdamW state with one zero-gradient step, leaving `step` at 1 in the live
    optimizer and in the checkpoint: the first real update then had step 2's bias correction (about 3/4 its size),
    so a run checkpointed at step 0 — and every resume of that checkpoint — trained otherwise than one that was not."""
    job, corpus = tiny
    reference = _trainer(tmp_path / "reference", job, corpus)
    reference.resume()
    for _ in range(2):
        reference.step()

    saved = _trainer(tmp_path / "saved", job, corpus)
    saved.resume()
    saved.save()
    state = ckpt.read_checkpoint_tensors(RunDir(tmp_path / "saved").checkpoint_dir(0))
    steps = {key: float(value) for key, value in state.items() if key.startswith("optim.state.") and key.endswith(".step")}
    assert steps and set(steps.values()) == {0.0}, steps
    for _ in range(2):
        saved.step()
    for got, want in zip(_params(saved), _params(reference), strict=True):
        assert torch.equal(got, want), "a checkpoint at step 0 changed the updates after it"

    # A relaunch: the step-0 checkpoint is the only one.
    _resumes_at_step_0_as(tmp_path / "saved", reference, job, corpus, "a resume from a checkpoint at step 0")


def test_a_save_after_falling_back_past_a_damaged_checkpoint_keeps_what_it_wrote(tmp_path):
    """Steps 8 and 12 saved, 12's shard then damaged on storage (same size, its CRC-32 fails): the resume falls back
    to 8 and trains on. Its save at step 9 under `keep: 1` removed step 9 itself (12 outranked it by name), leaving
    only the damaged 12: the next resume had no checkpoint to load."""
    init_distributed()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    run = RunDir(tmp_path)

    def save(step: int, keep: int) -> None:
        net(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        ckpt.save_checkpoint(run, step=step, parts=[net], optimizers=[optimizer], trainer_state={"step": step},
                             keep=keep)  # fmt: skip

    save(8, keep=3)
    save(12, keep=3)
    shard = run.checkpoint_dir(12) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    save(9, keep=1)
    assert ckpt.verify_checkpoint(run.checkpoint_dir(9)) is None, "the checkpoint just written was removed"
    assert not run.checkpoint_dir(8).exists()  # `keep: 1` counts from the newest save down
    assert run.checkpoint_dir(12).exists()  # not this attempt's to remove: a re-save of step 12 replaces it

    # What the next resume does: 12 fails its checksum, 9 loads.
    loaded = None
    for path in ckpt.resume_candidates(run):
        try:
            loaded = ckpt.load_checkpoint(path, parts=[net], optimizers=[optimizer])["step"]
            break
        except ckpt.CheckpointLoadError as e:
            assert "fails its CRC-32 check" in str(e)
    assert loaded == 9


def test_a_checkpoint_of_another_seed_is_refused_naming_the_seed(tmp_path, tiny):
    """The sample order is a function of (seed, sample index): resuming another seed's checkpoint went on silently
    with another order — samples of the epoch trained twice, others never — while the samples log audited clean,
    and every later checkpoint still claimed the old seed."""
    job, corpus = tiny
    first = _trainer(tmp_path / "run", job, corpus)
    first.resume()
    first.save()
    other = job.model_copy(update={"seed": job.seed + 1})
    with pytest.raises(ConfigError) as refused:
        _trainer(tmp_path / "run", other, corpus).resume()
    state_file = RunDir(tmp_path / "run").checkpoint_dir(0) / "trainer_state.json"
    line = str(refused.value)
    assert line.startswith(f"{state_file}: a checkpoint of seed {job.seed}, not of this job's seed {job.seed + 1}")
    assert f"set seed: {job.seed} to resume it" in line and "\n" not in line
    same = _trainer(tmp_path / "run", job, corpus)
    same.resume()
    assert same.loaded_step == 0


def test_a_checkpoint_copied_in_from_another_run_of_the_same_job_is_refused(tmp_path, tiny):
    """Same job, seed and data: a checkpoint copied in from another run directory resumed silently at that run's
    sample count (a sweep resumed 960 samples past this run's, which were never trained; only a later report
    noticed). Every checkpoint names its run (run.yaml's `created`); a checkpoint without the stamp (earlier cona,
    or a trainer started by hand) is taken as before."""
    job, corpus = tiny
    import json
    import shutil

    theirs = _trainer(tmp_path / "theirs", job, corpus, run_created=1000.0)
    theirs.resume()
    theirs.step()
    theirs.save()
    state_file = RunDir(tmp_path / "theirs").checkpoint_dir(1) / "trainer_state.json"
    assert json.loads(state_file.read_text())["run_created"] == 1000.0
    ours = RunDir(tmp_path / "ours")
    ours.checkpoints.mkdir(parents=True)
    shutil.copytree(RunDir(tmp_path / "theirs").checkpoint_dir(1), ours.checkpoint_dir(1))
    with pytest.raises(ConfigError) as refused:
        _trainer(ours.root, job, corpus, run_created=2000.0).resume()
    line = str(refused.value)
    copied = ours.checkpoint_dir(1) / "trainer_state.json"
    assert line.startswith(f"{copied}: a checkpoint of another run of this job (created ") and "\n" not in line
    assert "would skip or repeat this run's samples" in line
    again = _trainer(tmp_path / "theirs", job, corpus, run_created=1000.0)  # its own run resumes it
    again.resume()
    assert again.loaded_step == 1 and again.state.run_created == 1000.0
    by_hand = _trainer(ours.root, job, corpus)  # no identity to check against
    by_hand.resume()
    assert by_hand.loaded_step == 1


def test_a_checkpoint_of_other_data_is_refused_naming_both_sizes(tmp_path, tiny):
    """The sample order is a function of the training split's length: a resume on a re-prepared or edited corpus,
    or under another `data.val_fraction`, went on silently in another order (samples trained twice or never)."""
    job, corpus = tiny
    first = _trainer(tmp_path / "run", job, corpus)
    first.resume()
    first.save()
    state_file = RunDir(tmp_path / "run").checkpoint_dir(0) / "trainer_state.json"
    import json

    assert json.loads(state_file.read_text())["data_tokens"] == [len(corpus.train), len(corpus.val)]
    moved = job.model_copy(update={"data": job.data.model_copy(update={"val_fraction": job.data.val_fraction * 2})})
    other = load_corpus(moved)
    with pytest.raises(ConfigError) as refused:
        _trainer(tmp_path / "run", moved, other).resume()
    line = str(refused.value)
    assert line.startswith(f"{state_file}: a checkpoint trained on {len(corpus.train):,} training and "
                           f"{len(corpus.val):,} validation tokens, but data.path now gives {len(other.train):,}")
    assert "restore the data the run started with" in line and "\n" not in line
    # A checkpoint of an earlier cona (no record of its data) is not refused for it.
    state = json.loads(state_file.read_text())
    del state["data_tokens"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "trainer_state.json").write_text(json.dumps(state))
    assert ckpt.foreign_reason(tmp_path / "old", job_name=job.name, model=state["model"], seed=job.seed,
                               data_tokens=[len(other.train), len(other.val)]) is None  # fmt: skip


def test_a_checkpoint_of_another_corpus_of_the_same_length_is_refused(tmp_path, tiny):
    """Token counts alone let another corpus of the same length through (a re-prepared file with another tokenizer
    of the same size, an in-place edit): the sampled fingerprint of each split is recorded and compared."""
    job, corpus = tiny
    first = _trainer(tmp_path / "run", job, corpus)
    first.resume()
    first.save()
    train = corpus.train.slice(0, len(corpus.train))
    edited = train.copy()
    edited[len(edited) // 2 :] = edited[len(edited) // 2 :][::-1]  # the same tokens, half of them in another order
    for split, other in (("training", dataclasses.replace(corpus, train=TokenSequence([edited.astype(np.uint8)]))),
                         ("validation", dataclasses.replace(corpus, val=TokenSequence([np.zeros(len(corpus.val), np.uint8)])))):  # fmt: skip
        assert [len(other.train), len(other.val)] == [len(corpus.train), len(corpus.val)]
        with pytest.raises(ConfigError) as refused:
            _trainer(tmp_path / "run", job, other).resume()
        line = str(refused.value)
        assert f"data.path's {split} tokens have the same count but other content" in line and "\n" not in line
    # The same tokens held in another dtype (a .npy of int32 for a .bin of uint8) are the same data.
    same = dataclasses.replace(corpus, train=TokenSequence([train.astype(np.int32)]))
    resumed = _trainer(tmp_path / "run", job, same)
    resumed.resume()
    assert resumed.loaded_step == 0


def test_a_step_0_checkpoint_of_earlier_code_resumes_as_if_adam_never_stepped(tmp_path, tiny, monkeypatch):
    """Earlier cona saved a step-0 checkpoint with AdamW's `step` at 1 (it did not reset get_state_dict's fill);
    a resume of such a checkpoint still trains exactly as a run that never checkpointed."""
    job, corpus = tiny
    reference = _trainer(tmp_path / "reference", job, corpus)
    reference.resume()
    for _ in range(2):
        reference.step()

    with monkeypatch.context() as patch:
        patch.setattr(ckpt, "_reset_step_counts", lambda optimizer: None)  # the earlier save
        old = _trainer(tmp_path / "old", job, corpus)
        old.resume()
        old.save()
    state = ckpt.read_checkpoint_tensors(RunDir(tmp_path / "old").checkpoint_dir(0))
    steps = {float(v) for k, v in state.items() if k.startswith("optim.state.") and k.endswith(".step")}
    assert steps == {1.0}, "the earlier save no longer reproduced: this test checks nothing"

    _resumes_at_step_0_as(tmp_path / "old", reference, job, corpus, "a resume of an earlier step-0 checkpoint")



def test_a_checkpoint_this_user_may_not_read_is_passed_over_naming_it(tmp_path, tiny, monkeypatch, capsys):
    """A step directory without read permission (a run directory shared between users) raised PermissionError on
    rank 0 inside the resume's scan: a traceback there, and the other ranks left waiting in a collective. It is
    listed, passed over with a one-line warning that says what to do, and the resume loads the one before it.
    (Simulated: as root, which the tests may run as, chmod 000 does not stop a read.)"""
    import errno
    import pathlib

    from cona.orchestrator.live import newest_intact_checkpoint

    job, corpus = tiny
    first = _trainer(tmp_path / "run", job, corpus)
    first.resume()
    first.save()
    first.step()
    first.save()
    run = RunDir(tmp_path / "run")
    locked = run.checkpoint_dir(1)
    assert run.complete_checkpoints() == [run.checkpoint_dir(0), locked]
    real_stat = pathlib.Path.stat

    def stat(self, *args, **kwargs):
        if str(self).startswith(str(locked) + "/"):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "stat", stat)
    assert run.complete_checkpoints() == [run.checkpoint_dir(0), locked]  # listed, not taken for a partial save
    assert locked not in run.incomplete_checkpoints()
    intact, passed = newest_intact_checkpoint(run)
    assert intact == run.checkpoint_dir(0) and [p["path"] for p in passed] == [str(locked)]
    resumed = _trainer(tmp_path / "run", job, corpus)
    resumed.resume()
    assert resumed.loaded_step == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if str(locked) in line]
    assert len(warned) == 1 and "Permission denied" in warned[0] and f"give this user read access to {locked}" in warned[0]
