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
from tests.faults import Fault, FaultFailed, Result, Run

K8S_KINDS = ("pod-delete", "pod-evict")
KINDS = faults.KINDS + K8S_KINDS
"""What `--backend kubernetes` draws from by default."""


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

    def __init__(self, root: Path, name: str, k8s: Cluster, extra: tuple[str, ...] = ()) -> None:
        super().__init__(root, name, extra)
        self.k8s = k8s
        self.args[self.args.index(str(faults.PROFILE))] = str(k8s.profile)

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


def inject(run: KubernetesRun, fault: Fault) -> str:
    """Do it; the process kinds as on every backend (`faults.inject`)."""
    if fault.kind not in K8S_KINDS:
        return faults.inject(run, fault)
    controller = run.k8s.controller
    # Between two attempts (a switch is a relaunch here) the fault hits the next attempt's pods as they start.
    if not run.wait_until(lambda: bool(controller.running(run.job_names())), timeout=120,
                          what="a running Job of the run"):  # fmt: skip
        return "run ended first"
    jobs = controller.running(run.job_names())
    if not jobs:
        return "the Job ended first"
    job = jobs[-1]
    index = fault.victim % len(job.pods)
    if fault.kind == "pod-delete":
        return f"pod {controller.delete_pod(job.name, index)} deleted"
    return f"pod {controller.disrupt_pod(job.name, index)} evicted"


def check_released(run: KubernetesRun) -> None:
    """No Job of the run is left in the API (each ended attempt is released)."""
    from kubernetes import client

    batch = client.BatchV1Api(run.k8s.emulator.api_client("fault-check"))
    left = sorted(set(run.job_names()) & {j.metadata.name for j in batch.list_job_for_all_namespaces().items})
    if left:
        raise FaultFailed(f"Jobs left in the API after the run: {', '.join(left)}")


def run_group(k8s: Cluster, root: Path, group: list[Fault], reference: Any, *, seed: int,
              timeout: float = 300) -> list[Result]:  # fmt: skip
    """One run with `group`'s faults (in window order), checked at the end (`faults.run_group`'s flow)."""
    run = KubernetesRun(root, "run-" + "-".join(str(f.index) for f in group), k8s)
    results = [Result(f) for f in group]
    run.start()
    try:
        for result in results:
            where = faults.arm(run, result.fault, timeout)
            result.hit = f"{where}: {inject(run, result.fault)}"
            print(f"  {result.fault.describe()} → {result.hit}", flush=True)
        assert run.proc is not None
        try:
            run.proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            raise FaultFailed(f"cona run did not finish in 900 s\n{run.tail()}") from None
        summary = faults.check_run(run, reference)
        check_released(run)
        for result in results:
            result.ok, result.outcome = True, summary
    except FaultFailed as e:
        replay = " ; ".join(f"python -m tests.faults --backend kubernetes --seed {seed} --fault {r.fault.index}"
                            for r in results)  # fmt: skip
        for result in results:
            result.outcome = f"FAILED: {e}\n  replay: {replay}\n  run directory: {run.root}\n{k8s.controller.logs()[-2000:]}"
    finally:
        faults.kill_run(run.root)
    return results


def reference_run(k8s: Cluster, root: Path) -> tuple[list[tuple[int, str]], dict[str, Any]]:
    """The uninterrupted run on the emulated cluster."""
    run = KubernetesRun(root, "reference", k8s)
    run.start()
    assert run.proc is not None
    if run.proc.wait(timeout=900) != 0:
        raise FaultFailed(f"the uninterrupted reference run failed\n{run.tail()}")
    faults.check_files(run)
    check_released(run)
    return faults.layout_sequence(run.root), faults.final_parameters(run.root)


def run_suite(*, seed: int, indices: list[int], kinds: tuple[str, ...], root: Path) -> list[Result]:
    drawn = [faults.draw(seed, i, kinds) for i in indices]
    results: list[Result] = []
    with cluster(root) as k8s:
        started = time.monotonic()
        reference = reference_run(k8s, root)
        print(f"reference run: {time.monotonic() - started:.0f} s", flush=True)
        for number, group in sorted(faults.groups(drawn).items()):
            print(f"run {number}: {', '.join(f.describe() for f in group)}", flush=True)
            results += run_group(k8s, root, group, reference, seed=seed)
            print(f"  → {results[-1].outcome.splitlines()[0]}", flush=True)
    return results
