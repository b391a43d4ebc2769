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
