"""Why a workload's pods are not created: the Warning events of the Jobs that create them.

When the API server refuses a Job's pods (a PriorityClass or ServiceAccount that does not exist, a namespace's
ResourceQuota used up or too small for one pod, a Pod Security level the pods violate, an admission webhook's
denial), no pod exists to carry a condition: only the Job controller's Warning event `FailedCreate` on the Job says
why (`Error creating: pods "exp1-a1-0-" is forbidden: no PriorityClass with name high was found`). The backend
(an attempt with fewer pods than it should have) and `cona status` (an orchestrator Job without its pod) read those
events here: `creation_blocked` finds the newest one, `explain_refusal` turns its message into one line naming the
field to fix and says whether waiting can help and whether fewer pods would fit — the one place that decides both;
the scheduler's pending timeout then treats it as it treats a pod's waiting reason (`Outcome.stuck`), and an
elastic run shrinks for pods that a ResourceQuota admits only some of (`Blocked.fewer_fit`), as for unschedulable
ones (and `quotas.py` keeps it from growing back into pods the quota would refuse again).

Reading events takes `list` on `events` (core/v1), which the Roles of `manifests/rbac.yaml` grant; without it
(403) the callers say what they said before: that there is no pod yet.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
from collections.abc import Sequence
from typing import Any

from cona.orchestrator.backends.kubernetes.api import FORBIDDEN, KubeApi, one_line
from cona.orchestrator.backends.kubernetes.render import quantity_value

FAILED_CREATE = "FailedCreate"
BLOCKING_REASONS = frozenset({FAILED_CREATE})
"""Warning reasons, on an object that creates pods, meaning that its pods are not being created: the Job
controller's `FailedCreate` (JobSet's and Trainer's Jobs are Jobs too). Nothing else blocks creation: a pod that
exists carries the scheduler's `FailedScheduling` as its `PodScheduled` condition, which `waiting_reason` reads."""
CLOCK_SKEW_S = 60.0
"""Events last seen this long before the attempt started still count (the controller's clock is not the
orchestrator's); older ones are another object's of the same name (a run submitted again under its old name)."""

_PREFIX = re.compile(r'^(Error creating: )?(pods "[^"]*" is forbidden: )?')
_PRIORITY = re.compile(r"no PriorityClass with name (\S+) was found")
_ACCOUNT = re.compile(r'error looking up service account [^/\s]+/(\S+?): serviceaccount "[^"]*" not found')
_EXCEEDED = re.compile(r"exceeded quota: ([^,]+), requested: (\S+), used: (\S+), limited: (\S+)", re.IGNORECASE)
_MUST_SPECIFY = re.compile(r"failed quota: ([^:]+): must specify (.+)")
_POD_SECURITY = re.compile(r'violates PodSecurity "([^"]+)": (.+)')
_TRANSIENT = ("internal error", "timeout", "timed out", "try again", "too many requests", "currently unable",
              "connection refused", "failed calling webhook")  # fmt: skip
"""Words of a refusal that may pass by itself (the API server or a webhook failing for a while), not a decision."""


@dataclasses.dataclass(frozen=True)
class PodFields:
    """The profile fields that set what a pod asks of a ResourceQuota, to name in the line of a refusal: by the
    quota's resource name (`requests.cpu`, `limits.memory`, `requests.nvidia.com/gpu`; a bare `cpu` or `memory` is
    the request). Only what the field really sets: a CPU limit no field sets (cona renders none) is not named."""

    by_resource: dict[str, str]

    def field_of(self, resource: str) -> str | None:
        return self.by_resource.get(resource)


def trainer_fields(gpu_resource: str) -> PodFields:
    """A trainer pod's: `trainer_cpu` (a request), `trainer_memory` (request and limit), and its GPUs (a limit, which
    is also the request of an extended resource), as many as the strategy places per pod, `gpus_per_node` at most
    (`render.trainer_resources`)."""
    cpu, memory, gpus = "kubernetes.trainer_cpu", "kubernetes.trainer_memory", "gpus_per_node"
    return PodFields({"cpu": cpu, "requests.cpu": cpu, "memory": memory, "requests.memory": memory,
                      "limits.memory": memory, gpu_resource: gpus, f"requests.{gpu_resource}": gpus,
                      f"limits.{gpu_resource}": gpus})  # fmt: skip


ORCHESTRATOR_FIELDS = PodFields({
    "cpu": "kubernetes.orchestrator_cpu", "requests.cpu": "kubernetes.orchestrator_cpu",
    "memory": "kubernetes.orchestrator_memory", "requests.memory": "kubernetes.orchestrator_memory",
    "limits.memory": "kubernetes.orchestrator_memory",
})  # fmt: skip
"""The orchestrator pod's (`runobjects.render_orchestrator_job`): a CPU request, a memory request and limit."""


@dataclasses.dataclass(frozen=True)
class Blocked:
    """Why the pods of one object are not created."""

    line: str
    """One line naming the object, the cluster's reason and the field to fix where cona knows it."""
    stuck: bool
    """Waiting does not bring the pods (see `explain_refusal`)."""
    message: str
    """The controller's own message, in one line."""
    creator: str = ""
    """The object whose event it is (`Job exp1-a1`): its pods are the ones not created."""
    fewer_fit: bool = False
    """A ResourceQuota refuses the pods for how many they are, not for what one asks (see `explain_refusal`):
    fewer pods may be created. An elastic run shrinks for it (the Kubernetes backend's `_lost`); every other
    refusal meets each pod alike, and fewer pods would be refused the same."""


def _resources(text: str) -> dict[str, str]:
    """A quota message's resource list (`limits.cpu=4,requests.nvidia.com/gpu=8`) as {resource: quantity}."""
    return dict(item.split("=", 1) for item in text.split(",") if "=" in item)


def _named(fields: PodFields, resources: Sequence[str]) -> str:
    named = sorted({f for r in resources if (f := fields.field_of(r)) is not None})
    return ", ".join(named)


def explain_refusal(message: str, *, creator: str, namespace: str, fields: PodFields,
                    pods: int = 1) -> tuple[str, bool, bool]:  # fmt: skip
    """The line of a `FailedCreate` message of `creator` (`Job exp1-a1`), which creates `pods` pods that must all
    run at once, whether it is stuck, and whether fewer pods would fit (`Blocked.fewer_fit`).

    Stuck (past `kubernetes.pending_timeout_s` the attempt ends and the run fails with this line, as for an image
    that cannot be pulled: the same rule, applied by the same place, `Scheduler._note_pending`): a PriorityClass or
    ServiceAccount that does not exist, a ResourceQuota smaller than the `pods` pods' requests together (the pods
    already admitted hold their share until the attempt ends: waiting would never end) or wanting a field the pods
    do not set, a Pod Security refusal, and any other refusal — the Job controller retries, but the same pod meets
    the same admission. Not stuck: a ResourceQuota used up by other pods, which frees as they end (capacity, like an
    unschedulable pod's `Insufficient nvidia.com/gpu`), and a refusal that reads as the API server or a webhook
    failing for a while (`_TRANSIENT`).

    Fewer would fit: an exceeded ResourceQuota that one pod fits — used up by other pods, or smaller than the `pods`
    pods together but not than one of them. Fewer pods (fewer nodes' worth) may then be created, which an elastic
    run can train on; a quota smaller than one pod, one that wants a field the pods do not set, and every other
    refusal meet each pod alike (every pod asks the same), so fewer pods would not help."""
    text = one_line(message)
    cause = _PREFIX.sub("", text, count=1)
    head = f"pods of {creator} cannot be created ({FAILED_CREATE})"
    if m := _PRIORITY.search(cause):
        return (f"{head}: no PriorityClass {m.group(1)!r} in the cluster; set kubernetes.priority_class to one of "
                "`kubectl get priorityclasses`, or leave it out"), True, False  # fmt: skip
    if m := _ACCOUNT.search(cause):
        return (f"{head}: no ServiceAccount {m.group(1)!r} in namespace {namespace!r}; create it (`kubectl apply -k "
                "manifests/` creates cona) or set kubernetes.service_account to one that exists"), True, False  # fmt: skip
    if m := _EXCEEDED.search(cause):
        quota, requested, used, limited = (m.group(i).rstrip(",") for i in range(1, 5))
        asked, hard = _resources(requested), _resources(limited)
        # {resource: (one pod's request, the quota's limit)} of each resource both name as a quantity.
        sizes = {r: (a, h) for r, q in asked.items() if r in hard and (a := quantity_value(q)) is not None
                 and (h := quantity_value(hard[r])) is not None}  # fmt: skip
        too_big = [r for r, (a, h) in sizes.items() if a * pods > h]
        if too_big:
            # Stuck either way; fewer pods fit unless one pod alone asks more than the quota allows.
            one_fits = all(a <= h for a, h in sizes.values())
            named = _named(fields, too_big)
            who = "one pod asks" if pods == 1 else f"the {pods} pods, which must run together, ask"
            each = "requested" if pods == 1 else "each requested"
            return (f"{head}: {who} for more than namespace {namespace!r}'s ResourceQuota {quota!r} allows in all "
                    f"({each} {requested}, limited {limited}); ask the cluster's admin to raise it, or ask less per "
                    "pod" + (f" ({named})" if named else "")), True, one_fits  # fmt: skip
        return (f"{head}: namespace {namespace!r}'s ResourceQuota {quota!r} is used up (requested {requested}, used "
                f"{used}, limited {limited}); the pods are created once other pods free it"), False, True  # fmt: skip
    if m := _MUST_SPECIFY.search(cause):
        quota, wanted = m.group(1), m.group(2)
        wants = [w.strip() for w in wanted.split(",")]
        named = _named(fields, wants)
        unset = [w for w in wants if fields.field_of(w) is None]
        fix = [f"set {named}"] if named else []
        fix += [f"no profile field sets {', '.join(unset)}: ask the cluster's admin"] if unset else []
        return (f"{head}: namespace {namespace!r}'s ResourceQuota {quota!r} wants every pod to set {wanted}; "
                + "; ".join(fix)), True, False  # fmt: skip
    if m := _POD_SECURITY.search(cause):
        return (f"{head}: namespace {namespace!r}'s Pod Security admission ({m.group(1)}) refuses them: "
                f"{m.group(2)}; run in a namespace whose pod-security.kubernetes.io/enforce level admits them"), True, False  # fmt: skip
    transient = any(word in cause.lower() for word in _TRANSIENT)
    return f"{head}: {cause}", not transient, False


def _seen(event: Any) -> datetime.datetime | None:
    """When the event was last seen: its series' last observation, its lastTimestamp, its eventTime (events.k8s.io
    recorders set only that one) or its creation; None when it says nothing."""
    series = getattr(event, "series", None)
    times = [getattr(series, "last_observed_time", None) if series is not None else None,
             event.last_timestamp, event.event_time, event.metadata.creation_timestamp if event.metadata else None]  # fmt: skip
    seen = next((t for t in times if isinstance(t, datetime.datetime)), None)
    return seen.replace(tzinfo=datetime.UTC) if seen is not None and seen.tzinfo is None else seen


def _blocking(event: Any, kind: str, name: str) -> bool:
    """Whether `event` is a blocking Warning of the object `kind` `name` (filtered here as well: a server may
    ignore the field selector, as the test emulator does)."""
    involved = event.involved_object
    return (event.type == "Warning" and event.reason in BLOCKING_REASONS and involved is not None
            and involved.kind == kind and involved.name == name)  # fmt: skip


def creation_blocked(api: KubeApi, creators: Sequence[tuple[str, str]], *, fields: PodFields, pods: int = 1,
                     since: float | None = None) -> Blocked | object | None:  # fmt: skip
    """Why the pods of `creators` ((kind, name) of each object that creates them; `pods` of them in all, which must
    run together) are not created: the newest blocking Warning event of any of them (`BLOCKING_REASONS`), explained
    (`explain_refusal`); None when there is none, `FORBIDDEN` when listing events is refused (403). One call per creator,
    selected by its kind, name and `type=Warning`. `since` (epoch seconds): events last seen before it, less
    `CLOCK_SKEW_S`, are left out. Other API errors raise `BackendError`, as every call does."""
    core = api.core()
    found: list[tuple[datetime.datetime | None, str, Any]] = []
    for kind, name in creators:
        selector = f"involvedObject.kind={kind},involvedObject.name={name},type=Warning"
        listed = api.call("list", "events", f"of {kind} {name}", core.list_namespaced_event, api.namespace,
                          field_selector=selector, forbidden_ok=True)  # fmt: skip
        if listed is FORBIDDEN:
            return FORBIDDEN
        found += [(_seen(e), f"{kind} {name}", e) for e in listed.items or [] if _blocking(e, kind, name)]
    if since is not None:
        cutoff = datetime.datetime.fromtimestamp(since - CLOCK_SKEW_S, datetime.UTC)
        found = [f for f in found if f[0] is None or f[0] >= cutoff]
    if not found:
        return None
    oldest = datetime.datetime.min.replace(tzinfo=datetime.UTC)
    _, creator, event = max(found, key=lambda f: f[0] or oldest)
    line, stuck, fewer_fit = explain_refusal(event.message or "", creator=creator, namespace=api.namespace,
                                             fields=fields, pods=pods)  # fmt: skip
    return Blocked(line=line, stuck=stuck, message=one_line(event.message or ""), creator=creator, fewer_fit=fewer_fit)
