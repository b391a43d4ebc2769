"""The backend registry: one constructor signature, one line per backend, `cona render BACKEND` for each."""

from __future__ import annotations

from pathlib import Path

import pytest
from cona.orchestrator.backends import BACKENDS, backend_class, make_backend
from cona.orchestrator.job import load_job
from cona.orchestrator.profile import load_profile
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy

from tests.conftest import EXAMPLES, PROFILES, REPO, run_cona

PROFILE_OF = {
    "local": PROFILES / "local-cpu.yaml",
    "slurm": PROFILES / "local-slurm.yaml",
    "kubernetes": REPO / "manifests" / "profiles" / "h100-k8s.yaml",
}


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_registered_backend_is_built_the_same_way(name, tmp_path):
    profile = load_profile(PROFILE_OF[name])
    job = load_job(EXAMPLES / "tiny-gpt.yaml")
    # A kubernetes run directory lies on the PVC's mount (/runs); building the backend loads no API configuration.
    root = Path("/runs/run") if name == "kubernetes" else tmp_path / "run"
    backend = make_backend(profile=profile, run_dir=RunDir(root), job=job)
    assert type(backend) is backend_class(name) and backend.name == name
    assert backend.profile is profile and backend.job is job
    rendered = backend.render(strategy=Strategy.parse("dp=4,tp=1,pp=1,mbs=4,gbs=16"))
    assert rendered.endswith("\n") and len(rendered.splitlines()) >= 3


def test_an_unknown_backend_names_the_available_ones():
    with pytest.raises(ValueError, match=r"backend 'k8s' is not available yet; available: kubernetes, local, slurm"):
        backend_class("k8s")


def test_cona_render_local_prints_the_first_attempts_command():
    out = run_cona("render", "local", "--profile", str(PROFILE_OF["local"]), "--job", str(EXAMPLES / "tiny-gpt.yaml"))
    assert out.returncode == 0, out.stderr
    command = out.stdout.splitlines()[-1]
    # The cona policy starts on the best strategy under its prior noise scale: 4 processes on this profile.
    assert "-m torch.distributed.run" in command and "--nproc-per-node=4" in command
    assert "-m cona.trainer" in command and "--attempt 1" in command and command.endswith("exit $rc")


def test_cona_render_refuses_a_profile_of_another_backend():
    out = run_cona("render", "slurm", "--profile", str(PROFILE_OF["local"]), "--job", str(EXAMPLES / "tiny-gpt.yaml"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "backend is 'local'; `cona render slurm` needs a slurm profile" in out.stderr.strip().splitlines()[-1]


def test_cona_run_on_a_kubernetes_profile_without_a_kubeconfig_fails_in_one_line(tmp_path):
    from tests.test_k8s_e2e import write_profile

    profile = write_profile(tmp_path)
    env = {"KUBECONFIG": str(tmp_path / "missing"), "HOME": str(tmp_path), "KUBERNETES_SERVICE_HOST": ""}
    out = run_cona("run", "--profile", str(profile), "--job", str(EXAMPLES / "tiny-gpt.yaml"),
                   "--run-dir", str(tmp_path / "run"), env=env)  # fmt: skip
    assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("cona: error: kubernetes: cannot load the API configuration")
    assert not (tmp_path / "run" / "attempts" / "1" / "launch.json").exists()
