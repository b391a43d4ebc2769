"""Render one attempt's training workload as Kubernetes objects (plain dicts), and as YAML for `cona render kubernetes`.

Pure functions: no API calls, no torch, no files read. Every kind runs one pod per node the strategy is placed on
(`cona.protocol.feasibility.placement`), each pod torchrun from an argv list (no shell), the run directory on the
PVC. `kubernetes.workload` picks the kind:

- `indexed-job` (default; plain Kubernetes): an Indexed Job and a headless Service whose name is the pods'
  `subdomain`, so pod 0 answers at `<job>-0.<service>` and serves torchrun's c10d rendezvous there.
- `jobset` (needs the JobSet controller): a JobSet whose one replicatedJob `node` (replicas 1) is that same
  Indexed Job; JobSet creates the headless Service itself (`network.enableDNSHostnames`), pod 0 answers at
  `<jobset>-node-0-0.<jobset>`. `failurePolicy.maxRestarts: 0`: a failed Job fails the JobSet.
- `trainjob` (needs Kubeflow Trainer v2): a TrainJob on the `kubernetes.trainer_runtime` ClusterTrainingRuntime
  (`torch-distributed`), which sets torchrun's `PET_NNODES`, `PET_NPROC_PER_NODE`, `PET_NODE_RANK`,
  `PET_MASTER_ADDR` (`<trainjob>-node-0-0.<trainjob>`) and `PET_MASTER_PORT` (29500): torchrun reads them as its
  defaults, so the command names neither nodes nor rendezvous (static rendezvous on pod 0). The PVC, `/dev/shm`,
  security contexts, service account, image pull secrets, node selector and tolerations go through
  `spec.runtimePatches` (the only pod-level override the v1alpha1 CRD offers; it has no priority class, which is
  why `kubernetes.priority_class` is refused with this kind).

The command of the first two kinds:

    python -m torch.distributed.run --nnodes=N --nproc-per-node=G --node-rank=$(JOB_COMPLETION_INDEX)
        --rdzv-backend=c10d --rdzv-id=<name> --rdzv-endpoint=<pod 0's hostname>:<port> --max-restarts=0
        -m cona.trainer --run-dir <run dir on the PVC> --attempt <n>

Kubernetes expands `$(VAR)` in `command`, `args` and `env` values; the only reference cona writes on purpose is
`$(JOB_COMPLETION_INDEX)`. Every `$` of a value that comes from the profile or job is doubled (`$$` expands to
`$`), so `$(rm -rf /)` in a run directory reaches torchrun literally. No value ever passes through a shell.

torchrun picks the c10d store's host by resolving the endpoint and comparing the addresses with its own, so pod 0
hosts the store only if its own DNS record (published before readiness) already resolves when torchrun starts; if
not, no pod hosts it and the attempt fails at rendezvous. Not seen yet (nothing runs on a cluster so far); the
launch step should watch for it and, if needed, move to torchrun's static rendezvous (`--master-addr`), as the
TrainJob's runtime already does.

`kubernetes.host_network: true` (indexed-job and jobset; refused for a TrainJob, whose runtimePatches cannot carry
it) puts the trainer pods on their nodes' network: `hostNetwork`, `dnsPolicy: ClusterFirstWithHostNet`, the
rendezvous port as a `hostPort`, a required anti-affinity that keeps the attempt's pods on distinct nodes, and
`--rdzv-backend=static` (the same endpoint; node rank 0 hosts the store), because there pod 0's hostname is its
node's, and c10d's choice of the store's host and of the workers' MASTER_ADDR would hang on how the node's name
resolves (`_host_network_fields`).

The (Indexed) Job ends as soon as the trainer exits with one of its protocol codes (`ExitCode`: switch, stop, world
does not fit, bad input) through `podFailurePolicy`; a pod evicted or preempted (`DisruptionTarget`) without such
an exit does not count against `backoffLimit`; the orchestrator, which sees the condition, deletes the workload
and relaunches the attempt as disrupted (torchrun's rendezvous cannot take in a replacement pod). `backoffLimit:
0`: any other failure ends the attempt, and the orchestrator decides what follows. A TrainJob's Jobs come from its
runtime, which cona cannot patch there: the stock `torch-distributed` leaves `backoffLimit` at Kubernetes' default
of 6, so the backend ends such an attempt itself once a pod failed (`workloads.py`).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import yaml
from cona.orchestrator.backends.kubernetes.spec import pull_secrets_problem, workload_problem
from cona.protocol.feasibility import placement
from cona.protocol.rundir import ExitCode
from cona.protocol.yamlconfig import ConfigError

if TYPE_CHECKING:
    from cona.orchestrator.backends.kubernetes.spec import KubernetesSpec
    from cona.orchestrator.job import Job
    from cona.orchestrator.profile import ClusterProfile
    from cona.protocol.strategy import Strategy

CONTAINER = "trainer"
"""The trainer container's name (the podFailurePolicy's exit-code rule names it)."""
PYTHON = "python"
"""The interpreter in the image (the root Dockerfile installs cona into it)."""
MAX_NAME = 52
"""Longest Job/Service name: an Indexed Job's pod hostname is `<job>-<index>` and must stay a 63-character label."""
REPLICATED_JOB = "node"
"""The JobSet's one replicatedJob; also the name Trainer's torch runtimes give theirs."""
MAX_JOBSET_NAME = 63 - len(f"-{REPLICATED_JOB}-0-") - 3 - len("-abcde")
"""Longest JobSet/TrainJob name (46): JobSet's webhook wants every generated pod name
`<name>-node-0-<index>-<5 characters>` to be a 63-character label; 3 digits of index is 1000 nodes."""
TRAINJOB_CONTAINER = "node"
"""The trainer container of Trainer's torch runtimes: the TrainJob's `trainer` section applies to it."""
TRAINJOB_PATCH_MANAGER = "cona.dev/orchestrator"
"""Owner of the TrainJob's runtime patch (`spec.runtimePatches` is a list keyed by manager)."""
MAX_LABEL = 63
RUN_UID = 1000
"""The non-root user of the image (Dockerfile `USER 1000`); also the group that owns files on the PVC."""
PROTOCOL_EXIT_CODES = sorted(int(code) for code in ExitCode if code != ExitCode.DONE)
"""Exit codes that end the Job at once (Kubernetes wants them ascending): 2, 42, 43, 44."""
ENV_REFERENCE = "$(JOB_COMPLETION_INDEX)"

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
"""A DNS-1123 label (at most 63 characters), as a namespace's name."""
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_QUALIFIED = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
QUANTITY = re.compile(r"(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?")
"""A Kubernetes quantity (resource.Quantity's grammar, without a sign): `500m`, `2`, `1.5`, `64Gi`, `1e3`. One pattern
for every resource field: CPUs in millicores and memory with binary or decimal suffixes alike."""
_BAD_IMAGE = re.compile(r"[\s\x00-\x1f\x7f]")
_SUFFIXES = {"": 1.0, "n": 1e-9, "u": 1e-6, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
             **{s: 1024.0 ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))}}  # fmt: skip
MIN_MEMORY = 1024**2
"""The least memory quantity taken (1Mi): below it, a unit was forgotten (`2` is two bytes) or `m` (milli) was
taken for mebi (`500m` is half a byte), and the pod would be killed at start or /dev/shm be full at once."""


def quantity_bytes(value: str) -> float:
    """A quantity that matches `QUANTITY` (`1.5Gi`, `500m`, `2`, `1e3`) as a number (bytes for memory)."""
    match = QUANTITY.fullmatch(value)
    assert match is not None, value
    suffix = match.group("suffix") or ""
    scale = 10.0 ** int(suffix[1:]) if suffix[:1] in ("e", "E") else _SUFFIXES[suffix]
    return float(match.group("number")) * scale


def quantity_value(text: str) -> float | None:
    """A quantity as the API server writes one, any suffix milli included (`500m`, `4`, `16Gi`), as a number
    (bytes for memory); None when `text` is not one."""
    return quantity_bytes(text) if QUANTITY.fullmatch(text) else None


def check_cpu(field: str, value: str) -> None:
    """Refuse a CPU quantity below one millicore (`0`: a pod that may use no CPU), in one line naming `field`."""
    if quantity_bytes(value) < 1e-3:
        raise ConfigError(f"{field}: {value!r} is less than one millicore; give CPUs, e.g. 500m or 2")


def check_memory(field: str, value: str) -> None:
    """Refuse a memory quantity under `MIN_MEMORY`, in one line naming `field`."""
    if quantity_bytes(value) < MIN_MEMORY:
        raise ConfigError(f"{field}: {value!r} is {quantity_bytes(value):g} bytes; give a unit, e.g. 2Gi (Mi, Gi: "
                          "1024-based; m would be milli)")  # fmt: skip


RESERVED_PATHS = {
    "/": "the container's root filesystem",
    "/tmp": "the pods' scratch emptyDir (HOME=/tmp)",
    "/dev": "where the container's devices (the GPUs) are",
    "/dev/shm": "the pods' in-memory /dev/shm volume",
    "/proc": "the container's /proc",
    "/sys": "the container's /sys",
}
"""Paths `kubernetes.mount_path` may not be: the pods mount or need something else there."""


def image_tag(image: str) -> str | None:
    """The tag of an image reference (`latest` of `reg:5000/cona:latest`), `@` and the digest of a pinned one, None
    when it has neither (a registry's port, `reg:5000/cona`, is no tag)."""
    name, at, digest = image.partition("@")
    if at:
        return f"@{digest}"
    _, colon, tag = name.rpartition("/")[2].partition(":")
    return tag if colon else None


_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE = re.compile(rf"(?:{_DOMAIN}/)?{_PATH}(?:/{_PATH})*(?::[\w][\w.-]{{0,127}})?"
                    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")  # fmt: skip
"""An image reference as registries and the kubelet parse it (the distribution project's grammar): an optional
registry host (with a port), lowercase path components, an optional tag and an optional digest."""


def image_problem(image: str) -> str | None:
    """None when `image` is a reference the kubelet can pull; else what is wrong with it. The API server takes any
    string, so a bad one (`ghcr.io/Team/cona:1`: a repository has no capitals) would fail only when an attempt's
    pods try to pull it, `pending_timeout_s` into the run."""
    if _IMAGE.fullmatch(image):
        return None
    return ("not an image reference: [registry[:port]/]repository[:tag][@digest], the repository in lowercase "
            "letters, digits and . _ - separators, a tag of letters, digits, _ . - (not first)")


def pull_policy(image: str) -> str:
    """The pods' `imagePullPolicy`, as Kubernetes would default it: `Always` for `:latest` (it moves, and a node's
    cached copy may be older than another's: every pod of an attempt must run the same code), else `IfNotPresent`
    (a version tag or a digest is pulled once per node)."""
    return "Always" if image_tag(image) == "latest" else "IfNotPresent"


def trainer_resources(spec: KubernetesSpec, devices: int) -> dict[str, Any]:
    """A trainer pod's resources: its devices as a limit (a quantity is a string in the API: the official client
    refuses an int), and `trainer_cpu`/`trainer_memory` where the profile sets them (memory as request and limit,
    so that a pod over it is the one killed, not a neighbour)."""
    resources: dict[str, Any] = {"limits": {spec.gpu_resource: str(int(devices))}}
    requests: dict[str, str] = {}
    if spec.trainer_cpu is not None:
        requests["cpu"] = spec.trainer_cpu
    if spec.trainer_memory is not None:
        requests["memory"] = spec.trainer_memory
        resources["limits"]["memory"] = spec.trainer_memory
    if requests:
        resources["requests"] = requests
    return resources


def escape(value: str) -> str:
    """`value` as Kubernetes must see it in `command`/`args`/`env` so that it expands to itself: `$` → `$$`."""
    return value.replace("$", "$$")


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:8]


def dns_name(value: str, limit: int = MAX_NAME, *, distinct: bool = True) -> str:
    """A DNS-1035 label (lower-case letters, digits, `-`; starts with a letter) of at most `limit` characters for
    `value`: upper case is lowered, other characters become `-`, `r-` goes before a first character that is no
    letter. The one place run names become Kubernetes names (the workloads of `workload_names`, the Lease).

    Distinct values give distinct names: a value that is already such a label is its own name; any other ends in a
    hash of the original, whether it was shortened or only changed, so run directories `Exp1` and `exp1` (or `a_b`
    and `a-b`) never share a workload or a Lease, where one run would adopt or delete the other's. `distinct=False`
    adds the hash only to a shortened name: for a name the API server keeps unique itself (`runobjects.run_name`)."""
    name = re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", value.lower())).strip("-")
    if not name or not name[0].isalpha():
        name = f"r-{name}".rstrip("-")
    if len(name) > limit or (distinct and name != value):
        name = f"{name[: limit - 9].rstrip('-')}-{_digest(value)}"
    return name


def label_value(value: str) -> str:
    """`value` as a label value (≤ 63 characters of `[A-Za-z0-9_.-]`, alphanumeric at both ends)."""
    text = re.sub(r"[^A-Za-z0-9_.-]", "-", value).strip("-_.")
    if len(text) > MAX_LABEL or text != value:
        text = f"{text[: MAX_LABEL - 9].strip('-_.')}-{_digest(value)}".strip("-")
    return text


def workload_names(run_name: str, attempt: int, limit: int = MAX_NAME) -> tuple[str, str]:
    """(workload name, Service or subdomain name) of a run's attempt; the same DNS-1035 label ≤ `limit` characters
    for both (`MAX_NAME` for an Indexed Job, `MAX_JOBSET_NAME` for a JobSet or TrainJob)."""
    suffix = f"-a{int(attempt)}"
    base = dns_name(run_name, limit - len(suffix))
    name = f"{base}{suffix}"
    return name, name


def _check(what: str, value: str, pattern: re.Pattern[str], limit: int, expected: str) -> str:
    if len(value) > limit or not pattern.fullmatch(value):
        shown = value.encode("unicode_escape").decode()
        raise ConfigError(f"{what}: {shown!r} is not {expected} (at most {limit} characters)")
    return value


def check_spec(spec: KubernetesSpec) -> None:
    """Reject profile values that cannot be names in a manifest, with one line naming the field."""
    _check("kubernetes.namespace", spec.namespace, DNS_LABEL, 63, "a DNS-1123 label")
    _check("kubernetes.pvc", spec.pvc, _DNS_SUBDOMAIN, 253, "a DNS-1123 subdomain")
    _check("kubernetes.service_account", spec.service_account, _DNS_SUBDOMAIN, 253, "a DNS-1123 subdomain")
    _check("kubernetes.gpu_resource", spec.gpu_resource, _QUALIFIED, 316, "a resource name such as nvidia.com/gpu")
    if spec.gpu_resource != "cpu" and "/" not in spec.gpu_resource:
        # The API server takes a bare name only for its standard resources: `GPU` is refused when the orchestrator
        # creates the attempt, and `memory` would ask for as many bytes as the node has devices.
        raise ConfigError(f"kubernetes.gpu_resource: {spec.gpu_resource!r} is neither cpu nor an extended resource "
                          "named with its domain (nvidia.com/gpu, amd.com/gpu, habana.ai/gaudi)")  # fmt: skip
    if not spec.image or _BAD_IMAGE.search(spec.image):
        shown = spec.image.encode("unicode_escape").decode()
        raise ConfigError(f"kubernetes.image: {shown!r} is empty or contains whitespace or a control character")
    _check("kubernetes.trainer_runtime", spec.trainer_runtime, _DNS_SUBDOMAIN, 253, "a DNS-1123 subdomain")
    # Checked when the profile loads too (`spec.py`); again here for a spec built or changed without validation.
    problem = pull_secrets_problem(spec.image_pull_secrets)
    if problem:
        raise ConfigError(f"kubernetes.image_pull_secrets: {problem}")
    found = workload_problem(spec)
    if found:
        raise ConfigError(f"kubernetes.{found[0]}: {found[1]}")
    tag = image_tag(spec.image)
    if not tag:
        # Kubernetes would take `:latest`, which moves: the nodes of one attempt, or one attempt and the next,
        # could run different code, and a resumed run would not run what it started with.
        raise ConfigError(
            f"kubernetes.image: {spec.image!r} has no tag; name the version to run, e.g. "
            f"{spec.image.rstrip(':')}:0.1.0, or pin a digest (@sha256:...); ':latest' only if you mean it"
        )
    problem = image_problem(spec.image)
    if problem:
        raise ConfigError(f"kubernetes.image: {spec.image!r} is {problem}")
    if spec.shm_size is not None:
        _check("kubernetes.shm_size", spec.shm_size, QUANTITY, 64, "a quantity such as 64Gi")
        check_memory("kubernetes.shm_size", spec.shm_size)
    if spec.trainer_memory is not None:
        _check("kubernetes.trainer_memory", spec.trainer_memory, QUANTITY, 64, "a quantity such as 200Gi")
        check_memory("kubernetes.trainer_memory", spec.trainer_memory)
    if spec.trainer_cpu is not None:
        _check("kubernetes.trainer_cpu", spec.trainer_cpu, QUANTITY, 64, "a quantity such as 32 or 500m")
        check_cpu("kubernetes.trainer_cpu", spec.trainer_cpu)
        if spec.gpu_resource == "cpu":  # one resource in requests twice, with two meanings: say which one counts
            raise ConfigError("kubernetes.trainer_cpu: the profile's devices are CPUs (gpu_resource: cpu), requested "
                              "one per process already; leave trainer_cpu out")  # fmt: skip
    if not spec.mount_path.startswith("/"):
        raise ConfigError(f"kubernetes.mount_path: {spec.mount_path!r} is not an absolute path")
    mount = str(PurePosixPath(spec.mount_path))
    if mount in RESERVED_PATHS:
        # The pod spec would mount two volumes at one path (refused when the Job creates its pods, so the attempt
        # would wait for pods that never come) or hide what the container needs there.
        raise ConfigError(f"kubernetes.mount_path: {spec.mount_path!r} is {RESERVED_PATHS[mount]}; mount the PVC "
                          "at a path of its own, e.g. /runs (and put storage.run_root under it)")  # fmt: skip


def _run_dir_on_pvc(run_dir: str, mount_path: str) -> str:
    path = PurePosixPath(run_dir)
    mount = PurePosixPath(mount_path)
    if not path.is_absolute() or ".." in path.parts or (path != mount and mount not in path.parents):
        raise ConfigError(
            f"run directory {run_dir!r} is not under kubernetes.mount_path {mount_path!r}: the pods would not "
            "see it (put storage.run_root under the mount path)"
        )
    if "\x00" in run_dir:
        raise ConfigError("run directory: contains a NUL character")
    return run_dir


def labels(*, run_name: str, name: str, attempt: int | None = None) -> dict[str, str]:
    """The standard labels of a run's objects, plus `cona.dev/run` (and `cona.dev/attempt`)."""
    result = {
        "app.kubernetes.io/name": "cona",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "trainer",
        "app.kubernetes.io/part-of": "cona",
        "app.kubernetes.io/managed-by": "cona-orchestrator",
        "cona.dev/run": label_value(run_name),
    }
    if attempt is not None:
        result["cona.dev/attempt"] = str(int(attempt))
    return result


def trainer_argv(
    *, nnodes: int, nproc_per_node: int, rdzv_id: str, endpoint: str, run_dir: str, attempt: int,
    rdzv_backend: str = "c10d",
) -> list[str]:  # fmt: skip
    """The trainer container's command: torchrun under c10d rendezvous (`static` on the node's network: see
    `_host_network_fields`), as an argv list with user values escaped."""
    assert rdzv_backend in ("c10d", "static"), rdzv_backend
    return [
        PYTHON, "-m", "torch.distributed.run",
        f"--nnodes={int(nnodes)}", f"--nproc-per-node={int(nproc_per_node)}", f"--node-rank={ENV_REFERENCE}",
        f"--rdzv-backend={rdzv_backend}", f"--rdzv-id={escape(rdzv_id)}", f"--rdzv-endpoint={escape(endpoint)}",
        "--max-restarts=0",
        "-m", "cona.trainer", "--run-dir", escape(run_dir), "--attempt", str(int(attempt)),
    ]  # fmt: skip


def _volumes(spec: KubernetesSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volume mounts): the PVC of the run directories and an in-memory /dev/shm."""
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.shm_size is not None:
        shm["sizeLimit"] = spec.shm_size
    volumes = [
        {"name": "runs", "persistentVolumeClaim": {"claimName": spec.pvc}},
        {"name": "dshm", "emptyDir": shm},
        # The root filesystem is read-only: torchrun's error files and torch's caches go to /tmp (HOME=/tmp).
        {"name": "tmp", "emptyDir": {}},
    ]
    mounts = [
        {"name": "runs", "mountPath": spec.mount_path},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    return volumes, mounts


CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": RUN_UID,
    "runAsGroup": RUN_UID,
    "fsGroup": RUN_UID,
    # Change ownership only when the volume's root does not match: a large PVC is not walked per pod.
    "fsGroupChangePolicy": "OnRootMismatch",
    "seccompProfile": {"type": "RuntimeDefault"},
}


def pod_fields(spec: KubernetesSpec) -> dict[str, Any]:
    """The pod-level fields every pod cona creates takes from the profile, trainer or orchestrator (absent when
    unset): its priority class and image pull secrets."""
    fields: dict[str, Any] = {}
    if spec.priority_class is not None:
        fields["priorityClassName"] = spec.priority_class
    if spec.image_pull_secrets:
        fields["imagePullSecrets"] = [{"name": name} for name in spec.image_pull_secrets]
    return fields


def _placement_fields(spec: KubernetesSpec) -> dict[str, Any]:
    """The trainer pod's node selector and tolerations from the profile (absent when empty)."""
    fields: dict[str, Any] = {}
    if spec.node_selector:
        fields["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        fields["tolerations"] = [dict(t) for t in spec.tolerations]
    return fields


def _host_network_fields(spec: KubernetesSpec, selector: dict[str, str]) -> dict[str, Any]:
    """A trainer pod's fields for `kubernetes.host_network` (absent when false; `check_spec` refuses it for a
    TrainJob, whose runtimePatches cannot carry them). `selector` picks the attempt's trainer pods.

    The rendezvous of such pods is torchrun's static one (`render_attempt`). c10d decides which pod hosts the store
    by resolving the pod's hostname, which on the node's network is the node's (nor does the kubelet write the
    pod's own name into its /etc/hosts there), and raises where the node's name does not resolve; it also hands the
    workers pod 0's FQDN, the node's, as MASTER_ADDR, which the other pods may not resolve. The static rendezvous
    makes node rank 0 (pod 0, `$(JOB_COMPLETION_INDEX)`) the host and the endpoint's name the workers' MASTER_ADDR,
    whatever the node's names resolve to."""
    if not spec.host_network:
        return {}
    return {
        "hostNetwork": True,
        # The default policy (ClusterFirst) falls back to the node's resolv.conf on the node's network: pod 0's
        # name in the headless Service, the rendezvous endpoint, would not resolve.
        "dnsPolicy": "ClusterFirstWithHostNet",
        # One pod of the attempt per node. Pods on one node's network share its ports and its hostname, so NCCL
        # would take them for one machine and reach for shared memory across pods that do not share /dev/shm. A
        # pod asking for all `gpus_per_node` devices keeps a node to itself already, but `placement` gives a
        # strategy fewer per pod when that spreads it evenly (12 processes on nodes of 8: 3 pods of 4), and a CPU
        # profile's pods ask for CPUs, of which a node has plenty. Said here, not left to the hostPort's side
        # effect in the scheduler (`_pod_spec`), which holds only while every pod declares the same port.
        "affinity": {
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": {"matchLabels": dict(selector)}, "topologyKey": "kubernetes.io/hostname"}
                ]
            }
        },
    }


def container_env(base: list[dict[str, Any]], env: dict[str, str]) -> list[dict[str, Any]]:
    """A trainer container's `env`: cona's entries, then the profile's `env` (one that names one of cona's, such as
    HOME, replaces it: a name given twice is a warning in the API and a guess about which one wins). Values are
    escaped so that Kubernetes does not expand a `$(VAR)` in them: the profile takes values as written."""
    return [*(item for item in base if item["name"] not in env),
            *({"name": name, "value": escape(value)} for name, value in env.items())]  # fmt: skip


def _pod_spec(
    spec: KubernetesSpec, *, subdomain: str | None, argv: list[str], gpus: int, attempt: int,
    selector: dict[str, str], env: dict[str, str],
) -> dict[str, Any]:  # fmt: skip
    """The pod of an Indexed Job (also inside a JobSet, whose controller sets the subdomain itself: None)."""
    port: dict[str, Any] = {"name": "rdzv", "containerPort": spec.rendezvous_port, "protocol": "TCP"}
    if spec.host_network:
        # What the API server would default on the node's network, written out: the scheduler then places no
        # trainer pod on a node where another pod declares the rendezvous port (another host-network run's, a
        # previous attempt's still terminating), where pod 0 could not bind it.
        port["hostPort"] = spec.rendezvous_port
    volumes, mounts = _volumes(spec)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": pull_policy(spec.image),
        "command": argv,
        "env": container_env([
            # Declared here (the Job controller would add the same) so that `$(JOB_COMPLETION_INDEX)` in the
            # command visibly refers to a variable of this container.
            {
                "name": "JOB_COMPLETION_INDEX",
                "valueFrom": {
                    "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
                },
            },
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "HOME", "value": "/tmp"},
            {"name": "CONA_ATTEMPT", "value": str(int(attempt))},
        ], env),
        "ports": [port],
        # A quantity is a string in the API (the official client refuses an int here).
        "resources": trainer_resources(spec, gpus),
        "volumeMounts": mounts,
        "securityContext": dict(CONTAINER_SECURITY),
    }
    pod: dict[str, Any] = {"restartPolicy": "Never"}
    if subdomain is not None:
        pod["subdomain"] = subdomain
    pod.update({
        "serviceAccountName": spec.service_account,
        "securityContext": dict(POD_SECURITY),
        "containers": [container],
        "volumes": volumes,
        **pod_fields(spec),
        **_placement_fields(spec),
        **_host_network_fields(spec, selector),
    })  # fmt: skip
    return pod


def _indexed_job_spec(
    spec: KubernetesSpec, *, nnodes: int, subdomain: str | None, argv: list[str], gpus: int, attempt: int,
    meta_labels: dict[str, str], annotations: dict[str, str], selector: dict[str, str], env: dict[str, str],
) -> dict[str, Any]:  # fmt: skip
    """The Indexed Job of an attempt: on its own (`indexed-job`) or as the JobSet's replicatedJob template."""
    return {
        "completionMode": "Indexed",
        "completions": nnodes,
        "parallelism": nnodes,
        "backoffLimit": 0,
        # A replacement pod starts only once the one it replaces is gone (no two pods of one index).
        "podReplacementPolicy": "Failed",
        "podFailurePolicy": {
            "rules": [
                # The trainer ended on purpose (switch, stop, world does not fit, bad input): end the Job
                # now; the orchestrator reads exit.json and launches the next attempt.
                {
                    "action": "FailJob",
                    "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": PROTOCOL_EXIT_CODES},
                },
                # Eviction, preemption, node drain: replace the pod without counting it against backoffLimit.
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        },
        "template": {
            "metadata": {"labels": meta_labels, "annotations": annotations},
            "spec": _pod_spec(spec, subdomain=subdomain, argv=argv, gpus=gpus, attempt=attempt, selector=selector,
                              env=env),
        },
    }


def render_attempt(
    *,
    profile: ClusterProfile,
    strategy: Strategy,
    attempt: int,
    run_dir: str,
    run_name: str | None = None,
    job: Job | None = None,
) -> list[dict[str, Any]]:
    """The objects of one attempt, by `kubernetes.workload`: [headless Service, Indexed Job], [JobSet] or [TrainJob].

    `run_dir` is the run directory as the pods see it (under `kubernetes.mount_path`); `run_name` defaults to its
    last component. `job` is accepted for the other backends' signature and not needed (the trainer reads the job
    from run.yaml). Raises ConfigError for profile values that cannot be rendered, ValueError for a strategy that
    does not fit the profile's nodes.
    """
    del job
    spec = profile.kubernetes
    if spec is None:
        raise ConfigError(f"profile {profile.name!r} has no kubernetes: section (backend is {profile.backend!r})")
    check_spec(spec)
    run_dir = _run_dir_on_pvc(str(run_dir), spec.mount_path)
    run_name = run_name if run_name is not None else PurePosixPath(run_dir).name
    nnodes, per_node = placement(strategy, profile.gpus_per_node, profile.nodes)
    # A JobSet's pod names hold the node index: past 1,000 nodes (the profile's, the most any attempt has) its
    # digits come out of the name's own characters.
    limit = MAX_NAME if spec.workload == "indexed-job" else MAX_JOBSET_NAME - max(0, len(str(profile.nodes - 1)) - 3)
    name, service = workload_names(run_name, attempt, limit)
    meta_labels = labels(run_name=run_name, name=name, attempt=attempt)
    annotations = {"cona.dev/strategy": str(strategy), "cona.dev/run-dir": run_dir}
    metadata = {"name": name, "namespace": spec.namespace, "labels": meta_labels, "annotations": annotations}
    if spec.workload == "trainjob":
        return [_trainjob(spec, metadata=metadata, nnodes=nnodes, per_node=per_node, run_dir=run_dir, attempt=attempt,
                          env=profile.env)]
    # The pod hostname of index 0: `<job>-0` in an Indexed Job, `<jobset>-<replicatedJob>-<job index>-0` in a JobSet.
    # On the node's network too, the headless Service's record of that name is pod 0's IP (then its node's).
    host = f"{name}-0" if spec.workload == "indexed-job" else f"{name}-{REPLICATED_JOB}-0-0"
    argv = trainer_argv(
        nnodes=nnodes, nproc_per_node=per_node, rdzv_id=name,
        endpoint=f"{host}.{service}:{spec.rendezvous_port}", run_dir=run_dir, attempt=attempt,
        rdzv_backend="static" if spec.host_network else "c10d",  # why: `_host_network_fields`
    )  # fmt: skip
    # The attempt's trainer pods: the Service's selector, and the host-network pods' anti-affinity.
    selector = {key: meta_labels[key] for key in ("app.kubernetes.io/instance", "cona.dev/attempt")}
    job_spec = _indexed_job_spec(
        spec, nnodes=nnodes, subdomain=service if spec.workload == "indexed-job" else None, argv=argv, gpus=per_node,
        attempt=attempt, meta_labels=meta_labels, annotations=annotations, selector=selector, env=profile.env,
    )  # fmt: skip
    if spec.workload == "jobset":
        return [_jobset(metadata=metadata, subdomain=service, job_spec=job_spec)]
    assert spec.workload == "indexed-job", spec.workload  # the profile's Literal admits nothing else
    service_obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service, "namespace": spec.namespace, "labels": meta_labels},
        "spec": {
            "clusterIP": "None",
            # Pod 0 must resolve before it is ready: it is the rendezvous host.
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [{"name": "rdzv", "port": spec.rendezvous_port, "targetPort": "rdzv", "protocol": "TCP"}],
        },
    }
    job_obj = {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": job_spec}
    return [service_obj, job_obj]


def _jobset(*, metadata: dict[str, Any], subdomain: str, job_spec: dict[str, Any]) -> dict[str, Any]:
    """A JobSet of one replicatedJob (one Job) whose template is the attempt's Indexed Job."""
    template = job_spec["template"]["metadata"]
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            # JobSet creates the headless Service named `subdomain`; pod 0 must resolve before it is ready (it is
            # the rendezvous host), as the Indexed Job's own Service does.
            "network": {"enableDNSHostnames": True, "subdomain": subdomain, "publishNotReadyAddresses": True},
            # A failed Job fails the JobSet at once: the orchestrator, not JobSet, decides what follows.
            "failurePolicy": {"maxRestarts": 0},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": 1,
                    "template": {"metadata": {"labels": template["labels"], "annotations": template["annotations"]},
                                 "spec": job_spec},
                }
            ],
        },
    }  # fmt: skip


def _trainjob(
    spec: KubernetesSpec, *, metadata: dict[str, Any], nnodes: int, per_node: int, run_dir: str, attempt: int,
    env: dict[str, str],
) -> dict[str, Any]:  # fmt: skip
    """A Kubeflow Trainer v2 TrainJob on the profile's torch runtime (see the module docstring)."""
    volumes, mounts = _volumes(spec)
    # torchrun takes --nnodes, --nproc-per-node, --node-rank and the static rendezvous on pod 0 from the PET_*
    # variables the runtime sets (PET_NNODES = numNodes, PET_NPROC_PER_NODE = numProcPerNode).
    command = [
        PYTHON, "-m", "torch.distributed.run", "--max-restarts=0",
        "-m", "cona.trainer", "--run-dir", escape(run_dir), "--attempt", str(int(attempt)),
    ]  # fmt: skip
    pod_metadata = {"labels": metadata["labels"], "annotations": metadata["annotations"]}
    pod_patch = {
        "serviceAccountName": spec.service_account,
        "securityContext": dict(POD_SECURITY),
        "containers": [
            {"name": TRAINJOB_CONTAINER, "volumeMounts": mounts, "securityContext": dict(CONTAINER_SECURITY)}
        ],
        "volumes": volumes,
        # Pull secrets only: `check_spec` refuses a priority class here (runtimePatches cannot set one).
        **pod_fields(spec),
        **_placement_fields(spec),
    }
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": metadata,
        "spec": {
            "runtimeRef": {"name": spec.trainer_runtime, "apiGroup": "trainer.kubeflow.org",
                           "kind": "ClusterTrainingRuntime"},
            "trainer": {
                "image": spec.image,
                "command": command,
                "numNodes": nnodes,
                "numProcPerNode": per_node,
                # A quantity is a string in the API, as in the Indexed Job's pods.
                "resourcesPerNode": trainer_resources(spec, per_node),
                "env": container_env([
                    {"name": "PYTHONUNBUFFERED", "value": "1"},
                    {"name": "HOME", "value": "/tmp"},
                    {"name": "CONA_ATTEMPT", "value": str(int(attempt))},
                ], env),
            },
            "runtimePatches": [
                {
                    "manager": TRAINJOB_PATCH_MANAGER,
                    "trainingRuntimeSpec": {
                        "template": {
                            "metadata": {"labels": metadata["labels"]},
                            "spec": {
                                "replicatedJobs": [
                                    {
                                        "name": REPLICATED_JOB,
                                        "template": {
                                            "metadata": {"labels": metadata["labels"]},
                                            "spec": {"template": {"metadata": pod_metadata, "spec": pod_patch}},
                                        },
                                    }
                                ]
                            },
                        }
                    },
                }
            ],
        },
    }  # fmt: skip


class _Dumper(yaml.SafeDumper):
    """Safe YAML without anchors and aliases (shared label dicts are written out each time)."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_text(
    *,
    profile: ClusterProfile,
    strategy: Strategy,
    run_dir: str,
    job: Job | None = None,
    attempt: int = 1,
    run_name: str | None = None,
) -> str:
    """Multi-document YAML of an attempt's objects (`cona render kubernetes`), after a comment saying what it is."""
    objects = render_attempt(
        profile=profile, strategy=strategy, attempt=attempt, run_dir=run_dir, run_name=run_name, job=job
    )
    header = (
        f"# cona kubernetes workload of attempt {int(attempt)} under {strategy}\n"
        "# (the orchestrator also writes attempts/<n>/launch.json on the PVC before it creates these)\n"
    )
    documents = [yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000) for obj in objects]
    return header + "---\n" + "---\n".join(documents)
