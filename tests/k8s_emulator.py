"""The Kubernetes API emulator (kmock) for the backend tests, behind the `k8s` fixture in conftest.py.

kmock serves an in-memory Kubernetes API over HTTP; it runs here in a thread with its own event loop, and the
official (synchronous) client talks to it. Besides the bundled built-in resources it knows the custom ones of the
optional workload kinds (`CUSTOM_RESOURCES`: JobSet, TrainJob), as if their CRDs were installed. It has no
controllers: nothing creates a Job's pods or fills in its status, so `Emulator` plays the Job, JobSet and Trainer
controllers and the kubelet (`make_pods`, `set_status`) through a client of its own, whose requests carry a
different User-Agent and so are left out of `backend_requests`.

`run_jobs(workdir)` goes further for whole `cona run`s: a background thread plays the Job and JobSet controllers
and the kubelet. Every new Job gets its `completions` pods (from its template), every new JobSet the pods of its
first replicatedJob's Job (one per completion index, named and labelled as JobSet does), and each pod's container
command runs as a local process: argv from the container spec with `$(VAR)` expanded from the container's env as
Kubernetes does (`$$` → `$`, JOB_COMPLETION_INDEX = the pod's index), `python` → this interpreter, the rendezvous
endpoint (pod 0's hostname: `<job>-0.<service>`, `<jobset>-<replicatedJob>-0-0.<subdomain>`) →
`127.0.0.1:<a free port of this workload>`. Pod and workload status follow the processes (Running;
Succeeded/Failed with the exit code; Job Complete or JobSet Completed, or Failed and its other pods killed, as
`backoffLimit: 0` and `maxRestarts: 0` would); deleting the workload kills its processes. `disrupt_pod`,
`crash_worker` and `delete_pod` inject faults; a pod deleted through the API while it runs is terminated as the
kubelet does it (SIGTERM to the container's main process, SIGKILL after its grace period) and its end fails the Job. Nodes exist only if a test creates them (`add_node`): then each new pod is bound to a
Ready, schedulable node that no running pod holds (`spec.nodeName`; one pod a node, as one trainer pod takes a
node's GPUs), and `lose_node` plays a node that vanishes: its Node object is deleted and its pods' processes
killed, while their API objects stay as they were (no kubelet is left to report them). TrainJobs are not run (their torch runtime is not emulated).

Known limits of the emulator: label and field selectors are ignored (the backend filters pods itself), no
uid/resourceVersion/status is filled in, PUT and deletecollection answer 404, watches never end on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BACKEND_AGENT = "cona-backend-under-test"
KUBELET_AGENT = "cona-test-kubelet"
CUSTOM_RESOURCES = {
    # (group, version, plural): kind. Served as if the CRDs of JobSet and Kubeflow Trainer were installed.
    ("jobset.x-k8s.io", "v1alpha2", "jobsets"): "JobSet",
    ("trainer.kubeflow.org", "v1alpha1", "trainjobs"): "TrainJob",
}
CUSTOM_VERBS = {"create", "get", "list", "watch", "update", "patch", "delete", "deletecollection"}
WORKLOADS = {
    # profile workload: (group, version, plural) of its main object; None: a batch/v1 Job
    "indexed-job": None,
    "jobset": ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
    "trainjob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
}
SUCCEEDED = {"indexed-job": "Complete", "jobset": "Completed", "trainjob": "Complete"}
REPLICATED_JOB = "node"


class Emulator:
    """kmock's KubernetesEmulator served on 127.0.0.1 from a background thread."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.kmock: Any = None
        self.url = ""
        self._thread = threading.Thread(target=self._run, name="kmock", daemon=True)
        self._controller: JobController | None = None
        self._arrived: list[Any] = []
        self.pod_logs: dict[str, str] = {}
        """What a pod's container printed, by pod name, for pods no process runs for (`make_pods`)."""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # reported by start()/stop()
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        import kmock

        arrived = self._arrived

        class ShortHistory(kmock.KubernetesEmulator):
            """kmock finds a request's reaction by scanning every request it has kept, once per reaction: quadratic
            in the requests served (an end-to-end test took 101 CPU-s with it, 62 without). Here kmock keeps only
            the requests in flight, which are all its reactions look at; `arrived` keeps them all, for the tests."""

            async def _handle(self, request: Any) -> Any:
                arrived.append(request)  # before the first await: in the order they came
                try:
                    return await super()._handle(request)
                finally:
                    index = next(i for i, r in enumerate(self._requests) if r is request)
                    del self._requests[index]

        async with ShortHistory(strict=False) as k, kmock.Server(k) as srv:
            k.resources.load_bundled()
            for (group, version, plural), kind in CUSTOM_RESOURCES.items():
                k.resources[f"{group}/{version}/{plural}"] = kmock.ResourceInfo(
                    kind=kind, namespaced=True, verbs=CUSTOM_VERBS, subresources={"status"}
                )
            self.kmock, self.url = k, str(srv.url).rstrip("/")
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()

    def start(self) -> Emulator:
        import kmock

        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"the Kubernetes emulator did not start: {self._error!r}")

        async def serve_logs() -> None:
            # kmock answers a pod's log with the pod itself: answer with what the emulated container printed.
            self.kmock["get", kmock.resource("", "v1", "pods"), kmock.subresource("log")] << kmock.headers(
                {"Content-Type": "text/plain"}
            ) << self._pod_log  # fmt: skip

        asyncio.run_coroutine_threadsafe(serve_logs(), self._loop).result(10)
        return self

    def _pod_log(self, request: Any) -> bytes:
        """The last `tailLines` lines of an emulated pod's output: `pod_logs`, else its process's (empty for a pod
        no process ran for)."""
        pod = request.url.path.rstrip("/").split("/")[-2]
        controller = self._controller
        found = [p for j in (controller.jobs.values() if controller else []) for p in j.pods if p.name == pod]
        if pod in self.pod_logs:
            lines = self.pod_logs[pod].encode().splitlines(keepends=True)
        elif not found or not found[0].log.exists():
            return b""
        else:
            lines = found[0].log.read_bytes().splitlines(keepends=True)
        tail = request.url.query.get("tailLines")
        return b"".join(lines[-int(tail) :] if tail else lines)

    def stop(self) -> None:
        if self._controller is not None:
            self._controller.stop()
        if self._stop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)
        assert not self._thread.is_alive(), "the Kubernetes emulator's thread did not end"
        self._loop.close()

    # --- clients ---------------------------------------------------------------------------------------------

    def api_client(self, user_agent: str = BACKEND_AGENT) -> Any:
        """A client of the official library pointed at the emulator (a fresh one per call)."""
        from kubernetes import client

        configuration = client.Configuration(host=self.url)
        configuration.retries = 0
        api = client.ApiClient(configuration)
        api.user_agent = user_agent
        return api

    def requests(self) -> list[Any]:
        """Every request the emulator has received, in the order they came."""
        return list(self._arrived)

    def backend_requests(self) -> list[tuple[str, str]]:
        """(method, path) of every request the backend's clients made, in order."""
        return [
            (str(r.method.value if hasattr(r.method, "value") else r.method).upper(), r.url.path)
            for r in self.requests()
            if r.headers.get("User-Agent") == BACKEND_AGENT
        ]

    def refuse(self, method: str, group: str, version: str, plural: str, *, status: int, message: str,
               causes: list[dict[str, str]] | None = None) -> None:  # fmt: skip
        """From now on, answer `method` requests on that resource with an API error (a Status body)."""
        import kmock

        body = {"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": status, "message": message,
                "reason": {403: "Forbidden", 409: "AlreadyExists", 422: "Invalid"}.get(status, "Error"),
                "details": {"causes": causes or []}}  # fmt: skip

        async def add() -> None:
            self.kmock[method, kmock.resource(group, version, plural)] << status << body

        asyncio.run_coroutine_threadsafe(add(), self._loop).result(10)

    # --- playing the controllers -----------------------------------------------------------------------------

    def _kubelet(self) -> tuple[Any, Any]:
        from kubernetes import client

        api = self.api_client(KUBELET_AGENT)
        return client.CoreV1Api(api), client.BatchV1Api(api)

    def set_job_status(self, name: str, namespace: str, *, conditions: list[dict[str, Any]], **status: Any) -> None:
        """Give the Job a status (as the Job controller would), e.g. `[{"type": "Complete", "status": "True"}]`."""
        self.set_status("indexed-job", name, namespace, conditions=conditions, **status)

    def set_status(self, workload: str, name: str, namespace: str, *, conditions: list[dict[str, Any]],
                   **status: Any) -> None:  # fmt: skip
        """Give the workload of kind `workload` (a profile's `kubernetes.workload`) a status, as its controller
        would, e.g. `[{"type": "Completed", "status": "True"}]` for a JobSet."""
        from kubernetes import client

        body = {"status": {"conditions": conditions, **status}}
        gvp = WORKLOADS[workload]
        if gvp is None:
            self._kubelet()[1].patch_namespaced_job(name, namespace, body)
        else:
            client.CustomObjectsApi(self.api_client(KUBELET_AGENT)).patch_namespaced_custom_object(
                gvp[0], gvp[1], namespace, gvp[2], name, body
            )

    def pod_template(self, workload: str, name: str, namespace: str) -> tuple[int, dict[str, Any], dict[str, str]]:
        """(pod count, pod template as a dict, labels its controllers add) of the workload, as its controllers
        would make the pods: a Job's template; a JobSet's first replicatedJob's; a TrainJob's torch runtime (a
        `node` container with the trainer's image and command, patched by its runtime patch)."""
        from kubernetes import client

        api = self.api_client(KUBELET_AGENT)
        gvp = WORKLOADS[workload]
        if gvp is None:
            job = client.BatchV1Api(api).read_namespaced_job(name, namespace)
            template = client.ApiClient().sanitize_for_serialization(job.spec.template)
            return job.spec.completions or 1, template, {"batch.kubernetes.io/job-name": name, "job-name": name}
        obj = client.CustomObjectsApi(api).get_namespaced_custom_object(gvp[0], gvp[1], namespace, gvp[2], name)
        job_name = f"{name}-{REPLICATED_JOB}-0"
        added = {"jobset.sigs.k8s.io/jobset-name": name, "batch.kubernetes.io/job-name": job_name, "job-name": job_name}
        if workload == "jobset":
            job_template = obj["spec"]["replicatedJobs"][0]["template"]
            return job_template["spec"].get("completions") or 1, job_template["spec"]["template"], added
        trainer = obj["spec"]["trainer"]
        (patch,) = obj["spec"]["runtimePatches"]
        (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        template = json_copy(replicated["template"]["spec"]["template"])
        (container,) = template["spec"]["containers"]
        container.update({"image": trainer["image"], "command": trainer["command"], "env": trainer.get("env", [])})
        return trainer["numNodes"], template, added

    def make_pods(
        self, job_name: str, namespace: str, *, phase: str = "Running", exit_codes: list[int] | None = None,
        conditions: list[dict[str, Any]] | None = None, container_waiting: dict[str, str] | None = None,
        workload: str = "indexed-job", node_name: str | None = None,
    ) -> list[str]:  # fmt: skip
        """Create the pods of the workload `job_name` (one per completion index, from its template) with the given
        status, as its controllers and the kubelet would. `exit_codes[i]`: pod i's trainer container terminated
        with that code. `workload`: the kind, as a profile's `kubernetes.workload` names it; `node_name`: the node
        they were scheduled on."""
        core, _ = self._kubelet()
        count, template, added = self.pod_template(workload, job_name, namespace)
        names = []
        for index in range(count):
            labels = {**(template["metadata"].get("labels") or {}), **added,
                      "batch.kubernetes.io/job-completion-index": str(index)}  # fmt: skip
            container = template["spec"]["containers"][0]
            state: dict[str, Any] = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
            if exit_codes is not None:
                code = exit_codes[index]
                state = {"terminated": {"exitCode": code, "reason": "Error" if code else "Completed"}}
            elif container_waiting is not None:
                state = {"waiting": container_waiting}
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{job_name}-{index}-abcde",
                    "namespace": namespace,
                    "labels": labels,
                    "annotations": {"batch.kubernetes.io/job-completion-index": str(index)},
                },
                "spec": {**template["spec"], **({"nodeName": node_name} if node_name else {})},
                "status": {
                    "phase": phase,
                    "conditions": list(conditions or []),
                    "containerStatuses": [
                        {
                            "name": container["name"],
                            "image": container.get("image") or "",
                            "imageID": "",
                            "ready": phase == "Running",
                            "restartCount": 0,
                            "state": state,
                        }
                    ],
                },
            }
            core.create_namespaced_pod(namespace, pod)
            names.append(pod["metadata"]["name"])
        return names


    # --- running Jobs as local processes ----------------------------------------------------------------------

    def run_jobs(self, workdir: Path, *, env: dict[str, str] | None = None) -> JobController:
        """Start playing the Job controller and the kubelet: every Job created from now on runs its pods as local
        processes (their working directories and logs under `workdir`), with `env` added to their environment
        (e.g. the KUBECONFIG that stands in for the pods' service account). Stopped with the emulator."""
        if self._controller is None:
            self._controller = JobController(self, Path(workdir), env=env).start()
        return self._controller

    def add_node(self, name: str, *, resource: str, count: int, ready: bool = True, unschedulable: bool = False,
                 labels: dict[str, str] | None = None) -> None:  # fmt: skip
        """Create a Node with `count` of `resource` allocatable, as a kubelet registering would."""
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}},
                "spec": {"unschedulable": unschedulable},
                "status": {"allocatable": {resource: str(count)}, "capacity": {resource: str(count)},
                           "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}  # fmt: skip
        self._kubelet()[0].create_node(body)

    def write_kubeconfig(self, path: Path, *, token: str, namespace: str = "default") -> Path:
        """A kubeconfig for the emulator (plain http) whose requests carry `Bearer <token>`: the emulator does not
        check it, but `requests_by(token)` tells the callers apart (the laptop's CLI, the orchestrator pod)."""
        import yaml

        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": token, "user": {"token": token}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": token, "namespace": namespace}}],
            "current-context": "emulator",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    def requests_by(self, token: str) -> list[tuple[str, str]]:
        """(method, path) of every request made with a kubeconfig of `write_kubeconfig(token=...)`, in order."""
        return [
            (str(r.method.value if hasattr(r.method, "value") else r.method).upper(), r.url.path)
            for r in self.requests()
            if r.headers.get("Authorization") == f"Bearer {token}"
        ]


def json_copy(value: Any) -> Any:
    return json.loads(json.dumps(value))


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of `command`/`args`/`env` values: `$(VAR)` → the variable's value if it is defined
    (else left as written), `$$` → `$`, any other `$` kept."""
    out, i = [], 0
    while i < len(value):
        if value.startswith("$$", i):
            out.append("$")
            i += 2
        elif value.startswith("$(", i) and (end := value.find(")", i + 2)) != -1:
            name = value[i + 2 : end]
            out.append(env[name] if name in env else value[i : end + 1])
            i = end + 1
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


STARTED = "emulator.cona.dev/started"
"""Annotation the emulated Job controller puts on a workload it has started (the uid it gave it)."""
POD_MARKER = "CONA_EMULATED_POD"
"""Environment variable that names the pod in each of its processes (and every process they start)."""


def pod_pids(pod_name: str) -> list[int]:
    """The live processes of an emulated pod (all carry `POD_MARKER=<pod>` in their environment)."""
    marker = f"{POD_MARKER}={pod_name}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def kill_pod(pod: PodProcess, sig: int = signal.SIGKILL) -> None:
    for pid in [pod.proc.pid, *pod_pids(pod.name)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


@contextlib.contextmanager
def frozen(pods: list[PodProcess]) -> Iterator[None]:
    """Stop every process of `pods` (SIGSTOP: torchrun and its workers) for the block, then let them go on.

    The pods stay running to the controller and the API, at the step they had reached: an attempt that must outlive
    some event (an orchestrator's restart, a stop on its way) does so however fast or loaded the machine is, instead
    of training a long budget in the hope of outlasting it."""
    pids = [pid for pod in pods for pid in pod_pids(pod.name)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@dataclass
class PodProcess:
    name: str
    index: int
    proc: subprocess.Popen
    log: Path
    disrupted: bool = False
    reported: bool = False
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    node: str | None = None
    """The Node it was bound to (`spec.nodeName`), when the test created Nodes."""
    lost: bool = False
    """Its node vanished (`lose_node`): its processes are dead, nothing reports it any more."""
    deleted_at: float | None = None
    """When its API object was deleted (`kubectl delete pod`) while it ran (monotonic): the kubelet's graceful
    termination is under way, and the Job controller counts its end without a pod object to report it on."""
    grace_s: float = 30.0
    """The pod's `terminationGracePeriodSeconds` (Kubernetes' default 30 s)."""


@dataclass
class RunningJob:
    """A Job or a JobSet (`workload`: "indexed-job" or "jobset") whose pods run as local processes."""

    name: str
    namespace: str
    port: int
    uid: str = ""
    container: str = "trainer"
    restart_policy: str = "Never"
    backoff_limit: int = 0
    pods: list[PodProcess] = field(default_factory=list)
    finished: bool = False
    deleted: bool = False
    workload: str = "indexed-job"
    owners: list[tuple[str, str, str]] = field(default_factory=list)
    """(kind, name, uid) of the Job's ownerReferences when it was created."""


class JobController:
    """The Job controller and kubelet of `Emulator.run_jobs` (see the module docstring)."""

    POLL_S = 0.25

    def __init__(self, emulator: Emulator, workdir: Path, *, env: dict[str, str] | None = None) -> None:
        self.emulator = emulator
        self.workdir = workdir
        self.env = dict(env or {})
        self.jobs: dict[tuple[str, str], RunningJob] = {}
        self.errors: list[str] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="k8s-job-controller", daemon=True)

    def start(self) -> JobController:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        with self._lock:
            for job in self.jobs.values():
                self._kill(job)
            deadline = time.monotonic() + 10
            while (left := [p for j in self.jobs.values() for pod in j.pods for p in pod_pids(pod.name)]) and (
                time.monotonic() < deadline
            ):
                time.sleep(0.2)
            assert not left, f"emulated pods' processes outlived the test: {left}"

    # --- the loop --------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        core, batch = self.emulator._kubelet()
        while not self._stop.is_set():
            try:
                self._tick(core, batch)
            except Exception as e:  # kept for the test's failure message; the loop goes on
                self.errors.append(f"{type(e).__name__}: {e}")
            self._stop.wait(self.POLL_S)

    def _tick(self, core: Any, batch: Any) -> None:
        from kubernetes import client

        # Keyed by (namespace, name) whatever the kind: a run uses one kind, so a Job and a JobSet never share it.
        # (workload kind, the uid this controller gave it when it started it: none yet for a new object).
        listed = {(j.metadata.namespace, j.metadata.name): ("indexed-job", (j.metadata.annotations or {}).get(STARTED))
                  for j in batch.list_job_for_all_namespaces().items}  # fmt: skip
        group, version, plural = WORKLOADS["jobset"]  # type: ignore[misc]
        custom = client.CustomObjectsApi(batch.api_client)
        for obj in custom.list_cluster_custom_object(group, version, plural)["items"]:
            meta = obj["metadata"]
            listed[(meta["namespace"], meta["name"])] = ("jobset", (meta.get("annotations") or {}).get(STARTED))
        with self._lock:
            # Deletions first: a workload deleted and the next one created between two ticks (a switch, a shrink)
            # frees its nodes before the new pods are placed, as the real scheduler would see them freed.
            for key, running in self.jobs.items():
                if key not in listed:
                    if not running.deleted:
                        # Deleted (foreground): its processes are killed and its pods go, finished or not.
                        self._kill(running)
                        for pod in running.pods:
                            with contextlib.suppress(Exception):
                                core.delete_namespaced_pod(pod.name, running.namespace)
                    running.finished = running.deleted = True
            for key, (workload, started) in listed.items():
                previous = self.jobs.get(key)
                if previous is not None and not previous.deleted and started != previous.uid:
                    # Deleted and created again between two ticks (a new object, without our mark): the old one's
                    # processes and pods go, as its deletion would have done.
                    self._kill(previous)
                    for pod in previous.pods:
                        with contextlib.suppress(Exception):
                            core.delete_namespaced_pod(pod.name, previous.namespace)
                    previous.finished = previous.deleted = True
                if previous is None or previous.deleted:
                    self.jobs[key] = self._start_job(core, key[1], key[0], workload)
            self._terminate_deleted_pods(core, [r for key, r in self.jobs.items() if key in listed and not r.finished])
            for key, running in self.jobs.items():
                if key in listed:
                    self._update(core, batch, running)

    def _terminate_deleted_pods(self, core: Any, live: list[RunningJob]) -> None:
        """The kubelet's part of a pod deleted through the API while it runs: SIGTERM to the container's main process
        (torchrun, which passes it on to its workers), SIGKILL to whatever of the pod is left after its grace period.
        (The real Job controller keeps the object, terminating, until its finalizer goes; kmock removes it at once.)"""
        running_pods = [(r, p) for r in live for p in r.pods if not p.reported and not p.lost]
        if not running_pods:
            return
        present = {(p.metadata.namespace, p.metadata.name) for p in core.list_pod_for_all_namespaces().items}
        now = time.monotonic()
        for running, pod in running_pods:
            if pod.deleted_at is None and (running.namespace, pod.name) not in present:
                pod.deleted_at = now
                with contextlib.suppress(ProcessLookupError):
                    pod.proc.send_signal(signal.SIGTERM)
            elif pod.deleted_at is not None and now > pod.deleted_at + pod.grace_s and pod.proc.poll() is None:
                kill_pod(pod)

    def _start_job(self, core: Any, name: str, namespace: str, workload: str) -> RunningJob:
        """Create the workload's pods and start their commands (Job: `<job>-<index>` in the Service named by the
        template's subdomain; JobSet: `<jobset>-node-0-<index>` in the JobSet's subdomain, as JobSet names them)."""
        from kubernetes import client

        count, template, added = self.emulator.pod_template(workload, name, namespace)
        spec = template["spec"]
        # kmock fills in no uid: the controller gives the workload one (its pods carry it, as the real ones do).
        uid, backoff_limit, owners = str(uuid.uuid4()), 0, []
        if workload == "indexed-job":
            job = client.BatchV1Api(core.api_client).read_namespaced_job(name, namespace)
            uid = (job.metadata.uid if job.metadata else None) or uid
            backoff_limit = job.spec.backoff_limit if job.spec.backoff_limit is not None else 6
            owners = [(o.kind, o.name, o.uid) for o in (job.metadata.owner_references or [])]
        # Marked as started (kmock keeps no uid): an object deleted and created again is told apart by the mark.
        mark = {"metadata": {"annotations": {STARTED: uid}}}
        if workload == "indexed-job":
            client.BatchV1Api(core.api_client).patch_namespaced_job(name, namespace, mark)
        else:
            group, version, plural = WORKLOADS[workload]  # type: ignore[misc]
            client.CustomObjectsApi(core.api_client).patch_namespaced_custom_object(group, version, namespace,
                                                                                    plural, name, mark)  # fmt: skip
        running = RunningJob(name=name, namespace=namespace, port=_free_port(), workload=workload, uid=uid,
                             restart_policy=spec.get("restartPolicy") or "Never", backoff_limit=backoff_limit,
                             owners=owners)  # fmt: skip
        if workload == "jobset":
            job_name = f"{name}-{REPLICATED_JOB}-0"
            spec = {**spec, "subdomain": name}  # the JobSet's network.subdomain, which render.py sets to its name
            hostname = [f"{job_name}-{index}" for index in range(count)]
        else:
            hostname = [f"{name}-{index}" for index in range(count)]
        container = spec["containers"][0]
        running.container = container["name"]
        free = self._free_nodes(core)
        for index in range(count):
            pod_name = f"{hostname[index]}-{os.urandom(3).hex()[:5]}"
            labels = {**(template["metadata"].get("labels") or {}), **added,
                      "batch.kubernetes.io/job-completion-index": str(index),
                      "batch.kubernetes.io/controller-uid": uid, "controller-uid": uid}  # fmt: skip
            annotations = {**(template["metadata"].get("annotations") or {}),
                           "batch.kubernetes.io/job-completion-index": str(index)}  # fmt: skip
            fields = {"metadata.name": pod_name, "metadata.namespace": namespace,
                      **{f"metadata.labels['{k}']": v for k, v in labels.items()},
                      **{f"metadata.annotations['{k}']": v for k, v in annotations.items()}}  # fmt: skip
            argv, env = self._command(container, index=index, host=f"{hostname[0]}.{spec.get('subdomain')}",
                                      port=running.port, fields=fields)  # fmt: skip
            env.update(self.env)
            env[POD_MARKER] = pod_name
            cwd = Path(tempfile.mkdtemp(prefix=f"{pod_name}-", dir=self.workdir))
            log = cwd / "container.log"
            node = free[index] if index < len(free) else None
            grace = spec.get("terminationGracePeriodSeconds")
            running.pods.append(PodProcess(name=pod_name, index=index, proc=self._spawn(argv, env, cwd, log), log=log,
                                           argv=argv, env=env, node=node,
                                           grace_s=30.0 if grace is None else float(grace)))  # fmt: skip
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod_name, "namespace": namespace, "labels": labels, "annotations": annotations},
                "spec": {**spec, "nodeName": node} if node else spec,
                "status": {
                    "phase": "Running",
                    "startTime": _now(),
                    "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
                    "containerStatuses": [self._container_status(container, {"running": {"startedAt": _now()}})],
                },
            }
            core.create_namespaced_pod(namespace, pod)
        return running

    def _free_nodes(self, core: Any) -> list[str]:
        """The Ready, schedulable Nodes that no pod of a running workload holds, by name."""
        # A node is held by a pod whose container still runs: a pod of the previous attempt that has exited frees its
        # node even before its Job object is marked finished or deleted (the next attempt's pods are created then).
        held = {p.node for j in self.jobs.values() if not j.finished and not j.deleted for p in j.pods
                if not p.lost and p.proc.poll() is None}  # fmt: skip
        free = []
        for node in core.list_node().items:
            ready = any(c.type == "Ready" and c.status == "True" for c in (node.status.conditions or []))
            if ready and not (node.spec and node.spec.unschedulable) and node.metadata.name not in held:
                free.append(node.metadata.name)
        return sorted(free)

    @staticmethod
    def _spawn(argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> subprocess.Popen:
        with log.open("a") as out:
            return subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip

    @staticmethod
    def _container_status(container: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
        return {"name": container["name"], "image": container["image"], "imageID": "", "restartCount": 0,
                "ready": "running" in state, "state": state}  # fmt: skip

    @staticmethod
    def _command(container: dict[str, Any], *, index: int, host: str, port: int,
                 fields: dict[str, str]) -> tuple[list[str], dict[str, str]]:  # fmt: skip
        """The container's argv and environment as the kubelet would give them, mapped onto this machine: the
        rendezvous on `host` (pod 0's DNS name) goes to 127.0.0.1:`port`; `fields` are the pod's downward-API
        fields (`metadata.name`, `metadata.labels['...']`, ...)."""
        env: dict[str, str] = {"JOB_COMPLETION_INDEX": str(index)}
        for var in container.get("env") or []:
            if "value" in var:
                env[var["name"]] = expand(var["value"], env)
            elif (path := ((var.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")) in fields:
                env[var["name"]] = fields[path]
        argv = [expand(a, env) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        argv = [re.sub(rf"^--rdzv-endpoint={re.escape(host)}:\d+$", f"--rdzv-endpoint=127.0.0.1:{port}", a)
                for a in argv]  # fmt: skip
        return argv, {**os.environ, **env, "OMP_NUM_THREADS": "1"}

    def _update(self, core: Any, batch: Any, running: RunningJob) -> None:
        if running.finished:
            return
        for pod in running.pods:
            code = pod.proc.poll()
            if code is not None and code != 0 and running.restart_policy == "OnFailure" and not pod.disrupted and (
                pod.deleted_at is None and pod.restarts < running.backoff_limit
            ):
                # The kubelet restarts the container in the same pod (the real one backs off; 1 s here).
                pod.restarts += 1
                time.sleep(1.0)
                pod.proc = self._spawn(pod.argv, pod.env, pod.log.parent, pod.log)
                restarted = {"name": running.container, "image": "", "imageID": "", "restartCount": pod.restarts,
                             "ready": True, "state": {"running": {"startedAt": _now()}}}  # fmt: skip
                core.patch_namespaced_pod(pod.name, running.namespace, {"status": {"containerStatuses": [restarted]}})
                continue
            if code is not None and not pod.reported and not pod.lost:
                self._report(core, running, pod, code)
        ended = [p for p in running.pods if p.reported]
        failed = [p for p in ended if p.proc.returncode != 0 and not p.disrupted]
        if failed:
            # backoffLimit 0 (or a FailJob rule): the Job fails and its other pods are terminated.
            self._kill(running)
            for pod in running.pods:
                if not pod.reported and not pod.lost:
                    self._report(core, running, pod, pod.proc.wait(30))
            code = failed[0].proc.returncode
            reason = "PodFailurePolicy" if code in (2, 42, 43, 44) else "BackoffLimitExceeded"
            if running.workload == "jobset":
                reason = "FailedJobs"  # maxRestarts 0: the JobSet fails with its Job
            self._job_status(running, "Failed", reason, f"pod {failed[0].name} exited {code}", failed=len(failed))
            running.finished = True
        elif len(ended) == len(running.pods) and all(p.proc.returncode == 0 for p in ended):
            self._job_status(running, SUCCEEDED[running.workload], "", "", succeeded=len(ended))
            running.finished = True

    def _report(self, core: Any, running: RunningJob, pod: PodProcess, code: int, *,
                conditions: list[dict[str, Any]] | None = None) -> None:  # fmt: skip
        pod.reported = True
        if pod.deleted_at is not None:
            return  # no object left to report on: the Job controller counts the end all the same
        exit_code = code if code >= 0 else 128 - code  # killed by a signal: 128 + its number, as a container
        state = {"terminated": {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                                "finishedAt": _now()}}  # fmt: skip
        status = {"phase": "Succeeded" if exit_code == 0 else "Failed",
                  "containerStatuses": [{"name": running.container, "image": "", "imageID": "", "restartCount": pod.restarts,
                                         "ready": False, "state": state}]}  # fmt: skip
        if conditions is not None:
            status["conditions"] = conditions
        core.patch_namespaced_pod(pod.name, running.namespace, {"status": status})

    def _job_status(self, running: RunningJob, kind: str, reason: str, message: str, **counts: int) -> None:
        condition = {"type": kind, "status": "True", "reason": reason, "message": message,
                     "lastTransitionTime": _now()}  # fmt: skip
        if running.workload == "jobset":
            counts = {}  # a JobSet's status counts per replicatedJob, which the backend does not read
        self.emulator.set_status(running.workload, running.name, running.namespace, conditions=[condition], **counts)

    @staticmethod
    def _kill(running: RunningJob, sig: int = signal.SIGKILL) -> None:
        """Kill every process of the Job's pods, as a container's end kills its whole PID namespace: torchrun
        starts each worker in a session of its own, so the pods' processes are found by their POD_MARKER."""
        for pod in running.pods:
            kill_pod(pod, sig)
        for pod in running.pods:
            with contextlib.suppress(subprocess.TimeoutExpired):
                pod.proc.wait(30)

    # --- faults ----------------------------------------------------------------------------------------------

    def wait_job(self, name: str, timeout: float = 120) -> RunningJob:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                found = [j for (_, n), j in self.jobs.items() if n == name]
            if found:
                return found[0]
            time.sleep(0.2)
        raise TimeoutError(f"Job {name!r} was never started")

    def disrupt_pod(self, job: str, index: int = 0, *, reason: str = "EvictionByEvictionAPI") -> str:
        """Evict pod `index` of `job`: kill its processes and mark it Failed with a DisruptionTarget condition.

        Unlike the real Job controller (whose podFailurePolicy `Ignore` rule would start a replacement pod), no
        replacement is started: the backend deletes the Job of a disrupted attempt and relaunches it."""
        core, _ = self.emulator._kubelet()
        running = self.wait_job(job)
        with self._lock:
            pod = running.pods[index]
            pod.disrupted = True
            kill_pod(pod)
            code = pod.proc.wait(30)
            condition = {"type": "DisruptionTarget", "status": "True", "reason": reason,
                         "message": "Eviction API: evicting", "lastTransitionTime": _now()}  # fmt: skip
            self._report(core, running, pod, code, conditions=[condition])
        return pod.name

    def running(self, names: list[str]) -> list[RunningJob]:
        """The workloads of these names that run now (started, not finished, not deleted), in the order named."""
        with self._lock:  # the controller's thread adds workloads as they are created
            found = {n: j for (_, n), j in self.jobs.items() if n in names and not j.finished and not j.deleted}
        return [found[n] for n in names if n in found]

    def delete_pod(self, job: str, index: int = 0) -> str:
        """`kubectl delete pod` on pod `index` of `job`, through the API as a user would (not the kubelet's client):
        the next tick terminates it gracefully (`_terminate_deleted_pods`). Its name."""
        running = self.wait_job(job)
        pod = running.pods[index]
        from kubernetes import client

        client.CoreV1Api(self.emulator.api_client("kubectl")).delete_namespaced_pod(pod.name, running.namespace)
        return pod.name

    def lose_node(self, node: str) -> list[str]:
        """The node vanishes: its Node object is deleted and the processes of the pods on it killed; their pod
        objects stay as they were (Running), as no kubelet is left to update them. The names of those pods."""
        core, _ = self.emulator._kubelet()
        core.delete_node(node)
        with self._lock:
            pods = [p for j in self.jobs.values() for p in j.pods if p.node == node and not p.lost]
            for pod in pods:
                pod.lost = True
                kill_pod(pod)
        return [pod.name for pod in pods]

    def crash_worker(self, job: str, index: int = 0) -> int:
        """kill -9 one trainer worker (a child of torchrun) of pod `index` of `job`; its pid."""
        running = self.wait_job(job)
        pod = running.pods[index]
        for pid in pod_pids(pod.name):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if pid != pod.proc.pid and b"cona.trainer" in cmdline and b"torch.distributed.run" not in cmdline:
                os.kill(pid, signal.SIGKILL)
                return pid
        raise LookupError(f"no trainer worker in pod {index} of Job {job!r}")

    def logs(self) -> str:
        parts = [f"controller error: {e}" for e in self.errors[-5:]]
        with self._lock:
            for running in self.jobs.values():
                for pod in running.pods:
                    text = pod.log.read_text(errors="replace") if pod.log.exists() else ""
                    parts.append(f"--- pod {pod.name} (exit {pod.proc.returncode})\n{text[-2500:]}")
        return "\n".join(parts)


@contextlib.contextmanager
def running_emulator() -> Iterator[Emulator]:
    emulator = Emulator().start()
    try:
        yield emulator
    finally:
        emulator.stop()
