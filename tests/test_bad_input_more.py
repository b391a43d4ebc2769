"""Bad input found by a bug hunt (docs/reliability.md): a crash's recorded reason in the final line, advice that can
be followed after the trainer refuses its input, the trainer's input checked before a run directory exists, an
evaluation set larger than the held-out split, a `--run-dir` full of the user's files, misspelled options of the
data plane's programs, the missing-data hint, and a backend without its clients. Fast: no trainer process but one
in-process refusal."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess

import numpy as np
import pytest
from cona.orchestrator import cli
from cona.orchestrator.backends.base import Attempt, BackendError
from cona.orchestrator.job import load_job
from cona.orchestrator.profile import load_profile
from cona.orchestrator.runstate import create_run, event_line, read_events, read_state
from cona.orchestrator.scheduler import RunFailed, Scheduler
from cona.protocol.inputs import FIX_EITHER, FIX_FILES, FIX_JOB, InputRefused, check_inputs
from cona.protocol.job import job_from_dict
from cona.protocol.rundir import ExitCode, ExitRecord, RunDir
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

from tests.conftest import EXAMPLES, PROFILES
from tests.test_scheduler import ScriptedBackend, make_scheduler
from tests.trainer_helpers import corpus_path

PROFILE = PROFILES / "local-cpu.yaml"
JOB = EXAMPLES / "tiny-gpt.yaml"


def run_cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return code, err.getvalue()


def error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# H2: a crash's recorded reason reaches the final line and the failure event ---------------------------------


def _crashing(tmp_path, reasons, *overrides):
    """A scheduler whose attempt n crashes with `reasons(n)` recorded by its trainer."""

    def trainer_crashes(live) -> None:
        for number, _ in backend.launched:
            if number not in backend.exit_codes:
                sched.run_dir.write_exit(number, ExitRecord(exit_code=1, name="CRASH", reason=reasons(number), step=None,
                                                            time=1.0))  # fmt: skip
                backend.exit_codes[number] = 1

    sched, backend = make_scheduler(tmp_path, *overrides, on_update=trainer_crashes)
    return sched, backend


def test_the_final_line_of_a_crashing_run_says_what_the_trainer_recorded(tmp_path):
    def reason(number: int) -> str:
        return f"step {number}: loss nan, gradient norm² nan; lower optimizer.lr"

    sched, _ = _crashing(tmp_path, reason, "policy.max_restarts=1")
    with pytest.raises(RunFailed) as info:
        sched.run()
    assert str(info.value).startswith(f"attempt 2 crashed (exit 1): {reason(2)}; gave up after 1 restarts; logs: ")
    assert [e.get("reason") for e in read_events(sched.run_dir) if e["event"] == "failure"] == [reason(1)]
    assert read_state(sched.run_dir).reason.startswith(f"attempt 2 crashed (exit 1): {reason(2)}")


def test_a_crashing_run_s_events_read_as_lines_not_dict_reprs(tmp_path):
    """`cona run`'s console prints failure, disruption, pending... events in one line each (`event_line`): their
    fields by name and a strategy in its short form, the trainer's reason last, never the record's Python repr."""
    reason = "step 1: loss nan, gradient norm² nan; lower optimizer.lr"
    sched, _ = _crashing(tmp_path, lambda number: reason if number == 1 else "", "policy.max_restarts=1")
    with pytest.raises(RunFailed):
        sched.run()
    events = read_events(sched.run_dir)
    lines = [event_line(e) for e in events]
    assert not [line for line in lines if "{'" in line or "['" in line or "': " in line], lines
    strategy = Strategy.from_dict(next(e for e in events if e["event"] == "failure")["strategy"]).short()
    # events.jsonl keeps its fields sorted by name: so does the line.
    assert f"failure: attempt 1, backoff_s=1, exit_code=1, kind=crashed, restart=1, strategy={strategy}: {reason}" in lines
    failed = next(e for e in events if e["event"] == "failed")
    assert event_line(failed) == f"failed: {failed['reason']}"
    disruption = {"time": 1.0, "event": "disruption", "attempt": 2, "detail": "pod w-0 on node n1: PreemptionByScheduler",
                  "checkpoint": None, "without_progress": 0, "restarts": 0, "lost": ["n1", "n2"]}  # fmt: skip
    assert event_line(disruption) == ("disruption: attempt 2, without_progress=0, restarts=0, lost=(n1, n2): pod w-0 on "
                                      "node n1: PreemptionByScheduler")  # fmt: skip


def test_a_crash_that_replays_in_the_same_words_is_not_relaunched_again(tmp_path):
    """From the same checkpoint under the same strategy a relaunch replays the crash: the second time the trainer
    explains it in the same words, the run fails, not after max_restarts more allocations."""
    same = "step 7: loss nan, gradient norm² nan; lower optimizer.lr"
    sched, backend = _crashing(tmp_path, lambda number: same, "policy.max_restarts=5")
    with pytest.raises(RunFailed) as info:
        sched.run()
    assert str(info.value).startswith(f"attempt 2 crashed as attempt 1 did, under the same strategy: {same}; a "
                                      "relaunch would replay it, so the run stops here (not after 5 restarts)")  # fmt: skip
    assert [number for number, _ in backend.launched] == [1, 2]
    # An unexplained exit (no reason recorded) says nothing about the next try: relaunched up to the limit.
    other, backend = _crashing(tmp_path / "unexplained", lambda number: "", "policy.max_restarts=2")
    with pytest.raises(RunFailed, match="gave up after 2 restarts"):
        other.run()
    assert [number for number, _ in backend.launched] == [1, 2, 3]


def test_a_hung_attempt_s_stop_record_is_not_given_as_the_crash_s_reason(tmp_path):
    """A hang is cancelled with SIGTERM, and the trainer records `STOPPED`: that is no cause of the failure."""
    def stopped_then_cancelled(live) -> None:
        for number, _ in backend.launched:
            if number not in backend.exit_codes:
                sched.run_dir.write_exit(number, ExitRecord(exit_code=int(ExitCode.STOPPED), name="STOPPED",
                                                            reason="signal SIGTERM (1 rank)", step=None, time=1.0))  # fmt: skip
                backend.exit_codes[number] = 1

    sched, backend = make_scheduler(tmp_path, "policy.max_restarts=0", on_update=stopped_then_cancelled)
    with pytest.raises(RunFailed) as info:
        sched.run()
    assert "SIGTERM" not in str(info.value) and str(info.value).startswith("attempt 1 crashed (exit 1); gave up")


def test_the_trainer_blames_the_model_not_the_lr_when_nothing_was_updated_yet():
    from cona.trainer.train import diverged_reason

    nan = float("nan")
    first = diverged_reason(step=1, loss=nan, grad_sqnorm=nan, first_val={"step": 0, "val_loss": 5.5})
    assert "lower optimizer.lr" not in first and "before any update" in first and "model.norm_eps" in first
    late = diverged_reason(step=9, loss=nan, grad_sqnorm=nan, first_val={"step": 0, "val_loss": nan})
    assert "validation was already nan at step 0" in late and "lower optimizer.lr" not in late
    assert diverged_reason(step=9, loss=nan, grad_sqnorm=nan, first_val={"step": 0, "val_loss": 5.5}).endswith(
        "; lower optimizer.lr")
    assert diverged_reason(step=9, loss=nan, grad_sqnorm=1.0, first_val=None).endswith("; lower optimizer.lr")


# M1: advice that can be followed, from where the refusal record says the fix lies ------------------------------


@pytest.mark.parametrize(
    ("fix", "advice"),
    [
        (FIX_JOB, "a run's job cannot change: start a new run (another --run-dir) with the corrected job; logs: "),
        (FIX_FILES, "fix the files and resume with `cona run --resume {root}`; logs: "),
        (FIX_EITHER, "fix files on disk and resume with `cona run --resume {root}`, or, for a job field, start a new "
                     "run (another --run-dir) with the corrected job; logs: "),
    ],
)  # fmt: skip
def test_a_refusal_is_answered_by_where_its_fix_lies(tmp_path, fix, advice):
    reason = "model.vocab_size=100: a byte-level corpus needs at least 256; set model.vocab_size: 256"

    def trainer_refuses(live) -> None:
        record = ExitRecord(exit_code=int(ExitCode.CONFIG), name="CONFIG", reason=reason, step=None, time=1.0)
        sched.run_dir.exit_file(1).write_text(json.dumps({**record.to_dict(), "fix": fix}))
        backend.exit_codes = {1: ExitCode.CONFIG}

    sched, backend = make_scheduler(tmp_path, on_update=trainer_refuses)
    with pytest.raises(RunFailed) as info:
        sched.run()
    assert str(info.value).startswith(f"attempt 1 refused its input: {reason}; {advice.format(root=sched.run_dir.root)}")


def test_the_trainer_s_refusal_record_says_where_the_fix_lies(tmp_path, monkeypatch):
    """In process, before any process group: `python -m cona.trainer` on a byte corpus with a vocabulary of 100."""
    from cona.trainer.main import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    with pytest.raises(SystemExit) as info:
        main(["--run-dir", str(run.root), "--job", str(JOB), "--set", "model.vocab_size=100", "--set",
              f"data.path={corpus_path()}", "--strategy", "dp=1,tp=1,pp=1,mbs=8,gbs=8"])  # fmt: skip
    assert info.value.code == ExitCode.CONFIG
    record = json.loads(run.exit_file(0).read_text())
    assert record["fix"] == FIX_JOB and record["reason"].startswith("model.vocab_size=100: a byte-level corpus")
    assert run.read_exit(0).exit_code == ExitCode.CONFIG  # still an exit record as every reader knows it
    assert run.read_exit(0).fix == FIX_JOB  # and the typed record carries where the fix lies


@pytest.mark.parametrize("fix", [FIX_JOB, FIX_FILES, FIX_EITHER, None])
def test_an_exit_record_round_trips_its_fix(tmp_path, fix):
    record = ExitRecord(exit_code=int(ExitCode.CONFIG), name="CONFIG", reason="data.path: empty", step=None, time=1.0,
                        fix=fix)  # fmt: skip
    data = record.to_dict()
    # Only a refusal's record has the key: every other exit.json is written as before.
    assert ("fix" in data) == (fix is not None) and data.get("fix") == fix
    assert ExitRecord.from_dict(data) == record
    run = RunDir(tmp_path / "run")
    run.attempt_dir(1).mkdir(parents=True)
    run.write_exit(1, record)
    assert run.read_exit(1) == record


@pytest.mark.parametrize("fix", ["bogus", 3, ["job"], None])
def test_an_exit_record_with_no_known_fix_still_reads(tmp_path, fix):
    """An exit.json from before the field, or with a value this version does not know (a newer trainer's, a hand
    edit), reads as a record without advice, not as no record at all."""
    data = {"exit_code": int(ExitCode.CONFIG), "name": "CONFIG", "reason": "data.path: empty", "step": None,
            "time": 1.0, **({} if fix is None else {"fix": fix})}  # fmt: skip
    run = RunDir(tmp_path / "run")
    run.attempt_dir(1).mkdir(parents=True)
    run.exit_file(1).write_text(json.dumps(data))
    record = run.read_exit(1)
    assert record is not None and record.exit_code == ExitCode.CONFIG and record.fix is None
    assert "fix" not in record.to_dict()


def test_the_refusal_advice_follows_the_record_it_is_given(tmp_path):
    """The scheduler advises from the exit record it already read, not from the file again."""
    sched, _ = make_scheduler(tmp_path)
    base = ExitRecord(exit_code=int(ExitCode.CONFIG), name="CONFIG", reason="r", step=None, time=1.0)
    assert not sched.run_dir.exit_file(1).exists()
    assert sched._refusal_advice(dataclasses.replace(base, fix=FIX_JOB)).startswith("a run's job cannot change: ")
    assert sched._refusal_advice(dataclasses.replace(base, fix=FIX_FILES)).startswith("fix the files and resume ")
    assert sched._refusal_advice(base).startswith("fix files on disk and resume with ")


# M1, M4: the trainer's input checked before the run directory exists ---------------------------------------------


def test_the_cheap_refusals_and_where_their_fix_lies(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "no-text").mkdir()
    (tmp_path / "no-text" / "a.bin").write_bytes(bytes(4))
    (tmp_path / "odd.bin").write_bytes(bytes(1001))
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "tokens.json").write_text('{"vocab_size": 50, "token_dtype": "uint16"}')
    (tmp_path / "init").mkdir()
    cases = [
        ({"path": str(tmp_path / "empty.txt")}, {}, "0 tokens are too few for seq_len=64", FIX_EITHER),
        ({"path": str(tmp_path / "no-text")}, {}, "the directory holds no text files", FIX_EITHER),
        ({"path": str(tmp_path / "odd.bin")}, {}, "odd.bin: size 1001 is not a multiple of 2 bytes; check "
                                                  "data.token_dtype (now uint16)", FIX_EITHER),
        ({"path": str(tmp_path / "prepared")}, {}, "tokens.json but no tokens.bin; run cona data prepare again", FIX_FILES),
        ({"path": str(corpus_path())}, {"init_from": str(tmp_path / "init")}, "model.init_from", FIX_EITHER),
        ({"path": str(corpus_path())}, {"vocab_size": 100}, "model.vocab_size=100: a byte-level corpus needs at "
                                                            "least 256", FIX_JOB),
    ]  # fmt: skip
    for data, model, expected, fix in cases:
        job = job_from_dict({"model": {"preset": "tiny-gpt", **model}, "data": data})
        with pytest.raises(InputRefused) as info:
            check_inputs(job, source="job.yaml")
        assert str(info.value).startswith("job.yaml: ") and expected in str(info.value), (data, str(info.value))
        assert info.value.fix == fix, (data, info.value.fix)
    init = job_from_dict({"model": {"preset": "tiny-gpt", "init_from": str(tmp_path / "init")},
                          "data": {"path": str(corpus_path())}})  # fmt: skip
    assert "no config.json in it" in _refusal(init)


def _refusal(job) -> str:
    with pytest.raises(InputRefused) as info:
        check_inputs(job)
    return str(info.value)


def test_an_evaluation_set_larger_than_the_held_out_split_is_refused_before_and_in_the_trainer(tmp_path):
    """`eval.num_windows=1000000` made the first evaluation run for hours: one line naming it and the maximum,
    from `cona run` (file sizes) and from the trainer (the tokens read), the same check."""
    from cona.trainer.data import load_corpus

    (np.arange(20_000) % 1000).astype(np.uint16).tofile(tmp_path / "a.bin")  # 1,000 held out: 15 windows of 65
    np.save(tmp_path / "b.npy", (np.arange(20_000) % 1000).astype(np.uint32))  # its size says nothing: the trainer's
    for name, before in (("a.bin", True), ("b.npy", False)):
        job = job_from_dict({"model": {"preset": "tiny-gpt", "vocab_size": 1000}, "data": {"path": str(tmp_path / name)},
                             "eval": {"num_windows": 16}})  # fmt: skip
        expected = (f"eval.num_windows=16: the held-out split of data.path '{tmp_path / name}' (1000 tokens, "
                    "data.val_fraction=0.05) holds 15 windows of 65 tokens; set eval.num_windows to at most 15")  # fmt: skip
        if before:
            assert _refusal(job) == expected
        else:
            check_inputs(job)
        with pytest.raises(InputRefused) as info:
            load_corpus(job)
        assert str(info.value) == expected and info.value.fix == FIX_JOB
        load_corpus(job.model_copy(update={"eval": job.eval.model_copy(update={"num_windows": 15})}))


def test_cona_run_refuses_bad_input_files_before_the_run_directory_exists(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    run = tmp_path / "run"
    for setting, expected in [
        (f"data.path={tmp_path / 'empty.txt'}", "0 tokens are too few"),
        ("eval.num_windows=1000000", "eval.num_windows=1000000: the held-out split"),
    ]:  # fmt: skip
        code, err = run_cli(["run", "--profile", str(PROFILE), "--job", str(JOB), "--set", f"data.path={corpus_path()}",
                             "--set", setting, "--run-dir", str(run)])  # fmt: skip
        line = error_line(err)
        assert code == 2 and f"{JOB}: " in line and expected in line, err
        assert not run.exists()


# L1: the missing-data hint fits the data ---------------------------------------------------------------------------


def test_the_missing_data_hint_fits_what_the_job_names(tmp_path):
    profile, job = load_profile(PROFILE), load_job(EXAMPLES / "gpt3-1.3b.yaml")
    with pytest.raises(InputRefused) as info:
        check_inputs(job, source="examples/gpt3-1.3b.yaml")
    message = str(info.value)
    assert message.startswith("examples/gpt3-1.3b.yaml: data.path 'data/openwebtext-gpt2.bin' does not exist; ")
    assert "cona data prepare" in message and "--set data.path=" in message and "shakespeare" not in message.lower()
    with pytest.raises(ConfigError, match="cona data prepare") as created:  # create_run's own check says the same
        create_run(run_dir=RunDir(tmp_path / "r"), profile=profile, job=job)
    assert "fetch_shakespeare" not in str(created.value)
    default = job_from_dict({"model": {"preset": "tiny-gpt"}, "data": {"path": str(tmp_path / "shakespeare.txt")}})
    assert f"`python scripts/fetch_shakespeare.py {tmp_path / 'shakespeare.txt'}`" in _refusal(default)


# M10: a --run-dir full of the user's files ---------------------------------------------------------------------


def test_a_file_given_as_a_run_directory_is_said_to_be_a_file(tmp_path):
    """`cona export FILE` said "no such run directory" and `cona status/stop/report FILE` and `cona run --resume
    FILE` "not a cona run directory (no run.yaml)", as if the path did not exist or were a directory; `cona run
    --run-dir FILE` said "cannot create it (File exists)". Each says it is a file, and a file of a run (its
    state.json) names the run's directory to give instead (`rundir.file_given_as_run_dir`)."""
    from cona.trainer.export import main as export

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(PROFILE), job=load_job(JOB))
    for path, advice in [(a_file, "give the run's directory (the --run-dir it was created with)"),
                         (run.run_yaml, f"give the run directory it is in, {run.root}")]:  # fmt: skip
        said = f"{path}: a file, not a run directory; {advice}"
        for argv in (["status", str(path)], ["stop", str(path)], ["report", str(path)], ["run", "--resume", str(path)]):
            code, err = run_cli(argv)
            assert (code, error_line(err)) == (2, f"cona: error: {said}"), argv
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert export([str(path), "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
        assert err.getvalue() == f"cona: error: {said}\n"
    code, err = run_cli(["run", "--profile", str(PROFILE), "--job", str(JOB), "--run-dir", str(a_file)])
    assert (code, error_line(err)) == (2, f"cona: error: --run-dir {a_file}: a file, not a run directory; pick a path "
                                          "where none exists (or an empty directory)")  # fmt: skip
    assert a_file.read_text() == "mine"


def test_a_run_directory_of_someone_else_s_files_is_refused_and_an_empty_one_used(tmp_path):
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    code, err = run_cli(["run", "--profile", str(PROFILE), "--job", str(JOB), "--run-dir", str(mine)])
    line = error_line(err)
    assert code == 2 and f"--run-dir {mine}: not a cona run directory (no run.yaml) and not empty" in line
    assert "pick a new path" in line and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    profile, job = load_profile(PROFILE), load_job(JOB)
    cli._create_or_same(RunDir(empty), profile, job)
    assert (empty / "run.yaml").exists()
    cli._create_or_same(RunDir(empty), profile, job)  # the same run again: resumed, not refused


# M11: misspelled options of the data plane's programs ---------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "argv", "expected"),
    [
        ("export", ["run", "--format", "hf", "--out", "x", "--stpe", "30"],
         "unrecognized arguments: --stpe 30; did you mean --step?; valid options: --format, --help, --job, "),
        ("export", ["run", "--format", "hf", "--outt", "x"], "unrecognized arguments: --outt; did you mean --out?"),
        ("export", ["run", "--format", "hf", "--out", "x", "--overwite"], "did you mean --overwrite?"),
        ("export", ["run", "--format", "hf", "--out", "x", "--max-shard", "1GB"], "did you mean --max-shard-size?"),
        ("prepare", ["prepare", "--tokenizer", "t", "--input", "i", "--out", "o", "--worker", "1"],
         "unrecognized arguments: --worker 1; did you mean --workers?; valid options: --chunk-mb, --eos, --help, "),
        ("prepare", ["prepare", "--tokenizer", "t", "--inptu", "i", "--out", "o"], "did you mean --input?"),
        ("prepare", ["prepaer", "--tokenizer", "t"], "invalid choice: 'prepaer'"),
    ],
)  # fmt: skip
def test_the_data_plane_answers_a_misspelled_option_with_the_close_one(capsys, module, argv, expected):
    from cona.trainer import export, prepare

    with pytest.raises(SystemExit) as info:
        {"export": export, "prepare": prepare}[module].parse_args(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err


def test_a_misspelled_required_option_of_cona_is_named_not_reported_missing():
    code, err = run_cli(["plan", "--profile", str(PROFILE), "--jbo", str(JOB)])
    assert code == 2 and "unrecognized arguments: --jbo; did you mean --job?; valid options: " in error_line(err)


@pytest.mark.parametrize("argv", [
    ["plan", "--prof", str(PROFILE), "--job", str(JOB)],
    ["plan", "--profile", str(PROFILE), "--job", str(JOB), "--to", "3"],
    ["status", "--jso", "runs/x"],
])  # fmt: skip
def test_cona_takes_no_abbreviated_option_as_the_data_plane_takes_none(argv):
    """An abbreviation (`--prof` for `--profile`) is answered like a misspelling, with the full option: one that
    works today would turn ambiguous or mean another option when an option is added."""
    code, err = run_cli(argv)
    short = next(a for a in argv if a in ("--prof", "--to", "--jso"))
    full = {"--prof": "--profile", "--to": "--top", "--jso": "--json"}[short]
    assert code == 2 and f"unrecognized arguments: {short}" in error_line(err) and f"did you mean {full}?" in error_line(err)


# An empty value (an unset shell variable) -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # Each of these ran as if the option were left out, or read "" as the working directory: the default run
        # directory trained, --measured was dropped, the report went into the run directory, the default name.
        (["run", "--profile", str(PROFILE), "--job", str(JOB), "--run-dir", ""],
         "argument --run-dir: empty value '' (an unset shell variable?); give DIR, or drop --run-dir"),
        (["profile", "--profile", str(PROFILE), "--job", str(JOB), "--run-dir", " "], "argument --run-dir: empty value ' '"),
        (["run", "--resume", ""], "argument --resume: empty value"),
        (["plan", "--profile", str(PROFILE), "--job", str(JOB), "--measured", ""], "argument --measured: empty value"),
        (["plan", "--profile", "", "--job", str(JOB)], "argument --profile: empty value '' (an unset shell variable?); "
         "give PROFILE.yaml"),
        (["submit", "--profile", str(PROFILE), "--job", str(JOB), "--name", ""], "argument --name: empty value"),
        (["status", ""], "argument RUN: empty value '' (an unset shell variable?); give RUN"),
        (["stop", "x", "-n", ""], "argument -n/--namespace: empty value"),
        (["report", "x", "--out", ""], "argument --out: empty value"),
    ],
)  # fmt: skip
def test_an_empty_value_is_refused_naming_the_option(tmp_path, monkeypatch, argv, expected):
    monkeypatch.chdir(tmp_path)  # nothing may be written where "" would have pointed
    code, err = run_cli(argv)
    assert code == 2 and expected in error_line(err), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("module", "argv", "expected"),
    [
        # `--out ""` wrote tokens.bin into the working directory; `--input ""` tokenized all of it.
        ("prepare", ["prepare", "--tokenizer", "t", "--input", "i", "--out", ""], "argument --out: empty value '' "
         "(an unset shell variable?); give DIR"),
        ("prepare", ["prepare", "--tokenizer", "t", "--input", "i", "", "--out", "o"], "argument --input: empty value"),
        ("prepare", ["prepare", "--tokenizer", "", "--input", "i", "--out", "o"], "argument --tokenizer: empty value"),
        ("export", ["", "--format", "hf", "--out", "x"], "argument RUN_DIR: empty value"),
        ("export", ["run", "--format", "hf", "--out", ""], "argument --out: empty value"),
        ("export", ["run", "--format", "hf", "--out", "x", "--job", ""], "argument --job: empty value '' (an unset "
         "shell variable?); give JOB.yaml, or drop --job"),
    ],
)  # fmt: skip
def test_the_data_plane_refuses_an_empty_value_in_one_line(capsys, module, argv, expected):
    from cona.trainer import export, prepare

    with pytest.raises(SystemExit) as info:
        {"export": export, "prepare": prepare}[module].parse_args(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and expected in err, err


# L4: a backend without its clients ----------------------------------------------------------------------------


def test_a_slurm_run_without_sbatch_leaves_no_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    run = tmp_path / "run"
    code, err = run_cli(["run", "--profile", str(PROFILES / "local-slurm.yaml"), "--job", str(JOB), "--run-dir", str(run)])
    assert code == 1 and "sbatch not found" in error_line(err) and not run.exists()


def _slurm_clients(tmp_path, sinfo: str) -> str:
    """A PATH with the Slurm clients a run needs (doing nothing) and an `sinfo` that prints `sinfo`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", ""), ("scontrol", ""), ("scancel", ""), ("sinfo", f"printf '{sinfo}'")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return f"{bin_dir}:{os.environ['PATH']}"


@pytest.mark.parametrize(
    ("sinfo", "overrides", "expected"),
    [
        # The partition Slurm would leave the job pending in for ever (PartitionNodeLimit), said before any run dir.
        ("n1|debug*\\nn2|debug*\\n", ["nodes=3"],
         "slurm.partition 'debug' has 2 node(s), the profile needs 3 (nodes=3): Slurm would leave every job pending "
         "for ever; lower nodes (--profile-set nodes=2) or pick another partition; no run directory was created"),
        ("n1|debug*\\nn2|debug*\\n", ["nodes=3", "min_nodes=3"], "(nodes=3)"),
        ("n1|debug*\\nn2|debug*\\n", ["nodes=4", "min_nodes=3"], "the profile needs 3 (min_nodes=3)"),
        ("n1|gpu*\\nn1|cpu\\n", [], "slurm.partition 'debug': no such partition on this cluster (sinfo lists cpu, gpu)"),
        ("n1|gpu*\\nn1|cpu\\n", ["slurm.partition=null", "nodes=2"], "the default partition 'gpu' has 1 node(s)"),
        # A time limit above the partition's: pending for ever (PartitionTimeLimit), or refused at submission.
        ("n1|debug*|30:00\\nn2|debug*|30:00\\n", [],
         "slurm.time_limit 01:00:00 is above the time limit of slurm.partition 'debug', 30:00: Slurm would leave "
         "every job pending for ever (PartitionTimeLimit); lower it (--profile-set slurm.time_limit=30:00)"),
        ("n1|debug*|1-00:00:00\\nn2|debug*|1-00:00:00\\n", ["slurm.time_limit=2-00:00:00"], "above the time limit"),
        # A list of partitions (the job starts in the first that can run it): each name must exist, one must fit.
        ("n1|gpu*\\nn1|cpu\\n", ["slurm.partition=gpu,batch"], "slurm.partition 'batch': no such partition"),
        ("n1|gpu*|30:00\\nn2|gpu*|30:00\\nn1|cpu\\n", ["slurm.partition=gpu,cpu"],
         "no partition of 'gpu,cpu' can run the job: slurm.time_limit 01:00:00 is above the time limit of "
         "slurm.partition 'gpu'"),
    ],
)  # fmt: skip
def test_a_slurm_partition_that_cannot_run_the_job_is_said_before_the_run(tmp_path, monkeypatch, sinfo, overrides,
                                                                          expected):  # fmt: skip
    monkeypatch.setenv("PATH", _slurm_clients(tmp_path, sinfo))
    run = tmp_path / "run"
    sets = [x for o in overrides for x in ("--profile-set", o)]
    code, err = run_cli(["run", "--profile", str(PROFILES / "local-slurm.yaml"), *sets, "--job", str(JOB),
                         "--run-dir", str(run)])  # fmt: skip
    assert code == 1 and expected in error_line(err) and not run.exists(), err


def test_a_slurm_partition_with_room_or_an_sinfo_that_does_not_answer_is_not_judged(tmp_path):
    from cona.orchestrator.backends.slurm.backend import check_partition, partition_problem

    profile = load_profile(PROFILES / "local-slurm.yaml")
    assert partition_problem(profile, "n1|debug*\nn2|debug*\nn2|other\n") is None
    for limit in ("infinite", "UNLIMITED", "1:00:00", "2-00:00:00", "n/a", ""):  # room, none, or not understood
        assert partition_problem(profile, f"n1|debug*|{limit}\nn2|debug*|{limit}\n") is None, limit
    untimed = load_profile(PROFILES / "local-slurm.yaml", ["slurm.time_limit="])  # no --time: the partition's
    assert partition_problem(untimed, "n1|debug*|30:00\nn2|debug*|30:00\n") is None
    assert partition_problem(profile, "") is None  # a cluster that lists nothing: nothing to judge by
    # In a list, one partition that fits is enough: the job starts there (the validator's own advice was refused).
    listed = load_profile(PROFILES / "local-slurm.yaml", ["slurm.partition=gpu,batch"])
    assert partition_problem(listed, "n1|gpu*|30:00\nn2|gpu*|30:00\nn1|batch\nn2|batch\n") is None
    elastic = load_profile(PROFILES / "local-slurm.yaml", ["nodes=4", "min_nodes=2"])
    assert partition_problem(elastic, "n1|debug*\nn2|debug*\n") is None  # starts on 2, grows if more come

    def failing(argv, env=None):
        return subprocess.CompletedProcess(argv, 1, "", "slurm_load_partitions: Unable to contact slurm controller")

    check_partition(load_profile(PROFILES / "local-slurm.yaml", ["nodes=9"]), runner=failing)  # no error: not judged


def test_a_launch_the_backend_refuses_leaves_the_run_failed_with_why_and_resumable(tmp_path):
    class Refusing(ScriptedBackend):
        def launch(self, *, attempt: int, strategy: Strategy, previous: Attempt | None = None) -> Attempt:
            raise BackendError("sbatch --parsable ... failed: sbatch: fatal: Could not establish a configuration source")

    profile, job = load_profile(PROFILE), load_job(JOB, ["data.path=examples/tiny-gpt.yaml"])
    run_dir = RunDir(tmp_path / "run")
    create_run(run_dir=run_dir, profile=profile, job=job)

    def scheduler(backend_class: type[ScriptedBackend]) -> Scheduler:
        backend = backend_class(run_dir=run_dir, profile=profile, job=job)
        return Scheduler(run_dir=run_dir, profile=profile, job=job, backend=backend, poll_interval_s=0.01)

    with pytest.raises(BackendError):
        scheduler(Refusing).run()
    state = read_state(run_dir)
    assert state.status == "failed" and not state.final  # `cona status` says failed, and why
    assert state.reason.startswith("attempt 1 could not be launched: sbatch --parsable ... failed: ")
    assert state.reason.endswith(f"; fix that and resume with `cona run --resume {run_dir.root}`")
    assert [e["event"] for e in read_events(run_dir)][-1] == "launch-failed"
    attempt = scheduler(ScriptedBackend).start_or_resume()  # fixed: the same run goes on
    assert attempt is not None and read_state(run_dir).status == "running" and read_state(run_dir).reason is None


def test_a_token_array_with_negative_ids_is_refused_when_the_corpus_opens(tmp_path):
    """A signed .npy with -1 in it (a padding id, say) trained into an "index out of range" deep in the model, a
    traceback that `cona run` retried as a crash."""
    from cona.trainer.data import load_corpus

    ids = (np.arange(20_000) % 256).astype(np.int32)
    ids[::7] = -1
    np.save(tmp_path / "neg.npy", ids)
    job = job_from_dict({"model": {"preset": "tiny-gpt"}, "data": {"path": str(tmp_path / "neg.npy")},
                         "eval": {"num_windows": 8}})  # fmt: skip
    with pytest.raises(InputRefused, match=r"neg\.npy: holds negative token ids \(the least is -1\)"):
        load_corpus(job)
    np.save(tmp_path / "neg.npy", np.abs(ids))  # the same, signed but in range: fine
    load_corpus(job)


def test_bert_on_prepared_tokens_needs_a_mask_id_outside_the_vocabulary(tmp_path):
    """BERT masks with id vocab_size - 1. The trainer's own advice for a 300-token vocabulary was vocab_size 300,
    where that id is a real token (`Ġhe`, thousands of times in the corpus): masks and that token were one."""
    import json

    (np.arange(200_000) % 300).astype(np.uint16).tofile(tmp_path / "tokens.bin")
    (tmp_path / "tokens.json").write_text(json.dumps({"vocab_size": 300, "token_dtype": "uint16", "num_tokens": 200_000,
                                                      "tokenizer_sha256": "0" * 64}))  # fmt: skip
    job = job_from_dict({"model": {"preset": "tiny-bert", "vocab_size": 300}, "data": {"path": str(tmp_path)}})
    refusal = _refusal(job)
    assert "BERT masks with id vocab_size - 1" in refusal and refusal.endswith("set model.vocab_size: 301"), refusal
    check_inputs(job.model_copy(update={"model": job.model.model_copy(update={"vocab_size": 301})}))
    gpt = job_from_dict({"model": {"preset": "tiny-gpt", "vocab_size": 300}, "data": {"path": str(tmp_path)}})
    check_inputs(gpt)  # no mask id: the whole vocabulary is the model's


def test_without_profile_the_embedded_local_default_is_used(tmp_path, monkeypatch):
    """`cona run --help` showed --profile as optional, and the README speaks of an embedded local default: without
    it, `cona run`, `plan` and `profile` take slurm/profiles/local-cpu.yaml, installed with the package."""
    from cona.orchestrator.profile import load_profile

    assert cli.DEFAULT_PROFILE.read_text() == (PROFILES / "local-cpu.yaml").read_text()
    monkeypatch.chdir(tmp_path)  # the default does not depend on the working directory
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["plan", "--job", str(JOB), "--top", "1"]) == 0
    assert f"on {load_profile(cli.DEFAULT_PROFILE).name}: 1 node(s) × 4 cpu" in out.getvalue()
    code, err = run_cli(["run", "--set", "seed=1"])
    assert code == 2 and "give --job (and --profile: the embedded local one without it)" in error_line(err)


def test_an_odd_device_count_is_not_blamed_when_the_micro_batches_are_the_cause():
    """3 devices with micro-batches of 5: no batch of the range splits into them on any share of the factor 3, so
    the advice to pick a multiple of 3 (followed, it still failed) was no fix; d1t1p3 runs at g32 with mbs 4."""
    code, err = run_cli(["run", "--profile", str(PROFILES / "local-cpu.yaml"), "--profile-set", "gpus_per_node=3",
                         "--job", str(JOB), "--set", "batch.mbs_choices=[5]", "--run-dir", "/nonexistent/x"])  # fmt: skip
    line = error_line(err)
    assert code == 2 and "factor 3" not in line and "no feasible strategy" in line, line
