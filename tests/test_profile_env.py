"""The profile's `env`: environment variables of every trainer process, on every backend.

What a user writes (NCCL_SOCKET_IFNAME, NCCL_DEBUG, OMP_NUM_THREADS) reaches the trainers as written: a real local
attempt (torchrun and its workers, observed from inside through `sitecustomize`), the Slurm batch script's export
lines run by bash, and the Kubernetes trainer containers of every workload kind (validated against the schemas).
Bad entries are one line naming the variable.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cona.orchestrator.backends.kubernetes.render import render_attempt
from cona.orchestrator.backends.local.backend import LocalBackend
from cona.orchestrator.backends.slurm.script import render_batch_script
from cona.orchestrator.profile import load_profile
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

from tests.conftest import EXAMPLES, REPO, run_cona
from tests.test_k8s_manifests import K8S_PROFILE, MULTI_NODE, _validate

PROFILES = REPO / "slurm" / "profiles"
ODD = "it's $(HOME) \"q\" `id` $$ \\ ;"
"""A value every layer could mangle: quotes, command substitution, Kubernetes' `$(VAR)`, a backslash."""
ENV = {"NCCL_DEBUG": "WARN", "OMP_NUM_THREADS": "3", "ODD": ODD}


def _with_env(path: Path, tmp_path: Path, env: dict, **fields) -> Path:
    data = yaml.safe_load(path.read_text())
    data.update(env=env, **fields)
    out = tmp_path / path.name
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("env.RANK=3", "env': RANK is set by cona, torchrun or the cluster"),
        ("env.MASTER_ADDR=x", "MASTER_ADDR is set by cona"),
        ("env.CONA_ATTEMPT=2", "CONA_ATTEMPT is set by cona"),
        ("env.SLURM_NTASKS=2", "SLURM_NTASKS is set by cona"),
        ("env.CUDA_VISIBLE_DEVICES=0", "for a local run, set it in the shell that runs cona"),
        ("env.NCCL_IB_DISABLE=yes", 'NCCL_IB_DISABLE: YAML read the value as a boolean (true/false/yes/no/on/off); quote it as written'),
        # 8.0 reached the trainers as 8, 2.10 as 2.1 (no float is sure to be the text written)
        ("env.TORCH_CUDA_ARCH_LIST=8.0", 'TORCH_CUDA_ARCH_LIST: YAML read the value as a number (8.0), which need not be the text written'),
        ("env.V=2.10", 'V: YAML read the value as a number (2.1), which need not be the text written (2.10 reads as 2.1); quote it (e.g. V: "2.1")'),
        ("env.NCCL_DEBUG=null", 'NCCL_DEBUG: no value; give one, or quote an empty one (NCCL_DEBUG: "")'),
        ("env.X=[1, 2]", "X: a list is not text or a number"),
        ("env.9LIVES=1", "'9LIVES' is not a variable name"),
        ("env.A-B=1", "'A-B' is not a variable name"),
        ("env=NCCL_DEBUG", "field 'env'"),
    ],
)  # fmt: skip
def test_a_bad_entry_is_one_line_naming_it(override, message):
    with pytest.raises(ConfigError, match=None) as caught:
        load_profile(PROFILES / "local-cpu.yaml", [override])
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_bad_entry_from_the_cli_is_one_line_without_a_traceback():
    out = run_cona("plan", "--profile", str(PROFILES / "local-cpu.yaml"), "--job", str(EXAMPLES / "tiny-gpt.yaml"),
                   "--profile-set", "env.WORLD_SIZE=8")  # fmt: skip
    assert out.returncode == 2
    assert "WORLD_SIZE is set by cona" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_integers_become_text_and_a_newline_is_refused(tmp_path):
    profile = load_profile(_with_env(PROFILES / "local-cpu.yaml", tmp_path, {"A": 4, "B": "0.5", "C": "x"}))
    assert profile.env == {"A": "4", "B": "0.5", "C": "x"}
    with pytest.raises(ConfigError, match="C: the value holds a newline"):
        load_profile(_with_env(PROFILES / "local-cpu.yaml", tmp_path, {"C": "a\nb"}))


SITECUSTOMIZE = """
import json, os
folder = os.environ.get("ENVDUMP")
if folder:
    keys = ("NCCL_DEBUG", "OMP_NUM_THREADS", "ODD", "RANK", "PYTHONUNBUFFERED")
    with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
        json.dump({key: os.environ.get(key) for key in keys}, f)
"""


def test_a_local_attempt_runs_its_trainers_with_the_env(tmp_path):
    """A real attempt: torchrun and both trainer processes see the profile's env (the trainers then stop at once,
    the run directory having no run.yaml). Each Python process writes its environment from `sitecustomize`."""
    hook, dump = tmp_path / "hook", tmp_path / "dump"
    hook.mkdir()
    dump.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = {**ENV, "PYTHONPATH": str(hook), "ENVDUMP": str(dump)}
    profile = load_profile(_with_env(PROFILES / "local-cpu.yaml", tmp_path, env, gpus_per_node=2))
    run_dir = RunDir(tmp_path / "run")
    backend = LocalBackend(run_dir=run_dir, profile=profile)
    assert "#   ODD=" in backend.render(strategy=Strategy.parse("dp=2,tp=1,pp=1,mbs=1,gbs=2"))
    backend.launch(attempt=1, strategy=Strategy.parse("dp=2,tp=1,pp=1,mbs=1,gbs=2"))
    exit_code = run_dir.attempt_dir(1) / "exit_code"
    deadline = time.monotonic() + 120
    while not exit_code.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert exit_code.exists(), (run_dir.attempt_dir(1) / "torchrun.log").read_text()
    seen = [json.loads(path.read_text()) for path in dump.glob("*.json")]
    workers = sorted((s for s in seen if s["RANK"] is not None), key=lambda s: s["RANK"])
    assert [w["RANK"] for w in workers] == ["0", "1"], seen
    for process in seen:  # torchrun's agent and both workers
        assert (process["NCCL_DEBUG"], process["OMP_NUM_THREADS"], process["ODD"]) == ("WARN", "3", ODD)
        assert process["PYTHONUNBUFFERED"] == "1"


def _env_block(script: str) -> list[str]:
    lines = script.splitlines()
    start = lines.index("# --- environment of the trainers, from the profile's env: ---")
    end = lines.index("", start)
    return lines[start:end]


def test_the_slurm_script_exports_the_env_after_the_setup(tmp_path):
    profile = load_profile(_with_env(PROFILES / "local-slurm.yaml", tmp_path, ENV))
    script = render_batch_script(profile, None, tmp_path / "run")
    block = _env_block(script)
    assert [line.split("=", 1)[0] for line in block[1:]] == [f"export {name}" for name in ENV]
    # After the setup commands (a module they load does not undo it), before the first srun.
    assert script.index("# --- end of setup") < script.index(block[0]) < script.index("srun --nodes")
    # What bash makes of the lines is the value as written.
    shown = subprocess.run(["bash", "-c", "\n".join([*block, f"{sys.executable} -c 'import json, os; "
                            "print(json.dumps({k: os.environ[k] for k in (\"NCCL_DEBUG\", \"OMP_NUM_THREADS\", \"ODD\")}))'"])],
                           capture_output=True, text=True, check=True)  # fmt: skip
    assert json.loads(shown.stdout) == ENV
    # Without env the script is what it was (the golden scripts check every byte).
    assert "environment of the trainers" not in render_batch_script(load_profile(PROFILES / "local-slurm.yaml"), None, tmp_path)


@pytest.mark.parametrize("workload", ["indexed-job", "jobset", "trainjob"])
def test_every_kubernetes_workload_gives_its_trainers_the_env(workload, tmp_path):
    env = {**ENV, "HOME": "/runs/home"}  # HOME replaces cona's /tmp, not a second entry
    profile = load_profile(_with_env(K8S_PROFILE, tmp_path, env), [f"kubernetes.workload={workload}"])
    objects = render_attempt(profile=profile, strategy=MULTI_NODE, attempt=2, run_dir="/runs/r")
    for obj in objects:
        _validate(obj)
    (workload_obj,) = [obj for obj in objects if obj["kind"] in ("Job", "JobSet", "TrainJob")]
    if workload_obj["kind"] == "TrainJob":
        entries = workload_obj["spec"]["trainer"]["env"]
    else:
        spec = workload_obj["spec"]
        template = spec["template"] if workload_obj["kind"] == "Job" else spec["replicatedJobs"][0]["template"]["spec"]["template"]
        (container,) = template["spec"]["containers"]
        entries = container["env"]
    values = {entry["name"]: entry.get("value") for entry in entries}
    assert [entry["name"] for entry in entries].count("HOME") == 1
    # Kubernetes would expand $(HOME) in a value: written as $$(HOME), it reaches the process as written.
    assert values["ODD"] == ODD.replace("$", "$$") and values["HOME"] == "/runs/home"
    assert (values["NCCL_DEBUG"], values["OMP_NUM_THREADS"], values["CONA_ATTEMPT"]) == ("WARN", "3", "2")


def test_a_submitted_run_carries_the_env_to_its_orchestrator(tmp_path):
    from cona.orchestrator.backends.kubernetes.runobjects import render_submission
    from cona.orchestrator.job import load_job

    job = load_job(EXAMPLES / "tiny-gpt.yaml", ["data.path=/runs/data/shakespeare.txt"])
    profile = load_profile(_with_env(K8S_PROFILE, tmp_path, {"NCCL_SOCKET_IFNAME": "ib0"}))
    configmap = render_submission(profile=profile, job=job, run="env-1", submitted=0.0)[0]
    assert yaml.safe_load(configmap["data"]["profile.yaml"])["env"] == {"NCCL_SOCKET_IFNAME": "ib0"}
