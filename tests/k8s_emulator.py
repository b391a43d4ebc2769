"""The Kubernetes API emulator (kmock) for the backend tests, behind the `k8s` fixture in conftest.py.

kmock serves an in-memory Kubernetes API over HTTP; it runs here in a thread with its own event loop, and the
official (synchronous) client talks to it. It has no controllers: nothing creates a Job's pods or fills in its
status, so `Emulator` plays the Job controller and the kubelet (`make_pods`, `set_job_status`) through a client of
its own, whose requests carry a different User-Agent and so are left out of `backend_requests`.

Known limits of the emulator: label and field selectors are ignored (the backend filters pods itself), no
uid/resourceVersion/status is filled in, PUT and deletecollection answer 404, watches never end on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

BACKEND_AGENT = "cona-backend-under-test"
KUBELET_AGENT = "cona-test-kubelet"


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

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as e:  # reported by start()/stop()
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        import kmock

        async with kmock.KubernetesEmulator(strict=False) as k, kmock.Server(k) as srv:
            k.resources.load_bundled()
            self.kmock, self.url = k, str(srv.url).rstrip("/")
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()

    def start(self) -> Emulator:
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"the Kubernetes emulator did not start: {self._error!r}")
        return self

    def stop(self) -> None:
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

    def backend_requests(self) -> list[tuple[str, str]]:
        """(method, path) of every request the backend's clients made, in order."""
        return [
            (str(r.method.value if hasattr(r.method, "value") else r.method).upper(), r.url.path)
            for r in list(self.kmock._requests)
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
        _, batch = self._kubelet()
        batch.patch_namespaced_job(name, namespace, {"status": {"conditions": conditions, **status}})

    def make_pods(
        self, job_name: str, namespace: str, *, phase: str = "Running", exit_codes: list[int] | None = None,
        conditions: list[dict[str, Any]] | None = None, container_waiting: dict[str, str] | None = None,
    ) -> list[str]:  # fmt: skip
        """Create the Job's pods (one per completion index, from its template) with the given status, as the Job
        controller and the kubelet would. `exit_codes[i]`: pod i's trainer container terminated with that code."""
        from kubernetes import client

        core, batch = self._kubelet()
        job = batch.read_namespaced_job(job_name, namespace)
        template = job.spec.template
        names = []
        for index in range(job.spec.completions or 1):
            labels = {**(template.metadata.labels or {}), "batch.kubernetes.io/job-name": job_name,
                      "job-name": job_name, "batch.kubernetes.io/job-completion-index": str(index)}  # fmt: skip
            container = template.spec.containers[0]
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
                "spec": client.ApiClient().sanitize_for_serialization(template.spec),
                "status": {
                    "phase": phase,
                    "conditions": list(conditions or []),
                    "containerStatuses": [
                        {
                            "name": container.name,
                            "image": container.image,
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


@contextlib.contextmanager
def running_emulator() -> Iterator[Emulator]:
    emulator = Emulator().start()
    try:
        yield emulator
    finally:
        emulator.stop()
