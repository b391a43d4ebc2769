"""Fuzzed input (hypothesis): job specs and profiles mutated from the shipped ones, `--set` pairs and command-line
flags with bad values. Each either works or exits 2 with one `error:` line — never a traceback, never exit 1.
Hostile strings in everything that reaches a shell command stay inert: the local backend's wrapper is rendered and
run with a marker file that must not appear.

In-process (`cona.orchestrator.cli.main`), so a few hundred examples take seconds."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from cona.orchestrator import cli
from cona.orchestrator.job import load_job
from cona.orchestrator.profile import load_profile
from cona.protocol.rundir import RunDir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import REPO

PROFILE = REPO / "slurm" / "profiles" / "local-cpu.yaml"
JOB = REPO / "examples" / "tiny-gpt.yaml"
# CI draws the same 60 examples a test every time (derandomize: a failure there is no accident of the draw);
# CONA_FUZZ_EXAMPLES=N draws N fresh ones, to look for more (docs/reliability.md).
EXAMPLES = int(os.environ.get("CONA_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="CONA_FUZZ_EXAMPLES" not in os.environ,
                database=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip

HOSTILE = ["$(touch {m})", "`touch {m}`", "; touch {m}; #", "' ; touch {m} ; '", '" ; touch {m} ; "', "\\", "%", "{m}"]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """`cona ARGV` in this process: (exit code, stdout, stderr); argparse's exits come back as codes."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def assert_works_or_one_line(code: int, err: str, what: str) -> str:
    """0, or 2 with exactly one `error:` line; returns that line."""
    assert "Traceback" not in err, f"{what}: traceback\n{err}"
    assert code in (0, 2), f"{what}: exit {code}\n{err}"
    if code == 0:
        return ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], f"{what}: not one error line\n{err}"
    return lines[0]


def leaf_paths(data: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(data, dict):
        return [prefix] * bool(prefix) + [p for k, v in data.items() for p in leaf_paths(v, (*prefix, str(k)))]
    return [prefix]


VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30), st.sampled_from(HOSTILE),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
    st.sampled_from([0, -1, 1, 2**31, 1e308, -1e-308, "", " ", "null", "1e999", "nan"]),
)  # fmt: skip


def mutated(document: dict[str, Any], draw) -> tuple[dict[str, Any], str]:
    """`document` with one field removed, retyped or set to an extreme or hostile value; and which."""
    data = copy.deepcopy(document)
    path = draw(st.sampled_from(leaf_paths(data)))
    node = data
    for key in path[:-1]:
        node = node[key]
    if draw(st.booleans()) and len(path) > 0:
        node.pop(path[-1], None)
        return data, f"removed {'.'.join(path)}"
    value = draw(VALUES)
    if isinstance(value, str) and "{m}" in value:
        value = value.replace("{m}", "/tmp/cona-fuzz-marker")
    node[path[-1]] = value
    return data, f"{'.'.join(path)}={value!r}"


def _write(tmp_path: Path, name: str, data: dict[str, Any]) -> Path:
    path = tmp_path / name
    # allow_unicode: a surrogate or control character would not survive YAML; keep what YAML can carry
    path.write_text(yaml.safe_dump(data, allow_unicode=False))
    return path


@FUZZ
@given(st.data())
def test_mutated_job_specs_work_or_name_the_field(tmp_path, data):
    document = yaml.safe_load(JOB.read_text())
    job, what = mutated(document, data.draw)
    path = _write(tmp_path, "job.yaml", job)
    code, _, err = run_cli(["render", "local", "--profile", str(PROFILE), "--job", str(path), "--run-dir", str(tmp_path / "r")])
    line = assert_works_or_one_line(code, err, what)
    if line:  # it names the file or a field, or (no strategy fits) the command that says why for each
        assert str(path) in line or "policy" in line or "cona plan --all" in line or any(
            part in line for part in what.split("=")[0].removeprefix("removed ").split(".")
        ), f"{what}: {line}"
    assert not Path("/tmp/cona-fuzz-marker").exists()


@FUZZ
@given(st.data())
def test_mutated_profiles_work_or_name_the_field(tmp_path, data):
    document = yaml.safe_load(PROFILE.read_text())
    profile, what = mutated(document, data.draw)
    path = _write(tmp_path, "profile.yaml", profile)
    code, _, err = run_cli(["render", "local", "--profile", str(path), "--job", str(JOB), "--run-dir", str(tmp_path / "r")])
    assert_works_or_one_line(code, err, what)
    assert not Path("/tmp/cona-fuzz-marker").exists()


KEYS = st.one_of(st.text(max_size=20), st.sampled_from(
    ["optimizer.lr", "batch.max_gbs", "policy.schedule", "policy.name", "target", "model.preset", "a..b", ".", "=",
     "eval.interval_samples", "checkpoint.keep", "policy.decision_interval_s", "seed", "name"]))  # fmt: skip


@FUZZ
@given(key=KEYS, separator=st.sampled_from(["=", "", "==", " = "]), value=st.one_of(st.text(max_size=30), st.sampled_from(
    ["[", "{a: [", "!!python/object:os.system", "*x", "1e999", "-1", "null", "[]", "{}"])))  # fmt: skip
def test_set_pairs_work_or_say_what_is_wrong(tmp_path, key, value, separator):
    pair = f"{key}{separator}{value}"
    code, _, err = run_cli(["render", "local", "--profile", str(PROFILE), "--job", str(JOB), "--set", pair,
                            "--run-dir", str(tmp_path / "r")])  # fmt: skip
    assert_works_or_one_line(code, err, f"--set {pair!r}")


BAD = st.one_of(st.text(max_size=15), st.sampled_from(["-1", "0", "1e9", "nan", "", "--", "-h2", "x" * 300]))


@FUZZ
@given(flag=st.sampled_from([
    ["plan", "--profile", str(PROFILE), "--job", str(JOB), "--top", "{}"],
    ["plan", "--profile", str(PROFILE), "--job", str(JOB), "--gbs", "{}"],
    ["plan", "--profile", "{}", "--job", str(JOB)],
    ["plan", "--profile", str(PROFILE), "--job", "{}"],
    ["plan", "--profile", str(PROFILE), "--profile-set", "{}", "--job", str(JOB)],
    ["render", "local", "--profile", str(PROFILE), "--job", str(JOB), "--run-dir", "/nonexistent/{}"],
    ["run", "--resume", "/nonexistent/{}"],
    ["status", "/nonexistent/{}"],
    ["stop", "/nonexistent/{}"],
    ["report", "/nonexistent/{}"],
]), value=BAD)  # fmt: skip
def test_cli_flags_with_bad_values(flag, value):
    argv = [part.replace("{}", value) for part in flag]
    code, _, err = run_cli(argv)
    assert_works_or_one_line(code, err, " ".join(argv))
    assert not Path("/nonexistent").exists()


@FUZZ
@given(value=BAD)
def test_policy_flag_works_or_says_what_is_valid(value):
    """`cona run --policy VALUE`, without starting a run: the flag's own translation (`cli._policy_overrides`)."""
    for policy in (value, f"fixed:{value}"):
        try:
            overrides = cli._policy_overrides(policy)
        except cli.UserError as e:
            assert "\n" not in str(e) and "--policy" in str(e)
            continue
        code, _, err = run_cli(["render", "local", "--profile", str(PROFILE), "--job", str(JOB),
                                *[a for o in overrides for a in ("--set", o)]])  # fmt: skip
        assert_works_or_one_line(code, err, f"--policy {policy!r}")


@FUZZ
@given(name=st.one_of(st.sampled_from(HOSTILE), st.text(alphabet=st.characters(blacklist_categories=["Cs", "Cc"]),
                                                         min_size=1, max_size=20)))  # fmt: skip
def test_hostile_run_directory_stays_inert_in_the_local_wrapper(tmp_path, name):
    """The local backend's shell wrapper with a hostile run directory, run for real (with `true` as Python): the
    marker never appears and the exit code lands in the attempt directory, where the backend reads it."""
    from cona.orchestrator.backends.local.backend import LocalBackend
    from cona.orchestrator.job import load_job
    from cona.orchestrator.profile import load_profile
    from cona.protocol.rundir import RunDir
    from cona.protocol.strategy import Strategy

    root = Path(tempfile.mkdtemp(dir=tmp_path))  # one per example: hypothesis reuses tmp_path
    marker = root / "pwned"
    name = name.replace("{m}", str(marker)).replace("/", "_").replace("\0", "")
    run = RunDir(root / "runs" / (name if name not in (".", "..") else "dot"))
    backend = LocalBackend(run_dir=run, profile=load_profile(PROFILE), job=load_job(JOB))
    backend.python = "true"
    run.attempt_dir(1).mkdir(parents=True)
    wrapper = backend.wrapper(attempt=1, strategy=Strategy.parse("dp=4,tp=1,pp=1,mbs=4,gbs=16"))
    result = subprocess.run(["/bin/sh", "-c", wrapper], cwd=root, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert not marker.exists(), f"{name!r} was executed"
    assert (run.attempt_dir(1) / "exit_code").read_text().strip() == "0"


def test_status_of_something_that_is_no_run_is_one_line(tmp_path):
    code, _, err = run_cli(["status", str(tmp_path / "nothing")])
    assert code == 2 and assert_works_or_one_line(code, err, "status")


@pytest.mark.parametrize("text", ["{", "[]", '{"version": 99}', "\x00\xff"])
def test_corrupt_state_json_is_one_line_naming_it(tmp_path, text):
    """`cona status` and `cona run --resume` on a run whose state.json is corrupt: the file named, exit 2."""
    from cona.orchestrator.job import load_job
    from cona.orchestrator.profile import load_profile
    from cona.orchestrator.runstate import create_run
    from cona.protocol.rundir import RunDir

    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(PROFILE), job=load_job(JOB))
    run.state_json.write_bytes(text.encode("latin-1"))
    for argv in (["status", str(run.root)], ["run", "--resume", str(run.root)]):
        code, _, err = run_cli(argv)
        line = assert_works_or_one_line(code, err, " ".join(argv))
        assert code == 2 and str(run.state_json) in line, (argv, err)


def test_a_run_with_a_bad_schedule_leaves_no_run_directory(tmp_path):
    """Refused before the run exists: otherwise the corrected command would resume the bad one's run.yaml."""
    run = tmp_path / "r"
    bad = "policy.schedule=[{samples: 0, strategy: 'dp=3,tp=1,pp=1,mbs=4,gbs=16'}]"
    code, _, err = run_cli(["run", "--profile", str(PROFILE), "--job", str(JOB), "--set", "policy.name=schedule",
                            "--set", bad, "--run-dir", str(run)])  # fmt: skip
    line = assert_works_or_one_line(code, err, bad)
    assert code == 2 and "policy.schedule[0]" in line
    assert not (run / "run.yaml").exists()


def test_a_slurm_profile_its_batch_script_cannot_carry_leaves_no_run_directory(tmp_path):
    """Checked only as the script was rendered, at the first launch: the run directory stayed behind, 'running'."""
    slurm = REPO / "slurm" / "profiles" / "local-slurm.yaml"
    for override, expected in [
        ('slurm.extra_sbatch=["--exclusive --mem=0"]', "slurm.extra_sbatch: '--exclusive --mem=0' is not an sbatch option"),
        ('slurm.python=""', "slurm.python is empty"),
        ("slurm.setup=[\"echo 'open\"]", "slurm.setup does not parse as shell commands"),
    ]:  # fmt: skip
        run = tmp_path / f"run-{len(override)}"
        code, _, err = run_cli(["run", "--profile", str(slurm), "--job", str(JOB), "--profile-set", override,
                                "--run-dir", str(run)])  # fmt: skip
        line = assert_works_or_one_line(code, err, override)
        assert code == 2 and expected in line, line
        assert not run.exists()


def test_an_init_from_that_is_another_model_is_refused_before_the_run_exists(tmp_path):
    """config.json is read by `cona run`, not first by the trainer: on a cluster that was after the queue's wait, and
    the run directory then held the job that does not fit."""
    import json

    from cona.protocol.hfconfig import _GELU_NAMES

    hf = tmp_path / "hf"
    hf.mkdir()
    tiny = load_job(JOB).model
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": tiny.num_layers,
              "n_embd": tiny.hidden_size, "n_head": tiny.num_heads, "n_positions": tiny.seq_len,
              "vocab_size": tiny.vocab_size, "layer_norm_epsilon": tiny.norm_eps,
              "tie_word_embeddings": tiny.tie_embeddings,
              "activation_function": _GELU_NAMES[tiny.gelu_approximation]}  # fmt: skip
    for changes, expected, fix in [
        ({"n_embd": 2 * tiny.hidden_size}, f"hidden_size is {2 * tiny.hidden_size} there but {tiny.hidden_size} here; "
         f"set model.hidden_size: {2 * tiny.hidden_size}", "either"),
        ({"model_type": "llama"}, "a llama model, but model.family is gpt; set model.family: llama", "either"),
        # Python's json reads NaN, which JSON has not: the advice was `set model.norm_eps: nan`.
        ({"layer_norm_epsilon": float("nan")}, "config.json: not valid JSON (NaN is not a JSON number", "files"),
    ]:
        (hf / "config.json").write_text(json.dumps({**config, **changes}))
        run = tmp_path / f"run-{fix}-{len(changes)}-{next(iter(changes))}"
        code, _, err = run_cli(["run", "--profile", str(PROFILE), "--job", str(JOB), "--set",
                                f"model.init_from={hf}", "--run-dir", str(run)])  # fmt: skip
        line = assert_works_or_one_line(code, err, str(changes))
        assert code == 2 and "model.init_from:" in line and expected in line, line
        assert not (run / "run.yaml").exists()
    # A config.json that describes the model passes this check (the tensors are the trainer's to check).
    from cona.protocol.inputs import check_init_from

    (hf / "config.json").write_text(json.dumps(config))
    check_init_from(load_job(JOB).model_copy(update={"model": tiny.model_copy(update={"init_from": str(hf)})}))


def test_paths_of_the_wrong_kind_are_one_line(tmp_path):
    """A file where a run directory belongs, a run directory that cannot be created, `--out` naming a file."""
    from cona.orchestrator.runstate import create_run

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for argv, expected in [
        (["status", str(a_file)], f"{a_file}: a file, not a run directory"),
        (["report", str(a_file)], f"{a_file}: a file, not a run directory"),
        (["stop", str(a_file)], f"{a_file}: a file, not a run directory"),
        (["run", "--resume", str(a_file)], f"{a_file}: a file, not a run directory"),
        (["run", "--profile", str(PROFILE), "--job", str(JOB), "--run-dir", str(a_file / "run")],
         f"--run-dir {a_file / 'run'}: cannot create it"),
    ]:  # fmt: skip
        code, _, err = run_cli(argv)
        line = assert_works_or_one_line(code, err, " ".join(argv))
        assert code == 2 and expected in line, (argv, err)
    run = tmp_path / "run"
    create_run(run_dir=RunDir(run), profile=load_profile(PROFILE), job=load_job(JOB))
    code, _, err = run_cli(["report", str(run), "--out", str(a_file)])
    assert code == 2 and f"--out {a_file}: a file, not a directory" in assert_works_or_one_line(code, err, "report")


def test_resume_and_rerun_never_drop_what_the_command_asks_for(tmp_path):
    """`run --resume` with flags it would ignore, and the same --run-dir given another job: refused, not resumed."""
    from cona.orchestrator.runstate import create_run

    run = tmp_path / "run"
    create_run(run_dir=RunDir(run), profile=load_profile(PROFILE), job=load_job(JOB))
    for argv, expected in [
        (["run", "--resume", str(run), "--set", "optimizer.lr=99"], "drop --profile/--job/--set"),
        (["run", "--resume", str(run), "--profile-set", "nodes=2"], "a resumed run keeps the profile it was planned"),
        (["run", "--resume", str(run), "--profile-set", "slurm.qos=x"], "the run has not ended (status created)"),
        (["run", "--resume", str(run), "--policy", "static"], "--resume takes the profile, job and policy"),
        (["run", "--profile", str(PROFILE), "--job", str(JOB), "--set", "optimizer.lr=0.5", "--run-dir", str(run)],
         f"--run-dir {run} holds a run with another job"),
        (["run", "--profile", str(PROFILE), "--profile-set", "nodes=2", "--job", str(JOB), "--run-dir", str(run)],
         f"--run-dir {run} holds a run with another profile"),
    ]:  # fmt: skip
        code, _, err = run_cli(argv)
        line = assert_works_or_one_line(code, err, " ".join(argv))
        assert code == 2 and expected in line, (argv, err)


def test_stop_of_a_run_that_never_started_writes_nothing_the_next_start_would_act_on(tmp_path):
    """A run created and never started took the stop command, and its first `cona run --resume` then trained one
    step and stopped "on request". Just after `cona run` created it (the orchestrator may not hold it yet) the stop
    is still written, for that orchestrator to act on."""
    import os

    from cona.orchestrator.cli import NEVER_STARTED_S
    from cona.orchestrator.runstate import create_run

    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(PROFILE), job=load_job(JOB))
    code, out, _ = run_cli(["stop", str(run.root)])
    assert code == 0 and run.read_control().command == "stop"  # may be starting: asked
    run.control_json.unlink()
    old = run.run_yaml.stat().st_mtime - NEVER_STARTED_S - 1
    os.utime(run.run_yaml, (old, old))
    code, out, _ = run_cli(["stop", str(run.root)])
    assert code == 0 and "was created but never started; nothing to stop (no stop command written)" in out
    assert run.read_control() is None


def test_stop_outranks_a_damaged_control_file_and_leaves_an_ended_run_alone(tmp_path):
    from cona.orchestrator.runstate import RunState, create_run, read_state, write_state

    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(PROFILE), job=load_job(JOB))
    write_state(run, RunState(status="running", control_seq=5))
    run.control_json.write_text('{"seq": 5, "comm')  # torn: the orchestrator has taken note of seq 5
    code, out, _ = run_cli(["stop", str(run.root)])
    assert code == 0 and run.read_control().seq == 6 and run.read_control().command == "stop"
    write_state(run, RunState(status="done", final=True, control_seq=6))
    code, out, _ = run_cli(["stop", str(run.root)])
    assert code == 0 and "already ended (done); nothing to stop" in out
    assert run.read_control().seq == 6 and read_state(run).status == "done"


@pytest.mark.parametrize("text", ['{"seq": "9", "command": "checkpoint"}', '{"seq": null, "command": "stop"}',
                                  '{"seq": [1], "command": "stop"}', '{"seq": true, "command": "stop"}',
                                  '{"seq": 3, "command": "switch", "attempt": "2"}', '{"seq": -1, "command": "stop"}',
                                  '{"seq": 3, "command": "switch", "in_place": "yes"}'])  # fmt: skip
def test_a_mistyped_control_record_is_passed_over_as_damaged(tmp_path, text):
    """`"seq": "9"` was compared with an int by the trainer's poll, the orchestrator and `cona stop`: three
    tracebacks, and a relaunch loop that named no cause. It is now read as no record, like a torn one."""
    from cona.orchestrator.runstate import RunState, create_run, read_state, write_state

    run = RunDir(tmp_path / "run")
    create_run(run_dir=run, profile=load_profile(PROFILE), job=load_job(JOB))
    write_state(run, RunState(status="running", control_seq=4))
    run.control_json.write_text(text)
    assert run.read_control() is None
    code, _, err = run_cli(["stop", str(run.root)])
    assert code == 0, err
    assert run.read_control().seq == 5 and run.read_control().command == "stop" and read_state(run).status == "running"


@pytest.mark.parametrize("argv, expected", [
    (["plan", "--profile", str(PROFILE), "--job", str(JOB), "--top", "-3"], "--top -3: give a positive count"),
    (["plan", "--profile", str(PROFILE), "--job", str(JOB), "--gbs", "7"], "no feasible strategy for tiny-gpt"),
    (["plan", "--profile", str(PROFILE), "--job", str(JOB), "--set", "batch.gbs_choices=[1000]"],
     "field 'batch': gbs_choices [1000] must be a non-empty list within [min_gbs, max_gbs]"),
    (["plan", "--profile", str(PROFILE), "--job", str(JOB), "--set", "name=../../evil"], "field 'name': use 1-63 letters"),
    (["plan", "--profile", str(PROFILE), "--job", str(JOB), "--profile-set", "accelerator.memory=4"],
     "field 'accelerator.memory': '4' has no unit; write e.g. '4 GB' or '4 GiB'"),
    (["render", "slurm", "--profile", str(REPO / "slurm" / "profiles" / "local-slurm.yaml"), "--job", str(JOB),
      "--profile-set", "slurm.time_limit=forever"], "field 'slurm.time_limit': not a Slurm time"),
    (["run", "--profile", str(PROFILE), "--job", str(JOB), "--policy", "fixed:dp=1,dp=4,tp=1,pp=1,mbs=2,gbs=16",
      "--run-dir", "/nonexistent/x"], "dp is given twice"),
    (["render", "kubernetes", "--profile", str(REPO / "manifests" / "profiles" / "h100-k8s.yaml"), "--job", str(JOB),
      "--profile-set", "kubernetes.tolerations=[{key: a, operator: Maybe, effect: NoSchedule}]"],
     "field 'kubernetes.tolerations': [0].operator 'Maybe': use one of 'Exists', 'Equal'"),
    (["render", "kubernetes", "--profile", str(REPO / "manifests" / "profiles" / "h100-k8s.yaml"), "--job", str(JOB),
      "--profile-set", "kubernetes.tolerations=[{key: a, operatr: Exists}]"],
     "field 'kubernetes.tolerations': [0]: unknown key(s) 'operatr'; valid: "),
    (["plan", "--profile", str(JOB), "--job", str(PROFILE)], "given as --profile; did you swap --profile and --job?"),
    # e-notation is how a too-large count is usually written; it passed the limit, and `cona run` wrote a run.yaml
    # that it then refused to read.
    (["plan", "--profile", str(PROFILE), "--job", str(JOB), "--set", "target.max_samples=1e20"],
     "field 'target.max_samples': too large (at most 9e+15)"),
    (["plan", "--profile", str(PROFILE), "--job", str(JOB), "--set", "seed=1.5e30"], "field 'seed': too large"),
    (["plan", "--profile", str(PROFILE), "--job", str(JOB), "--set", "seed=010"],
     "--set 'seed=010': 010 is an octal number to YAML 1.1 (8)"),
    # Denormal rates and peaks divided the cost model by zero (a traceback).
    (["plan", "--profile", str(REPO / "slurm" / "profiles" / "a100-4x8.yaml"), "--job", str(JOB), "--profile-set", "accelerator.peak_tflops=1e-320"],
     "field 'accelerator.peak_tflops': Input should be greater than or equal to"),
    (["plan", "--profile", str(REPO / "slurm" / "profiles" / "a100-4x8.yaml"), "--job", str(JOB), "--profile-set", "network.inter_node_bandwidth=1e-310 bit/s"],
     "field 'network.inter_node_bandwidth': '1e-310 bit/s' is less than one byte per second"),
    (["plan", "--profile", str(REPO / "slurm" / "profiles" / "a100-4x8.yaml"), "--job", str(JOB), "--profile-set", "accelerator.memory=80 GB/s"],
     "field 'accelerator.memory': '80 GB/s' is a rate; a size has no /s"),
    # An inf prior: "noise scale must be finite", naming no field.
    (["plan", "--profile", str(PROFILE), "--job", str(JOB), "--set", "policy.critical_batch_factor=1e308"],
     "field 'policy.critical_batch_factor': Input should be less than or equal to"),
    # Micro-batches larger than any batch: "at most 0 devices ... set gpus_per_node to at most 0".
    (["plan", "--profile", str(PROFILE), "--job", str(JOB), "--set", "batch.mbs_choices=[256]"],
     "mbs_choices [256] are all larger than max_gbs=128"),
    # A cosine that ends before the warmup does: a drop from the peak to the floor in one step.
    (["plan", "--profile", str(PROFILE), "--job", str(JOB), "--set", "optimizer.decay_samples=1000"],
     "field 'optimizer': decay_samples=1000 is not past warmup_samples=2048"),
    (["plan", "--profile", str(PROFILE), "--job", str(JOB), "--set", "policy.name=schedule", "--set",
      "policy.schedule=[{samples: 0, strategy: 'dp=4,tp=1,pp=1,mbs=2,gbs=16'}, {samples: 0, strategy: 'dp=4,tp=1,pp=1,mbs=2,gbs=32'}]"],
     "policy.schedule must start at samples 0 and increase strictly"),
    # A text file read as raw token ids: refused only by the trainer, after the run existed.
    (["run", "--profile", str(PROFILE), "--job", str(JOB), "--set", "data.format=tokens", "--run-dir", "/nonexistent/x"],
     "is a text file, but data.format is tokens"),
    (["render", "kubernetes", "--profile", str(REPO / "manifests" / "profiles" / "h100-k8s.yaml"), "--job", str(JOB),
      "--profile-set", "kubernetes.node_selector={nvidia.com/gpu.present: true}"],
     'nvidia.com/gpu.present: YAML read the value as a boolean, and a label value is text; quote it'),
    (["render", "slurm", "--profile", str(REPO / "slurm" / "profiles" / "a100-4x8.yaml"), "--job", str(JOB), "--profile-set", "slurm.partition=gpu batch"],
     "'gpu batch' is not a Slurm partition name"),
    (["render", "slurm", "--profile", str(REPO / "slurm" / "profiles" / "a100-4x8.yaml"), "--job", str(JOB), "--profile-set", "slurm.qos= "],
     "field 'slurm.qos': empty; give the qos's name"),
    (["plan", "--profile", str(PROFILE), "--job", str(PROFILE)], "given as --job; did you swap --profile and --job?"),
])  # fmt: skip
def test_values_that_were_taken_silently_are_one_line(argv, expected):
    code, _, err = run_cli(argv)
    line = assert_works_or_one_line(code, err, " ".join(argv))
    assert code == 2 and expected in line, (argv, err)
    assert not Path("/nonexistent").exists()


def test_a_data_plane_command_whose_python_cannot_start_is_one_line(monkeypatch, capsys):
    """`cona export` (and the other commands run in their own process) ended in a PermissionError traceback when
    this user could not run cona's interpreter."""
    import subprocess

    from cona.orchestrator import cli

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(subprocess, "Popen", refused)
    assert cli.main(["export", "runs/x", "--format", "hf", "--out", "/nonexistent/y"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cona: error: cannot start ") and "`cona export`: Permission denied" in err
    assert err.count("\n") == 1
