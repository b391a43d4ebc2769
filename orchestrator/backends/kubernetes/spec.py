"""The profile's `kubernetes:` section: how to run on Kubernetes. Owned by the backend; `cona.orchestrator.profile` only embeds it.

Imports nothing of the backend itself, so loading a profile does not load the backend.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import pydantic
from cona.protocol.yamlconfig import StrictModel, not_a_bool
from pydantic import Field

_TOLERATION_FIELDS = ("key", "operator", "value", "effect", "tolerationSeconds")
_TAINT_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_KEY_RULE = "an optional DNS prefix and '/', then at most 63 of A-Z a-z 0-9 - _ . with a letter or digit at both ends"
LABEL_VALUE_RULE = "empty, or at most 63 of A-Z a-z 0-9 - _ . with a letter or digit at both ends"
DNS_SUBDOMAIN_RULE = "a DNS-1123 subdomain (at most 253 lower-case letters, digits, '-' and '.', a letter or digit first and last)"


def is_label_key(key: str) -> bool:
    """Whether `key` is a label key (a qualified name: `[prefix/]name`), as a node selector or toleration key must be."""
    prefix, slash, name = key.rpartition("/")
    if slash and not (len(prefix) <= 253 and _DNS_SUBDOMAIN.fullmatch(prefix)):
        return False
    return len(name) <= 63 and bool(_LABEL_NAME.fullmatch(name))


def is_dns_subdomain(value: str) -> bool:
    """Whether `value` is a DNS-1123 subdomain (≤ 253 characters), as the name of a Secret or PriorityClass must be."""
    return len(value) <= 253 and bool(_DNS_SUBDOMAIN.fullmatch(value))


def pull_secrets_problem(names: list[str]) -> str | None:
    """What is wrong with `image_pull_secrets` (the first problem, in one line), or None."""
    for i, name in enumerate(names):
        if not is_dns_subdomain(name):
            return (f"[{i}] {name!r} is not {DNS_SUBDOMAIN_RULE}; give the name of a docker-registry Secret in the "
                    "run's namespace (kubectl -n NS get secrets)")  # fmt: skip
        if name in names[:i]:
            return f"[{i}] {name!r} is listed twice; list each Secret once"
    return None


def priority_class_problem(priority_class: str | None, workload: str | None = None) -> str | None:
    """What is wrong with `priority_class` (for `workload`, when given), in one line, or None."""
    if priority_class is None:
        return None
    if not is_dns_subdomain(priority_class):
        return (f"{priority_class!r} is not {DNS_SUBDOMAIN_RULE}; give the name of one of the cluster's "
                "PriorityClasses (kubectl get priorityclasses)")  # fmt: skip
    if workload == "trainjob":
        # Trainer v1alpha1's `runtimePatches`, the only pod-level override a TrainJob has, has no priorityClassName:
        # rendered anyway, the API server would refuse the TrainJob (unknown field) or drop it silently.
        return (f"{priority_class!r} cannot reach a TrainJob's pods (Trainer v1alpha1's runtimePatches have no "
                "priorityClassName); set priorityClassName in the trainer_runtime's pod template and leave "
                "priority_class out, or use workload indexed-job or jobset")  # fmt: skip
    return None


def host_network_problem(host_network: Any, workload: str | None = None) -> str | None:
    """What is wrong with `host_network` (for `workload`, when given), in one line, or None."""
    if problem := not_a_bool(host_network):  # validated profiles never get here; a spec built in code may
        return problem
    if host_network and workload == "trainjob":
        # Trainer v1alpha1's `runtimePatches`, the only pod-level override a TrainJob has, has neither hostNetwork
        # nor dnsPolicy: rendered anyway, the API server would refuse the TrainJob (unknown field) or drop them.
        return ("true cannot reach the pods of workload trainjob (Trainer v1alpha1's runtimePatches have no "
                "hostNetwork or dnsPolicy); set hostNetwork: true and dnsPolicy: ClusterFirstWithHostNet in the "
                "trainer_runtime's pod template and leave host_network out, or use workload indexed-job or jobset")  # fmt: skip
    return None


def workload_problem(spec: KubernetesSpec) -> tuple[str, str] | None:
    """(field, what is wrong) of the first field of `spec` its `workload` cannot carry to its pods, or None: the
    profile's validator and `render.check_spec` (a spec built or changed without validation) both ask here."""
    for field, problem in (("priority_class", priority_class_problem(spec.priority_class, spec.workload)),
                           ("host_network", host_network_problem(spec.host_network, spec.workload))):  # fmt: skip
        if problem:
            return field, problem
    return None


def is_label_value(value: str) -> bool:
    """Whether `value` is a label value (empty, or ≤ 63 characters, alphanumeric at both ends)."""
    return value == "" or (len(value) <= 63 and bool(_LABEL_NAME.fullmatch(value)))


class KubernetesSpec(StrictModel):
    """How to run on Kubernetes."""

    namespace: str = "default"
    """Namespace of the run's workloads (a DNS-1123 label); `manifests/` creates `cona`."""
    image: str = "ghcr.io/cona-project/cona:latest"
    """Container image with cona and torch installed."""
    pvc: str = "cona-runs"
    """ReadWriteMany PersistentVolumeClaim that holds the run directories."""
    mount_path: str = "/runs"
    """Where the PVC is mounted in every pod (storage.run_root should lie under it)."""
    service_account: str = "cona"
    """ServiceAccount of the trainer pods (`manifests/` creates `cona` with its Role)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the trainer pods must match (e.g. the GPU product)."""
    tolerations: list[dict[str, str | int]] = Field(default_factory=list)
    """Tolerations of the trainer pods, as in a pod spec (key, operator, value, effect, tolerationSeconds)."""
    workload: Literal["indexed-job", "jobset", "trainjob"] = "indexed-job"
    """The training workload of an attempt: `indexed-job` (an Indexed Job plus a headless Service; nothing to install),
    `jobset` (a JobSet, `jobset.x-k8s.io/v1alpha2`; needs the JobSet controller), `trainjob` (a Kubeflow Trainer v2
    TrainJob, `trainer.kubeflow.org/v1alpha1`; needs Kubeflow Trainer and its `trainer_runtime`)."""
    trainer_runtime: str = "torch-distributed"
    """`workload: trainjob` only: the ClusterTrainingRuntime the TrainJob refers to. It must be a torch runtime (it
    sets torchrun's `PET_*` variables) whose trainer container is named `node`, as Trainer's `torch-distributed`."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource name requested per pod, as many as the pod runs processes (`cpu` by default when
    `accelerator.device` is `cpu`: `cona.orchestrator.profile` sets it unless the profile says)."""
    rendezvous_port: int = Field(default=29400, ge=1, le=65535)
    """Port of torchrun's c10d rendezvous on pod 0 (`<job>-0.<service>:<port>`, `<jobset>-node-0-0.<jobset>:<port>`);
    a TrainJob's runtime picks its own (`PET_MASTER_PORT`, 29500 in Trainer's torch runtimes)."""
    pending_timeout_s: float = Field(default=600.0, gt=0)
    """How long an attempt's pods may stay Pending before the orchestrator acts (`Scheduler._note_pending` decides;
    the clock starts at the first poll that finds the attempt pending and survives an orchestrator restart). Past
    it: an event `pending-timeout` with the reason, once; a pod that waits for something waiting does not bring
    (ErrImagePull, ImagePullBackOff, InvalidImageName, CreateContainerConfigError, ...: `STUCK_WAITING_REASONS` in
    `backend.py`) ends the attempt and fails the run with that reason (`image ... cannot be pulled (...)`) once it has lasted
    this long itself (a pod scheduled after a long queue wait gets the whole time for its pull), as do
    pods the API server refuses to create for good (a Job's `FailedCreate` event: a PriorityClass or ServiceAccount
    that does not exist, Pod Security, a ResourceQuota smaller than the attempt's pods together; `events.explain_refusal`), while an
    unschedulable pod (`0/4 nodes are available: 4 Insufficient nvidia.com/gpu`) or a ResourceQuota used up by other
    pods goes on waiting — the cluster's queue, like Slurm's — and `cona status` shows for how long and why."""
    elastic_pending_timeout_s: float = Field(default=300.0, gt=0)
    """Elastic runs only (`min_nodes` < `nodes`): how long one pod of a running attempt may stay Pending (not
    scheduled: its node is gone, cordoned or full), or not be created because a ResourceQuota admits only some of
    the attempt's pods (used up by other pods, or too small for all of them together: the Job's `FailedCreate`
    event, `events.explain_refusal`), before the attempt ends as if that pod's node were lost, so the run replans
    for the pods that can run (`Outcome.lost_nodes`). Counted from the first poll that saw the pod Pending, or saw
    the refusal (a launch's events are read from 10 s after it; an orchestrator restart starts it again). Shorter
    than `pending_timeout_s` (an elastic profile where it is not is refused), which never shrinks a run; a pod that waits for something waiting does not bring (an
    image that cannot be pulled) is not a lost node, nor is one refused for what every pod asks alike (a missing
    PriorityClass or ServiceAccount, Pod Security, a quota smaller than one pod)."""
    shm_size: str | None = None
    """Size limit of the in-memory `/dev/shm` volume (a quantity such as `64Gi`); None: no limit beyond the pod's."""
    trainer_cpu: str | None = None
    """CPU request of each trainer pod (a quantity such as `32`); None: none, beyond `gpu_resource`'s limit. With
    neither this nor `trainer_memory` the pods are BestEffort: the first evicted under memory pressure, and refused
    in a namespace whose ResourceQuota asks every pod for requests."""
    trainer_memory: str | None = None
    """Memory request and limit of each trainer pod (a quantity such as `200Gi`); None: none."""
    orchestrator_cpu: str = "500m"
    """CPU request of the orchestrator pod (`cona submit`): it tails files and calls the API, a fraction of a core."""
    orchestrator_memory: str = "2Gi"
    """Memory request and limit of the orchestrator pod (the report's plots are the largest part)."""
    orchestrator_restarts: int = Field(default=10, ge=0)
    """How often Kubernetes restarts a failing orchestrator pod (its Job's `backoffLimit`) before the run's Job fails;
    each restart adopts the running attempt."""
    lease_duration_s: int = Field(default=15, ge=3, le=300)
    """How long the orchestrator's Lease lasts without renewal (renewed every third of it): after the orchestrator
    dies, a restarted one waits this long before it takes over the run."""
    image_pull_secrets: list[str] = Field(default_factory=list)
    """Names of docker-registry Secrets (type `kubernetes.io/dockerconfigjson`, in `namespace`) that the kubelet
    pulls `image` with from a private registry: every pod cona creates (the trainer pods of every workload kind,
    the orchestrator pod of `cona submit`) lists them as `imagePullSecrets`. Each a DNS-1123 subdomain, listed once.
    Empty: the pods pull with the service account's own pull secrets, if it has any, else anonymously. `cona
    submit` does not check that they exist (reading Secrets would give the submitter their contents): a missing or
    wrong one shows as `ImagePullBackOff`, which fails the run past `pending_timeout_s`."""
    priority_class: str | None = None
    """PriorityClass of every pod cona creates (`priorityClassName`; a DNS-1123 subdomain naming one of the
    cluster's, `kubectl get priorityclasses`): on a shared cluster it decides which pods the scheduler preempts for
    which. A trainer pod preempted by a higher one ends its attempt as disrupted; the next attempt resumes from the
    last complete checkpoint without counting as a failure. None: the cluster's default (its `globalDefault` class,
    else priority 0). Not with `workload: trainjob`, whose pod-level override (`runtimePatches`) cannot set it: give
    the ClusterTrainingRuntime's pod template a priorityClassName instead."""
    host_network: bool = False
    """Run the trainer pods on their nodes' network (`hostNetwork: true`). Use it on GPU clusters whose pod network
    cannot carry NCCL's traffic at speed (InfiniBand or RoCE NICs outside the CNI): NCCL then sees the node's NICs.
    False (default): the pods' own network. True also gives the trainer pods (not the orchestrator's):
    `dnsPolicy: ClusterFirstWithHostNet`, without which they would resolve names with the node's DNS and not find
    pod 0 in the headless Service; a required pod anti-affinity on `kubernetes.io/hostname` against the attempt's
    other pods, since pods on one node's network share its ports and hostname (NCCL would take two for one machine)
    and a pod of fewer than `gpus_per_node` devices, or a CPU profile's, could share a node; and torchrun's static
    rendezvous (`--rdzv-backend=static`, node rank 0 hosts the store) on the same endpoint
    `<pod 0's hostname>.<service>:<rendezvous_port>`, whose DNS record is pod 0's IP, now its node's. c10d would
    decide which pod hosts the store from how pod 0's hostname, now the node's, resolves (it fails where the node's
    name does not resolve to its address) and hand the workers that node's FQDN as `MASTER_ADDR`.
    Ports the pods use on the node: `rendezvous_port` (TCP, 29400 by default), where pod 0 serves the store that
    torchrun and the training processes share; every trainer pod declares it as a `hostPort`, so the scheduler puts
    none on a node where another pod declares that port (another run's, or a previous attempt's still
    terminating). No daemon of the nodes may listen on it, and it should lie outside their ephemeral range
    (`net.ipv4.ip_local_port_range`, 32768-60999 on Linux). Everything else binds ephemeral ports (NCCL's bootstrap
    and socket transport, Gloo); InfiniBand/RoCE traffic uses no TCP port. The namespace's Pod Security level must
    be `privileged` (`baseline` refuses host networking; the run then fails saying so). Not with
    `workload: trainjob`, whose pod-level override (`runtimePatches`) cannot set it: give the
    ClusterTrainingRuntime's pod template `hostNetwork: true` and `dnsPolicy: ClusterFirstWithHostNet` instead."""

    @pydantic.field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets(cls, value: list[str]) -> list[str]:
        # The API server takes any name here (a typo fails only when the kubelet pulls); checked as it would check
        # a Secret's own name, so that a name no Secret can have is said at once.
        problem = pull_secrets_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @pydantic.field_validator("priority_class")
    @classmethod
    def _priority_class_name(cls, value: str | None) -> str | None:
        problem = priority_class_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @pydantic.model_validator(mode="after")
    def _workload_fields(self) -> KubernetesSpec:
        # After the fields (they depend on `workload` too), so the error is reported for the section: it names the
        # field itself.
        found = workload_problem(self)
        if found:
            raise ValueError(" ".join(found))
        return self

    @pydantic.field_validator("trainer_cpu", mode="before")
    @classmethod
    def _cpu_count(cls, value: Any) -> Any:
        # `trainer_cpu: 32` is a count of cores, as Kubernetes reads the quantity "32": take the number as that.
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return value

    @pydantic.field_validator("node_selector", mode="before")
    @classmethod
    def _node_selector_text(cls, value: object) -> object:
        # A label value is text: YAML reads `nvidia.com/gpu.present: true` (the GPU feature discovery label) as a
        # boolean and `gpu.count: 8` as a number, which the API server would not take either.
        if isinstance(value, dict):
            for key, label in value.items():
                if isinstance(label, (bool, int, float)):
                    shown = str(label).lower() if isinstance(label, bool) else str(label)
                    what = "a boolean" if isinstance(label, bool) else "a number"
                    raise ValueError(f"{key}: YAML read the value as {what}, and a label value is text; quote it as "
                                     f"written ({key}: \"{shown}\")")  # fmt: skip
        return value

    @pydantic.field_validator("node_selector")
    @classmethod
    def _node_selector(cls, value: dict[str, str]) -> dict[str, str]:
        # The API server refuses a pod whose selector is no label (`gpu type: H100`), but only when the orchestrator
        # creates an attempt's workload, in the cluster, after `cona submit` said the run was submitted.
        for key, label in value.items():
            if not is_label_key(key):
                raise ValueError(f"key {key!r} is not a label key ({LABEL_KEY_RULE})")
            if not is_label_value(label):
                raise ValueError(f"{key}: value {label!r} is not a label value ({LABEL_VALUE_RULE})")
        return value

    @pydantic.field_validator("tolerations", mode="before")
    @classmethod
    def _tolerations(cls, value: object) -> object:
        # Checked here, not by the API server at submission: a typo would otherwise surface as a failed pod later.
        # Before pydantic's conversion, which took `tolerationSeconds: true` for 1 and named a float's str arm.
        if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
            return value  # pydantic says what it is not
        for i, toleration in enumerate(value):
            unknown = sorted(set(toleration) - set(_TOLERATION_FIELDS))
            if unknown:
                keys = ", ".join(map(repr, unknown))  # as the other messages here quote a value; not a list repr
                raise ValueError(f"[{i}]: unknown key(s) {keys}; valid: {', '.join(_TOLERATION_FIELDS)}")
            for name in ("key", "operator", "value", "effect"):
                # YAML reads `value: 1` or `value: true` as a number: the API takes only a string there.
                if name in toleration and not isinstance(toleration[name], str):
                    shown = str(toleration[name]).lower() if isinstance(toleration[name], bool) else repr(toleration[name])
                    raise ValueError(f"[{i}].{name} {shown}: write it in quotes, as written (a string)")
            for name, allowed in (("operator", ("Exists", "Equal")), ("effect", _TAINT_EFFECTS)):
                if name in toleration and toleration[name] not in allowed:
                    raise ValueError(f"[{i}].{name} {toleration[name]!r}: use one of {', '.join(map(repr, allowed))}")
            seconds = toleration.get("tolerationSeconds")
            if seconds is not None and (not isinstance(seconds, int) or isinstance(seconds, bool)):
                shown = str(seconds).lower() if isinstance(seconds, bool) else repr(seconds)
                raise ValueError(f"[{i}].tolerationSeconds {shown}: give whole seconds")
            if toleration.get("operator") == "Exists" and toleration.get("value"):
                raise ValueError(f"[{i}]: operator 'Exists' takes no value; drop value or use operator 'Equal'")
            # The API server's own rules for a toleration (`ValidateTolerations`), so that a pod is never refused.
            key = str(toleration.get("key", ""))
            if key and not is_label_key(key):
                raise ValueError(f"[{i}].key {key!r} is not a label key ({LABEL_KEY_RULE})")
            if not key and toleration.get("operator") != "Exists":
                raise ValueError(f"[{i}]: a toleration without a key needs operator 'Exists' (it then tolerates "
                                 "every taint); give the taint's key, or operator: Exists")  # fmt: skip
            if toleration.get("operator", "Equal") == "Equal" and not is_label_value(str(toleration.get("value", ""))):
                raise ValueError(f"[{i}].value {toleration['value']!r} is not a label value ({LABEL_VALUE_RULE})")
            if seconds is not None and toleration.get("effect") != "NoExecute":
                raise ValueError(f"[{i}].tolerationSeconds is only for effect 'NoExecute' (how long a pod stays on a "
                                 "node tainted NoExecute); drop it or set effect: NoExecute")  # fmt: skip
        return value
