"""An orchestrator that goes on with a damaged run directory (`cona run --resume`, the same command again, a
restarted orchestrator): what it refuses instead of silently starting over, and what it repairs before it appends.
On real run directories made by `create_run` and the scripted backend of tests/test_scheduler.py (no processes)."""

from __future__ import annotations

import json
import re

import pytest
from cona.orchestrator import cli
from cona.orchestrator.backends.base import AttemptStatus
from cona.orchestrator.runstate import read_events, read_state
from cona.orchestrator.scheduler import RunFailed, drive
from cona.protocol.rundir import COMPLETE_MARKER, ExitCode, LaunchRecord, RunDir, append_jsonl
from cona.protocol.yamlconfig import ConfigError

from tests.test_scheduler import A, B, _state_with_attempt_one, make_scheduler


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    """A crash is relaunched after a backoff of 1 s: nothing here waits for a process."""
    import cona.orchestrator.scheduler as scheduler

    monkeypatch.setattr(scheduler.time, "sleep", lambda seconds: None)


def _beat(attempt: int, samples: int, **fields) -> dict:
    """A heartbeat as trainer rank 0 writes it."""
    return {"time": 10.0 + samples, "attempt": attempt, "strategy": A.to_dict(), "step": samples // 16,
            "samples": samples, "tokens": 64 * samples, "train_loss": 3.0, "lr": 1e-3, "step_time_s": 0.1,
            "samples_per_s": 160.0, **fields}  # fmt: skip


def _trained(run_dir: RunDir, *, checkpoint_at: int | None) -> None:
    """Attempt 1 trained to 5,824 samples, with a `checkpoint` heartbeat at `checkpoint_at` (None: none)."""
    beats = [_beat(1, 0, event="start", train_loss=None), _beat(1, 2048), _beat(1, 5824)]
    if checkpoint_at is not None:
        beats.insert(2, _beat(1, checkpoint_at, event="checkpoint", reason="periodic"))
    for beat in beats:
        append_jsonl(run_dir.heartbeat_file(1), beat)


def _checkpoint(run_dir: RunDir, step: int, *, name: str | None = None, marked: bool = True) -> None:
    path = run_dir.checkpoints / (name or run_dir.checkpoint_dir(step).name)
    path.mkdir(parents=True)
    if marked:
        (path / COMPLETE_MARKER).write_text("{}")


def _cona(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = cli.main(argv)
    return code, capsys.readouterr().err


# --- state.json lost ----------------------------------------------------------------------------------------------


def test_resume_without_state_json_refuses_in_one_line_and_touches_nothing(tmp_path, capsys):
    """It started again at attempt 1: re-read the old heartbeats as new, invented a switch from the old in-place exit,
    overwrote attempts/1/launch.json and appended to heartbeats/1.jsonl (found by a bug hunt)."""
    sched, backend = make_scheduler(tmp_path)
    run_dir = sched.run_dir
    _trained(run_dir, checkpoint_at=3200)
    backend.write_launch(1, A)
    append_jsonl(run_dir.heartbeat_file(2), _beat(2, 5824))
    before = {p: p.read_bytes() for p in run_dir.root.rglob("*") if p.is_file() and p.name != "orchestrator.lock"}
    code, err = _cona(["run", "--resume", str(run_dir.root), "--quiet"], capsys)
    assert code == 2
    assert err == (f"cona: error: {run_dir.state_json} is missing but attempts 1–2 exist; restore state.json from a "
                   "backup, or start a new run with --run-dir\n")  # fmt: skip
    after = {p: p.read_bytes() for p in run_dir.root.rglob("*") if p.is_file() and p.name != "orchestrator.lock"}
    assert after == before and not run_dir.state_json.exists()
    with pytest.raises(ConfigError, match=r"state\.json is missing"):  # a scheduler driven directly refuses alike
        sched.start_or_resume()
    assert backend.launched == []


def test_a_state_json_older_than_the_attempts_never_hands_out_a_used_number(run_dir_with_stale_state):
    sched, backend = run_dir_with_stale_state
    attempt = sched.start_or_resume()
    nxt = sched._handle_end(attempt, AttemptStatus.STOPPED, int(ExitCode.STOPPED), "")
    assert nxt is not None and nxt.number == 4 and backend.launched == [(4, A)]
    skipped = [e for e in read_events(sched.run_dir) if e["event"] == "attempt-numbers-skipped"]
    assert [(e["first"], e["last"]) for e in skipped] == [(2, 3)]
    assert read_state(sched.run_dir).attempts_started == 4


@pytest.fixture
def run_dir_with_stale_state(tmp_path):
    """state.json restored from a backup taken at attempt 1, while attempts 2 and 3 ran since (their heartbeats and
    exit record are there)."""
    sched, backend = make_scheduler(tmp_path)
    _state_with_attempt_one(sched.run_dir)
    _checkpoint(sched.run_dir, 20)
    append_jsonl(sched.run_dir.heartbeat_file(2), _beat(2, 640))
    sched.run_dir.attempt_dir(3).mkdir(parents=True)
    sched.run_dir.exit_file(3).write_text(json.dumps({"exit_code": 43, "name": "STOPPED", "reason": "x", "step": 20,
                                                       "time": 1.0}))  # fmt: skip
    return sched, backend


def test_the_launch_record_of_an_in_place_switch_never_taken_does_not_skip_its_number(tmp_path):
    """A switch in place offered for attempt 2 (its launch record written), then attempt 1 crashed before going on
    as it: the relaunch is attempt 2, as before."""
    sched, backend = make_scheduler(tmp_path, "policy.max_restarts=2")
    _state_with_attempt_one(sched.run_dir)
    assert backend.launched == []
    sched.run_dir.write_launch(LaunchRecord(attempt=2, strategy=B, backend="local", written_at=1.0, in_place=True))
    attempt = sched.start_or_resume()
    sched.job.policy.heartbeat_timeout_s = 1e9
    nxt = sched._handle_end(attempt, AttemptStatus.CRASHED, 1, "killed")
    assert nxt is not None and nxt.number == 2 and backend.launched == [(2, A)]
    assert not [e for e in read_events(sched.run_dir) if e["event"] == "attempt-numbers-skipped"]


# --- checkpointed progress and no checkpoint ----------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["checkpoints deleted", "no COMPLETE marker"])
def test_progress_without_a_checkpoint_fails_the_run_instead_of_training_from_zero(tmp_path, damage):
    """The relaunch found no marked checkpoint and trained from step 0: 5,824 samples thrown away without a word."""
    sched, backend = make_scheduler(tmp_path, "policy.max_restarts=3")
    _state_with_attempt_one(sched.run_dir)
    _trained(sched.run_dir, checkpoint_at=5760)
    if damage == "no COMPLETE marker":
        _checkpoint(sched.run_dir, 180, marked=False)
    attempt = sched.start_or_resume()
    with pytest.raises(RunFailed) as info:
        sched._handle_end(attempt, AttemptStatus.CRASHED, None, "the attempt's processes are gone")
    reason = (f"{sched.run_dir.root} reached 5,824 samples (checkpointed up to 5,760) but has no complete checkpoint "
              f"in {sched.run_dir.checkpoints}; restore them from a backup and resume, or start over with a new "
              "--run-dir")  # fmt: skip
    assert str(info.value) == reason
    assert backend.launched == []
    state = read_state(sched.run_dir)
    assert (state.status, state.reason, state.attempts_started) == ("failed", reason, 1)
    assert [e["reason"] for e in read_events(sched.run_dir) if e["event"] == "failed"] == [reason]


def test_progress_seen_only_in_a_resume_or_an_exit_record_counts_too(tmp_path):
    """A checkpoint written for an in-place switch or a stop has no `checkpoint` heartbeat: the next attempt's
    `resume` record, or the exit record after it, shows it."""
    sched, _ = make_scheduler(tmp_path)
    append_jsonl(sched.run_dir.heartbeat_file(1), _beat(1, 3296, event="exit", exit_code=int(ExitCode.SWITCH)))
    assert "checkpointed up to 3,296" in sched.run_dir.progress_without_checkpoint()
    sched.run_dir.heartbeat_file(1).unlink()
    append_jsonl(sched.run_dir.heartbeat_file(2), _beat(2, 3296, event="resume"))
    assert "reached 4,000 samples" in sched.run_dir.progress_without_checkpoint(samples_known=4000)
    append_jsonl(sched.run_dir.heartbeat_file(1), _beat(1, 9000, event="exit", exit_code=1))  # a crash: no checkpoint
    assert "reached 9,000 samples (checkpointed up to 3,296)" in sched.run_dir.progress_without_checkpoint()


def test_a_crash_before_the_first_checkpoint_is_still_relaunched_from_zero(tmp_path):
    """Nothing was ever saved, so nothing is lost: training from 0 again is right."""
    sched, backend = make_scheduler(tmp_path, "policy.max_restarts=3")
    _state_with_attempt_one(sched.run_dir)
    _trained(sched.run_dir, checkpoint_at=None)
    attempt = sched.start_or_resume()
    sched.job.policy.heartbeat_timeout_s = 1e9
    nxt = sched._handle_end(attempt, AttemptStatus.CRASHED, 1, "killed")
    assert nxt is not None and nxt.number == 2 and backend.launched == [(2, A)]


def test_a_checkpoint_in_the_middle_of_an_interrupted_resave_still_resumes(tmp_path):
    """A crash between the two renames of a re-save leaves the only checkpoint under `.resave-`/`.replaced-`: the
    trainer puts it back (`recover_resaves`), so the run goes on."""
    sched, backend = make_scheduler(tmp_path, "policy.max_restarts=3")
    _state_with_attempt_one(sched.run_dir)
    _trained(sched.run_dir, checkpoint_at=5760)
    _checkpoint(sched.run_dir, 180, name=".resave-step-00000180")
    attempt = sched.start_or_resume()
    sched.job.policy.heartbeat_timeout_s = 1e9
    nxt = sched._handle_end(attempt, AttemptStatus.CRASHED, 1, "killed")
    assert nxt is not None and backend.launched == [(2, A)]


# --- run.yaml cut short -------------------------------------------------------------------------------------------


def _cut_run_yaml(run_dir: RunDir) -> None:
    text = run_dir.run_yaml.read_text()
    run_dir.run_yaml.write_text(text[: text.index("    mbs_choices:")])  # inside job.batch, as `head -c 1500`


def test_resume_of_a_cut_run_yaml_refuses_in_one_line_and_status_names_it(tmp_path, capsys):
    """The resume trained on with max_samples 200,000 instead of 30,000, no perplexity target and another
    checkpoint interval; `cona status` and `cona report` said nothing."""
    sched, backend = make_scheduler(tmp_path)
    _state_with_attempt_one(sched.run_dir)
    _cut_run_yaml(sched.run_dir)
    code, err = _cona(["run", "--resume", str(sched.run_dir.root), "--quiet"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"cona: error: {sched.run_dir.run_yaml}: cut short or damaged: job.parallel, job.target, ")
    assert err.rstrip().endswith("restore it from a backup (cona writes it once, whole, when the run is created) or "
                                 "start a new run with --run-dir")  # fmt: skip
    code, err = _cona(["status", str(sched.run_dir.root)], capsys)
    assert code == 0 and err.startswith(f"cona: warning: {sched.run_dir.run_yaml}: cut short or damaged")
    with pytest.raises(ConfigError, match=r"run\.yaml: cut short"):  # the scheduler refuses alike
        sched.start_or_resume()
    assert backend.launched == []


def test_drive_refuses_a_cut_run_yaml_before_anything(tmp_path):
    """The Kubernetes orchestrator loads the run as `cona status` does and hands it to `drive`, which refuses."""
    sched, _ = make_scheduler(tmp_path)
    _state_with_attempt_one(sched.run_dir)
    _cut_run_yaml(sched.run_dir)
    events = sched.run_dir.events.read_bytes() if sched.run_dir.events.exists() else b""
    with pytest.raises(ConfigError, match=r"run\.yaml: cut short"):
        drive(run_dir=sched.run_dir, profile=sched.profile, job=sched.job, quiet=True)
    assert (sched.run_dir.events.read_bytes() if sched.run_dir.events.exists() else b"") == events


# --- state.json of the wrong types ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"noise": "x"}, "its run model ('model') is unreadable ("),
        ({"live": {"samples": 64}, "throughput": {"measured": "x"}}, "its run model ('model') is unreadable ("),
    ],
)
def test_resume_of_a_state_json_whose_run_model_is_of_other_types_refuses_in_one_line(tmp_path, capsys, model, message):
    """`"model": {"noise": "x"}` (valid JSON, a hand edit or damage) ended `cona run --resume` in a traceback in
    `RunModel.restore`; so did `"status": 7` further on (`read_state` refuses that one now)."""
    sched, backend = make_scheduler(tmp_path)
    _state_with_attempt_one(sched.run_dir, model=model)
    with pytest.raises(ConfigError) as err:
        sched.start_or_resume()
    line = str(err.value)
    assert line.startswith(f"{sched.run_dir.state_json}: {message}") and "\n" not in line
    assert line.endswith("restore state.json from a backup, or start a new run with --run-dir")
    assert backend.launched == []
    code, err_text = _cona(["run", "--resume", str(sched.run_dir.root), "--quiet"], capsys)
    assert code == 2 and err_text.count("\n") == 1 and "Traceback" not in err_text
    assert err_text.startswith(f"cona: error: {sched.run_dir.state_json}: {message}")


# --- a torn tail of events.jsonl ------------------------------------------------------------------------------------


def test_a_resumed_orchestrator_cuts_a_torn_last_event_before_its_first_one(tmp_path):
    """Its first record (`resume`, here `adopt`) was glued onto the torn line and lost with it, and every later
    `cona status` and `cona report` warned about the damaged line."""
    sched, _ = make_scheduler(tmp_path)
    _state_with_attempt_one(sched.run_dir)
    append_jsonl(sched.run_dir.events, {"time": 1.0, "event": "launch", "attempt": 1, "strategy": A.to_dict()})
    with open(sched.run_dir.events, "ab") as f:
        f.write(b'{"attempt": 1, "event": "heartbeat-gap", "ti')
    assert sched.start_or_resume() is not None
    skipped: list[str] = []
    events = read_events(sched.run_dir, skipped=skipped)
    assert skipped == []
    assert [e["event"] for e in events] == ["launch", "torn-tail", "adopt"]
    assert events[1]["dropped"] == '{"attempt": 1, "event": "heartbeat-gap", "ti'


# --- every checkpoint damaged: the trainer's own refusal ------------------------------------------------------------


def test_a_trainer_whose_every_checkpoint_is_damaged_says_restore_not_delete(tmp_path):
    """It said "remove the corrupt step-* directories to start over": that led straight into a run that trains from
    sample 0 again (now refused by the orchestrator), throwing the checkpointed progress away."""
    from tests.trainer_helpers import describe, launch, write_job

    run = tmp_path / "run"
    job = write_job(tmp_path)
    one = "dp=1,tp=1,pp=1,mbs=4,gbs=16"
    assert launch(run, nproc=0, strategy=one, job=job, max_steps=1).returncode == 0
    (RunDir(run).checkpoint_dir(1) / "__0_0.distcp").unlink()
    result = launch(run, nproc=0, strategy=one, job=job, max_steps=2)
    assert result.returncode == 2, describe(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith("cona trainer: error:")]
    assert errors == [f"cona trainer: error: {RunDir(run).checkpoints}: no checkpoint can be loaded (the warnings "
                      "before this line in the attempt's log name each and why); restore them from a backup and "
                      "resume, or start over with a new --run-dir"], describe(result)  # fmt: skip


def _ended_slurm_run(tmp_path, status: str = "failed") -> RunDir:
    from cona.orchestrator.job import load_job
    from cona.orchestrator.profile import load_profile
    from cona.orchestrator.runstate import RunState, create_run, write_state

    from tests.conftest import EXAMPLES, PROFILES

    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(PROFILES / "local-slurm.yaml", ["slurm.qos=gone"]),
               job=load_job(EXAMPLES / "tiny-gpt.yaml"))  # fmt: skip
    write_state(run, RunState(status=status, final=status in ("failed", "stopped", "done"), reason="InvalidQOS"))
    return run


def test_an_ended_runs_submission_settings_can_change_on_resume_and_nothing_else(tmp_path):
    """`cona run --resume RUN --profile-set slurm.qos=...`: the fix that a job Slurm will not start asks for (an
    invalid QOS, a partition's time limit) could only be made by editing run.yaml, which --resume refused to touch."""
    from cona.orchestrator.runstate import RunLock, amend_profile, load_run

    run = _ended_slurm_run(tmp_path)
    amended = amend_profile(run, ["slurm.qos=normal", "slurm.time_limit=1:00:00"])
    assert amend_profile(run, ["env.NCCL_SOCKET_IFNAME=ib0"]).env == {"NCCL_SOCKET_IFNAME": "ib0"}
    profile, _ = load_run(run, resume=True)  # whole again, with the fix
    assert profile.slurm.qos == amended.slurm.qos == "normal" and profile.slurm.time_limit == "1:00:00"
    assert profile.nodes == 2 and profile.slurm.partition == "debug"  # the rest as it was
    event, _ = [e for e in read_events(run) if e["event"] == "profile-amended"]
    assert event["profile_set"] == ["slurm.qos=normal", "slurm.time_limit=1:00:00"]
    before = run.run_yaml.read_bytes()
    for overrides, expected in [
        (["nodes=1"], "--profile-set nodes=1: a resumed run keeps the profile it was planned for; only how its jobs "
                      "are submitted can change on resume (env.*, slurm.*, kubernetes.image and the other kubernetes"),
        (["env.RANK=3"], "RANK"),
        (["kubernetes.namespace=x"], "(of kubernetes: image, image_pull_secrets, service_account,"),
        (["kubernetes.image=reg/cona:2"], "the run's profile 'local-slurm' has no kubernetes section (its backend is "
                                          "'slurm')"),
        (["accelerator.peak_tflops=1"], "a resumed run keeps the profile it was planned for"),
        (["slurm=null"], "a resumed run keeps the profile it was planned for"),
        (["slurm.time_limit=soon"], "--profile-set slurm.time_limit"),
        (["slurm.qoss=x"], "qoss"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(expected)):
            amend_profile(run, overrides)
        assert run.run_yaml.read_bytes() == before  # refused: untouched
    def no_such_partition(profile) -> None:  # as `cona run`'s partition check answers (sinfo)
        raise ConfigError(f"slurm.partition {profile.slurm.partition!r}: no such partition on this cluster")

    with pytest.raises(ConfigError, match="'nosuch': no such partition"):
        amend_profile(run, ["slurm.partition=nosuch"], check=no_such_partition)
    assert run.run_yaml.read_bytes() == before  # refused by the check: untouched too
    with RunLock(run.lock), pytest.raises(ConfigError, match="another cona orchestrator"):
        amend_profile(run, ["slurm.qos=x"])
    going = _ended_slurm_run(tmp_path / "going", status="running")
    with pytest.raises(ConfigError, match=r"the run has not ended \(status running\)"):
        amend_profile(going, ["slurm.qos=x"])
    done = _ended_slurm_run(tmp_path / "done", status="done")
    with pytest.raises(ConfigError, match=r"the run has finished \(done\); there is nothing to resume"):
        amend_profile(done, ["slurm.qos=x"])
