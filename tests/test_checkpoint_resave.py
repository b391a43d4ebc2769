"""Saving a step that already has a complete checkpoint never leaves the run without one (`trainer.checkpoint`).

In one process (a gloo world of one, as `python -m cona.trainer` without torchrun): the re-save is written beside
the complete checkpoint and swapped in; a failure inside it keeps the old one; a crash between the swap's two
renames is repaired when the checkpoints are next listed.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from cona.protocol.rundir import RunDir
from cona.trainer import checkpoint as ckpt
from cona.trainer.distributed import init_distributed


@pytest.fixture
def model():
    init_distributed()
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return net, optimizer


def _save(run_dir: RunDir, net, optimizer, *, step: int, tag: str) -> None:
    ckpt.save_checkpoint(run_dir, step=step, parts=[net], optimizers=[optimizer],
                         trainer_state={"step": step, "tag": tag}, keep=3)  # fmt: skip


def _weight(path) -> torch.Tensor:
    return ckpt.read_checkpoint_tensors(path)["model.weight"]


def _hidden(run_dir: RunDir) -> list[str]:
    return sorted(p.name for p in run_dir.checkpoints.iterdir() if p.name.startswith("."))


def _resave_fails_and_keeps_the_first(run_dir: RunDir, net, optimizer, saved: torch.Tensor) -> None:
    """Re-save step 5 (tagged "first", weights `saved`) with changed weights under an injected failure: the error
    names step 5 as the checkpoint the run resumes from, which is intact and alone in the directory."""
    with torch.no_grad():
        net.weight.add_(1.0)
    with pytest.raises(ckpt.CheckpointSaveError, match=r"resumes from .*step-00000005"):
        _save(run_dir, net, optimizer, step=5, tag="second")
    path = run_dir.checkpoint_dir(5)
    assert ckpt.verify_checkpoint(path) is None
    assert "first" in (path / "trainer_state.json").read_text()
    assert torch.equal(_weight(path), saved)
    assert _hidden(run_dir) == []


def test_a_resave_of_the_same_step_replaces_it_and_leaves_nothing_beside_it(tmp_path, model):
    net, optimizer = model
    run_dir = RunDir(tmp_path)
    _save(run_dir, net, optimizer, step=5, tag="first")
    with torch.no_grad():
        net.weight.add_(1.0)
    _save(run_dir, net, optimizer, step=5, tag="second")
    path = run_dir.checkpoint_dir(5)
    assert ckpt.verify_checkpoint(path) is None
    assert (path / "trainer_state.json").read_text().count("second") == 1
    assert torch.equal(_weight(path), net.weight.detach())
    assert _hidden(run_dir) == []


def test_a_resave_that_fails_keeps_the_complete_checkpoint_of_that_step(tmp_path, model, monkeypatch):
    net, optimizer = model
    run_dir = RunDir(tmp_path)
    _save(run_dir, net, optimizer, step=5, tag="first")
    saved = net.weight.detach().clone()
    real = ckpt.atomic_write_json

    def failing(path, data):  # the marker of the re-save: after the shards are written
        if path.name == ckpt.COMPLETE_MARKER:
            raise PermissionError(13, "Permission denied (injected)")
        real(path, data)

    monkeypatch.setattr(ckpt, "atomic_write_json", failing)
    _resave_fails_and_keeps_the_first(run_dir, net, optimizer, saved)


def test_a_resave_whose_second_rename_fails_puts_the_old_checkpoint_back(tmp_path, model, monkeypatch):
    """The swap's first rename moved the complete checkpoint aside, the second fails: the old one takes its name
    again, so the one-line error names it as the checkpoint the run resumes from (not an earlier step)."""
    net, optimizer = model
    run_dir = RunDir(tmp_path)
    _save(run_dir, net, optimizer, step=3, tag="earlier")
    _save(run_dir, net, optimizer, step=5, tag="first")
    saved = net.weight.detach().clone()
    real = type(tmp_path).rename

    def failing(self, target):  # the staged re-save taking the step's name
        if self.name.startswith(ckpt.RESAVE_PREFIX):
            raise PermissionError(13, "Permission denied (injected)")
        return real(self, target)

    monkeypatch.setattr(type(tmp_path), "rename", failing)
    _resave_fails_and_keeps_the_first(run_dir, net, optimizer, saved)


@pytest.mark.parametrize("staged_complete", [True, False])
def test_a_crash_between_the_renames_is_repaired_when_the_checkpoints_are_listed(tmp_path, model, staged_complete):
    net, optimizer = model
    run_dir = RunDir(tmp_path)
    _save(run_dir, net, optimizer, step=3, tag="older")
    _save(run_dir, net, optimizer, step=5, tag="old")
    old_weight = net.weight.detach().clone()
    with torch.no_grad():
        net.weight.add_(1.0)
    _save(run_dir, net, optimizer, step=7, tag="new")  # a complete checkpoint to stand in for the staged re-save
    path = run_dir.checkpoint_dir(5)
    # The state after the first rename: the old checkpoint moved aside, the new one not yet in its place.
    path.rename(path.with_name(".replaced-step-00000005"))
    run_dir.checkpoint_dir(7).rename(path.with_name(".resave-step-00000005"))
    if not staged_complete:  # the crash came before its marker
        (path.with_name(".resave-step-00000005") / ckpt.COMPLETE_MARKER).unlink()
    notices: list[tuple[str, str]] = []
    found = ckpt.resume_candidates(run_dir, notices)
    assert found[0] == path, found
    assert ckpt.verify_checkpoint(path) is None
    expected = net.weight.detach() if staged_complete else old_weight
    assert torch.equal(_weight(path), expected)
    source = ".resave-step-00000005" if staged_complete else ".replaced-step-00000005"
    assert notices == [("checkpoint-restored", f"restored checkpoint {path} from {source} (a re-save of that step was interrupted)")]
    assert _hidden(run_dir) == []


def test_stale_resave_leftovers_beside_a_valid_checkpoint_are_removed(tmp_path, model):
    net, optimizer = model
    run_dir = RunDir(tmp_path)
    _save(run_dir, net, optimizer, step=5, tag="kept")
    path = run_dir.checkpoint_dir(5)
    shutil.copytree(path, path.with_name(".resave-step-00000005"))
    (path.with_name(".resave-step-00000005") / ckpt.COMPLETE_MARKER).unlink()
    assert ckpt.resume_candidates(run_dir) == [path]
    assert "kept" in (path / "trainer_state.json").read_text()
    assert _hidden(run_dir) == []


def test_directories_not_named_as_checkpoints_are_neither_resumed_nor_pruned(tmp_path, model, capsys):
    """`step-abc` or `step-1` in checkpoints/ is not cona's: it was skipped on every resume as a save "being
    written", and one that sorted before the newest checkpoint was removed as a partial save."""
    net, optimizer = model
    run_dir = RunDir(tmp_path)
    run_dir.checkpoints.mkdir(parents=True)
    for name in ("step-abc", "step-0000001", "step-"):
        (run_dir.checkpoints / name).mkdir()
        (run_dir.checkpoints / name / "notes.txt").write_text("mine")
    _save(run_dir, net, optimizer, step=5, tag="first")
    _save(run_dir, net, optimizer, step=6, tag="second")
    notices: list = []
    assert ckpt.resume_candidates(run_dir, notices) == [run_dir.checkpoint_dir(6), run_dir.checkpoint_dir(5)]
    assert notices == [] and "skipping" not in capsys.readouterr().err
    assert all((run_dir.checkpoints / name / "notes.txt").read_text() == "mine"
               for name in ("step-abc", "step-0000001", "step-"))  # fmt: skip
    assert run_dir.has_marked_checkpoint() and run_dir.incomplete_checkpoints() == []
