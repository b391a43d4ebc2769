"""`cona report` from a run directory's records (no training needed)."""

from __future__ import annotations

from cona.orchestrator.job import load_job
from cona.orchestrator.profile import load_profile
from cona.orchestrator.report import write_report
from cona.orchestrator.runstate import RunState, create_run, log_event, write_state
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy

from tests.conftest import EXAMPLES, PROFILES


def test_report_lists_switches_and_their_measured_costs_by_kind(tmp_path):
    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(PROFILES / "local-cpu.yaml"), job=load_job(EXAMPLES / "tiny-gpt.yaml"))
    a, b = Strategy.parse("dp=1,tp=1,pp=4,mbs=4,gbs=16"), Strategy.parse("dp=2,tp=1,pp=2,mbs=16,gbs=64")
    log_event(run, "start", strategy=a.to_dict())
    log_event(run, "launch", attempt=1, strategy=a.to_dict(), reason="initial strategy")
    log_event(run, "switch", attempt=1, **{"from": a.to_dict()}, to=b.to_dict(), reason="R 1.2× current", kind="in_place")
    log_event(run, "launch", attempt=2, strategy=b.to_dict(), reason="switch in place")
    log_event(run, "switch-complete", attempt=2, switch_cost_s=1.234, kind="in_place", predicted_s=1.0)
    log_event(run, "done", samples=100, val_perplexity=5.4)
    write_state(run, RunState(status="done", final=True, model={"switch_costs": {"in_place": [1.234]}}))
    png, md = write_report(run)
    text = md.read_text()
    assert png.stat().st_size > 10_000
    assert "`d1t1p4 m4 g16` → `d2t1p2 m16 g64`" in text
    assert "1.2 s in place (predicted 1.0 s)" in text


def test_damaged_records_are_skipped_by_status_and_report_and_said(tmp_path, capsys):
    """A heartbeat or event line of the wrong types (edited by hand, or bytes flipped into valid JSON), or one that is
    not JSON at all, is skipped: status and report still work from the rest, and each says in one line on stderr
    how many lines it left out and where the first one is."""
    import json

    from cona.orchestrator.live import status_summary

    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(PROFILES / "local-cpu.yaml"), job=load_job(EXAMPLES / "tiny-gpt.yaml"))
    a, b = Strategy.parse("dp=1,tp=1,pp=4,mbs=4,gbs=16"), Strategy.parse("dp=4,tp=1,pp=1,mbs=4,gbs=16")
    log_event(run, "start", strategy=a.to_dict())
    log_event(run, "switch", attempt=1, **{"from": a.to_dict()}, to=b.to_dict(), reason="R 1.2× current")
    with open(run.events, "a") as f:
        f.write(json.dumps({"event": "switch", "time": "now", "from": "x", "to": 3}) + "\n")
        f.write(json.dumps({"event": "switch", "time": 5.0, "from": a.to_dict(), "to": {"dp": "four"}}) + "\n")
        f.write(json.dumps({"event": 7, "time": 5.0}) + "\n")
        f.write("\x00\x00 garbage\n")
    run.heartbeats.mkdir(parents=True, exist_ok=True)
    good = {"attempt": 1, "time": 10.0, "step": 1, "samples": 16, "train_loss": 5.0, "strategy": a.to_dict(),
            "samples_per_s": 100.0, "val_loss": 5.1, "tokens": 1024, "lr": 1e-3, "step_time_s": 0.16}  # fmt: skip
    bad = {**good, "samples": "lots", "time": "now", "val_loss": "low"}
    odd_strategy = {**good, "strategy": {"dp": 1}}
    run.heartbeat_file(1).write_text("".join(json.dumps(r) + "\n" for r in (good, bad, odd_strategy)) + "{oops\n")
    capsys.readouterr()
    summary = status_summary(run)
    assert [s["to"] for s in summary["switches"]] == [b.to_dict()]
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and f"{run.events}: the line at byte" in warning[0] and "(and 3 more)" in warning[0]
    _, md = write_report(run)
    assert "`d1t1p4 m4 g16` → `d4t1p1 m4 g16`" in md.read_text()
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "(and 6 more)" in warning[0]  # 4 event lines, 3 heartbeats (one not JSON)


def test_status_without_state_json_says_so_instead_of_created(tmp_path):
    from cona.orchestrator.live import status_summary

    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(PROFILES / "local-cpu.yaml"), job=load_job(EXAMPLES / "tiny-gpt.yaml"))
    assert status_summary(run)["status"] == "created"  # nothing launched yet
    a = Strategy.parse("dp=1,tp=1,pp=4,mbs=4,gbs=16")
    log_event(run, "start", strategy=a.to_dict())
    log_event(run, "launch", attempt=1, strategy=a.to_dict(), reason="initial strategy")
    log_event(run, "done", samples=100, val_perplexity=5.4)
    summary = status_summary(run)
    assert summary["status"] == "unknown" and "state.json is missing" in summary["reason"] and "'done'" in summary["reason"]
    write_state(run, RunState(status="done", final=True))
    assert status_summary(run)["status"] == "done"
