"""state.json as a typed RunState: round trip, the unversioned layout of cona 0.1, and a newer layout refused."""

from __future__ import annotations

import json

import pytest
from cona.orchestrator.backends.base import Attempt
from cona.orchestrator.runstate import (
    STATE_VERSION,
    PendingSpell,
    RunState,
    SwitchRequest,
    load_run,
    read_state,
    write_state,
)
from cona.orchestrator.switchcost import SwitchKind
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

A = Strategy.parse("dp=1,tp=1,pp=4,mbs=4,gbs=16")
B = Strategy.parse("dp=2,tp=1,pp=2,mbs=16,gbs=64")


def test_round_trip(tmp_path):
    run = RunDir(tmp_path)
    state = RunState(status="running", attempts=[Attempt(number=1, strategy=A, backend_id="42", started_at=1.0)],
                     attempts_started=1, control_seq=3, heartbeat_offset=120, model={"live": {"samples": 64}},
                     switch_requested=SwitchRequest(time=5.0, seq=3, source=A, target=B, kind=SwitchKind.IN_PLACE, predicted_s=1.5),
                     pending=PendingSpell(attempt=1, since=4.0, detail="0/4 nodes are available", timed_out=True),
                     disruptions_without_progress=2, disruption_checkpoint="step-00000010")  # fmt: skip
    write_state(run, state)
    again = read_state(run)
    assert again == state
    assert again.pending.detail == "0/4 nodes are available" and again.pending.timed_out
    assert again.current.strategy == A and again.live["samples"] == 64 and again.switch_requested.in_place
    assert json.loads(run.state_json.read_text())["version"] == STATE_VERSION


def test_no_state_yet_is_a_fresh_run(tmp_path):
    state = read_state(RunDir(tmp_path))
    assert state.status == "created" and state.current is None and state.attempts_started == 0


def test_unversioned_state_of_cona_0_1_still_resumes(tmp_path):
    """The flat layout: the run model's keys at the top level, `attempt`/`strategy` copies of the newest attempt."""
    run = RunDir(tmp_path)
    old = {
        "attempt": 2, "strategy": B.to_dict(), "status": "running", "run_started": 10.0, "control_seq": 1,
        "attempts": [Attempt(number=1, strategy=A).to_dict(), Attempt(number=2, strategy=B, backend_id="7").to_dict()],
        "switch_requested": {"time": 3.0, "to": B.to_dict(), "from": A.to_dict(), "seq": 1, "in_place": True},
        "live": {"samples": 128, "step": 8}, "noise": {"kind": "plain"}, "last_decision": {"reason": "stay"},
        "heartbeat_offset": 10, "updated": 11.0,
    }  # fmt: skip
    run.state_json.write_text(json.dumps(old))
    state = read_state(run)
    assert state.current.number == 2 and state.current.backend_id == "7" and state.attempts_started == 2
    assert state.live == {"samples": 128, "step": 8}
    assert state.model["noise"] == {"kind": "plain"} and state.model["last_decision"] == {"reason": "stay"}
    assert "attempt" not in state.model and "strategy" not in state.model
    assert state.switch_requested.target == B and state.switch_requested.in_place
    assert state.version == STATE_VERSION


def test_a_version_2_state_from_before_the_pending_and_disruption_fields_reads_with_their_defaults(tmp_path):
    run = RunDir(tmp_path)
    state = RunState(status="running", attempts=[Attempt(number=1, strategy=A)], attempts_started=1, restarts_in_row=1)
    data = state.to_dict()
    for added in ("pending", "disruptions_without_progress", "disruption_checkpoint"):
        del data[added]
    run.state_json.write_text(json.dumps(data))
    again = read_state(run)
    assert again == state and again.pending is None and again.disruptions_without_progress == 0
    assert again.version == STATE_VERSION == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (json.dumps({"version": STATE_VERSION + 1, "status": "running"}), f"state version {STATE_VERSION + 1}"),
        ("[1, 2]", "not a JSON object"),
        ('{"status": "running", "attem', "unreadable"),
        (json.dumps({"version": 2, "attempts": [{"number": 1}]}), "unreadable run state"),
        (json.dumps({"version": 2, "pending": {"attempt": 1}}), "unreadable run state"),
    ],
)
def test_unusable_state_is_one_clear_line(tmp_path, text, message):
    run = RunDir(tmp_path)
    run.state_json.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_state(run)
    assert message in str(err.value) and "state.json" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (json.dumps({"version": 2, "status": 7}), "field 'status' is 7, not text"),
        (json.dumps({"version": 2, "status": "paused"}), "field 'status' is 'paused', not one of created, running"),
        (json.dumps({"version": 2, "attempts_started": "4"}), "field 'attempts_started' is '4', not a whole number"),
        (json.dumps({"version": 2, "final": "no"}), "field 'final' is 'no', not true or false"),
        ('{"version": 2, "paused_s": NaN}', "field 'paused_s' is nan, not a finite number"),
        (json.dumps({"version": 2, "model": [1]}), "field 'model' is [1], not a JSON object"),
        (json.dumps({"version": 2, "model": {"live": "x"}}), "field 'model.live' is 'x', not a JSON object"),
        (json.dumps({"version": 2, "attempts": "many"}), "field 'attempts' is 'many', not a list of objects"),
        # What `cona status` formats: these ended it in a traceback, or in "Cannot specify ',' with 's'".
        (json.dumps({"version": 2, "model": {"live": {"samples": "lots"}}}), "field 'model.live.samples' is 'lots', not a count"),
        (json.dumps({"version": 2, "model": {"live": {"step": [1]}}}), "field 'model.live.step' is [1], not a count"),
        (json.dumps({"version": 2, "model": {"live": {"val_loss": "low"}}}), "field 'model.live.val_loss' is 'low', not a number"),
        (json.dumps({"version": 2, "model": {"last_decision": [1]}}), "field 'model.last_decision' is [1], not a decision"),
        (json.dumps({"version": 2, "model": {"last_decision": {"x": 1}}}), "field 'model.last_decision' is {'x': 1}"),
        (json.dumps({"version": "2"}), "field 'version' is '2', not a whole number"),
        (json.dumps({"version": 2, "reason": "x" * 100}), None),
        ("null", "state.json: not a JSON object"),
        ("[" * 100_000 + "]" * 100_000, "state.json: unreadable"),
    ],
)
def test_a_state_json_of_the_wrong_types_is_refused_in_one_line_saying_what_to_do(tmp_path, text, message):
    """Valid JSON of other types used to be taken in: `"status": 7` was shown as the run's status, `"final": "no"`
    read as true, and `"attempts_started": "4"`, `"model": [1]` or `"model": {"live": "x"}` ended `cona run --resume` (and
    `cona status`) in a traceback. A file holding `null` read as a missing one, and JSON nested too deep as a
    traceback. Each is now one line naming the file, the field and what to do."""
    run = RunDir(tmp_path)
    run.state_json.write_text(text)
    if message is None:  # a long text in a text field is fine
        assert read_state(run).reason == "x" * 100
        return
    with pytest.raises(ConfigError) as err:
        read_state(run)
    line = str(err.value)
    assert line.startswith(f"{run.state_json}: ") and message in line and "\n" not in line
    assert line.endswith("restore state.json from a backup, or start a new run with --run-dir")


def test_numbers_of_either_json_kind_and_nulls_where_allowed_still_read(tmp_path):
    run = RunDir(tmp_path)
    run.state_json.write_text(json.dumps({"version": 2, "status": "stopped", "paused_s": 3, "run_started": None,
                                          "hang_cancelled": None, "reason": None, "model": {}}))  # fmt: skip
    state = read_state(run)
    assert (state.status, state.paused_s, state.run_started, state.reason) == ("stopped", 3, None, None)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe profile: {}", "run.yaml: not UTF-8 text (byte 0xff at offset 0)"),
        (b"profile: [\n", "run.yaml: line 2 column 1: invalid YAML"),
        (b"- 1\n", "run.yaml: expected a mapping"),
        (b"profile: {}\n", "run.yaml: missing the profile or job section"),
    ],
)
def test_unusable_run_yaml_is_one_line_naming_it(tmp_path, content, message):
    """Bytes that are no text used to surface as the codec's bare message, naming no file."""
    run = RunDir(tmp_path)
    run.run_yaml.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_run(run)
    assert message in str(err.value) and "\n" not in str(err.value)


# --- a damaged run directory met by an orchestrator that goes on with the run -------------------------------------


def _created_run(tmp_path) -> RunDir:
    """A real run directory as `cona run` creates it (run.yaml only)."""
    from cona.orchestrator.job import load_job
    from cona.orchestrator.profile import load_profile
    from cona.orchestrator.runstate import create_run

    from tests.conftest import EXAMPLES, PROFILES

    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(PROFILES / "local-cpu.yaml"), job=load_job(EXAMPLES / "tiny-gpt.yaml"))
    return run


def test_a_run_yaml_cut_short_anywhere_is_refused_for_resume_in_one_line(tmp_path):
    """`head -c 1500 run.yaml` still parsed: the missing sections took their defaults (max_samples 30,000 became
    200,000, the perplexity target was lost) and the resume ran another job without a word."""
    run = _created_run(tmp_path)
    whole = run.run_yaml.read_bytes()
    assert whole.startswith(b"version: 2\n") and whole.endswith(b"complete: true\n")
    assert load_run(run, resume=True)[1].target.val_perplexity is not None
    # Only the last newline may go: then nothing is lost (`complete: true` is whole). The stride must not land on
    # that cut: run.yaml's length follows the test's paths (2,664 bytes put one there).
    for cut in [*range(40, len(whole) - 1, 61), len(whole) - 3, len(whole) - 2]:
        run.run_yaml.write_bytes(whole[:cut])
        with pytest.raises(ConfigError) as err:
            load_run(run, resume=True)
        message = str(err.value)
        assert message.startswith(f"{run.run_yaml}:") and "\n" not in message, (cut, message)


def test_a_run_yaml_cut_inside_the_job_names_what_is_missing_and_status_goes_on_with_a_warning(tmp_path, capsys):
    run = _created_run(tmp_path)
    text = run.run_yaml.read_text()
    run.run_yaml.write_text(text[: text.index("  target:")])  # inside the job, as `head -c 1500` of a real run
    with pytest.raises(ConfigError) as err:
        load_run(run, resume=True)
    assert str(err.value) == (
        f"{run.run_yaml}: cut short or damaged: job.target, job.eval, job.checkpoint, job.heartbeat and 1 more "
        "missing, which cona always writes; restore it from a backup (cona writes it once, whole, when the run is "
        "created) or start a new run with --run-dir"
    )
    capsys.readouterr()
    for _ in range(2):  # `cona report` loads the run twice: one warning
        profile, job = load_run(run)
    assert job.name == "tiny-gpt" and profile.name == "local-cpu"
    err_lines = capsys.readouterr().err.splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith(f"cona: warning: {run.run_yaml}: cut short or damaged")


def test_an_unversioned_run_yaml_of_an_earlier_cona_still_resumes_and_a_cut_one_is_refused(tmp_path):
    """Run directories created before run.yaml had `version` and `complete`: whole, they resume as before; cut
    short, the sections every cona wrote tell it."""
    import yaml

    run = _created_run(tmp_path)
    document = yaml.safe_load(run.run_yaml.read_text())
    del document["version"], document["complete"], document["job"]["metrics"]  # `metrics` came later
    old = yaml.safe_dump(document, sort_keys=False)
    run.run_yaml.write_text(old)
    assert load_run(run, resume=True)[1].name == "tiny-gpt"
    run.run_yaml.write_text(old[: old.index("    mbs_choices:")])  # inside job.batch
    with pytest.raises(ConfigError, match=r"run\.yaml: cut short or damaged: job\.parallel, job\.target, job\.eval, "
                                          r"job\.checkpoint and 2 more missing"):  # fmt: skip
        load_run(run, resume=True)


def _beat(attempt: int, samples: int, **fields) -> dict:
    return {"time": 10.0 + samples, "attempt": attempt, "strategy": A.to_dict(), "step": samples // 16,
            "samples": samples, "tokens": 64 * samples, "train_loss": 3.0, "lr": 1e-3, "step_time_s": 0.1,
            "samples_per_s": 160.0, **fields}  # fmt: skip


def test_a_state_json_this_user_cannot_read_is_not_called_damaged(tmp_path, monkeypatch):
    """It was "unreadable; restore state.json from a backup": the file is intact, its permissions are the cause.
    (The suite runs as root, who reads any file: the denial is the open's own error, raised in its place.)"""
    from cona.orchestrator import runstate

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    run = RunDir(tmp_path)
    run.state_json.write_text("{}")
    monkeypatch.setattr(runstate, "read_json", denied)
    with pytest.raises(ConfigError, match="permission denied; run cona as the user that owns the run") as err:
        read_state(run)
    assert "backup" not in str(err.value)


@pytest.mark.parametrize("evidence", ["attempt directory", "heartbeats", "samples log", "launch event"])
def test_a_missing_state_json_of_a_run_with_attempts_is_refused_for_resume(tmp_path, evidence):
    """Without state.json a resume started again at attempt 1: it re-read attempt 1's heartbeats as new, invented
    a switch from its old exit record, and overwrote attempts/1 and appended to its logs."""
    from cona.orchestrator.runstate import log_event
    from cona.protocol.rundir import append_jsonl

    run = _created_run(tmp_path)
    assert read_state(run, resume=True).attempts_started == 0  # a new run: nothing launched yet
    run.attempt_dir(0).mkdir(parents=True)  # a trainer run by hand (attempt 0) is no attempt of the orchestrator's
    assert read_state(run, resume=True).attempts_started == 0
    if evidence == "attempt directory":
        run.attempt_dir(1).mkdir(parents=True)
        run.attempt_dir(2).mkdir(parents=True)
    elif evidence == "heartbeats":
        append_jsonl(run.heartbeat_file(1), _beat(1, 16))
        append_jsonl(run.heartbeat_file(2), _beat(2, 32))
    elif evidence == "samples log":
        append_jsonl(run.samples_log / "1.jsonl", {"step": 1, "start": 0, "end": 16})
        append_jsonl(run.samples_log / "2.jsonl", {"step": 2, "start": 16, "end": 32})
    else:
        log_event(run, "launch", attempt=1, strategy=A.to_dict())
        log_event(run, "launch", attempt=2, strategy=B.to_dict())
    with pytest.raises(ConfigError) as err:
        read_state(run, resume=True)
    assert str(err.value) == (f"{run.state_json} is missing but attempts 1–2 exist; restore state.json from a backup, "
                              "or start a new run with --run-dir")  # fmt: skip
    assert read_state(run).status == "created"  # `cona status` and `cona report` still read the rest
    assert not run.state_json.exists()


def test_a_torn_last_event_is_cut_and_logged_before_the_next_one(tmp_path):
    """A torn tail (a writer killed mid-append) had the next record glued onto it: that record was lost, and every
    reader warned about the damaged line from then on."""
    from cona.orchestrator.runstate import end_torn_events, log_event, read_events

    run = _created_run(tmp_path)
    end_torn_events(run)  # no events.jsonl yet: nothing to do
    assert not run.events.exists()
    log_event(run, "start", strategy=A.to_dict())
    end_torn_events(run)  # whole lines only: nothing to do
    assert len(read_events(run)) == 1
    whole = run.events.read_bytes()
    torn = b'{"attempt": 2, "event": "heartbeat-gap", "ti'
    run.events.write_bytes(whole + torn)
    end_torn_events(run)
    log_event(run, "resume", attempt=2)
    skipped: list[str] = []
    events = read_events(run, skipped=skipped)
    assert skipped == [] and [e["event"] for e in events] == ["start", "torn-tail", "resume"]
    assert events[1]["dropped"] == torn.decode() and (events[1]["at"], events[1]["bytes"]) == (len(whole), len(torn))
    run.events.write_bytes(whole + b"\0" * 100)  # zeros a crash left behind: no line at all
    end_torn_events(run)
    assert run.events.read_bytes().startswith(whole) and read_events(run)[-1]["bytes"] == 100
