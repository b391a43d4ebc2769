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
