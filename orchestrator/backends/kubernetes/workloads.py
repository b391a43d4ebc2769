"""The API side of each `kubernetes.workload` kind: where it lives, how its state reads, how its pods are found.

`render.py` renders the objects; this module says, per kind, which API creates, reads and deletes the attempt's
main object (an Indexed Job through `BatchV1Api`; a JobSet or TrainJob through `CustomObjectsApi`, as plain
dicts), which condition types mean success and failure, which container runs the trainer and which label ties a
pod to the attempt. `KubernetesBackend` does the rest the same way for every kind.

| workload | object | success / failure condition | trainer container | pods labelled | cluster needs |
|---|---|---|---|---|---|
| indexed-job | `batch/v1` Job (+ Service) | Complete / Failed | trainer | `app.kubernetes.io/instance` | nothing |
| jobset | `jobset.x-k8s.io/v1alpha2` JobSet | Completed / Failed | trainer | `jobset.sigs.k8s.io/jobset-name` | JobSet |
| trainjob | `trainer.kubeflow.org/v1alpha1` TrainJob | Complete / Failed | node | `jobset.sigs.k8s.io/jobset-name` | Trainer v2 |

A TrainJob's JobSet carries the TrainJob's name, so its pods are found by the same JobSet label.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cona.orchestrator.backends.kubernetes.render import CONTAINER, REPLICATED_JOB, TRAINJOB_CONTAINER

INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
TRAINER_COMPONENT = "trainer"
"""The component label of an attempt's pods (`render.labels`); a run's orchestrator pod has `orchestrator`."""
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
JOB_NAME_LABELS = ("batch.kubernetes.io/job-name", "job-name", INSTANCE_LABEL)
"""Labels that tie a pod to its Job: the two the Job controller sets, and the instance label cona renders."""
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
"""The annotation (and label) the Job controller gives each pod of an Indexed Job: its index. Every kind's pods
have one: a JobSet's and a TrainJob's Jobs are Indexed Jobs too."""


@dataclass(frozen=True)
class Condition:
    """One status condition of a workload, from a client model or a custom object's dict alike."""

    type: str
    status: str
    reason: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class WorkloadKind:
    """What the backend needs to know about one `kubernetes.workload` kind (see the module docstring)."""

    workload: str
    kind: str
    api_version: str
    plural: str
    container: str
    succeeded: str
    selector_label: str
    """The label the pods are listed by (the server may ignore the selector: they are filtered again)."""
    pod_labels: tuple[str, ...]
    """A pod belongs to the attempt when one of these labels has the workload's name."""
    requires: str
    """What must be installed on the cluster, for the error of a missing resource (404)."""
    retries_pods: bool = False
    """Its Jobs come with a backoffLimit cona does not set (a TrainJob's runtime): a failed pod may be replaced."""
    failed: str = "Failed"

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]

    @property
    def custom(self) -> bool:
        """A custom resource, reached through CustomObjectsApi."""
        return self.kind != "Job"

    def pod_creators(self, name: str) -> list[tuple[str, str]]:
        """(kind, name) of the objects that create the pods of the workload `name`, whose Warning events say why
        pods are not created (`events.py`): the Indexed Job itself; a JobSet's one Job, `<name>-node-0` (the JobSet
        controller names a child Job `<jobset>-<replicatedJob>-<job index>`; a TrainJob's JobSet carries the
        TrainJob's name, and the torch runtime's replicatedJob is `node` too)."""
        if not self.custom:
            return [("Job", name)]
        return [("Job", f"{name}-{REPLICATED_JOB}-0")]


KINDS: dict[str, WorkloadKind] = {
    "indexed-job": WorkloadKind(
        workload="indexed-job", kind="Job", api_version="batch/v1", plural="jobs", container=CONTAINER,
        succeeded="Complete", selector_label=INSTANCE_LABEL, pod_labels=JOB_NAME_LABELS,
        requires="nothing beyond Kubernetes 1.31 (Indexed Jobs with podFailurePolicy and podReplacementPolicy)",
    ),
    "jobset": WorkloadKind(
        workload="jobset", kind="JobSet", api_version="jobset.x-k8s.io/v1alpha2", plural="jobsets",
        container=CONTAINER, succeeded="Completed", selector_label=JOBSET_NAME_LABEL,
        pod_labels=(JOBSET_NAME_LABEL, INSTANCE_LABEL),
        requires="the JobSet controller, kubernetes-sigs/jobset, which installs the jobsets.jobset.x-k8s.io CRD",
    ),
    "trainjob": WorkloadKind(
        workload="trainjob", kind="TrainJob", api_version="trainer.kubeflow.org/v1alpha1", plural="trainjobs",
        container=TRAINJOB_CONTAINER, succeeded="Complete", selector_label=JOBSET_NAME_LABEL,
        pod_labels=(JOBSET_NAME_LABEL, INSTANCE_LABEL), retries_pods=True,
        requires="Kubeflow Trainer v2, which installs the trainjobs.trainer.kubeflow.org CRD and the torch runtime",
    ),
}  # fmt: skip


def kind_of(workload: str) -> WorkloadKind:
    """The kind of a profile's `kubernetes.workload` value (the profile's Literal admits only these)."""
    return KINDS[workload]


def _conditions(raw: Any) -> list[Condition]:
    """The conditions of a client model (attributes) or of a custom object (dicts)."""
    out = []
    for item in raw or []:
        if isinstance(item, dict):
            out.append(Condition(str(item.get("type")), str(item.get("status")), item.get("reason"), item.get("message")))
        else:
            out.append(Condition(str(item.type), str(item.status), item.reason, item.message))
    return out


def true_condition(conditions: list[Condition], kind: str) -> Condition | None:
    """The condition of type `kind` whose status is True, or None."""
    return next((c for c in conditions if c.type == kind and c.status == "True"), None)


Call = Callable[..., Any]
"""`KubernetesBackend._call`: (verb, resource, name, fn, *args, missing_ok=..., **kwargs) → fn's result."""


class WorkloadApi:
    """Create, read and delete an attempt's main object of one kind, every call through the backend's `_call`."""

    def __init__(self, kind: WorkloadKind, api_client: Any, namespace: str, call: Call) -> None:
        from kubernetes import client

        self.kind = kind
        self.namespace = namespace
        self._call = call
        self._batch = client.BatchV1Api(api_client)
        self._custom = client.CustomObjectsApi(api_client)

    def create(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        k = self.kind
        if not k.custom:
            self._call("create", k.plural, name, self._batch.create_namespaced_job, self.namespace, obj)
            return
        self._call("create", k.plural, name, self._custom.create_namespaced_custom_object, k.group, k.version,
                   self.namespace, k.plural, obj)  # fmt: skip

    def conditions(self, name: str) -> list[Condition] | None:
        """The object's status conditions, or None when it does not exist."""
        k = self.kind
        if not k.custom:
            job = self._call("get", k.plural, name, self._batch.read_namespaced_job, name, self.namespace,
                             missing_ok=True)  # fmt: skip
            return None if job is None else _conditions(job.status.conditions if job.status else None)
        obj = self._call("get", k.plural, name, self._custom.get_namespaced_custom_object, k.group, k.version,
                         self.namespace, k.plural, name, missing_ok=True)  # fmt: skip
        return None if obj is None else _conditions((obj.get("status") or {}).get("conditions"))

    def delete(self, name: str) -> None:
        """Delete it, foreground (its Jobs and pods go first); a missing one is fine."""
        from kubernetes import client

        k = self.kind
        options = client.V1DeleteOptions(propagation_policy="Foreground")
        if not k.custom:
            self._call("delete", k.plural, name, self._batch.delete_namespaced_job, name, self.namespace,
                       body=options, missing_ok=True)  # fmt: skip
            return
        self._call("delete", k.plural, name, self._custom.delete_namespaced_custom_object, k.group, k.version,
                   self.namespace, k.plural, name, body=options, missing_ok=True)  # fmt: skip

    def owns(self, pod: Any, name: str) -> bool:
        """Whether `pod` belongs to the workload `name` (one of the kind's labels has that value) and is a trainer
        pod: the orchestrator pod of a run named like this attempt (`R-a1`) has the instance label `R-a1` too."""
        pod_labels = pod.metadata.labels or {}
        if pod_labels.get(COMPONENT_LABEL, TRAINER_COMPONENT) != TRAINER_COMPONENT:
            return False
        return any(pod_labels.get(label) == name for label in self.kind.pod_labels)


def completion_index(pod: Any) -> int | None:
    """The completion index of an Indexed Job's pod (`COMPLETION_INDEX`), or None when it has none."""
    meta = pod.metadata
    for where in ((meta.annotations or {}), (meta.labels or {})) if meta else ():
        value = where.get(COMPLETION_INDEX)
        if value is not None and str(value).isdigit():
            return int(value)
    return None
