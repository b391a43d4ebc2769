"""Security checks: how the code loads what it reads (torch.load, YAML), what the Kubernetes Role grants, what the
run directory and the rendered scripts may contain (no secrets), and that one run directory has one orchestrator.
The fault suite (`tests/faults.py`) also checks every file of its real runs for world-writable modes and secrets."""

from __future__ import annotations

import ast
import contextlib
import io
import os
from pathlib import Path

import pytest
import yaml
from cona.orchestrator import cli
from cona.orchestrator.job import load_job
from cona.orchestrator.profile import load_profile
from cona.orchestrator.runstate import RunLock, create_run
from cona.protocol.rundir import RunDir

from tests.conftest import REPO

SOURCES = [p for folder in ("orchestrator", "trainer", "protocol", "benchmarks", "scripts", "tests")
           for p in (REPO / folder).rglob("*.py")]  # fmt: skip
PROFILE = REPO / "slurm" / "profiles" / "local-cpu.yaml"
JOB = REPO / "examples" / "tiny-gpt.yaml"
SECRETS = {"HF_TOKEN": "hf_secret_7f3a9c", "AWS_SECRET_ACCESS_KEY": "aws_secret_51e2d0", "WANDB_API_KEY": "wandb_secret_c44e1b"}


def _calls(name: str) -> list[tuple[Path, ast.Call]]:
    """Every call of `<something>.<name>(...)` in the repository's Python files."""
    found = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == name:
                found.append((path, node))
    return found


def test_every_torch_load_uses_weights_only():
    """A checkpoint or weight file is data: weights_only=True refuses pickled objects that would run code."""
    loads = [(p, c) for p, c in _calls("load") if isinstance(c.func.value, ast.Name) and c.func.value.id == "torch"]
    assert loads, "expected torch.load calls to check (trainer/checkpoint.py reads exported DCP checkpoints)"
    for path, call in loads:
        flags = {k.arg: k.value for k in call.keywords}
        value = flags.get("weights_only")
        assert isinstance(value, ast.Constant) and value.value is True, f"{path}:{call.lineno}: torch.load without weights_only=True"


def test_yaml_is_read_only_with_safe_load():
    """yaml.load only with a loader that is yaml.SafeLoader or a subclass of it (the one that refuses keys given
    twice); never full_load/unsafe_load, which build arbitrary objects."""
    from cona.protocol import yamlconfig

    safe = {name for name, value in vars(yamlconfig).items() if isinstance(value, type) and issubclass(value, yaml.SafeLoader)}
    assert "_StrictLoader" in safe
    unsafe = []
    for name in ("load", "load_all", "full_load", "unsafe_load", "full_load_all"):
        for path, call in _calls(name):
            if not (isinstance(call.func.value, ast.Name) and call.func.value.id == "yaml"):
                continue
            loader = {k.arg: k.value for k in call.keywords}.get("Loader")
            named = loader.id if isinstance(loader, ast.Name) else None
            if name in ("load", "load_all") and path.name == "yamlconfig.py" and named in safe:
                continue
            unsafe.append((path, call.lineno, name))
    assert unsafe == [], f"YAML read without safe_load: {unsafe}"


def test_kubernetes_role_is_namespaced_and_has_no_wildcard():
    docs = [d for d in yaml.safe_load_all((REPO / "manifests" / "rbac.yaml").read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert "Role" in kinds and not kinds & {"ClusterRole", "ClusterRoleBinding"}
    for role in (d for d in docs if d["kind"] == "Role"):
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule.get(key, []), f"wildcard in {role['metadata']['name']} {key}: {rule}"
            assert "nonResourceURLs" not in rule
    for binding in (d for d in docs if d["kind"] == "RoleBinding"):
        assert binding["roleRef"]["kind"] == "Role"


def test_a_second_orchestrator_of_the_same_run_is_refused(tmp_path):
    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(PROFILE), job=load_job(JOB))
    lock = RunLock(run.lock)
    lock.acquire()
    try:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = cli.main(["run", "--resume", str(run.root)])
    finally:
        lock.release()
    assert code == 2
    assert err.getvalue().count("\n") == 1 and "another cona orchestrator" in err.getvalue()


def test_run_directory_files_are_not_world_writable(tmp_path):
    """What `cona run` writes before any trainer starts (the trainer's files are checked on the fault suite's
    real runs), even under a permissive umask."""
    old = os.umask(0)
    try:
        run = RunDir(tmp_path / "run")
        create_run(run_dir=run, profile=load_profile(PROFILE), job=load_job(JOB))
        from cona.orchestrator.runstate import RunState, log_event, write_state

        write_state(run, RunState())
        log_event(run, "start")
    finally:
        os.umask(old)
    for path in [run.root, *run.root.rglob("*")]:
        assert not path.stat().st_mode & 0o002, f"{path} is world-writable ({oct(path.stat().st_mode)})"


@pytest.mark.parametrize("target, profile", [
    ("local", REPO / "slurm" / "profiles" / "local-cpu.yaml"),
    ("slurm", REPO / "slurm" / "profiles" / "local-slurm.yaml"),
])  # fmt: skip
def test_rendered_scripts_hold_no_secret_from_the_environment(tmp_path, monkeypatch, target, profile):
    if not profile.exists():
        pytest.skip(f"{profile} not in this checkout")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("users: [{name: u, user: {token: kube_secret_9d8e7f}}]\n")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["render", target, "--profile", str(profile), "--job", str(JOB), "--run-dir", str(tmp_path / "r")])
    assert code == 0
    text = out.getvalue()
    assert text.strip()
    for secret in [*SECRETS.values(), "kube_secret_9d8e7f"]:
        assert secret not in text
