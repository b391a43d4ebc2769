"""Render the Slurm batch script of a run from the cluster profile (`cona render slurm`).

The script text lives in `orchestrator/backends/slurm/templates/cona.sbatch.tmpl` and embeds the job-side helper
`orchestrator/backends/slurm/templates/slurm_helper.py` verbatim; this module fills in the values. Every value that reaches the
shell is `shlex.quote`d; `#SBATCH` lines are comments to bash and are parsed only by sbatch, whose own quoting
(double quotes, backslash escapes) is used for them. A value with a newline or another control character is
rejected with a `ConfigError`: no quoting can carry it on an `#SBATCH` line.

Torch-free and quick to import (login nodes).
"""

from __future__ import annotations

import hashlib
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from cona.protocol.yamlconfig import ConfigError

if TYPE_CHECKING:
    from cona.orchestrator.job import Job
    from cona.orchestrator.profile import ClusterProfile

TEMPLATES = Path(__file__).resolve().parent / "templates"
SCRIPT_TEMPLATE = TEMPLATES / "cona.sbatch.tmpl"
HELPER = TEMPLATES / "slurm_helper.py"
HELPER_EOF = "CONA_HELPER_EOF"

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SBATCH_BARE = re.compile(r"[A-Za-z0-9_.,:/@%+=\-\[\]]+")
_OPTION = re.compile(r"--?[A-Za-z][A-Za-z0-9\-]*")
_PLACEHOLDER = re.compile(r"\{\{([A-Z_]+)\}\}")


def check_value(what: str, value: str) -> str:
    """`value` unchanged, or a ConfigError when it holds a newline or another control character."""
    if _CONTROL.search(value):
        shown = value.encode("unicode_escape").decode()
        raise ConfigError(
            f"{what}: '{shown}' contains a newline or control character; "
            "it cannot be put on an #SBATCH line or into the job's shell"
        )
    return value


def sbatch_quote(value: str, what: str = "value") -> str:
    """Quote `value` for sbatch's own `#SBATCH` parser: bare when safe, else double quotes with `\\` escapes."""
    check_value(what, value)
    if value and _SBATCH_BARE.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


_HET_SEPARATORS = ("hetjob", "packjob")
"""Words sbatch finds anywhere in an `#SBATCH` line, in any case, as the separator of a heterogeneous job's
components: a job named `hetjob-ablation` would be split in two."""


def _no_het_separator(what: str, value: str) -> str:
    word = next((w for w in _HET_SEPARATORS if w in value.lower()), None)
    if word is not None:
        raise ConfigError(f"{what}: {value!r} contains {word!r}, which sbatch reads on an #SBATCH line as the "
                          "separator of a heterogeneous job's components (the job would be split); rename it")  # fmt: skip
    return value


def sbatch_line(option: str, value: str | int | None = None, what: str | None = None) -> str:
    """One `#SBATCH --option=value` line with the value quoted for sbatch."""
    if value is None:
        return f"#SBATCH {_no_het_separator(what or option, option)}"
    return f"#SBATCH {option}={sbatch_quote(_no_het_separator(what or option, str(value)), what or option)}"


def _unquoted(value: str) -> str:
    """An `extra_sbatch` value as sbatch reads it from an `#SBATCH` line: one pair of enclosing quotes is no part of
    it (`--constraint="a100&ib"` asks for a100&ib; quoted again they were a feature name of their own)."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def parse_extra_option(entry: str) -> tuple[str, str | None]:
    """Split one `slurm.extra_sbatch` entry (`--constraint=a100`, `-C a100`, `--exclusive`) into option and value."""
    check_value("slurm.extra_sbatch", entry)
    entry = entry.strip()
    if "=" in entry and entry.startswith("--"):
        option, value = entry.split("=", 1)
    elif " " in entry:
        option, value = entry.split(" ", 1)
        value = value.strip()
    else:
        option, value = entry, None
    if not _OPTION.fullmatch(option):
        raise ConfigError(
            f"slurm.extra_sbatch: {entry!r} is not an sbatch option (expected e.g. '--constraint=a100' or '--exclusive')"
        )
    return option, None if value is None else _unquoted(value)


def filename_pattern(path: str) -> str:
    """A literal path for sbatch/srun `--output`, whose `%` patterns would otherwise expand (`%%` is a `%`)."""
    return path.replace("%", "%%")


def python_command(profile: ClusterProfile) -> list[str]:
    """The interpreter command on the compute nodes (`slurm.python`, split like a shell would, never evaluated)."""
    assert profile.slurm is not None
    text = check_value("slurm.python", profile.slurm.python)
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"slurm.python: {text!r}: {e}") from None
    if not words:
        raise ConfigError(
            "slurm.python is empty; give an interpreter such as python3 or /opt/venv/bin/python"
        )
    return words


def check_setup(lines: list[str]) -> None:
    """The setup commands must parse as shell on their own (an open quote would swallow the rest of the script)."""
    for line in lines:
        if "\x00" in line:
            raise ConfigError("slurm.setup: a command contains a NUL character")
    bash = shutil.which("bash")
    if not lines or bash is None:
        return
    text = "\n".join(lines) + "\n"
    result = subprocess.run([bash, "-n"], input=text, capture_output=True, text=True, check=False)
    if result.returncode != 0 or "here-document" in result.stderr:
        message = (result.stderr.strip().splitlines() or ["syntax error"])[-1]
        raise ConfigError(f"slurm.setup does not parse as shell commands: {message}")


def helper_text() -> str:
    text = HELPER.read_text()
    if any(line.strip() == HELPER_EOF for line in text.splitlines()):
        raise RuntimeError(f"{HELPER} must not contain a line {HELPER_EOF!r}")
    return text.rstrip("\n")


def helper_digest() -> str:
    return hashlib.sha256(helper_text().encode()).hexdigest()[:12]


def node_options(nodes: int | str) -> list[tuple[str, str]]:
    """The sbatch options that give a job `nodes` nodes: a count, or `MIN-MAX` for an elastic launch. Both the
    script's `#SBATCH` lines and SlurmBackend's sbatch command line come from here, so they cannot differ.

    One task per node: the batch script's `srun` starts one helper agent on each node (it says `--ntasks=K
    --ntasks-per-node=1` itself), and that agent starts the node's trainers. A range needs more tasks: Slurm
    allocates at most as many nodes as the job has tasks, and `--ntasks-per-node=1` without `--ntasks` makes that
    MIN, so the job would always get MIN nodes. MAX tasks fit on any node count of the range, so Slurm gives as
    many nodes as it can. A range has no `--ntasks-per-node`: with more than one task, slurmctld makes
    `cpus_per_task × ntasks_per_node` every node's minimum CPU count (job_mgr.c), so `--ntasks-per-node=MAX` left
    out every node with fewer than MAX CPUs, and a range whose top exceeds a node's CPU count never started.
    Without it Slurm packs the MAX tasks (one CPU each) onto the nodes it gives however they fit. (The training
    steps set their own task counts.)"""
    text = str(nodes)
    _, sep, high = text.partition("-")
    if sep and high.isdigit():
        return [("--nodes", text), ("--ntasks", high)]
    return [("--nodes", text), ("--ntasks-per-node", "1")]


def sbatch_lines(
    profile: ClusterProfile, job_name: str, run_dir: Path, *, nodes: int | str | None = None
) -> list[str]:
    """The `#SBATCH` lines of the run's batch script, for `nodes` nodes (a count or `MIN-MAX`; default: the
    profile's `nodes`)."""
    spec = profile.slurm
    assert spec is not None
    output = filename_pattern(str(run_dir / "attempts")) + "/slurm-%j.out"
    lines = [sbatch_line("--job-name", job_name, "job name")]
    if spec.partition:
        lines.append(sbatch_line("--partition", spec.partition, "slurm.partition"))
    if spec.account:
        lines.append(sbatch_line("--account", spec.account, "slurm.account"))
    if spec.qos:
        lines.append(sbatch_line("--qos", spec.qos, "slurm.qos"))
    if spec.time_limit:
        lines.append(sbatch_line("--time", spec.time_limit, "slurm.time_limit"))
    lines += [sbatch_line(option, value) for option, value in node_options(nodes or profile.nodes)]
    if spec.gpus_per_node_flag:
        lines.append(sbatch_line("--gpus-per-node", profile.gpus_per_node))
    lines.append(sbatch_line("--requeue"))
    lines.append(sbatch_line("--open-mode", "append"))
    lines.append(sbatch_line("--output", output, "run directory"))
    if spec.signal_before_timeout_s > 0:
        lines.append(sbatch_line("--signal", f"B:USR1@{spec.signal_before_timeout_s}"))
    for entry in spec.extra_sbatch:
        option, value = parse_extra_option(entry)
        if value is None:
            lines.append(sbatch_line(option))
        elif option.startswith("--"):
            lines.append(sbatch_line(option, value, "slurm.extra_sbatch"))
        else:
            _no_het_separator("slurm.extra_sbatch", value)
            lines.append(f"#SBATCH {option} {sbatch_quote(value, 'slurm.extra_sbatch')}")
    return lines


def config_lines(profile: ClusterProfile, run_dir: Path, job_name: str) -> list[str]:
    """Shell assignments of the run's settings; each value is `shlex.quote`d."""
    spec = profile.slurm
    assert spec is not None
    python = " ".join(shlex.quote(word) for word in python_command(profile))
    return [
        f"CONA_RUN_DIR={shlex.quote(check_value('run directory', str(run_dir)))}",
        f"CONA_JOB_NAME={shlex.quote(check_value('job name', job_name))}",
        f"CONA_PYTHON=({python})",
        f"CONA_PORT_BASE={int(spec.rendezvous_port_base)}",
        f"CONA_GPUS_PER_NODE={int(profile.gpus_per_node)}",
    ]


def job_name_for(job: Job | None, run_dir: Path) -> str:
    name = job.name if job is not None else run_dir.name
    return check_value("job name", name or "cona")


def env_block(env: dict[str, str]) -> str:
    """The profile's `env` as `export` lines (after the setup commands, so a module they load does not undo it;
    srun hands the batch shell's environment to every task), or nothing."""
    if not env:
        return ""
    lines = [f"export {name}={shlex.quote(check_value(f'env.{name}', value))}" for name, value in env.items()]
    return "# --- environment of the trainers, from the profile's env: ---\n" + "\n".join(lines) + "\n"


def render_batch_script(
    profile: ClusterProfile,
    job: Job | None,
    run_dir: str | Path,
    *,
    nodes: int | str | None = None,
    job_name: str | None = None,
) -> str:
    """The batch script of a run: `#SBATCH` lines from `profile.slurm`, setup commands, the attempt loop.

    `nodes` is what its `#SBATCH --nodes` asks for, a count or `MIN-MAX` (default: the profile's node count).
    SlurmBackend renders each submission's own (`SlurmBackend.node_request`) and passes the same options on the
    sbatch command line as well. Raises ConfigError for values that cannot be rendered safely.
    """
    if profile.slurm is None:
        raise ConfigError(f"profile {profile.name!r} has no slurm: section (backend is {profile.backend!r})")
    run_path = Path(check_value("run directory", str(run_dir))).absolute()
    name = check_value("job name", job_name) if job_name is not None else job_name_for(job, run_path)
    check_setup(profile.slurm.setup)
    setup = (
        "\n".join(profile.slurm.setup) if profile.slurm.setup else ": # (no setup commands in the profile)"
    )
    values = {
        "SBATCH": "\n".join(sbatch_lines(profile, name, run_path, nodes=nodes)),
        "CONFIG": "\n".join(config_lines(profile, run_path, name)),
        "SETUP": setup,
        "ENV": env_block(profile.env),
        "HELPER": helper_text(),
        "HELPER_SHA": helper_digest(),
    }
    template = SCRIPT_TEMPLATE.read_text()
    # One pass: inserted values are never scanned for placeholders again.
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)
