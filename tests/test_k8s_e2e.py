"""cona end to end on Kubernetes, emulated: a real `cona run` on a kubernetes profile, the real scheduler loop,
the real `KubernetesBackend` (official client, loaded from a kubeconfig) and the real trainer.

The API server is the kmock emulator (`tests/k8s_emulator.py`); `Emulator.run_jobs` plays the Job and JobSet
controllers and the kubelet, so each pod of an attempt's Indexed Job (or JobSet) runs its rendered torchrun command
as a local process (2 pods × 2 CPU processes, gloo), with the rendezvous endpoint mapped to 127.0.0.1. The checks are what a user relies on:
the run ends DONE, no two attempts overlap, and the samples consumed across every relaunch are exactly 0..N−1.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml
from cona.orchestrator.runstate import read_state, request_stop
from cona.protocol.strategy import Strategy
from kubernetes import client

from tests.cli_run import CliRun
from tests.conftest import REPO
from tests.test_orchestrator_e2e import assert_attempts_never_overlap, assert_samples_exact, heartbeats

pytestmark = [pytest.mark.kubernetes, pytest.mark.distributed]

TINY = str(REPO / "examples" / "tiny-gpt.yaml")
S4 = "dp=4,tp=1,pp=1,mbs=4,gbs=16"  # 2 pods × 2 processes
S2 = "dp=2,tp=1,pp=1,mbs=4,gbs=32"  # 1 pod × 2 processes
NAMESPACE = "cona"
BASE = [  # a short run: no perplexity target, a checkpoint every 10 steps, generous hang timeout
    "--set", "target.val_perplexity=null", "--set", "target.max_samples=1600", "--set", "eval.interval_samples=800",
    "--set", "checkpoint.interval_steps=10", "--set", "policy.heartbeat_timeout_s=240",
    "--set", "policy.decision_interval_s=2", "--set", "optimizer.warmup_samples=256",
]  # fmt: skip


def write_profile(root: Path, workload: str = "indexed-job") -> Path:
    """A kubernetes profile for this machine: 2 nodes × 2 CPU processes, the PVC "mounted" at `root`."""
    local = yaml.safe_load((REPO / "slurm" / "profiles" / "local-cpu.yaml").read_text())
    profile = {
        "name": "emulated-k8s",
        "backend": "kubernetes",
        "nodes": 2,
        "gpus_per_node": 2,
        "accelerator": local["accelerator"],
        "network": local["network"],
        "storage": {**local["storage"], "run_root": str(root)},
        "kubernetes": {
            "namespace": NAMESPACE,
            "image": "cona:test",
            "mount_path": str(root),
            "gpu_resource": "cona.dev/cpu",
            "lease_duration_s": 5,  # a restarted orchestrator takes over after 5 s
            "workload": workload,
        },
    }
    path = root / "k8s-cpu.yaml"
    path.write_text(yaml.safe_dump(profile, sort_keys=False))
    return path


def write_kubeconfig(path: Path, url: str) -> Path:
    """A kubeconfig for the emulator: plain http, no credentials (the client loads it like any other)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "tester", "user": {}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester", "namespace": NAMESPACE}}],
        "current-context": "emulator",
    }
    path.write_text(yaml.safe_dump(config))
    return path


class K8sRun(CliRun):
    """One `cona run` on the emulated cluster, with what the tests look at and what a failure should show."""

    finish_timeout_s = 200.0

    def __init__(self, k8s, root: Path, workload: str = "indexed-job") -> None:
        super().__init__(root / "run", root / "cona-run.out")
        self.k8s = k8s
        self.controller = k8s.run_jobs(root / "pods")
        (root / "pods").mkdir(exist_ok=True)
        self.profile = write_profile(root, workload)
        self.kubeconfig = write_kubeconfig(root / "kubeconfig", k8s.url)

    def start(self, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = str(self.kubeconfig)
        self.start_cli(["--profile", str(self.profile), "--job", TINY, *BASE, *args], env)

    def launch(self, attempt: int) -> dict:
        try:
            return json.loads((self.run.attempt_dir(attempt) / "launch.json").read_text())
        except (OSError, ValueError):
            return {}

    def logs(self) -> str:
        return "\n".join([f"--- cona run output\n{self.output()[-4000:]}", self.controller.logs(), self.events_text()])


@pytest.fixture
def k8s_run(k8s, tmp_path):
    run = K8sRun(k8s, tmp_path)
    yield run
    run.cleanup()


@pytest.fixture
def jobset_run(k8s, tmp_path):
    run = K8sRun(k8s, tmp_path, workload="jobset")
    yield run
    run.cleanup()


def assert_samples(run: K8sRun, expected: int) -> None:
    assert_attempts_never_overlap(run.run)
    assert assert_samples_exact(run.run) == expected, run.logs()


@pytest.mark.slow
def test_cona_run_switches_through_kubernetes_jobs(k8s_run):
    """A schedule 2 pods × 2 → 1 pod × 2 (dp 4 → 2, gbs 16 → 32) at 800 samples: one Indexed Job per attempt."""
    schedule = f"[{{samples: 0, strategy: '{S4}'}}, {{samples: 800, strategy: '{S2}'}}]"
    k8s_run.start("--set", "policy.name=schedule", "--set", f"policy.schedule={schedule}")
    state = k8s_run.finish()
    launches = k8s_run.events("launch")
    assert len(launches) >= 2, k8s_run.logs()
    switches = k8s_run.events("switch")
    assert any(s["from"]["gbs"] != s["to"]["gbs"] and s["from"]["dp"] != s["to"]["dp"] for s in switches), switches
    first, second = k8s_run.launch(1), k8s_run.launch(2)
    assert first["job_name"] != second["job_name"] and first["namespace"] == NAMESPACE
    jobs = {name: job for (_, name), job in k8s_run.controller.jobs.items()}
    # The rendered torchrun commands the pods ran: 2 nodes × 2, then 1 node × 2, each Job on its own port.
    for name, nnodes, ranks in ((first["job_name"], 2, ["0", "1"]), (second["job_name"], 1, ["0"])):
        argvs = [pod.proc.args for pod in jobs[name].pods]
        assert [a for argv in argvs for a in argv if a.startswith("--node-rank=")] == [f"--node-rank={r}" for r in ranks]
        assert all(f"--nnodes={nnodes}" in argv and "--nproc-per-node=2" in argv for argv in argvs), argvs
        assert all(f"--rdzv-endpoint=127.0.0.1:{jobs[name].port}" in argv for argv in argvs), argvs
    assert jobs[first["job_name"]].port != jobs[second["job_name"]].port
    # Each ended attempt was released: its pods' output kept in its directory, its Job and Service deleted.
    from kubernetes import client

    batch, core = client.BatchV1Api(k8s_run.k8s.api_client()), client.CoreV1Api(k8s_run.k8s.api_client())
    for attempt, launch in ((1, first), (2, second)):
        logs = sorted(k8s_run.run.attempt_dir(attempt).glob("pod-*.log"))
        assert len(logs) == len(jobs[launch["job_name"]].pods) and all(log.read_text() for log in logs), logs
        assert launch["job_name"] not in [j.metadata.name for j in batch.list_namespaced_job(NAMESPACE).items]
        assert launch["service"] not in [v.metadata.name for v in core.list_namespaced_service(NAMESPACE).items]
    assert state.live["samples"] >= 1600
    assert_samples(k8s_run, state.live["samples"])


@pytest.mark.slow
def test_cona_run_switches_through_jobsets(jobset_run):
    """The same schedule (2 pods × 2 → 1 pod × 2 at 800 samples) with `workload: jobset`: one JobSet per attempt,
    its pods named and reached as JobSet names them, no Service of cona's own."""
    schedule = f"[{{samples: 0, strategy: '{S4}'}}, {{samples: 800, strategy: '{S2}'}}]"
    jobset_run.start("--set", "policy.name=schedule", "--set", f"policy.schedule={schedule}")
    state = jobset_run.finish()
    first, second = jobset_run.launch(1), jobset_run.launch(2)
    assert first["workload"] == second["workload"] == "jobset" and first["job_name"] != second["job_name"]
    assert any(s["from"]["dp"] != s["to"]["dp"] for s in jobset_run.events("switch")), jobset_run.logs()
    running = {name: job for (_, name), job in jobset_run.controller.jobs.items()}
    assert {job.workload for job in running.values()} == {"jobset"}
    for name, nnodes in ((first["job_name"], 2), (second["job_name"], 1)):
        pods = running[name].pods
        assert [pod.name.rsplit("-", 1)[0] for pod in pods] == [f"{name}-node-0-{i}" for i in range(nnodes)]
        assert all(f"--rdzv-endpoint=127.0.0.1:{running[name].port}" in pod.proc.args for pod in pods)
    # Each ended attempt was released: its JobSet deleted, its pods' output kept in its directory. cona created
    # no Service (JobSet makes its own).
    api = jobset_run.k8s.api_client("reader")
    jobsets = client.CustomObjectsApi(api).list_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", NAMESPACE,
                                                                         "jobsets")["items"]  # fmt: skip
    assert jobsets == []
    for attempt, launch in ((1, first), (2, second)):
        logs = sorted(jobset_run.run.attempt_dir(attempt).glob("pod-*.log"))
        assert len(logs) == len(running[launch["job_name"]].pods) and all(log.read_text() for log in logs), logs
    ends = jobset_run.events("attempt-end")
    assert ends[0]["status"] == "switched" and ends[-1]["status"] == "done", ends
    assert client.CoreV1Api(api).list_namespaced_service(NAMESPACE).items == []
    assert state.live["samples"] >= 1600
    assert_samples(jobset_run, state.live["samples"])


def steps(run: K8sRun, attempt: int) -> int:
    return max((h.get("step", 0) for h in heartbeats(run.run, attempt)), default=0)


@pytest.mark.slow
def test_a_crashed_worker_a_disrupted_pod_and_a_deleted_pod_are_relaunched_from_the_checkpoint(k8s_run):
    """Attempt 1: a trainer worker of pod 0 is killed (-9): torchrun fails, the pod fails, the Job fails
    (backoffLimit 0): a crash. Attempt 2: pod 1 is evicted (DisruptionTarget): the backend deletes the Job and the
    attempt ends disrupted, which is not a failure: the run's restart counter shows only the crash. Attempt 3: pod 1
    is deleted (`kubectl delete pod`): the kubelet sends SIGTERM to its torchrun, whose workers take it as a
    preemption together with every other rank (the signal flags are summed each step): they checkpoint and exit
    43, and the Job fails without the pod. Each time the next attempt resumes from the last checkpoint and the
    samples audit stays exact."""
    k8s_run.finish_timeout_s = 400  # four attempts, each starting torchrun in two pods
    k8s_run.start("--policy", f"fixed:{S4}")
    evicted = deleted = ""
    for attempt in (1, 2, 3):
        k8s_run.wait(lambda a=attempt: k8s_run.launch(a).get("job_name"), 120, f"attempt {attempt}'s launch")
        job = k8s_run.launch(attempt)["job_name"]
        k8s_run.wait(lambda a=attempt: k8s_run.run.latest_checkpoint() is not None and steps(k8s_run, a) >= 12 * a,
                     180, f"attempt {attempt}: a checkpoint and step {12 * attempt}")  # fmt: skip
        if attempt == 1:
            k8s_run.controller.crash_worker(job, 0)
        elif attempt == 2:
            evicted = k8s_run.controller.disrupt_pod(job, 1)
        else:
            deleted = k8s_run.controller.delete_pod(job, 1)
    state = k8s_run.finish()
    ends = k8s_run.events("attempt-end")
    assert [(e["attempt"], e["status"]) for e in ends[:3]] == [(1, "crashed"), (2, "disrupted"), (3, "stopped")], ends
    # The killed worker is named from the pods' logs (torchrun's summary), not only "the Job failed".
    assert re.search(r"^the Job failed \(.*\); trainer exit code 1: rank [01] killed by SIGKILL$", ends[0]["detail"]), ends[0]
    assert ends[1]["detail"] == f"pod {evicted}: EvictionByEvictionAPI (Eviction API: evicting)", ends[1]
    assert [e["attempt"] for e in k8s_run.events("failure")] == [1]  # the crash only: not the eviction or deletion
    assert [(e["attempt"], e["detail"]) for e in k8s_run.events("disruption")] == [(2, ends[1]["detail"])]
    reasons = [e["reason"] for e in k8s_run.events("launch")][1:4]
    assert reasons[:2] == ["relaunch after crashed", "relaunch after a disruption"], reasons
    assert reasons[2].startswith("resume after SIGTERM ("), reasons  # what the trainer recorded, not a guess
    # The deleted pod: stopped at a step boundary with a checkpoint (exit 43), well inside its grace period.
    pod = next(p for p in k8s_run.controller.jobs[(NAMESPACE, k8s_run.launch(3)["job_name"])].pods if p.name == deleted)
    assert pod.deleted_at is not None and pod.proc.returncode is not None and ends[2]["exit_code"] == 43
    resumed = [h for h in heartbeats(k8s_run.run, 4) if h.get("event") == "resume"]
    assert resumed and resumed[0]["step"] == ends[2]["step"], resumed  # from the checkpoint the SIGTERM wrote
    assert ends[-1]["status"] == "done" and len(k8s_run.events("launch")) >= 4
    for attempt in (1, 2, 3):
        running = k8s_run.controller.jobs[(NAMESPACE, k8s_run.launch(attempt)["job_name"])]
        assert running.finished and all(pod.proc.poll() is not None for pod in running.pods)
    assert state.live["samples"] >= 1600
    assert_samples(k8s_run, state.live["samples"])


def test_kubernetes_expansion_of_command_values():
    from tests.k8s_emulator import expand

    env = {"JOB_COMPLETION_INDEX": "1", "A": "x"}
    assert expand("--node-rank=$(JOB_COMPLETION_INDEX)", env) == "--node-rank=1"
    assert expand("$$(A) $(A) $(B) $$$(A) $ a$", env) == "$(A) x $(B) $x $ a$"


def test_a_lost_node_shrinks_the_run_to_the_plan_for_the_nodes_left(k8s_run):
    """An elastic run (`min_nodes: 1`) on two emulated Nodes: node b vanishes mid-run (Node deleted, its pod's
    processes killed, the pod left as it was): the run goes on from the last complete checkpoint in one pod, on
    node a, with the strategy planned for one node, until it is stopped. No failure is counted; the samples are
    exactly 0..N−1 across both attempts. (Growing back is the scheduler's, as on every backend: the local e2e
    test covers it; `available_nodes` here is unit-tested in tests/test_k8s_elastic.py.)"""
    for node in ("a", "b"):
        k8s_run.k8s.add_node(node, resource="cona.dev/cpu", count=2)
    schedule = f"[{{samples: 0, strategy: '{S4}'}}]"  # the policy's own plan for two nodes, and nothing else
    k8s_run.start("--profile-set", "min_nodes=1", "--set", "policy.name=schedule", "--set",
                  f"policy.schedule={schedule}", "--set", "target.max_samples=100000")  # fmt: skip
    k8s_run.wait(lambda: k8s_run.launch(1).get("job_name"), 120, "attempt 1's launch")
    job = k8s_run.launch(1)["job_name"]
    assert Strategy.from_dict(k8s_run.launch(1)["strategy"]) == Strategy.parse(S4)
    k8s_run.wait(lambda: k8s_run.run.latest_checkpoint() is not None and steps(k8s_run, 1) >= 12, 180,
                 "attempt 1: a checkpoint and step 12")  # fmt: skip
    running = k8s_run.controller.jobs[(NAMESPACE, job)]
    assert sorted(p.node for p in running.pods) == ["a", "b"]
    (lost_pod,) = k8s_run.controller.lose_node("b")
    shrink = k8s_run.wait(lambda: k8s_run.events("shrink"), 120, "the run to shrink after losing node b")[0]
    assert shrink["lost"] == ["b"] and shrink["nodes"] == 1, shrink
    assert f"node b of pod {lost_pod} is gone" in shrink["reason"], shrink
    one = Strategy.from_dict(shrink["to"])
    assert one.world_size == 2 and one != Strategy.parse(S4)
    k8s_run.wait(lambda: steps(k8s_run, 2) >= 3, 180, "three steps on one node")
    second = k8s_run.controller.jobs[(NAMESPACE, k8s_run.launch(2)["job_name"])]
    assert [p.node for p in second.pods] == ["a"] and Strategy.from_dict(k8s_run.launch(2)["strategy"]) == one
    assert Strategy.from_dict(heartbeats(k8s_run.run, 2)[0]["strategy"]) == one
    request_stop(k8s_run.run)
    assert k8s_run.proc is not None and k8s_run.proc.wait(timeout=200) == 0, k8s_run.logs()
    state = read_state(k8s_run.run)
    assert state.status == "stopped", k8s_run.logs()
    assert not k8s_run.events("failure") and state.restarts_in_row == 0, k8s_run.logs()
    assert [e["status"] for e in k8s_run.events("attempt-end")] == ["lost-node", "stopped"], k8s_run.logs()
    assert_samples(k8s_run, state.live["samples"])
