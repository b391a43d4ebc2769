"""One orchestrator per run on Kubernetes: a `coordination.k8s.io/v1` Lease named after the run.

The local and Slurm backends keep a second orchestrator out with `flock` on the run directory; on a ReadWriteMany
volume (NFS, CephFS, Lustre) `flock` is not reliable across nodes, and an orchestrator pod on a partitioned node
may live on while Kubernetes starts another. So on Kubernetes the orchestrator holds a Lease and renews it every
few seconds from a background thread:

- **acquire**: take the Lease if it does not exist, is released (no holder), is ours, or has not been renewed for
  a whole lease duration. Expiry is judged the way client-go's leader election judges it: by how long *this*
  process has seen the record unchanged (clock skew between nodes does not matter), or at once when its renew time
  is older than twice the duration by the wall clock. A Lease renewed by someone else all along is one line of
  error after `wait_s`.
- **renew**: every `renew_every_s`; the update carries the resourceVersion read, so two takers cannot both win on a
  real API server (409 → read again).
- **lost**: if another holder shows up, or no renewal succeeded for a whole duration, `check()` raises `LeaseLost`
  and the orchestrator stops touching the run (its pod exits non-zero; Kubernetes restarts it, and the restarted
  process waits for the Lease like any other).
- **release**: on a clean exit the holder is cleared, so a next orchestrator takes the Lease at once.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import socket
import threading
import time
from typing import Any

from cona.orchestrator.backends.base import BackendError
from cona.orchestrator.backends.kubernetes.api import KubeApi


class LeaseLost(BackendError):
    """This orchestrator no longer holds the run's Lease; it must stop acting on the run."""


def _micro_time(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _epoch(value: Any) -> float | None:
    """A Lease's MicroTime (datetime from the client, or a string) as seconds since the epoch."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.UTC)
        return value.timestamp()
    return None


def default_identity() -> str:
    """Pod name (or host), pid and a random part: a container restarted in the same pod (pid 1 again) differs."""
    where = os.environ.get("POD_NAME") or socket.gethostname()
    return f"{where}/{os.getpid()}/{secrets.token_hex(3)}"


class KubeLease:
    """The run's Lease, held from `acquire()` to `release()`; a context manager like `RunLock`."""

    def __init__(
        self,
        api: KubeApi,
        name: str,
        *,
        identity: str | None = None,
        duration_s: int = 15,
        renew_every_s: float = 5.0,
        wait_s: float | None = None,
        labels: dict[str, str] | None = None,
    ) -> None:
        self.api = api
        self.name = name
        self.identity = identity or default_identity()
        self.duration_s = int(duration_s)
        self.renew_every_s = renew_every_s
        self.wait_s = wait_s if wait_s is not None else 2 * self.duration_s + 5
        self.labels = labels or {}
        self._lost: str | None = None
        self._last_renewed = 0.0
        self._resource_version: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- API -------------------------------------------------------------------------------------------------

    def _read(self) -> Any | None:
        api = self.api.coordination()
        return self.api.call("get", "leases", self.name, api.read_namespaced_lease, self.name, self.api.namespace,
                             missing_ok=True)  # fmt: skip

    def _create(self) -> bool:
        now = _micro_time(time.time())
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": self.name, "namespace": self.api.namespace, "labels": self.labels},
            "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": self.duration_s, "acquireTime": now,
                     "renewTime": now, "leaseTransitions": 0},
        }  # fmt: skip
        api = self.api.coordination()
        created = self.api.call("create", "leases", self.name, api.create_namespaced_lease, self.api.namespace, body,
                                conflict_ok=True)  # fmt: skip
        if created is None:
            return False
        self._resource_version = created.metadata.resource_version if created.metadata else None
        return True

    def _write(self, spec: dict[str, Any], resource_version: str | None) -> bool:
        """Patch the Lease's spec, conditional on `resource_version` where the server gives one; False on 409."""
        body: dict[str, Any] = {"spec": spec}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        api = self.api.coordination()
        patched = self.api.call("patch", "leases", self.name, api.patch_namespaced_lease, self.name,
                                self.api.namespace, body, conflict_ok=True)  # fmt: skip
        if patched is None:
            return False
        self._resource_version = patched.metadata.resource_version if patched.metadata else None
        return True

    # --- acquire, renew, release -----------------------------------------------------------------------------

    def acquire(self) -> None:
        deadline = time.monotonic() + self.wait_s
        observed: tuple[Any, ...] | None = None
        observed_at = time.monotonic()
        while True:
            lease = self._read()
            if lease is None:
                if self._create():
                    break
                continue  # someone else created it in between: read it
            spec = lease.spec
            holder = spec.holder_identity if spec else None
            renewed = _epoch(spec.renew_time) if spec else None
            duration = (spec.lease_duration_seconds if spec else None) or self.duration_s
            record = (holder, renewed, lease.metadata.resource_version if lease.metadata else None)
            if record != observed:
                observed, observed_at = record, time.monotonic()
            unchanged_for = time.monotonic() - observed_at
            stale = renewed is None or time.time() - renewed > 2 * duration
            if not holder or holder == self.identity or stale or unchanged_for > duration:
                transitions = (spec.lease_transitions or 0) if spec else 0
                now = _micro_time(time.time())
                taken = {"holderIdentity": self.identity, "leaseDurationSeconds": self.duration_s,
                         "acquireTime": now, "renewTime": now,
                         "leaseTransitions": transitions + (1 if holder and holder != self.identity else 0)}  # fmt: skip
                if self._write(taken, record[2]):
                    break
                continue
            if time.monotonic() > deadline:
                ago = f"{time.time() - renewed:.0f} s ago" if renewed else "recently"
                raise BackendError(
                    f"kubernetes: Lease {self.name!r} in namespace {self.api.namespace!r} is held by another "
                    f"orchestrator ({holder}, renewed {ago}); only one may drive a run: stop it first, or watch the "
                    "run with `cona status`"
                )
            time.sleep(min(1.0, max(0.1, self.renew_every_s / 5)))
        self._last_renewed = time.monotonic()
        self._lost = None
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name=f"lease-{self.name}", daemon=True)
        self._thread.start()

    def _renew_once(self) -> None:
        lease = self._read()
        holder = lease.spec.holder_identity if lease is not None and lease.spec else None
        if lease is None or holder != self.identity:
            self._lost = f"taken by {holder}" if holder else "deleted or released by someone else"
            return
        version = lease.metadata.resource_version if lease.metadata else None
        if self._write({"renewTime": _micro_time(time.time())}, version):
            self._last_renewed = time.monotonic()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            # An unreachable API server is not fatal yet: the duration below decides when it is.
            with contextlib.suppress(BackendError):
                self._renew_once()
            if self._lost is None and time.monotonic() - self._last_renewed > self.duration_s:
                self._lost = f"not renewed for {self.duration_s} s (the API server could not be reached)"
            if self._lost is not None:
                return

    @property
    def held(self) -> bool:
        return self._thread is not None and self._lost is None

    def check(self) -> None:
        """Raise `LeaseLost` once the Lease is no longer ours (called from the orchestrator's loop)."""
        if self._lost is not None:
            raise LeaseLost(
                f"kubernetes: this orchestrator lost Lease {self.name!r} in namespace {self.api.namespace!r} "
                f"({self._lost}); it stops so that only one orchestrator drives the run"
            )

    def release(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(self.renew_every_s + 35)
        self._thread = None
        if self._lost is not None:
            return
        try:
            lease = self._read()
            if lease is not None and lease.spec and lease.spec.holder_identity == self.identity:
                version = lease.metadata.resource_version if lease.metadata else None
                # A merge patch with null removes the holder: the next orchestrator takes the Lease at once.
                self._write({"holderIdentity": None, "renewTime": _micro_time(time.time())}, version)
        except BackendError:
            pass  # it expires by itself after duration_s

    def __enter__(self) -> KubeLease:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
