"""Storage faults: a disk that fills up during a checkpoint save, and run-directory files that are torn, corrupt or
from somewhere else. Each is refused with one line naming the file and what to do, or skipped safely and said so;
none leaves the run without a usable checkpoint or in a crash loop."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from cona.protocol.rundir import RunDir, SwitchPoints, read_jsonl

from tests.trainer_helpers import describe, launch, write_job

DP2 = "dp=2,tp=1,pp=1,mbs=4,gbs=16"
ONE = "dp=1,tp=1,pp=1,mbs=4,gbs=16"


@pytest.fixture
def small_disk(tmp_path):
    """`run/checkpoints` on a tmpfs of 8 MB: room for one checkpoint of the tiny GPT (5.4 MB), not two."""
    mount = tmp_path / "run" / "checkpoints"
    mount.mkdir(parents=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.distributed
def test_full_disk_during_a_save_keeps_the_previous_checkpoint_and_says_what_is_needed(tmp_path, small_disk):
    from cona.trainer.checkpoint import verify_checkpoint

    run = tmp_path / "run"
    job = write_job(tmp_path, checkpoint={"interval_steps": 1000, "keep": 3})
    first = launch(run, nproc=2, strategy=DP2, job=job, max_steps=2)
    assert first.returncode == 0, describe(first)
    kept = RunDir(run).checkpoint_dir(2)
    assert verify_checkpoint(kept) is None

    second = launch(run, nproc=2, strategy=DP2, job=job, max_steps=4, attempt=1)
    assert second.returncode != 0, describe(second)
    reason = second.exit.reason if second.exit else ""
    assert "no space left on device" in reason and str(RunDir(run).checkpoint_dir(4)) in reason, describe(second)
    assert "MB needed" in reason and f"resumes from {kept}" in reason, reason
    errors = [line for line in second.stderr.splitlines() if line.startswith("cona trainer: error:")]
    assert errors == [f"cona trainer: error: {reason}"], describe(second)
    # The previous checkpoint is intact, the partial one gone (it would hold the space the next attempt needs).
    assert verify_checkpoint(kept) is None
    assert not RunDir(run).checkpoint_dir(4).exists()

    # With room again the next attempt resumes from the kept checkpoint, and no sample is lost or repeated.
    subprocess.run(["mount", "-o", "remount,size=32m", str(small_disk)], check=True)
    third = launch(run, nproc=2, strategy=DP2, job=job, max_steps=4, attempt=2)
    assert third.returncode == 0, describe(third)
    resumed = [r for r in read_jsonl(run / "samples" / "2.jsonl")[0] if "resume" in r]
    assert resumed == [{"resume": 2, "samples": 32}]
    from cona.protocol.samples_log import audit_samples

    assert audit_samples(RunDir(run))[-1] == (48, 64)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_save_that_fails_on_one_rank_stops_every_rank_promptly(tmp_path):
    """A save that fails on one rank only (`tests/save_fault_trainer.py`: before DCP's first collective, inside
    its collectives, or at the marker after them) must not leave the other ranks waiting in a collective until the
    heartbeat timeout: every rank learns of it, the partial directory is removed, the trainer exits 1 with one line
    naming the path and the error, and the previous checkpoint is intact and resumed from."""
    from cona.protocol.samples_log import audit_samples
    from cona.trainer.checkpoint import verify_checkpoint

    run = tmp_path / "run"
    job = write_job(tmp_path, checkpoint={"interval_steps": 1000, "keep": 3})
    # A world of one writes the checkpoint to keep (faster to start; checkpoints reshard between layouts).
    first = launch(run, nproc=0, strategy=ONE, job=job, max_steps=2)
    assert first.returncode == 0, describe(first)
    kept = RunDir(run).checkpoint_dir(2)
    partial = RunDir(run).checkpoint_dir(4)

    for attempt, (rank, where) in enumerate([(1, "writer"), (1, "write"), (0, "marker")], start=1):
        # A hang would last until gloo's 30-minute collective timeout: 150 s tells it from a slow machine.
        try:
            failed = launch(run, nproc=2, strategy=DP2, job=job, max_steps=4, attempt=attempt, timeout=150,
                            module="tests.save_fault_trainer", env={"CONA_TEST_SAVE_FAULT": f"{rank}:{where}"})  # fmt: skip
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"a save failing on rank {rank} ({where}) hung the others: {(e.stderr or b'')[-2000:]!r}")
        assert failed.returncode == 1, (where, describe(failed))
        reason = failed.exit.reason if failed.exit else ""
        assert reason.startswith(f"cannot write checkpoint {partial}: PermissionError: "), (where, describe(failed))
        assert "injected on one rank" in reason and reason.endswith(f"the run resumes from {kept}"), (where, reason)
        # torchrun prints its own traceback for a worker that exits non-zero; the workers print none.
        assert not re.search(r'File ".*/trainer/\w+\.py"', failed.stderr), (where, describe(failed))
        errors = [line for line in failed.stderr.splitlines() if line.startswith("cona trainer: error:")]
        assert errors == [f"cona trainer: error: {reason}"], (where, describe(failed))
        assert not partial.exists(), where
        assert verify_checkpoint(kept) is None, where
        resumed = [r for r in read_jsonl(run / "samples" / f"{attempt}.jsonl")[0] if "resume" in r]
        assert resumed == [{"resume": 2, "samples": 32}], where

    last = launch(run, nproc=0, strategy=ONE, job=job, max_steps=4, attempt=4)
    assert last.returncode == 0, describe(last)
    resumed = [r for r in read_jsonl(run / "samples" / "4.jsonl")[0] if "resume" in r]
    assert resumed == [{"resume": 2, "samples": 32}]
    assert audit_samples(RunDir(run))[-1] == (48, 64)


@pytest.mark.distributed
def test_ranks_left_in_a_collective_by_a_rank_killed_in_a_save_exit_on_torchruns_sigterm(tmp_path):
    """Rank 0 (DCP's coordinator) killed while it writes its shards: the other three, out of DCP on its error, met in
    mismatched collectives (two in the save's agreement all-reduce, one in DCP's gather) that never complete, and
    ignored torchrun's SIGTERM — their handler only sets a flag, which a rank blocked in a collective never gets to
    — until torchrun killed them after its 30 s grace. Each now sees that a process of its node is gone and exits at
    once. The save that died has no COMPLETE marker, and the one before stays complete."""
    from cona.trainer.checkpoint import verify_checkpoint

    run = tmp_path / "run"
    job = write_job(tmp_path, checkpoint={"interval_steps": 1000, "keep": 3})
    first = launch(run, nproc=0, strategy=ONE, job=job, max_steps=2)  # the checkpoint to keep, in a world of one
    assert first.returncode == 0, describe(first)
    killed = launch(run, nproc=4, strategy="dp=4,tp=1,pp=1,mbs=4,gbs=16", job=job, max_steps=4, attempt=1, timeout=240,
                    module="tests.save_fault_trainer", env={"CONA_TEST_SAVE_FAULT": "0:kill"})  # fmt: skip
    assert killed.returncode == 1 and killed.exit is None, describe(killed)
    assert "exitcode  : -9" in killed.stderr and "local_rank: 0" in killed.stderr, describe(killed)
    # torchrun's words when a worker outlives the grace after its SIGTERM, and it kills it.
    assert "forcefully exiting via 9" not in killed.stderr, describe(killed)
    assert "a process of this node is gone" in killed.stderr, describe(killed)
    assert not (RunDir(run).checkpoint_dir(4) / "COMPLETE").exists()
    assert verify_checkpoint(RunDir(run).checkpoint_dir(2)) is None


def test_corrupt_switch_points_are_refused_naming_the_file(tmp_path):
    run = RunDir(tmp_path)
    run.switch_points_json.write_text('{"samples": [200, "x"]}')
    with pytest.raises(ValueError, match=r"switch_points\.json: `samples` must be a list of positive integers; delete it"):
        run.read_switch_points()
    run.switch_points_json.write_text("\x00\xff garbage")
    with pytest.raises(ValueError, match=r"switch_points\.json: unreadable"):
        run.read_switch_points()
    run.switch_points_json.unlink()
    assert run.read_switch_points() == SwitchPoints()


def test_trainer_refuses_a_corrupt_switch_points_file_in_one_line(tmp_path):
    """Before any collective: exit 2 with the file named, no traceback."""
    run = tmp_path / "run"
    run.mkdir()
    RunDir(run).switch_points_json.write_text("[1, 2")
    job = write_job(tmp_path)
    result = launch(run, nproc=0, strategy="dp=1,tp=1,pp=1,mbs=4,gbs=16", job=job, max_steps=1)
    assert result.returncode == 2, describe(result)
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"cona trainer: error: {RunDir(run).switch_points_json}")


def test_torn_and_garbage_heartbeat_lines_are_skipped(tmp_path):
    """The scheduler's reader takes whole JSON objects only: a torn tail waits, garbage and non-objects are
    skipped, and the offset never passes a line that is still being written."""
    path = tmp_path / "hb.jsonl"
    good = json.dumps({"step": 1, "samples": 16})
    path.write_bytes(f"{good}\nnot json\n[1, 2]\n\x00\xfe\n{good}\n{{\"step\": 2, \"sam".encode())
    records, offset = read_jsonl(path)
    assert records == [json.loads(good)] * 2
    assert offset == path.read_bytes().rfind(b"\n") + 1
    with path.open("ab") as f:
        f.write(b'ples": 32}\n')
    more, _ = read_jsonl(path, offset=offset)
    assert more == [{"step": 2, "samples": 32}]


def test_corrupt_control_json_is_ignored_not_fatal(tmp_path):
    run = RunDir(tmp_path)
    for text in ("{", "[]", '{"seq": 3, "command": "rm -rf /"}', "\x00\xff"):
        run.control_json.write_bytes(text.encode("latin-1"))
        assert run.read_control() is None


def test_truncated_shard_is_named(tmp_path):
    """A shard cut short after the marker was written: the checkpoint is skipped with the file and sizes named."""
    from cona.trainer.checkpoint import verify_checkpoint

    source = tmp_path / "step-00000001"
    source.mkdir()
    (source / ".metadata").write_bytes(b"x")
    (source / "trainer_state.json").write_text('{"step": 1}')
    (source / "COMPLETE").write_text(json.dumps({"step": 1, "files": {".metadata": 1, "trainer_state.json": 11}}))
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    assert verify_checkpoint(copy) is None
    (copy / ".metadata").write_bytes(b"")
    assert ".metadata has 0 bytes, expected 1" in (verify_checkpoint(copy) or "")


@pytest.mark.parametrize("files", [[".metadata"], {".metadata": "1", "trainer_state.json": 11}, {".metadata": True}])
def test_a_marker_of_the_wrong_shape_is_damage_not_a_crash(tmp_path, files):
    """Valid JSON in COMPLETE whose `files` is no mapping of names to sizes crashed the check (a list) or said a
    file of the right size had the wrong one (a size given as a string)."""
    from cona.trainer.checkpoint import verify_checkpoint

    (tmp_path / ".metadata").write_bytes(b"x")
    (tmp_path / "trainer_state.json").write_text('{"step": 1}')
    (tmp_path / "COMPLETE").write_text(json.dumps({"step": 1, "files": files}))
    assert verify_checkpoint(tmp_path) == "its COMPLETE marker is unreadable (its files are not a mapping of names to sizes)"




@pytest.mark.parametrize("crc32", [[1, 2], {".metadata": 1}, {".metadata": "1", "trainer_state.json": 2}])
def test_a_checksum_map_of_the_wrong_shape_is_damage(tmp_path, crc32):
    from cona.trainer.checkpoint import verify_checkpoint

    (tmp_path / ".metadata").write_bytes(b"x")
    (tmp_path / "trainer_state.json").write_text('{"step": 1}')
    files = {".metadata": 1, "trainer_state.json": 11}
    (tmp_path / "COMPLETE").write_text(json.dumps({"step": 1, "files": files, "crc32": crc32}))
    assert verify_checkpoint(tmp_path) == (
        "its COMPLETE marker is unreadable (its crc32 is not a mapping of its files to checksums)"
    )


@pytest.mark.parametrize("state", [{"step": 1, "samples": "many"}, {"step": "1"}, {"step": 1, "lr": None},
                                   {"step": 1, "last_control_seq": True}])  # fmt: skip
def test_a_trainer_state_of_the_wrong_types_is_damage(tmp_path, state):
    """Valid JSON whose sizes match its marker: `"samples": "many"` crashed every rank at the first step of every
    relaunch (a TypeError in the target check) until the run gave up; it is skipped like a torn file instead."""
    from cona.trainer.checkpoint import verify_checkpoint

    text = json.dumps(state)
    (tmp_path / ".metadata").write_bytes(b"x")
    (tmp_path / "trainer_state.json").write_text(text)
    (tmp_path / "COMPLETE").write_text(json.dumps({"step": 1, "files": {".metadata": 1, "trainer_state.json": len(text)}}))
    assert (verify_checkpoint(tmp_path) or "").startswith("trainer_state.json is corrupt")

def _only_error_line(result) -> str:
    """The trainer's one `error:` line; fails if it printed a traceback instead."""
    assert "Traceback" not in result.stderr, describe(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith("cona trainer: error:")]
    assert len(errors) == 1, describe(result)
    return errors[0]


def test_checkpoints_of_another_job_model_or_newer_cona_are_refused_in_one_line(tmp_path):
    """Each would load (the same shapes) and train on from someone else's weights; each is refused, exit 2, with
    the file and what to do."""
    run = tmp_path / "run"
    job = write_job(tmp_path)
    assert launch(run, nproc=0, strategy=ONE, job=job, max_steps=1).returncode == 0
    state_file = RunDir(run).checkpoint_dir(1) / "trainer_state.json"

    other_job = write_job(tmp_path, name="other.yaml")
    other_job.write_text(other_job.read_text().replace("name: test-tiny-gpt", "name: someone-else"))
    result = launch(run, nproc=0, strategy=ONE, job=other_job, max_steps=2)
    assert result.returncode == 2
    line = _only_error_line(result)
    assert f"{state_file}: a checkpoint of job 'test-tiny-gpt', not of this job 'someone-else'" in line
    assert "use a new --run-dir" in line

    other_model = write_job(tmp_path, name="eps.yaml", model={"preset": "tiny-gpt", "norm_eps": 1e-6})
    result = launch(run, nproc=0, strategy=ONE, job=other_model, max_steps=2)
    assert result.returncode == 2
    assert f"{state_file}: a checkpoint of another model: norm_eps 1e-05 (this job: 1e-06)" in _only_error_line(result)

    # A newer cona's checkpoint: the manifest's sizes are kept right, so only the version can be the reason.
    data = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**data, "version": 99}))
    marker = state_file.parent / "COMPLETE"
    manifest = json.loads(marker.read_text())
    manifest["files"]["trainer_state.json"] = state_file.stat().st_size
    marker.write_text(json.dumps(manifest))
    result = launch(run, nproc=0, strategy=ONE, job=job, max_steps=2)
    assert result.returncode == 2
    assert "written by a newer cona (trainer state version 99 > 1); upgrade cona" in _only_error_line(result)


def test_deleted_shard_falls_back_to_the_older_checkpoint_and_says_so(tmp_path):
    run = tmp_path / "run"
    job = write_job(tmp_path, checkpoint={"interval_steps": 1, "keep": 5})
    assert launch(run, nproc=0, strategy=ONE, job=job, max_steps=2).returncode == 0
    shard = RunDir(run).checkpoint_dir(2) / "__0_0.distcp"
    shard.unlink()
    result = launch(run, nproc=0, strategy=ONE, job=job, max_steps=3, attempt=1)
    assert result.returncode == 0, describe(result)
    resumed = [r for r in read_jsonl(run / "samples" / "1.jsonl")[0] if "resume" in r]
    assert resumed == [{"resume": 1, "samples": 16}]
    skipped = [hb for hb in read_jsonl(run / "heartbeats" / "1.jsonl")[0] if hb.get("event") == "checkpoint-skipped"]
    assert [hb["reason"] for hb in skipped] == [f"skipping checkpoint {shard.parent}: __0_0.distcp is missing"]
    # The heartbeat is the record; the user is told once, by the warning on stderr when it happens (the progress
    # line of that heartbeat on stdout would say it again).
    said = [line for line in (result.stdout + result.stderr).splitlines() if "skipping checkpoint" in line]
    assert said == [f"cona trainer: warning: skipping checkpoint {shard.parent}: __0_0.distcp is missing"], said


def _flip_bit(path, offset: int) -> None:
    """One bit changed in place: the size stays, so only a checksum can tell."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.distributed
def test_a_flipped_bit_in_a_shard_fails_its_checksum_and_the_run_resumes_from_the_older_checkpoint(tmp_path):
    """Same size, other bytes: DCP would load such a shard without a word (a weight silently changed). Each rank
    checks the shards of its rank number against the marker's CRC-32 before the load, and all fall back together."""
    from cona.trainer.checkpoint import verify_checkpoint
    from cona.trainer.export import find_checkpoint

    run = tmp_path / "run"
    job = write_job(tmp_path, checkpoint={"interval_steps": 1, "keep": 5})
    assert launch(run, nproc=2, strategy=DP2, job=job, max_steps=2).returncode == 0
    newest = RunDir(run).checkpoint_dir(2)
    marker = json.loads((newest / "COMPLETE").read_text())
    assert marker["crc32"].keys() == marker["files"].keys()
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "trainer_state.json"} <= marker["crc32"].keys()
    shard = newest / "__1_0.distcp"  # checked by rank 1
    _flip_bit(shard, shard.stat().st_size // 2)
    assert verify_checkpoint(newest) is None  # the sizes alone see nothing
    problem = "__1_0.distcp fails its CRC-32 check: its bytes changed on storage after it was written"
    with pytest.raises(ValueError, match=re.escape(f"{newest}: {problem}; export an intact one with --step 1")):
        find_checkpoint(RunDir(run), None)

    result = launch(run, nproc=2, strategy=DP2, job=job, max_steps=3, attempt=1)
    assert result.returncode == 0, describe(result)
    resumed = [r for r in read_jsonl(run / "samples" / "1.jsonl")[0] if "resume" in r]
    assert resumed == [{"resume": 1, "samples": 16}]
    skipped = [hb["reason"] for hb in read_jsonl(run / "heartbeats" / "1.jsonl")[0] if hb.get("event") == "checkpoint-skipped"]
    assert skipped == [f"skipping checkpoint {newest}: cannot load it ({problem})"], skipped


def test_a_damaged_shard_of_a_checkpoint_without_checksums_falls_back_in_one_line(tmp_path):
    """A marker of an earlier cona has no crc32, so DCP's read is what fails: its error (a CheckpointException,
    which is no Exception) used to pass the fallback and end every relaunch in a traceback."""
    run = tmp_path / "run"
    job = write_job(tmp_path, checkpoint={"interval_steps": 1, "keep": 5})
    assert launch(run, nproc=0, strategy=ONE, job=job, max_steps=2).returncode == 0
    newest = RunDir(run).checkpoint_dir(2)
    marker = json.loads((newest / "COMPLETE").read_text())
    marker.pop("crc32", None)
    (newest / "COMPLETE").write_text(json.dumps(marker))
    shard = newest / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))  # zeros, at the size the marker lists
    # Exporting it (no checksums to check first) is refused in one line.
    from cona.trainer.hf import checkpoint_model_tensors

    with pytest.raises(ValueError) as refused:
        checkpoint_model_tensors(newest)
    text = str(refused.value)
    assert text.startswith(f"{newest}: unreadable checkpoint (") and text.endswith("use an older one (cona export --step K)")
    assert "\n" not in text, text

    result = launch(run, nproc=0, strategy=ONE, job=job, max_steps=3, attempt=1)
    assert result.returncode == 0, describe(result)
    assert "Traceback" not in result.stderr, describe(result)
    resumed = [r for r in read_jsonl(run / "samples" / "1.jsonl")[0] if "resume" in r]
    assert resumed == [{"resume": 1, "samples": 16}]
    skipped = [hb["reason"] for hb in read_jsonl(run / "heartbeats" / "1.jsonl")[0] if hb.get("event") == "checkpoint-skipped"]
    assert len(skipped) == 1 and skipped[0].startswith(f"skipping checkpoint {newest}: cannot load it ("), skipped
    assert "\n" not in skipped[0] and len(skipped[0]) < 400, skipped
