"""The profile's `slurm:` section: how to submit to Slurm. Owned by the backend; `cona.orchestrator.profile` only embeds it.

Imports nothing of the backend itself, so loading a profile does not load the backend.
"""

from __future__ import annotations

import re

import pydantic
from cona.protocol.yamlconfig import StrictModel
from pydantic import Field

_SLURM_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|unlimited|infinite", re.IGNORECASE)
"""The forms `sbatch --time` accepts (man sbatch)."""

SIGNAL_MAX_S = 65535
"""The largest `--signal=...@N` sbatch accepts (man sbatch: 0 to 65535)."""

_NODES = "the node count comes from the profile and each submission's strategy; set nodes / min_nodes in the profile"
_TASKS = "cona runs one task per node, which starts gpus_per_node trainers; set nodes / gpus_per_node in the profile"
_GPUS = "each node runs gpus_per_node trainer processes; set gpus_per_node in the profile"
_EXPORT = ("the trainers need the batch shell's environment (the profile's env, PATH, the venv); give --export=ALL,... "
           "or remove the entry")  # fmt: skip
_GPUS_TYPED = (f"{_GPUS} (for a GPU type, as in --gres=gpu:a100:8, set slurm.gpus_per_node_flag: false and give "
               "that count)")  # fmt: skip
_LOG = "the job's log stays in the run directory (attempts/slurm-%j.out); remove the entry"
_ARRAY = ("a run is one job, which requeues itself, and an array would start several copies of the run writing one "
          "run directory; remove the entry")  # fmt: skip
_OWN_OPTIONS: dict[str, str] = {
    # Options the batch script renders itself (`script.sbatch_lines`, `script.node_options`): sbatch takes the
    # last of two, so a second one in extra_sbatch would silently win over cona's.
    "nodes": _NODES,
    "ntasks": _TASKS,
    "ntasks-per-node": _TASKS,
    "time": "set slurm.time_limit instead",
    "signal": "set slurm.signal_before_timeout_s instead",
    "job-name": "the job is named after the job file's name; set name there",
    "output": _LOG,
    "error": _LOG,
    "open-mode": _LOG,
    "requeue": "cona requests it already; remove the entry",
    "no-requeue": "the job requeues itself after the pre-timeout signal; remove the entry",
    "gpus-per-node": _GPUS,
    "tasks-per-node": _TASKS,  # sbatch's other name for --ntasks-per-node
    # Not rendered, but they change how many GPUs or tasks a node gets, which torchrun's process count assumes.
    "gpus": _GPUS,
    "gpus-per-task": _GPUS,
    "gpus-per-socket": _GPUS,
    "ntasks-per-socket": _TASKS,
    "ntasks-per-core": _TASKS,
    "ntasks-per-gpu": _TASKS,
    "ntasks-per-tres": _TASKS,
    # Not rendered either, but it breaks the job model: the run directory has one writer, the run's one job.
    "array": _ARRAY,
    # They change what a submission is: sbatch would block until the job ends (and cona's submission timed out
    # while the job was queued), submit nothing, or run another script than the run's.
    "wait": "cona submits the job and follows it itself; sbatch --wait would block the submission; remove the entry",
    "test-only": "no job would be submitted; use `cona render slurm` to see the script instead; remove the entry",
    "wrap": "the job runs the run's batch script; remove the entry",
}
# Left alone on purpose: `--nodelist`/`-w` (and `--nodefile`) and `--exclude`/`-x` say where the job runs, not
# how many nodes or GPUs it gets, and cona sets no placement option they could override. With cona's `--nodes`
# always given, slurmctld keeps that count: it adds nodes to a shorter nodelist and picks among a longer one (which
# it turns into "exclude all others"), so a list fits every node count a switch submits. What it costs, that the
# listed nodes of a shorter list must all be up before the job starts again, is the user's to choose.
_GPU_REQUESTS = ("gres", "tres-per-task")
"""Refused only when they request GPUs (`gpu`, `gpu:4`, `gpu:a100:4`, `gres/gpu=1`); other generic resources, and
`--tres-per-task=cpu=4` (what `-c 4` sets), stay allowed. sbatch has no `--tres-per-node`: `--gres` is its form."""
_PROFILE_FIELDS = ("partition", "account", "qos")
"""Rendered from the field of that name when it is set: refused in extra_sbatch only then."""
SHORT_OPTIONS = {"A": "account", "a": "array", "B": "extra-node-info", "b": "begin", "C": "constraint",
                 "c": "cpus-per-task", "D": "chdir", "d": "dependency", "e": "error", "F": "nodefile", "G": "gpus",
                 "H": "hold", "h": "help", "I": "immediate", "i": "input", "J": "job-name", "k": "no-kill",
                 "L": "licenses", "M": "clusters", "m": "distribution", "N": "nodes", "n": "ntasks", "O": "overcommit",
                 "o": "output", "p": "partition", "Q": "quiet", "q": "qos", "S": "core-spec", "s": "oversubscribe",
                 "t": "time", "V": "version", "v": "verbose", "W": "wait", "w": "nodelist", "x": "exclude"}  # fmt: skip
"""sbatch's short options by their long names (man sbatch): an entry is judged, and handed to submitit (which
takes long names only), by what sbatch would read."""
_SHORT_FLAGS = frozenset("hHIkOQsvVW")
"""sbatch's short options without an argument: in a cluster such as `-HN8` the letters after them are options
too, while the rest after one that takes an argument is its value."""


def _sbatch_options(entry: str) -> list[tuple[str, str | None]]:
    """The (long name, value) of the sbatch options in one `extra_sbatch` entry; short ones by their long name.

    Only for refusing options here; an entry that is no option at all is left to `script.parse_extra_option`."""
    text = entry.strip()
    if text.startswith("--"):
        long = re.fullmatch(r"--([^=\s]*)(?:[=\s]\s*(.*))?", text, re.DOTALL)
        assert long is not None  # every text that starts with -- matches
        return [(long.group(1), long.group(2) or None)]
    if not text.startswith("-"):
        return []
    word, _, rest = text[1:].partition(" ")
    options: list[tuple[str, str | None]] = []
    for i, letter in enumerate(word):
        attached = word[i + 1 :]
        options.append((SHORT_OPTIONS.get(letter, letter), (attached or rest.strip()) or None))
        if letter not in _SHORT_FLAGS:
            break  # it takes an argument: the rest of the word (or the next one) is its value
    return options


def _requests_gpus(value: str | None) -> bool:
    """Whether a `--gres` or `--tres-per-task` value asks for GPUs: an item named `gpu`, bare or as `gres/gpu`
    (`gres:gpu`), followed by `:type`, `:count` or `=count`."""
    names = (re.split(r"[:=]", item.strip().removeprefix("gres/").removeprefix("gres:"))[0]
             for item in (value or "").split(","))  # fmt: skip
    return "gpu" in names


def _gpu_count(value: str) -> int | None:
    """The GPUs a `--gres` or `--tres-per-task` value asks for (`gpu` is 1, `gpu:8`, `gpu:a100` is 1, `gpu:a100:8`,
    `gres/gpu=2`, `gres/gpu:a100=2`; several GPU items add up), or None when a count cannot be read (a suffix, a
    form sbatch reads otherwise): then it is left to sbatch."""
    total = 0
    for item in value.split(","):
        name, *rest = re.split(r"[:=]", item.strip().removeprefix("gres/").removeprefix("gres:"))
        if name != "gpu":
            continue
        if not rest or (len(rest) == 1 and not rest[0].isdigit()):  # no count, or a type alone: one GPU
            total += 1
        elif rest[-1].isascii() and rest[-1].isdigit():
            total += int(rest[-1])
        else:
            return None
    return total


def gpu_request_problem(spec: SlurmSpec, gpus_per_node: int) -> str | None:
    """What is wrong (one line) when an `extra_sbatch` entry asks for the GPUs itself — allowed only with
    `gpus_per_node_flag: false`, for a type (`--gres=gpu:a100:8`) — and its count is not the profile's
    `gpus_per_node`; None otherwise. Each node starts gpus_per_node trainer processes, one per GPU: asked for fewer,
    the job would start processes on GPUs it does not hold, or never start; asked for more, it would hold GPUs it
    never uses. `--tres-per-task` counts per node too: cona runs one task per node."""
    if spec.gpus_per_node_flag:
        return None  # cona asks with --gpus-per-node, and a GPU request of extra_sbatch is refused (`_refusal`)
    for entry in spec.extra_sbatch:
        for name, value in _sbatch_options(entry):
            if not (any(name == option or (len(name) >= 2 and option.startswith(name)) for option in _GPU_REQUESTS)
                    and _requests_gpus(value)):  # fmt: skip
                continue
            count = _gpu_count(value or "")
            if count is not None and count != gpus_per_node:
                return (f"slurm.extra_sbatch {entry.strip()!r} asks for {count} GPU{'s' if count != 1 else ''} per node, "
                        f"but gpus_per_node is {gpus_per_node}, the trainer processes each node starts (one per "
                        "GPU); make the two agree")  # fmt: skip
    return None


def _refusal(
    name: str, value: str | None, set_fields: dict[str, str | None], *, gpus: bool = True
) -> tuple[str, str] | None:
    """(the option cona owns, what to do instead) when sbatch would read `--name` as an option cona sets itself;
    `gpus`: whether cona asks for the GPUs (`--gpus-per-node`), so that a GPU request of `--gres` is its own too."""
    owned = dict(_OWN_OPTIONS)
    owned.update({field: f"slurm.{field} is set ({set_fields[field]!r}); set it there only" for field in _PROFILE_FIELDS
                  if set_fields.get(field)})  # fmt: skip
    if gpus and _requests_gpus(value):
        owned.update(dict.fromkeys(_GPU_REQUESTS, _GPUS_TYPED))
    if value is not None and "ALL" not in value.upper().split(","):
        # An --export of NONE (or a list without ALL): srun hands the tasks only that, so the trainers lose env, PATH
        # and the venv. Its prefixes (`--exp=NONE`) are the rule below's.
        owned["export"] = _EXPORT
    if name in owned:
        return name, owned[name]
    # sbatch reads options with getopt_long, which takes any unambiguous prefix (`--gpus-per-n=4` is
    # `--gpus-per-node=4`). No sbatch option left alone here is a prefix of an owned one, so a prefix of an owned
    # option means that option (or is ambiguous, which sbatch refuses anyway).
    full = [option for option in owned if len(name) >= 2 and option.startswith(name)]
    return (full[0], owned[full[0]]) if full else None


def slurm_time_seconds(text: str) -> int | None:
    """Seconds of a Slurm time limit in one of the `_SLURM_TIME` forms; None for no limit (empty, `0`,
    `UNLIMITED`, `INFINITE`: the partition's limit, or none).

    man sbatch: `MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS`."""
    text = text.strip()
    if not text or text.lower() in ("unlimited", "infinite"):
        return None
    days, dash, clock = text.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if dash:  # D-HH, D-HH:MM, D-HH:MM:SS
        parts += [0] * (3 - len(parts))
    elif len(parts) < 3:  # MM, MM:SS (only three fields are HH:MM:SS)
        parts = [0, *parts] + [0] * (2 - len(parts))
    hours, minutes, seconds = parts
    total = ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds
    return total or None  # `--time=0` asks for no time limit at all


class SlurmSpec(StrictModel):
    """How to submit to Slurm. Every value is shell-quoted into the batch script."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_limit: str = "04:00:00"
    """`--time` of the training job, in one of Slurm's forms: `MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`,
    `D-HH:MM:SS`, or `UNLIMITED`. A whole number is minutes (`MM`), quoted or not, in a file as on the command
    line; a form with colons goes in quotes in a file (unquoted, YAML 1.1 reads it as one number in base 60)."""
    gpus_per_node_flag: bool = True
    """Request `--gpus-per-node`; false on CPU-only clusters (the default there when `accelerator.device` is `cpu`:
    `cona.orchestrator.profile` sets it unless the profile says), or where `extra_sbatch` asks for the GPUs itself
    (`--gres=gpu:a100:8`, a type; its count must be `gpus_per_node`). Declared before `extra_sbatch`, which is
    judged with it."""
    extra_sbatch: list[str] = Field(default_factory=list)
    """Extra `#SBATCH` options, e.g. `--constraint=a100`."""
    setup: list[str] = Field(default_factory=list)
    """Shell commands run before training (module loads, `source venv/bin/activate`)."""
    use_submitit: bool = False
    """Submit through submitit instead of sbatch: submitit's own batch script (same resources) starts `python -m
    submitit.core._submit` (so submitit must be installed for `python`), which runs the rendered script with bash."""
    signal_before_timeout_s: int = 120
    """Send SIGUSR1 this many seconds before the time limit so the trainer checkpoints (0: no signal); below
    `time_limit` and at most 65535 (sbatch's limit)."""
    pending_timeout_s: float = Field(default=120.0, gt=0)
    """How long a job may stay pending for a reason that waiting does not resolve (an invalid account or QOS, a
    per-job limit of the QOS, `BadConstraints`: `STUCK_PENDING_REASONS` in `backend.py`) before the run fails with
    the reason and what to fix; the job is cancelled. Counted from the first poll that finds such a reason
    (`Scheduler._note_pending`), not from the start of the queue wait before it. A job that waits for nodes (Resources, Priority, a DOWN node coming back) waits
    without limit, and is not reported past this time (hours in a queue are the norm)."""
    rendezvous_port_base: int = Field(29500, gt=1023, lt=65000)
    """Rendezvous ports are this plus an offset per job, so concurrent jobs don't collide."""
    python: str = "python3"
    """Python interpreter on the compute nodes."""

    @pydantic.field_validator("partition", "account", "qos")
    @classmethod
    def _name(cls, value: str | None, info: pydantic.ValidationInfo) -> str | None:
        # sbatch would be handed `--qos=" "` or `--partition="gpu batch"`: Slurm names hold no blanks (a partition
        # may be a comma-separated list of them).
        if value is None:
            return None
        name = value.strip()
        if not name:
            raise ValueError(f"empty; give the {info.field_name}'s name, or leave slurm.{info.field_name} out")
        if any(ch.isspace() for ch in name) or name.startswith("-"):
            many = " (several partitions are separated by commas: gpu,batch)" if info.field_name == "partition" else ""
            raise ValueError(f"{value!r} is not a Slurm {info.field_name} name: it holds a blank or starts with '-'{many}")
        return name

    @pydantic.field_validator("time_limit", mode="before")
    @classmethod
    def _time_limit(cls, value: object) -> object:
        # A whole number is minutes, sbatch's `MM` (`--time=90`), written with quotes or without: YAML reads an
        # unquoted `time_limit: 90` as an integer, which a file refused ("write the value in quotes") while
        # `--profile-set slurm.time_limit=90` rendered --time=90. (`1:30:00` unquoted is base 60 to YAML 1.1,
        # refused as the file is read: `yamlconfig._Sexagesimal`.) Any other number is judged as its text, alike.
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            return value  # pydantic says it is no text
        if value.strip() and not _SLURM_TIME.fullmatch(value.strip()):  # empty: no --time line (the partition's)
            raise ValueError("not a Slurm time: use MM (minutes), MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or "
                             "UNLIMITED")  # fmt: skip
        return value.strip()

    @pydantic.field_validator("extra_sbatch")
    @classmethod
    def _extra_sbatch(cls, value: list[str], info: pydantic.ValidationInfo) -> list[str]:
        # partition, account and qos are declared (and so validated) before extra_sbatch: info.data has them.
        set_fields = {field: info.data.get(field) for field in _PROFILE_FIELDS}
        # cona asks for the GPUs itself (--gpus-per-node) unless told not to: a second request would change how many
        # a node gets. Told not to, a typed request (--gres=gpu:a100:8) is the user's way to ask for them.
        gpus = bool(info.data.get("gpus_per_node_flag", True))
        for entry in value:
            for name, option_value in _sbatch_options(entry):
                refused = _refusal(name, option_value, set_fields, gpus=gpus)
                if refused is not None:
                    option, advice = refused
                    raise ValueError(f"{entry.strip()!r} sets --{option}, which cona decides itself: {advice}")
        return value

    @pydantic.field_validator("signal_before_timeout_s")
    @classmethod
    def _signal_range(cls, value: int) -> int:
        if not 0 <= value <= SIGNAL_MAX_S:
            raise ValueError(f"must be 0 (no signal) to {SIGNAL_MAX_S} seconds, the range of sbatch --signal")
        return value

    @pydantic.model_validator(mode="after")
    def _signal_before_time_limit(self) -> SlurmSpec:
        # A lead at or above the limit fires the signal as the job starts: it checkpoints, requeues itself and
        # starts again, forever.
        limit = slurm_time_seconds(self.time_limit)
        if self.signal_before_timeout_s > 0 and limit is not None and self.signal_before_timeout_s >= limit:
            raise ValueError(
                f"slurm.signal_before_timeout_s={self.signal_before_timeout_s} is not below slurm.time_limit "
                f"{self.time_limit!r} ({limit} s), so the pre-timeout signal would come as the job starts; "
                "lower signal_before_timeout_s or raise time_limit"
            )
        # submitit always asks for a pre-timeout signal, USR2@90 unless told another one; cona tells it SIGUSR1@N,
        # which the trainer takes as "checkpoint and exit for the requeue". With no signal asked for, submitit's
        # USR2 would reach the trainers, whose default action for it is to die: no checkpoint, 90 s of work lost.
        if self.use_submitit and self.signal_before_timeout_s == 0:
            raise ValueError(
                "slurm.use_submitit with slurm.signal_before_timeout_s=0: submitit always has Slurm send a pre-timeout "
                "signal (SIGUSR2 90 s before the limit), which would end the trainers without a checkpoint; set "
                "signal_before_timeout_s above 0 (cona then asks for SIGUSR1, which checkpoints and requeues) or "
                "submit with sbatch (use_submitit: false)"
            )
        return self
