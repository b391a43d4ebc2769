"""Elastic runs on the real local Slurm cluster (`min_nodes: 1` on the 2-node profile): a `--nodes=1-2` job that
gets one node starts on the strategy planned for one node; a run that loses a node goes on, replanned, on the node
that is left and grows back when the node returns; the samples stay exactly 0..N−1 throughout.

Every test that takes n2 away (drained, or its slurmd killed) gives it back in a fixture finalizer, so the tests
after it find both nodes idle.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cona.orchestrator.elastic import read_plan
from cona.orchestrator.runstate import read_state
from cona.protocol.strategy import Strategy

from tests.conftest import REPO
from tests.test_orchestrator_e2e import heartbeats, wait_for
from tests.test_slurm_cluster import LOCAL_CLUSTER, _sh, cluster  # noqa: F401 (the cluster fixture)
from tests.test_slurm_e2e import (  # noqa: F401 (slurm_run: the fixture)
    S4,
    _step_processes,
    assert_samples,
    losses,
    relaunched_losses,
    sets,
    slurm_run,
    snapshot,
)

pytestmark = [pytest.mark.slurm, pytest.mark.distributed]

ELASTIC = ["--profile-set", "min_nodes=1"]
PIDFILE = Path("/run/cona-slurm/slurmd-n2.pid")


def _node_state(node: str) -> str:
    return _sh("sinfo", "-h", "-N", "-n", node, "-o", "%T").stdout.strip()


def _states() -> dict[str, str]:
    """Every node's state in one `sinfo` call (`idle*`: not responding; a node just resumed shows it for a while)."""
    lines = _sh("sinfo", "-h", "-N", "-o", "%N|%T").stdout.split()
    return dict(line.split("|", 1) for line in lines if "|" in line)


def _both_nodes_idle() -> None:
    """Wait (bounded) until n1 and n2 are idle and responding, so that a `--nodes=1-2` job gets both."""
    wait_for(lambda: _states() == {"n1": "idle", "n2": "idle"}, timeout=300, what="n1 and n2 idle",
             detail=lambda: f"{_states()}\n{_sh('squeue').stdout}")  # fmt: skip


@pytest.fixture
def n2_drained(cluster):  # noqa: F811 (the imported fixture)
    """n2 drained (no new job lands there) for the test, resumed after it."""
    _sh("scontrol", "update", "nodename=n2", "state=drain", "reason=cona-elastic-test")
    try:
        yield
    finally:
        _sh("scontrol", "update", "nodename=n2", "state=resume")
        # Back in service (Slurm may still mark it not responding for a moment, as after any resume).
        wait_for(lambda: "drain" not in _node_state("n2"), timeout=120, what="n2 no longer drained",
                 detail=lambda: str(_states()))  # fmt: skip


@pytest.fixture
def n2_restorer(cluster):  # noqa: F811 (the imported fixture)
    """Whatever the test did to n2's slurmd, it is running and n2 is back in service afterwards."""
    yield
    if not _node_state("n2").startswith(("idle", "mix", "alloc")):
        subprocess.run([str(LOCAL_CLUSTER), "restart-node", "n2"], capture_output=True, timeout=180)
    wait_for(lambda: _node_state("n2").startswith(("idle", "mix", "alloc")), timeout=180, what="n2 back in service",
             detail=lambda: str(_states()))  # fmt: skip


def _on_two_nodes(run) -> int | None:
    """The run's current attempt when it runs on both nodes."""
    launches = run.events("launch")
    current = max((e["attempt"] for e in launches), default=0)
    started = run.attempt_json(current, "slurm.json") if current else {}
    return current if len(str(started.get("nodelist", "")).split(",")) == 2 else None


def test_an_elastic_job_that_gets_one_node_starts_on_the_strategy_planned_for_one_node(slurm_run, n2_drained):  # noqa: F811
    """`min_nodes: 1`: the job is submitted with `--nodes=1-2`; with n2 drained Slurm gives it n1 alone, and the
    batch script's helper runs the planning table's strategy for one node (other degrees than the two-node one)."""
    slurm_run.start(*ELASTIC, *sets(target__max_samples=800, eval__interval_samples=400))
    state = slurm_run.finish()
    launch, started = slurm_run.attempt_json(1, "launch.json"), slurm_run.attempt_json(1, "slurm.json")
    plan = read_plan(slurm_run.run)
    assert plan is not None and (plan.min_nodes, plan.max_nodes) == (1, 2)
    one, two = plan.strategy_for(1), plan.strategy_for(2)
    assert one is not None and two is not None and one.layout() != two.layout()
    assert set(launch["by_nnodes"]) == {"1", "2"} and Strategy.from_dict(launch["strategy"]) == two
    assert started["nnodes"] == 1 and started["nodelist"] == "n1"
    assert Strategy.from_dict(started["strategy"]) == one
    assert "NumNodes=1 " in _sh("scontrol", "show", "job", "-o", launch["job_id"]).stdout
    (elastic_start,) = slurm_run.events("elastic-start")
    assert elastic_start["nodes"] == 1 and Strategy.from_dict(elastic_start["strategy"]) == one
    assert read_state(slurm_run.run).attempts[0].strategy.world_size == 2
    first_beats = [hb for hb in heartbeats(slurm_run.run, 1) if hb.get("strategy")]
    assert first_beats and Strategy.from_dict(first_beats[0]["strategy"]) == one
    # `cona status` shows the world now, the range and the table.
    status = subprocess.run([sys.executable, "-m", "cona.orchestrator.cli", "status", str(slurm_run.run.root),
                             "--json"], cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    summary = json.loads(status.stdout)
    assert summary["elastic"]["min_nodes"] == 1 and summary["elastic"]["max_nodes"] == 2
    assert [p["nodes"] for p in summary["elastic"]["plans"]] == [1, 2]
    text = subprocess.run([sys.executable, "-m", "cona.orchestrator.cli", "status", str(slurm_run.run.root)],
                          cwd=REPO, capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    assert "elastic    1-2 nodes" in text and f"1 node(s), 2 devices: {one.short()}" in text, text
    assert_samples(slurm_run, state.live["samples"])


@pytest.mark.slow
def test_a_lost_node_shrinks_the_run_and_the_returning_node_grows_it_back(slurm_run, n2_restorer, tmp_path):  # noqa: F811
    """n2 dies mid-run (slurmd killed, its trainers frozen): the run goes on from the last complete checkpoint on
    n1 with the strategy planned for one node, and trains there exactly what a relaunch from that checkpoint
    trains. n2 comes back: growing is a switch the policy takes (a one-entry `schedule` of the two-node strategy
    always wants it: the knob that forces it), and the run finishes on two nodes with the samples exact."""
    if not PIDFILE.exists() or os.geteuid() != 0:
        pytest.skip("needs the cluster of slurm/local-cluster.sh, as root")
    _both_nodes_idle()
    schedule = f"[{{samples: 0, strategy: '{S4}'}}]"
    slurm_run.start(*ELASTIC, "--set", "policy.name=schedule", "--set", f"policy.schedule={schedule}",
                    *sets(target__max_samples=100000, checkpoint__keep=50))  # fmt: skip
    # Both nodes are idle: the `--nodes=1-2` job gets both, and runs the two-node plan.
    first = slurm_run.wait(lambda: _on_two_nodes(slurm_run), 240, "an attempt on two nodes")
    assert first == 1 and not slurm_run.events("elastic-start"), slurm_run.logs()
    slurm_run.running(steps=12, attempt=first)
    frozen = _step_processes(slurm_run.run.root, "n2")
    assert frozen, "no process of the job on n2"
    try:
        os.kill(int(PIDFILE.read_text()), signal.SIGKILL)
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        # SlurmdTimeout is 10 s on this cluster: n2 is DOWN within about 20 s, and polled every 0.5 s.
        shrink = slurm_run.wait(lambda: slurm_run.events("shrink"), 240, "the run to shrink after losing n2")[0]
        assert shrink["lost"] == ["n2"] and shrink["nodes"] == 1, shrink
        one = Strategy.from_dict(shrink["to"])
        assert one.world_size == 2 and one != Strategy.parse(S4)
        # The shrink is logged before the next attempt's launch: name that attempt, then wait for its launch.
        after = shrink["attempt"] + 1
        slurm_run.wait(lambda: [e for e in slurm_run.events("launch") if e["attempt"] == after], 240,
                       "the shrunk attempt's launch")  # fmt: skip
        resume = slurm_run.wait(lambda: slurm_run.resumes(after), 240, "the shrunk attempt's resume")[0]["resume"]
        # Copied now: the run trains on until the test stops it, and its pruning would remove this checkpoint.
        resumed_from = snapshot(slurm_run.run, resume, tmp_path / "resumed-from")
        slurm_run.wait(lambda: slurm_run.steps(after) >= resume + 3, 240, "three steps on one node")
    finally:
        subprocess.run([str(LOCAL_CLUSTER), "restart-node", "n2"], capture_output=True, timeout=180)
        for pid in set(frozen) & set(_step_processes(slurm_run.run.root, "n2")):  # normally gone by now
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    shrunk = slurm_run.attempt_json(after, "slurm.json")
    assert shrunk["nodelist"] == "n1" and Strategy.from_dict(slurm_run.attempt_json(after, "launch.json")["strategy"]) == one
    assert shrink["checkpoint"] == slurm_run.run.checkpoint_dir(resume).name and resume >= 10, shrink
    # Grows back once n2 is idle again: a resubmission on two nodes with the two-node strategy.
    grow = slurm_run.wait(lambda: slurm_run.events("grow"), 240, "the run to grow back to two nodes")[0]
    assert grow["nodes"] == 2 and grow["available_nodes"] == 2, grow
    grown = after + 1
    slurm_run.wait(lambda: slurm_run.steps(grown) > 0, 240, "training on two nodes again")
    subprocess.run([sys.executable, "-m", "cona.orchestrator.cli", "stop", str(slurm_run.run.root)], cwd=REPO,
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    assert slurm_run.proc is not None and slurm_run.proc.wait(timeout=400) == 0, slurm_run.logs()
    state = read_state(slurm_run.run)
    assert state.status == "stopped", slurm_run.logs()
    regrown = slurm_run.attempt_json(grown, "launch.json")
    assert Strategy.from_dict(regrown["strategy"]) == Strategy.parse(S4) and regrown["nnodes"] == 2
    assert len(slurm_run.attempt_json(grown, "slurm.json")["nodelist"].split(",")) == 2
    assert not slurm_run.events("failure"), slurm_run.logs()  # a lost node is not a crash of the trainer
    assert_samples(slurm_run, state.live["samples"])
    # The shrunk attempt resumed the checkpoint exactly: the losses of a relaunch from it, step by step.
    upto = resume + 3
    assert losses(slurm_run.run, after, upto) == relaunched_losses(resumed_from, tmp_path, step=resume, strategy=one,
                                                                     upto=upto)
