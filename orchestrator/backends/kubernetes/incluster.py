"""The orchestrator pod's side of a submitted run (`cona orchestrate R`, what the orchestrator Job runs).

It reads the run's ConfigMap (the profile and job `cona submit` resolved), creates the run directory on the PVC
the first time (later starts find run.yaml there and resume), takes the run's Lease and drives the run with the
same scheduler loop as `cona run`. `StatusMirror` is the run directory's window for a laptop that cannot see the
PVC: every few seconds it writes `cona status`'s summary into the ConfigMap and reads back what `cona stop` and
`cona report` asked for (a stop goes into control.json, a report into the `R-report` ConfigMap). A report is
rendered on a thread of its own: drawing it takes seconds (tens on a loaded node), and the scheduler's loop must
go on watching the run, acting on a stop and deciding switches meanwhile.

Exit codes: 0 once the run has ended (done, stopped or failed: its status is in the ConfigMap, and restarting the
pod would not change it), also when it cannot start or go on for a reason a restart would meet again (a bad
profile, missing data, a damaged run directory: failed, with the reason in the ConfigMap); non-zero when the
orchestrator itself failed (a lost Lease, an API outage, a bug), so that Kubernetes restarts it
(`restartPolicy: OnFailure`) and it adopts the running attempt.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import yaml
from cona.orchestrator.backends.base import BackendError
from cona.orchestrator.backends.kubernetes.api import KubeApi, one_line
from cona.orchestrator.backends.kubernetes.runobjects import (
    AMEND_KEY,
    JOB_KEY,
    OWNER_JOB_ENV,
    OWNER_UID_ENV,
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
    VERSION_KEY,
    owner_reference,
    report_configmap_name,
    run_labels,
)
from cona.protocol.yamlconfig import ConfigError

if TYPE_CHECKING:
    from cona.orchestrator.profile import ClusterProfile
    from cona.protocol.rundir import RunDir

MAX_CONFIGMAP_BYTES = 1_000_000
"""What the API server stores in one ConfigMap (1 MiB), less room for its metadata."""


def orchestrator_owner() -> dict[str, Any] | None:
    """The ownerReference to the orchestrator Job this process runs in (`cona submit`'s, through the downward
    API), else None (`cona run` from a pod of one's own)."""
    name, uid = os.environ.get(OWNER_JOB_ENV, ""), os.environ.get(OWNER_UID_ENV, "")
    return owner_reference(name, uid) if name and uid else None


def read_run_configmap(api: KubeApi, run: str) -> dict[str, str]:
    """The data of run `run`'s ConfigMap; a missing one is a one-line error."""
    core = api.core()
    found = api.call("get", "configmaps", run, core.read_namespaced_config_map, run, api.namespace, missing_ok=True)
    if found is None:
        raise BackendError(
            f"kubernetes: no run {run!r} in namespace {api.namespace!r} (no ConfigMap {run!r}); `cona submit` "
            "prints the run's name, `kubectl get configmaps -l app.kubernetes.io/part-of=cona` lists them"
        )
    return dict(found.data or {})


def store_report(api: KubeApi, run: str, run_dir: RunDir) -> str:
    """Write the run's report and keep it in the `R-report` ConfigMap; returns a note on what was stored."""
    from cona.orchestrator.report import write_report

    png, md = write_report(run_dir)
    data = {REPORT_MD: md.read_text(), "generated": f"{time.time():.3f}"}
    binary: dict[str, str] = {}
    png_bytes = png.read_bytes()
    note = "report.md and report.png"
    if len(png_bytes) * 4 // 3 + len(data[REPORT_MD]) < MAX_CONFIGMAP_BYTES:
        binary[REPORT_PNG] = base64.b64encode(png_bytes).decode()
    else:
        note = f"report.md only (report.png is {len(png_bytes):,} bytes, over a ConfigMap's 1 MiB; it is at {png})"
        data[REPORT_MD] += f"\n\n_{note}_\n"
    name = report_configmap_name(run)
    metadata: dict[str, Any] = {"name": name, "namespace": api.namespace, "labels": run_labels(run, "report")}
    owner = orchestrator_owner()
    if owner is not None:  # deleted with the run's orchestrator Job, like everything else the run created
        metadata["ownerReferences"] = [owner]
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data, "binaryData": binary}
    core = api.core()
    created = api.call("create", "configmaps", name, core.create_namespaced_config_map, api.namespace, body,
                       conflict_ok=True)  # fmt: skip
    if created is None:
        # Replaced key by key: a merge patch with the new keys (and none removed: the same two keys each time).
        api.call("patch", "configmaps", name, core.patch_namespaced_config_map, name, api.namespace,
                 {"data": data, "binaryData": binary or {REPORT_PNG: None}})  # fmt: skip
    return note


class StatusMirror:
    """The run's ConfigMap kept up to date from the run directory, and the laptop's requests carried back."""

    def __init__(self, api: KubeApi, run: str, run_dir: RunDir, *, interval_s: float = 5.0) -> None:
        self.api = api
        self.run = run
        self.run_dir = run_dir
        self.interval_s = interval_s
        self._last = 0.0
        self._seen: str | None = None
        self._stops_seen: set[str] = set()
        self._report: threading.Thread | None = None
        self._report_token: str | None = None

    def _summary(self) -> dict[str, Any]:
        from cona.orchestrator.live import status_summary

        return status_summary(self.run_dir)

    def publish(self, summary: dict[str, Any] | None = None) -> dict[str, str]:
        """Write the summary into the ConfigMap (one PATCH, whose answer also carries the requests); returns the
        ConfigMap's data."""
        summary = summary if summary is not None else self._summary()
        core = self.api.core()
        patched = self.api.call("patch", "configmaps", self.run, core.patch_namespaced_config_map, self.run,
                                self.api.namespace, {"data": {STATUS_KEY: json.dumps(summary, sort_keys=True)}})  # fmt: skip
        self._last = time.monotonic()
        return dict(patched.data or {}) if patched is not None else {}

    def tick(self, status: str | None = None, *, force: bool = False) -> None:
        """Called from the scheduler's loop with its live status (else the state.json one): publish every
        `interval_s`, or at once when the status changed, then act on the requests found."""
        if status is None:
            from cona.orchestrator.runstate import read_state

            status = read_state(self.run_dir).status
        if not force and status == self._seen and time.monotonic() - self._last < self.interval_s:
            return
        self._seen = status
        self.handle(self.publish())

    def handle(self, data: dict[str, str]) -> None:
        """Carry out what the laptop asked for through the ConfigMap."""
        from cona.orchestrator.runstate import read_events, request_stop

        stop = data.get(STOP_KEY)
        if stop and stop not in self._stops_seen:
            self._stops_seen.add(stop)
            reason = f"cona stop ({stop})"
            # Once per token, also across orchestrator restarts: the token's stop is in the event log.
            if not any(e.get("event") == "stop-command" and e.get("reason") == reason for e in read_events(self.run_dir)):
                request_stop(self.run_dir, reason=reason)
        request = data.get(REPORT_REQUEST_KEY)
        if request and request != data.get(REPORT_DONE_KEY) and request != self._report_token and not self.reporting:
            self._report_token = request
            self._report = threading.Thread(target=self._serve_report, args=(request,), name="cona-report", daemon=True)
            self._report.start()

    @property
    def reporting(self) -> bool:
        """Whether a requested report is being written now."""
        return self._report is not None and self._report.is_alive()

    def _serve_report(self, token: str) -> None:
        """Write the report asked for with `token`, store it and echo the token (on the report thread); a failure
        is echoed as `token: why`, which `cona report` prints, and never ends the run."""
        core = self.api.core()
        try:
            store_report(self.api, self.run, self.run_dir)
            answer = {REPORT_DONE_KEY: token}
        except Exception as e:  # the report is a courtesy: the run goes on, the laptop learns why
            why = one_line(str(e)) or type(e).__name__
            print(f"cona: no report for request {token}: {why}", flush=True)
            answer = {REPORT_ERROR_KEY: f"{token}: {why}"}
        try:
            self.api.call("patch", "configmaps", self.run, core.patch_namespaced_config_map, self.run,
                          self.api.namespace, {"data": answer})  # fmt: skip
        except Exception as e:  # the next request asks again; an API outage ends the loop's own calls
            print(f"cona: could not answer report request {token}: {one_line(str(e))}", flush=True)

    def wait_report(self) -> None:
        """Let a report being written finish (before the final one is drawn: one drawing at a time)."""
        if self._report is not None:
            self._report.join()

    def fail(self, reason: str) -> None:
        """The run could not even start (bad profile, missing data): say so where `cona status` looks."""
        self.publish({"status": "failed", "reason": reason, "run_dir": str(self.run_dir.root)})


def _resume_pending(run_dir: RunDir, token: str, finished_at: float | None) -> bool:
    """Whether `cona submit --resume` asked with `token` and the run has not ended since that resume started."""
    from cona.orchestrator.runstate import read_events

    started = [e["time"] for e in read_events(run_dir) if e.get("event") == "resume-requested" and e.get("token") == token]
    return not started or (finished_at is not None and finished_at < max(started))


def _amended(run_dir: RunDir, data: dict[str, str], token: str | None) -> ClusterProfile | None:
    """The run's profile after the overrides `cona submit --resume` stored for `token` (`AMEND_KEY`), applied to
    run.yaml once (`runstate.amend_profile`; a restarted orchestrator finds its `profile-amended` event); None when
    this resume asked for none. The run's Lease, not its flock, keeps other orchestrators out."""
    from cona.orchestrator.runstate import amend_profile, read_events

    try:
        asked = json.loads(data.get(AMEND_KEY) or "{}")
    except ValueError:
        asked = {}
    if not token or not isinstance(asked, dict) or asked.get("token") != token:
        return None
    overrides = [str(item) for item in asked.get("profile_set") or []]
    if not overrides or any(e.get("event") == "profile-amended" and e.get("token") == token for e in read_events(run_dir)):
        return None
    return amend_profile(run_dir, overrides, lock=False, token=token)


def _cannot_go_on(mirror: StatusMirror, error: Exception) -> int:
    """Fail the run where `cona status` looks, with `error` as the reason, and return the exit code 0: a restarted
    pod would fail the same way (`restartPolicy: OnFailure` would restart it for ever), and the reason is in the
    ConfigMap. The run directory is left as it is: once its owner fixed it, `cona submit --resume` goes on."""
    reason = one_line(str(error))
    mirror.fail(reason)
    print(f"cona: error: {reason}", flush=True)
    return 0


def _version_skew(submitted_by: str | None) -> str:
    """What to add to an error about the ConfigMap's profile or job when another cona submitted it: a field this
    image does not know is most likely one that a newer cona added."""
    from cona.orchestrator import cona_version

    ours = cona_version()
    if not submitted_by or submitted_by == ours:
        return ""
    return (f" (the run was submitted by cona {submitted_by}, this orchestrator image runs cona {ours}: set "
            f"kubernetes.image to an image of cona {submitted_by})")  # fmt: skip


def orchestrate(run: str, *, namespace: str, api_client: Any | None = None, quiet: bool = False) -> int:
    """Drive submitted run `run` (see the module docstring); returns the process's exit code."""
    from cona.orchestrator.job import job_from_dict
    from cona.orchestrator.profile import ClusterProfile
    from cona.orchestrator.runstate import create_run, load_run, log_event, read_state
    from cona.orchestrator.scheduler import drive
    from cona.protocol.rundir import RunDir
    from cona.protocol.yamlconfig import validate

    api = KubeApi(namespace, api_client)
    data = read_run_configmap(api, run)
    if RUN_DIR_KEY not in data:
        raise BackendError(f"kubernetes: ConfigMap {run!r} in namespace {namespace!r} has no {RUN_DIR_KEY!r}; "
                           "it was not written by cona submit")  # fmt: skip
    run_dir = RunDir(data[RUN_DIR_KEY])
    mirror = StatusMirror(api, run, run_dir)
    try:
        if run_dir.run_yaml.exists():
            # A restarted orchestrator: resume (and adopt) the run. Read as `cona status` reads it, so that a run
            # that has ended is still reported; `drive` refuses to go on with a damaged one (below).
            profile, job = load_run(run_dir)
        else:
            where = f"ConfigMap {namespace}/{run}"
            try:
                profile = validate(ClusterProfile, yaml.safe_load(data.get(PROFILE_KEY) or "{}"),
                                   source=f"{where} {PROFILE_KEY}")  # fmt: skip
                job = job_from_dict(yaml.safe_load(data.get(JOB_KEY) or "{}"), source=f"{where} {JOB_KEY}")
            except ConfigError as e:
                raise ConfigError(f"{e}{_version_skew(data.get(VERSION_KEY))}") from None
            create_run(run_dir=run_dir, profile=profile, job=job)
        state = read_state(run_dir)  # a corrupt state.json: one line naming it
    except (ConfigError, OSError) as e:
        return _cannot_go_on(mirror, e)
    token = data.get(RESUME_KEY)
    if state.final and not (token and _resume_pending(run_dir, token, state.finished_at)):
        # The run had ended before this process started (it died after the end, before exiting): just report.
        mirror.handle(mirror.publish())
        mirror.wait_report()
        return 0
    if state.final:
        try:  # `cona submit --resume --profile-set ...`: the fix it names goes into the run's stored profile first
            profile = _amended(run_dir, data, token) or profile
        except ConfigError as e:
            return _cannot_go_on(mirror, e)
        log_event(run_dir, "resume-requested", token=token)  # `cona submit --resume`: the scheduler resumes it
    try:
        state, failure = drive(run_dir=run_dir, profile=profile, job=job, quiet=quiet,
                               also=lambda live: mirror.tick(live.status))  # fmt: skip
    except ConfigError as e:
        # Refused in one line, as `cona run` refuses it with exit 2: the run directory (`Scheduler.check_resumable`,
        # before anything is launched or written: a run.yaml cut short, state.json lost while the run has attempts)
        # or another input a restart would meet again. A lost Lease or an API outage is no ConfigError: restarted.
        mirror.wait_report()
        return _cannot_go_on(mirror, e)
    if failure is not None:
        print(f"cona: error: {failure}", flush=True)
    # The report first, then the final status: a laptop that sees the run ended finds its report stored.
    mirror.wait_report()
    try:
        note = store_report(api, run, run_dir)
        print(f"cona: stored the report in ConfigMap {report_configmap_name(run)}: {note}", flush=True)
    except Exception as e:  # a courtesy: it must never turn an ended run into a failed orchestrator (restarted)
        print(f"cona: no report for run {run} ({state.status}): {one_line(str(e))}", flush=True)
    mirror.tick(force=True)
    return 0
