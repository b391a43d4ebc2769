"""The programs that read a run directory — `cona status`, `cona report`, `cona stop` and `cona run`'s console —
on damaged or unusual run directories, built by hand (no training needed)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import zlib

import pytest
from cona.orchestrator import cli
from cona.orchestrator.backends.base import Attempt
from cona.orchestrator.job import load_job
from cona.orchestrator.live import LiveView, print_status, status_summary
from cona.orchestrator.profile import load_profile
from cona.orchestrator.report import write_report
from cona.orchestrator.runstate import RunLock, RunState, create_run, log_event, write_state
from cona.protocol.rundir import ExitRecord, LaunchRecord, RunDir, stop_exit_reason
from cona.protocol.strategy import Strategy

from tests.conftest import EXAMPLES, PROFILES, REPO

A = Strategy.parse("dp=1,tp=1,pp=4,mbs=4,gbs=16")
B = Strategy.parse("dp=4,tp=1,pp=1,mbs=4,gbs=16")


def make_run(tmp_path, profile=PROFILES / "local-cpu.yaml") -> RunDir:
    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(profile), job=load_job(EXAMPLES / "tiny-gpt.yaml"))
    return run


def beat(**fields) -> dict:
    return {"attempt": 1, "time": 10.0, "step": 1, "samples": 16, "train_loss": 5.0, "strategy": A.to_dict(),
            "samples_per_s": 100.0, "tokens": 1024, "lr": 1e-3, "step_time_s": 0.16, **fields}  # fmt: skip


def write_beats(run: RunDir, attempt: int, records: list[dict]) -> None:
    run.heartbeats.mkdir(parents=True, exist_ok=True)
    run.heartbeat_file(attempt).write_text("".join(json.dumps(r) + "\n" for r in records))


def cona(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------------------------------------- #6: divergence


def test_a_diverged_run_gets_its_report_with_the_perplexity_clipped(tmp_path, capsys):
    """A validation loss of 1e6 (lr far too high) or 1000 made `math.exp` overflow in the report: `cona run` of a
    finished run and `cona report` ended in a traceback. The perplexity is clipped at e^50, as the trainer and the
    run model clip theirs."""
    run = make_run(tmp_path)
    log_event(run, "start", strategy=A.to_dict())
    write_beats(run, 1, [beat(time=10.0, samples=320, val_loss=1.35e6), beat(time=11.0, samples=640, val_loss=1000.0)])
    write_state(run, RunState(status="done", final=True))
    code, _, err = cona(["report", str(run.root)], capsys)
    assert code == 0 and "Traceback" not in err, err
    text = (run.root / "report.md").read_text()
    assert "best validation loss 1000.0000 (perplexity 5184705528587072" in text
    assert "target perplexity 5.5: not reached" in text


# ------------------------------------------------------------------------------------ #10: records of wrong shape


def test_event_records_of_the_wrong_shape_are_skipped_and_said_by_every_reader(tmp_path, capsys):
    """Valid JSON of the wrong shape (a launch without its strategy, a switch-complete without its cost, a switch
    whose reason is a number, a checkpoint notice without its detail) crashed status, report and the console with a
    traceback. Each reader skips them and says so in its one warning line; the good records are still used."""
    run = make_run(tmp_path)
    log_event(run, "start", strategy=A.to_dict())
    log_event(run, "launch", attempt=1, strategy=A.to_dict(), reason="initial strategy")
    log_event(run, "switch", attempt=1, **{"from": A.to_dict()}, to=B.to_dict(), reason="R 1.2× current")
    log_event(run, "launch")
    log_event(run, "switch-complete", attempt=2, kind="in_place")
    log_event(run, "switch", attempt=1, **{"from": A.to_dict()}, to=B.to_dict(), reason=5)
    log_event(run, "checkpoint-skipped", attempt=2)
    log_event(run, "launch", attempt=2, strategy={"dp": "two"}, reason="switch in place")
    write_state(run, RunState(status="done", final=True))

    capsys.readouterr()
    summary = status_summary(run)
    print_status(summary)
    out, err = capsys.readouterr()
    assert [s["reason"] for s in summary["switches"]] == ["R 1.2× current"] and summary["checkpoint_notice"] is None
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "a launch record without an attempt number" in lines[0] and "(and 4 more)" in lines[0]

    _, md = write_report(run)
    assert "| 1 |" in md.read_text() and "`d1t1p4 m4 g16` → `d4t1p1 m4 g16`" in md.read_text()
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "(and 4 more)" in lines[0]

    view = LiveView(run_dir=run, job=load_job(EXAMPLES / "tiny-gpt.yaml"), quiet=True)
    view._print_events()  # `cona run`'s console, from the start of the file
    out, err = capsys.readouterr()
    assert "cona: launch attempt 1 with d1t1p4 m4 g16" in out and out.count("cona: launch") == 1
    assert len(err.strip().splitlines()) == 1 and "(and 4 more)" in err


# ---------------------------------------------------------------------------------- #9: an unterminated tail


def test_an_unterminated_tail_that_is_no_record_is_said_but_a_torn_record_is_left_alone(tmp_path, capsys):
    """A file whose last bytes have no newline is left for its writer to finish; but bytes that no writer ever
    finishes into a record (NUL bytes a crash left in a grown file, a line that does not start with `{`) were
    dropped without a word: status showed `switches 0`, the report no loss curve, and neither warned."""
    run = make_run(tmp_path)
    log_event(run, "start", strategy=A.to_dict())
    log_event(run, "launch", attempt=1, strategy=A.to_dict(), reason="initial strategy")
    write_beats(run, 1, [beat(val_loss=5.1)])
    write_state(run, RunState(status="running"))
    capsys.readouterr()

    with open(run.events, "ab") as f:
        f.write(b'{"attempt": 1, "event": "heartbeat-gap", "ti')  # a record being written: no warning
    status_summary(run)
    write_report(run)
    assert capsys.readouterr().err == ""
    # Once the run has ended no writer is left to finish it: the record its writer was killed in (the run's last
    # `stopped` or `done`) was dropped without a word.
    write_state(run, RunState(status="done", final=True))
    status_summary(run)
    write_report(run)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(f"{run.events}: the last 44 bytes, from byte " in line for line in err), err
    assert all("hold a record cut short (its writer ended in the middle of it)" in line for line in err), err

    size = run.events.stat().st_size
    run.events.write_bytes(b"\0" * size)  # the whole file, as a crash can leave it
    assert status_summary(run)["switches"] == []
    err = capsys.readouterr().err
    assert f"{run.events}: the last {size} bytes, from byte 0, have no newline and hold NUL bytes" in err

    run.events.write_text(json.dumps({"time": 1.0, "event": "start"}) + "\nnot json and no newline")
    status_summary(run)
    assert "from byte 32, have no newline and hold no JSON record" in capsys.readouterr().err

    run.events.write_text(json.dumps({"time": 1.0, "event": "start"}) + "\n")
    beats = run.heartbeat_file(1).read_bytes()
    run.heartbeat_file(1).write_bytes(b"\0" * len(beats))
    write_report(run)
    assert f"{run.heartbeat_file(1)}: the last {len(beats)} bytes" in capsys.readouterr().err


def test_lines_json_cannot_take_are_skipped_as_damaged_not_an_error_naming_no_file(tmp_path, capsys):
    """A number of over 4,300 digits is a bare ValueError in `json.loads` (not a JSONDecodeError): `cona status`,
    `cona report` and `cona run --resume` exited 2 with Python's message and no file; a line nested 100,000 deep
    (a RecursionError) ended them in a traceback."""
    run = make_run(tmp_path)
    log_event(run, "start", strategy=A.to_dict())
    log_event(run, "launch", attempt=1, strategy=A.to_dict(), reason="initial strategy")
    write_beats(run, 1, [beat(val_loss=5.1)])
    write_state(run, RunState(status="done", final=True))
    for junk in (b'{"event": "x", "time": 1' + b"0" * 5000 + b"}\n", b"[" * 100_000 + b"]" * 100_000 + b"\n"):
        good = run.events.read_bytes()
        with open(run.events, "ab") as f:
            f.write(junk)
        with open(run.heartbeat_file(1), "ab") as f:
            f.write(junk)
        capsys.readouterr()
        assert status_summary(run)["switches"] == []
        err = capsys.readouterr().err
        assert err == f"cona: warning: skipped a damaged line, {run.events}: the line at byte {len(good)} is not a " \
                      "JSON object; the rest is used\n"  # fmt: skip
        write_report(run)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "(and 1 more)" in err and str(run.events) in err
        assert "samples: 16; steps: 1" in (run.root / "report.md").read_text()
        run.events.write_bytes(good)
        write_beats(run, 1, [beat(val_loss=5.1)])


def _ended_run_of_two_attempts(tmp_path) -> RunDir:
    """A stopped run of attempts 1 and 2 (a switch between them), as its files say."""
    run = make_run(tmp_path)
    log_event(run, "start", strategy=A.to_dict())
    log_event(run, "launch", attempt=1, strategy=A.to_dict(), reason="initial strategy")
    log_event(run, "switch", attempt=1, **{"from": A.to_dict()}, to=B.to_dict(), reason="R 1.2× current")
    log_event(run, "launch", attempt=2, strategy=B.to_dict(), reason="switch in place")
    log_event(run, "stopped", reason="stopped on request")
    write_beats(run, 1, [beat(time=10.0, samples=16), beat(time=11.0, step=2, samples=32)])
    write_beats(run, 2, [beat(attempt=2, time=12.0, step=3, samples=48, strategy=B.to_dict()),
                         beat(attempt=2, time=13.0, step=4, samples=64, strategy=B.to_dict())])  # fmt: skip
    write_state(run, RunState(status="stopped", final=True, attempts_started=2, model={"live": {"samples": 64}},
                              attempts=[Attempt(number=1, strategy=A), Attempt(number=2, strategy=B)]))  # fmt: skip
    make_checkpoint(run, 4)  # a stopped trainer checkpoints where it stops: a resume goes on from there
    return run


def test_files_lost_from_an_ended_run_are_said_by_status_and_report_not_counted_as_less(tmp_path, capsys):
    """events.jsonl deleted or emptied: `cona status` said `switches 0` and `cona report` showed no attempts and no
    switches for a run that had them; a heartbeat file deleted: the report counted the samples of the files left
    (11,904 of 16,320 in the bug hunt); state.json deleted: the report said `created` with 0 attempts. None warned."""
    run = _ended_run_of_two_attempts(tmp_path)
    capsys.readouterr()
    status_summary(run)
    write_report(run)
    assert capsys.readouterr().err == ""  # whole: nothing to say

    run.heartbeat_file(2).unlink()
    write_report(run)
    assert capsys.readouterr().err == (
        f"cona: warning: {run.heartbeat_file(2)} is missing: the report counts 32 samples from the heartbeats left, "
        "but state.json recorded 64; restore them from a backup for the whole run\n"
    )
    write_beats(run, 2, [beat(attempt=2, time=12.0, step=3, samples=48, strategy=B.to_dict())])
    write_report(run)  # cut short rather than deleted
    assert "heartbeat files in " in capsys.readouterr().err

    events = run.events.read_bytes()
    for damage in ("delete", "empty"):
        run.events.unlink() if damage == "delete" else run.events.write_bytes(b"")
        how = "is missing, though state.json lists 2 attempts (1–2)" if damage == "delete" else \
            "has no launch record of 2 attempts (1–2) that state.json lists"  # fmt: skip
        line = f"cona: warning: {run.events} {how}: the attempts and switches it logged are left out; restore it " \
               "from a backup to see them\n"  # fmt: skip
        assert status_summary(run)["switches"] == []
        assert capsys.readouterr().err == line
        write_report(run)
        assert line in capsys.readouterr().err
    run.events.write_bytes(events)

    run.state_json.unlink()
    write_report(run)
    assert capsys.readouterr().err == (f"cona: warning: {run.state_json} is missing, though {run.events} logs "
                                       "launches: the report cannot say the run's status; restore it from a backup\n")  # fmt: skip
    text = (run.root / "report.md").read_text()
    assert text.startswith("# tiny-gpt — unknown") and "attempts: 2; switches: 1" in text


def _samples_logs(run: RunDir, logs: dict[int, list[dict]]) -> None:
    run.samples_log.mkdir(parents=True, exist_ok=True)
    for attempt, records in logs.items():
        (run.samples_log / f"{attempt}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_report_vouches_for_the_sample_order_or_says_why_it_cannot(tmp_path, capsys):
    """samples/<attempt>.jsonl, the record of which samples each step trained, was read by no cona command (only by
    the tests' audit), so a damaged one went unsaid. The report now audits it: the history covers 0..N-1 once each,
    steps retrained after a crash are counted, and a damaged file is named with its line."""
    run = _ended_run_of_two_attempts(tmp_path)
    steps = [{"step": k, "start": 16 * (k - 1), "end": 16 * k} for k in range(1, 5)]
    # Attempt 1 trained steps 1–3, but its last checkpoint was at step 2: attempt 2 trains step 3 again.
    _samples_logs(run, {1: [{"resume": 0, "samples": 0}, *steps[:3]], 2: [{"resume": 2, "samples": 32}, *steps[2:]]})
    capsys.readouterr()
    write_report(run)
    assert capsys.readouterr().err == ""
    text = (run.root / "report.md").read_text()
    assert ("- sample order: the model's history covers samples 0–63 once each, in order, across 2 attempt(s) "
            "(`samples/`, audited); 1 step(s) trained again after a crash") in text, text  # fmt: skip

    for damage, why in [
        ([{"resume": 2, "samples": 32}, steps[3]], "2.jsonl line 2: step 4 follows step 2 (expected 3)"),
        ([{"resume": 2, "samples": 32}, {"step": 3, "start": 40, "end": 48}], "starts at sample 40 but the previous "
         "step ended at 32 (gap)"),
        ([{"resume": 2, "samples": 32}, [3]], "2.jsonl line 2: expected {step, start, end} or {resume, samples}"),
        ([{"resume": "2", "samples": 32}], "2.jsonl line 1: resume is '2', not a whole number"),
        ([{"resume": 2, "samples": 32}, {"step": 3, "start": 32, "end": 10**5000}], "2.jsonl line 2: not valid JSON"),
    ]:  # fmt: skip
        if damage[-1] == {"step": 3, "start": 32, "end": 10**5000}:
            (run.samples_log / "2.jsonl").write_text(json.dumps(damage[0]) + '\n{"step": 3, "start": 32, "end": '
                                                     + "9" * 5000 + "}\n")  # fmt: skip
        else:
            _samples_logs(run, {2: damage})
        write_report(run)
        err = capsys.readouterr().err
        assert err.startswith(f"cona: warning: {run.samples_log}: ") and why in err and err.count("\n") == 1, err
        assert "- sample order: not verified (" in (run.root / "report.md").read_text()

    # A torn last line is a record still being written (a run going on), not damage; a finished run whose history
    # ends short of its heartbeats says both counts, and warns that the rest went unseen (a log deleted or cut short).
    (run.samples_log / "2.jsonl").write_text(json.dumps({"resume": 2, "samples": 32}) + "\n" + json.dumps(steps[2])
                                             + '\n{"step": 4, "sta')  # fmt: skip
    write_report(run)
    err = capsys.readouterr().err
    assert err == (f"cona: warning: {run.samples_log}: the logs cover samples 0–47, but the heartbeats count 64; the "
                   "report cannot vouch for the order of the rest\n"), err
    assert "covers samples 0–47 once each" in (text := (run.root / "report.md").read_text()), text
    assert "; the heartbeats count 64 samples" in text


def test_the_newest_attempt_of_a_run_going_on_may_lack_its_launch_record_for_a_moment(tmp_path, capsys):
    """The scheduler saves state.json a moment before it logs the launch: no warning for that attempt then."""
    run = _ended_run_of_two_attempts(tmp_path)
    write_state(run, RunState(status="running", attempts_started=3, model={"live": {"samples": 64}},
                              attempts=[Attempt(number=n, strategy=A) for n in (1, 2, 3)]))  # fmt: skip
    capsys.readouterr()
    status_summary(run)
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------- #3: resuming from an older checkpoint is shown


def test_the_console_and_status_show_a_checkpoint_the_resume_passed_over(tmp_path, capsys):
    """A trainer that skips a damaged checkpoint resumes from an older one: `cona run`'s console and `cona status`
    say which and why, and the step it resumed from (from the attempt's startup.json)."""
    run = make_run(tmp_path)
    log_event(run, "launch", attempt=3, strategy=A.to_dict(), reason="relaunch after crashed")
    skipped = f"skipping checkpoint {run.checkpoint_dir(180)}: __1_0.distcp has 5000 bytes, expected 2104025"
    log_event(run, "checkpoint-skipped", attempt=3, detail=skipped)
    run.attempt_dir(3).mkdir(parents=True)
    (run.attempt_dir(3) / "startup.json").write_text(json.dumps({"load_end": 1.0, "resumed_step": 160}))
    write_state(run, RunState(status="done", final=True))
    line = f"checkpoint-skipped (attempt 3): {skipped}; attempt 3 resumed from step 160"

    view = LiveView(run_dir=run, job=load_job(EXAMPLES / "tiny-gpt.yaml"), quiet=True)
    capsys.readouterr()
    view._print_events()
    assert f"cona: {line}\n" in capsys.readouterr().out

    summary = status_summary(run)
    assert summary["checkpoint_notice"] == line
    print_status(summary)
    assert f"notice     {line}\n" in capsys.readouterr().out

    log_event(run, "checkpoint-restored", attempt=4, detail="restored step-00000200 from its interrupted re-save")
    run.attempt_dir(4).mkdir(parents=True)
    (run.attempt_dir(4) / "startup.json").write_text(json.dumps({"resumed_step": None}))  # started afresh
    assert status_summary(run)["checkpoint_notice"].endswith("re-save; attempt 4 started from step 0")


# ---------------------------------------------------------------------- #11: the latest checkpoint status names


def make_checkpoint(run: RunDir, step: int, *, shard: bytes = b"x" * 100) -> dict[str, bytes]:
    """A checkpoint directory as the trainer writes one (its files, sizes and CRC-32s in COMPLETE)."""
    files = {".metadata": b"m" * 10, "__0_0.distcp": shard,
             "trainer_state.json": json.dumps({"step": step, "samples": step * 16}).ljust(64).encode()}  # fmt: skip
    path = run.checkpoint_dir(step)
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    (path / "COMPLETE").write_text(json.dumps({"step": step, "time": 1.0, "files": {n: len(d) for n, d in files.items()},
                                               "crc32": {n: zlib.crc32(d) for n, d in files.items()}}))  # fmt: skip
    return files


def test_status_names_the_checkpoint_a_resume_would_load_not_a_damaged_newer_one(tmp_path, capsys):
    run = make_run(tmp_path)
    make_checkpoint(run, 120)
    make_checkpoint(run, 125)
    make_checkpoint(run, 130)
    assert status_summary(run)["latest_checkpoint"] == str(run.checkpoint_dir(130))
    os.truncate(run.checkpoint_dir(130) / "__0_0.distcp", 7)
    (run.checkpoint_dir(125) / "COMPLETE").write_text("")
    summary = status_summary(run)
    assert summary["latest_checkpoint"] == str(run.checkpoint_dir(120))
    assert summary["damaged_checkpoints"] == [
        {"path": str(run.checkpoint_dir(130)), "problem": "__0_0.distcp has 7 bytes, expected 100 (truncated or overwritten)"},
        {"path": str(run.checkpoint_dir(125)), "problem": "its COMPLETE marker is unreadable"},
    ]
    capsys.readouterr()
    print_status(summary)
    out = capsys.readouterr().out
    assert f"checkpoint {run.checkpoint_dir(120)}\n" in out
    assert f"passed over (a resume skips it): {run.checkpoint_dir(130)}: __0_0.distcp has 7 bytes" in out


def test_the_torch_free_checkpoint_check_names_each_damage(tmp_path):
    """`cona status` judges checkpoints without torch, by the trainer's own check (`verify_checkpoint`, below): one
    torch-free function, `cona.protocol.checkpoint_record.checkpoint_problem`, which says why for each damage."""
    from cona.protocol.checkpoint_record import checkpoint_problem

    run = make_run(tmp_path)

    def rewrite(path, text: str) -> None:  # at the same size, so that the size check passes
        path.write_text(text.ljust(path.stat().st_size))

    def marker(path, **changes) -> None:
        data = json.loads((path / "COMPLETE").read_text())
        (path / "COMPLETE").write_text(json.dumps({**data, **changes}))

    unreadable = "its COMPLETE marker is unreadable"
    damage = [
        (lambda p: None, None),
        (lambda p: os.truncate(p / "__0_0.distcp", 3), "__0_0.distcp has 3 bytes, expected 100 (truncated or overwritten)"),
        (lambda p: (p / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
        (lambda p: (p / "COMPLETE").write_text(""), unreadable),
        (lambda p: (p / "COMPLETE").unlink(), "no COMPLETE marker (it was being written when the trainer stopped)"),
        (lambda p: marker(p, files=["__0_0.distcp"]), f"{unreadable} (its files are not a mapping of names to sizes)"),
        (lambda p: marker(p, files={"__0_0.distcp": "100"}), f"{unreadable} (its files are not a mapping of names to sizes)"),
        (lambda p: marker(p, crc32={"__0_0.distcp": 1}), f"{unreadable} (its crc32 is not a mapping of its files to checksums)"),
        (lambda p: marker(p, files={"__0_0.distcp": 100}, crc32=None), "it lacks .metadata or trainer_state.json"),
        (lambda p: rewrite(p / "trainer_state.json", json.dumps({"step": 1, "samples": "many"})),
         "trainer_state.json is corrupt (samples is 'many', not a number)"),
        (lambda p: rewrite(p / "trainer_state.json", json.dumps({"samples": 1})), "trainer_state.json is corrupt"),
        (lambda p: rewrite(p / "trainer_state.json", "{"), "trainer_state.json is corrupt"),
    ]  # fmt: skip
    for step, (hurt, problem) in enumerate(damage, start=1):
        make_checkpoint(run, step)
        path = run.checkpoint_dir(step)
        hurt(path)
        assert checkpoint_problem(path) == problem, step


def test_the_trainer_checks_a_checkpoint_as_status_does():
    pytest.importorskip("torch")
    from cona.protocol.checkpoint_record import checkpoint_problem
    from cona.trainer.checkpoint import verify_checkpoint

    assert verify_checkpoint is checkpoint_problem


# ------------------------------------------------------------------------ #7: a run whose orchestrator is gone


def test_status_and_stop_of_a_run_whose_orchestrator_is_gone(tmp_path, capsys):
    """state.json says running, but no process holds the run lock (the orchestrator was SIGKILLed): status says
    it is not running and how to resume; stop writes nothing — a stop nobody acts on now would stop the next resume
    after one step. While an orchestrator holds the lock, or a trainer still writes, both work as before."""
    run = make_run(tmp_path)
    write_state(run, RunState(status="running", attempts_started=1, attempts=[Attempt(number=1, strategy=A)]))
    run.lock.write_text("4345")  # what the dead orchestrator's RunLock wrote
    write_beats(run, 1, [beat()])
    old = time.time() - 3600
    os.utime(run.heartbeat_file(1), (old, old))

    summary = status_summary(run)
    resume = f"`cona run --resume {run.root}`"
    assert summary["status"] == "not running", summary
    assert summary["reason"] == f"its orchestrator (pid 4345) is gone; resume with {resume}"
    code, out, _ = cona(["status", str(run.root)], capsys)
    assert code == 0 and f"status     not running (its orchestrator (pid 4345) is gone; resume with {resume})" in out
    code, out, _ = cona(["stop", str(run.root)], capsys)
    assert code == 0 and "is not running" in out and "nothing to stop (no stop command written)" in out, out
    assert resume in out and run.read_control() is None

    with RunLock(run.lock):  # an orchestrator drives it
        assert status_summary(run)["status"] == "running" and status_summary(run)["orphaned"] is None
        code, out, _ = cona(["stop", str(run.root)], capsys)
        assert code == 0 and out.startswith(f"asked {run.root} to stop: the trainer checkpoints")
        assert run.read_control().command == "stop"
    run.control_json.unlink()
    run.lock.write_text("4345")  # RunLock wrote this process's pid

    os.utime(run.heartbeat_file(1))  # the orchestrator is gone but its trainer trains on (a resume adopts it)
    summary = status_summary(run)
    assert summary["status"] == "running" and "is gone, but attempt 1's trainer wrote" in summary["reason"]
    code, out, _ = cona(["stop", str(run.root)], capsys)
    assert code == 0 and "its orchestrator (pid 4345) is gone, but attempt 1's trainer is still writing" in out
    assert run.read_control().command == "stop"  # the trainer reads control.json itself

    # No heartbeat yet, only the launch record: it was launched, not seen training ("its trainer wrote" said so).
    run.heartbeat_file(1).unlink()
    run.launch_file(1).parent.mkdir(parents=True, exist_ok=True)
    run.launch_file(1).write_text("{}")
    summary = status_summary(run)
    assert summary["status"] == "running" and "is gone, but attempt 1 was launched " in summary["reason"]
    assert "ago and has sent no heartbeat yet: it may be starting" in summary["reason"], summary["reason"]


def _orphan(tmp_path, *, backend_id: str = "", extra: dict | None = None, **state) -> RunDir:
    """A run whose orchestrator (pid 4345) is gone, attempt 1 current in state.json."""
    run = make_run(tmp_path)
    write_state(run, RunState(status="running", attempts_started=1, attempts=[
        Attempt(number=1, strategy=A, backend_id=backend_id, extra=extra or {})], **state))  # fmt: skip
    run.lock.write_text("4345")
    return run


def test_status_and_stop_follow_the_trainer_of_an_in_place_switch_its_orchestrator_did_not_see(tmp_path, capsys):
    """Ctrl-C of `cona run` during an in-place switch: attempt 1's exit record says its processes went on as attempt
    2, which trains on. Status said "not running" (attempt 1 had an exit record) and showed the orchestrator's last
    progress; it follows the processes to attempt 2, its strategy and the progress its heartbeats report, and a stop
    is addressed to attempt 2's trainer."""
    run = _orphan(tmp_path, model={"live": {"step": 30, "samples": 480, "train_loss": 3.0, "eta_s": 12.0}})
    run.write_exit(1, ExitRecord(exit_code=42, name="SWITCH", reason="switch in place", step=30, time=time.time(),
                                 next_attempt=2, next_strategy=B))  # fmt: skip
    run.write_launch(LaunchRecord(attempt=2, strategy=B, backend="local", written_at=time.time(), in_place=True))
    write_beats(run, 2, [beat(attempt=2, strategy=B.to_dict(), step=31, samples=496, train_loss=2.9),
                         beat(attempt=2, strategy=B.to_dict(), step=40, samples=640, train_loss=2.5, val_loss=1.0)])  # fmt: skip

    summary = status_summary(run)
    assert summary["status"] == "running" and "is gone, but attempt 2's trainer wrote" in summary["reason"], summary
    assert (summary["attempt"], summary["strategy"]) == (2, B.to_dict())
    assert (summary["step"], summary["samples"], summary["train_loss"], summary["val_samples"]) == (40, 640, 2.5, 640)
    assert summary["eta_s"] is None  # nobody estimates it now
    code, out, _ = cona(["status", str(run.root)], capsys)
    assert f"attempt    2 with {B.short()}" in out and "progress   step 40, 640 samples" in out, out
    assert f"from {run.heartbeat_file(2)} (no orchestrator reads it)" in out
    code, out, _ = cona(["stop", str(run.root)], capsys)
    assert code == 0 and "but attempt 2's trainer is still writing" in out, out
    assert (run.read_control().command, run.read_control().attempt) == ("stop", 2)


def test_status_takes_the_newer_progress_of_the_trainer_from_where_the_orchestrator_stopped_reading(tmp_path):
    """The orchestrator was killed after reading 2 heartbeats; the trainer wrote 2 more: status shows those."""
    run = _orphan(tmp_path)
    write_beats(run, 1, [beat(step=1, samples=16), beat(step=2, samples=32)])
    offset = run.heartbeat_file(1).stat().st_size
    state = RunState.from_dict({**json.loads(run.state_json.read_text()), "heartbeat_offset": offset,
                                "model": {"live": {"step": 2, "samples": 32, "train_loss": 5.0}}})  # fmt: skip
    write_state(run, state)
    assert (status_summary(run)["step"], status_summary(run)["progress_from"]) == (2, None)  # nothing newer
    with open(run.heartbeat_file(1), "a") as f:
        f.write(json.dumps(beat(step=7, samples=112, train_loss=4.0, step_time_s=0.2, samples_per_s=80.0)) + "\n")
    summary = status_summary(run)
    assert (summary["step"], summary["samples"], summary["train_loss"], summary["samples_per_s"]) == (7, 112, 4.0, 80.0)


def test_a_trainer_that_ended_after_its_orchestrator_is_said_gone_and_not_stopped(tmp_path, capsys):
    """The orchestrator was SIGKILLed, then a trainer worker crashed: no exit record, and the last heartbeat is
    recent. Status said the trainer "may train on unattended" and `cona stop` wrote a stop that the next resume's
    relaunch served after one step. The backend tells that its processes are gone."""
    gone = subprocess.Popen(["true"])  # stands in for the attempt's wrapper, ended
    gone.wait()
    run = _orphan(tmp_path, backend_id=str(gone.pid), extra={"host": socket.gethostname()})
    write_beats(run, 1, [beat()])  # written just now
    summary = status_summary(run)
    assert summary["status"] == "not running", summary
    assert ("its orchestrator (pid 4345) is gone, and so is attempt 1's trainer (its processes are gone, without an "
            "exit record)") in summary["reason"]  # fmt: skip
    code, out, _ = cona(["stop", str(run.root)], capsys)
    assert code == 0 and "attempt 1's trainer is gone too" in out and "no stop command written" in out, out
    assert run.read_control() is None

    # Alive (this process stands in for the attempt's wrapper), or on another machine: as before.
    from cona.protocol.procstat import start_time

    write_state(run, RunState(status="running", attempts_started=1, attempts=[Attempt(
        number=1, strategy=A, backend_id=str(os.getpid()), extra={"start_time": start_time(os.getpid())})]))  # fmt: skip
    assert "is gone, but attempt 1's trainer wrote" in status_summary(run)["reason"]
    write_state(run, RunState(status="running", attempts_started=1, attempts=[Attempt(
        number=1, strategy=A, backend_id=str(gone.pid), extra={"host": "elsewhere"})]))  # fmt: skip
    assert "is gone, but attempt 1's trainer wrote" in status_summary(run)["reason"]

    # An exit record says how it ended; one that served a stop (`cona stop` reached it) leaves the run stopped.
    run.write_exit(1, ExitRecord(exit_code=1, name="CRASH", reason="step 7: loss nan", step=5, time=time.time()))
    assert "and so is attempt 1's trainer (it exited CRASH)" in status_summary(run)["reason"]
    run.write_exit(1, ExitRecord(exit_code=43, name="STOPPED", reason=stop_exit_reason(1), step=5, time=time.time()))
    summary = status_summary(run)
    assert summary["status"] == "stopped" and summary["reason"].startswith("attempt 1's trainer served a stop command")
    code, out, _ = cona(["stop", str(run.root)], capsys)
    assert code == 0 and "is stopped already" in out and run.read_control() is None, out


def test_a_slurm_trainer_that_ended_after_its_orchestrator_is_said_gone(tmp_path, capsys, monkeypatch):
    """As on the local backend, with the job's state from Slurm (`SlurmBackend.gone`): a job that crashed after its
    orchestrator was killed was shown as a trainer that "may train on unattended" for the heartbeat timeout, and
    `cona stop` wrote a stop the next resume served. A job Slurm still runs, or a Slurm that does not answer: as
    before."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    answer = bin_dir / "scontrol.out"

    def clients(scontrol: str) -> None:
        answer.write_text(scontrol)
        for name, body in (("scontrol", f"cat '{answer}'; grep -q JobId= '{answer}' || exit 1"),
                           ("sacct", "echo 'sacct: error: Slurm accounting storage is disabled' >&2; exit 1")):  # fmt: skip
            (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
            (bin_dir / name).chmod(0o755)

    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run = make_run(tmp_path, profile=PROFILES / "local-slurm.yaml")
    write_state(run, RunState(status="running", attempts_started=1, attempts=[Attempt(
        number=1, strategy=A, backend_id="101", extra={"submission": "s1"})]))  # fmt: skip
    run.lock.write_text("4345")
    write_beats(run, 1, [beat()])  # written just now

    clients("slurm_load_jobs error: Invalid job id specified\n")  # ended and purged
    summary = status_summary(run)
    assert summary["status"] == "not running", summary
    assert "and so is attempt 1's trainer (its processes are gone, without an exit record)" in summary["reason"]
    code, out, _ = cona(["stop", str(run.root)], capsys)
    assert code == 0 and "attempt 1's trainer is gone too" in out and "no stop command written" in out, out
    assert run.read_control() is None
    clients("JobId=101 JobName=r JobState=FAILED Reason=NonZeroExitCode Restarts=0 ExitCode=1:0 NodeList=n1\n")
    assert status_summary(run)["status"] == "not running"

    for scontrol in ("JobId=101 JobName=r JobState=RUNNING Reason=None Restarts=0 ExitCode=0:0 NodeList=n[1-2]\n",
                     "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n"):  # fmt: skip
        clients(scontrol)
        assert "is gone, but attempt 1's trainer wrote" in status_summary(run)["reason"], scontrol


def test_a_run_without_a_lock_file_or_on_kubernetes_is_not_judged_by_the_lock(tmp_path, capsys):
    """No orchestrator.lock: none ever ran here, or it cannot be told; a Kubernetes run is kept apart by a Lease in
    the API, not by this file. Both are shown and stopped as before."""
    run = make_run(tmp_path)
    write_state(run, RunState(status="running", attempts_started=1, attempts=[Attempt(number=1, strategy=A)]))
    assert status_summary(run)["status"] == "running"

    k8s = make_run(tmp_path / "k8s", profile=REPO / "manifests" / "profiles" / "h100-k8s.yaml")
    write_state(k8s, RunState(status="running", attempts_started=1, attempts=[Attempt(number=1, strategy=A)]))
    k8s.lock.write_text("4345")
    assert status_summary(k8s)["status"] == "running"
    code, out, _ = cona(["stop", str(k8s.root)], capsys)
    assert code == 0 and out.startswith(f"asked {k8s.root} to stop: the trainer checkpoints")
    assert k8s.read_control().command == "stop"


def test_a_report_that_cannot_be_written_in_the_run_directory_points_to_out(tmp_path, capsys, monkeypatch):
    """A run directory on a read-only mount (an archive, another user's run) is still readable: the one line says
    the report can go elsewhere with --out (root writes through chmod, so the mount is simulated)."""
    import errno

    from cona.orchestrator import report

    run = make_run(tmp_path)
    write_state(run, RunState(status="done", final=True))

    def read_only(run_dir, *, out_dir=None):
        if out_dir is None:
            raise OSError(errno.EROFS, "Read-only file system", str(run_dir.root / "report.png"))
        return write_report(run_dir, out_dir=out_dir)

    monkeypatch.setattr(report, "write_report", read_only)
    code, _, err = cona(["report", str(run.root)], capsys)
    assert code == 2 and err == (f"cona: error: {run.root / 'report.png'}: Read-only file system; write the report "
                                 "elsewhere with --out DIR\n")  # fmt: skip
    code, _, err = cona(["report", str(run.root), "--out", str(tmp_path / "elsewhere")], capsys)
    assert code == 0 and (tmp_path / "elsewhere" / "report.md").exists(), err


def test_a_non_finite_time_or_loss_in_a_record_is_no_record(tmp_path, capsys):
    """Python's json reads `1e999` as inf and `NaN` as nan: a `done` event at time inf made the report's wall time
    "inf s", and a heartbeat's NaN validation loss its "best validation loss nan"."""
    from cona.orchestrator.runstate import event_problem

    assert event_problem({"event": "done", "time": float("inf")}) == "a done record without a numeric time"
    assert event_problem({"event": "done", "time": float("nan")}) is not None
    run = _ended_run_of_two_attempts(tmp_path)
    write_beats(run, 3, [beat(attempt=3, time=14.0, step=5, samples=80, val_loss=float("nan")),
                         beat(attempt=3, time=15.0, step=6, samples=96, val_loss=2.5)])  # fmt: skip
    write_report(run)
    text = (run.root / "report.md").read_text()
    assert "- best validation loss 2.5000" in text and "nan" not in text, text


# ------------------------------------------------------------------ a FIFO (or a device) in the run directory


def _fifo_in_place_of(path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


@pytest.mark.timeout(120)  # without the refusal each reader waits on the FIFO for ever
def test_a_fifo_in_the_run_directory_is_refused_by_every_reader_not_waited_on(tmp_path, capsys):
    """`cona status RUN` with RUN/state.json a FIFO blocked for ever (an open for reading waits for a writer), as did
    every other reader of a run-directory file and the appenders of events and heartbeats (an open for writing
    waits for a reader). One function (`rundir.open_regular_fd`) opens them without blocking and refuses anything
    but a regular file, in one line naming it; within a checkpoint it is damage, which a resume passes over."""
    from cona.trainer.export import main as export

    run = _ended_run_of_two_attempts(tmp_path)
    _samples_logs(run, {1: [{"step": 1, "start": 0, "end": 16}]})

    def refused(path) -> str:
        return (f"cona: error: {path} is a FIFO (named pipe), not a regular file; cona keeps only regular files in a "
                "run directory: remove it, or put back the file it replaced\n")  # fmt: skip

    readers = {run.state_json: ("status", "report", "stop"), run.run_yaml: ("status", "report", "stop"),
               run.events: ("status", "report"), run.heartbeat_file(1): ("report",),
               run.samples_log / "1.jsonl": ("report",)}  # fmt: skip
    for path, commands in readers.items():
        kept = path.read_bytes()
        _fifo_in_place_of(path)
        for command in commands:
            code, _, err = cona([command, str(run.root)], capsys)
            assert (code, err) == (2, refused(path)), (command, path)
        path.unlink()
        path.write_bytes(kept)
    kept = run.run_yaml.read_bytes()
    _fifo_in_place_of(run.run_yaml)  # `cona export` reads the job's data from run.yaml (of the run's checkpoint 4)
    assert export([str(run.root), "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == refused(run.run_yaml)
    run.run_yaml.unlink()
    run.run_yaml.write_bytes(kept)

    # An appender (`cona stop`'s event, a trainer's heartbeat) with nobody reading the FIFO: refused, not blocked.
    from cona.protocol.rundir import NotRegularFile, append_jsonl

    with pytest.raises(NotRegularFile, match=r"heartbeats/9\.jsonl is a FIFO"):
        os.mkfifo(run.heartbeat_file(9))
        append_jsonl(run.heartbeat_file(9), {"attempt": 9})

    # The lock of a run that says running: `cona status` looks whether an orchestrator holds it.
    write_state(run, RunState(status="running", attempts_started=2, attempts=[Attempt(number=2, strategy=B)]))
    _fifo_in_place_of(run.lock)
    code, _, err = cona(["status", str(run.root)], capsys)
    assert (code, err) == (2, refused(run.lock))

    # Inside a checkpoint a FIFO is damage: the resume (and `cona status`) passes the checkpoint over, saying why.
    run.lock.unlink()
    _fifo_in_place_of(run.checkpoint_dir(4) / "COMPLETE")
    summary = status_summary(run)
    assert summary["damaged_checkpoints"] == [
        {"path": str(run.checkpoint_dir(4)), "problem": "its COMPLETE marker is not a regular file"}]


def test_the_report_of_a_failed_run_rolls_back_the_steps_after_its_last_checkpoint(tmp_path, capsys):
    """The last attempt of a failed run trained steps 3 and 4 after its checkpoint at step 2 and crashed: a resume
    goes on from step 2 and trains them again, but the report counted them as the model's history (samples 0–63)."""
    run = _ended_run_of_two_attempts(tmp_path)
    shutil.rmtree(run.checkpoint_dir(4))
    make_checkpoint(run, 2)
    write_state(run, RunState(status="failed", final=True, attempts_started=2, model={"live": {"samples": 64}},
                              reason="attempt 2 crashed", attempts=[Attempt(number=1, strategy=A),
                                                                    Attempt(number=2, strategy=B)]))  # fmt: skip
    steps = [{"step": k, "start": 16 * (k - 1), "end": 16 * k} for k in range(1, 5)]
    _samples_logs(run, {1: [{"resume": 0, "samples": 0}, *steps[:2]], 2: [{"resume": 2, "samples": 32}, *steps[2:]]})
    capsys.readouterr()
    write_report(run)
    assert capsys.readouterr().err == ""
    text = (run.root / "report.md").read_text()
    assert "- samples: 64 trained, 32 kept; steps: 4 trained, 2 kept (the rest rolled back, see the sample order); " in text
    assert ("- sample order: the model's history covers samples 0–31 once each, in order, across 2 attempt(s) "
            "(`samples/`, audited); rolled back: 2 step(s) after checkpoint `step-00000002` (step 2), samples 32–63, "
            "trained by the attempt that ended the run and lost with it") in text, text  # fmt: skip

    shutil.rmtree(run.checkpoint_dir(2))  # no checkpoint at all: a resume starts from sample 0
    write_report(run)
    text = (run.root / "report.md").read_text()
    assert ("the model's history holds no sample yet, across 2 attempt(s) (`samples/`, audited); rolled back: 4 "
            "step(s) after the start (no complete checkpoint), samples 0–63") in text, text  # fmt: skip
