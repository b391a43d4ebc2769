"""The Slurm backend: one batch job per allocation; attempts run as `srun` steps inside it.

`launch` writes the attempt's hand-off record and either gives it to the job that is already running (same node
count: the job's loop is waiting after a switch) or submits a new job (`sbatch`, or submitit when
`slurm.use_submitit`). `poll` reads the attempt's `slurm-exit.json` (written by the batch script) and the job's
state (`scontrol show job`, `sacct` when the cluster keeps accounting). The protocol between this module and the batch
script is described at the top of `orchestrator/backends/slurm/templates/cona.sbatch.tmpl`; in short, per attempt N:

    attempts/N/launch.json      orchestrator → job: {"attempt", "submission", "strategy", "nnodes",
                                "nproc_per_node"}
    attempts/N/slurm.json       job → orchestrator: where and when attempt N started (job id, restarts, nodes)
    attempts/N/nodes/I.json     node I's trainer exit code
    attempts/N/slurm-exit.json  job → orchestrator: the attempt's exit code and what the job does next

A *submission* is a random token given to each sbatch as the script's first argument; launch records name the
submission that must run them, so nothing depends on job ids (which restart at 1 when a cluster's state is wiped).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import shlex
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from cona.orchestrator.backends.base import Attempt, AttemptStatus, Backend, BackendError, Outcome
from cona.orchestrator.backends.slurm.script import (
    node_options,
    parse_extra_option,
    python_command,
    render_batch_script,
)
from cona.orchestrator.backends.slurm.spec import SHORT_OPTIONS, slurm_time_seconds
from cona.orchestrator.elastic import is_elastic, node_range, startable_nodes
from cona.orchestrator.job import Job
from cona.orchestrator.profile import ClusterProfile
from cona.orchestrator.switchcost import SwitchKind, checkpoint_bytes, checkpoint_save_s
from cona.protocol.feasibility import placement
from cona.protocol.rundir import ExitCode, RunDir, read_json
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

# Job states (squeue/scontrol/sacct long names).
PENDING_STATES = frozenset(
    {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SPECIAL_EXIT",
     "SUSPENDED", "STOPPED"}
)  # fmt: skip
RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "SIGNALING", "RESIZING", "STAGE_OUT"})
DEFAULT_HANDOFF_TIMEOUT_S = 300
COMMAND_TIMEOUT_S = 30
DEFAULT_RELEASE_TIMEOUT_S = 1200
"""How long `launch` waits for a cancelled job to end (KillWait, epilog; a hung node is DOWN only after
SlurmdTimeout, 300 s by default) before it gives up with an error."""
DEFAULT_END_GRACE_S = 30.0
"""How long after its exit record a job that ends by itself (`ends_by_itself`) is left to leave the queue before
it is scancelled: the batch script still exits after writing the record (under submitit, its Python process then
pickles the result), and a scancel in that window makes Slurm record a finished job as CANCELLED."""
ENDING_ACTIONS = frozenset({"done", "stop", "exit"})
"""The actions of slurm-exit.json after which the batch loop exits (the batch script's `done | stop` and `exit N`);
after `wait` it idles for a hand-off, after `requeue`/`requeued` it runs again."""
_JOB_VARIABLE_PREFIXES = ("SLURM_", "SLURMD_", "SRUN_")
_CLIENT_VARIABLES = frozenset({"SLURM_CONF", "SLURM_CLUSTERS", "SLURM_TIME_FORMAT"})
"""Client settings a user may export; kept when the job's own SLURM_* variables are dropped."""


class SlurmError(BackendError):
    """A Slurm command failed; the message is one line with the command's own error."""


@dataclasses.dataclass
class SlurmJobInfo:
    """What Slurm says about one job."""

    job_id: str
    state: str
    """Long state name, e.g. RUNNING, PENDING, COMPLETED, NODE_FAIL."""
    reason: str = ""
    restarts: int = 0
    """How often the job was requeued (scontrol `Restarts=`)."""
    nodes: list[str] = dataclasses.field(default_factory=list)
    num_nodes: int = 0
    exit_code: str = ""
    """`status:signal` of the batch script, e.g. `0:0`, `3:0`, `0:15`."""
    batch_host: str = ""
    num_cpus: int = 0
    """CPUs the job holds on all its nodes together (scontrol `NumCPUs=`; 0: not said)."""

    @property
    def alive(self) -> bool:
        return self.state in PENDING_STATES or self.state in RUNNING_STATES

    @property
    def pending(self) -> bool:
        return self.state in PENDING_STATES

    @property
    def exit_status(self) -> int | None:
        status, _, _ = self.exit_code.partition(":")
        return int(status) if status.isdigit() else None


_ACCOUNT_ADVICE = "fix slurm.account (sacctmgr show assoc user=$USER lists yours)"
_QOS_ADVICE = "fix slurm.qos (sacctmgr show assoc user=$USER format=qos lists yours)"
_PARTITION_ADVICE = ("the partition cannot run it (scontrol show partition): change slurm.partition, nodes or "
                     "slurm.time_limit")  # fmt: skip
STUCK_PENDING_REASONS: dict[str, str] = {
    "InvalidAccount": _ACCOUNT_ADVICE,
    "AccountNotAllowed": _ACCOUNT_ADVICE + " or slurm.partition (the partition does not allow the account)",
    "InvalidQOS": _QOS_ADVICE,
    "QOSNotAllowed": _QOS_ADVICE + " or slurm.partition (the partition does not allow the QOS)",
    "BadConstraints": "no node of the partition has the features asked for: fix --constraint in slurm.extra_sbatch",
    "PartitionNodeLimit": _PARTITION_ADVICE,
    "PartitionTimeLimit": _PARTITION_ADVICE,
    "PartitionConfig": _PARTITION_ADVICE,
    "MaxMemPerLimit": "the memory asked for is above the partition's limit: lower --mem in slurm.extra_sbatch",
    "DependencyNeverSatisfied": "the --dependency in slurm.extra_sbatch can no longer be met: remove it",
    "ReservationInvalid": "the --reservation in slurm.extra_sbatch is not usable: fix or remove it",
    "ReservationDeleted": "the --reservation in slurm.extra_sbatch was deleted: remove it",
    "JobHoldMaxRequeue": "Slurm held the job after too many requeues (MaxBatchRequeue): look at its log in attempts/",
}
"""Slurm's pending reasons that waiting does not resolve (Slurm's job_reason_codes), with what to fix. Per-job
limits of a QOS or association (`QOSMax...PerJob...`, `AssocMax...PerNode`, `QOSMin...`) are added by
`stuck_pending_advice`. Not here: reasons that end as other jobs end or nodes come back (Resources, Priority,
ReqNodeNotAvail, the aggregate `...Grp...`, `...PerUser`, `...PerAccount` limits), and holds, which a person
releases (JobHeldUser, JobHeldAdmin)."""
_PER_JOB_LIMIT = re.compile(r"(QOS|Assoc)(Max\w*Per(Job|Node)\w*|Min\w+)")
"""A QOS's or association's limit on one job (`QOSMaxWallDurationPerJobLimit`, `AssocMaxGRESPerNode`,
`QOSMinGRES`): the job itself asks for more (or less) than it allows."""


def stuck_pending_advice(reason: str) -> str | None:
    """What to fix when a job pends for `reason` that waiting does not resolve (`STUCK_PENDING_REASONS`, a per-job
    limit); None when waiting may bring it (a queue, a node coming back, other jobs ending)."""
    advice = STUCK_PENDING_REASONS.get(reason)
    if advice is not None:
        return advice
    limit = _PER_JOB_LIMIT.fullmatch(reason)
    if limit is None:
        return None
    owner = "its QOS (sacctmgr show qos)" if limit.group(1) == "QOS" else "the account (sacctmgr show assoc)"
    return (f"the job asks for more than {owner} allows one job: lower slurm.time_limit or nodes, or pick another "
            "slurm.qos or slurm.account")  # fmt: skip


def cpu_shortage(info: SlurmJobInfo, processes: int, task_plugin: str) -> str | None:
    """A warning when the running job holds fewer CPUs than it runs trainer processes on a cluster that confines
    tasks to their CPUs (`TaskPlugin` task/cgroup or task/affinity), else None. cona asks for one task per node and
    no CPUs: unless the cluster sets DefCpuPerGPU, Slurm then gives each node one CPU, which all of the node's
    trainers (and their data loading) share."""
    if not info.num_cpus or info.num_cpus >= processes or not re.search(r"cgroup|affinity", task_plugin):
        return None
    return (f"job {info.job_id} holds {info.num_cpus} CPU(s) for its {processes} trainer processes ({task_plugin} "
            "confines them to those): add --exclusive (whole nodes) or --cpus-per-gpu=N to slurm.extra_sbatch")  # fmt: skip


REQUIRED_CLIENTS = ("sbatch", "scontrol", "scancel")
"""The Slurm commands a run cannot do without: submit, watch and cancel its jobs (`sacct` and `sinfo` are asked
when they answer)."""


def _client_missing(name: str) -> str:
    return f"{name} not found: is this a Slurm login node (are the Slurm clients on PATH)?"


def check_clients() -> None:
    """SlurmError, in one line, unless the Slurm clients a run needs (`REQUIRED_CLIENTS`) are on PATH: `cona run`
    asks before it creates a run directory (or resumes one), not at its first submission."""
    import shutil

    missing = [name for name in REQUIRED_CLIENTS if shutil.which(name) is None]
    if missing:
        raise SlurmError(f"{_client_missing(missing[0])}; no run directory was created or changed")


def check_partition(profile: ClusterProfile, runner: Any = None) -> None:
    """SlurmError, in one line, when the profile's partition cannot run its jobs at all (`partition_problem`): `cona
    run` asks before it creates a run directory. Slurm itself accepts such a job and leaves it PENDING for ever
    (`PartitionNodeLimit`), with nothing in the queue that says it waits for what will never come. Not checked when
    `sinfo` does not answer (a cluster that hides it): the job's pending reason is then what shows."""
    try:
        result = (runner or _run)(["sinfo", "-h", "-N", "-o", "%N|%P|%l"])
    except (OSError, subprocess.SubprocessError):
        return
    if result.returncode == 0:
        problem = partition_problem(profile, result.stdout)
        if problem is not None:
            raise SlurmError(f"{problem}; no run directory was created or changed")


def partition_problem(profile: ClusterProfile, sinfo_nodes: str) -> str | None:
    """Why the partition of `profile` (`slurm.partition`, else the cluster's default) cannot run its jobs, from
    `sinfo -h -N -o '%N|%P|%l'` (one line per node and partition, the default partition marked `*`, its time limit
    last), or None: no such partition, fewer nodes in it than the run needs (`nodes`; `min_nodes` for an elastic
    run, which starts on what there is), or a `slurm.time_limit` above the partition's (`PartitionTimeLimit`: pending
    for ever, or refused at submission where the cluster enforces it). Nodes that are down or drained count: they
    may come back."""
    members: dict[str, set[str]] = {}
    limits: dict[str, str] = {}
    default = None
    for line in sinfo_nodes.splitlines():
        node, _, rest = line.strip().partition("|")
        partition, _, limit = rest.partition("|")
        if not node or not partition:
            continue
        if partition.endswith("*"):
            partition = default = partition[:-1]
        members.setdefault(partition, set()).add(node)
        if limit.strip():
            limits[partition] = limit.strip()
    if not members:
        return None  # nothing listed (a cluster that hides its nodes): nothing to judge by
    wanted = profile.slurm.partition or default
    if wanted is None:
        return None
    # A comma-separated list: the job starts in whichever of them can run it first, so every name must exist and
    # one of them must fit the job.
    names = [name.strip() for name in wanted.split(",") if name.strip()]
    unknown = [name for name in names if name not in members]
    if unknown:
        return (f"slurm.partition {unknown[0]!r}: no such partition on this cluster (sinfo lists "
                f"{', '.join(sorted(members))}); fix slurm.partition in the profile")  # fmt: skip
    problems = [_fit_problem(profile, name, members[name], limits.get(name, "")) for name in names]
    if all(problems):
        return problems[0] if len(names) == 1 else f"no partition of {wanted!r} can run the job: {problems[0]}"
    return None


def _fit_problem(profile: ClusterProfile, partition: str, nodes: set[str], limit: str) -> str | None:
    """Why `partition` (its `nodes` and time `limit` as sinfo lists them) can never start the run's jobs, or None."""
    assert profile.slurm is not None
    which = f"slurm.partition {partition!r}" if profile.slurm.partition else f"the default partition {partition!r}"
    need, have = node_range(profile)[0], len(nodes)
    if need > have:
        field = "min_nodes" if is_elastic(profile) else "nodes"
        return (f"{which} has {have} node(s), the profile needs {need} ({field}={need}): Slurm would leave every "
                f"job pending for ever; lower {field} (--profile-set {field}={have}) or pick another partition")
    try:
        asked, allowed = slurm_time_seconds(profile.slurm.time_limit), slurm_time_seconds(limit)
    except ValueError:  # a limit this parser does not know (`n/a`): not judged
        return None
    if asked is not None and allowed is not None and asked > allowed:
        return (f"slurm.time_limit {profile.slurm.time_limit} is above the time limit of {which}, "
                f"{limit}: Slurm would leave every job pending for ever (PartitionTimeLimit); lower it "
                f"(--profile-set slurm.time_limit={limit}) or pick another partition")
    return None


# --- parsers (pure; unit-tested on recorded outputs) ---------------------------------------------------------


def expand_hostlist(text: str) -> list[str]:
    """`n[1-3,7],gpu01` → ['n1', 'n2', 'n3', 'n7', 'gpu01'] (Slurm hostlist syntax, zero padding kept)."""
    text = text.strip()
    if not text or text in ("(null)", "None"):
        return []
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", text):
        part = part.strip(",")
        if not part:
            continue
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            items: list[str] = []
            if ranges:
                for piece in ranges.split(","):
                    lo, sep, hi = piece.partition("-")
                    if sep and lo.isdigit() and hi.isdigit():
                        width = len(lo)
                        items += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
                    else:
                        items.append(piece)
            expanded = [e + literal + i for e in expanded for i in (items or [""])]
        hosts += [h for h in expanded if h]
    return hosts


def parse_scontrol_job(text: str) -> SlurmJobInfo | None:
    """Parse `scontrol show job -o ID` (one line of Key=Value); None when the job is unknown."""
    line = text.strip()
    if not line or "Invalid job id" in line or "JobId=" not in line:
        return None

    def field(key: str) -> str:
        m = re.search(rf"(?:^|\s){re.escape(key)}=(\S*)", line)
        return m.group(1) if m else ""

    nodes = field("NodeList")
    restarts = field("Restarts")
    num_nodes = field("NumNodes")
    return SlurmJobInfo(
        job_id=field("JobId"),
        state=field("JobState"),
        reason=field("Reason"),
        restarts=int(restarts) if restarts.isdigit() else 0,
        nodes=expand_hostlist(nodes),
        num_nodes=int(num_nodes.split("-")[0]) if num_nodes.split("-")[0].isdigit() else 0,
        exit_code=field("ExitCode"),
        batch_host=field("BatchHost"),
        num_cpus=int(field("NumCPUs")) if field("NumCPUs").isdigit() else 0,
    )


def parse_squeue(text: str) -> dict[str, SlurmJobInfo]:
    """Parse `squeue -h -o '%i|%T|%r|%D|%N'`."""
    jobs: dict[str, SlurmJobInfo] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 2 or not parts[0]:
            continue
        job_id, state = parts[0], parts[1]
        reason = parts[2] if len(parts) > 2 else ""
        count = parts[3] if len(parts) > 3 else ""
        nodes = expand_hostlist(parts[4]) if len(parts) > 4 else []
        jobs[job_id] = SlurmJobInfo(
            job_id, state, reason, nodes=nodes, num_nodes=int(count) if count.isdigit() else 0
        )
    return jobs


def parse_sacct(text: str) -> dict[str, SlurmJobInfo]:
    """Parse `sacct -n -X -P -o JobID,State,ExitCode,NodeList`; `CANCELLED by 0` → CANCELLED."""
    jobs: dict[str, SlurmJobInfo] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3 or not parts[0] or "." in parts[0]:
            continue
        state = parts[1].split()[0] if parts[1].split() else ""
        nodes = expand_hostlist(parts[3]) if len(parts) > 3 and parts[3] != "None assigned" else []
        jobs[parts[0]] = SlurmJobInfo(parts[0], state, exit_code=parts[2], nodes=nodes)
    return jobs


SINFO_NODE_ARGS = ("-h", "-N", "-O", "NodeList:|,StateLong:|,StateComplete:|")
"""`sinfo` arguments for each node's state, as `parse_sinfo_nodes` reads them: `NODE|LONG|COMPLETE|`.

Not `-o '%N|%T'` alone: `%T` (StateLong) names a drained node by its DRAIN flag whatever its base state, so a node
that went DOWN while draining or drained (an admin's `scontrol update state=down`, a node failure during a
maintenance drain) shows as `drained`/`draining`, the same as a healthy drained one, and an elastic run never saw
it lost. StateComplete (`down+drain`) keeps the base state. An sinfo that does not know StateComplete prints the
field empty (and exits 0): the long state alone is then used, as before."""


def parse_sinfo_nodes(text: str) -> dict[str, str]:
    """Parse `sinfo SINFO_NODE_ARGS` (`NODE|LONG|COMPLETE|`) or `sinfo -h -N -o '%N|%T'` → {node: state}.

    The state is the long one (`idle`, `down*`, `drained`, ...; a trailing `*` means not responding), except for a
    drained node whose complete state has a DOWN base: that one (`down+drain`), which `node_is_down` takes as lost
    while `drained` is not."""
    states: dict[str, str] = {}
    for line in text.splitlines():
        fields = [field.strip().lower() for field in line.strip().split("|")]
        if len(fields) < 2 or not fields[0]:
            continue
        name, state = fields[0], fields[1]
        complete = fields[2] if len(fields) > 2 else ""
        if complete.split("+")[0].startswith("down") and not node_is_down(state):
            state = complete  # `drained`/`draining` that is DOWN underneath
        states[name] = state
    return states


def ends_by_itself(record: dict[str, Any] | None, info: SlurmJobInfo, *, now: float, grace_s: float) -> bool:
    """Whether `info`'s job is ending on its own, by `record` (the newest slurm-exit.json of its submission):
    the batch loop wrote an action after which it exits, during the job's current run (no requeue since: same
    restart count, not pending), at most `grace_s` seconds ago (by the record's clock; later, something holds the
    job up and a scancel is due). Such a job is not to be scancelled while it ends: Slurm would record it
    CANCELLED instead of COMPLETED (or FAILED with the crash's code)."""
    if record is None or info.pending or record.get("requeued") or record.get("action") not in ENDING_ACTIONS:
        return False
    if str(record.get("job_id") or info.job_id) != info.job_id:
        return False
    if record.get("restarts", 0) != info.restarts:
        return False
    written = record.get("time")
    return isinstance(written, (int, float)) and now - float(written) < grace_s


def save_outlasts_signal(profile: ClusterProfile, job: Job) -> str | None:
    """Why a checkpoint started at the pre-timeout signal cannot finish before the time limit, or None.

    The trainer checkpoints when SIGUSR1 comes `slurm.signal_before_timeout_s` before `slurm.time_limit`; Slurm
    ends the job at the limit (SIGTERM, then SIGKILL after its KillWait). A save the profile's own storage bandwidth
    puts above that lead is killed half-written, and the requeued job resumes from the previous checkpoint: the
    work since then is lost at every time limit. Said, not refused: the bandwidth is the user's estimate."""
    lead = profile.slurm.signal_before_timeout_s if profile.slurm is not None else 0
    if lead <= 0:
        return None  # no pre-timeout checkpoint asked for: nothing is promised at the limit
    save_s = checkpoint_save_s(job, profile)
    if save_s <= lead:
        return None
    return (f"a checkpoint of {job.model.num_params / 1e9:.3g}B parameters ({checkpoint_bytes(job) / 1e9:.3g} GB) takes about "
            f"{save_s:,.0f} s at storage.write_bandwidth {profile.storage.write_bandwidth}, longer than "
            f"slurm.signal_before_timeout_s={lead}: a job that reaches slurm.time_limit is killed while it saves and "
            f"resumes from its previous checkpoint; raise signal_before_timeout_s to at least {2 * save_s:,.0f} "
            "(or correct storage.write_bandwidth)")  # fmt: skip


_said: set[str] = set()
"""The warnings this process printed (an orchestrator builds its backend again after a restart of the loop)."""


def node_is_down(state: str) -> bool:
    """DOWN, FAIL (and DOWN+DRAIN, DOWN*, ...): the node is lost to its jobs. DRAIN alone lets jobs finish."""
    base = state.rstrip("*~#!%$@^-").lower()
    return base.startswith("down") or base == "fail"


# --- the backend -----------------------------------------------------------------------------------------------


class SlurmBackend(Backend):
    """Runs trainer attempts as `srun` steps of Slurm batch jobs.

    `profile` is the cluster profile (its `slurm:` section); `job` names the Slurm job. `use_sacct` forces the
    accounting path on or off (None: detect once). `handoff_timeout_s` is how long a job waits after a switch
    for its next attempt. `release_timeout_s` is how long a resubmission waits for the previous job, cancelled,
    to end; `end_grace_s` how long a job that ends by itself is given to do so before it is cancelled. `runner`
    runs Slurm commands (tests inject one); it gets an argv list and returns a CompletedProcess.

    Never two attempts at once: a resubmission (other node count, or the previous job ended, crashed, was
    requeued by Slurm or lost a node) first cancels the previous job and waits until Slurm reports it ended —
    no process of it left (COMPLETING over) and no requeue that could bring it back. A requeued job that starts
    anyway finds a newer attempt's launch.json and ends without running anything (`slurm_helper.py next`). A job
    whose batch loop has recorded that it ends (done, stopped, crashed) is first given `end_grace_s` to leave
    the queue by itself, so that `sacct` keeps its own end (COMPLETED, FAILED), not CANCELLED.

    No attempt ends DISRUPTED here (yet): a node failure or a preemption with PreemptMode=REQUEUE requeues the job,
    which the attempt follows as PENDING without ending; a preemption that signals the job ends it STOPPED after a
    checkpoint, which is not counted as a failure either. In an elastic run (`min_nodes` < `nodes`) a lost node is
    a shrink, not a failure: a poll that finds a node of the job DOWN (the job running, requeued, or ended with it)
    reports it in `Outcome.lost_nodes`, and the scheduler replans for the nodes left (`Scheduler._shrink`, no
    restart counted). In a run that is not elastic, a poll that catches the job RUNNING on a DOWN node, or a job
    that ended NODE_FAIL or PREEMPTED without an exit record, ends CRASHED and counts against
    `policy.max_restarts`; calling those DISRUPTED would be right, but changes what the real-cluster tests
    (`tests/test_slurm_e2e.py`, `tests/test_slurm_cluster.py`) expect, so it waits until they can run with it.
    """

    name = "slurm"

    def __init__(
        self,
        *,
        run_dir: RunDir,
        profile: ClusterProfile | None = None,
        job: Job | None = None,
        use_sacct: bool | None = None,
        handoff_timeout_s: float | None = None,
        release_timeout_s: float = DEFAULT_RELEASE_TIMEOUT_S,
        end_grace_s: float = DEFAULT_END_GRACE_S,
        env: dict[str, str] | None = None,
        runner: Any = None,
    ) -> None:
        if profile is None or profile.slurm is None:
            raise ValueError(f"profile {getattr(profile, 'name', None)!r} has no slurm: section")
        super().__init__(run_dir=run_dir, profile=profile, job=job)
        self.profile: ClusterProfile = profile
        self._use_sacct = use_sacct
        if handoff_timeout_s is None:
            handoff_timeout_s = float(os.environ.get("CONA_HANDOFF_TIMEOUT_S", DEFAULT_HANDOFF_TIMEOUT_S))
        self.handoff_timeout_s = float(handoff_timeout_s)
        self.release_timeout_s = float(release_timeout_s)
        self.end_grace_s = float(end_grace_s)
        self.extra_env = dict(env or {})
        self._runner = runner or _run
        self._jobs: dict[str, str] = {}
        """The jobs of this run that `close` releases: job id → the job's submission (which names its records)."""
        self._cpus_checked: set[str] = set()
        """The jobs whose CPUs `_check_cpus` has looked at."""
        self._task_plugin: str | None = None
        warning = save_outlasts_signal(profile, job) if job is not None else None
        if warning and warning not in _said:
            _said.add(warning)
            print(f"cona: warning: {warning}", file=sys.stderr, flush=True)

    reports_long_queue_waits = False  # hours in a queue are the norm: the timeout is for stuck reasons only

    def resume_hint(self, detail: str) -> str:
        # A stuck reason's fix is a field of the profile's slurm section (`stuck_pending_advice` names it).
        return f"`cona run --resume {self.run_dir.root} --profile-set slurm.FIELD=VALUE` applies the fix to this run"

    @property
    def pending_timeout_s(self) -> float:
        assert self.profile.slurm is not None  # checked in __init__
        return self.profile.slurm.pending_timeout_s

    # -- Slurm commands ------------------------------------------------------------------------------------

    def _cmd(
        self, argv: list[str], *, check: bool = False, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        try:
            result = self._runner(argv, env=env)
        except FileNotFoundError:
            raise SlurmError(_client_missing(argv[0])) from None
        except subprocess.TimeoutExpired:
            raise SlurmError(
                f"{shlex.join(argv)} timed out after {COMMAND_TIMEOUT_S}s (is slurmctld up?)"
            ) from None
        if check and result.returncode != 0:
            message = (result.stderr or result.stdout or "").strip().splitlines()
            raise SlurmError(
                f"{shlex.join(argv)} failed: {message[-1] if message else f'exit {result.returncode}'}"
            )
        return result

    @property
    def use_sacct(self) -> bool:
        """Whether `sacct` answers on this cluster (detected once)."""
        if self._use_sacct is None:
            try:
                result = self._cmd(["sacct", "-n", "-X", "-P", "-o", "JobID", "-j", "1"])
                self._use_sacct = result.returncode == 0
            except SlurmError:
                self._use_sacct = False
        return self._use_sacct

    @property
    def task_plugin(self) -> str:
        """The cluster's `TaskPlugin` (`scontrol show config`, asked once; empty when it does not say)."""
        if self._task_plugin is None:
            result = self._cmd(["scontrol", "show", "config"])
            found = re.search(r"^TaskPlugin\s*=\s*(\S+)", result.stdout if result.returncode == 0 else "", re.M)
            self._task_plugin = found.group(1) if found else ""
        return self._task_plugin

    def _check_cpus(self, attempt: Attempt, info: SlurmJobInfo) -> None:
        """Warn once per job (a `cpu-shortage` event, which `cona run`'s console prints) when it runs more trainers
        than it holds CPUs."""
        if info.job_id in self._cpus_checked:
            return
        self._cpus_checked.add(info.job_id)
        processes = int(attempt.extra.get("nnodes", 0)) * int(attempt.extra.get("nproc_per_node", 0))
        if not 0 < info.num_cpus < processes:  # enough, or not said: no need to ask for the cluster's config
            return
        warning = cpu_shortage(info, processes, self.task_plugin)
        if warning is not None:  # `cona run`'s console prints it (`LiveView`); `cona status` lists the event
            from cona.orchestrator.runstate import log_event

            log_event(self.run_dir, "cpu-shortage", attempt=attempt.number, detail=warning)

    def job_info(self, job_id: str, *, strict: bool = False) -> SlurmJobInfo | None:
        """The job as slurmctld knows it (None once it has been purged, MinJobAge after its end). `strict`: None
        only when Slurm says so (`Invalid job id`); an answer that names no job is a SlurmError too."""
        if not job_id:
            return None
        result = self._cmd(["scontrol", "show", "job", "-o", str(job_id)])
        unknown = "Invalid job id" in (result.stderr + result.stdout)
        if result.returncode != 0:
            if unknown:
                return None
            raise SlurmError(f"scontrol show job {job_id} failed: {(result.stderr or result.stdout).strip()}")
        info = parse_scontrol_job(result.stdout)
        if info is None and strict and not unknown:
            raise SlurmError(f"scontrol show job {job_id} named no job: {result.stdout.strip()[:80]!r}")
        return info

    def accounting(self, job_id: str) -> SlurmJobInfo | None:
        """The job's final record from sacct, or None without accounting."""
        if not job_id or not self.use_sacct:
            return None
        result = self._cmd(
            ["sacct", "-n", "-X", "-P", "-o", "JobID,State,ExitCode,NodeList", "-j", str(job_id)]
        )
        if result.returncode != 0:
            return None
        return parse_sacct(result.stdout).get(str(job_id))

    def node_states(self, nodes: list[str]) -> dict[str, str]:
        if not nodes:
            return {}
        result = self._cmd(["sinfo", *SINFO_NODE_ARGS, "-n", ",".join(nodes)])
        return parse_sinfo_nodes(result.stdout) if result.returncode == 0 else {}

    def down_nodes(self, nodes: list[str]) -> list[str]:
        return sorted(node for node, state in self.node_states(nodes).items() if node_is_down(state))

    # -- run-directory records ------------------------------------------------------------------------------

    def _attempt_file(self, attempt: int, name: str) -> Path:
        return self.run_dir.attempt_dir(attempt) / name

    def _record(self, attempt: int, name: str, submission: str | None) -> dict[str, Any] | None:
        """attempts/<n>/<name> when it belongs to `submission` (or to any, when None)."""
        try:
            data = read_json(self._attempt_file(attempt, name))
        except (ValueError, OSError):
            return None
        if not isinstance(data, dict):
            return None
        if submission is not None and data.get("submission") != submission:
            return None
        return data

    def exit_record(self, attempt: Attempt) -> dict[str, Any] | None:
        """The attempt's slurm-exit.json as written by its job, if that job has written one."""
        return self._record(attempt.number, "slurm-exit.json", attempt.extra.get("submission"))

    def last_exit_record(self, submission: str) -> dict[str, Any] | None:
        """The newest slurm-exit.json (highest attempt) of the job of `submission`: what its batch loop did last.
        An attempt continued in place or relaunched in the allocation is recorded under its own number, so this is
        the loop's latest decision, whichever attempt object the caller holds."""
        if not submission:
            return None
        newest: tuple[int, dict[str, Any]] | None = None
        for path in (self.run_dir.root / "attempts").glob("*/slurm-exit.json"):
            if not path.parent.name.isdigit():
                continue
            number = int(path.parent.name)
            record = self._record(number, "slurm-exit.json", submission)
            if record is not None and (newest is None or number > newest[0]):
                newest = (number, record)
        return newest[1] if newest else None

    # -- Backend API ---------------------------------------------------------------------------------------

    def render(self, *, strategy: Strategy) -> str:
        """The batch script of the run's first submission, starting `strategy`: its `#SBATCH --nodes` is the one
        `launch` would pass (the strategy's node count, or an elastic run's range). The strategy itself reaches
        the job through launch.json."""
        nodes = self.node_request(strategy, self._startable_node_counts())
        text = render_batch_script(self.profile, self.job, str(self.run_dir.root), nodes=nodes)
        if not self.profile.slurm.use_submitit:
            return text
        shebang, _, rest = text.partition("\n")
        log = self.run_dir.root.absolute() / "slurm" / "submitit" / "%j_0_log.out"
        return f"{shebang}\n{SUBMITIT_NOTE.format(python=submitit_python(self.profile), log=log)}\n{rest}"

    def placement(self, strategy: Strategy) -> tuple[int, int]:
        return placement(strategy, self.profile.gpus_per_node, self.profile.nodes)

    def node_request(self, strategy: Strategy, elastic: Collection[int] | None = None) -> str:
        """The `--nodes` of a submission that starts `strategy`: its node count, or `MIN-MAX` when it may start on
        any of several node counts (`elastic`: those of an elastic run's planning table). The one place that
        decides it, for `launch` and for `render` alike."""
        if elastic and len(elastic) > 1:
            return f"{min(elastic)}-{max(elastic)}"
        return str(self.placement(strategy)[0])

    def _startable_node_counts(self) -> list[int] | None:
        """The node counts an elastic run's first submission may start on, for `render`: the scheduler launches on
        the keys of its planning table (`ElasticPlan.by_nodes`), the counts of the profile's range that can start
        the job (`startable_nodes`); only the lowest and the highest matter for `node_request`. None when not
        elastic."""
        if not is_elastic(self.profile):
            return None
        if self.job is None:
            return node_range(self.profile)
        # Searched from both ends: usually only the two ends of a range are planned, however large it is.
        low = next(startable_nodes(self.profile, self.job), None)
        high = next(startable_nodes(self.profile, self.job, descending=True), None)
        return sorted({end[0] for end in (low, high) if end is not None})

    # A relaunch is a new srun step in the running allocation: step start on every node, interpreter and imports,
    # the c10d rendezvous and, on GPUs, NCCL initialisation. Another node count needs a new allocation: the
    # resubmission adds the previous job's release and the queue, which no profile can know in advance.
    relaunch_overhead_s = 30.0
    resubmit_overhead_s = 120.0

    def switch_kind(self, current: Strategy, target: Strategy, *, in_place_allowed: bool) -> SwitchKind:
        if self.placement(current)[0] != self.placement(target)[0]:
            return SwitchKind.RESUBMIT
        return super().switch_kind(current, target, in_place_allowed=in_place_allowed)

    # The trainers of a step go on as the next attempt when the world size stays (`policy.in_place_switch`): no
    # new step, no interpreter, imports or rendezvous. The batch script's helper follows their exit records to the
    # attempt that finally ends (`slurm_helper.py last`) and writes its slurm-exit.json there.
    supports_in_place_switch = True

    def offer_in_place(self, attempt: Attempt, *, number: int, strategy: Strategy) -> None:
        """The launch record of attempt `number` carries the job's submission, node count and processes per node,
        as any launch record of this job does: a job requeued before its trainers made the switch finds it there
        and starts the previous attempt again (`slurm_helper.py` `_runnable`), one requeued after it starts this
        one."""
        keep = {k: attempt.extra[k] for k in ("submission", "job_id") if k in attempt.extra}
        nnodes, nproc = self.placement(strategy)
        self.write_launch(number, strategy, in_place=True, mode="continued", nnodes=nnodes, nproc_per_node=nproc,
                          launched_as=attempt.extra.get("launched_as", attempt.number), **keep)  # fmt: skip

    def continued(self, attempt: Attempt, *, number: int, strategy: Strategy) -> Attempt:
        # Same job, same step: its records (slurm.json, the node logs) stay in the directory of the attempt that
        # started it; its end is recorded in this attempt's slurm-exit.json.
        extra = {**attempt.extra, "launched_as": attempt.extra.get("launched_as", attempt.number), "mode": "continued"}
        extra.pop("by_nnodes", None)  # the step runs `strategy` now, whatever its start chose
        return Attempt(number, strategy, backend_id=attempt.backend_id, started_at=time.time(), extra=extra)

    def _started_record(self, attempt: Attempt) -> dict[str, Any] | None:
        """slurm.json of the step that runs `attempt` (the attempt that started it, for one continued in place)."""
        launched_as = int(attempt.extra.get("launched_as", attempt.number))
        return self._record(launched_as, "slurm.json", attempt.extra.get("submission"))

    def launch(
        self, *, attempt: int, strategy: Strategy, previous: Attempt | None = None,
        elastic: dict[int, Strategy] | None = None,
    ) -> Attempt:  # fmt: skip
        nnodes, nproc = self.placement(strategy)
        (self.run_dir.root / "attempts").mkdir(parents=True, exist_ok=True)  # sbatch --output lies there
        extra: dict[str, Any] = {"nnodes": nnodes, "nproc_per_node": nproc}
        node_counts = self.node_request(strategy, elastic)
        if previous is not None and self._can_relaunch_in_allocation(previous, nnodes):
            # A new srun step of the same allocation (new processes; an in-place switch keeps them, `continued`).
            # Also for an elastic relaunch: the job holds that many nodes now, and a resubmission could lose them.
            extra.update(submission=str(previous.extra["submission"]), job_id=previous.backend_id, mode="relaunch")
            self.write_launch(attempt, strategy, **extra)
            return Attempt(attempt, strategy, backend_id=previous.backend_id, started_at=time.time(), extra=extra)
        if elastic and len(elastic) > 1:
            # `--nodes=MIN-MAX`: Slurm starts the job on as many nodes of the range as it can give, and the batch
            # script's helper runs the table's strategy for `$SLURM_NNODES` (no round trip through the queue).
            table = {str(n): {"strategy": s.to_dict(), "nproc_per_node": self.placement(s)[1]} for n, s in elastic.items()}
            extra["by_nnodes"] = table

        if previous is not None and previous.backend_id:
            # A job idling in its hand-off loop runs nothing and ends once it sees the newer attempt; any other
            # previous job may still have trainer processes, or run the attempt again after a requeue.
            idle = (self.exit_record(previous) or {}).get("action") == "wait"
            self._release(previous.backend_id, wait=not idle, submission=previous.extra.get("submission"))
        extra.update(submission=secrets.token_hex(8), mode="submit")
        self.write_launch(attempt, strategy, **extra)
        if self.profile.slurm.use_submitit:
            job_id = self._submit_submitit(node_counts, extra["submission"])
        else:
            job_id = self._submit_sbatch(node_counts, extra["submission"])
        extra["job_id"] = job_id
        self.write_launch(attempt, strategy, **extra)  # the same record, now with the job id
        self._jobs[job_id] = extra["submission"]
        return Attempt(attempt, strategy, backend_id=job_id, started_at=time.time(), extra=extra)

    def _can_relaunch_in_allocation(self, previous: Attempt, nnodes: int) -> bool:
        """The previous attempt's job is alive, waiting for a hand-off, on the same number of nodes."""
        submission = previous.extra.get("submission")
        if not submission or not previous.backend_id:
            return False
        if self.placement(previous.strategy)[0] != nnodes:  # what it runs (an elastic start may differ from extra)
            return False
        done = self._record(previous.number, "slurm-exit.json", submission)
        if not done or done.get("action") != "wait":
            return False
        if time.time() - float(done.get("time", 0)) > self.handoff_timeout_s - 10:
            return False  # the job is about to give up waiting
        info = self.job_info(previous.backend_id)
        return info is not None and info.state == "RUNNING" and (info.num_nodes in (0, nnodes))

    def _release(self, job_id: str, *, wait: bool = True, submission: str | None = None) -> None:
        """Cancel a job of this run that is still alive (idle after a switch, requeued, or on a dead node).

        A job whose batch loop recorded that it ends (`ends_by_itself`, by the records of `submission`) is
        scancelled only if it is still alive `end_grace_s` after that record: the orchestrator reads the record
        while the batch script is still exiting, and a scancel then makes Slurm record the finished job CANCELLED.

        With `wait`, return only once Slurm reports it ended: a job on a DOWN node that Slurm requeues, or one
        cancelled while its trainers checkpoint on SIGTERM, must not overlap the attempt submitted next.
        """
        info = self.job_info(job_id)
        if info is None or not info.alive:
            return
        info, ended = self._await_own_end(job_id, info, submission)
        if info is None or not info.alive:
            return
        if not ended:
            self._cmd(["scancel", str(job_id)])
        deadline = time.monotonic() + self.release_timeout_s
        while wait:
            time.sleep(0.5)
            info = self.job_info(job_id)
            if info is None or not info.alive:
                return
            if time.monotonic() > deadline:
                raise SlurmError(
                    f"job {job_id} is still {info.state} {self.release_timeout_s:.0f}s after "
                    f"{'its batch script ended' if ended else 'scancel'}; not submitting the next attempt beside it "
                    "(cancel it, then `cona run --resume`)"
                )
            if info.pending:
                self._cmd(["scancel", str(job_id)])  # requeued by Slurm meanwhile

    def _await_own_end(
        self, job_id: str, info: SlurmJobInfo, submission: str | None
    ) -> tuple[SlurmJobInfo | None, bool]:
        """While the job ends by itself (`ends_by_itself`) and is still RUNNING, wait for it, at most `end_grace_s`.

        Returns the job's state then, and whether its batch script ended by itself: the job is gone, or COMPLETING
        (its end is recorded; what is left is Slurm's cleanup, which a scancel would not hasten) with no requeue
        since. Not for a job on a DOWN node: its batch script may be gone with the node, and it is cancelled.
        """
        record = self.last_exit_record(submission or "")

        def ending(job: SlurmJobInfo) -> bool:
            return ends_by_itself(record, job, now=time.time(), grace_s=self.end_grace_s)

        if not ending(info) or self.down_nodes(info.nodes):
            return info, False
        deadline = time.monotonic() + self.end_grace_s  # also bounded by our clock: a node's may run ahead
        current: SlurmJobInfo | None = info
        while (
            current is not None
            and current.state in RUNNING_STATES - {"COMPLETING"}
            and ending(current)
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
            current = self.job_info(job_id)
        if current is None or not current.alive:
            return current, True
        return current, current.state == "COMPLETING" and ending(current)

    def overridden_input_variables(self, env: dict[str, str]) -> list[str]:
        """sbatch's input variables in `env` that would override the batch script (sbatch reads them over its
        `#SBATCH` lines): those of options the script sets from the profile (`SBATCH_PARTITION` over
        `slurm.partition`, `SBATCH_TIMELIMIT` over `slurm.time_limit`, ...), `SBATCH_WAIT` (the submission would
        block until the job ends) and an `SBATCH_EXPORT` without ALL (the trainers would lose the environment).
        Left out of the submission, so the script `cona render slurm` shows is what runs; the others (a site's
        `SBATCH_ACCOUNT` where the profile names none) pass."""
        spec = self.profile.slurm
        owned = {"SBATCH_JOB_NAME", "SBATCH_TIMELIMIT", "SBATCH_REQUEUE", "SBATCH_NO_REQUEUE", "SBATCH_OPEN_MODE",
                 "SBATCH_SIGNAL", "SBATCH_GPUS_PER_NODE", "SBATCH_GPUS", "SBATCH_WAIT", "SBATCH_ARRAY_INX"}  # fmt: skip
        owned.update(f"SBATCH_{field.upper()}" for field in ("partition", "account", "qos") if getattr(spec, field))
        if "ALL" not in env.get("SBATCH_EXPORT", "ALL").upper().split(","):
            owned.add("SBATCH_EXPORT")
        return sorted(key for key in env if key in owned)

    def submission_env(self) -> dict[str, str]:
        """The environment sbatch passes on to the job (`--export=ALL`).

        When `slurm.python` is a bare name, the directory of this interpreter goes first on PATH: on a cluster
        whose nodes share the orchestrator's filesystem, `python3` is then the same virtualenv; elsewhere the
        directory does not exist on the node and PATH lookup moves on.

        sbatch's input variables that would override the script are left out (`overridden_input_variables`).

        When the orchestrator itself runs in a Slurm job, that job's own variables (SLURM_JOB_ID,
        SLURM_CPUS_PER_TASK, SLURM_NTASKS, SLURM_MEM_PER_CPU, ...) are left out: the training job would inherit
        them, and its `srun` would take them as options (one CPU per trainer, a memory-option conflict).
        """
        env = dict(os.environ)
        if "SLURM_JOB_ID" in env:
            for key in [k for k in env if k.startswith(_JOB_VARIABLE_PREFIXES) and k not in _CLIENT_VARIABLES]:
                del env[key]
        for key in self.overridden_input_variables(env):
            del env[key]
        words = self.profile.slurm.python.split()
        if words and "/" not in words[0]:
            bindir = os.path.dirname(os.path.abspath(sys.executable))
            path = env.get("PATH", "")
            if bindir not in path.split(os.pathsep):
                env["PATH"] = bindir + (os.pathsep + path if path else "")
        env["CONA_HANDOFF_TIMEOUT_S"] = str(int(self.handoff_timeout_s))
        env.update(self.extra_env)
        return env

    def script_path(self) -> Path:
        return self.run_dir.root / "slurm" / "cona.sbatch"

    def write_script(self, nodes: str | None = None) -> Path:
        """The run's batch script, for a submission on `nodes` nodes (`node_request`; default: the profile's)."""
        text = render_batch_script(self.profile, self.job, self.run_dir.root.absolute(), nodes=nodes)
        path = self.script_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.chmod(0o755)
        os.replace(tmp, path)
        return path

    def _submit_sbatch(self, nnodes: str, submission: str) -> str:
        """Submit the batch script on `nnodes` nodes (a count, or `MIN-MAX` for an elastic launch)."""
        script = self.write_script(nnodes)
        # The script's #SBATCH lines say the same; on the command line as well, which wins over any script.
        options = [f"{option}={value}" for option, value in node_options(nnodes)]
        argv = ["sbatch", "--parsable", *options, str(script), submission]
        result = self._cmd(argv, check=True, env=self.submission_env())
        job_id = result.stdout.strip().split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"sbatch printed no job id: {result.stdout.strip()!r}")
        return job_id

    def _submit_submitit(self, nnodes: str, submission: str) -> str:
        """Submit the same batch loop through submitit: the script runs in the batch step (no srun wrapper).

        The pre-timeout signal goes to the job's steps (`--signal=USR1@N`, not `B:`): the trainers checkpoint and
        exit 43 and, as no stop was requested in control.json, the loop requeues the job.
        """
        import submitit

        spec = self.profile.slurm
        script = self.write_script(nnodes)
        folder = self.run_dir.root / "slurm" / "submitit"
        # submitit's batch script starts `python -u -m submitit.core._submit` on the first node, by default with this
        # process's interpreter: the compute nodes' one is `slurm.python` (submitit needs to be installed there).
        executor = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_python=submitit_python(self.profile))
        additional: dict[str, Any] = {"requeue": True, "time": spec.time_limit}
        # The node options go in verbatim, the same as the sbatch path's: submitit's typed `nodes` parameter takes
        # only an int, and an elastic `MIN-MAX` failed its check. (Left unset it stays 1: submitit then expects the
        # one result of the one process that runs the loop, which is what `slurm_use_srun=False` starts.)
        additional.update({option[2:].replace("-", "_"): value for option, value in node_options(nnodes)})
        if spec.signal_before_timeout_s > 0:
            additional["signal"] = f"USR1@{spec.signal_before_timeout_s}"
        for entry in spec.extra_sbatch:
            option, value = parse_extra_option(entry)
            # submitit writes `--{name}`: a short option (`-C a100`) would become `--C`, which sbatch does not know.
            name = option[2:] if option.startswith("--") else SHORT_OPTIONS.get(option[1:2], "")
            if not name or (not option.startswith("--") and len(option) > 2):
                raise ConfigError(f"slurm.extra_sbatch: {entry.strip()!r}: give the option's long name (--name=value) "
                                  "for submitit")  # fmt: skip
            additional[name.replace("-", "_")] = True if value is None else value
        params: dict[str, Any] = {
            "name": (self.job.name if self.job is not None else self.run_dir.root.name),
            "slurm_use_srun": False,
            "slurm_setup": list(spec.setup),
            "slurm_additional_parameters": additional,
        }
        if spec.partition:
            params["slurm_partition"] = spec.partition
        if spec.account:
            additional["account"] = spec.account
        if spec.qos:
            additional["qos"] = spec.qos
        if spec.gpus_per_node_flag:
            params["slurm_gpus_per_node"] = self.profile.gpus_per_node
        executor.update_parameters(**params)
        env = self.submission_env()
        # no env=: the command inherits the job's environment (SLURM_* and what sbatch exported from `env`)
        function = submitit.helpers.CommandFunction(["bash", str(script), submission])
        saved = dict(os.environ)
        try:  # sbatch (run by submitit) exports this process's environment
            os.environ.clear()
            os.environ.update(env)
            job = executor.submit(function)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        return str(job.job_id).split("_")[0]

    def poll(self, attempt: Attempt) -> Outcome:
        try:
            return self.with_crash_cause(attempt, self._poll(attempt))
        except SlurmError as e:
            # slurmctld busy or restarting (`Socket timed out`, `Unable to contact slurm controller`): nothing
            # is known to have changed; ask again at the next poll (heartbeats still tell a hang).
            return Outcome(AttemptStatus.RUNNING, None, f"Slurm did not answer ({e}); asking again")

    def _poll(self, attempt: Attempt) -> Outcome:
        outcome = self._poll_job(attempt)
        if "by_nnodes" in attempt.extra:  # an elastic start: the helper chose the strategy for the nodes it got
            chosen = (self._started_record(attempt) or {}).get("strategy")
            if isinstance(chosen, dict) and Strategy.from_dict(chosen) != attempt.strategy:
                outcome = dataclasses.replace(outcome, strategy=Strategy.from_dict(chosen))
        return outcome

    def _poll_job(self, attempt: Attempt) -> Outcome:
        job_id = attempt.backend_id
        done = self.exit_record(attempt)
        if done is not None and not done.get("requeued"):
            return _outcome_from_exit(done, job_id)
        info = self.job_info(job_id)
        if info is not None and info.alive:
            restarts = f", requeued {info.restarts}x" if info.restarts else ""
            if info.pending:
                why = f" ({info.reason})" if info.reason and info.reason != "None" else ""
                started = self._started_record(attempt) or {}
                down = self.down_nodes([n for n in str(started.get("nodelist", "")).split(",") if n])
                lost = f"; node {','.join(down)} DOWN" if down else ""
                advice = stuck_pending_advice(info.reason)
                fix = f": Slurm will not start it, {advice}" if advice else ""
                return Outcome(AttemptStatus.PENDING, None, f"job {job_id} {info.state}{why}{restarts}{lost}{fix}",
                               stuck=advice is not None, lost_nodes=tuple(down))  # fmt: skip
            self._check_cpus(attempt, info)
            down = self.down_nodes(info.nodes)
            if down:
                return Outcome(
                    AttemptStatus.CRASHED,
                    None,
                    f"node {','.join(down)} DOWN (job {job_id} {info.state}{restarts})",
                    lost_nodes=tuple(down),
                )
            missing = self._nodes_not_regained(attempt, info)
            if missing:
                return Outcome(
                    AttemptStatus.CRASHED,
                    None,
                    f"job {job_id} {info.state}{restarts} on {','.join(info.nodes)} only: attempt {attempt.number} "
                    f"needs {self.placement(attempt.strategy)[0]} node(s), node {','.join(missing)} not in the "
                    "allocation",
                    lost_nodes=missing,
                )
            return Outcome(
                AttemptStatus.RUNNING, None, f"job {job_id} {info.state} on {','.join(info.nodes)}{restarts}"
            )
        # The job has ended (or is unknown): the run directory says how; re-read in case it just wrote.
        done = self.exit_record(attempt)
        if done is not None and not done.get("requeued"):
            return _outcome_from_exit(done, job_id)
        final = self.accounting(job_id) or info
        how = f"{final.state} (exit {final.exit_code})" if final is not None else "gone from the queue"
        if done is not None:  # the attempt was to run again after a requeue, but the job did not come back
            code = int(done.get("code", 1))
            status = AttemptStatus.STOPPED if code == ExitCode.STOPPED else AttemptStatus.CRASHED
            return Outcome(status, code, f"exit {code} for a requeue, but job {job_id} ended: {how}")
        started = self._started_record(attempt)
        when = "" if started else " before the attempt started"
        code = final.exit_status if final is not None and final.exit_status else None
        # A job that ended with a node (NODE_FAIL, not requeued): which of its nodes are gone.
        down = self.down_nodes([n for n in str((started or {}).get("nodelist", "")).split(",") if n])
        lost = f"; node {','.join(down)} DOWN" if down else ""
        return Outcome(
            AttemptStatus.CRASHED,
            code,
            f"job {job_id} {how}{when}, no exit record for attempt {attempt.number}{lost}",
            lost_nodes=tuple(down),
        )

    def _nodes_not_regained(self, attempt: Attempt, info: SlurmJobInfo) -> tuple[str, ...]:
        """The nodes `attempt` started on that its job, running again on fewer nodes than the attempt needs, no
        longer holds; () when it holds enough.

        Only an elastic job (`--nodes=MIN-MAX`) that Slurm requeued can come back smaller: off a node drained
        meanwhile (DRAIN alone is no lost node, `node_is_down`), or one that was DOWN only for a moment. Its elastic
        start (`by_nnodes`) runs the table's strategy for what it got; any later attempt of it (a switch in place,
        a relaunch in the allocation) has one node count, and the job's helper waits rather than run it on too few
        nodes (`slurm_helper.py` `_too_few_nodes`). Reported as lost nodes, so the scheduler replans for the nodes
        left and resubmits (`Scheduler._shrink`) instead of a crash, and a relaunch that queues for the missing
        node."""
        if "by_nnodes" in attempt.extra or info.state != "RUNNING" or not info.nodes:
            return ()  # COMPLETING: Slurm drops each node from the list as it finishes
        short = self.placement(attempt.strategy)[0] - len(info.nodes)
        if short <= 0:
            return ()
        started = str((self._started_record(attempt) or {}).get("nodelist", ""))
        return tuple([n for n in started.split(",") if n and n not in info.nodes][:short])

    def available_nodes(self, attempt: Attempt) -> int | None:
        """The nodes of the profile's partition that `attempt`'s job holds, plus those idle (neither DOWN nor
        draining); None when Slurm does not answer."""
        argv = ["sinfo", *SINFO_NODE_ARGS] + (["-p", self.profile.slurm.partition] if self.profile.slurm.partition else [])
        try:
            result = self._cmd(argv)
            info = self.job_info(attempt.backend_id) if attempt.backend_id else None
        except SlurmError:
            return None
        if result.returncode != 0:
            return None
        held = set(info.nodes) if info is not None and info.state in RUNNING_STATES else set()
        states = parse_sinfo_nodes(result.stdout)
        return sum(1 for node, state in states.items()
                   if not node_is_down(state) and "drain" not in state and (node in held or state.startswith("idle")))  # fmt: skip

    def crash_logs(self, attempt: Attempt) -> list[Path]:
        """The step's output, one `node-<i>.log` per node (the batch script's `srun --output`), in the directory of
        the attempt that started the step (`launched_as`); the job-side helper ends each with its node's torchrun
        summary when a worker failed."""
        directory = self.run_dir.attempt_dir(int(attempt.extra.get("launched_as", attempt.number)))
        logs = [path for path in directory.glob("node-*.log") if path.stem[5:].isdigit()]
        return sorted(logs, key=lambda path: int(path.stem[5:]))

    def gone(self, attempt: Attempt) -> bool:
        """Whether the attempt's job has ended, told by read-only queries: `scontrol show job` says it finished
        (COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, ...) or no longer knows it (purged from the queue) and
        `sacct`, where the cluster keeps accounting, does not say it is queued or running. A job pending again
        (requeued) is not gone: its trainer runs again. False whenever Slurm does not answer."""
        if not attempt.backend_id:
            return False
        try:
            # Strict: `cona stop` writes no stop for a trainer said gone, so an answer that cannot be read is not
            # taken for a job that is gone.
            info = self.job_info(attempt.backend_id, strict=True) or self.accounting(attempt.backend_id)
        except (SlurmError, OSError, subprocess.SubprocessError):  # slurmctld down or busy, no clients: cannot tell
            return False
        return info is None or not info.alive

    def cancel(self, attempt: Attempt) -> None:
        if not attempt.backend_id:
            return
        info = self.job_info(attempt.backend_id)
        if info is not None and info.alive:
            self._cmd(["scancel", str(attempt.backend_id)])

    def adopt(self, attempt: Attempt) -> bool:
        alive = not self.poll(attempt).status.finished
        if alive and attempt.backend_id:
            self._jobs[attempt.backend_id] = str(attempt.extra.get("submission") or "")
        return alive

    def close(self) -> None:
        """Cancel this run's jobs that are still alive (an allocation idling after the last attempt); a job whose
        batch loop recorded its end is first left to end by itself (`_release`)."""
        for job_id, submission in sorted(self._jobs.items()):
            with contextlib.suppress(SlurmError):
                self._release(job_id, wait=False, submission=submission)
        self._jobs.clear()


SUBMITIT_NOTE = """\
# NOTE slurm.use_submitit is true: `cona run` does not sbatch this script. It submits submitit's own batch script,
# which asks for the resources of the #SBATCH lines below, but sends the pre-timeout signal to the steps
# (--signal=USR1@N, not B:), logs to {log} and adds --wckey=submitit. It runs
# `{python} -u -m submitit.core._submit` (slurm.python), which runs this script with bash."""
"""The head of `cona render slurm` for a submitit profile: what it prints is not what is submitted."""


def submitit_python(profile: ClusterProfile) -> str:
    """`slurm.python` as the shell command submitit puts in its batch script (each word quoted)."""
    return " ".join(shlex.quote(word) for word in python_command(profile))


def _outcome_from_exit(done: dict[str, Any], job_id: str) -> Outcome:
    code = done.get("code")
    code = int(code) if isinstance(code, int) else None
    status = AttemptStatus.from_exit_code(code)
    detail = f"exit {code} in job {job_id}"
    if done.get("signal"):
        detail += f" after SIG{done['signal']}"
    if done.get("detail"):
        detail += f": {done['detail']}"
    return Outcome(status, code, detail)


def _run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False,
        env={**(env or os.environ), "LC_ALL": "C"},
    )  # fmt: skip
