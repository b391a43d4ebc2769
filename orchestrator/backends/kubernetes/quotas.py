"""How many more trainer pods the namespace's ResourceQuotas admit now, so that an elastic run does not grow into a
quota that would refuse its pods.

Without it an elastic run that shrank because a ResourceQuota refused some of its pods (`events.Blocked.fewer_fit`)
would grow back at the next decision (the Nodes are there), have the same pods refused, wait
`kubernetes.elastic_pending_timeout_s` and shrink again: two relaunches and a timeout each time round. The backend
(`KubernetesBackend.available_nodes`, `_start_on`) bounds the nodes it offers by `quota_room`.

Pure: the quota objects are given (API models or their dicts), one pod's resources as `render.trainer_resources`
renders them. Counted as the API server's quota admission counts a pod: the limits of the quota's `status.hard`
against its `status.used`, for the resource names a pod is charged under (`pod_charges`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from cona.orchestrator.backends.kubernetes.render import quantity_value

POD_COUNTS = ("pods", "count/pods")
"""Quota names that count the pods themselves (one each, whatever they ask)."""
BARE_REQUESTS = ("cpu", "memory", "ephemeral-storage")
"""Quota names without a prefix that mean the request (`cpu` is `requests.cpu`); extended resources have none."""
_SLACK = 1e-9
"""Room is a float quotient (`0.3 / 0.1` is 2.999…): a hair more, so that an exact fit counts as one."""


def _get(obj: Any, key: str) -> Any:
    """`key` (camelCase, as the API writes it) of a dict, or its snake_case attribute of an API model; None if
    absent."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, "".join(f"_{c.lower()}" if c.isupper() else c for c in key), None)


def _quantities(values: Mapping[str, Any] | None) -> dict[str, float]:
    """{resource: number} of those of `values` that parse as quantities (a quota's hard or used, a pod's)."""
    return {r: v for r, q in (values or {}).items() if (v := quantity_value(str(q))) is not None}


def pod_charges(resources: Mapping[str, Any]) -> dict[str, float]:
    """What one pod of container `resources` ({"requests": …, "limits": …}) counts against a ResourceQuota, by the
    quota's resource names: `pods` and `count/pods` one; each request as `requests.<res>` (and bare `cpu`,
    `memory`, `ephemeral-storage`); each limit as `limits.<res>`. A limit without a request is also the request
    (the API server defaults it so: the GPUs cona renders as a limit only). A resource the pod does not set is not
    charged: a quota on it refuses the pod outright (`must specify`), which `events.explain_refusal` reports."""
    limits = _quantities(resources.get("limits"))
    requests = {**limits, **_quantities(resources.get("requests"))}
    charges = dict.fromkeys(POD_COUNTS, 1.0)
    for resource, value in requests.items():
        charges[f"requests.{resource}"] = value
        if resource in BARE_REQUESTS:
            charges[resource] = value
    charges.update({f"limits.{resource}": value for resource, value in limits.items()})
    return charges


def applies_to_every_pod(quota: Any) -> bool:
    """Whether the quota counts every pod of the namespace: no `spec.scopes`, no `spec.scopeSelector`.

    A scoped quota counts only the pods its scopes select (a PriorityClass, BestEffort or not, with an
    activeDeadlineSeconds or not, cross-namespace affinity): telling whether a trainer pod is among them would mean
    evaluating the scopes as the API server does. Not counted, so a quota that may not apply never holds a run
    back; if it does apply, the pods it refuses are seen as before (`FailedCreate`, and the run shrinks)."""
    spec = _get(quota, "spec")
    return not _get(spec, "scopes") and not _get(spec, "scopeSelector")


def quota_room(quotas: Iterable[Any], charges: Mapping[str, float]) -> int | None:
    """How many more pods that each count `charges` (`pod_charges`) the ResourceQuotas `quotas` admit now: for each
    resource a quota limits and a pod counts, floor((hard - used) / what one pod counts), the least over all of
    them (never below 0); None when none limits them (no quota, or only scoped ones: `applies_to_every_pod`).

    Read from each quota's status, which is what admission checks: the quota controller copies `spec.hard` there and
    keeps `used`. A quota without a status yet (just created) is left out rather than read as `spec.hard` with
    nothing used: admission limits nothing a quota's `status.hard` does not name, and the controller fills it in
    within seconds, when the next decision reads it; reading `used` as 0 meanwhile would also count pods twice that
    it holds. A resource without a usage (or that does not parse) is left out the same way."""
    room: int | None = None
    for quota in quotas:
        if not applies_to_every_pod(quota):
            continue
        status = _get(quota, "status")
        hard, used = _quantities(_get(status, "hard")), _quantities(_get(status, "used"))
        for resource, limit in hard.items():
            charge = charges.get(resource)
            if not charge or resource not in used:
                continue
            fits = max(math.floor((limit - used[resource]) / charge + _SLACK), 0)
            room = fits if room is None else min(room, fits)
    return room
