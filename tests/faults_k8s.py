"""The seeded fault injector on the Kubernetes emulator: `python -m tests.faults --backend kubernetes ...`.

The same runs, schedule, moments and checks as the local backend (`tests/faults.py`), through the Kubernetes
backend: each attempt is an Indexed Job of 2 pods × 2 trainer processes on the kmock API emulator, whose pods the
emulator's Job controller and kubelet run as local processes (`tests/k8s_emulator.py`; no API server can run here).
Kinds of its own, on top of the process faults (which hit the pods' processes the same way):

- `pod-delete`: `kubectl delete pod` on one pod of the running attempt — the kubelet sends SIGTERM to its torchrun
  and SIGKILL after the grace period; the Job fails without that pod;
- `pod-evict`: the Eviction API on one pod (a `DisruptionTarget` condition, its processes killed).

Besides the promises of every backend, after each run no Job of the run is left in the API.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests import faults
from tests.faults import K8S_KINDS, Fault, FaultFailed, Result, Run


@dataclasses.dataclass
class Cluster:
    """The emulated cluster of one suite: the API, the controller that runs the pods, a profile and a kubeconfig."""

    emulator: Any
    controller: Any
    profile: Path
    kubeconfig: Path


@contextlib.contextmanager
def cluster(root: Path) -> Iterator[Cluster]:
    from tests.k8s_emulator import running_emulator
    from tests.test_k8s_e2e import write_kubeconfig, write_profile

    root.mkdir(parents=True, exist_ok=True)
    with running_emulator() as emulator:
        (root / "pods").mkdir(exist_ok=True)
        controller = emulator.run_jobs(root / "pods")
        yield Cluster(emulator, controller, write_profile(root), write_kubeconfig(root / "kubeconfig", emulator.url))


class KubernetesRun(Run):
    """One `cona run` on the emulated cluster's profile, with the kubeconfig that points at it."""

    def __init__(self, root: Path, name: str, k8s: Cluster) -> None:
        super().__init__(root, name, backend="kubernetes", profile=k8s.profile)
        self.k8s = k8s

    def start(self) -> None:
        # The pods' in-cluster variables must not leak into the client's configuration: the kubeconfig decides.
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env.update(PYTHONUNBUFFERED="1", KUBECONFIG=str(self.k8s.kubeconfig), **faults.SECRETS)
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(self.args, cwd=faults.REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    def job_names(self) -> list[str]:
        """The Jobs the run's attempts launched (their launch records), oldest first."""
        names = []
        for path in sorted((self.root / "attempts").glob("*/launch.json"), key=lambda p: int(p.parent.name)):
            with contextlib.suppress(OSError, ValueError):
                if name := json.loads(path.read_text()).get("job_name"):
                    names.append(name)
        return names

    def inject_own(self, fault: Fault) -> str | None:
        if fault.kind not in K8S_KINDS:
            return None
        controller = self.k8s.controller
        # Between two attempts (a switch is a relaunch here) the fault hits the next attempt's pods as they start.
        # Polled at the controller's own tick: each poll reads every launch record of the run.
        if not self.wait_until(lambda: bool(controller.running(self.job_names())), timeout=120,
                               what="a running Job of the run", poll=controller.POLL_S):  # fmt: skip
            return "run ended first"
        jobs = controller.running(self.job_names())
        if not jobs:
            return "the Job ended first"
        job = jobs[-1]
        index = fault.victim % len(job.pods)
        if fault.kind == "pod-delete":
            return f"pod {controller.delete_pod(job.name, index)} deleted"
        return f"pod {controller.disrupt_pod(job.name, index)} evicted"

    def check_own(self) -> None:
        """No Job of the run is left in the API (each ended attempt is released)."""
        from kubernetes import client

        batch = client.BatchV1Api(self.k8s.emulator.api_client("fault-check"))
        left = sorted(set(self.job_names()) & {j.metadata.name for j in batch.list_job_for_all_namespaces().items})
        if left:
            raise FaultFailed(f"Jobs left in the API after the run: {', '.join(left)}")


def reference_run(k8s: Cluster, root: Path) -> tuple[list[tuple[int, str]], dict[str, Any]]:
    """The uninterrupted run on the emulated cluster."""
    run = KubernetesRun(root, "reference", k8s)
    run.start()
    assert run.proc is not None
    if run.proc.wait(timeout=900) != 0:
        raise FaultFailed(f"the uninterrupted reference run failed\n{run.tail()}")
    faults.check_files(run)
    run.check_own()
    return faults.layout_sequence(run.root), faults.final_parameters(run.root)


def run_suite(*, seed: int, indices: list[int], kinds: tuple[str, ...], root: Path) -> list[Result]:
    drawn = [faults.draw(seed, i, kinds, "kubernetes") for i in indices]
    results: list[Result] = []
    with cluster(root) as k8s:
        started = time.monotonic()
        reference = reference_run(k8s, root)
        print(f"reference run: {time.monotonic() - started:.0f} s", flush=True)
        for number, group in sorted(faults.groups(drawn).items()):
            print(f"run {number}: {', '.join(f.describe() for f in group)}", flush=True)
            results += faults.run_group(root, group, reference, seed=seed, backend="kubernetes",
                                        new_run=lambda root, name: KubernetesRun(root, name, k8s))  # fmt: skip
            print(f"  → {results[-1].outcome.splitlines()[0]}", flush=True)
    return results
