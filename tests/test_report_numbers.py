"""The numbers `cona report` and `cona status` print agree with the run's own records (hand-written run dirs)."""

from __future__ import annotations

import json

import pytest
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
    # Without the 5 s it lay stopped (110 → 115), as the scheduler's elapsed time counts it.
    assert "wall time: 25.0 s (without the 5.0 s it lay stopped before `cona run --resume`)" in md.read_text()


def test_report_leaves_out_the_time_a_run_lay_stopped_from_when_its_trainer_stopped(tmp_path):
    """The trainer served `cona stop` at 110 while no orchestrator ran; the resume at 125 logged the stop then, with
    the time it happened (`at`): the pause is 110 → 125, not 121 → 125, and a damaged `at` is no time."""
    events = [
        {"time": 100.0, "event": "start", "strategy": A.to_dict()},
        {"time": 121.0, "at": 110.0, "event": "stopped", "reason": "stopped on request while its orchestrator was gone"},
        {"time": 125.0, "event": "resume-run", "previous_status": "stopped"},
    ]
    run = _run(tmp_path, events, [_beat(105.0, 5), _beat(140.0, 10)], RunState(status="running"))
    _, md = write_report(run)
    assert "wall time: 25.0 s (without the 15.0 s it lay stopped before `cona run --resume`)" in md.read_text()


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
    beats = [_beat(105.0, 2, samples_per_s=10.0), _beat(110.0, 5, samples_per_s=100.0),  # each attempt's warm-up first
             _beat(145.0, 7, attempt=2, samples_per_s=10.0), _beat(150.0, 10, attempt=2, samples_per_s=300.0)]  # fmt: skip
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
    assert "cona: resume-run: previous_status=stopped" in out and "cona: launch attempt 2" in out


# ------------------------------------------------------------------ warm-up windows, and the console after a switch

B = Strategy.parse("dp=4,tp=1,pp=1,mbs=4,gbs=16")


def _model():
    from cona.orchestrator.planner import enumerate_candidates
    from cona.orchestrator.runmodel import RunModel
    from cona.orchestrator.switchcost import SwitchKind

    profile, job = load_profile(PROFILES / "local-cpu.yaml"), load_job(EXAMPLES / "tiny-gpt.yaml")
    candidates = enumerate_candidates(profile=profile, job=job, feasible_only=True)
    return RunModel(profile=profile, job=job, candidates=candidates, switch_kind=lambda a, b: SwitchKind.RELAUNCH,
                    switch_overhead_s=lambda kind: 1.0)  # fmt: skip


def _attempt_beats(attempt: int, strategy: Strategy, t0: float, first_step: int, *, warm_s: float, steady_s: float,
                   first: str = "start") -> list[dict]:  # fmt: skip
    """One attempt's heartbeats: its start/resume record, a slow warm-up window, then two steady ones."""
    g = strategy.gbs

    def at(i: int, step_time_s: float, **extra: object) -> dict:
        step = first_step + i
        return _beat(t0 + i, step, attempt=attempt, strategy=strategy.to_dict(), samples=g * step,
                     step_time_s=step_time_s, samples_per_s=g / step_time_s if step_time_s else 0.0, **extra)  # fmt: skip

    return [at(0, 0.0, event=first), at(1, warm_s), at(2, steady_s), at(3, steady_s)]


def test_report_samples_per_s_leaves_out_each_attempts_warm_up_as_the_run_model_does(tmp_path, monkeypatch):
    """An attempt's first window after its launch (compilation, allocations, first collectives) is far slower than
    the rest. The run model (and so the policy and the live line) does not count it: the report's samples/s per
    attempt and per strategy must not either, or they show another number than the one the run was steered by."""
    import matplotlib.figure
    from cona.protocol.heartbeat_record import Heartbeat

    first = _attempt_beats(1, A, 110.0, 0, warm_s=1.6, steady_s=0.16)  # 20 samples/s warming up, then 200
    second = _attempt_beats(2, B, 150.0, 10, warm_s=1.0, steady_s=0.05, first="resume")  # 16, then 320
    events = [
        {"time": 100.0, "event": "start", "strategy": A.to_dict()},
        {"time": 100.0, "event": "launch", "attempt": 1, "strategy": A.to_dict(), "reason": "initial strategy"},
        {"time": 140.0, "event": "launch", "attempt": 2, "strategy": B.to_dict(), "reason": "switch"},
    ]
    run = _run(tmp_path, events, first + second, RunState(status="running"))
    figures: list[matplotlib.figure.Figure] = []
    save = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda self, *a, **k: (figures.append(self), save(self, *a, **k)))
    text = write_report(run)[1].read_text()

    model = _model()
    rates = []
    for number, strategy, beats in ((1, A, first), (2, B, second)):
        model.attempt_started(number, strategy)
        model.absorb(number, strategy, [Heartbeat.from_dict(b) for b in beats])
        rates.append(model.live.samples_per_s)
        assert model.throughput.samples_per_s_of(strategy) == pytest.approx(model.live.samples_per_s)
    assert rates == [pytest.approx(200.0), pytest.approx(320.0)]
    assert f"| 1 | 0.0 | `d2t1p2 m8 g32` | {rates[0]:.1f} | initial strategy |" in text
    assert f"| 2 | 40.0 | `d4t1p1 m4 g16` | {rates[1]:.1f} | switch |" in text
    bars = [patch.get_height() for patch in figures[0].axes[2].patches]
    assert bars == [pytest.approx(200.0), pytest.approx(320.0)]


def test_console_counts_a_switch_when_it_is_decided_and_shows_no_old_rate_after_it(tmp_path, capsys):
    """`cona run`'s line after a switch: the switch counts as soon as its event is logged (as in `cona status`), not
    at the next launch; and from the new attempt's launch until its first window after warm-up, samples/s and the
    ETA are "—", not the previous attempt's numbers next to the new attempt and strategy."""
    from cona.orchestrator.live import LiveView
    from cona.orchestrator.runstate import log_event
    from cona.orchestrator.switchcost import SwitchKind
    from cona.protocol.heartbeat_record import Heartbeat

    run = _run(tmp_path, [{"time": 100.0, "event": "start", "strategy": A.to_dict()}], [], RunState(status="running"))
    view = LiveView(run_dir=run, job=load_job(EXAMPLES / "tiny-gpt.yaml"), interval_s=0.0)
    model = _model()
    first = _attempt_beats(1, A, 110.0, 0, warm_s=1.6, steady_s=0.16)
    second = _attempt_beats(2, B, 150.0, 10, warm_s=1.0, steady_s=0.05, first="resume")

    def line() -> str:
        capsys.readouterr()
        view.update(model.live)
        return capsys.readouterr().out.strip().splitlines()[-1]

    def absorb(number: int, strategy: Strategy, beats: list[dict]) -> None:
        model.absorb(number, strategy, [Heartbeat.from_dict(b) for b in beats])

    log_event(run, "launch", attempt=1, strategy=A.to_dict(), reason="initial strategy")
    model.attempt_started(1, A)
    absorb(1, A, first[:2])  # the start record and the warm-up window: nothing measured yet
    assert "| — samples/s |" in line() and line().endswith("| ETA —")
    absorb(1, A, first[2:])
    assert "| 200 samples/s |" in line() and "ETA —" not in line() and "| switches 0 |" in line()

    log_event(run, "switch", attempt=1, **{"from": A.to_dict()}, to=B.to_dict(), reason="R 1.2× current")
    now = line()  # the old attempt still trains up to its switch point: its own rate, on its own strategy
    assert "| switches 1 |" in now and "on d2t1p2 m8 g32 | 200 samples/s" in now
    assert model.live.switches == 0  # the model counts it only once it is under way

    model.switch_started(requested_at=140.0, to_attempt=2, kind=SwitchKind.RELAUNCH, predicted_s=5.0)
    model.attempt_started(2, B)
    log_event(run, "launch", attempt=2, strategy=B.to_dict(), reason="switch")
    now = line()
    assert "attempt 2 |" in now and "on d4t1p1 m4 g16 | — samples/s" in now and now.endswith("| ETA —")
    assert "| switches 1 |" in now  # the model's count caught up: not counted twice
    write_state(run, RunState(status="running", model=model.to_dict()))  # what `cona status --json` reads
    assert (status_summary(run)["samples_per_s"], status_summary(run)["eta_s"]) == (None, None)
    absorb(2, B, second[:2])  # its resume record and warm-up window
    model.decide(now=152.0, current=B, strategy_since=140.0, elapsed_s=52.0)
    now = line()
    assert "| — samples/s |" in now and now.endswith("| ETA —"), now
    absorb(2, B, second[2:3])  # its first measured window: the rate and the time to target at once
    now = line()
    assert "| 320 samples/s |" in now and "ETA —" not in now and model.live.eta_s is not None

    capsys.readouterr()
    view.end(type("Ended", (), {"state": RunState(status="done"), "live": model.live})())
    assert "1 switch(es)" in capsys.readouterr().out


def test_report_samples_per_s_is_samples_over_time_not_the_mean_of_window_rates(tmp_path):
    """Windows at 400 and 100 samples/s over the same samples train at 160 samples/s: the arithmetic mean of the
    rates (250) overstated what the attempt trained (a sweep's report said 244.5 where 231 was trained)."""
    beats = _attempt_beats(1, A, 110.0, 0, warm_s=1.6, steady_s=0.08)  # warm-up, then 400, 400
    beats[3] = {**beats[3], "step_time_s": 0.32, "samples_per_s": A.gbs / 0.32}  # ... and 100
    events = [{"time": 100.0, "event": "start", "strategy": A.to_dict()},
              {"time": 100.0, "event": "launch", "attempt": 1, "strategy": A.to_dict(), "reason": "initial strategy"}]
    text = write_report(_run(tmp_path, events, beats, RunState(status="running")))[1].read_text()
    assert "| 1 | 0.0 | `d2t1p2 m8 g32` | 160.0 | initial strategy |" in text, text
