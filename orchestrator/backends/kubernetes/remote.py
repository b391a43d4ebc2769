"""The laptop's side of a run on Kubernetes: `cona submit`, and `cona status/stop/report R` through the API.

The run directory lives on the cluster's PVC, which a laptop cannot see; the run's ConfigMap is the window
(`runobjects.py` lists its keys): `cona status` reads the summary the orchestrator mirrors there (and the
orchestrator pod's own state, so a pod that cannot start is visible too, or, while there is none, the newest
`FailedCreate` event of its Job: a pod the API server refuses), `cona stop` and `cona report` leave a
request there that the orchestrator carries out within a few seconds.
"""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import yaml
from cona.orchestrator.backends.base import BackendError
from cona.orchestrator.backends.kubernetes.api import FORBIDDEN, KubeApi, one_line
from cona.orchestrator.backends.kubernetes.backend import waiting_reason
from cona.orchestrator.backends.kubernetes.events import ORCHESTRATOR_FIELDS, Blocked, creation_blocked
from cona.orchestrator.backends.kubernetes.incluster import read_run_configmap
from cona.orchestrator.backends.kubernetes.render import DNS_LABEL
from cona.orchestrator.backends.kubernetes.runobjects import (
    AMEND_KEY,
    PROFILE_KEY,
    REPORT_DONE_KEY,
    REPORT_ERROR_KEY,
    REPORT_MD,
    REPORT_PNG,
    REPORT_REQUEST_KEY,
    RESUME_KEY,
    RUN_DIR_KEY,
    STATUS_KEY,
    STOP_KEY,
    check_submission_spec,
    orchestrator_job_name,
    owner_reference,
    render_orchestrator_job,
    report_configmap_name,
)
from cona.protocol.yamlconfig import ConfigError

FINAL = ("done", "stopped", "failed")


def _mirrored(data: dict[str, str]) -> dict[str, Any] | None:
    """The status summary the orchestrator mirrored into the run's ConfigMap, or None (none yet, or unreadable)."""
    try:
        summary = json.loads(data[STATUS_KEY]) if STATUS_KEY in data else None
    except ValueError:
        return None
    return summary if isinstance(summary, dict) else None


def _own_configmap(api: KubeApi, run: str, job: Any) -> None:
    """Make the run's ConfigMap a dependent of the orchestrator Job `job` just created (the API server's uid)."""
    uid = job.metadata.uid if job is not None and job.metadata else None
    if uid:
        core = api.core()
        api.call("patch", "configmaps", run, core.patch_namespaced_config_map, run, api.namespace,
                 {"metadata": {"ownerReferences": [owner_reference(orchestrator_job_name(run), uid)]}})  # fmt: skip


def _api(namespace: str, api_client: Any | None) -> KubeApi:
    """The API of `namespace`, which must be a DNS-1123 label: `cona status/stop/report` and `--resume` take it
    from `--namespace` or the kubeconfig's context, where a typo would only read as "no run of that name"."""
    if len(namespace) > 63 or not DNS_LABEL.fullmatch(namespace):
        raise ConfigError(f"namespace {namespace!r} (--namespace, else the kubeconfig context's): not a DNS-1123 label "
                          "(at most 63 lower-case letters, digits and '-'); give the run's namespace, e.g. -n cona")  # fmt: skip
    return KubeApi(namespace, api_client)


def _pod_volume_claim(job: dict[str, Any]) -> str | None:
    """The PVC the orchestrator Job's pod mounts (the run directories), or None."""
    volumes = job["spec"]["template"]["spec"].get("volumes") or []
    return next((v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v), None)


def _check_cluster(api: KubeApi, job: dict[str, Any], nodes: int) -> None:
    """Refuse, before anything is created, a run whose orchestrator pod could never start: its PVC or ServiceAccount
    missing from the namespace (the pod would stay Pending, or never be created, and `cona status` would say so
    only later), or a PVC that the pods of `nodes` nodes cannot all mount. A submitter whose Role predates these
    reads (403) is not refused: the checks are a courtesy, the pod's own state tells the same later."""
    core = api.core()
    pod = job["spec"]["template"]["spec"]
    claim = _pod_volume_claim(job)
    account = pod.get("serviceAccountName")

    def read(resource: str, name: str, fn: Any) -> Any:
        return api.call("get", resource, name, fn, name, api.namespace, missing_ok=True, forbidden_ok=True)

    if claim:
        pvc = read("persistentvolumeclaims", claim, core.read_namespaced_persistent_volume_claim)
        if pvc is None:
            raise ConfigError(
                f"kubernetes.pvc {claim!r}: no PersistentVolumeClaim of that name in namespace {api.namespace!r} "
                "(or no such namespace); `kubectl apply -k manifests/` creates cona-runs in cona, else set "
                "kubernetes.pvc to your ReadWriteMany claim"
            )
        modes = set(pvc.spec.access_modes or []) if pvc is not FORBIDDEN and pvc.spec is not None else set()
        if modes and "ReadWriteMany" not in modes and ("ReadWriteOnce" not in modes or nodes > 1):
            # Only one node may mount a ReadWriteOnce claim: fine on a one-machine cluster, but the pods of a run on
            # several nodes would wait in ContainerCreating for a volume that never attaches.
            raise ConfigError(
                f"kubernetes.pvc {claim!r} is {', '.join(sorted(modes))}: the pods of a run on {nodes} node(s) "
                "must all mount it to write the run directory; give a ReadWriteMany claim (manifests/pvc.yaml)"
            )
    if account and read("serviceaccounts", account, core.read_namespaced_service_account) is None:
        raise ConfigError(
            f"kubernetes.service_account {account!r}: no ServiceAccount of that name in namespace {api.namespace!r}, "
            "so the orchestrator's pod could not be created; `kubectl apply -k manifests/` creates cona and its Role, "
            "else set kubernetes.service_account to one bound to the Role in manifests/rbac.yaml"
        )


def submit(objects: list[dict[str, Any]], *, api_client: Any | None = None) -> tuple[str, str]:
    """Create a run's [ConfigMap, orchestrator Job] (`runobjects.render_submission`); returns (run, namespace).

    The PVC and the ServiceAccount are checked first (`_check_cluster`). Nothing is left behind when the Job
    cannot be created; the ConfigMap is then given the Job as its owner, so deleting the Job deletes the run's
    objects (the attempts' workloads are owned by it too)."""
    configmap, job = objects
    run, namespace = configmap["metadata"]["name"], configmap["metadata"]["namespace"]
    api = _api(namespace, api_client)
    profile = yaml.safe_load(configmap["data"].get(PROFILE_KEY) or "{}") or {}
    _check_cluster(api, job, int(profile.get("nodes") or 1))
    core, batch = api.core(), api.batch()
    if api.call("create", "configmaps", run, core.create_namespaced_config_map, namespace, configmap,
                conflict_ok=True) is None:  # fmt: skip
        raise BackendError(
            f"kubernetes: a run named {run!r} exists already in namespace {namespace!r}; pick another --name, or "
            f"follow it with `cona status {run} --namespace {namespace}`"
        )
    job_name = job["metadata"]["name"]
    try:
        created = api.call("create", "jobs", job_name, batch.create_namespaced_job, namespace, job)
    except BackendError:
        api.call("delete", "configmaps", run, core.delete_namespaced_config_map, run, namespace, missing_ok=True)
        raise
    _own_configmap(api, run, created)
    return run, namespace


def _orchestrator_state(api: KubeApi, run: str) -> str:
    """One line on the orchestrator Job and its pod: what `cona status` adds to the mirrored summary."""
    name = orchestrator_job_name(run)
    batch, core = api.batch(), api.core()
    job = api.call("get", "jobs", name, batch.read_namespaced_job, name, api.namespace, missing_ok=True)
    if job is None:
        return f"Job {name} not found (deleted?)"
    for condition in (job.status.conditions or []) if job.status else []:
        if condition.type in ("Failed", "Complete") and condition.status == "True":
            detail = one_line(f"{condition.reason or ''} {condition.message or ''}")
            return f"Job {name} {condition.type.lower()}" + (f": {detail}" if detail else "")
    pods = api.call("list", "pods", f"of job {name}", core.list_namespaced_pod, api.namespace,
                    label_selector=f"batch.kubernetes.io/job-name={name}")  # fmt: skip
    mine = [p for p in pods.items if (p.metadata.labels or {}).get("batch.kubernetes.io/job-name") == name]
    if not mine:
        # Why not, if the API server refused the pod (its PriorityClass, a quota): the Job's FailedCreate event. A
        # submitter whose Role predates `list` on events (403), or an events read that fails, sees what it saw
        # before: the events only explain.
        created = job.metadata.creation_timestamp if job.metadata else None
        try:
            blocked = creation_blocked(api, [("Job", name)], fields=ORCHESTRATOR_FIELDS,
                                       since=created.timestamp() if created is not None else None)  # fmt: skip
        except BackendError:
            blocked = None
        return f"Job {name}: no pod yet" + (f"; {blocked.line}" if isinstance(blocked, Blocked) else "")
    pod = max(mine, key=lambda p: str(p.metadata.creation_timestamp or ""))
    status = pod.status
    phase = (status.phase if status else None) or "Pending"
    restarts = sum(c.restart_count or 0 for c in (status.container_statuses or [])) if status else 0
    why = (waiting_reason(pod) or ("", False))[0]
    return f"pod {pod.metadata.name} {phase}, {restarts} restart(s)" + (f": {why}" if why else "")


def _orphaned(run: str) -> tuple[str, ...]:
    """How `_orchestrator_state` begins when nobody drives the run: its orchestrator Job failed, or is gone."""
    name = orchestrator_job_name(run)
    return f"Job {name} failed", f"Job {name} not found"


def remote_status(run: str, *, namespace: str, api_client: Any | None = None) -> dict[str, Any]:
    """`cona status`'s summary of a run on Kubernetes, with `orchestrator` (its pod) added."""
    api = _api(namespace, api_client)
    data = read_run_configmap(api, run)
    summary = _mirrored(data)
    if summary is None:
        summary = {"status": "submitted", "reason": "the orchestrator has not reported yet", "run_dir": data.get("run-dir")}
    summary["run"] = run
    summary["namespace"] = namespace
    summary["orchestrator"] = orchestrator = _orchestrator_state(api, run)
    if summary.get("status") not in FINAL and orchestrator.startswith(f"Job {orchestrator_job_name(run)} failed"):
        # Nobody drives the run any more: what it mirrored last is stale.
        summary["reason"] = f"{orchestrator}; the last status it mirrored was {summary.get('status')}"
        summary["status"] = "failed"
    return summary


def remote_stop(run: str, *, namespace: str, api_client: Any | None = None) -> str:
    """Leave a stop request in the run's ConfigMap; returns what to tell the user."""
    api = _api(namespace, api_client)
    data = read_run_configmap(api, run)
    status = (_mirrored(data) or {}).get("status")
    if status in FINAL:
        return f"run {run} has already ended ({status}); nothing to stop"
    orchestrator = _orchestrator_state(api, run)
    if orchestrator.startswith(_orphaned(run)):
        # Nobody would carry the stop out now, and the next orchestrator (`--resume`) would: it would stop the
        # resumed run at once. So no stop is left.
        return (f"run {run} is not running ({orchestrator}); nothing to stop (no stop request left); "
                f"`cona submit --resume {run} --namespace {namespace}` goes on from its last checkpoint")  # fmt: skip
    core = api.core()
    token = f"stop-{time.time():.3f}"
    api.call("patch", "configmaps", run, core.patch_namespaced_config_map, run, namespace, {"data": {STOP_KEY: token}})
    return (f"asked run {run} to stop: the orchestrator passes it on within seconds, the trainer checkpoints at its "
            f"next step boundary and exits (follow with `cona status {run} --namespace {namespace}`)")  # fmt: skip


def remote_report(run: str, *, namespace: str, out_dir: Path, wait_s: float = 120.0,
                  api_client: Any | None = None) -> tuple[Path, Path | None]:  # fmt: skip
    """Fetch the run's report into `out_dir`: the stored one of an ended run, else one the orchestrator writes on
    request now. Returns (report.md, report.png or None)."""
    api = _api(namespace, api_client)
    core = api.core()
    data = read_run_configmap(api, run)
    status = (_mirrored(data) or {}).get("status")
    name = report_configmap_name(run)
    if status not in FINAL:
        orchestrator = _orchestrator_state(api, run)
        if orchestrator.startswith(_orphaned(run)):
            # Nobody would write it: say so now rather than after `wait_s` of waiting.
            raise BackendError(f"kubernetes: run {run!r} is not running ({orchestrator}), so no orchestrator can "
                               f"write its report; `cona submit --resume {run} --namespace {namespace}` goes on, "
                               "or read the run directory on the PVC")  # fmt: skip
        token = f"report-{time.time():.3f}"
        api.call("patch", "configmaps", run, core.patch_namespaced_config_map, run, namespace,
                 {"data": {REPORT_REQUEST_KEY: token}})  # fmt: skip
        deadline = time.monotonic() + wait_s
        while (answer := read_run_configmap(api, run)).get(REPORT_DONE_KEY) != token:
            error = answer.get(REPORT_ERROR_KEY, "")
            if error.startswith(f"{token}: "):
                raise BackendError(f"kubernetes: run {run!r}: the orchestrator could not write the report: "
                                   f"{error[len(token) + 2:]}")  # fmt: skip
            if time.monotonic() > deadline:
                raise BackendError(
                    f"kubernetes: run {run!r}: the orchestrator did not write the report within {wait_s:.0f} s; is its "
                    f"pod running? (`cona status {run} --namespace {namespace}`)"
                )
            time.sleep(1.0)
    report = api.call("get", "configmaps", name, core.read_namespaced_config_map, name, namespace, missing_ok=True)
    if report is None:
        raise BackendError(
            f"kubernetes: run {run!r} has ended ({status}) without a stored report (ConfigMap {name!r}); the run "
            "directory on the PVC has its files"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / REPORT_MD
    md.write_text((report.data or {}).get(REPORT_MD, ""))
    png_data = (report.binary_data or {}).get(REPORT_PNG)
    png = None
    if png_data:
        png = out_dir / REPORT_PNG
        png.write_bytes(base64.b64decode(png_data))
    return md, png


def resume(
    run: str, *, namespace: str, api_client: Any | None = None, wait_s: float = 120.0,
    profile_set: list[str] | tuple[str, ...] = (),
) -> str:  # fmt: skip
    """Resume a stopped or failed submitted run: a new orchestrator Job (the old one deleted, the run's ConfigMaps
    kept) that goes on from the last complete checkpoint. `profile_set`: overrides of how its pods are submitted
    (`runstate.check_amendable`: an image that can be pulled, a Secret), applied to the ConfigMap's profile here (the
    new orchestrator Job's own image among them) and to the run's stored one by the new orchestrator (`AMEND_KEY`).
    Returns what to tell the user."""
    from cona.orchestrator.profile import ClusterProfile
    from cona.orchestrator.runstate import check_amendable
    from cona.protocol.yamlconfig import apply_overrides, validate
    from kubernetes import client

    check_amendable(profile_set)  # before any call: a field that may not change is refused in one line
    api = _api(namespace, api_client)
    core, batch = api.core(), api.batch()
    data = read_run_configmap(api, run)
    status = (_mirrored(data) or {}).get("status")
    name = orchestrator_job_name(run)
    if status == "done":
        raise BackendError(f"kubernetes: run {run!r} has finished (done); there is nothing to resume")
    # Ended, or nobody drives it any more (a resume whose new Job could not be created deleted the old one: the
    # run must stay resumable then).
    if status not in ("stopped", "failed") and not _orchestrator_state(api, run).startswith(_orphaned(run)):
        raise BackendError(f"kubernetes: run {run!r} is {status or 'submitted'}, not ended; stop it first "
                           f"(`cona stop {run} --namespace {namespace}`)")  # fmt: skip
    try:
        stored = yaml.safe_load(data.get(PROFILE_KEY) or "{}")
        if profile_set and isinstance(stored, dict):
            stored = apply_overrides(stored, list(profile_set), source="--profile-set")
        profile = validate(ClusterProfile, stored, source=f"ConfigMap {namespace}/{run} {PROFILE_KEY}",
                           overrides=profile_set, flag="--profile-set")  # fmt: skip
        if profile.kubernetes is None:
            raise ConfigError(f"ConfigMap {namespace}/{run} {PROFILE_KEY}: no kubernetes section")
        # What `cona submit` checks, before the old orchestrator Job is deleted: an image or a quantity the API
        # server refuses would leave the run with no Job at all.
        check_submission_spec(profile.kubernetes)
    except ConfigError as e:
        raise BackendError(f"kubernetes: run {run!r} cannot be resumed: {e}") from None
    token = f"resume-{time.time():.3f}"
    patch = {RESUME_KEY: token}
    if profile_set:
        # What was set, as `cona submit` stored it (an older orchestrator image reads it; defaults stay its own).
        patch |= {PROFILE_KEY: yaml.safe_dump(profile.model_dump(mode="json", exclude_unset=True), sort_keys=False),
                  AMEND_KEY: json.dumps({"token": token, "profile_set": list(profile_set)})}  # fmt: skip
    # The ConfigMaps are owned by the old orchestrator Job: detach them, or deleting it would delete them too.
    for configmap in (run, report_configmap_name(run)):
        api.call("patch", "configmaps", configmap, core.patch_namespaced_config_map, configmap, namespace,
                 {"metadata": {"ownerReferences": None}}, missing_ok=True)  # fmt: skip
    api.call("delete", "jobs", name, batch.delete_namespaced_job, name, namespace,
             body=client.V1DeleteOptions(propagation_policy="Background"), missing_ok=True)  # fmt: skip
    deadline = time.monotonic() + wait_s
    while api.call("get", "jobs", name, batch.read_namespaced_job, name, namespace, missing_ok=True) is not None:
        if time.monotonic() > deadline:
            raise BackendError(f"kubernetes: the old orchestrator Job {name!r} was not deleted within {wait_s:.0f} s")
        time.sleep(1.0)
    api.call("patch", "configmaps", run, core.patch_namespaced_config_map, run, namespace, {"data": patch})
    job = render_orchestrator_job(spec=profile.kubernetes, run=run, run_dir=data.get(RUN_DIR_KEY, ""))
    _own_configmap(api, run, api.call("create", "jobs", name, batch.create_namespaced_job, namespace, job))
    return (f"resuming run {run} ({status}) with a new orchestrator Job {name}: it goes on from the last complete "
            f"checkpoint (follow with `cona status {run} --namespace {namespace}`)")
