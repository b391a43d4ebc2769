"""`cona submit` on a real Kubernetes cluster, when one is given; skipped (with the reason) otherwise.

Needs: `KUBECONFIG` (a cluster where `kubectl apply -k manifests/` was applied and you may submit: the
`cona-submitter` Role), `CONA_K8S_IMAGE` (the image built from the root Dockerfile, pullable there), and the tiny
corpus on the PVC at `CONA_K8S_DATA` (default /runs/data/shakespeare.txt). `CONA_K8S_PROFILE` picks the profile
(default manifests/profiles/h100-k8s.yaml; for CPU nodes, a copy with the accelerator and `gpu_resource` of yours).
The run is a tiny GPT to 3,200 samples; the test follows it through `cona status` only (the laptop cannot see the
PVC), fetches the report, and deletes the orchestrator Job (and with it the run's objects) at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest

from tests.conftest import EXAMPLES, REPO, run_cona

pytestmark = [pytest.mark.kubernetes]

IMAGE = os.environ.get("CONA_K8S_IMAGE")
KUBECONFIG = os.environ.get("KUBECONFIG")
PROFILE = os.environ.get("CONA_K8S_PROFILE", str(REPO / "manifests" / "profiles" / "h100-k8s.yaml"))
DATA = os.environ.get("CONA_K8S_DATA", "/runs/data/shakespeare.txt")


@pytest.mark.skipif(not (IMAGE and KUBECONFIG), reason="no real cluster: set KUBECONFIG and CONA_K8S_IMAGE to run it")
def test_submit_on_a_real_cluster(tmp_path):
    run = f"cona-e2e-{uuid.uuid4().hex[:6]}"
    out = run_cona("submit", "--profile", PROFILE, "--job", str(EXAMPLES / "tiny-gpt.yaml"), "--name", run,
                   "--set", f"data.path={DATA}", "--profile-set", f"kubernetes.image={IMAGE}",
                   "--set", "target.val_perplexity=null", "--set", "target.max_samples=3200")  # fmt: skip
    assert out.returncode == 0, out.stderr
    namespace = out.stdout.split(" to namespace ", 1)[1].split(":", 1)[0]
    try:
        deadline = time.monotonic() + 1800
        status: dict = {}
        while time.monotonic() < deadline:
            result = run_cona("status", run, "--namespace", namespace, "--json")
            assert result.returncode == 0, result.stderr
            status = json.loads(result.stdout)
            if status["status"] in ("done", "stopped", "failed"):
                break
            time.sleep(10)
        assert status.get("status") == "done", status
        assert status["samples"] >= 3200
        report = run_cona("report", run, "--namespace", namespace, "--out", str(tmp_path / "report"))
        assert report.returncode == 0, report.stderr
        assert (tmp_path / "report" / "report.md").read_text()
    finally:
        subprocess.run(["kubectl", "-n", namespace, "delete", "job", f"{run}-orch", "--cascade=foreground",
                        "--ignore-not-found"], capture_output=True, timeout=300)  # fmt: skip
