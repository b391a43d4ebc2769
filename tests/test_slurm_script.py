"""The rendered Slurm batch script: golden files, hostile values that must stay inert, the job-side helper.

No Slurm needed. `UPDATE_GOLDEN=1 pytest tests/test_slurm_script.py` rewrites the golden files.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cona.orchestrator.backends.slurm import SlurmBackend
from cona.orchestrator.backends.slurm.script import (
    HELPER,
    parse_extra_option,
    render_batch_script,
    sbatch_quote,
)
from cona.orchestrator.backends.slurm.spec import slurm_time_seconds
from cona.orchestrator.elastic import plan_table
from cona.orchestrator.job import load_job
from cona.orchestrator.profile import ClusterProfile, load_profile
from cona.orchestrator.scheduler import Scheduler
from cona.protocol.rundir import RunDir
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

from tests.conftest import EXAMPLES, PROFILES, REPO, assert_golden, run_cona

GOLDEN = REPO / "tests" / "golden" / "slurm"
BASH = shutil.which("bash")


def _helper():
    spec = importlib.util.spec_from_file_location("cona_slurm_helper", HELPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


helper = _helper()


def _golden(name: str, text: str) -> None:
    assert_golden(GOLDEN / name, text, what="the rendered script")


def _profile(base: str = "local-slurm.yaml", **slurm) -> ClusterProfile:
    profile = load_profile(PROFILES / base)
    return profile.model_copy(update={"slurm": profile.slurm.model_copy(update=slurm)})


@pytest.mark.parametrize("name", ["local-slurm", "a100-4x8", "h100-2x8"])
def test_golden_scripts(name):
    profile = load_profile(PROFILES / f"{name}.yaml")
    text = render_batch_script(profile, None, "/shared/cona/runs/golden-run")
    _golden(f"{name}.sbatch", text)
    if BASH:
        subprocess.run([BASH, "-n"], input=text, text=True, check=True)


def test_script_content_local():
    text = render_batch_script(_profile(), None, "/runs/r1")
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == [
        "#SBATCH --job-name=r1",
        "#SBATCH --partition=debug",
        "#SBATCH --time=01:00:00",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=/runs/r1/attempts/slurm-%j.out",
        "#SBATCH --signal=B:USR1@60",
    ]
    # every #SBATCH line precedes the first command (sbatch stops reading options there)
    lines = text.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < first_command
    assert "--kill-on-bad-exit=1" in text and "--rdzv-backend=c10d" in text and "--max-restarts=0" in text


def test_gpu_profile_lines():
    text = render_batch_script(load_profile(PROFILES / "a100-4x8.yaml"), None, "/runs/x", nodes=3)
    assert "#SBATCH --gpus-per-node=8" in text
    assert "#SBATCH --nodes=3" in text
    assert "#SBATCH --exclusive" in text
    assert "#SBATCH --signal=B:USR1@300" in text
    assert "--gpus-per-node" not in render_batch_script(_profile(), None, "/runs/x")


def test_a_cpu_profile_asks_for_no_gpus_unless_it_says_so():
    """`gpus_per_node_flag` defaults to true, for GPU clusters; a CPU profile that leaves it out asked a CPU
    partition for `--gpus-per-node` and never started. Its default follows the device; said explicitly, it stays."""
    cpu = ["accelerator.device=cpu", "accelerator.name=cpu"]
    assert not load_profile(PROFILES / "a100-4x8.yaml", cpu).slurm.gpus_per_node_flag
    assert "--gpus-per-node" not in render_batch_script(load_profile(PROFILES / "a100-4x8.yaml", cpu), None, "/runs/x")
    forced = load_profile(PROFILES / "a100-4x8.yaml", [*cpu, "slurm.gpus_per_node_flag=true"])
    assert "#SBATCH --gpus-per-node=8" in render_batch_script(forced, None, "/runs/x")
    assert load_profile(PROFILES / "a100-4x8.yaml").slurm.gpus_per_node_flag  # a GPU profile keeps the default


# --- the node count: what `cona render slurm` shows is what the submission asks for --------------------------


def _sbatch_runner(calls: list[list[str]]):
    """A Slurm that answers sbatch with job id 7 and records every command."""

    def run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        calls.append(list(argv))
        return subprocess.CompletedProcess(argv, 0, stdout="7\n" if argv[0] == "sbatch" else "", stderr="")

    return run


def _node_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("#SBATCH --nodes", "#SBATCH --ntasks"))]


def test_render_asks_for_the_nodes_the_submission_asks_for(tmp_path):
    """A strategy on fewer nodes than the profile's: the rendered #SBATCH lines, the sbatch command line and the
    script that submission writes all say one node, not the profile's four."""
    profile = _profile_set()
    job = load_job(EXAMPLES / "gpt3-1.3b.yaml")
    strategy = Strategy.parse("dp=8,tp=1,pp=1,mbs=8,gbs=512")
    calls: list[list[str]] = []
    backend = SlurmBackend(run_dir=RunDir(tmp_path / "run"), profile=profile, job=job, runner=_sbatch_runner(calls))
    rendered = backend.render(strategy=strategy)
    assert _node_lines(rendered) == ["#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1"] and profile.nodes == 4
    attempt = backend.launch(attempt=1, strategy=strategy)
    (sbatch,) = [c for c in calls if c[0] == "sbatch"]
    assert [f"#SBATCH {option}" for option in sbatch[2:-2]] == _node_lines(rendered)
    assert _node_lines(Path(sbatch[-2]).read_text()) == _node_lines(rendered)
    assert attempt.extra["nnodes"] == 1


def test_cona_render_slurm_shows_the_strategys_node_count():
    out = run_cona("render", "slurm", "--profile", str(A100), "--job", str(EXAMPLES / "gpt3-1.3b.yaml"),
                   "--set", "policy.name=fixed", "--set", "policy.strategy=dp=8,tp=1,pp=1,mbs=8,gbs=512")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert _node_lines(out.stdout) == ["#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1"]


def test_render_of_an_elastic_run_asks_for_the_range_the_scheduler_submits(tmp_path):
    """With 8 GB a GPU, gpt3-1.3b fits on 2 to 4 nodes but not on one: the planning table starts at 2 nodes, so
    the first submission asks for 2-4, not the profile's min_nodes=1."""
    profile = _profile_set("min_nodes=1", "accelerator.memory=8 GB")
    job = load_job(EXAMPLES / "gpt3-1.3b.yaml")
    calls: list[list[str]] = []
    run_dir = RunDir(tmp_path / "run")
    backend = SlurmBackend(run_dir=run_dir, profile=profile, job=job, runner=_sbatch_runner(calls))
    scheduler = Scheduler(run_dir=run_dir, profile=profile, job=job, backend=backend)
    plan = plan_table(scheduler.model, reason="start", time=1.0)  # what the scheduler launches an elastic start with
    assert sorted(plan.by_nodes()) == [2, 3, 4]
    strategy = plan.strategy_for(plan.max_nodes)
    rendered = backend.render(strategy=strategy)
    assert _node_lines(rendered) == ["#SBATCH --nodes=2-4", "#SBATCH --ntasks=4"]
    backend.launch(attempt=1, strategy=strategy, elastic=plan.by_nodes())
    (sbatch,) = [c for c in calls if c[0] == "sbatch"]
    assert [f"#SBATCH {option}" for option in sbatch[2:-2]] == _node_lines(rendered)


def test_a_node_range_does_not_raise_the_per_node_cpu_minimum():
    """slurmctld makes `cpus_per_task × ntasks_per_node` every node's minimum CPU count when a job has more than
    one task, so `--nodes=150-288 --ntasks=288 --ntasks-per-node=288` fitted no node with fewer than 288 CPUs and
    never started. A range asks for MAX tasks only; the batch script's srun still starts one agent per node."""
    profile = _profile_set("nodes=300", "min_nodes=150")
    text = render_batch_script(profile, None, "/runs/x", nodes="150-288")
    assert _node_lines(text) == ["#SBATCH --nodes=150-288", "#SBATCH --ntasks=288"]
    step = next(line for line in text.splitlines() if line.strip().startswith("srun "))
    assert '--nodes="$cona_nnodes" --ntasks="$cona_nnodes" --ntasks-per-node=1' in step
    # A node count keeps one task per node.
    assert _node_lines(render_batch_script(profile, None, "/runs/x", nodes=3)) == [
        "#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1"]  # fmt: skip


# --- slurm.use_submitit ----------------------------------------------------------------------------------------


@pytest.fixture
def fake_submitit_slurm(tmp_path, monkeypatch):
    """An sbatch that answers with job id 12345 (what submitit parses) and an srun (submitit looks for one)."""
    pytest.importorskip("submitit")
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    (bindir / "sbatch").write_text('#!/bin/sh\necho "$@" >>"$0.calls"\necho "Submitted batch job 12345"\n')
    (bindir / "srun").write_text("#!/bin/sh\nexit 1\n")
    for tool in ("sbatch", "srun"):
        (bindir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    return bindir


def test_submitit_submits_an_elastic_range_with_the_profiles_python(tmp_path, fake_submitit_slurm):
    """submitit's typed `nodes` takes only an int: an elastic `MIN-MAX` crashed the first launch with its
    AssertionError. The node options go in as sbatch options, the same as the sbatch path's; and submitit's batch
    script starts `slurm.python` on the compute node, not the orchestrator's own interpreter."""
    profile = _profile_set("min_nodes=1", "slurm.use_submitit=true", base=PROFILES / "local-slurm.yaml")
    python = "'/opt/cona venv/bin/python3' -X utf8"  # split like a shell command
    profile = profile.model_copy(update={"slurm": profile.slurm.model_copy(update={"python": python})})
    run_dir = RunDir(tmp_path / "run")
    backend = SlurmBackend(run_dir=run_dir, profile=profile, job=load_job(EXAMPLES / "tiny-gpt.yaml"))
    s4, s2 = Strategy.parse("dp=4,tp=1,pp=1,mbs=4,gbs=16"), Strategy.parse("dp=2,tp=1,pp=1,mbs=4,gbs=16")
    attempt = backend.launch(attempt=1, strategy=s4, elastic={1: s2, 2: s4})
    assert attempt.backend_id == "12345"
    submitted = (run_dir.root / "slurm" / "submitit" / "12345_submission.sh").read_text()
    assert _node_lines(submitted) == ["#SBATCH --nodes=1-2", "#SBATCH --ntasks=2"], submitted
    assert "\n'/opt/cona venv/bin/python3' -X utf8 -u -m submitit.core._submit " in submitted, submitted
    # A node count stays one task per node.
    backend.launch(attempt=2, strategy=s2, previous=None)
    submitted = (run_dir.root / "slurm" / "submitit" / "12345_submission.sh").read_text()
    assert _node_lines(submitted) == ["#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1"], submitted



def test_submitit_gets_extra_sbatch_short_options_by_their_long_names(tmp_path, fake_submitit_slurm):
    """submitit writes `--{name}`: `-C a100` became `#SBATCH --C=a100`, and `-w` the ambiguous `--w`."""
    profile = _profile_set("slurm.use_submitit=true", _extra("-C a100", "-w n[1-4]", "--exclusive"),
                           base=PROFILES / "local-slurm.yaml")  # fmt: skip
    run_dir = RunDir(tmp_path / "run")
    backend = SlurmBackend(run_dir=run_dir, profile=profile, job=load_job(EXAMPLES / "tiny-gpt.yaml"))
    backend.launch(attempt=1, strategy=Strategy.parse("dp=4,tp=1,pp=1,mbs=4,gbs=16"))
    submitted = (run_dir.root / "slurm" / "submitit" / "12345_submission.sh").read_text()
    sbatch = [line for line in submitted.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --constraint=a100" in sbatch and "#SBATCH --exclusive" in sbatch, sbatch
    assert any(line.startswith("#SBATCH --nodelist=") for line in sbatch), sbatch
    assert not any(line.startswith(("#SBATCH --C=", "#SBATCH --w=")) for line in sbatch), sbatch


def test_render_says_that_submitit_submits_its_own_script(tmp_path):
    """With use_submitit, `cona render slurm` prints the script the job runs, not the one sbatch gets: its head says
    so, and which interpreter starts it. Still a script: #SBATCH lines before the first command, `bash -n` clean."""
    profile = _profile_set("slurm.use_submitit=true", "slurm.python=/opt/py/bin/python3", base=PROFILES / "local-slurm.yaml")
    backend = SlurmBackend(run_dir=RunDir(tmp_path / "run"), profile=profile, job=load_job(EXAMPLES / "tiny-gpt.yaml"))
    text = backend.render(strategy=Strategy.parse("dp=4,tp=1,pp=1,mbs=4,gbs=16"))
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash" and lines[1].startswith("# NOTE slurm.use_submitit is true: `cona run` does not")
    head = "\n".join(lines[1:5])
    assert "/opt/py/bin/python3 -u -m submitit.core._submit" in head and "slurm/submitit/%j_0_log.out" in head
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < first_command
    if BASH:
        subprocess.run([BASH, "-n"], input=text, text=True, check=True)
    plain = SlurmBackend(run_dir=RunDir(tmp_path / "run"), profile=_profile(), job=load_job(EXAMPLES / "tiny-gpt.yaml"))
    assert "use_submitit" not in plain.render(strategy=Strategy.parse("dp=4,tp=1,pp=1,mbs=4,gbs=16"))


def test_sbatch_quote_follows_sbatch_parser():
    assert sbatch_quote("debug") == "debug"
    assert sbatch_quote("a b") == '"a b"'
    assert sbatch_quote('say "hi" \\o/') == '"say \\"hi\\" \\\\o/"'
    assert sbatch_quote("x#y") == '"x#y"'  # an unquoted # starts a comment for sbatch
    assert sbatch_quote("") == '""'
    for bad in ("a\nb", "a\rb", "a\x00b", "tab\there"):
        with pytest.raises(ConfigError, match="newline or control character"):
            sbatch_quote(bad, "slurm.partition")


def test_extra_sbatch_options():
    assert parse_extra_option("--constraint=a100") == ("--constraint", "a100")
    assert parse_extra_option("-C a100") == ("-C", "a100")
    assert parse_extra_option("--exclusive") == ("--exclusive", None)
    assert parse_extra_option("--comment=two words") == ("--comment", "two words")
    for bad in ("exclusive", "; rm -rf /", "--x=\n#!"):
        with pytest.raises(ConfigError):
            parse_extra_option(bad)


A100 = PROFILES / "a100-4x8.yaml"  # 4 nodes × 8 GPUs, partition gpu, time limit 24:00:00


def _profile_set(*overrides: str, base: Path = A100) -> ClusterProfile:
    """The profile as `cona ... --profile-set` loads it (validated, unlike `_profile`'s model_copy)."""
    return load_profile(base, list(overrides))


def _extra(*entries: str) -> str:
    return f"slurm.extra_sbatch={json.dumps(list(entries))}"


@pytest.mark.parametrize(
    "entry, option, advice",
    [
        ("--gpus-per-node=4", "gpus-per-node", "set gpus_per_node in the profile"),
        ("-N 8", "nodes", "set nodes / min_nodes in the profile"),
        ("-N8", "nodes", "set nodes / min_nodes in the profile"),
        ("--nodes 8", "nodes", "set nodes / min_nodes in the profile"),
        ("--gres=gpu:4", "gres", "set gpus_per_node in the profile"),
        ("--gres=nvme:1,gpu:a100:2", "gres", "set gpus_per_node in the profile"),
        ("--ntasks-per-node=8", "ntasks-per-node", "set nodes / gpus_per_node in the profile"),
        ("-n 32", "ntasks", "set nodes / gpus_per_node in the profile"),
        ("--time=1:00:00", "time", "set slurm.time_limit instead"),
        ("-t 60", "time", "set slurm.time_limit instead"),
        ("--signal=B:USR1@60", "signal", "set slurm.signal_before_timeout_s instead"),
        ("-J other", "job-name", "set name there"),
        ("--output=/tmp/x.out", "output", "remove the entry"),
        ("-e /tmp/x.err", "error", "remove the entry"),
        ("--open-mode=truncate", "open-mode", "remove the entry"),
        ("--no-requeue", "no-requeue", "remove the entry"),
        ("-G 4", "gpus", "set gpus_per_node in the profile"),
        ("--gpus-per-task=1", "gpus-per-task", "set gpus_per_node in the profile"),
        ("--gpus-per-n=4", "gpus-per-node", "set gpus_per_node"),  # sbatch's getopt_long takes a unique prefix
        ("-HN 8", "nodes", "set nodes / min_nodes"),  # -H takes no argument: N is the next option
        ("--partition=other", "partition", "slurm.partition is set ('gpu'); set it there only"),
        ("-p other", "partition", "slurm.partition is set ('gpu'); set it there only"),
        # An array starts several copies of one run, each writing the same run directory.
        ("--array=0-3", "array", "a run is one job, which requeues itself"),
        ("-a 0-3", "array", "an array would start several copies of the run writing one run directory"),
        ("-a0-3%1", "array", "remove the entry"),
        ("--arr=1-2", "array", "remove the entry"),
        ("--tasks-per-node=8", "tasks-per-node", "set nodes / gpus_per_node in the profile"),
        ("--ntasks-per-tres=1", "ntasks-per-tres", "set nodes / gpus_per_node in the profile"),
        ("--tres-per-task=gres/gpu:1", "tres-per-task", "set gpus_per_node in the profile"),
        ("--tres-per-task=cpu=4,gres/gpu=1", "tres-per-task", "set gpus_per_node in the profile"),
        ("--tres-per-task=gres/gpu:a100=2", "tres-per-task", "set gpus_per_node in the profile"),
        ("--gres=gres/gpu=2", "gres", "set gpus_per_node in the profile"),
        # What a submission is: blocking until the job ends (cona's sbatch timed out while the job was queued),
        # nothing submitted, another script; and trainers without the batch shell's environment.
        ("--wait", "wait", "sbatch --wait would block the submission"),
        ("-W", "wait", "remove the entry"),
        ("--test-only", "test-only", "no job would be submitted"),
        ("--wrap=hostname", "wrap", "the job runs the run's batch script"),
        ("--export=NONE", "export", "the trainers need the batch shell's environment"),
        ("--export=X=1", "export", "give --export=ALL,... or remove the entry"),
    ],
)
def test_extra_sbatch_refuses_options_cona_decides(entry, option, advice):
    """sbatch takes the last of two equal options, and extra_sbatch comes after cona's own: refused at load."""
    with pytest.raises(ConfigError) as raised:
        _profile_set(_extra("--exclusive", entry))
    message = str(raised.value)
    assert "\n" not in message
    assert f"field 'slurm.extra_sbatch': {entry!r} sets --{option}, which cona decides itself" in message
    assert advice in message


def test_extra_sbatch_keeps_options_cona_leaves_alone():
    allowed = ["--account=proj", "-A proj", "--qos=high", "--constraint=a100", "-C a100", "--exclusive",
               "--mail-type=END", "--gres=nvme:1", "--mem=0", "-c 16", "--time-min=30", "--nodelist=n[1-4]",
               # placement, not counts: Slurm keeps cona's --nodes with any nodelist (spec.py says why)
               "-w n[1-4]", "--exclude=n5", "--tres-per-task=cpu=4", "--tres-per-task=gres/nvme:1"]  # fmt: skip
    text = render_batch_script(_profile_set(_extra(*allowed)), None, "/runs/r")
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch[-len(allowed) :] == [f"#SBATCH {entry}" for entry in allowed]
    # An entry as it would be written on an #SBATCH line: one pair of enclosing quotes is sbatch's, not the value's
    # (quoted again, the feature was named '"a100&ib"', quotes and all, and the job never started).
    text = render_batch_script(_profile_set(_extra('--constraint="a100&ib"', "-C 'a b'", "--export=ALL,X=1")), None,
                               "/runs/r")  # fmt: skip
    assert [line for line in text.splitlines() if line.startswith("#SBATCH")][-3:] == [
        '#SBATCH --constraint="a100&ib"', '#SBATCH -C "a b"', "#SBATCH --export=ALL,X=1"]  # fmt: skip
    # A GPU type is asked for with --gres once cona is told not to ask for GPUs itself (the advice says so).
    with pytest.raises(ConfigError, match=r"set slurm\.gpus_per_node_flag: false and give that count"):
        _profile_set(_extra("--gres=gpu:a100:8"))
    typed = render_batch_script(_profile_set("slurm.gpus_per_node_flag=false", _extra("--gres=gpu:a100:8")), None,
                                "/runs/r")  # fmt: skip
    assert "#SBATCH --gres=gpu:a100:8" in typed and "--gpus-per-node" not in typed
    # account and qos are refused only beside the profile's own field of that name
    with pytest.raises(ConfigError, match=r"'--qos=high' sets --qos, .*slurm\.qos is set \('normal'\)"):
        _profile_set("slurm.qos=normal", _extra("--qos=high"))


def test_a_gpu_count_of_extra_sbatch_must_be_the_profiles_gpus_per_node():
    """With `gpus_per_node_flag: false`, `--gres=gpu:TYPE:N` asks for the GPUs, and nothing compared N with
    `gpus_per_node`: 4 of 8 started 8 trainer processes per node on a job holding 4 GPUs. A count that differs is
    refused at load, naming both fields; a bare `gpu` or a type alone is one GPU, as sbatch reads it."""
    off = "slurm.gpus_per_node_flag=false"  # the a100-4x8 profile: 8 GPUs per node
    for entry, count in [("--gres=gpu:a100:4", 4), ("--gres=gpu", 1), ("--gres=gpu:a100", 1), ("--gres gpu:16", 16),
                         ("--gres=nvme:1,gpu:a100:4,gpu:v100:2", 6), ("--tres-per-task=gres/gpu:a100=2", 2)]:  # fmt: skip
        with pytest.raises(ConfigError) as raised:
            _profile_set(off, _extra("--exclusive", entry))
        assert str(raised.value) == (
            f"{A100}: slurm.extra_sbatch {entry!r} asks for {count} GPU{'s' if count > 1 else ''} per node, but "
            "gpus_per_node is 8, the trainer processes each node starts (one per GPU); make the two agree")  # fmt: skip
    for entry in ("--gres=gpu:a100:8", "--gres=gpu:8", "--gres=gres/gpu=8", "--gres=gpu:a100:4,gpu:v100:4"):
        assert _profile_set(off, _extra(entry)).slurm.extra_sbatch == [entry]
    assert _profile_set(off, _extra("--gres=gpu:a100:4"), "gpus_per_node=4").gpus_per_node == 4


def test_a_heterogeneous_job_separator_on_an_sbatch_line_is_refused():
    """sbatch reads 'hetjob' or 'packjob' anywhere in an #SBATCH line, in any case, as the separator of a
    heterogeneous job's components: a job named hetjob-ablation would have been split."""
    for kwargs, what in [({"job_name": "hetjob-ablation"}, "job name"), ({"run_dir": "/runs/PackJob-study/r1"},
                         "run directory")]:  # fmt: skip
        with pytest.raises(ConfigError, match=f"^{what}: .* contains '(hetjob|packjob)', which sbatch reads"):
            render_batch_script(_profile_set(), None, kwargs.get("run_dir", "/runs/r"), job_name=kwargs.get("job_name"))
    with pytest.raises(ConfigError, match=r"^slurm\.extra_sbatch: 'my hetjob' contains 'hetjob'"):
        render_batch_script(_profile_set(_extra("--comment=my hetjob")), None, "/runs/r")


@pytest.mark.parametrize(
    "time_limit, seconds",
    [("10", 600), ("10:30", 630), ("1:00:00", 3600), ("2-3", 183600), ("2-03:04", 183840),
     ("2-03:04:05", 183845), ("UNLIMITED", None), ("infinite", None), ("0", None), ("", None)],
)  # fmt: skip
def test_slurm_time_seconds(time_limit, seconds):
    assert slurm_time_seconds(time_limit) == seconds


def test_a_time_limit_of_whole_minutes_is_one_rule_in_a_file_and_on_the_command_line(tmp_path):
    """`--profile-set slurm.time_limit=90` rendered `--time=90` (90 minutes, sbatch's MM) while the same unquoted
    `time_limit: 90` in a profile file was refused ("write the value in quotes"): the field takes a whole number as
    minutes wherever it is written, and judges any other number as its text, alike."""
    edited = tmp_path / "profile.yaml"
    base = (PROFILES / "local-slurm.yaml").read_text()
    for written, expected in (("90", "90"), ('"90"', "90"), ("90.5", None), ("-5", None)):
        edited.write_text(base.replace('time_limit: "01:00:00"', f"time_limit: {written}"))
        overrides = [f"slurm.time_limit={written}"]
        if expected is None:
            said = []
            for path, given in ((edited, []), (PROFILES / "local-slurm.yaml", overrides)):
                with pytest.raises(ConfigError) as raised:
                    load_profile(path, given)
                said.append(str(raised.value).split("field 'slurm.time_limit': ")[1].split(" (got")[0])
            assert said == ["not a Slurm time: use MM (minutes), MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED"] * 2
            continue
        from_file, from_flag = load_profile(edited), load_profile(PROFILES / "local-slurm.yaml", overrides)
        assert from_file.slurm.time_limit == from_flag.slurm.time_limit == expected
        assert "#SBATCH --time=90\n" in render_batch_script(from_file, None, "/runs/r")


def test_signal_must_come_before_the_time_limit():
    """A lead at or above the limit fires the signal as the job starts: checkpoint, requeue, again, forever."""
    with pytest.raises(ConfigError) as raised:
        _profile_set('slurm.time_limit="10"', "slurm.signal_before_timeout_s=900")
    message = str(raised.value)
    assert "\n" not in message
    assert "slurm.signal_before_timeout_s=900 is not below slurm.time_limit '10' (600 s)" in message
    assert "lower signal_before_timeout_s or raise time_limit" in message
    with pytest.raises(ConfigError, match=r"signal_before_timeout_s=600 is not below"):
        _profile_set('slurm.time_limit="10"', "slurm.signal_before_timeout_s=600")
    assert _profile_set('slurm.time_limit="10"', "slurm.signal_before_timeout_s=599").slurm.signal_before_timeout_s == 599
    # No limit to count back from, or no signal: nothing to compare.
    assert _profile_set("slurm.time_limit=UNLIMITED", "slurm.signal_before_timeout_s=65535").slurm is not None
    assert _profile_set('slurm.time_limit="1"', "slurm.signal_before_timeout_s=0").slurm is not None


def test_submitit_needs_a_pre_timeout_signal_the_trainer_takes():
    """submitit always asks Slurm for a pre-timeout signal (USR2 unless told another), whose default action kills
    the trainers without a checkpoint: with no signal of cona's, the combination is refused in one line."""
    with pytest.raises(ConfigError) as raised:
        _profile_set("slurm.use_submitit=true", "slurm.signal_before_timeout_s=0")
    message = str(raised.value)
    assert "\n" not in message and "slurm.use_submitit with slurm.signal_before_timeout_s=0" in message
    assert "set signal_before_timeout_s above 0" in message and "use_submitit: false" in message
    assert _profile_set("slurm.use_submitit=true", "slurm.signal_before_timeout_s=60").slurm.use_submitit
    assert _profile_set("slurm.use_submitit=false", "slurm.signal_before_timeout_s=0").slurm is not None


@pytest.mark.parametrize("lead", [-1, 65536, 70000])
def test_signal_lead_is_within_sbatch_range(lead):
    with pytest.raises(ConfigError, match=r"field 'slurm.signal_before_timeout_s': must be 0 \(no signal\) to 65535"):
        _profile_set("slurm.time_limit=UNLIMITED", f"slurm.signal_before_timeout_s={lead}")


@pytest.mark.parametrize(
    "field, value",
    [
        ("partition", "debug\n#SBATCH --account=evil"),
        ("account", "acct\necho pwned"),
        ("qos", "q\r"),
        ("time_limit", "1:00\n"),
        ("python", "python3\ntouch /tmp/x"),
        ("extra_sbatch", ["--comment=a\nb"]),
    ],
)
def test_newlines_are_rejected(field, value):
    with pytest.raises(ConfigError, match="newline or control character"):
        render_batch_script(_profile(**{field: value}), None, "/runs/r")


def test_newline_in_run_dir_is_rejected():
    with pytest.raises(ConfigError, match="run directory"):
        render_batch_script(_profile(), None, "/runs/a\nb")


def test_a_setup_command_yaml_read_as_a_boolean_is_said_to_be_quoted():
    """`setup: [..., true]` (the shell's no-op) was told the field expects a number."""
    with pytest.raises(ConfigError, match=r"field 'slurm\.setup': expects text, not true/false \(YAML reads"):
        _profile_set("slurm.setup=[echo a, true]")


def test_bad_setup_is_rejected():
    if not BASH:
        pytest.skip("bash not installed")
    with pytest.raises(ConfigError, match=r"slurm\.setup does not parse"):
        render_batch_script(_profile(setup=["echo 'unterminated"]), None, "/runs/r")
    with pytest.raises(ConfigError, match=r"slurm\.setup does not parse"):
        render_batch_script(_profile(setup=["cat <<EOF", "never closed"]), None, "/runs/r")


def test_setup_runs_without_nounset_and_cannot_leave_errexit_on(tmp_path):
    """`export LD_LIBRARY_PATH=/x:$LD_LIBRARY_PATH` with the variable unset ended the job under the script's
    `set -u` before any attempt ran; a setup's `set -e` stayed on, and the pre-timeout USR1 interrupting `wait`
    then ended the script without its checkpoint and requeue."""
    if not BASH:
        pytest.skip("bash not installed")
    setup = ["export LD_LIBRARY_PATH=/opt/cuda/lib64:$LD_LIBRARY_PATH", "set -e", "echo setup-ran $UNSET_BY_ANYONE"]
    script = tmp_path / "job.sbatch"
    script.write_text(render_batch_script(_profile(setup=setup), None, tmp_path / "run"))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CONA_SLURM_DRY_RUN": "1", "HOME": str(tmp_path)}
    result = subprocess.run([BASH, str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=30)
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert "setup-ran" in out, result.stdout
    (options,) = [line.removeprefix("shell_options=") for line in out if line.startswith("shell_options=")]
    assert "u" in options and "e" not in options, options


def _hostile_profile(marker: Path) -> ClusterProfile:
    pwn = f"$(touch {marker})"
    return _profile(
        partition=f'debug" {pwn} `touch {marker}` #',
        account=f"acct'; touch {marker}; '",
        qos=f"normal {pwn}",
        time_limit="1:00:00",
        extra_sbatch=[f"--comment=hello {pwn} ' \" \\", "--exclusive"],
        python=f"python3 -X 'dev mode' {pwn}",
        setup=["export CONA_SETUP_RAN=yes"],
    )


def test_hostile_values_stay_inert(tmp_path):
    """Render hostile values, check the golden text, then run the script's preamble for real: nothing executes."""
    if not BASH:
        pytest.skip("bash not installed")
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "runs" / 'it\'s a $(touch PWN) `x` "run" 100%'
    run_dir = Path(str(run_dir).replace("PWN", str(marker)))
    profile = _hostile_profile(marker)
    text = render_batch_script(profile, None, run_dir, job_name=f"job $(touch {marker}) 'q'")
    subprocess.run([BASH, "-n"], input=text, text=True, check=True)
    golden = render_batch_script(
        _hostile_profile(Path("/tmp/pwned")), None, "/runs/it's a $(touch /tmp/pwned) `x` \"run\" 100%",
        job_name="job $(touch /tmp/pwned) 'q'",
    )  # fmt: skip
    _golden("hostile.sbatch", golden)
    assert "100%%/attempts/slurm-%j.out" in golden

    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CONA_SLURM_DRY_RUN": "1", "HOME": str(tmp_path)}
    result = subprocess.run(
        [BASH, str(script), "sub-$(touch x)"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert not marker.exists(), "a hostile value was executed"
    assert not (tmp_path / "x").exists()
    out = result.stdout.splitlines()
    assert f"run_dir={run_dir}" in out
    # slurm.python is split like a shell would split it (quotes group words) but never evaluated
    assert [line for line in out if line.startswith("python=")] == [
        "python=python3", "python=-X", "python=dev mode", "python=$(touch", f"python={marker})",
    ]  # fmt: skip
    assert "submission=sub-$(touch x)" in out


def test_hostile_values_parse_in_sbatch_order():
    """The #SBATCH lines decode (by sbatch's rules: quotes, backslash escapes) to the original values."""
    marker = Path("/tmp/pwned")
    text = render_batch_script(_hostile_profile(marker), None, "/runs/r")
    values = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH "):
            option, _, value = line[len("#SBATCH ") :].partition("=")
            values[option] = _sbatch_unquote(value) if value else None
    assert values["--partition"] == f'debug" $(touch {marker}) `touch {marker}` #'
    assert values["--account"] == f"acct'; touch {marker}; '"
    assert values["--comment"] == f"hello $(touch {marker}) ' \" \\"
    assert "--exclusive" in values


def _sbatch_unquote(text: str) -> str:
    """sbatch's `_get_argument` (src/sbatch/opt.c): backslash escapes, ' and " quote, unquoted # ends the line."""
    out, quote, escape = [], None, False
    for ch in text:
        if escape:
            out.append(ch)
            escape = False
        elif ch == "\\":
            escape = True
        elif quote:
            if ch == quote:
                quote = None
            else:
                out.append(ch)
        elif ch in "\"'":
            quote = ch
        elif ch == "#" or ch.isspace():
            break
        else:
            out.append(ch)
    assert quote is None
    return "".join(out)


# --- the job-side helper --------------------------------------------------------------------------------------


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _launch(run: Path, attempt: int, submission: str, nnodes: int = 2, nproc: int = 2) -> None:
    strategy = {"dp": nnodes * nproc, "tp": 1, "pp": 1, "mbs": 1, "gbs": nnodes * nproc}
    _write(run / "attempts" / str(attempt) / "launch.json",
           {"attempt": attempt, "submission": submission, "nnodes": nnodes, "nproc_per_node": nproc,
            "strategy": strategy})  # fmt: skip


def _run_helper(*args: str, timeout: float = 30, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(HELPER), *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **env} if env else None,
    )  # fmt: skip


def test_helper_next_runs_its_own_launch_unless_the_run_moved_on(tmp_path):
    run = tmp_path / "run"
    start = time.monotonic()
    r = _run_helper("next", "--run-dir", str(run), "--submission", "mine", "--timeout", "0.6")
    assert r.returncode == 3 and time.monotonic() - start >= 0.5  # no launch record for this job yet
    _launch(run, 1, "mine")
    r = _run_helper("next", "--run-dir", str(run), "--submission", "mine", "--timeout", "5", "--job", "7")
    assert r.returncode == 0, r.stderr
    attempt, nnodes, nproc, port, rdzv, strategy = r.stdout.split()
    assert (attempt, nnodes, nproc, strategy) == ("1", "2", "2", "dp=4,tp=1,pp=1,mbs=1,gbs=4")
    assert 29500 <= int(port) < 30500 and rdzv == "run-1-7-0"
    # after attempt 1: wait for a newer launch of ours; the run moving on elsewhere ends the wait at once
    _launch(run, 2, "someone-else")
    r = _run_helper("next", "--run-dir", str(run), "--submission", "mine", "--after", "1", "--timeout", "5")
    assert r.returncode == 4
    # a job (re)started while a newer attempt runs in another job does not run its own older one
    r = _run_helper("next", "--run-dir", str(run), "--submission", "mine", "--timeout", "5")
    assert r.returncode == 4
    _launch(run, 3, "mine", nnodes=1, nproc=4)
    r = _run_helper("next", "--run-dir", str(run), "--submission", "mine", "--after", "1", "--timeout", "5")
    assert r.returncode == 0 and r.stdout.split()[:3] == ["3", "1", "4"]


@pytest.mark.timeout(120)  # without the check the read waits on the FIFO for ever
def test_the_helper_reads_a_fifo_in_the_run_directory_as_no_record(tmp_path, capsys):
    """A FIFO in place of a record (exit.json, launch.json, control.json) hung the job's helper past every bound of
    its waits; it is opened without blocking, said on stderr and read as no record."""
    os.mkfifo(tmp_path / "exit.json")
    assert helper._read_json(str(tmp_path / "exit.json")) is None
    assert capsys.readouterr().err == f"slurm_helper: {tmp_path / 'exit.json'} is not a regular file; read as no record\n"


def test_helper_next_after_restart(tmp_path):
    """A job that Slurm restarts reruns a requeued attempt but not one that had ended."""
    run = tmp_path / "run"
    _launch(run, 1, "s")
    _write(run / "attempts" / "1" / "slurm-exit.json", {"submission": "s", "code": 43, "requeued": True})
    r = _run_helper("next", "--run-dir", str(run), "--submission", "s", "--timeout", "1")
    assert r.returncode == 0 and r.stdout.split()[0] == "1"
    _write(run / "attempts" / "1" / "slurm-exit.json", {"submission": "s", "code": 42, "requeued": False})
    r = _run_helper("next", "--run-dir", str(run), "--submission", "s", "--timeout", "0.3")
    assert r.returncode == 3


def test_helper_next_manual_mode(tmp_path):
    run = tmp_path / "run"
    _write(run / "attempts" / "5" / "launch.json",
           {"attempt": 5, "strategy": {"dp": 2, "tp": 2, "pp": 1, "mbs": 1, "gbs": 2}})  # fmt: skip
    r = _run_helper("next", "--run-dir", str(run), "--nnodes", "2")
    assert r.returncode == 0 and r.stdout.split()[:3] == ["5", "2", "2"]
    assert r.stdout.split()[5] == "dp=2,tp=2,pp=1,mbs=1,gbs=2"
    r = _run_helper("next", "--run-dir", str(run), "--nnodes", "2", "--after", "5")
    assert r.returncode == 3


def test_busy_rendezvous_port_is_skipped():
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        base = busy - 10 if busy > 2000 else busy
        assert helper.free_port(busy, base) != busy
    assert helper.free_port(busy, base) in (busy, busy + 1)


def test_rendezvous_ports_differ_per_job_and_attempt():
    ports = {
        helper.rendezvous_port(29500, "/runs/a", job, attempt, 0)
        for job in range(1, 30)
        for attempt in (1, 2)
    }
    assert len(ports) > 50 and all(29500 <= p < 30500 for p in ports)
    assert helper.rendezvous_port(64900, "/r", 1, 1, 0) <= 65535
    assert helper.rendezvous_port(29500, "/r", 1, 1, 0) == helper.rendezvous_port(29500, "/r", 1, 1, 0)


@pytest.mark.parametrize(
    "codes, srun_rc, expected",
    [
        ({"0": 42, "1": 42}, 0, 42),
        ({"0": 0, "1": 0}, 0, 0),
        ({"0": 43, "1": 7}, 7, 7),
        ({"0": 43}, 1, 1),  # node 1 left no record: a crash
        ({"0": 42, "1": 43}, 0, 42),  # disagreement: node 0 decides
    ],
)
def test_combine_node_codes(codes, srun_rc, expected):
    records = {node: {"code": code} for node, code in codes.items()}
    assert helper._combine(records, 2, srun_rc)[0] == expected


def test_combine_forgives_an_agent_error_after_a_clean_exit():
    records = {"0": {"code": 42}, "1": {"code": 1, "agent_error": True}}
    assert helper._combine(records, 2, 1, trainer_code=42)[0] == 42
    assert helper._combine(records, 2, 1, trainer_code=None)[0] == 1
    assert helper._combine(records, 2, 1, trainer_code=43)[0] == 1  # disagrees with node 0
    crashed = {"0": {"code": 42}, "1": {"code": 7}}  # a trainer's own crash is never forgiven
    assert helper._combine(crashed, 2, 7, trainer_code=42)[0] == 7


@pytest.mark.parametrize(
    "code, signal, control, restarts_now, action",
    [
        (0, "", None, "0", "done"),
        (42, "", "switch", "0", "wait"),
        (44, "", None, "0", "wait"),
        (43, "", "stop", "0", "stop"),
        (43, "USR1", "stop", "0", "requeue"),  # a preemption signal wins over an older stop record
        (43, "", "switch", "0", "requeue"),  # 43 without a stop request: preempted (signal to the steps)
        (43, "TERM", None, "0", "stop"),  # scancel / time limit: never undo a cancel by requeuing
        (7, "", None, "0", "exit 7"),
        (43, "TERM", None, "1", "requeued"),  # Slurm requeued the job (node failure)
    ],
)
def test_finish_actions(tmp_path, code, signal, control, restarts_now, action):
    run = tmp_path / "run"
    for node in ("0", "1"):
        _write(
            run / "attempts" / "3" / "nodes" / f"{node}.json",
            {"node": node, "code": code, "job_id": "9", "restarts": 0},
        )
    if control:
        _write(run / "control.json", {"seq": 1, "command": control})
    r = _run_helper("finish", "--run-dir", str(run), "--attempt", "3", "--nnodes", "2", "--submission", "s",
                    "--signal", signal, "--job", "9", "--restarts", "0", "--restarts-now", restarts_now)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == action
    record = json.loads((run / "attempts" / "3" / "slurm-exit.json").read_text())
    assert record["code"] == code and record["submission"] == "s" and record["job_id"] == "9"
    assert record["requeued"] == (action in ("requeue", "requeued"))


def test_finish_ignores_stale_node_records(tmp_path):
    run = tmp_path / "run"
    _write(
        run / "attempts" / "1" / "nodes" / "0.json", {"node": "0", "code": 0, "job_id": "9", "restarts": 1}
    )
    _write(
        run / "attempts" / "1" / "nodes" / "1.json", {"node": "1", "code": 43, "job_id": "9", "restarts": 0}
    )
    r = _run_helper("finish", "--run-dir", str(run), "--attempt", "1", "--nnodes", "2", "--srun-rc", "0",
                    "--job", "9", "--restarts", "1")  # fmt: skip
    assert r.stdout.strip() == "exit 1"  # node 1's record is from the run before the restart


def test_in_place_switches_are_followed_to_the_attempt_that_ended(tmp_path):
    """A step started as attempt 1 whose trainers switched in place twice ended as attempt 3: `last` says so, and
    `finish` records the step's end in attempt 3's slurm-exit.json from the node records kept under attempt 1."""
    run = tmp_path / "run"
    _launch(run, 1, "s")
    _write(run / "attempts" / "1" / "slurm.json", {"submission": "s", "started_at": time.time() - 60})
    for n in (1, 2):
        _launch(run, n + 1, "s")
        launch = json.loads((run / "attempts" / str(n + 1) / "launch.json").read_text())
        _write(run / "attempts" / str(n + 1) / "launch.json", {**launch, "in_place": True})
        _write(run / "attempts" / str(n) / "exit.json", {"exit_code": 42, "next_attempt": n + 1, "time": time.time()})
    _write(run / "attempts" / "3" / "exit.json", {"exit_code": 42, "time": time.time()})
    r = _run_helper("last", "--run-dir", str(run), "--attempt", "1")
    assert r.returncode == 0 and r.stdout.strip() == "3", r.stderr
    for node in ("0", "1"):
        _write(run / "attempts" / "1" / "nodes" / f"{node}.json", {"node": node, "code": 42, "job_id": "9", "restarts": 0})
    r = _run_helper("finish", "--run-dir", str(run), "--attempt", "1", "--nnodes", "2", "--submission", "s",
                    "--job", "9", "--restarts", "0")  # fmt: skip
    assert r.stdout.strip() == "wait", r.stderr
    record = json.loads((run / "attempts" / "3" / "slurm-exit.json").read_text())
    assert (record["attempt"], record["started_as"], record["code"]) == (3, 1, 42)
    assert not (run / "attempts" / "1" / "slurm-exit.json").exists()
    # An exit record older than the step's start (from before a requeue) is not followed.
    _write(run / "attempts" / "1" / "slurm.json", {"submission": "s", "started_at": time.time() + 60})
    assert _run_helper("last", "--run-dir", str(run), "--attempt", "1").stdout.strip() == "1"


def test_next_after_a_requeue_before_an_offered_in_place_switch_runs_the_previous_attempt(tmp_path):
    """The orchestrator offered attempt 2 in place; the job was requeued before its trainers switched (attempt 1
    names no next attempt): the restarted job runs attempt 1, whose trainer then finds the switch request."""
    run = tmp_path / "run"
    _launch(run, 1, "s")
    _launch(run, 2, "s")
    launch = json.loads((run / "attempts" / "2" / "launch.json").read_text())
    _write(run / "attempts" / "2" / "launch.json", {**launch, "in_place": True})
    r = _run_helper("next", "--run-dir", str(run), "--submission", "s", "--timeout", "5")
    assert r.returncode == 0 and r.stdout.split()[0] == "1", r.stderr
    _write(run / "attempts" / "1" / "exit.json", {"exit_code": 42, "next_attempt": 2, "time": time.time()})
    r = _run_helper("next", "--run-dir", str(run), "--submission", "s", "--timeout", "5")
    assert r.returncode == 0 and r.stdout.split()[0] == "2", r.stderr


def test_next_waits_when_a_requeued_elastic_job_came_back_on_fewer_nodes(tmp_path):
    """An elastic job (`--nodes=1-2`) switched in place (attempt 2: 2 nodes, no `by_nnodes`) and Slurm requeued
    it onto 1 node (the other drained meanwhile): its srun failed "Only allocated 1 nodes asked for 2" and the
    attempt counted as a crash. `next` now waits for the orchestrator to replan (it sees the job on too few nodes);
    its elastic start (`by_nnodes`) still runs the table's strategy for the nodes it got."""
    run = tmp_path / "run"
    job = {"SLURM_NNODES": "1"}  # Slurm sets it in the job; the helper checks the node count only then
    _launch(run, 1, "s")
    launch = json.loads((run / "attempts" / "1" / "launch.json").read_text())
    table = {"1": {"strategy": {"dp": 2, "tp": 1, "pp": 1, "mbs": 1, "gbs": 2}, "nproc_per_node": 2},
             "2": {"strategy": launch["strategy"], "nproc_per_node": 2}}  # fmt: skip
    _write(run / "attempts" / "1" / "launch.json", {**launch, "by_nnodes": table})
    r = _run_helper("next", "--run-dir", str(run), "--submission", "s", "--timeout", "5", "--nnodes", "1", env=job)
    assert r.returncode == 0 and r.stdout.split()[:3] == ["1", "1", "2"], r.stderr
    _launch(run, 2, "s")  # the switch in place, on the 2 nodes the job had
    _write(run / "attempts" / "2" / "launch.json",
           {**json.loads((run / "attempts" / "2" / "launch.json").read_text()), "in_place": True})  # fmt: skip
    _write(run / "attempts" / "1" / "exit.json", {"exit_code": 42, "next_attempt": 2, "time": time.time()})
    r = _run_helper("next", "--run-dir", str(run), "--submission", "s", "--timeout", "1", "--nnodes", "1", env=job)
    assert r.returncode == 3 and r.stdout == "", r.stdout
    assert r.stderr.count("attempt 2 needs 2 node(s), this job has 1; waiting") == 1, r.stderr
    # Outside a Slurm job (no SLURM_NNODES: the batch script's default of 1) the count is not checked.
    r = _run_helper("next", "--run-dir", str(run), "--submission", "s", "--timeout", "5", "--nnodes", "1",
                    env={"SLURM_NNODES": ""})  # fmt: skip
    assert r.returncode == 0 and r.stdout.split()[:3] == ["2", "2", "2"], r.stderr
    r = _run_helper("next", "--run-dir", str(run), "--submission", "s", "--timeout", "5", "--nnodes", "2", env=job)
    assert r.returncode == 0 and r.stdout.split()[:3] == ["2", "2", "2"], r.stderr
    _launch(run, 3, "other")  # the orchestrator replanned and submitted another job: this one ends
    r = _run_helper("next", "--run-dir", str(run), "--submission", "s", "--timeout", "5", "--nnodes", "1", env=job)
    assert r.returncode == 4, r.stderr



def test_helper_next_reads_the_launch_records_once_per_look(tmp_path, monkeypatch, capsys):
    """The job's next hand-off, written by the orchestrator while `next` looked: read in two passes, the record was
    missing from this job's launches and newest in the run's, so the job ended ("runs in another job") although the
    attempt was addressed to it (CI saw `test_switch_relaunches_inside_the_allocation` fail so). One snapshot now."""
    run = tmp_path / "run"
    _launch(run, 1, "mine")
    _write(run / "attempts" / "1" / "slurm-exit.json", {"submission": "mine", "requeued": False})
    real_glob, calls = helper.glob.glob, {"n": 0}

    def glob_that_sees_the_hand_off_appear(pattern: str) -> list[str]:
        calls["n"] += 1
        if calls["n"] == 2:  # between the first read and any second one: the orchestrator hands attempt 2 over
            _launch(run, 2, "mine")
        return real_glob(pattern)

    monkeypatch.setattr(helper.glob, "glob", glob_that_sees_the_hand_off_appear)
    code = helper.cmd_next(["--run-dir", str(run), "--submission", "mine", "--after", "1", "--timeout", "5"])
    assert code == 0 and capsys.readouterr().out.split()[0] == "2"


def test_the_agent_ends_its_node_log_with_torchruns_summary(tmp_path, monkeypatch, capsys):
    """The agent catches torchrun's failure to record the node's exit code, so torchrun's summary (which rank died,
    of what signal) was never printed and the crash line could not name a rank killed by a signal. It prints it, as
    torchrun does when nobody catches it: the orchestrator reads it at the end of the node's log."""
    pytest.importorskip("torch")
    import signal

    import torch.distributed.run
    from cona.orchestrator.backends.crashcause import torchrun_root_cause
    from torch.distributed.elastic.multiprocessing import api as elastic_api
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def torchrun(args):
        raise ChildFailedError("cona.trainer", {3: ProcessFailure(local_rank=1, pid=4321, exitcode=-9,
                                                                  error_file=str(tmp_path / "none.json"))})  # fmt: skip

    monkeypatch.setattr(torch.distributed.run, "main", torchrun)
    # What the agent changes in its process, put back for the rest of this one.
    monkeypatch.setattr(elastic_api, "_terminate_process_handler", elastic_api._terminate_process_handler)
    for name in ("PET_SIGNALS_TO_HANDLE", "TORCHELASTIC_SIGNALS_TO_HANDLE"):
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("SLURM_NODEID", "1")
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    try:
        assert helper.cmd_agent(["--node-dir", str(tmp_path), "--", "--nnodes=2"]) == 128 + 9
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    log = tmp_path / "node-1.log"
    log.write_text("step 7\n" + capsys.readouterr().err)
    root = torchrun_root_cause([log])
    assert root is not None and (root.rank, root.exit_code) == (3, -9), log.read_text()
    assert json.loads((tmp_path / "1.json").read_text())["ranks"] == {"3": 137}
