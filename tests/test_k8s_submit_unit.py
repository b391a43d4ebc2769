"""`cona submit`'s objects, the Lease and the laptop's view of a run, without running any pod.

The rendered ConfigMap and orchestrator Job are golden files validated against the Kubernetes schemas (strict);
the Lease and `cona status/stop` run against the API emulator with scripted pod states. The whole submitted run
(orchestrator and trainer pods as local processes) is in tests/test_k8s_submit.py.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml
from cona.orchestrator.backends.base import Attempt, BackendError
from cona.orchestrator.backends.kubernetes import incluster
from cona.orchestrator.backends.kubernetes.api import KubeApi
from cona.orchestrator.backends.kubernetes.incluster import StatusMirror, orchestrate
from cona.orchestrator.backends.kubernetes.lease import KubeLease, LeaseLost
from cona.orchestrator.backends.kubernetes.remote import (
    remote_report,
    remote_status,
    remote_stop,
    resume,
    submit,
)
from cona.orchestrator.backends.kubernetes.runobjects import (
    RUN_NAME_MAX,
    dump_objects,
    render_submission,
    run_name,
)
from cona.orchestrator.job import load_job
from cona.orchestrator.runstate import RunState, create_run, load_run, read_events, write_state
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError
from kubernetes import client

from tests.conftest import EXAMPLES, REPO, run_cona
from tests.test_k8s_manifests import K8S_PROFILE, _golden, _profile, _validate, k8s_expand

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),  # inside kmock
]

NS = "cona"
JOB = EXAMPLES / "tiny-gpt.yaml"
SUBMITTED = 1796300000.0


def _job():
    job = load_job(JOB)
    job.data.path = "/runs/data/shakespeare.txt"
    return job


def _objects(run: str = "tiny-1", **kubernetes):
    return render_submission(profile=_profile(**kubernetes), job=_job(), run=run, submitted=SUBMITTED)


def namespace_objects(k8s, namespace: str = NS, *, pvc: str | None = "cona-runs",
                      modes: tuple[str, ...] = ("ReadWriteMany",), account: str | None = "cona") -> None:  # fmt: skip
    """What `kubectl apply -k manifests/` leaves in the namespace and `cona submit` checks: the PVC (with its access
    modes) and the ServiceAccount. Created by a client of the test's own, which no request log counts."""
    core = client.CoreV1Api(k8s.api_client("cona-test-setup"))
    if pvc is not None:
        core.create_namespaced_persistent_volume_claim(namespace, {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": pvc},
            "spec": {"accessModes": list(modes), "resources": {"requests": {"storage": "1Ti"}}}})  # fmt: skip
    if account is not None:
        core.create_namespaced_service_account(namespace, {"apiVersion": "v1", "kind": "ServiceAccount",
                                                           "metadata": {"name": account}})  # fmt: skip


# ---- rendering ----------------------------------------------------------------------------------------------------


def test_submission_golden_and_valid():
    objects = _objects()
    assert [o["kind"] for o in objects] == ["ConfigMap", "Job"]
    for obj in objects:
        _validate(obj)
    _golden("submit.yaml", dump_objects(objects))
    configmap, job = objects
    # The ConfigMap holds what the orchestrator creates run.yaml from: the resolved profile and job.
    assert yaml.safe_load(configmap["data"]["profile.yaml"])["name"] == "h100-k8s"
    assert yaml.safe_load(configmap["data"]["job.yaml"])["data"]["path"] == "/runs/data/shakespeare.txt"
    assert configmap["data"]["run-dir"] == "/runs/tiny-1"
    spec = job["spec"]
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    assert pod["restartPolicy"] == "OnFailure" and spec["backoffLimit"] == 10
    assert container["command"] == ["python", "-m", "cona.orchestrator.cli", "orchestrate", "--namespace", NS, "tiny-1"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}.items() <= pod["securityContext"].items()
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/runs", "/tmp"}
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["CONA_OWNER_UID"] == "metadata.labels['batch.kubernetes.io/controller-uid']"
    assert "nodeSelector" not in pod and "nvidia.com/gpu" not in json.dumps(container["resources"])


def test_submission_with_pull_secrets_and_priority_golden_and_valid():
    """The orchestrator pod pulls the image as the trainer pods do and has their priority."""
    objects = _objects(image_pull_secrets=["regcred"], priority_class="ml-high")
    for obj in objects:
        _validate(obj)
    _golden("submit-pull-secrets-and-priority.yaml", dump_objects(objects))
    pod = objects[1]["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}] and pod["priorityClassName"] == "ml-high"
    profile = yaml.safe_load(objects[0]["data"]["profile.yaml"])["kubernetes"]  # what the orchestrator renders from
    assert (profile["image_pull_secrets"], profile["priority_class"]) == (["regcred"], "ml-high")


def test_the_example_run_in_manifests_is_what_submit_renders():
    """manifests/examples/run.yaml is `cona submit --dry-run` of the example profile; it must not drift."""
    out = run_cona("submit", "--profile", str(K8S_PROFILE), "--job", str(JOB), "--name", "tiny-gpt-example",
                   "--set", "data.path=/runs/data/shakespeare.txt", "--dry-run")  # fmt: skip
    assert out.returncode == 0, out.stderr
    example = REPO / "manifests" / "examples" / "run.yaml"
    text = example.read_text()
    body = text[text.index("apiVersion") :] if text.startswith("#") else text
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    stored = [d for d in yaml.safe_load_all(body) if d]
    for doc in rendered + stored:
        doc["data"].pop("submitted", None) if doc["kind"] == "ConfigMap" else None
    assert stored == rendered, "manifests/examples/run.yaml is stale: regenerate it with the command in its header"
    for doc in stored:
        _validate(doc)


def test_the_configmap_carries_what_was_set_and_reads_back_the_same():
    """An orchestrator image older than the CLI refuses a field it does not know: the ConfigMap carries only the
    fields the profile and job files set (and what their validators set), so a field added since, left at its
    default, never reaches it; and what it carries validates to the same profile and job."""
    from cona.orchestrator.job import job_from_dict
    from cona.orchestrator.profile import ClusterProfile, load_profile
    from cona.protocol.yamlconfig import validate

    profile = load_profile(K8S_PROFILE)
    data = _objects(run="tiny-1")[0]["data"]
    carried_profile, carried_job = yaml.safe_load(data["profile.yaml"]), yaml.safe_load(data["job.yaml"])
    written_profile, written_job = yaml.safe_load(K8S_PROFILE.read_text()), yaml.safe_load(JOB.read_text())
    assert set(carried_profile) <= set(written_profile)
    assert set(carried_profile["kubernetes"]) <= set(written_profile["kubernetes"])
    assert "host_network" not in carried_profile["kubernetes"] and "slurm" not in carried_profile
    assert set(carried_job) <= set(written_job) and set(carried_job["policy"]) <= set(written_job.get("policy", {}))
    # A value the file gave, even the default's, is kept: some validators tell it from a field left out.
    assert carried_profile["kubernetes"]["workload"] == written_profile["kubernetes"]["workload"] == "indexed-job"
    assert validate(ClusterProfile, carried_profile, source="cm").model_dump(mode="json") == profile.model_dump(mode="json")
    assert job_from_dict(carried_job).model_dump(mode="json") == _job().model_dump(mode="json")
    # Set on the command line (--profile-set), a field is carried like one in the file.
    carried = yaml.safe_load(_objects(run="tiny-1", host_network=True)[0]["data"]["profile.yaml"])
    assert carried["kubernetes"]["host_network"] is True


def test_hostile_run_names_and_values_are_refused_or_inert(renderer_without_image_check):
    with pytest.raises(ConfigError, match=r"--name 'a\$\(id\)': not a DNS-1035 label"):
        _objects(run="a$(id)")
    with pytest.raises(ConfigError, match="--name"):
        _objects(run="x" * (RUN_NAME_MAX + 1))
    with pytest.raises(ConfigError, match=r"kubernetes\.namespace"):
        _objects(namespace="cona\n$(rm -rf /)")
    with pytest.raises(ConfigError, match=r"kubernetes\.orchestrator_memory"):
        _objects(orchestrator_memory="2 GB")
    assert run_name("My Run: $(id)!") == "my-run-id" and len(run_name("a" * 99)) == RUN_NAME_MAX
    image = "registry.example/cona:v1\"';$(id)"
    _, job = _objects(image=image)
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == image and all(k8s_expand(a, {}) == a for a in container["command"][3:])


def test_run_root_must_lie_under_the_mount():
    profile = _profile()
    profile = profile.model_copy(update={"storage": profile.storage.model_copy(update={"run_root": "/elsewhere"})})
    with pytest.raises(ConfigError, match=r"storage\.run_root ./elsewhere. is not under kubernetes\.mount_path"):
        render_submission(profile=profile, job=_job(), run="r", submitted=SUBMITTED)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--profile", "slurm/profiles/local-cpu.yaml"], "backend is 'local'; cona submit needs a kubernetes profile"),
        (["--profile", str(K8S_PROFILE), "--set", "data.path=data/x.txt"], "data.path 'data/x.txt' is relative"),
        (["--profile", str(K8S_PROFILE), "--set", "data.path=/runs/x", "--name", "Bad_Name"], "--name 'Bad_Name'"),
        (["--profile", str(K8S_PROFILE), "--set", "data.path=/runs/x", "-n", "other"],
         "-n/--namespace is for --resume; a new run goes to the profile's kubernetes.namespace"),
        (["--profile", str(K8S_PROFILE), "--set", "data.path=/runs/x", "--policy", "fixed:dp=64,tp=1,pp=1,mbs=1,gbs=64"],
         "dp=64"),
    ],
)  # fmt: skip
def test_submit_refuses_bad_input_before_creating_anything(args, message, tmp_path):
    out = run_cona("submit", "--job", str(JOB), *args, env={"KUBECONFIG": str(tmp_path / "none")})
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


# ---- creating a run and following it --------------------------------------------------------------------------------


def test_submit_creates_the_configmap_then_the_job_and_refuses_a_second_run_of_the_name(k8s):
    namespace_objects(k8s)
    objects = _objects()
    assert submit(objects, api_client=k8s.api_client()) == ("tiny-1", NS)
    core = client.CoreV1Api(k8s.api_client())
    assert core.read_namespaced_config_map("tiny-1", NS).data["run-dir"] == "/runs/tiny-1"
    assert client.BatchV1Api(k8s.api_client()).read_namespaced_job("tiny-1-orch", NS).spec.backoff_limit == 10
    k8s.refuse("POST", "", "v1", "configmaps", status=409, message='configmaps "tiny-1" already exists')
    with pytest.raises(BackendError, match="a run named 'tiny-1' exists already in namespace 'cona'; pick another --name"):
        submit(objects, api_client=k8s.api_client())


def test_a_job_that_cannot_be_created_leaves_no_configmap(k8s):
    namespace_objects(k8s)
    k8s.refuse("POST", "batch", "v1", "jobs", status=403, message="forbidden")
    with pytest.raises(BackendError, match="lack create on jobs"):
        submit(_objects(), api_client=k8s.api_client())
    names = [c.metadata.name for c in client.CoreV1Api(k8s.api_client()).list_namespaced_config_map(NS).items]
    assert "tiny-1" not in names


def test_status_of_a_run_whose_orchestrator_cannot_start(k8s):
    namespace_objects(k8s)
    submit(_objects(), api_client=k8s.api_client())
    status = remote_status("tiny-1", namespace=NS, api_client=k8s.api_client())
    assert status["status"] == "submitted" and status["orchestrator"] == "Job tiny-1-orch: no pod yet"
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                     "message": "0/4 nodes are available: 4 Insufficient memory."}  # fmt: skip
    k8s.make_pods("tiny-1-orch", NS, phase="Pending", conditions=[unschedulable])
    status = remote_status("tiny-1", namespace=NS, api_client=k8s.api_client())
    assert status["orchestrator"].endswith("Pending, 0 restart(s): 0/4 nodes are available: 4 Insufficient memory.")
    with pytest.raises(BackendError, match=r"no run 'nope' in namespace 'cona' \(no ConfigMap 'nope'\)"):
        remote_status("nope", namespace=NS, api_client=k8s.api_client())


def test_a_run_whose_orchestrator_job_failed_is_failed_whatever_it_mirrored_last(k8s):
    namespace_objects(k8s)
    submit(_objects(), api_client=k8s.api_client())
    client.CoreV1Api(k8s.api_client()).patch_namespaced_config_map(
        "tiny-1", NS, {"data": {"status.json": json.dumps({"status": "running", "run_dir": "/runs/tiny-1"})}})
    k8s.set_job_status("tiny-1-orch", NS, conditions=[{"type": "Failed", "status": "True",
                       "reason": "BackoffLimitExceeded", "message": "Job has reached the specified backoff limit"}])  # fmt: skip
    status = remote_status("tiny-1", namespace=NS, api_client=k8s.api_client())
    assert status["status"] == "failed"
    assert status["reason"] == ("Job tiny-1-orch failed: BackoffLimitExceeded Job has reached the specified backoff "
                                "limit; the last status it mirrored was running")  # fmt: skip


def _mirrored(k8s, status: str) -> None:
    client.CoreV1Api(k8s.api_client()).patch_namespaced_config_map(
        "tiny-1", NS, {"data": {"status.json": json.dumps({"status": status, "run_dir": "/runs/tiny-1"})}})


def test_resume_replaces_the_orchestrator_job_of_an_ended_run_and_refuses_otherwise(k8s):
    namespace_objects(k8s)
    submit(_objects(), api_client=k8s.api_client())
    for status, message in (("running", "is running, not ended; stop it first"), ("done", "has finished (done)")):
        _mirrored(k8s, status)
        with pytest.raises(BackendError, match=re.escape(message)):
            resume("tiny-1", namespace=NS, api_client=k8s.api_client())
    _mirrored(k8s, "stopped")
    assert "resuming run tiny-1 (stopped)" in resume("tiny-1", namespace=NS, api_client=k8s.api_client())
    data = client.CoreV1Api(k8s.api_client()).read_namespaced_config_map("tiny-1", NS).data
    assert data["resume"].startswith("resume-") and data["profile.yaml"]  # the run's ConfigMap is kept
    job = client.BatchV1Api(k8s.api_client()).read_namespaced_job("tiny-1-orch", NS)
    assert job.spec.template.spec.containers[0].command[-1] == "tiny-1"
    methods = [(m, p) for m, p in k8s.backend_requests() if p.endswith("/jobs/tiny-1-orch") or p.endswith("/jobs")]
    assert ("DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/tiny-1-orch") in methods
    assert methods.index(("DELETE", f"/apis/batch/v1/namespaces/{NS}/jobs/tiny-1-orch")) < len(methods) - 1


def test_resume_with_a_fixed_image_changes_the_configmap_the_orchestrator_job_and_the_stored_profile(k8s, tmp_path):
    """An attempt whose image cannot be pulled fails the run ("fix it and resume"), but the image is the profile's,
    which a resume kept: `cona submit --resume RUN --profile-set kubernetes.image=...` now changes it — in the
    ConfigMap, in the new orchestrator Job, and (by that orchestrator, once) in the run's stored profile."""
    namespace_objects(k8s)
    submit(_objects(), api_client=k8s.api_client())
    _mirrored(k8s, "failed")
    with pytest.raises(ConfigError, match=re.escape("--profile-set kubernetes.namespace=x: a resumed run keeps")):
        resume("tiny-1", namespace=NS, api_client=k8s.api_client(), profile_set=["kubernetes.namespace=x"])
    assert client.BatchV1Api(k8s.api_client()).read_namespaced_job("tiny-1-orch", NS)  # refused before any change
    # What `cona submit` refuses is refused here too, before the old orchestrator Job is deleted.
    for bad, message in [("kubernetes.image=ghcr.io/Team/cona:1", "kubernetes.image"),
                         ("kubernetes.orchestrator_memory=2GB", "kubernetes.orchestrator_memory: '2GB' is not a quantity"),
                         ("kubernetes.trainer_cpu=lots", "kubernetes.trainer_cpu: 'lots' is not a quantity")]:  # fmt: skip
        with pytest.raises(BackendError, match=re.escape(message)):
            resume("tiny-1", namespace=NS, api_client=k8s.api_client(), profile_set=[bad])
        assert client.BatchV1Api(k8s.api_client()).read_namespaced_job("tiny-1-orch", NS)
    before = yaml.safe_load(client.CoreV1Api(k8s.api_client()).read_namespaced_config_map("tiny-1", NS).data["profile.yaml"])
    resume("tiny-1", namespace=NS, api_client=k8s.api_client(), profile_set=["kubernetes.image=reg.example/cona:fixed"])
    data = client.CoreV1Api(k8s.api_client()).read_namespaced_config_map("tiny-1", NS).data
    assert yaml.safe_load(data["profile.yaml"])["kubernetes"]["image"] == "reg.example/cona:fixed"
    # Only what was set is stored, as `cona submit` stored it (an older orchestrator image reads it).
    after = yaml.safe_load(data["profile.yaml"])
    assert set(after["kubernetes"]) == set(before["kubernetes"]) and set(after) == set(before), (before, after)
    asked = json.loads(data["profile-amended"])
    assert asked == {"token": data["resume"], "profile_set": ["kubernetes.image=reg.example/cona:fixed"]}
    job = client.BatchV1Api(k8s.api_client()).read_namespaced_job("tiny-1-orch", NS)
    assert job.spec.template.spec.containers[0].image == "reg.example/cona:fixed"

    # The new orchestrator: the run directory on the PVC, ended, still with the old image.
    profile = _profile(mount_path=str(tmp_path))
    run_dir = RunDir(tmp_path / "tiny-1")
    create_run(run_dir=run_dir, profile=profile, job=load_job(JOB))
    write_state(run_dir, RunState(status="failed", final=True, reason="image cannot be pulled"))
    amended = incluster._amended(run_dir, data, data["resume"])
    assert amended is not None and amended.kubernetes.image == "reg.example/cona:fixed"
    assert load_run(run_dir, resume=True)[0].kubernetes.image == "reg.example/cona:fixed"
    assert incluster._amended(run_dir, data, data["resume"]) is None  # a restarted orchestrator: applied once
    assert incluster._amended(run_dir, data, "resume-another") is None  # a later resume that asked for nothing
    assert [e["token"] for e in read_events(run_dir) if e["event"] == "profile-amended"] == [data["resume"]]


def test_cona_status_of_an_unknown_name_is_one_line(k8s, tmp_path):
    config = k8s.write_kubeconfig(tmp_path / "kubeconfig", token="laptop", namespace=NS)
    out = run_cona("status", "nope", env={"KUBECONFIG": str(config)})
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "no run 'nope' in namespace 'cona'" in out.stderr
    out = run_cona("status", str(tmp_path / "missing-dir"))
    assert out.returncode == 2 and "not a cona run directory" in out.stderr, out.stderr


def test_the_mirror_publishes_status_and_carries_a_stop_once(k8s, tmp_path):
    run_dir = RunDir(tmp_path / "runs" / "tiny-1")
    profile = _profile(mount_path=str(tmp_path / "runs"))
    profile = profile.model_copy(update={"storage": profile.storage.model_copy(update={"run_root": str(tmp_path / "runs")})})
    job = load_job(JOB)
    create_run(run_dir=run_dir, profile=profile, job=job)
    objects = render_submission(profile=profile, job=job, run="tiny-1", submitted=SUBMITTED)
    namespace_objects(k8s)
    submit(objects, api_client=k8s.api_client())
    api = KubeApi(NS, k8s.api_client())
    mirror = StatusMirror(api, "tiny-1", run_dir, interval_s=3600)
    mirror.tick()
    status = remote_status("tiny-1", namespace=NS, api_client=k8s.api_client())
    assert status["status"] == "created" and status["job"] == "tiny-gpt" and status["run_dir"] == str(run_dir.root)
    assert "asked run tiny-1 to stop" in remote_stop("tiny-1", namespace=NS, api_client=k8s.api_client())
    mirror.tick()  # within the interval and the status unchanged: nothing read yet
    assert run_dir.read_control() is None
    mirror.tick(force=True)
    control = run_dir.read_control()
    assert control is not None and control.command == "stop" and control.reason.startswith("cona stop (stop-")
    # The same request again (a restarted orchestrator reads the same ConfigMap) is not a second stop.
    StatusMirror(api, "tiny-1", run_dir).tick(force=True)
    assert [e["event"] for e in read_events(run_dir)].count("stop-command") == 1


def test_a_report_is_drawn_off_the_loop_and_a_failed_one_is_one_line(k8s, tmp_path, monkeypatch):
    """While a requested report is being drawn (seconds, tens on a loaded node) the loop goes on: a stop that
    arrives meanwhile is acted on at the next tick. A report that cannot be drawn answers the laptop with why."""
    import threading

    run_dir = RunDir(tmp_path / "runs" / "tiny-1")
    profile = _profile(mount_path=str(tmp_path / "runs"))
    profile = profile.model_copy(update={"storage": profile.storage.model_copy(update={"run_root": str(tmp_path / "runs")})})
    job = load_job(JOB)
    create_run(run_dir=run_dir, profile=profile, job=job)
    namespace_objects(k8s)
    submit(render_submission(profile=profile, job=job, run="tiny-1", submitted=SUBMITTED), api_client=k8s.api_client())
    api = KubeApi(NS, k8s.api_client())
    mirror = StatusMirror(api, "tiny-1", run_dir, interval_s=3600)
    mirror.tick(force=True)
    drawing, release, drawn = threading.Event(), threading.Event(), []
    store_report = incluster.store_report

    def slow_report(api_, run, run_dir_):
        drawing.set()
        assert release.wait(30)
        if drawn:
            raise RuntimeError("matplotlib: no space left on device")
        drawn.append(run)
        return store_report(api_, run, run_dir_)

    monkeypatch.setattr(incluster, "store_report", slow_report)
    fetched: list = []

    def ask() -> threading.Thread:
        """`cona report` on the laptop (a thread); the orchestrator's loop ticks until the drawing has begun."""
        laptop = threading.Thread(target=lambda: fetched.append(_report_or_error(k8s, tmp_path / "out", wait_s=30)))
        laptop.start()
        deadline = time.monotonic() + 20
        while not drawing.is_set() and time.monotonic() < deadline:
            mirror.tick(force=True)
            time.sleep(0.05)
        return laptop

    laptop = ask()
    assert drawing.is_set() and mirror.reporting
    remote_stop("tiny-1", namespace=NS, api_client=k8s.api_client())
    started = time.monotonic()
    mirror.tick(force=True)  # the report is still being drawn: the tick does not wait for it
    assert time.monotonic() - started < 5 and mirror.reporting
    control = run_dir.read_control()
    assert control is not None and control.command == "stop"
    release.set()
    mirror.wait_report()
    laptop.join(30)
    assert drawn == ["tiny-1"] and fetched and not isinstance(fetched[0], str), fetched
    assert fetched[0][0].read_text() == (run_dir.root / "report.md").read_text()

    # A second request whose drawing fails: the laptop gets the reason in one line, the loop goes on.
    drawing.clear()
    laptop = ask()
    mirror.wait_report()
    laptop.join(30)
    assert fetched[-1] == ("kubernetes: run 'tiny-1': the orchestrator could not write the report: matplotlib: no "
                           "space left on device"), fetched  # fmt: skip


def _report_or_error(k8s, out_dir, *, wait_s: float):
    """`cona report`'s fetch on the laptop: the paths, or the one-line error it would print."""
    try:
        return remote_report("tiny-1", namespace=NS, out_dir=out_dir, wait_s=wait_s, api_client=k8s.api_client())
    except BackendError as e:
        return str(e)


def test_orchestrate_a_run_that_cannot_start_records_why_and_exits_0(k8s, tmp_path):
    profile = _profile(mount_path=str(tmp_path))
    profile = profile.model_copy(update={"storage": profile.storage.model_copy(update={"run_root": str(tmp_path)})})
    job = load_job(JOB)
    job.data.path = str(tmp_path / "no-such-data.txt")
    namespace_objects(k8s)
    submit(render_submission(profile=profile, job=job, run="r9", submitted=SUBMITTED), api_client=k8s.api_client())
    assert orchestrate("r9", namespace=NS, api_client=k8s.api_client(), quiet=True) == 0
    status = remote_status("r9", namespace=NS, api_client=k8s.api_client())
    assert status["status"] == "failed" and "no-such-data.txt' does not exist" in status["reason"], status


@pytest.mark.parametrize("submitted_by", ["9.9.0", None])
def test_a_newer_clis_field_fails_the_run_naming_both_versions(k8s, tmp_path, submitted_by):
    """An orchestrator image older than the CLI that submitted the run does not know a field the user set: the run
    fails with the field and, when the ConfigMap says which cona submitted it, both versions and what to change."""
    from cona.orchestrator import cona_version

    profile = _profile(mount_path=str(tmp_path))
    profile = profile.model_copy(update={"storage": profile.storage.model_copy(update={"run_root": str(tmp_path)})})
    objects = render_submission(profile=profile, job=load_job(JOB), run="r7", submitted=SUBMITTED)
    data = objects[0]["data"]
    data["profile.yaml"] += "warp_drive: true\n"  # what a newer cona's profile might carry
    if submitted_by is None:
        del data["cona-version"]  # a ConfigMap of a cona before the key
    else:
        data["cona-version"] = submitted_by
    namespace_objects(k8s)
    submit(objects, api_client=k8s.api_client())
    assert orchestrate("r7", namespace=NS, api_client=k8s.api_client(), quiet=True) == 0
    reason = remote_status("r7", namespace=NS, api_client=k8s.api_client())["reason"]
    assert "unknown field 'warp_drive'" in reason and "\n" not in reason, reason
    skew = (f"(the run was submitted by cona 9.9.0, this orchestrator image runs cona {cona_version()}: set "
            "kubernetes.image to an image of cona 9.9.0)")
    assert reason.endswith(skew) if submitted_by else "submitted by" not in reason, reason


@pytest.mark.parametrize("damage", ["run.yaml cut short", "state.json corrupt"])
def test_orchestrate_a_run_whose_directory_is_damaged_records_why_and_exits_0(k8s, tmp_path, monkeypatch, damage):
    """A restarted orchestrator pod that finds run.yaml cut short (refused by `drive`) or state.json unreadable
    exited 2 with a ConfigError, and `restartPolicy: OnFailure` restarted it into the same refusal for ever, the
    run shown as running. It is failed, with the reason, where `cona status` looks, and the run directory is left
    as it was for its owner to restore (then `cona submit --resume`)."""
    from cona.orchestrator.backends.kubernetes import api as kube_api

    # The scheduler's backend takes the run's Lease through the default client: the emulator's, not a kubeconfig.
    monkeypatch.setattr(kube_api, "default_client", k8s.api_client)
    profile = _profile(mount_path=str(tmp_path / "runs"))
    profile = profile.model_copy(update={"storage": profile.storage.model_copy(update={"run_root": str(tmp_path / "runs")})})
    job = load_job(JOB)
    run_dir = RunDir(tmp_path / "runs" / "r8")
    create_run(run_dir=run_dir, profile=profile, job=job)
    namespace_objects(k8s)
    submit(render_submission(profile=profile, job=job, run="r8", submitted=SUBMITTED), api_client=k8s.api_client())
    if damage == "run.yaml cut short":
        text = run_dir.run_yaml.read_text()
        run_dir.run_yaml.write_text(text[: text.index("    mbs_choices:")])  # inside job.batch
        write_state(run_dir, RunState(status="running", run_started=1.0, attempts_started=1,
                                      attempts=[Attempt(number=1, strategy=Strategy.parse("dp=1,tp=1,pp=1,mbs=4,gbs=16"))]))  # fmt: skip
        expected = f"{run_dir.run_yaml}: cut short or damaged"
    else:
        run_dir.state_json.write_text('{"status": "runn')
        expected = f"{run_dir.state_json}: unreadable"
    before = {p: p.read_bytes() for p in run_dir.root.rglob("*") if p.is_file()}
    assert orchestrate("r8", namespace=NS, api_client=k8s.api_client(), quiet=True) == 0
    status = remote_status("r8", namespace=NS, api_client=k8s.api_client())
    assert status["status"] == "failed" and status["reason"].startswith(expected), status
    assert {p: p.read_bytes() for p in run_dir.root.rglob("*") if p.is_file()} == before


# ---- the Lease --------------------------------------------------------------------------------------------------------


def _lease(k8s, identity: str, **kwargs) -> KubeLease:
    return KubeLease(KubeApi(NS, k8s.api_client()), "run1", identity=identity, **kwargs)


def test_one_holder_at_a_time_and_release_hands_over_at_once(k8s):
    a = _lease(k8s, "A", duration_s=3, renew_every_s=0.5)
    a.acquire()
    try:
        time.sleep(1.2)  # renewed meanwhile: B never sees it unchanged for a whole duration
        b = _lease(k8s, "B", duration_s=3, renew_every_s=0.5, wait_s=4)
        with pytest.raises(BackendError, match=r"Lease 'run1' in namespace 'cona' is held by another orchestrator \(A, "):
            b.acquire()
        a.check()
    finally:
        a.release()
    lease = client.CoordinationV1Api(k8s.api_client()).read_namespaced_lease("run1", NS)
    assert lease.spec.holder_identity is None
    started = time.monotonic()
    with _lease(k8s, "B", duration_s=3, renew_every_s=0.5) as b:
        assert time.monotonic() - started < 2.0 and b.held  # a released lease is taken at once, not after 3 s


def test_a_dead_holder_is_taken_over_after_one_duration(k8s):
    a = _lease(k8s, "A", duration_s=2, renew_every_s=0.5)
    a.acquire()
    a._stop.set()  # dies without releasing: no renewals from now on
    a._thread.join()
    started = time.monotonic()
    with _lease(k8s, "C", duration_s=2, renew_every_s=0.5):
        waited = time.monotonic() - started
        lease = client.CoordinationV1Api(k8s.api_client()).read_namespaced_lease("run1", NS)
        assert lease.spec.holder_identity == "C" and lease.spec.lease_transitions == 1
    assert 1.5 < waited < 6, waited


def test_a_holder_whose_lease_was_taken_stops_in_one_line(k8s):
    a = _lease(k8s, "A", duration_s=30, renew_every_s=0.2)
    a.acquire()
    coordination = client.CoordinationV1Api(k8s.api_client())
    coordination.patch_namespaced_lease("run1", NS, {"spec": {"holderIdentity": "intruder"}})
    deadline = time.monotonic() + 10
    while a.held and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(LeaseLost, match=r"lost Lease 'run1' in namespace 'cona' \(taken by intruder\)") as info:
        a.check()
    assert "\n" not in str(info.value)
    a.release()
    assert coordination.read_namespaced_lease("run1", NS).spec.holder_identity == "intruder"  # not ours to clear
