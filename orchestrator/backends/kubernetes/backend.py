"""The Kubernetes backend: one workload per attempt, of the profile's `kubernetes.workload` kind (`render.py`
renders it): a headless Service and an Indexed Job, a JobSet, or a Kubeflow Trainer TrainJob.

`launch` writes the attempt's launch record on the PVC (the trainer reads its strategy there), then creates the
objects. `poll` reads the workload's conditions and its pods (container exit codes, scheduling messages, waiting
reasons, disruption conditions) and, when pods are missing, the Warning events of the Jobs that create them
(`events.py`: a `FailedCreate` says why the API server refuses them) and, first of all, the trainer's own exit record: torchrun exits 1 whatever
protocol code a worker returned, so `attempts/<n>/exit.json` is where SWITCH/STOPPED/BAD_WORLD are read, as on the
other backends. A disrupted pod ends the attempt as DISRUPTED (not a failure); a Pending pod is reported with its
reason, and whether waiting can help (`Outcome.stuck`), to the scheduler, which applies
`kubernetes.pending_timeout_s`. `cancel` deletes the workload (foreground: its Jobs and pods go first) and the
Service. What differs per kind (API, condition types, the trainer container's name, the pods' label) is in
`workloads.py`.

Every API call is one the Role in `manifests/rbac.yaml` grants: create/get/delete on jobs, jobsets or trainjobs,
create/delete on services (Indexed Jobs only), list on pods, list on events (without it, 403: said once, and a pod
that cannot be created shows only as missing); an elastic run also lists Nodes, which the optional
ClusterRole of `manifests/elastic/nodes.yaml` grants (without it, 403: the backend does without), and the
namespace's ResourceQuotas, to grow only into pods they admit (list on `resourcequotas`; without it, 403: said once,
the quotas are not counted). An API error becomes a one-line `BackendError` naming
the object and what to do.

The `kubernetes` client is imported inside the methods, so loading a profile (which embeds `spec.py`) stays light,
and the API configuration is loaded on the first API call, so `cona render kubernetes` needs no cluster. It comes
from the in-cluster service account, else the kubeconfig (`KUBECONFIG`, else `~/.kube/config`). Tested against the
Kubernetes API emulator: the backend alone (`tests/test_k8s_backend.py`) and whole `cona run`s whose pods the
emulator runs as local processes (`tests/test_k8s_e2e.py`); not yet on a real cluster.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cona.orchestrator.backends.base import Attempt, AttemptStatus, Backend, BackendError, Outcome
from cona.orchestrator.backends.kubernetes.api import (
    FORBIDDEN,
    REQUEST_TIMEOUT_S,
    KubeApi,
    api_message,
    one_line,
)
from cona.orchestrator.backends.kubernetes.events import Blocked, creation_blocked, trainer_fields
from cona.orchestrator.backends.kubernetes.incluster import orchestrator_owner
from cona.orchestrator.backends.kubernetes.quotas import pod_charges, quota_room
from cona.orchestrator.backends.kubernetes.render import render_attempt, render_text, trainer_resources
from cona.orchestrator.backends.kubernetes.workloads import (
    WorkloadApi,
    WorkloadKind,
    completion_index,
    kind_of,
    true_condition,
)
from cona.orchestrator.elastic import is_elastic, node_range, nodes_of, table_choice
from cona.protocol.feasibility import placement
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

if TYPE_CHECKING:
    from cona.orchestrator.job import Job
    from cona.orchestrator.profile import ClusterProfile
    from cona.protocol.rundir import RunDir

LOG_TAIL_LINES = 500
"""Lines of each pod's log kept in the attempt's directory when the attempt ends."""
RELEASE_WAIT_S = 120.0
"""How long the end of an attempt waits for its pods to be gone (their GPUs free) before the next is created."""
IMAGE_WAITING_REASONS = frozenset({
    "ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "ImageInspectError",
    "RegistryUnavailable", "SignatureValidationFailed",
})  # fmt: skip
"""The kubelet's waiting reasons of a container whose image cannot be pulled or used."""
NODE_LIST_EVERY_S = 5.0
"""Elastic runs: how often `poll` lists the cluster's Nodes (one cluster-wide call) to see lost ones."""
QUOTA_LIST_EVERY_S = 5.0
"""Elastic runs: how often `available_nodes` lists the namespace's ResourceQuotas at most (a decision interval
shorter than this, as in a small run, reads the last listing)."""
EVENTS_AFTER_S = 10.0
"""How long after its launch an attempt's missing pods are only the Job controller not having made them yet: its
Jobs' events are not read before (an API call per poll that could say nothing)."""
EVENTS_EVERY_S = 5.0
"""How often `poll` lists the events of an attempt whose pods are missing."""
STUCK_WAITING_REASONS = IMAGE_WAITING_REASONS | {
    "CreateContainerConfigError", "CreateContainerError", "PreCreateHookError", "PreStartHookError",
}  # fmt: skip
"""Waiting reasons that waiting does not fix (a bad image, a missing Secret or ConfigMap key, a container the
runtime refuses): past `kubernetes.pending_timeout_s` the scheduler ends such an attempt (`Outcome.stuck`). Anything
else, above all an unschedulable pod (`0/4 nodes are available: 4 Insufficient nvidia.com/gpu`), is capacity the
cluster's queue may still give."""


def waiting_reason(pod: Any) -> tuple[str, bool] | None:
    """Why a pod waits (the scheduler's message, or its container's waiting reason), and whether it is stuck:
    waiting for something that waiting does not bring (`STUCK_WAITING_REASONS`); None when nothing says."""
    status = pod.status
    for condition in (status.conditions or []) if status else []:
        if condition.type == "PodScheduled" and condition.status == "False":
            return one_line(condition.message or condition.reason or "unschedulable"), False
    for container in (status.container_statuses or []) if status else []:
        waiting = container.state.waiting if container.state else None
        if waiting is not None and waiting.reason:
            why = one_line(f"{waiting.reason}: {waiting.message or ''}".rstrip(": "))
            if waiting.reason in IMAGE_WAITING_REASONS:
                return f"image {container.image} cannot be pulled ({why})", True
            return why, waiting.reason in STUCK_WAITING_REASONS
    return None


def _pod_condition(pod: Any, kind: str) -> Any | None:
    """The pod's condition of type `kind` whose status is True, or None."""
    for item in (pod.status.conditions if pod.status else None) or []:
        if item.type == kind and item.status == "True":
            return item
    return None


def _quantity(value: Any) -> float:
    """A Kubernetes quantity of a countable resource (`4`, `4000m`) as a number; 0 when it is not one."""
    text = str(value or "0").strip()
    try:
        return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        return 0.0


def node_usable(node: Any, *, selector: dict[str, str], resource: str, per_pod: int) -> bool:
    """Whether a trainer pod of the run could be scheduled on `node` (as far as the Node object says): its Ready
    condition is True, it is not cordoned (`spec.unschedulable`), its labels match the profile's `node_selector`
    and it has at least `per_pod` of `resource` allocatable. What other workloads use of it is not counted: a pod
    that then stays Pending ends the attempt after `kubernetes.elastic_pending_timeout_s`, as a lost node."""
    status, spec, meta = node.status, node.spec, node.metadata
    ready = any(c.type == "Ready" and c.status == "True" for c in (status.conditions or [])) if status else False
    if not ready or (spec is not None and spec.unschedulable):
        return False
    labels = (meta.labels or {}) if meta else {}
    if any(labels.get(k) != v for k, v in selector.items()):
        return False
    allocatable = (status.allocatable or {}) if status else {}
    return _quantity(allocatable.get(resource)) >= per_pod


def missing_indices(pods: list[Any], expected: int) -> list[int]:
    """The completion indices of the `expected` pods of an Indexed Job (every kind's Jobs are) that no pod of
    `pods` has: the pods not created. A pod without an index (no Job controller's) still counts: then only as many
    indices as pods are missing are given, the lowest."""
    known = {completion_index(pod) for pod in pods}
    missing = [index for index in range(expected) if index not in known]
    return missing if None not in known else missing[: max(expected - len(pods), 0)]


@dataclasses.dataclass(frozen=True)
class NodeState:
    """What an elastic run needs to know of one Node."""

    ready: bool
    """Its Ready condition is True: the kubelet reports, the pods on it run."""
    usable: bool
    """A trainer pod of the run could be scheduled there (`node_usable`)."""


class KubernetesBackend(Backend):
    """Runs each attempt as a workload with one pod per node: an Indexed Job plus the headless Service of its
    rendezvous, a JobSet, or a TrainJob (`kubernetes.workload`).

    A pod disrupted by the cluster (eviction, preemption, node drain: a `DisruptionTarget` condition) ends the
    attempt as DISRUPTED, naming the pod, its node and the reason, unless the trainer recorded an exit; the
    scheduler relaunches it from the last complete checkpoint without counting a failure, and `poll` first deletes
    the Job of such an attempt if it is still active, so its other pods free their GPUs before the next attempt
    is created.

    Elastic runs (`min_nodes` < `nodes`): `launch` starts the planning table's strategy for the number of nodes a
    trainer pod could be scheduled on now (Ready, not cordoned, matching `node_selector`, with the GPUs
    allocatable: `node_usable`), and `poll` reports it (`Outcome.strategy`); a pod whose node is gone or NotReady,
    or that stays Pending past `kubernetes.elastic_pending_timeout_s`, or that is not created as long because a
    ResourceQuota admits fewer of the attempt's pods (`Blocked.fewer_fit`), ends the attempt with
    `Outcome.lost_nodes`, so the scheduler replans for the pods that can run; `available_nodes` counts the usable
    nodes, so the run grows back when the policy says it pays. Nodes are cluster-scoped: reading them takes the ClusterRole of
    `manifests/elastic/nodes.yaml`; without it only the pending timeout shrinks a run, and it never grows.
    """

    name = "kubernetes"
    # Each poll is two API calls (the workload, its pods): once a second is plenty against minutes-long attempts.
    poll_interval_s = 1.0
    # A new Job per attempt: pods are scheduled, the (cached) image started, torchrun meets at the rendezvous.
    relaunch_overhead_s = 60.0

    def __init__(
        self, *, run_dir: RunDir, profile: ClusterProfile | None = None, job: Job | None = None,
        api_client: Any | None = None,
    ) -> None:  # fmt: skip
        super().__init__(run_dir=run_dir, profile=profile, job=job)
        if profile is None or profile.kubernetes is None:
            name = profile.name if profile is not None else "(none)"
            raise ConfigError(f"profile {name!r} has no kubernetes: section; the kubernetes backend needs one")
        self.spec = profile.kubernetes
        self.namespace = self.spec.namespace
        self.api = KubeApi(self.namespace, api_client)
        self._pending_since: dict[str, float] = {}
        """Elastic runs: since when (monotonic) each pod of the attempt polled has been seen Pending, unscheduled, or
        not created for a ResourceQuota (keyed `pod <index> of Job <name>`)."""
        self._node_cache: tuple[float, dict[str, NodeState] | None] | None = None
        """(when, what) `nodes()` last listed: polls list Nodes at most every `NODE_LIST_EVERY_S`."""
        self._events_cache: tuple[str, float, Blocked | None] | None = None
        """(workload, when, what) `_creation_blocked` last read: at most every `EVENTS_EVERY_S`."""
        self._events_readable = True
        """False once listing events was refused (403): said once, not asked again by this orchestrator."""
        self._quota_cache: tuple[float, list[Any]] | None = None
        """(when, quotas) `_quota_room` last listed: at most every `QUOTA_LIST_EVERY_S` unless asked afresh."""
        self._quotas_readable = True
        """False once listing resourcequotas was refused (403): said once, not asked again by this orchestrator."""
        self._said: set[tuple[int, str]] | None = None
        """(attempt, line) of each refusal of pods already logged and printed; read from events.jsonl when first
        needed, so that an orchestrator that restarted does not log again what its predecessor did."""
        self._warned: set[str] = set()
        """Warnings already printed: each once per orchestrator."""

    @property
    def pending_timeout_s(self) -> float:
        return self.spec.pending_timeout_s

    def resume_hint(self, detail: str) -> str:
        import os

        from cona.orchestrator.backends.kubernetes.runobjects import OWNER_JOB_ENV

        image = " --profile-set kubernetes.image=IMAGE" if "cannot be pulled" in detail else ""
        if os.environ.get(OWNER_JOB_ENV):  # a submitted run's orchestrator pod: its run is named as its directory
            return f"`cona submit --resume {self.run_dir.root.name} --namespace {self.namespace}{image}`"
        return f"`cona run --resume {self.run_dir.root}{image}`"

    @property
    def elastic(self) -> bool:
        """Whether the run may train on fewer nodes than the profile's `nodes` (`min_nodes` below it)."""
        return self.profile is not None and is_elastic(self.profile)

    def nodes(self, *, fresh: bool = True) -> dict[str, NodeState] | None:
        """{name: state} of the cluster's Nodes; None when the backend cannot tell: Nodes are cluster-scoped and
        listing them is refused without `manifests/elastic/nodes.yaml` (403), or the API lists none (an API
        server without nodes is not a cluster that lost them all). `fresh=False`: a listing up to
        `NODE_LIST_EVERY_S` old will do (polls)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        now = time.monotonic()
        if not fresh and self._node_cache is not None and now - self._node_cache[0] < NODE_LIST_EVERY_S:
            return self._node_cache[1]
        core, _ = self._apis()
        try:
            listed = core.list_node(_request_timeout=REQUEST_TIMEOUT_S)
        except ApiException as e:
            if e.status != 403:
                raise BackendError(f"kubernetes: list nodes failed ({e.status}): {api_message(e)}; check the "
                                   "API server and the kubeconfig") from None  # fmt: skip
            states = None
        except HTTPError as e:
            raise BackendError(f"kubernetes: list nodes failed ({one_line(str(e))}); check that the API server "
                               "answers") from None  # fmt: skip
        else:
            per_pod = self.profile.gpus_per_node if self.profile is not None else 1
            states = {
                node.metadata.name: NodeState(
                    ready=node_usable(node, selector={}, resource=self.spec.gpu_resource, per_pod=0),
                    usable=node_usable(node, selector=self.spec.node_selector, resource=self.spec.gpu_resource,
                                       per_pod=per_pod),
                )
                for node in listed.items
            } or None  # fmt: skip
        self._node_cache = (now, states)
        return states

    def available_nodes(self, attempt: Attempt) -> int | None:
        """The nodes a trainer pod could be scheduled on now (`node_usable`), the attempt's own among them, and no
        more than the pods the namespace's ResourceQuotas admit: the attempt's own (which `used` counts already, and
        which a relaunch frees) and those that fit besides (`_quota_room`)."""
        states = self.nodes()  # asked once per decision interval: a fresh listing
        if states is None:
            return None
        usable = sum(s.usable for s in states.values())
        room = self._quota_room(fresh=False)
        return usable if room is None else min(usable, self._charged_pods(attempt) + room)

    def _start_on(self, table: dict[int, Strategy], planned: Strategy) -> Strategy:
        """The strategy an elastic launch starts: the table's for the most nodes that can run a pod now (the
        smallest node count when fewer: its pods wait for nodes), and no more than the namespace's ResourceQuotas
        admit pods (`_quota_room`); `planned` when the Nodes cannot be read (quotas alone are not asked then: such a
        run never grows, so it cannot grow into a quota either).

        No attempt holds pods here: the previous one was released (`release` waits until its pods are gone). Its
        share of a quota's `used` frees when the quota controller recounts, moments later; the quotas are read as
        they stand, so a launch in that moment starts on fewer pods and the run grows once they show the room (a
        relaunch), where counting the previous pods as freed could have pods refused and wait
        `elastic_pending_timeout_s` before shrinking (a relaunch and a timeout)."""
        states = self.nodes()
        if states is None:
            return planned
        usable = sum(s.usable for s in states.values())
        room = self._quota_room(fresh=True)
        return table_choice(table, usable if room is None else min(usable, room))

    def _charged_pods(self, attempt: Attempt) -> int:
        """The attempt's pods that its namespace's quotas count now: every one that exists and has not ended
        (Running, Pending, unscheduled or not; a Succeeded or Failed pod is no longer counted)."""
        workload = self._workload(self._kind(attempt))
        pods = self._pods(workload, attempt.backend_id)
        return sum(1 for pod in pods if not (pod.status and pod.status.phase in ("Succeeded", "Failed")))

    def _quota_room(self, *, fresh: bool) -> int | None:
        """How many more trainer pods of `gpus_per_node` devices (the pods of every node count an elastic run
        plans) the namespace's ResourceQuotas admit now (`quotas.quota_room`); None when none limits them or they
        cannot be read. `fresh=False`: a listing up to `QUOTA_LIST_EVERY_S` old will do. A refused listing (403: a
        Role without list on resourcequotas) is said once and not asked again; any other failure is said once and
        the quotas are not counted for that call: the run then grows as far as the Nodes go, as it did before."""
        if not self._quotas_readable or self.profile is None:
            return None
        now = time.monotonic()
        cached = self._quota_cache
        if fresh or cached is None or now - cached[0] >= QUOTA_LIST_EVERY_S:
            try:
                listed = self.api.call("list", "resourcequotas", "(all)", self.api.core().list_namespaced_resource_quota,
                                       self.namespace, forbidden_ok=True)  # fmt: skip
            except BackendError as e:
                self._warn(f"{e}; the run's growth is not bounded by the namespace's ResourceQuotas this time")
                return None
            if listed is FORBIDDEN:
                self._quotas_readable = False
                self._forbidden("resourcequotas", "an elastic run may grow into pods a ResourceQuota refuses")
                return None
            cached = self._quota_cache = (now, list(listed.items or []))
        return quota_room(cached[1], pod_charges(trainer_resources(self.spec, self.profile.gpus_per_node)))

    def _lost(
        self, pods: list[Any], strategy: Strategy, *, ended: bool, blocked: Blocked | None = None,
    ) -> tuple[tuple[str, ...], str]:  # fmt: skip
        """The nodes the attempt of `strategy` lost and why, as one line: those of its pods that are gone or
        NotReady, for each pod Pending unscheduled past `elastic_pending_timeout_s`, the pod (`pod <name>`), and,
        when `blocked` (`_creation_blocked`) is a ResourceQuota that admits fewer pods (`Blocked.fewer_fit`), each
        pod not created for as long (`pod <index> of Job <name>`: no pod, no node to name; the scheduler only
        counts the entries). An attempt on `min_nodes` waits for its pods instead: fewer nodes are not to be had.
        `ended`: the workload failed or the trainer recorded a crash; the Nodes are listed afresh then, since a
        lost node's peers crash within seconds and a cached listing would call that a crash of the trainer."""
        assert self.profile is not None
        may_shrink = nodes_of(strategy, self.profile) > node_range(self.profile)[0]
        states = self.nodes(fresh=ended)
        now = time.monotonic()
        lost: list[str] = []
        why: list[str] = []
        seen = set()
        for pod in pods:
            name = pod.metadata.name
            node = pod.spec.node_name if pod.spec else None
            phase = pod.status.phase if pod.status else None
            if node and states is not None and phase not in ("Succeeded",):
                state = states.get(node)
                if (state is None or not state.ready) and node not in lost:
                    lost.append(node)
                    why.append(f"node {node} of pod {name} {'is gone' if state is None else 'is NotReady'}")
                continue
            if node or phase not in (None, "Pending"):
                continue
            reason, stuck = self._pending_reason(pod)
            # An image that cannot be pulled is not a node's fault (`pending_timeout_s` fails the run instead).
            if stuck or not may_shrink:
                continue
            seen.add(name)
            since = self._pending_since.setdefault(name, now)
            if now - since >= self.spec.elastic_pending_timeout_s:
                lost.append(f"pod {name}")
                why.append(f"pod {name} Pending {now - since:.0f}s ({reason})")
        # A pod the quota refuses is capacity the cluster lacks, as an unschedulable pod is: fewer pods fit, so the
        # same clock applies. Other refusals meet every pod alike (`events.explain_refusal`): no shrinking helps.
        if blocked is not None and blocked.fewer_fit and may_shrink:
            late: list[tuple[int, float]] = []
            for index in missing_indices(pods, nodes_of(strategy, self.profile)):
                key = f"pod {index} of {blocked.creator}"
                seen.add(key)
                waited = now - self._pending_since.setdefault(key, now)
                if waited >= self.spec.elastic_pending_timeout_s:
                    lost.append(key)
                    late.append((index, waited))
            if late:
                which = ", ".join(str(index) for index, _ in late)
                why.append(f"pod{'s' if len(late) > 1 else ''} {which} of {blocked.creator} not created for "
                           f"{max(w for _, w in late):.0f}s ({blocked.line})")  # fmt: skip
        self._pending_since = {k: v for k, v in self._pending_since.items() if k in seen}
        return tuple(lost), "; ".join(why)

    @property
    def api_client(self) -> Any:
        """The API client given, else the default one, loaded on first use."""
        return self.api.api_client

    # --- API calls -------------------------------------------------------------------------------------------

    def _apis(self) -> tuple[Any, Any]:
        return self.api.core(), self.api.batch()

    def _kind(self, attempt: Attempt | None = None) -> WorkloadKind:
        """The workload kind of `attempt` (as launched), else the profile's (immutable for a run)."""
        workload = (attempt.extra.get("workload") if attempt is not None else None) or self.spec.workload
        return kind_of(str(workload))

    def _workload(self, kind: WorkloadKind) -> WorkloadApi:
        return WorkloadApi(kind, self.api_client, self.namespace, self._call)

    def _call(self, verb: str, resource: str, name: str, fn: Callable[..., Any], *args: Any,
              missing_ok: bool = False, **kwargs: Any) -> Any:  # fmt: skip
        """`fn(*args, **kwargs)`; an API error as one-line BackendError (`KubeApi.call`); a JobSet or TrainJob that
        cannot be created for lack of its CRD says what to install."""
        not_found = None
        if verb == "create" and resource in ("jobsets", "trainjobs"):
            kind = next(k for k in (kind_of("jobset"), kind_of("trainjob")) if k.plural == resource)
            not_found = f"is {kind.api_version} installed ({kind.requires})"
        return self.api.call(verb, resource, name, fn, *args, missing_ok=missing_ok, not_found_hint=not_found, **kwargs)

    # --- the interface ---------------------------------------------------------------------------------------

    def _pod_run_dir(self) -> str:
        """The run directory as the pods see it: the orchestrator's own path, which must lie on the PVC's mount."""
        root = Path(self.run_dir.root)
        return str(root if root.is_absolute() else root.resolve())

    def exclusion(self) -> Any:
        """The run's Lease (`lease.py`): flock on a ReadWriteMany volume is not reliable across nodes."""
        from cona.orchestrator.backends.kubernetes.lease import KubeLease
        from cona.orchestrator.backends.kubernetes.render import dns_name
        from cona.orchestrator.backends.kubernetes.runobjects import run_labels

        name = dns_name(Path(self.run_dir.root).name)
        duration = self.spec.lease_duration_s
        return KubeLease(self.api, name, duration_s=duration, renew_every_s=duration / 3,
                         labels=run_labels(name, "orchestrator"))  # fmt: skip

    def render(self, *, strategy: Strategy) -> str:
        return render_text(profile=self.profile, strategy=strategy, run_dir=self._pod_run_dir(), job=self.job)  # type: ignore[arg-type]

    def launch(
        self, *, attempt: int, strategy: Strategy, previous: Attempt | None = None,
        elastic: dict[int, Strategy] | None = None,
    ) -> Attempt:  # fmt: skip
        planned = strategy
        if elastic and len(elastic) > 1:
            # As many pods as there are nodes to run them, with the table's strategy for that many.
            strategy = self._start_on(elastic, planned)
        self._pending_since = {}
        # Rendered first (pure): a profile value that cannot be rendered leaves no launch record behind.
        objects = render_attempt(profile=self.profile, strategy=strategy, attempt=attempt,  # type: ignore[arg-type]
                                 run_dir=self._pod_run_dir(), job=self.job)  # fmt: skip
        # The scheduler knows the attempt by the strategy it planned; `poll` reports the one it runs.
        chosen = Attempt.started_as(strategy, planned)
        kind = self._kind()
        *services, main = objects  # an Indexed Job comes after its Service; a JobSet or TrainJob alone
        name = main["metadata"]["name"]
        owner = orchestrator_owner()
        if owner is not None:  # deleting the orchestrator Job deletes the workloads too
            for obj in objects:
                obj["metadata"]["ownerReferences"] = [owner]
        core, _ = self._apis()  # loads the API configuration: a missing kubeconfig leaves no record either
        workload = self._workload(kind)
        if kind.workload == "indexed-job":
            (service,) = services
            service_name = service["metadata"]["name"]
            self.write_launch(attempt, strategy, namespace=self.namespace, job_name=name, service=service_name)
            self._call("create", "services", service_name, core.create_namespaced_service, self.namespace, service)
            try:
                workload.create(main)
            except BackendError:
                # Leave nothing behind for an attempt that did not start.
                self._call("delete", "services", service_name, core.delete_namespaced_service, service_name,
                           self.namespace, missing_ok=True)  # fmt: skip
                raise
            return Attempt(number=attempt, strategy=planned, backend_id=name, started_at=time.time(),
                           extra={"namespace": self.namespace, "service": service_name, **chosen})  # fmt: skip
        assert not services, [obj["kind"] for obj in objects]  # JobSet (and TrainJob's JobSet) make their Service
        # `job_name` names the workload whatever its kind (the launch record's field predates the other kinds).
        self.write_launch(attempt, strategy, namespace=self.namespace, job_name=name, workload=kind.workload)
        workload.create(main)
        return Attempt(number=attempt, strategy=planned, backend_id=name, started_at=time.time(),
                       extra={"namespace": self.namespace, "workload": kind.workload, **chosen})  # fmt: skip

    def _pods(self, workload: WorkloadApi, name: str) -> list[Any]:
        core, _ = self._apis()
        pods = self._call("list", "pods", f"of {workload.kind.kind} {name}", core.list_namespaced_pod,
                          self.namespace, label_selector=f"{workload.kind.selector_label}={name}")  # fmt: skip
        # Filtered here as well: a selector the server ignored must not mix in another attempt's pods.
        return [pod for pod in pods.items if workload.owns(pod, name)]

    @staticmethod
    def _exit_codes(pods: list[Any], container: str) -> list[int]:
        """The trainer containers' exit codes of the pods that terminated, by completion index order."""
        codes = []
        for pod in pods:
            for status in (pod.status.container_statuses or []) if pod.status else []:
                terminated = status.state.terminated if status.state else None
                if status.name == container and terminated is not None and terminated.exit_code is not None:
                    codes.append(int(terminated.exit_code))
        return codes

    @staticmethod
    def _pending_reason(pod: Any) -> tuple[str, bool]:
        """Why a Pending pod waits (`waiting_reason`), and whether it is stuck."""
        return waiting_reason(pod) or (f"pod {pod.metadata.name} is pending", False)

    @classmethod
    def _pending(cls, pods: list[Any]) -> tuple[str, bool]:
        """The reason an attempt with Pending pods waits: a stuck pod's first (it is what must be fixed), else the
        first pod's."""
        reasons = [cls._pending_reason(pod) for pod in pods]
        return next((r for r in reasons if r[1]), reasons[0])

    @staticmethod
    def _disruption(pods: list[Any]) -> str | None:
        """The first disrupted pod (a `DisruptionTarget` condition) as one line naming it, its node and the
        cluster's reason, or None."""
        for pod in pods:
            condition = _pod_condition(pod, "DisruptionTarget")
            if condition is None:
                continue
            node = pod.spec.node_name if pod.spec else None
            where = f"pod {pod.metadata.name}" + (f" on node {node}" if node else "")
            why = condition.reason or "DisruptionTarget"
            return one_line(f"{where}: {why}" + (f" ({condition.message})" if condition.message else ""))
        return None

    def _creation_blocked(self, attempt: Attempt, kind: WorkloadKind, pods: list[Any]) -> Blocked | None:
        """Why some of the attempt's pods are not created (`events.creation_blocked`), when it has fewer pods than
        its strategy places and was launched at least `EVENTS_AFTER_S` ago; read at most every `EVENTS_EVERY_S`.
        Each new line is logged once per attempt (event `pods-not-created`, which the run's console prints). A
        refused read (403: a Role without `list` on `events`) is said once and not tried again, any other failed
        read is said once and skipped: the events only explain, so the poll goes on as it would without them."""
        if not self._events_readable or self.profile is None:
            return None
        expected, _ = placement(attempt.running, self.profile.gpus_per_node, self.profile.nodes)
        if len(pods) >= expected or time.time() - attempt.started_at < EVENTS_AFTER_S:
            return None
        now = time.monotonic()
        cached = self._events_cache
        if cached is not None and cached[0] == attempt.backend_id and now - cached[1] < EVENTS_EVERY_S:
            return cached[2]
        try:
            found = creation_blocked(self.api, kind.pod_creators(attempt.backend_id), since=attempt.started_at or None,
                                     fields=trainer_fields(self.spec.gpu_resource), pods=expected)  # fmt: skip
        except BackendError as e:
            self._warn(f"{e}; a pod that cannot be created shows only as missing")
            found = None
        if found is FORBIDDEN:
            self._events_readable = False
            self._forbidden("events", "a pod that cannot be created shows only as missing")
            return None
        assert found is None or isinstance(found, Blocked)
        self._events_cache = (attempt.backend_id, now, found)
        if found is not None and (attempt.number, found.line) not in self._logged_refusals():
            from cona.orchestrator.runstate import log_event

            self._logged_refusals().add((attempt.number, found.line))
            # The run's console (`live.LiveView`) prints it from events.jsonl, as every other event.
            log_event(self.run_dir, "pods-not-created", attempt=attempt.number, stuck=found.stuck, detail=found.line)
        return found

    def _logged_refusals(self) -> set[tuple[int, str]]:
        if self._said is None:
            from cona.orchestrator.runstate import read_events

            self._said = {(record.get("attempt"), record.get("detail")) for record in read_events(self.run_dir)
                          if record.get("event") == "pods-not-created"}  # fmt: skip
        return self._said

    def _forbidden(self, resource: str, meanwhile: str) -> None:
        """Say once that the Role does not let the orchestrator list `resource`, and what goes without it."""
        self._warn(f"kubernetes: list {resource} in namespace {self.namespace!r} refused (403): the Role lacks list "
                   f"on {resource}; apply manifests/rbac.yaml, until then {meanwhile}")  # fmt: skip

    def _warn(self, line: str) -> None:
        if line not in self._warned:
            self._warned.add(line)
            print(f"cona: warning: {line}", file=sys.stderr, flush=True)

    def poll(self, attempt: Attempt) -> Outcome:
        outcome = self.with_crash_cause(attempt, self._poll(attempt))
        if attempt.running != attempt.strategy:
            outcome = dataclasses.replace(outcome, strategy=attempt.running)
        return outcome

    def _poll(self, attempt: Attempt) -> Outcome:
        """Where the attempt stands, from the workload's conditions, its pods and the trainer's exit record.

        Workload gone → the trainer's record if it wrote one, else CRASHED (`the Job is gone`, or JobSet,
        TrainJob). A pod with a `DisruptionTarget` condition → DISRUPTED naming the pod, its node and the reason
        (the workload is deleted first if still active; a pod that failed because its peer went away does not make
        it a crash). Succeeded (Job and TrainJob `Complete`, JobSet `Completed`) → DONE; `Failed` → the protocol
        code of the exit record or of a pod's trainer container (`AttemptStatus.from_exit_code`), else CRASHED with
        the workload's reason. A TrainJob whose trainer wrote its exit record and one of whose pods failed has ended
        too, before its runtime's Job replaces the pod: it is deleted. Otherwise fewer pods than the strategy places
        and a Job's `FailedCreate` event (`_creation_blocked`) → PENDING with that event's line, `stuck` as
        `events.explain_refusal` decides (a Pending pod that is stuck itself is named instead); a Pending pod (or none yet)
        → PENDING with the scheduler's message or the container's waiting reason, `stuck` when waiting cannot help
        (`STUCK_WAITING_REASONS`), else RUNNING. An elastic run's attempt that is not complete and whose trainer
        recorded no protocol exit, one of whose pods lost its node or stays Pending past
        `elastic_pending_timeout_s`, or is not created that long for a ResourceQuota that admits fewer pods
        (`_lost`), reports `lost_nodes` (CRASHED if its workload failed, else as it is).
        """
        kind = self._kind(attempt)
        workload = self._workload(kind)
        name = attempt.backend_id
        recorded = self.run_dir.read_exit(attempt.number)
        conditions = workload.conditions(name)
        if conditions is None:
            if recorded is not None:
                return Outcome.of_exit(recorded.exit_code, who="trainer")
            return Outcome(AttemptStatus.CRASHED, None, f"the {kind.kind} is gone")
        complete, failed = true_condition(conditions, kind.succeeded), true_condition(conditions, kind.failed)
        pods = self._pods(workload, name)
        disrupted = self._disruption(pods)
        # Before the exit record: a peer's loss makes the trainer record a crash, which is the lost node's doing.
        if self.elastic and not complete and (recorded is None or Outcome.of_exit(recorded.exit_code, who="").status is AttemptStatus.CRASHED):
            # Read only when pods are missing (and cached): the later pending reason reads the same.
            blocked = self._creation_blocked(attempt, kind, pods)
            lost, why = self._lost(pods, attempt.running, ended=bool(failed) or recorded is not None, blocked=blocked)
            if lost:
                status = AttemptStatus.CRASHED if failed or recorded is not None else AttemptStatus.RUNNING
                return Outcome(status, recorded.exit_code if recorded else None, why, lost_nodes=lost)
        if recorded is not None and (complete or failed or disrupted):
            return Outcome.of_exit(recorded.exit_code, who="trainer")
        if recorded is not None and kind.retries_pods and any(pod.status and pod.status.phase == "Failed" for pod in pods):
            self.cancel(attempt)
            return Outcome.of_exit(recorded.exit_code, who="trainer")
        if disrupted is not None:
            if not (complete or failed):
                self.cancel(attempt)
            return Outcome(AttemptStatus.DISRUPTED, None, disrupted)
        if complete:
            return Outcome(AttemptStatus.DONE, 0)
        if failed:
            codes = self._exit_codes(pods, kind.container)
            nonzero = [c for c in codes if c != 0]
            protocol = [c for c in nonzero if AttemptStatus.from_exit_code(c) is not AttemptStatus.CRASHED]
            code = protocol[0] if protocol else (nonzero[0] if nonzero else None)
            status = AttemptStatus.from_exit_code(code)
            if status is not AttemptStatus.CRASHED:
                return Outcome(status, code)
            why = one_line(f"{failed.reason or 'Failed'}: {failed.message or ''}".rstrip(": "))
            shown = f"exit code {code}" if code is not None else "no exit code"
            return Outcome(AttemptStatus.CRASHED, code, f"the {kind.kind} failed ({why}); trainer {shown}")
        pending = [pod for pod in pods if pod.status is None or pod.status.phase in (None, "Pending")]
        blocked = self._creation_blocked(attempt, kind, pods)
        if blocked is not None:
            # The pods that are not created are what must be fixed, unless a pod that exists waits for what waiting
            # does not bring either (its image): that one is named, as `_pending` names a stuck pod first.
            detail, stuck = self._pending(pending) if pending else ("", False)
            if not stuck:
                detail, stuck = blocked.line, blocked.stuck
            return Outcome(AttemptStatus.PENDING, None, detail, stuck=stuck)
        if pending:
            detail, stuck = self._pending(pending)
            return Outcome(AttemptStatus.PENDING, None, detail, stuck=stuck)
        if not pods:
            return Outcome(AttemptStatus.PENDING, None, "no pods yet")
        return Outcome(AttemptStatus.RUNNING)

    def _save_logs(self, attempt: Attempt) -> None:
        """Save the last `LOG_TAIL_LINES` of each of the attempt's pods' trainer container into the attempt's
        directory (`pod-<name>.log`): the pods' output lives nowhere else, and goes with them."""
        kind = self._kind(attempt)
        pods = self._pods(self._workload(kind), attempt.backend_id)
        core, _ = self._apis()
        directory = self.run_dir.attempt_dir(attempt.number)
        for pod in pods:
            log = self._call("get", "pods/log", pod.metadata.name, core.read_namespaced_pod_log, pod.metadata.name,
                             self.namespace, container=kind.container, tail_lines=LOG_TAIL_LINES, missing_ok=True)  # fmt: skip
            if isinstance(log, str) and log:
                (directory / f"pod-{pod.metadata.name}.log").write_text(log)

    def crash_logs(self, attempt: Attempt) -> list[Path]:
        """The pods' logs, saved now (`_save_logs`, as `release` saves them after the crash line is said), each
        ending with its pod's torchrun summary when a worker failed. A log that cannot be read goes without: it
        only explains the crash."""
        try:
            self._save_logs(attempt)
        except (BackendError, OSError) as e:
            self._warn(f"{e}; the crash line goes without the pods' logs")
        return sorted(self.run_dir.attempt_dir(attempt.number).glob("pod-*.log"))

    def gone(self, attempt: Attempt) -> bool:
        """Whether the attempt's trainer has ended, told by read-only GETs: its workload is gone, or finished (its
        success or failure condition), or every pod of it has ended (Succeeded or Failed: the Job controller adds
        the condition moments later) and none is to be replaced — not a disrupted pod, which the Job replaces
        without counting a failure, nor any pod of a kind whose Jobs retry failed pods (`retries_pods`). False
        while a pod runs or may come, and whenever the API server cannot be reached or refuses."""
        if not attempt.backend_id:
            return False
        try:
            kind = self._kind(attempt)
            workload = self._workload(kind)
            conditions = workload.conditions(attempt.backend_id)
            if conditions is None:
                return True
            if true_condition(conditions, kind.succeeded) or true_condition(conditions, kind.failed):
                return True
            pods = [] if kind.retries_pods else self._pods(workload, attempt.backend_id)
        except (BackendError, ValueError):  # no API server, no credentials, a kind this version does not know
            return False
        ended = all(pod.status is not None and pod.status.phase in ("Succeeded", "Failed") for pod in pods)
        return bool(pods) and ended and self._disruption(pods) is None

    def release(self, attempt: Attempt) -> None:
        """Save each pod's log tail into the attempt's directory (`_save_logs`), delete the workload and wait up to
        `RELEASE_WAIT_S` until it is gone."""
        kind = self._kind(attempt)
        workload = self._workload(kind)
        name = attempt.backend_id
        self._save_logs(attempt)
        self.cancel(attempt)
        # Foreground deletion keeps the workload until its pods are deleted: once it is gone, so are they.
        deadline = time.monotonic() + RELEASE_WAIT_S
        while workload.conditions(name) is not None and time.monotonic() < deadline:
            time.sleep(1.0)

    def cancel(self, attempt: Attempt) -> None:
        """Delete the attempt's workload (foreground: its Jobs and pods first) and, for an Indexed Job, its Service
        (a JobSet's belongs to the JobSet and goes with it); a missing one is fine."""
        core, _ = self._apis()
        kind = self._kind(attempt)
        name = attempt.backend_id
        self._workload(kind).delete(name)
        if kind.workload == "indexed-job":
            service = str(attempt.extra.get("service") or name)  # render.py gives both the same name
            self._call("delete", "services", service, core.delete_namespaced_service, service, self.namespace,
                       missing_ok=True)  # fmt: skip
