"""The numbers `cona report` and `cona status` print agree with the run's own records (hand-written run dirs)."""

from __future__ import annotations

import json

from cona.orchestrator.job import load_job
from cona.orchestrator.live import status_summary
from cona.orchestrator.profile import load_profile
from cona.orchestrator.report import write_report
from cona.orchestrator.runstate import RunState, create_run, write_state
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy

from tests.conftest import EXAMPLES, PROFILES

A = Strategy.parse("dp=2,tp=1,pp=2,mbs=8,gbs=32")


def _run(tmp_path, events: list[dict], beats: list[dict], state: RunState) -> RunDir:
    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(PROFILES / "local-cpu.yaml"), job=load_job(EXAMPLES / "tiny-gpt.yaml"))
    with open(run.events, "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    run.heartbeats.mkdir(parents=True, exist_ok=True)
    for attempt in sorted({b["attempt"] for b in beats}):
        mine = [b for b in beats if b["attempt"] == attempt]
        run.heartbeat_file(attempt).write_text("".join(json.dumps(b) + "\n" for b in mine))
    write_state(run, state)
    return run


def _beat(time: float, step: int, attempt: int = 1, **extra: object) -> dict:
    return {"attempt": attempt, "time": time, "step": step, "samples": 32 * step, "tokens": 2048 * step, "lr": 1e-3,
            "train_loss": 3.0, "strategy": A.to_dict(), "samples_per_s": 200.0, "step_time_s": 0.16, **extra}  # fmt: skip


def test_report_wall_time_runs_to_the_end_event_as_cona_run_says(tmp_path):
    """`cona run` prints (and the `done` event records) the time from the start to the run's end; the trainer's exit
    and the orchestrator's follow-up come after the last heartbeat and are part of it."""
    events = [
        {"time": 100.0, "event": "start", "strategy": A.to_dict()},
        {"time": 100.1, "event": "launch", "attempt": 1, "strategy": A.to_dict(), "reason": "initial strategy"},
        {"time": 135.0, "event": "done", "samples": 320, "elapsed_s": 35.0, "switches": 0},
    ]
    run = _run(tmp_path, events, [_beat(120.0, 5), _beat(130.0, 10)], RunState(status="done", final=True))
    _, md = write_report(run)
    assert "- samples: 320; steps: 10; wall time: 35.0 s" in md.read_text()


def test_report_wall_time_of_a_run_going_on_is_its_latest_heartbeat(tmp_path):
    """A resumed run's earlier `stopped` event is not its end."""
    events = [
        {"time": 100.0, "event": "start", "strategy": A.to_dict()},
        {"time": 110.0, "event": "stopped", "reason": "stopped on request", "samples": 160},
        {"time": 115.0, "event": "resume-run", "previous_status": "stopped"},
    ]
    run = _run(tmp_path, events, [_beat(105.0, 5), _beat(130.0, 10)], RunState(status="running"))
    _, md = write_report(run)
    assert "wall time: 30.0 s" in md.read_text()


def test_status_of_an_ended_run_has_no_time_to_go(tmp_path):
    """state.json keeps the last live ETA; `cona status --json` of a done or stopped run must not offer it."""
    live = {"step": 10, "samples": 320, "eta_s": 4.2, "samples_per_s": 200.0}
    run = _run(tmp_path, [{"time": 100.0, "event": "start", "strategy": A.to_dict()}], [_beat(130.0, 10)],
               RunState(status="stopped", final=True, model={"live": live}))  # fmt: skip
    assert status_summary(run)["eta_s"] is None
    write_state(run, RunState(status="running", model={"live": live}))
    assert status_summary(run)["eta_s"] == 4.2


def test_strategies_table_measures_each_attempt_on_its_own(tmp_path):
    """A run stopped and resumed (or switched back) runs the same strategy in two attempts: each row shows the mean of
    its own attempt's heartbeats, not of both."""
    events = [
        {"time": 100.0, "event": "start", "strategy": A.to_dict()},
        {"time": 100.0, "event": "launch", "attempt": 1, "strategy": A.to_dict(), "reason": "initial strategy"},
        {"time": 140.0, "event": "launch", "attempt": 2, "strategy": A.to_dict(), "reason": "resume"},
    ]
    beats = [_beat(110.0, 5, samples_per_s=100.0), _beat(150.0, 10, attempt=2, samples_per_s=300.0)]
    run = _run(tmp_path, events, beats, RunState(status="running"))
    text = write_report(run)[1].read_text()
    assert "| 1 | 0.0 | `d2t1p2 m8 g32` | 100.0 | initial strategy |" in text
    assert "| 2 | 40.0 | `d2t1p2 m8 g32` | 300.0 | resume |" in text


def test_noise_plot_says_it_shows_the_estimate_not_the_ranked_b_noise(tmp_path, monkeypatch):
    """`cona status` prints the cona policy's B_noise, `critical_batch_factor` (5) times the estimate the plot draws:
    an axis labelled plain "B_noise" reads 5× off."""
    import matplotlib.figure

    figures: list[matplotlib.figure.Figure] = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: (figures.append(self), save(self, *a, **k)))
    run = _run(tmp_path, [{"time": 100.0, "event": "start", "strategy": A.to_dict()}], [_beat(110.0, 5)],
               RunState(status="running"))  # fmt: skip
    write_report(run)
    label = figures[0].axes[1].get_ylabel()
    assert label.startswith("estimate") and "B_noise = 5× this" in label


def test_tensorboard_switch_of_a_restarted_orchestrator_is_at_the_switch_point(tmp_path):
    """A restarted orchestrator's new writer completes a pending switch on the first heartbeats it reads (the new
    attempt's resume record, at the switch point 2000), before it has seen any: the marker belongs there, not at 0."""
    from cona.orchestrator.tensorboard import TensorBoardWriter
    from cona.protocol.heartbeat_record import Heartbeat

    from tests.test_tensorboard import read_events

    B = Strategy.parse("dp=4,tp=1,pp=1,mbs=4,gbs=16")
    writer = TensorBoardWriter(tmp_path)
    writer.switch(source=B, target=A, cost_s=2.9, kind="in_place")
    writer.heartbeats([Heartbeat.from_dict(_beat(0.0, 2000 // 32, attempt=2, event="resume") | {"samples": 2000})],
                      noise_estimate=None, noise_scale=None)  # fmt: skip
    writer.close()
    scalars, texts = read_events(tmp_path / "tensorboard")
    assert scalars["switch"] == [(2000, 1.0)]
    assert (2000, f"switch {B.short()} → {A.short()} at sample 2000 (in_place, 2.9 s)") in texts


def test_console_says_a_stopped_run_was_resumed(tmp_path, capsys):
    """`cona run --resume` of a stopped run: the console shows the resume itself, not only a launch whose reason
    ("resume after preemption") reads as if the cluster had taken the run away."""
    from cona.orchestrator.live import LiveView

    events = [
        {"time": 110.0, "event": "stopped", "reason": "stopped on request", "samples": 160},
        {"time": 115.0, "event": "resume-run", "previous_status": "stopped"},
        {"time": 115.1, "event": "launch", "attempt": 2, "strategy": A.to_dict(), "reason": "resume after preemption"},
    ]
    run = _run(tmp_path, events, [_beat(105.0, 5)], RunState(status="running"))
    capsys.readouterr()
    LiveView(run_dir=run, job=load_job(EXAMPLES / "tiny-gpt.yaml"), quiet=True)._print_events()
    out = capsys.readouterr().out
    assert "cona: resume-run: {'previous_status': 'stopped'}" in out and "cona: launch attempt 2" in out
