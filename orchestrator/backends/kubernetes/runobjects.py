"""A run's own Kubernetes objects (not an attempt's): its ConfigMap, its orchestrator Job and its Lease.

`cona submit` (on a laptop) renders and creates the first two; the orchestrator pod reads the ConfigMap, holds the
Lease and creates the training workloads, each owned by the orchestrator Job (`owner_reference`) so that deleting
that Job deletes everything the run created on the cluster (the run directory on the PVC stays).

All of a run's objects share one name `R`, a DNS-1035 label of at most `RUN_NAME_MAX` characters, which is also
the run directory's name under `storage.run_root`, so the attempts' workloads (`R-a<n>`) line up with it:

| object | name | written by |
|---|---|---|
| ConfigMap | `R` | `cona submit` (profile.yaml, job.yaml, run-dir, cona-version), the orchestrator (status.json, report-done), `cona stop` (stop), `cona report` (report-request), `cona submit --resume` (resume) |
| ConfigMap | `R-report` | the orchestrator (report.md, report.png) |
| Job | `R-orch` | `cona submit` |
| Lease | `R` | the orchestrator that drives the run |
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

import yaml
from cona.orchestrator import cona_version
from cona.orchestrator.backends.kubernetes.render import (
    CONTAINER_SECURITY,
    POD_SECURITY,
    PYTHON,
    QUANTITY,
    check_cpu,
    check_memory,
    check_spec,
    dns_name,
    escape,
    label_value,
    pod_fields,
    pull_policy,
)
from cona.protocol.yamlconfig import ConfigError

if TYPE_CHECKING:
    from cona.orchestrator.backends.kubernetes.spec import KubernetesSpec
    from cona.orchestrator.job import Job
    from cona.orchestrator.profile import ClusterProfile

RUN_NAME_MAX = 40
"""Longest run name: `R-orch` and the attempts' `R-a<n>` must stay within the 52 characters of a Job's name."""
ORCHESTRATOR_SUFFIX = "-orch"
REPORT_SUFFIX = "-report"
CONTAINER = "orchestrator"

# Keys of the run's ConfigMap.
PROFILE_KEY = "profile.yaml"
JOB_KEY = "job.yaml"
RUN_DIR_KEY = "run-dir"
STATUS_KEY = "status.json"
"""`cona status`'s summary, mirrored by the orchestrator every few seconds and at every change of the run's status."""
STOP_KEY = "stop"
"""Set by `cona stop`: a token the orchestrator turns into a stop in the run's control.json once."""
REPORT_REQUEST_KEY = "report-request"
"""Set by `cona report`: a token; the orchestrator writes the report, stores it in `R-report` and echoes the token."""
REPORT_DONE_KEY = "report-done"
REPORT_ERROR_KEY = "report-error"
"""Set by the orchestrator when it could not write the report asked for: `token: why` (one line)."""
VERSION_KEY = "cona-version"
"""The version of the cona that submitted the run: an orchestrator image of another version names both when it
cannot read the profile or job (a field it does not know)."""
RESUME_KEY = "resume"
"""Set by `cona submit --resume`: a token; the new orchestrator resumes the ended run once for it."""
AMEND_KEY = "profile-amended"
"""Set by `cona submit --resume --profile-set ...`: JSON `{"token", "profile_set"}`; the new orchestrator applies the
overrides to the run's stored profile (`runstate.amend_profile`) before it resumes for that token, once."""
REPORT_MD, REPORT_PNG = "report.md", "report.png"

OWNER_JOB_ENV = "CONA_OWNER_JOB"
OWNER_UID_ENV = "CONA_OWNER_UID"
"""The orchestrator pod's own Job (name and uid, from its pod's labels through the downward API): the owner of the
workloads it creates."""


def run_name(value: str) -> str:
    """The Kubernetes name of a run (and its directory's name): `value` as a DNS-1035 label of ≤ 40 characters.

    Readable, without the hash `dns_name` gives a changed name (only a shortened one has it): the name is the run's
    ConfigMap's, which the API server keeps unique (a second run of the name is refused, `remote.submit`, never
    adopted), and `cona status/stop/report` take it as typed."""
    return dns_name(value, RUN_NAME_MAX, distinct=False)


def orchestrator_job_name(run: str) -> str:
    return f"{run}{ORCHESTRATOR_SUFFIX}"


def report_configmap_name(run: str) -> str:
    return f"{run}{REPORT_SUFFIX}"


def run_labels(run: str, component: str) -> dict[str, str]:
    """The standard labels of a run-level object."""
    return {
        "app.kubernetes.io/name": "cona",
        "app.kubernetes.io/instance": run,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": "cona",
        "app.kubernetes.io/managed-by": "cona",
        "cona.dev/run": label_value(run),
    }


def owner_reference(job_name: str, uid: str) -> dict[str, Any]:
    """An ownerReference to the orchestrator Job: the garbage collector deletes the owned object with the Job.
    Not `blockOwnerDeletion` (that needs update on jobs/finalizers, which the Role does not grant)."""
    return {"apiVersion": "batch/v1", "kind": "Job", "name": job_name, "uid": uid, "controller": False}


def run_dir_for(profile: ClusterProfile, run: str) -> str:
    """The run directory on the PVC as the pods see it: `storage.run_root/R`, which must lie under the mount."""
    spec = profile.kubernetes
    assert spec is not None
    path = PurePosixPath(profile.storage.run_root) / run
    mount = PurePosixPath(spec.mount_path)
    if not path.is_absolute() or ".." in path.parts or mount not in path.parents:
        raise ConfigError(
            f"storage.run_root {profile.storage.run_root!r} is not under kubernetes.mount_path {spec.mount_path!r}: "
            "the orchestrator and trainer pods would not see the run directory (put run_root under the mount path)"
        )
    return str(path)


class _Dumper(yaml.SafeDumper):
    """Safe YAML without anchors; multi-line strings (the embedded profile and job) as `|` blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value and not any(c in value for c in "\r\t") and value == value.rstrip(" ") else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def _dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=1000)


def dump_objects(objects: list[dict[str, Any]]) -> str:
    """Multi-document YAML of `objects` for `kubectl apply -f -`."""
    return "---\n".join(_dump(obj) for obj in objects)


def render_configmap(*, profile: ClusterProfile, job: Job, run: str, run_dir: str, submitted: float) -> dict[str, Any]:
    """The run's ConfigMap: the resolved profile and job (what the orchestrator creates run.yaml from).

    Both carry only the fields the user (or a validator) set, not the defaults: the orchestrator pod runs the
    profile's image, which may be older than this CLI, and a field it does not know (every field added since, even
    at its default) would make it refuse the run. It fills the defaults in again, and fields that were set stay set
    (some validators tell a field left out from one given its default value)."""
    spec = profile.kubernetes
    assert spec is not None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": run, "namespace": spec.namespace, "labels": run_labels(run, "run"),
                     "annotations": {"cona.dev/run-dir": run_dir}},
        "data": {
            PROFILE_KEY: _dump(profile.model_dump(mode="json", exclude_unset=True)),
            JOB_KEY: _dump(job.model_dump(mode="json", exclude_unset=True)),
            RUN_DIR_KEY: run_dir,
            VERSION_KEY: cona_version(),
            "submitted": f"{submitted:.3f}",
        },
    }


def orchestrator_argv(run: str, namespace: str) -> list[str]:
    """What the orchestrator pod runs: `cona orchestrate`, as an argv list (no shell), `$` doubled."""
    return [PYTHON, "-m", "cona.orchestrator.cli", "orchestrate", "--namespace", escape(namespace), escape(run)]


def render_orchestrator_job(*, spec: KubernetesSpec, run: str, run_dir: str) -> dict[str, Any]:
    """The orchestrator Job: one pod that runs the scheduler loop next to the PVC.

    `restartPolicy: OnFailure`: when the orchestrator process dies (OOM, a lost Lease, an API outage), the kubelet
    restarts it in place and it adopts the running attempt; `backoffLimit` bounds that. A node lost under it gets
    a new pod from the Job controller, which waits for the Lease. The root filesystem is read-only; /tmp is an
    emptyDir (matplotlib's cache for the report)."""
    labels = run_labels(run, "orchestrator")
    field = "metadata.labels['batch.kubernetes.io/{}']"
    container = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": pull_policy(spec.image),
        "command": orchestrator_argv(run, spec.namespace),
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": OWNER_JOB_ENV, "valueFrom": {"fieldRef": {"fieldPath": field.format("job-name")}}},
            {"name": OWNER_UID_ENV, "valueFrom": {"fieldRef": {"fieldPath": field.format("controller-uid")}}},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "HOME", "value": "/tmp"},
            {"name": "MPLCONFIGDIR", "value": "/tmp/matplotlib"},
        ],
        "resources": {
            "requests": {"cpu": spec.orchestrator_cpu, "memory": spec.orchestrator_memory},
            "limits": {"memory": spec.orchestrator_memory},
        },
        "volumeMounts": [{"name": "runs", "mountPath": spec.mount_path}, {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": dict(CONTAINER_SECURITY),
    }
    pod: dict[str, Any] = {
        "restartPolicy": "OnFailure",
        "serviceAccountName": spec.service_account,
        "securityContext": dict(POD_SECURITY),
        "containers": [container],
        "volumes": [
            {"name": "runs", "persistentVolumeClaim": {"claimName": spec.pvc}},
            {"name": "tmp", "emptyDir": {}},
        ],
        # The trainer pods' priority (a lower orchestrator would be preempted first) and pull secrets (same image).
        **pod_fields(spec),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": orchestrator_job_name(run), "namespace": spec.namespace, "labels": labels,
                     "annotations": {"cona.dev/run-dir": run_dir}},
        "spec": {
            "backoffLimit": spec.orchestrator_restarts,
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


def check_submission_spec(spec: KubernetesSpec) -> None:
    """ConfigError, one line, unless `spec` renders pods the API server takes: the trainers' (`check_spec`) and the
    orchestrator's own requests. What `cona submit` checks, and `cona submit --resume` with `--profile-set`."""
    check_spec(spec)
    for field, value in (("orchestrator_cpu", spec.orchestrator_cpu), ("orchestrator_memory", spec.orchestrator_memory)):
        if not QUANTITY.fullmatch(value):
            raise ConfigError(f"kubernetes.{field}: {value!r} is not a quantity such as 500m, 2 or 2Gi")
    check_cpu("kubernetes.orchestrator_cpu", spec.orchestrator_cpu)
    check_memory("kubernetes.orchestrator_memory", spec.orchestrator_memory)


def render_submission(*, profile: ClusterProfile, job: Job, run: str, submitted: float) -> list[dict[str, Any]]:
    """[ConfigMap, orchestrator Job] of a run, ConfigMap first (the orchestrator reads it when it starts)."""
    spec = profile.kubernetes
    if spec is None or profile.backend != "kubernetes":
        raise ConfigError(f"profile {profile.name!r}: backend is {profile.backend!r}; cona submit needs a kubernetes profile")
    check_submission_spec(spec)
    if run != run_name(run):
        raise ConfigError(f"--name {run!r}: not a DNS-1035 label of at most {RUN_NAME_MAX} characters (e.g. {run_name(run)!r})")
    if run.endswith(REPORT_SUFFIX):
        # Its ConfigMap would be run `X`'s report ConfigMap: X's orchestrator would write its report into this run's.
        raise ConfigError(f"--name {run!r}: ends in {REPORT_SUFFIX!r}, the name of run {run[: -len(REPORT_SUFFIX)]!r}'s "
                          "report ConfigMap; pick another name")  # fmt: skip
    run_dir = run_dir_for(profile, run)
    return [
        render_configmap(profile=profile, job=job, run=run, run_dir=run_dir, submitted=submitted),
        render_orchestrator_job(spec=spec, run=run, run_dir=run_dir),
    ]
