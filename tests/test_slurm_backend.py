"""SlurmBackend without a cluster: parsers of squeue/scontrol/sacct/sinfo output, placement, poll and launch logic.

The Slurm commands are replaced by a fake that answers with recorded outputs of Slurm 22.05.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from cona.orchestrator.backends.base import Attempt, AttemptStatus
from cona.orchestrator.backends.slurm import (
    SlurmBackend,
    SlurmError,
    SlurmJobInfo,
    ends_by_itself,
    expand_hostlist,
    node_is_down,
    parse_sacct,
    parse_scontrol_job,
    parse_sinfo_nodes,
    parse_squeue,
    stuck_pending_advice,
)
from cona.orchestrator.profile import load_profile
from cona.orchestrator.runstate import read_events
from cona.orchestrator.switchcost import SwitchKind
from cona.protocol.feasibility import placement
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy

from tests.conftest import PROFILES

# Recorded with Slurm 22.05.8 (slurm/local-cluster.sh).
SCONTROL_RUNNING = (
    "JobId=5 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901755 Nice=0 Account=(null) "
    "QOS=(null) JobState=RUNNING Reason=None Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 "
    "ExitCode=0:0 RunTime=00:00:01 TimeLimit=UNLIMITED TimeMin=N/A SubmitTime=2026-12-02T09:51:22 "
    "Partition=debug AllocNode:Sid=localhost:2791 ReqNodeList=(null) ExcNodeList=(null) NodeList=n[1-2] "
    "BatchHost=n1 NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=2,billing=2 "
    "Command=/runs/my run/slurm/cona.sbatch WorkDir=/tmp/with space StdErr=/dev/null StdOut=/dev/null Power= \n"
)
SCONTROL_REQUEUED = (
    "JobId=10 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901750 Nice=0 "
    "Account=(null) QOS=(null) JobState=PENDING Reason=BeginTime Dependency=(null) Requeue=1 Restarts=1 "
    "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED Partition=debug NodeList= "
    "NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 Power= \n"
)
SCONTROL_FAILED = (
    "JobId=11 JobName=wrap UserId=root(0) GroupId=root(0) JobState=FAILED Reason=NonZeroExitCode "
    "Dependency=(null) Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=3:0 RunTime=00:00:00 "
    "NodeList=n1 BatchHost=n1 NumNodes=1 NumCPUs=1 Power= \n"
)
SQUEUE = "7|COMPLETED|None|2|n[1-2]\n9|PENDING|Resources|2|\n11|FAILED|NonZeroExitCode|1|n1\n"
SACCT = "3|COMPLETED|0:0|n1\n4|FAILED|3:0|n1\n4.batch|FAILED|3:0|n1\n12|CANCELLED by 0|0:15|n[1-2]\n13|PENDING|0:0|None assigned\n"
SINFO = "n1|idle\nn2|down*\nn3|mixed\nn4|drained\nn5|idle*\n"


def test_expand_hostlist():
    assert expand_hostlist("n[1-2]") == ["n1", "n2"]
    assert expand_hostlist("n[1-3,7],gpu01") == ["n1", "n2", "n3", "n7", "gpu01"]
    assert expand_hostlist("gpu[08-10]") == ["gpu08", "gpu09", "gpu10"]
    assert expand_hostlist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    assert expand_hostlist("") == [] and expand_hostlist("(null)") == []


def test_parse_scontrol():
    info = parse_scontrol_job(SCONTROL_RUNNING)
    assert (info.job_id, info.state, info.reason, info.restarts) == ("5", "RUNNING", "None", 0)
    assert info.nodes == ["n1", "n2"] and info.num_nodes == 2 and info.batch_host == "n1"
    assert info.alive and not info.pending
    requeued = parse_scontrol_job(SCONTROL_REQUEUED)
    assert (requeued.state, requeued.reason, requeued.restarts, requeued.nodes) == (
        "PENDING",
        "BeginTime",
        1,
        [],
    )
    assert requeued.alive and requeued.pending
    failed = parse_scontrol_job(SCONTROL_FAILED)
    assert not failed.alive and failed.exit_status == 3
    assert parse_scontrol_job("slurm_load_jobs error: Invalid job id specified") is None
    assert parse_scontrol_job("") is None


def test_parse_squeue_sacct_sinfo():
    jobs = parse_squeue(SQUEUE)
    assert jobs["9"].state == "PENDING" and jobs["9"].reason == "Resources" and jobs["9"].nodes == []
    assert jobs["7"].nodes == ["n1", "n2"] and jobs["7"].num_nodes == 2
    acct = parse_sacct(SACCT)
    assert set(acct) == {"3", "4", "12", "13"}  # steps (4.batch) are skipped
    assert acct["4"].exit_status == 3 and acct["12"].state == "CANCELLED" and acct["13"].nodes == []
    nodes = parse_sinfo_nodes(SINFO)
    assert [n for n, s in nodes.items() if node_is_down(s)] == ["n2"]
    assert not node_is_down("drained") and not node_is_down("idle*") and node_is_down("down+drain")


@pytest.mark.parametrize(
    "layout, gpn, expected",
    [
        ((4, 1, 1), 2, (2, 2)),
        ((2, 1, 1), 2, (1, 2)),
        ((1, 1, 1), 8, (1, 1)),
        ((8, 4, 1), 8, (4, 8)),
        ((3, 1, 1), 2, (3, 1)),
        ((2, 16, 1), 8, (4, 8)),  # tensor parallelism across nodes: each tp group on two whole nodes
        ((1, 4, 3), 8, (3, 4)),  # not 2 nodes of 6, which would cut a tp group of 4 in two
    ],
)
def test_placement(layout, gpn, expected):
    dp, tp, pp = layout
    assert placement(Strategy(dp=dp, tp=tp, pp=pp, mbs=1, gbs=dp), gpn) == expected


def test_placement_too_big():
    with pytest.raises(ValueError, match="needs 3 nodes"):
        placement(Strategy(dp=6, tp=1, pp=1, mbs=1, gbs=6), 2, max_nodes=2)


class FakeSlurm:
    """Answers Slurm commands from a table; records every call."""

    def __init__(self) -> None:
        self.jobs: dict[str, str] = {}
        self.sacct: str | None = None  # None: accounting disabled
        self.sinfo = "n1|mixed\nn2|mixed\n"
        self.calls: list[list[str]] = []
        self.next_job = 100
        self.config = "TaskPlugin              = task/none\n"

    def __call__(self, argv, env=None):
        self.calls.append(list(argv))
        cmd = argv[0]
        if cmd == "scontrol" and argv[1:3] == ["show", "job"]:
            text = self.jobs.get(argv[-1])
            if text is None:
                return _cp(1, "", "slurm_load_jobs error: Invalid job id specified")
            return _cp(0, text)
        if cmd == "scontrol" and argv[1:3] == ["show", "config"]:
            return _cp(0, self.config)
        if cmd == "sacct":
            if self.sacct is None:
                return _cp(1, "", "sacct: error: Slurm accounting storage is disabled")
            return _cp(0, self.sacct)
        if cmd == "sinfo":
            return _cp(0, self.sinfo)
        if cmd == "scancel":
            return _cp(0)
        if cmd == "sbatch":
            self.next_job += 1
            return _cp(0, f"{self.next_job}\n")
        raise AssertionError(f"unexpected command {argv}")


def _cp(rc: int, out: str = "", err: str = "") -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], rc, out, err)


def _job(
    job_id: str,
    state: str,
    *,
    nodes: str = "n[1-2]",
    restarts: int = 0,
    reason: str = "None",
    exit_code="0:0",
):
    return (
        f"JobId={job_id} JobName=r JobState={state} Reason={reason} Requeue=1 Restarts={restarts} BatchFlag=1 "
        f"ExitCode={exit_code} NodeList={nodes} BatchHost=n1 NumNodes=2 Power= \n"
    )


@pytest.fixture
def env(tmp_path):
    fake = FakeSlurm()
    run = RunDir(tmp_path / "run")
    backend = SlurmBackend(run_dir=run, profile=load_profile(PROFILES / "local-slurm.yaml"), runner=fake)
    return backend, fake, run


S4 = Strategy(dp=4, tp=1, pp=1, mbs=1, gbs=4)
S2 = Strategy(dp=2, tp=1, pp=1, mbs=1, gbs=2)


def _exit(run: RunDir, attempt: int, submission: str, code: int, action: str, requeued: bool = False,
          **more: object) -> None:  # fmt: skip
    path = run.attempt_dir(attempt) / "slurm-exit.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"code": code, "action": action, "requeued": requeued, "submission": submission,
                                "time": time.time(), "detail": "", **more}))  # fmt: skip


def test_launch_submits_and_writes_handoff(env):
    backend, fake, run = env
    attempt = backend.launch(attempt=1, strategy=S4)
    assert (
        attempt.backend_id == "101" and attempt.extra["nnodes"] == 2 and attempt.extra["nproc_per_node"] == 2
    )
    sbatch = next(c for c in fake.calls if c[0] == "sbatch")
    assert sbatch[1:3] == ["--parsable", "--nodes=2"] and sbatch[-1] == attempt.extra["submission"]
    assert Path(sbatch[-2]).read_text().startswith("#!/bin/bash\n#SBATCH")
    launch = json.loads((run.attempt_dir(1) / "launch.json").read_text())
    assert launch["submission"] == attempt.extra["submission"] and launch["strategy"] == S4.to_dict()
    assert launch["job_id"] == "101" and launch["backend"] == "slurm" and launch["mode"] == "submit"
    record = run.read_launch(1)
    assert record is not None and record.strategy == S4 and record.extra["nnodes"] == 2


def test_launch_never_writes_the_orchestrators_state(env):
    # state.json has one writer, the scheduler: the job side learns everything from the launch record.
    backend, _, run = env
    run.root.mkdir(parents=True)
    run.state_json.write_text(json.dumps({"status": "running", "attempt": 0}))
    backend.launch(attempt=1, strategy=S4)
    assert json.loads(run.state_json.read_text()) == {"status": "running", "attempt": 0}


def test_in_place_relaunch_when_node_count_stays(env):
    backend, fake, run = env
    first = backend.launch(attempt=1, strategy=S4)
    _exit(run, 1, first.extra["submission"], 42, "wait")
    fake.jobs["101"] = _job("101", "RUNNING")
    assert backend.poll(first).status == AttemptStatus.SWITCHED
    second = backend.launch(attempt=2, strategy=Strategy(dp=2, tp=2, pp=1, mbs=1, gbs=2), previous=first)
    assert second.backend_id == "101" and second.extra["mode"] == "relaunch"
    assert second.extra["submission"] == first.extra["submission"]
    assert sum(1 for c in fake.calls if c[0] == "sbatch") == 1
    launch = json.loads((run.attempt_dir(2) / "launch.json").read_text())
    assert launch["submission"] == first.extra["submission"] and launch["nproc_per_node"] == 2


def test_an_elastic_relaunch_keeps_the_allocation_its_job_holds(env):
    """A relaunch of an elastic run carries the planning table, so that a resubmission may start on fewer nodes;
    but a job that still holds the attempt's nodes, waiting for a hand-off, runs it in its allocation (a
    resubmission could lose them). Only a job that is gone is resubmitted with `--nodes=MIN-MAX`."""
    backend, fake, run = env
    first = backend.launch(attempt=1, strategy=S4)
    _exit(run, 1, first.extra["submission"], 1, "wait")
    fake.jobs["101"] = _job("101", "RUNNING")
    second = backend.launch(attempt=2, strategy=S4, previous=first, elastic={1: S2, 2: S4})
    assert second.backend_id == "101" and second.extra["mode"] == "relaunch" and "by_nnodes" not in second.extra
    assert sum(1 for c in fake.calls if c[0] == "sbatch") == 1
    fake.jobs["101"] = _job("101", "COMPLETED")  # the job gave up waiting: resubmitted, elastic
    third = backend.launch(attempt=3, strategy=S4, previous=second, elastic={1: S2, 2: S4})
    assert third.backend_id == "102" and set(third.extra["by_nnodes"]) == {"1", "2"}
    assert "--nodes=1-2" in next(c for c in reversed(fake.calls) if c[0] == "sbatch")


def test_resubmit_when_node_count_changes(env):
    backend, fake, run = env
    first = backend.launch(attempt=1, strategy=S4)
    _exit(run, 1, first.extra["submission"], 42, "wait")
    fake.jobs["101"] = _job("101", "RUNNING")
    second = backend.launch(attempt=2, strategy=S2, previous=first)
    assert second.backend_id == "102" and second.extra["nnodes"] == 1
    assert second.extra["submission"] != first.extra["submission"]
    assert ["scancel", "101"] in fake.calls  # the idle allocation is released
    assert "--nodes=1" in next(c for c in reversed(fake.calls) if c[0] == "sbatch")


def test_resubmit_when_job_is_gone(env):
    backend, fake, run = env
    first = backend.launch(attempt=1, strategy=S4)
    _exit(run, 1, first.extra["submission"], 42, "wait")
    second = backend.launch(attempt=2, strategy=S4, previous=first)  # scontrol: job unknown
    assert second.backend_id == "102" and ["scancel", "101"] not in fake.calls


@pytest.mark.parametrize("sacct", [True, False])
@pytest.mark.parametrize(
    "code, action, status",
    [
        (0, "done", "done"),
        (42, "wait", "switched"),
        (43, "stop", "stopped"),
        (44, "wait", "bad_world"),
        (7, "exit", "crashed"),
    ],
)
def test_poll_from_exit_record(env, sacct, code, action, status):
    backend, fake, run = env
    fake.sacct = "" if sacct else None
    attempt = backend.launch(attempt=1, strategy=S4)
    fake.jobs["101"] = _job("101", "RUNNING")
    assert backend.poll(attempt).status == AttemptStatus.RUNNING
    _exit(run, 1, attempt.extra["submission"], code, action)
    outcome = backend.poll(attempt)
    assert outcome.status.value == status and outcome.exit_code == code
    del fake.jobs["101"]  # purged from slurmctld: the exit record still decides
    assert backend.poll(attempt).status.value == status


def test_poll_ignores_exit_record_of_another_submission(env):
    backend, fake, run = env
    attempt = backend.launch(attempt=1, strategy=S4)
    _exit(run, 1, "someone-else", 0, "done")
    fake.jobs["101"] = _job("101", "RUNNING")
    assert backend.poll(attempt).status == AttemptStatus.RUNNING


def test_poll_pending_and_requeued(env):
    backend, fake, run = env
    attempt = backend.launch(attempt=1, strategy=S4)
    fake.jobs["101"] = _job("101", "PENDING", nodes="", reason="Resources")
    outcome = backend.poll(attempt)
    assert outcome.status == AttemptStatus.PENDING and "Resources" in outcome.detail
    _exit(run, 1, attempt.extra["submission"], 43, "requeue", requeued=True)
    (run.attempt_dir(1) / "slurm.json").write_text(
        json.dumps({"submission": attempt.extra["submission"], "nodelist": "n1,n2"})
    )
    fake.jobs["101"] = _job("101", "PENDING", nodes="", reason="BeginTime", restarts=1)
    fake.sinfo = "n1|idle\nn2|down*\n"
    outcome = backend.poll(attempt)
    assert outcome.status == AttemptStatus.PENDING
    assert "requeued 1x" in outcome.detail and "node n2 DOWN" in outcome.detail
    fake.jobs["101"] = _job("101", "RUNNING", restarts=1)
    fake.sinfo = "n1|mixed\nn2|mixed\n"
    assert backend.poll(attempt).status == AttemptStatus.RUNNING


@pytest.mark.parametrize(
    ("reason", "fix"),
    [
        ("InvalidQOS", "slurm.qos"),
        ("QOSNotAllowed", "slurm.qos"),
        ("InvalidAccount", "slurm.account"),
        ("AccountNotAllowed", "slurm.account"),
        ("BadConstraints", "--constraint"),
        ("DependencyNeverSatisfied", "--dependency"),
        ("PartitionTimeLimit", "slurm.partition"),
        ("QOSMaxWallDurationPerJobLimit", "its QOS"),
        ("QOSMaxGRESPerNode", "its QOS"),
        ("QOSMinGRES", "its QOS"),
        ("AssocMaxNodePerJobLimit", "the account"),
        ("AssocMaxCpuMinutesPerJobLimit", "the account"),
    ],
)
def test_pending_reasons_that_waiting_does_not_resolve(reason, fix):
    advice = stuck_pending_advice(reason)
    assert advice is not None and fix in advice


@pytest.mark.parametrize(
    "reason",
    ["None", "", "Resources", "Priority", "BeginTime", "Dependency", "ReqNodeNotAvail", "NodeDown", "JobHeldUser",
     "JobHeldAdmin", "QOSGrpGRES", "AssocGrpCpuLimit", "QOSMaxJobsPerUserLimit", "AssocMaxJobsLimit",
     "MaxGRESPerAccount", "QOSMaxGRESPerUser", "PartitionDown", "Reservation"],
)  # fmt: skip
def test_pending_reasons_that_other_jobs_or_nodes_resolve(reason):
    # Aggregate limits end as other jobs end, a DOWN node comes back, a hold is a person's to release.
    assert stuck_pending_advice(reason) is None


def test_a_job_pending_for_a_reason_waiting_does_not_resolve_is_stuck(env):
    backend, fake, run = env
    assert backend.pending_timeout_s == backend.profile.slurm.pending_timeout_s == 120
    attempt = backend.launch(attempt=1, strategy=S4)
    fake.jobs["101"] = _job("101", "PENDING", nodes="", reason="Resources")
    assert not backend.poll(attempt).stuck
    fake.jobs["101"] = _job("101", "PENDING", nodes="", reason="QOSMaxWallDurationPerJobLimit")
    outcome = backend.poll(attempt)
    assert outcome.status == AttemptStatus.PENDING and outcome.stuck
    assert outcome.detail.startswith("job 101 PENDING (QOSMaxWallDurationPerJobLimit): Slurm will not start it")
    assert "slurm.time_limit" in outcome.detail and "\n" not in outcome.detail
    assert backend.resume_hint(outcome.detail) == (f"`cona run --resume {run.root} --profile-set slurm.FIELD=VALUE` "
                                                   "applies the fix to this run")  # fmt: skip


@pytest.mark.parametrize(
    ("cpus", "plugin", "warned"),
    [(2, "task/cgroup,task/affinity", True), (2, "task/affinity", True), (2, "task/none", False),
     (4, "task/cgroup", False), (0, "task/cgroup", False)],
)  # fmt: skip
def test_a_job_with_fewer_cpus_than_trainers_on_a_confining_cluster_is_said_once(env, cpus, plugin, warned):
    """cona asks for one task per node and no CPUs: without --exclusive or --cpus-per-gpu (and no DefCpuPerGPU) a
    node's trainers share one CPU where tasks are confined to theirs. Said once per job, from what Slurm gave."""
    backend, fake, run = env
    fake.config = f"AccountingStorageType   = accounting_storage/none\nTaskPlugin              = {plugin}\n"
    attempt = backend.launch(attempt=1, strategy=S4)  # 2 nodes x 2 trainers
    fake.jobs["101"] = _job("101", "RUNNING").replace("NumNodes=2", f"NumNodes=2 NumCPUs={cpus}")
    for _ in range(3):
        assert backend.poll(attempt).status == AttemptStatus.RUNNING
    said = [e for e in read_events(run) if e["event"] == "cpu-shortage"]
    assert len(said) == int(warned), said
    if warned:
        assert said[0]["detail"] == (f"job 101 holds 2 CPU(s) for its 4 trainer processes ({plugin} confines them "
                                     "to those): add --exclusive (whole nodes) or --cpus-per-gpu=N to "
                                     "slurm.extra_sbatch")  # fmt: skip
    assert sum(c[:3] == ["scontrol", "show", "config"] for c in fake.calls) == (cpus == 2)  # asked once, if at all


def test_poll_running_on_down_node(env):
    backend, fake, _ = env
    attempt = backend.launch(attempt=1, strategy=S4)
    fake.jobs["101"] = _job("101", "RUNNING")
    fake.sinfo = "n1|mixed\nn2|down*\n"
    outcome = backend.poll(attempt)
    assert outcome.status == AttemptStatus.CRASHED and "node n2 DOWN" in outcome.detail


@pytest.mark.parametrize("sacct", [True, False])
def test_poll_job_gone_without_exit_record(env, sacct):
    backend, fake, _ = env
    fake.sacct = "101|CANCELLED by 0|0:15|n[1-2]\n" if sacct else None
    attempt = backend.launch(attempt=1, strategy=S4)
    outcome = backend.poll(attempt)  # not in scontrol any more
    assert outcome.status == AttemptStatus.CRASHED
    assert ("CANCELLED" in outcome.detail) if sacct else ("gone from the queue" in outcome.detail)
    assert "before the attempt started" in outcome.detail


def test_poll_finished_job_in_scontrol_without_sacct(env):
    backend, fake, _ = env
    attempt = backend.launch(attempt=1, strategy=S4)
    fake.jobs["101"] = _job("101", "TIMEOUT", exit_code="0:15")
    outcome = backend.poll(attempt)
    assert outcome.status == AttemptStatus.CRASHED and "TIMEOUT" in outcome.detail


def test_poll_requeue_that_never_came_back(env):
    backend, fake, run = env
    attempt = backend.launch(attempt=1, strategy=S4)
    _exit(run, 1, attempt.extra["submission"], 43, "requeue", requeued=True)
    fake.jobs["101"] = _job("101", "CANCELLED", exit_code="0:15")
    outcome = backend.poll(attempt)
    assert outcome.status == AttemptStatus.STOPPED and outcome.exit_code == 43


def test_cancel_and_close(env):
    backend, fake, _ = env
    attempt = backend.launch(attempt=1, strategy=S4)
    fake.jobs["101"] = _job("101", "RUNNING")
    backend.cancel(attempt)
    assert ["scancel", "101"] in fake.calls
    fake.calls.clear()
    fake.jobs["101"] = _job("101", "CANCELLED")
    backend.cancel(attempt)  # idempotent: nothing to cancel
    backend.close()
    assert not any(c[0] == "scancel" for c in fake.calls)


def _ending_after(backend: SlurmBackend, fake: FakeSlurm, job_id: str, queries: int, final: str | None) -> None:
    """Slurm reports `job_id` RUNNING to the next `queries` `scontrol show job`, then `final` (None: gone)."""
    fake.jobs[job_id] = _job(job_id, "RUNNING")
    seen = [0]

    def runner(argv, env=None):
        if argv[:3] == ["scontrol", "show", "job"] and argv[-1] == job_id:
            seen[0] += 1
            if seen[0] > queries:
                if final is None:
                    fake.jobs.pop(job_id, None)
                else:
                    fake.jobs[job_id] = _job(job_id, final)
        return fake(argv, env=env)

    backend._runner = runner


@pytest.mark.parametrize("final", ["COMPLETING", "COMPLETED", None])
def test_close_lets_a_job_that_ends_by_itself_end_without_scancel(env, final):
    """The run is done: its exit record says so while the batch script is still exiting. A scancel then made Slurm
    record the finished job CANCELLED; close waits for it to leave RUNNING by itself instead."""
    backend, fake, run = env
    attempt = backend.launch(attempt=1, strategy=S4)
    _exit(run, 1, attempt.extra["submission"], 0, "done")
    _ending_after(backend, fake, "101", 2, final)
    backend.close()
    assert not any(c[0] == "scancel" for c in fake.calls), fake.calls


def test_close_cancels_a_job_that_does_not_end_within_the_grace(env):
    backend, fake, run = env
    backend.end_grace_s = 0.5
    attempt = backend.launch(attempt=1, strategy=S4)
    _exit(run, 1, attempt.extra["submission"], 0, "done")
    fake.jobs["101"] = _job("101", "RUNNING")
    started = time.monotonic()
    backend.close()
    assert ["scancel", "101"] in fake.calls and time.monotonic() - started < 5


@pytest.mark.parametrize(
    "action, requeued, state, restarts, sinfo",
    [
        ("wait", False, "RUNNING", 0, "n1|mixed\nn2|mixed\n"),  # idle after a switch: waits for a hand-off
        ("requeue", True, "RUNNING", 0, "n1|mixed\nn2|mixed\n"),  # requeues itself
        ("done", False, "PENDING", 1, "n1|mixed\nn2|mixed\n"),  # requeued by Slurm after it was done
        ("done", False, "RUNNING", 1, "n1|mixed\nn2|mixed\n"),  # and started again: it idles for a hand-off
        ("done", False, "RUNNING", 0, "n1|mixed\nn2|down*\n"),  # on a dead node: it may never end
    ],
)
def test_close_cancels_at_once_a_job_that_does_not_end_by_itself(env, action, requeued, state, restarts, sinfo):
    backend, fake, run = env
    attempt = backend.launch(attempt=1, strategy=S4)
    _exit(run, 1, attempt.extra["submission"], 0, action, requeued=requeued, job_id="101", restarts=0)
    fake.jobs["101"] = _job("101", state, restarts=restarts)
    fake.sinfo = sinfo
    started = time.monotonic()
    backend.close()
    assert ["scancel", "101"] in fake.calls and time.monotonic() - started < 1


def test_a_resubmission_after_a_crash_lets_the_crashed_job_end_by_itself(env):
    """The job that crashed records `exit 7` and exits 7 (Slurm: FAILED); the next attempt's resubmission waits
    for that end instead of scancelling it, and still submits only once the job is gone."""
    backend, fake, run = env
    first = backend.launch(attempt=1, strategy=S4)
    _exit(run, 1, first.extra["submission"], 7, "exit")
    _ending_after(backend, fake, "101", 2, None)
    second = backend.launch(attempt=2, strategy=S4, previous=first)
    assert second.backend_id == "102" and ["scancel", "101"] not in fake.calls
    scontrol = [i for i, c in enumerate(fake.calls) if c[:3] == ["scontrol", "show", "job"]]
    assert max(scontrol) < next(i for i, c in enumerate(fake.calls) if c[0] == "sbatch" and i > scontrol[0])


def test_the_newest_exit_record_of_a_job_decides(env):
    """After a relaunch in the allocation the job's newest record is the later attempt's: a `done` there ends it,
    while the earlier attempt's `wait` no longer says anything."""
    backend, _, run = env
    first = backend.launch(attempt=1, strategy=S4)
    submission = first.extra["submission"]
    _exit(run, 1, submission, 42, "wait")
    _exit(run, 3, "another-job", 0, "done")
    assert backend.last_exit_record(submission)["action"] == "wait"
    _exit(run, 2, submission, 0, "done")
    assert backend.last_exit_record(submission)["action"] == "done"
    assert backend.last_exit_record("") is None


def _info(state: str = "RUNNING", restarts: int = 0, job_id: str = "5") -> SlurmJobInfo:
    return SlurmJobInfo(job_id, state, restarts=restarts)


@pytest.mark.parametrize(
    "record, info, expected",
    [
        ({"action": "done", "time": 100.0}, _info(), True),
        ({"action": "stop", "time": 100.0, "job_id": "5", "restarts": 0}, _info(), True),
        ({"action": "exit", "code": 7, "time": 100.0}, _info(), True),
        ({"action": "done", "time": 100.0}, _info("COMPLETING"), True),
        (None, _info(), False),
        ({"action": "wait", "time": 100.0}, _info(), False),  # idle, waiting for a hand-off
        ({"action": "requeue", "requeued": True, "time": 100.0}, _info(), False),
        ({"action": "requeued", "requeued": True, "time": 100.0}, _info(), False),
        ({"action": "done", "time": 100.0}, _info("PENDING", restarts=1), False),  # requeued since
        ({"action": "done", "time": 100.0, "restarts": 0}, _info(restarts=1), False),  # and running again
        ({"action": "done", "time": 100.0, "job_id": "4"}, _info(), False),  # another job's record
        ({"action": "done", "time": 60.0}, _info(), False),  # long ago: something holds it up
        ({"action": "done"}, _info(), False),
    ],
)
def test_ends_by_itself(record, info, expected):
    assert ends_by_itself(record, info, now=110.0, grace_s=30.0) is expected


def test_adopt(env):
    backend, fake, _ = env
    attempt = Attempt(number=3, strategy=S4, backend_id="55", extra={"submission": "abc", "nnodes": 2})
    fake.jobs["55"] = _job("55", "RUNNING")
    assert backend.adopt(attempt)
    fake.jobs["55"] = _job("55", "FAILED", exit_code="1:0")
    assert not backend.adopt(attempt)


def test_sacct_detected_once(env):
    backend, fake, _ = env
    assert backend.use_sacct is False
    fake.sacct = ""
    assert backend.use_sacct is False  # cached
    assert sum(1 for c in fake.calls if c[0] == "sacct") == 1


def test_missing_slurm_commands_give_one_line(tmp_path):
    def runner(argv, env=None):
        raise FileNotFoundError(argv[0])

    backend = SlurmBackend(
        run_dir=RunDir(tmp_path), profile=load_profile(PROFILES / "local-slurm.yaml"), runner=runner
    )
    with pytest.raises(SlurmError, match="sbatch not found"):
        backend.launch(attempt=1, strategy=S4)


def test_submission_env_puts_own_interpreter_first(env):
    import os
    import sys

    backend, _, _ = env
    path = backend.submission_env()["PATH"].split(os.pathsep)
    assert path[0] == os.path.dirname(os.path.abspath(sys.executable))
    pinned = SlurmBackend(
        run_dir=backend.run_dir,
        profile=backend.profile.model_copy(
            update={"slurm": backend.profile.slurm.model_copy(update={"python": "/opt/py/bin/python3"})}
        ),
    )
    assert pinned.submission_env()["PATH"] == os.environ.get("PATH", "")


def test_sbatch_input_variables_do_not_override_the_script(env, monkeypatch):
    """sbatch reads SBATCH_* over its #SBATCH lines: a shell's SBATCH_PARTITION or SBATCH_TIMELIMIT replaced the
    profile's (and `cona render slurm` did not show what ran), SBATCH_WAIT blocked the submission, SBATCH_EXPORT=NONE
    left the trainers without the environment. A site default for what the profile does not set passes."""
    backend, _, _ = env
    assert backend.profile.slurm.partition and not backend.profile.slurm.account
    for key, value in [("SBATCH_PARTITION", "debug"), ("SBATCH_TIMELIMIT", "00:10:00"), ("SBATCH_WAIT", "1"),
                       ("SBATCH_EXPORT", "NONE"), ("SBATCH_ACCOUNT", "site-default"), ("SBATCH_EXCLUSIVE", "1")]:  # fmt: skip
        monkeypatch.setenv(key, value)
    submitted = backend.submission_env()
    assert sorted(
        k for k in submitted if k.startswith("SBATCH_")) == ["SBATCH_ACCOUNT", "SBATCH_EXCLUSIVE"]
    monkeypatch.setenv("SBATCH_EXPORT", "ALL,X=1")
    assert backend.submission_env()["SBATCH_EXPORT"] == "ALL,X=1"


def test_switch_kind_follows_the_node_count(env):
    # A switch that keeps the node count keeps the step's processes (in place) when allowed, else it is a new srun
    # step in the same allocation; another node count resubmits.
    backend, _, _ = env
    same_nodes = Strategy(dp=2, tp=2, pp=1, mbs=1, gbs=2)
    assert backend.switch_kind(S4, same_nodes, in_place_allowed=True) is SwitchKind.IN_PLACE
    assert backend.switch_kind(S4, same_nodes, in_place_allowed=False) is SwitchKind.RELAUNCH
    assert backend.switch_overhead_s(SwitchKind.RELAUNCH) > backend.switch_overhead_s(SwitchKind.IN_PLACE)
    assert backend.switch_kind(S4, S2, in_place_allowed=True) is SwitchKind.RESUBMIT
    assert backend.switch_overhead_s(SwitchKind.RESUBMIT) > backend.switch_overhead_s(SwitchKind.RELAUNCH)


def test_an_elastic_launch_submits_a_node_range_and_reports_the_strategy_it_got(env):
    """`--nodes=1-2` with as many tasks as the range's top (else Slurm caps the job at one node), the table in the
    launch record; once the job's helper recorded what it runs, `poll` reports that strategy."""
    backend, fake, run = env
    attempt = backend.launch(attempt=1, strategy=S4, elastic={1: S2, 2: S4})
    sbatch = next(c for c in fake.calls if c[0] == "sbatch")
    assert sbatch[1:4] == ["--parsable", "--nodes=1-2", "--ntasks=2"] and sbatch[4] == str(backend.script_path()), sbatch
    launch = json.loads((run.attempt_dir(1) / "launch.json").read_text())
    assert launch["by_nnodes"] == {"1": {"strategy": S2.to_dict(), "nproc_per_node": 2},
                                   "2": {"strategy": S4.to_dict(), "nproc_per_node": 2}}  # fmt: skip
    fake.jobs["101"] = _job("101", "RUNNING", nodes="n1")
    assert backend.poll(attempt).strategy is None  # not started yet: nothing chosen
    (run.attempt_dir(1) / "slurm.json").write_text(json.dumps(
        {"submission": attempt.extra["submission"], "nnodes": 1, "strategy": S2.to_dict(), "nodelist": "n1"}))
    assert backend.poll(attempt).strategy == S2
    # One node count alone is an ordinary submission.
    backend.launch(attempt=2, strategy=S2, elastic={1: S2})
    assert next(c for c in reversed(fake.calls) if c[0] == "sbatch")[1:3] == ["--parsable", "--nodes=1"]


def test_a_down_node_of_the_job_is_reported_lost_and_idle_nodes_are_available(env):
    backend, fake, run = env
    attempt = backend.launch(attempt=1, strategy=S4)
    fake.jobs["101"] = _job("101", "RUNNING")
    fake.sinfo = "n1|mixed\nn2|down*\n"
    outcome = backend.poll(attempt)
    assert outcome.status is AttemptStatus.CRASHED and outcome.lost_nodes == ("n2",)
    fake.jobs["101"] = _job("101", "RUNNING", nodes="n1")
    assert backend.available_nodes(attempt) == 1  # n1 (the job's); n2 is down
    fake.sinfo = "n1|mixed\nn2|idle\n"
    assert backend.available_nodes(attempt) == 2
    fake.sinfo = "n1|mixed\nn2|drained\n"
    assert backend.available_nodes(attempt) == 1
    # The job ended with its node (NODE_FAIL, not requeued): the nodes it started on say which is gone.
    (run.attempt_dir(1) / "slurm.json").write_text(json.dumps({"submission": attempt.extra["submission"],
                                                               "nodelist": "n1,n2"}))  # fmt: skip
    del fake.jobs["101"]
    fake.sinfo = "n1|idle\nn2|down*\n"
    outcome = backend.poll(attempt)
    assert outcome.status is AttemptStatus.CRASHED and outcome.lost_nodes == ("n2",), outcome


# `sinfo SINFO_NODE_ARGS` on Slurm 22.05 (the local cluster) after `scontrol update nodename=n2 state=drain`, then
# `state=down`: the long state of a DOWN+DRAIN node is `drained`, like that of a healthy drained node (n3).
SINFO_DOWN_DRAIN = "n1|mixed|mixed|\nn2|drained|down+drain|\nn3|drained|idle+drain|\nn4|down*|down+not_responding|\n"


def test_a_node_that_went_down_while_drained_is_lost(env):
    """A node drained and then DOWN (`scontrol update state=down`, a node failure during a maintenance drain):
    sinfo's `%T` says `drained`, which alone is no loss; the complete state (`down+drain`) says it is. Before,
    an elastic run whose job Slurm requeued off such a node never shrank: the requeued job restarted on fewer
    nodes than its attempt asked for and crashed, and the relaunch queued for the drained node."""
    assert parse_sinfo_nodes(SINFO_DOWN_DRAIN) == {"n1": "mixed", "n2": "down+drain", "n3": "drained",
                                                   "n4": "down*"}  # fmt: skip
    assert [n for n, s in parse_sinfo_nodes(SINFO_DOWN_DRAIN).items() if node_is_down(s)] == ["n2", "n4"]
    # An sinfo without StateComplete prints that field empty: the long state alone, as with `-o '%N|%T'`.
    assert parse_sinfo_nodes("n1|idle||\nn2|drained||\n") == {"n1": "idle", "n2": "drained"}
    backend, fake, run = env
    attempt = backend.launch(attempt=1, strategy=S4)
    (run.attempt_dir(1) / "slurm.json").write_text(json.dumps({"submission": attempt.extra["submission"],
                                                               "nodelist": "n1,n2"}))  # fmt: skip
    fake.jobs["101"] = _job("101", "PENDING", nodes="", reason="BeginTime", restarts=1)  # requeued off n2
    fake.sinfo = "n1|idle|idle|\nn2|drained|down+drain|\n"  # `-n n1,n2`: the nodes the attempt started on
    outcome = backend.poll(attempt)
    assert outcome.status is AttemptStatus.PENDING and outcome.lost_nodes == ("n2",), outcome
    assert "node n2 DOWN" in outcome.detail
    sinfo = next(c for c in reversed(fake.calls) if c[0] == "sinfo")
    assert "StateComplete" in " ".join(sinfo), sinfo
    fake.jobs["101"] = _job("101", "RUNNING", nodes="n1")
    fake.sinfo = SINFO_DOWN_DRAIN
    assert backend.available_nodes(attempt) == 1  # n2 down, n3 drained, n4 down: only the job's n1


def test_a_requeued_job_back_on_fewer_nodes_than_its_attempt_needs_reports_the_missing_node_lost(env):
    """An elastic job (`--nodes=1-2`) switched in place to attempt 2 on n1,n2; Slurm requeued it and it runs again
    on n1 alone (n2 drained meanwhile: not DOWN). Its helper waits rather than run attempt 2 on one node; the poll
    names n2 lost so that the scheduler replans for one node, instead of a crash and a relaunch queued for n2."""
    backend, fake, run = env
    first = backend.launch(attempt=1, strategy=S4, elastic={1: S2, 2: S4})
    (run.attempt_dir(1) / "slurm.json").write_text(json.dumps({"submission": first.extra["submission"],
                                                               "nodelist": "n1,n2", "restarts": 0}))  # fmt: skip
    second = backend.continued(first, number=2, strategy=S4)
    fake.jobs["101"] = _job("101", "RUNNING", nodes="n1", restarts=1)
    fake.sinfo = "n1|mixed|mixed|\n"
    outcome = backend.poll(second)
    assert outcome.status is AttemptStatus.CRASHED and outcome.lost_nodes == ("n2",), outcome
    assert "on n1 only" in outcome.detail and "node n2 not in the allocation" in outcome.detail
    # The elastic start itself runs the table's strategy for the nodes it got: nothing is missing.
    assert backend.poll(first).lost_nodes == ()
    # Back on both nodes, or COMPLETING (Slurm drops each node from the list as it finishes): nothing is missing.
    fake.jobs["101"] = _job("101", "RUNNING", nodes="n[1-2]", restarts=1)
    assert backend.poll(second).status is AttemptStatus.RUNNING
    fake.jobs["101"] = _job("101", "COMPLETING", nodes="n1", restarts=1)
    assert backend.poll(second).lost_nodes == ()


def test_an_attempt_continued_in_place_is_watched_in_the_same_job(env):
    """An in-place switch: the next attempt's launch record carries the job's submission (a requeued job finds it),
    the continued attempt is the same job, and its end is read from its own slurm-exit.json."""
    backend, fake, run = env
    first = backend.launch(attempt=1, strategy=S4)
    other = Strategy(dp=2, tp=2, pp=1, mbs=1, gbs=2)
    backend.offer_in_place(first, number=2, strategy=other)
    offered = json.loads((run.attempt_dir(2) / "launch.json").read_text())
    assert offered["in_place"] and offered["submission"] == first.extra["submission"] and offered["launched_as"] == 1
    assert (offered["nnodes"], offered["nproc_per_node"], offered["mode"]) == (2, 2, "continued")
    second = backend.continued(first, number=2, strategy=other)
    assert second.backend_id == first.backend_id and second.extra["launched_as"] == 1
    fake.jobs["101"] = _job("101", "RUNNING")
    assert backend.poll(second).status is AttemptStatus.RUNNING
    _exit(run, 2, first.extra["submission"], 0, "done")
    assert backend.poll(second).status is AttemptStatus.DONE


def test_a_checkpoint_slower_than_the_pre_timeout_signal_is_said_once(tmp_path, capsys):
    """At 10 MB/s a 1.3B model's checkpoint (15.8 GB) takes ~26 minutes: started at the signal 300 s before the
    time limit, it is killed half-written and every time limit loses the work since the previous checkpoint. The
    run goes on (the bandwidth is the user's estimate), with one warning line that says what to raise."""
    from cona.orchestrator.backends.slurm.backend import save_outlasts_signal
    from cona.orchestrator.job import load_job

    from tests.conftest import EXAMPLES

    profile = load_profile(PROFILES / "a100-4x8.yaml")
    job = load_job(EXAMPLES / "gpt3-1.3b.yaml")
    assert save_outlasts_signal(profile, job) is None  # 7.9 s at the profile's 2 GB/s
    slow = profile.model_copy(update={"storage": profile.storage.model_copy(update={"write_bandwidth": "10 MB/s"})})
    for n in range(2):  # an orchestrator builds its backend again after a restart: said once per process
        SlurmBackend(run_dir=RunDir(tmp_path / f"run{n}"), profile=slow, job=job, runner=FakeSlurm())
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("cona: warning: a checkpoint of 1.32B parameters (15.8 GB)")
    assert "storage.write_bandwidth 10 MB/s" in err and "slurm.signal_before_timeout_s=300" in err
    assert "raise signal_before_timeout_s to at least 3,158" in err
    # With the lead at the save's length or more, or no pre-timeout signal at all, nothing is said.
    ample = slow.model_copy(update={"slurm": slow.slurm.model_copy(update={"signal_before_timeout_s": 3200})})
    silent = slow.model_copy(update={"slurm": slow.slurm.model_copy(update={"signal_before_timeout_s": 0})})
    assert save_outlasts_signal(ample, job) is None and save_outlasts_signal(silent, job) is None


def test_a_crash_names_the_rank_that_died_and_of_what(env):
    """A Slurm crash line said `exit 1 in job 101`: which rank died of what is in the ranks' own crash records, on
    the shared run directory (`Backend.with_crash_cause`, as the Kubernetes backend says it too)."""
    from cona.protocol.rundir import CrashRecord

    backend, fake, run = env
    attempt = backend.launch(attempt=1, strategy=S4)
    fake.jobs["101"] = _job("101", "RUNNING")
    _exit(run, 1, attempt.extra["submission"], 1, "exit")
    assert backend.poll(attempt).detail == "exit 1 in job 101"
    run.write_crash(1, CrashRecord(2, "ValueError: injected on one rank", 1.0))
    run.write_crash(1, CrashRecord(0, "RuntimeError: Connection closed by peer", 2.0))
    outcome = backend.poll(attempt)
    assert outcome.status is AttemptStatus.CRASHED
    assert outcome.detail == "exit 1 in job 101: rank 2: ValueError: injected on one rank"
    _exit(run, 1, attempt.extra["submission"], 43, "stop")  # no crash: the records are not said
    assert backend.poll(attempt).detail == "exit 43 in job 101"


def test_a_rank_killed_by_a_signal_is_named_from_the_step_node_logs(env):
    """A rank killed by a signal writes no crash record: the crash line said only `exit 137 in job 101: a node's
    trainer crashed`. The job-side helper ends each node's log (`node-<i>.log` of the attempt that started the step)
    with its torchrun's summary; the one that saw the failure first names the rank and the signal, as locally."""
    from tests.test_local_backend import torchrun_summary

    backend, fake, run = env
    attempt = backend.launch(attempt=1, strategy=S4)
    fake.jobs["101"] = _job("101", "RUNNING")
    _exit(run, 1, attempt.extra["submission"], 137, "exit", detail="a node's trainer crashed")
    plain = "exit 137 in job 101: a node's trainer crashed"
    assert backend.poll(attempt).detail == plain  # no log
    (run.attempt_dir(1) / "node-0.log").write_text("step 7\n")
    assert backend.poll(attempt).detail == plain  # a log without a summary
    (run.attempt_dir(1) / "node-0.log").write_text("step 7\n" + torchrun_summary(rank=0, code=1, at="20:41:05"))
    (run.attempt_dir(1) / "node-1.log").write_text(torchrun_summary(rank=3, code=-9, at="20:41:04"))
    outcome = backend.poll(attempt)
    assert (outcome.status, outcome.detail) == (AttemptStatus.CRASHED, f"{plain}: rank 3 killed by SIGKILL")

    # The step's processes went on in place as attempt 2: its logs stay in attempt 1's directory.
    second = backend.continued(attempt, number=2, strategy=S4)
    _exit(run, 2, attempt.extra["submission"], 137, "exit", detail="a node's trainer crashed")
    assert backend.poll(second).detail == f"{plain}: rank 3 killed by SIGKILL"


def test_gone_tells_an_ended_job_by_read_only_queries(env):
    """`cona status` and `cona stop` of a run whose orchestrator is gone ask `gone`: a job Slurm says finished, or
    no longer knows (and accounting does not say it runs), is gone; a job queued, running or requeued is not, nor
    one whose state Slurm does not answer. Nothing is submitted, cancelled or written."""
    backend, fake, run = env
    attempt = backend.launch(attempt=1, strategy=S4)
    fake.calls.clear()
    before = sorted(p.relative_to(run.root) for p in run.root.rglob("*"))
    cases = [
        (_job("101", "RUNNING"), None, False),
        (_job("101", "PENDING", reason="Priority"), None, False),
        (_job("101", "PENDING", restarts=1, reason="BeginTime"), None, False),  # requeued: its trainer runs again
        (_job("101", "COMPLETING"), None, False),
        (_job("101", "FAILED", exit_code="1:0"), None, True),
        (_job("101", "CANCELLED", exit_code="0:15"), None, True),
        (_job("101", "NODE_FAIL"), None, True),
        (None, None, True),  # purged from slurmctld (Invalid job id), no accounting
        (None, "101|COMPLETED|0:0|n[1-2]\n", True),
        (None, "101|RUNNING|0:0|n[1-2]\n", False),  # slurmctld forgot it, accounting says it runs: cannot tell
    ]
    for job, sacct, expected in cases:
        fake.jobs.pop("101", None)
        if job is not None:
            fake.jobs["101"] = job
        fake.sacct, backend._use_sacct = sacct, None
        assert backend.gone(attempt) is expected, (job, sacct)
    assert {call[0] for call in fake.calls} <= {"scontrol", "sacct"}, fake.calls
    assert sorted(p.relative_to(run.root) for p in run.root.rglob("*")) == before

    def answers(rc: int, out: str = "", err: str = "", *, raises: BaseException | None = None):
        def runner(argv, env=None):
            if raises is not None:
                raise raises
            return _cp(rc, out, err)

        return runner

    for runner in (answers(1, err="slurm_load_jobs error: Socket timed out on send/recv operation"),
                   answers(0, out=""),  # an answer that names no job: not taken for a purged one
                   answers(0, raises=subprocess.TimeoutExpired(["scontrol"], 30)),
                   answers(0, raises=FileNotFoundError("scontrol")),
                   answers(0, raises=PermissionError("scontrol"))):  # fmt: skip
        backend._runner = runner
        assert backend.gone(attempt) is False
    assert backend.gone(Attempt(number=1, strategy=S4)) is False  # never submitted
