"""Elastic runs on the local backend, with real torchrun/gloo processes: the machine described as 2 nodes × 2
devices with `min_nodes: 1`; the run directory's `devices` file tells the backend it has fewer devices now."""

from __future__ import annotations

import json

import pytest
from cona.orchestrator.backends.base import Attempt, AttemptStatus, BackendError
from cona.orchestrator.backends.local.backend import DEVICES_FILE, LocalBackend
from cona.orchestrator.live import status_summary
from cona.orchestrator.profile import load_profile
from cona.orchestrator.runstate import read_events, read_state, request_stop
from cona.protocol.rundir import RunDir
from cona.protocol.samples_log import samples_file
from cona.protocol.strategy import Strategy

from tests.test_orchestrator_e2e import (
    PROFILE,
    SHORT,
    TINY,
    assert_attempts_never_overlap,
    assert_samples_exact,
    cona,
    finish,
    heartbeats,
    wait_for,
)
from tests.test_slurm_e2e import losses, relaunched_losses

S4 = "dp=4,tp=1,pp=1,mbs=4,gbs=16"
ELASTIC = ["--profile-set", "nodes=2", "--profile-set", "gpus_per_node=2", "--profile-set", "min_nodes=1"]


def _backend(tmp_path, *, min_nodes: int | None = 1) -> LocalBackend:
    profile = load_profile(PROFILE).model_copy(update={"nodes": 2, "gpus_per_node": 2, "min_nodes": min_nodes})
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir(parents=True)
    return LocalBackend(run_dir=run_dir, profile=profile)


def test_the_devices_file_is_the_machine_now(tmp_path):
    """No file: the profile's 4 devices; `2`: one node lost while 4 processes run; a bad value: a one-line error
    naming the file and what to write."""
    backend = _backend(tmp_path)
    attempt = Attempt(number=1, strategy=Strategy.parse(S4), backend_id="0")  # pid 0: not ours, ended
    assert backend.devices() == 4 and backend.available_nodes(attempt) == 2
    assert backend.poll(attempt).lost_nodes == ()
    (backend.run_dir.root / DEVICES_FILE).write_text("2\n")
    assert backend.available_nodes(attempt) == 1
    outcome = backend.poll(attempt)
    assert outcome.status is AttemptStatus.CRASHED and outcome.lost_nodes == ("devices 2-3",), outcome
    # Two processes are the smallest plan (min_nodes 1): nothing smaller to shrink to, the attempt goes on.
    (backend.run_dir.root / DEVICES_FILE).write_text("1")
    assert backend.poll(Attempt(number=2, strategy=Strategy.parse("dp=2,tp=1,pp=1,mbs=8,gbs=16"),
                                backend_id="0")).lost_nodes == ()  # fmt: skip
    (backend.run_dir.root / DEVICES_FILE).write_text("two")
    with pytest.raises(BackendError, match=r"devices: 'two' is not a device count; write one integer \(0 to 4\)"):
        backend.devices()
    # Not elastic: the file changes nothing.
    plain = _backend(tmp_path / "plain", min_nodes=None)
    (plain.run_dir.root / DEVICES_FILE).write_text("2")
    assert plain.available_nodes(attempt) is None and plain.poll(attempt).lost_nodes == ()


@pytest.mark.distributed
@pytest.mark.slow
def test_fewer_devices_shrink_the_run_and_their_return_grows_it_back(tmp_path):
    """4 processes; the `devices` file says 2 mid-run: the attempt ends as lost devices, the run goes on from the
    last complete checkpoint in 2 processes with the strategy planned for one node, training exactly what a fresh
    torchrun of that strategy from that checkpoint trains. The file is removed: growing is a switch the policy
    takes (a one-entry `schedule` of the 4-process strategy always wants it: the knob that forces it), and the run
    trains on 4 processes until it is stopped, the samples exactly 0..N−1 across the three attempts."""
    run_dir = RunDir(tmp_path / "run")
    schedule = ["--set", "policy.name=schedule", "--set", f"policy.schedule=[{{samples: 0, strategy: '{S4}'}}]",
                "--set", "policy.decision_interval_s=1", "--set", "target.max_samples=100000",
                "--set", "checkpoint.keep=50"]  # fmt: skip
    proc = cona("run", "--profile", PROFILE, "--job", TINY, "--run-dir", str(run_dir.root), *SHORT, *schedule,
                *ELASTIC)  # fmt: skip

    def steps(attempt: int) -> int:
        return max((hb.get("step", 0) for hb in heartbeats(run_dir, attempt)), default=0)

    def events(kind: str) -> list[dict]:
        return [e for e in read_events(run_dir) if e["event"] == kind] if (run_dir.root / "events.jsonl").exists() else []

    def output() -> str:
        return "\n".join(json.dumps(e)[:300] for e in read_events(run_dir))

    try:
        wait_for(lambda: run_dir.latest_checkpoint() is not None and steps(1) >= 12, timeout=240,
                 what="attempt 1: a checkpoint and step 12", detail=output)  # fmt: skip
        (run_dir.root / DEVICES_FILE).write_text("2\n")
        wait_for(lambda: events("shrink"), timeout=120, what="the run to shrink", detail=output)
        shrink = events("shrink")[0]
        assert shrink["lost"] == ["devices 2-3"] and shrink["nodes"] == 1, shrink
        one = Strategy.from_dict(shrink["to"])
        assert one.world_size == 2 and one != Strategy.parse(S4)
        summary = status_summary(run_dir)  # `cona status`: the range, the plans, what the devices file says
        assert summary["elastic"]["devices_file"] == "2" and [p["nodes"] for p in summary["elastic"]["plans"]] == [1, 2]
        wait_for(lambda: steps(2) >= 3 + int(shrink["checkpoint"].rsplit("-", 1)[-1]), timeout=180,
                 what="three steps on two processes", detail=output)  # fmt: skip
        (run_dir.root / DEVICES_FILE).unlink()
        wait_for(lambda: events("grow"), timeout=120, what="the run to grow back", detail=output)
        wait_for(lambda: steps(3) > 0, timeout=180, what="training on 4 processes again", detail=output)
        request_stop(run_dir)
        out = finish(proc, timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    state = read_state(run_dir)
    assert state.status == "stopped" and not events("failure"), output()
    assert [e["status"] for e in events("attempt-end")] == ["lost-node", "switched", "stopped"], output()
    assert [a.strategy for a in state.attempts] == [Strategy.parse(S4), one, Strategy.parse(S4)]
    assert run_dir.read_launch(2).strategy == one
    assert events("grow")[0]["available_nodes"] == 2
    assert_attempts_never_overlap(run_dir)
    assert assert_samples_exact(run_dir) == state.live["samples"]
    # The shrunk attempt resumed from the checkpoint the shrink names, exactly as a fresh relaunch from it.
    resume = next(json.loads(x)["resume"] for x in samples_file(run_dir, 2).read_text().splitlines() if '"resume"' in x)
    assert shrink["checkpoint"] == run_dir.checkpoint_dir(resume).name and resume >= 10, shrink
    upto = resume + 3
    assert losses(run_dir, 2, upto) == relaunched_losses(run_dir, tmp_path, step=resume, strategy=one, upto=upto)
