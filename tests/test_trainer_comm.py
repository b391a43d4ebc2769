"""A peer lost or hung in a collective (`cona.trainer.distributed.CommunicationError`, `parallel.collective_timeout_s`).

- A save whose collectives lose a peer starts no collective after it (the agreement would fail a second time, or
  hang where the survivors meet in different collectives) and marks nothing complete.
- A resume whose load loses a peer does not fall back to an older checkpoint (another collective, and a good
  checkpoint passed over).
- The rank ends as a crash: exit 1, one line, its crash record naming the communication error, no exit record.
- Every group the model trains on waits at most `parallel.collective_timeout_s` in one collective; a hold at a switch
  point, which waits for the orchestrator's decision, goes in rounds far shorter than that.
- End to end: a peer on another node hung inside a save ends the survivor after the timeout, not 30 minutes.

All but the last in one process (a gloo world of one, the peer's failure injected where gloo raises it).
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cona.protocol.job import JobSpec, load_job
from cona.protocol.rundir import RunDir, SwitchPoints, describe_crashes
from cona.protocol.strategy import Strategy
from cona.trainer import checkpoint as ckpt
from cona.trainer import train
from cona.trainer.control import Action
from cona.trainer.data import load_corpus
from cona.trainer.distributed import CommunicationError, bound_collectives, init_distributed
from cona.trainer.train import Trainer

try:
    import tests.trainer_helpers as helpers
except ImportError:  # tests/ is not a package here
    import trainer_helpers as helpers

ONE = Strategy.parse("dp=1,tp=1,pp=1,mbs=8,gbs=16")
# What gloo raises when the peer's process is gone (a RuntimeError: only its words say so).
PEER_GONE = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
             "[127.0.0.1]:3468. This is typically caused by a remote worker crashing. Check the logs of the remote "
             "worker before reporting an error. GLHF!")  # fmt: skip
COLLECTIVES = ("all_reduce", "all_gather_object", "broadcast_object_list", "barrier", "gather_object", "all_gather")


def _trainer(tmp_path: Path, **job_sections: dict) -> Trainer:
    init_distributed()
    job: JobSpec = load_job(helpers.write_job(tmp_path, **job_sections), [])
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    return Trainer(job=job, strategy=ONE, run_dir=RunDir(run), attempt=0, env=init_distributed(), corpus=load_corpus(job))


def _peer_lost_in(monkeypatch, dcp_call: str) -> list[str]:
    """Make DCP's `dcp_call` ("save", "load") raise gloo's error for a lost peer; returns the names of the
    collectives started after it (filled as they start)."""
    started: list[str] = []
    broken = [False]
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            if broken[0]:
                started.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(dist, name, counting)

    def lost(*args, **kwargs):
        broken[0] = True
        raise RuntimeError(PEER_GONE)

    monkeypatch.setattr(ckpt.dcp, dcp_call, lost)
    return started


def test_a_save_that_loses_a_peer_starts_no_collective_after_it(tmp_path, monkeypatch):
    """DCP's gather raised `Connection closed by peer` (the peer died writing its shards): the save went on to its
    agreement all-reduce on the broken group, which failed again naming nothing, or — where the survivors were in
    different collectives, one still in DCP's gather — hung until the groups' timeout (30 minutes under gloo). Now
    the save raises CommunicationError at once, and the partial checkpoint has no COMPLETE marker."""
    trainer = _trainer(tmp_path)
    trainer.resume()
    trainer.step()
    started = _peer_lost_in(monkeypatch, "save")
    with pytest.raises(CommunicationError, match=r"Connection closed by peer \[127\.0\.0\.1\]:3468; nothing was saved"):
        trainer.save()
    assert started == []
    assert not (trainer.run_dir.checkpoint_dir(1) / "COMPLETE").exists()
    assert trainer.run_dir.complete_checkpoints() == []


def test_a_resume_that_loses_a_peer_does_not_fall_back_to_an_older_checkpoint(tmp_path, monkeypatch):
    """A load that lost a peer was taken for a damaged checkpoint: an all-reduce on the broken group, then the
    next older checkpoint, a good one passed over with a warning."""
    trainer = _trainer(tmp_path)
    trainer.resume()
    trainer.save()  # step 0
    trainer.step()
    trainer.save()  # step 1
    started = _peer_lost_in(monkeypatch, "load")
    again = _trainer(tmp_path)
    with pytest.raises(CommunicationError, match="Connection closed by peer"):
        again.resume()
    assert started == [] and again._notices == []


def test_a_peer_lost_in_a_step_ends_the_rank_as_a_crash_in_one_line(tmp_path, monkeypatch, capsys):
    """Exit 1 (a crash: relaunched from the last complete checkpoint), no checkpoint and no exit record (both need
    collectives), the rank's crash record naming the communication error, one line instead of a traceback."""
    from cona.trainer.main import main

    def step(self):
        raise RuntimeError(PEER_GONE)

    run, argv = helpers.one_rank_main(tmp_path, monkeypatch, step=step, attempt=2, extra=("--max-steps", "3"))
    status = main(argv)
    assert status == 1
    assert run.read_exit(2) is None
    assert not run.checkpoints.exists() or not any(run.checkpoints.iterdir())
    crash = describe_crashes(run.read_crashes(2))
    assert crash is not None and crash.startswith("rank 0: CommunicationError: a collective failed (a peer died"), crash
    assert "Connection closed by peer [127.0.0.1]:3468; nothing was saved" in crash and "GLHF" not in crash, crash
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if "error" in line] == [
        "cona trainer: error: rank 0: " + crash.removeprefix("rank 0: CommunicationError: ")
    ]


def test_the_model_groups_wait_at_most_the_collective_timeout(tmp_path):
    """torch's default is 30 minutes under gloo (10 under NCCL), and a subgroup (the device mesh's, `new_group`'s)
    gets it whatever the world's group was given. (In a world of one every mesh dimension is the world's group, so
    the subgroup is made here.)"""
    trainer = _trainer(tmp_path, parallel={"collective_timeout_s": 42})

    def timeout(group: dist.ProcessGroup) -> datetime.timedelta:
        return group._get_backend(torch.device("cpu")).options._timeout

    for group in [dist.distributed_c10d._get_default_group(), *trainer.model.own_process_groups()]:
        assert timeout(group) == datetime.timedelta(seconds=42)
    subgroup = dist.new_group([0])
    assert timeout(subgroup) == datetime.timedelta(minutes=30)
    bound_collectives([subgroup], 42)
    assert timeout(subgroup) == datetime.timedelta(seconds=42)
    dist.destroy_process_group(subgroup)


def test_a_hold_waits_in_rounds_shorter_than_the_collective_timeout(tmp_path, monkeypatch):
    """The other ranks waited in one all-reduce for the whole hold (up to the switch points' `wait_s`, which the
    orchestrator sets to 10 decision intervals): a decision slower than `parallel.collective_timeout_s` would have
    ended the run as a lost peer. Rank 0 now shares its news at least every HOLD_ROUND_S."""
    trainer = _trainer(tmp_path)
    trainer.resume()
    trainer.switch_points = SwitchPoints(samples=(16,), wait_s=1.0)
    monkeypatch.setattr(train, "HOLD_ROUND_S", 0.1, raising=False)
    rounds = [0]
    real = dist.all_reduce

    def counting(*args, **kwargs):
        rounds[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting)
    assert trainer._hold() == Action.SWITCH and trainer._hold_timed_out
    assert rounds[0] >= 5, rounds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_a_peer_hung_on_another_node_in_a_save_ends_the_survivor_after_the_collective_timeout(tmp_path):
    """Two nodes of one process each (two torchruns, a static rendezvous on this host): rank 1 hangs (SIGSTOP) while
    it writes its shards of the save at step 3. Rank 0 waited in DCP's gather for torch's default 30 minutes — its
    torchrun sees nothing wrong, and the SIGTERM watcher looks at its own node only. It now ends after
    `parallel.collective_timeout_s`, starts no collective after that, and exits 1 with its crash record; the save
    has no COMPLETE marker and the checkpoint of step 2 stays the last complete one."""
    job = helpers.write_job(tmp_path, checkpoint={"interval_steps": 2, "keep": 3}, parallel={"collective_timeout_s": 20})
    run = tmp_path / "run"
    port, nodes = _free_port(), []
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
                   "--master-addr=127.0.0.1", f"--master-port={port}", "--max-restarts=0", "-m", "tests.save_fault_trainer",
                   "--run-dir", str(run), "--attempt", "0", "--job", str(job), "--strategy", "dp=2,tp=1,pp=1,mbs=4,gbs=16",
                   "--max-steps", "3"]  # fmt: skip
            nodes.append(subprocess.Popen(cmd, cwd=helpers.REPO, env={**helpers.trainer_env(), "CONA_TEST_SAVE_FAULT": "1:stop@3"},
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True))  # fmt: skip
        try:
            _, stderr = nodes[0].communicate(timeout=400)  # 20 s after the hang; torch's default was 1800 s
        except subprocess.TimeoutExpired:
            pytest.fail("rank 0 still waits for its hung peer")
    finally:
        for proc in nodes:  # node 1's torchrun waits on its stopped worker for ever
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    run_dir = RunDir(run)
    crash = describe_crashes(run_dir.read_crashes(0))
    assert nodes[0].returncode == 1 and run_dir.read_exit(0) is None, stderr[-3000:]
    assert crash is not None and crash.startswith("rank 0: CommunicationError: a collective failed after "
                                                  "parallel.collective_timeout_s"), (crash, stderr[-3000:])  # fmt: skip
    assert "Timed out waiting 20000ms" in crash, crash
    assert "cona trainer: error: rank 0: a collective failed after" in stderr, stderr[-3000:]
    assert "[rank0]: Traceback" not in stderr, stderr[-3000:]  # (torchrun prints its own, of its worker's exit 1)
    assert not (run_dir.checkpoint_dir(3) / "COMPLETE").exists()
    assert [p.name for p in run_dir.complete_checkpoints()] == ["step-00000002"]
