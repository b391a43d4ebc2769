"""The seeded fault injector: `python -m tests.faults --seed S --count N --backend local [--kinds ...]`.

It runs real `cona run`s (torchrun, gloo, the trainer) under the `schedule` policy, so the strategy sequence and
therefore the expected result are known, injects N faults chosen by the seed — what (`KINDS`) and when (`POINTS`:
during a step, a checkpoint save, an in-place switch, the orchestrator's decision at a switch point) — lets each
run finish and checks what cona promises (docs/reliability.md):

- the samples log audits to exactly samples 0 … N−1, in order, across all attempts;
- the final parameters equal an uninterrupted run's with the same schedule: bit for bit when the runs trained the
  same samples under the same strategies, within 1e-5 otherwise;
- `cona status` says done, and no process of the run is left.

Fault i is drawn from its own generator (`random.Random(f"{seed}:{i}")`), so `--seed S --fault i` replays it alone;
a failure prints that command. Faults run two to a run (one before sample `WINDOW_SPLIT`, one after), which halves
the number of runs without letting one fault hide another: the second is armed only once the run recovered past
the first one's window.

`--backend slurm` runs the same schedule on the local two-node Slurm cluster (`slurm/local-cluster.sh`, 2 nodes ×
2 processes, so every switch is still in place) and adds the cluster's own faults (`SLURM_KINDS`: `scancel`,
`scontrol requeue`, a killed slurmd, a restarted slurmctld) and the moment `queued` (the partition is held DOWN and
the job requeued, so the attempt waits PENDING while the fault strikes). After each Slurm run no job of the run may
be left in the queue. The cluster's helpers are `SlurmCluster`; it must run as root (it restarts daemons).

`--backend kubernetes` runs it through the Kubernetes backend on the API emulator, with `kubectl delete pod` and
the Eviction API as kinds of its own (`tests/faults_k8s.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cona.protocol.procstat import alive as process_alive

REPO = Path(__file__).resolve().parent.parent
PROFILES = {"local": REPO / "slurm" / "profiles" / "local-cpu.yaml", "slurm": REPO / "slurm" / "profiles" / "local-slurm.yaml"}
PROFILE = PROFILES["local"]
LOCAL_CLUSTER = REPO / "slurm" / "local-cluster.sh"
JOB = REPO / "examples" / "tiny-gpt.yaml"

# Three strategies on 4 processes: every switch is in place and changes the degrees and the batch. The points are
# no multiples of the batches, so "the first step boundary at or past the point" is tested, not a lucky division.
SCHEDULE: tuple[tuple[int, str], ...] = (
    (0, "dp=4,tp=1,pp=1,mbs=4,gbs=16"),
    (200, "dp=2,tp=1,pp=2,mbs=4,gbs=32"),
    (600, "dp=4,tp=1,pp=1,mbs=8,gbs=32"),
)
MAX_SAMPLES = 960
WINDOW_SPLIT = 400
"""Faults 2k and 2k + 1 share a run: the first before this sample, the second after (each window holds one switch
point)."""

KINDS = ("worker-kill", "torchrun-kill", "orchestrator-kill", "worker-stop", "preempt-term", "preempt-usr1")
SLURM_KINDS = ("scancel", "requeue", "slurmd-kill", "slurmctld-restart")
POINTS = ("step", "checkpoint", "switch", "decision")
QUEUED = "queued"
"""Slurm only: the attempt waits PENDING (its job requeued while the partition is held DOWN) when the fault strikes."""
QUEUED_KINDS = ("orchestrator-kill", "scancel", "slurmd-kill", "slurmctld-restart")
"""The kinds that can strike a queued attempt: it has no process to kill or signal, and a pending job cannot be
requeued."""
K8S_KINDS = ("pod-delete", "pod-evict")
"""Kubernetes only (`tests/faults_k8s.py`): `kubectl delete pod`, the Eviction API."""
BACKEND_KINDS = {"local": KINDS, "slurm": KINDS + SLURM_KINDS, "kubernetes": KINDS + K8S_KINDS}
SECRETS = {"HF_TOKEN": "hf_fault_secret_0d1e", "AWS_SECRET_ACCESS_KEY": "aws_fault_secret_77a2"}
"""Set in every run's environment: none may appear in any file of the run directory or in its output."""


def settings(schedule: tuple[tuple[int, str], ...] = SCHEDULE, max_samples: int = MAX_SAMPLES) -> list[str]:
    """The `--set` arguments of every run: short, frequent checkpoints, fast decisions, a 30 s hang timeout."""
    entries = ", ".join(f"{{samples: {n}, strategy: '{s}'}}" for n, s in schedule)
    values = {
        "target.max_samples": max_samples, "target.val_perplexity": "null", "eval.interval_samples": 100_000,
        "checkpoint.interval_steps": 4, "checkpoint.keep": 3, "optimizer.warmup_samples": 64,
        "policy.name": "schedule", "policy.schedule": f"[{entries}]", "policy.decision_interval_s": 0.5,
        "policy.heartbeat_timeout_s": 30, "policy.startup_timeout_s": 240, "policy.max_restarts": 20,
    }  # fmt: skip
    return [arg for key, value in values.items() for arg in ("--set", f"{key}={value}")]


@dataclasses.dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    point: str
    samples: int
    """step: inject once the trainer is past this sample; checkpoint: at the first save after it; switch and
    decision: at the schedule point in this fault's window."""
    victim: int
    """Which worker (an index into the sorted PIDs) for the kinds that pick one."""
    delay_s: float
    """orchestrator-kill: how long the orchestrator stays dead."""

    @property
    def window(self) -> tuple[int, int]:
        return (0, WINDOW_SPLIT) if self.index % 2 == 0 else (WINDOW_SPLIT, MAX_SAMPLES)

    def describe(self) -> str:
        when = "while the attempt is queued" if self.point == QUEUED else f"during a {self.point}"
        return f"fault {self.index}: {self.kind} {when} (samples {self.samples})"


def draw(seed: int, index: int, kinds: tuple[str, ...], backend: str = "local") -> Fault:
    """Fault `index` of seed `seed`: from its own generator, so it is the same whether drawn alone or in a batch.
    On Slurm a kind that can strike a queued attempt may also draw the moment `queued` (the local draws are
    unchanged, so their seeds replay as before)."""
    rng = random.Random(f"{seed}:{index}")
    kind = rng.choice(kinds)
    point = rng.choice((*POINTS, QUEUED) if backend == "slurm" and kind in QUEUED_KINDS else POINTS)
    lo, hi = (0, WINDOW_SPLIT) if index % 2 == 0 else (WINDOW_SPLIT, MAX_SAMPLES)
    if point in ("switch", "decision"):
        samples = next(n for n, _ in SCHEDULE if lo < n < hi)
    else:  # leave room after it for the fault to happen inside the window
        samples = rng.randrange(lo + 16, hi - 160, 8)
    return Fault(index=index, kind=kind, point=point, samples=samples, victim=rng.randrange(4),
                 delay_s=round(rng.uniform(0.5, 3.0), 2))  # fmt: skip


# ------------------------------------------------------------------------------------------------ processes


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def run_processes(run_root: Path) -> dict[int, str]:
    """Every live process whose command line names the run directory (orchestrator, wrapper, torchrun, workers)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            text = _cmdline(int(entry.name))
            if str(run_root) in text and process_alive(int(entry.name)):
                found[int(entry.name)] = text
    return found


def workers(run_root: Path) -> list[int]:
    # On Slurm the helper's agent (which runs torchrun in-process) carries the trainer's arguments too.
    return sorted(pid for pid, text in run_processes(run_root).items()
                  if "-m cona.trainer" in text and "torch.distributed.run" not in text and "/bin/sh" not in text
                  and "slurm_helper" not in text)  # fmt: skip


def torchrun(run_root: Path) -> list[int]:
    """Local: torchrun. Slurm: the helper's `agent` on each node, the process torchrun runs in."""
    return sorted(pid for pid, text in run_processes(run_root).items()
                  if "torch.distributed.run" in text or ("torchrun" in text and "/bin/sh" not in text)
                  or ("slurm_helper" in text and " agent " in text))  # fmt: skip


# ------------------------------------------------------------------------------------------------ the Slurm cluster


class SlurmCluster:
    """The local cluster of `slurm/local-cluster.sh` as the Slurm faults need it (root: it restarts daemons)."""

    PARTITION = "debug"
    PIDS = Path("/run/cona-slurm")

    @staticmethod
    def sh(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)

    @classmethod
    def script(cls, *args: str, timeout: float = 300) -> str:
        result = cls.sh(str(LOCAL_CLUSTER), *args, timeout=timeout)
        if result.returncode != 0:
            raise FaultFailed(f"slurm/local-cluster.sh {' '.join(args)} failed: {(result.stderr or result.stdout).strip()}")
        return result.stdout.strip()

    @classmethod
    def problem(cls) -> str | None:
        """None when the cluster answers and this process may restart its daemons, else why not."""
        if os.geteuid() != 0:
            return "the Slurm faults restart Slurm daemons: run as root"
        if not LOCAL_CLUSTER.exists() or cls.sh("scontrol", "ping", timeout=20).stdout.count("is UP") == 0:
            return "no local Slurm cluster answers (start it: slurm/local-cluster.sh start)"
        return None

    @classmethod
    def queue(cls, run_root: Path) -> dict[str, str]:
        """{job id: state} of the queued or running jobs whose batch script is this run's (`RUN/slurm/cona.sbatch`)."""
        out = cls.sh("squeue", "-h", "-o", "%i|%T|%o", timeout=60)
        if out.returncode != 0:
            raise FaultFailed(f"squeue failed: {(out.stderr or out.stdout).strip()}")
        jobs = {}
        for line in out.stdout.splitlines():
            job, state, command = ([*line.split("|", 2), "", ""])[:3]
            if command.startswith(f"{run_root}{os.sep}"):
                jobs[job] = state
        return jobs

    @classmethod
    def job_state(cls, job: str) -> str:
        out = cls.sh("scontrol", "show", "job", "-o", job).stdout
        return next((w.split("=", 1)[1] for w in out.split() if w.startswith("JobState=")), "")

    @staticmethod
    def current_job(run: Run) -> str | None:
        """The job of the newest launched attempt (the one the orchestrator follows)."""
        for path in sorted(run.root.glob("attempts/*/launch.json"), key=lambda p: -int(p.parent.name)):
            with contextlib.suppress(OSError, ValueError):
                job = json.loads(path.read_text()).get("job_id")
                if job:
                    return str(job)
        return None

    @classmethod
    def hold_partition(cls, down: bool) -> None:
        """DOWN: nothing new starts (jobs already running go on), so a requeued or resubmitted job waits."""
        state = "DOWN" if down else "UP"
        result = cls.sh("scontrol", "update", f"partitionname={cls.PARTITION}", f"state={state}")
        if result.returncode != 0:
            raise FaultFailed(f"scontrol update partition {state} failed: {(result.stderr or result.stdout).strip()}")

    @classmethod
    def node_state(cls, node: str) -> str:
        return cls.sh("sinfo", "-h", "-N", "-n", node, "-o", "%T").stdout.strip()

    @classmethod
    def step_processes(cls, run_root: Path, node: str) -> list[int]:
        """The processes of this run that Slurm started on `node` (agents, trainers), never slurmstepd."""
        pids = []
        for pid, text in run_processes(run_root).items():
            with contextlib.suppress(OSError):
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if f"SLURMD_NODENAME={node}".encode() in environ and "slurmstepd" not in text:
                    pids.append(pid)
        return sorted(pids)

    @classmethod
    def kill_slurmd(cls, run: Run, node: str) -> str:
        """The node dies: its slurmd is SIGKILLed and the run's processes on it freeze (nothing there answers any
        more) until Slurm declares it DOWN; then it "reboots": slurmd starts again and what was frozen is gone."""
        pid = int((cls.PIDS / f"slurmd-{node}.pid").read_text())
        frozen = cls.step_processes(run.root, node)
        os.kill(pid, signal.SIGKILL)
        for victim in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGSTOP)
        started = time.monotonic()
        try:
            deadline = started + 300
            while not cls.node_state(node).startswith("down"):
                if time.monotonic() > deadline:
                    raise FaultFailed(f"node {node} not DOWN 300 s after its slurmd was killed")
                time.sleep(1)
            down_after = time.monotonic() - started
        finally:
            cls.script("restart-node", node)
            for victim in frozen:  # a rebooted node keeps no process (normally Slurm killed them already)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
        return f"slurmd of {node} killed, {len(frozen)} process(es) frozen; {node} DOWN after {down_after:.0f}s, restarted"

    @classmethod
    def restart_slurmctld(cls, delay_s: float) -> str:
        """Stop slurmctld as its script does (SIGTERM: a SIGKILLed slurmctld loses state it has not saved and can
        resurrect cancelled jobs), leave it down for a while, start it again."""
        pidfile = cls.PIDS / "slurmctld.pid"
        pid = int(pidfile.read_text())
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 120
        while process_alive(pid):
            if time.monotonic() > deadline:
                raise FaultFailed(f"slurmctld {pid} still alive 120 s after SIGTERM")
            time.sleep(0.2)
        time.sleep(delay_s)
        cls.script("start")
        return f"slurmctld {pid} stopped, down {delay_s}s, started again"

    @classmethod
    def repair(cls, run_root: Path) -> None:
        """After a failed run: nothing of it queued, the partition UP, every daemon running and every node up."""
        with contextlib.suppress(Exception):
            cls.hold_partition(False)
        with contextlib.suppress(Exception):
            for job in cls.queue(run_root):
                cls.sh("scancel", job)
        with contextlib.suppress(Exception):
            cls.script("start")


# ------------------------------------------------------------------------------------------------ one run


class FaultFailed(AssertionError):
    """A promise did not hold; the message names the fault(s) and how to replay them."""


class Run:
    """One `cona run` under the fault schedule, restartable with the same command (as a user would)."""

    def __init__(self, root: Path, name: str, extra: tuple[str, ...] = (), backend: str = "local",
                 profile: Path | None = None) -> None:  # fmt: skip
        self.root = root / name
        self.log = root / f"{name}.log"
        self.backend = backend
        self.args = [sys.executable, "-m", "cona.orchestrator.cli", "run", "--profile", str(profile or PROFILES[backend]),
                     "--job", str(JOB), "--run-dir", str(self.root), "--quiet", "--no-report", *settings(), *extra]  # fmt: skip
        self.proc: subprocess.Popen | None = None
        self.after_inject: list[Callable[[], None]] = []
        """What the moment set up and the fault must not outlive (the held partition of `queued`)."""

    def inject_own(self, fault: Fault) -> str | None:
        """A fault kind of this run's backend alone, done, or None for the kinds `inject` does (Kubernetes overrides
        it: `tests/faults_k8s.py`)."""
        return None

    def check_own(self) -> None:
        """What this run's backend promises besides `check_run`'s checks (raises FaultFailed)."""

    def repair(self) -> None:
        """Undo what a failed run may have left in this backend's cluster, so the next run starts clean."""

    timeout_s: float = 300
    """How long a fault's moment may take to come (a Slurm attempt also waits in the queue)."""

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **SECRETS}
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(self.args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    def newest_attempt(self) -> int:
        numbers = [int(p.stem) for p in (self.root / "heartbeats").glob("*.jsonl") if p.stem.isdigit()]
        return max(numbers, default=0)

    def beats(self, attempt: int) -> list[dict[str, Any]]:
        path = self.root / "heartbeats" / f"{attempt}.jsonl"
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def samples(self) -> int:
        """Where the newest attempt stands (after a crash it goes back to its checkpoint)."""
        beats = self.beats(self.newest_attempt())
        return int(beats[-1]["samples"]) if beats else -1

    def ended(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def wait_until(self, condition: Callable[[], bool], *, timeout: float, what: str, poll: float = 0.02) -> bool:
        """Poll `condition`; False when the orchestrator ended first, FaultFailed on time-out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                return True
            if self.ended():
                return False
            time.sleep(poll)
        raise FaultFailed(f"timed out after {timeout:.0f}s waiting for {what}")

    def tail(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-3000:]


def arm(run: Run, fault: Fault, timeout: float) -> str:
    """Wait for `fault`'s moment; returns what it found (for the record). The run's own progress makes each come."""
    # The second fault of a run is armed once the run recovered into its window (samples −1: no heartbeat yet).
    if not run.wait_until(lambda: run.samples() >= fault.window[0], timeout=timeout, what=f"samples {fault.window[0]}"):
        return "run ended first"
    if fault.point == QUEUED:
        return arm_queued(run, fault, timeout)
    if fault.point == "step":
        run.wait_until(lambda: run.samples() >= fault.samples, timeout=timeout, what=f"samples {fault.samples}")
        return f"step at samples {run.samples()}"
    if fault.point == "checkpoint":
        run.wait_until(lambda: run.samples() >= fault.samples, timeout=timeout, what=f"samples {fault.samples}")
        seen = {p.name for p in (run.root / "checkpoints").glob("step-*")}

        def saving() -> bool:  # a new checkpoint directory without its COMPLETE marker yet
            return any(p.name not in seen and not (p / "COMPLETE").exists() for p in (run.root / "checkpoints").glob("step-*"))

        run.wait_until(saving, timeout=timeout, what="a checkpoint save", poll=0.005)
        return f"checkpoint save at samples {run.samples()}"
    if fault.point == "decision":
        # The trainer holds at the switch point until the orchestrator decides: the decision is under way.
        def holding() -> bool:
            beats = run.beats(run.newest_attempt())
            return bool(beats) and beats[-1].get("event") == "hold" and beats[-1]["samples"] >= fault.samples

        run.wait_until(holding, timeout=timeout, what=f"the hold at switch point {fault.samples}")
        return f"decision at samples {run.samples()}"
    # switch: the orchestrator offered the next attempt (its launch record): the in-place switch is under way
    current = run.newest_attempt()

    def offered() -> bool:
        beats = run.beats(run.newest_attempt())
        at_point = bool(beats) and beats[-1]["samples"] >= fault.samples
        return at_point and (run.root / "attempts" / str(run.newest_attempt() + 1) / "launch.json").exists()

    run.wait_until(offered, timeout=timeout, what=f"the switch at point {fault.samples} (attempt {current})")
    return f"switch to attempt {run.newest_attempt() + 1} at samples {run.samples()}"


def arm_queued(run: Run, fault: Fault, timeout: float) -> str:
    """Slurm: past the drawn sample, hold the partition DOWN and requeue the job, and wait until it is PENDING;
    the partition comes back UP right after the fault (`Run.after_inject`), so the attempt starts again then."""
    if not run.wait_until(lambda: run.samples() >= fault.samples and SlurmCluster.current_job(run) is not None,
                          timeout=timeout, what=f"samples {fault.samples}"):  # fmt: skip
        return "run ended first"
    job = SlurmCluster.current_job(run)
    assert job is not None
    SlurmCluster.hold_partition(True)
    run.after_inject.append(lambda: SlurmCluster.hold_partition(False))
    requeue = SlurmCluster.sh("scontrol", "requeue", job)
    if requeue.returncode != 0:  # the job ended meanwhile (between attempts): a resubmission will queue instead
        job_now = lambda: SlurmCluster.current_job(run)  # noqa: E731
        run.wait_until(lambda: job_now() not in (None, job), timeout=timeout, what=f"a job after {job}")
        job = job_now()
        assert job is not None
    run.wait_until(lambda: SlurmCluster.job_state(job) == "PENDING", timeout=timeout, what=f"job {job} PENDING")
    return f"job {job} queued (partition held DOWN) at samples {run.samples()}"


def inject(run: Run, fault: Fault) -> str:
    """Do it; returns what was hit."""
    if (own := run.inject_own(fault)) is not None:
        return own
    if fault.kind == "orchestrator-kill":
        assert run.proc is not None
        run.proc.send_signal(signal.SIGKILL)
        run.proc.wait()
        time.sleep(fault.delay_s)
        run.start()  # the same command again: it adopts the attempt or relaunches it
        return f"orchestrator {run.proc.pid} killed, restarted after {fault.delay_s}s"
    if fault.kind == "torchrun-kill":
        pids = torchrun(run.root)
        if not pids:
            return "no torchrun running (between attempts)"
        os.kill(pids[0], signal.SIGKILL)
        return f"torchrun {pids[0]} killed"
    pids = workers(run.root)
    if not pids:
        return "no worker running (between attempts)"
    if fault.kind in ("preempt-term", "preempt-usr1"):
        # As Slurm and Kubernetes do: every process of the job gets the signal.
        sig = signal.SIGTERM if fault.kind == "preempt-term" else signal.SIGUSR1
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # it may have exited meanwhile
                os.kill(pid, sig)
        return f"{sig.name} to workers {pids}"
    victim = pids[fault.victim % len(pids)]
    os.kill(victim, signal.SIGKILL if fault.kind == "worker-kill" else signal.SIGSTOP)
    return f"{'SIGKILL' if fault.kind == 'worker-kill' else 'SIGSTOP'} to worker {victim}"


def inject_slurm(run: Run, fault: Fault) -> str:
    """The cluster's faults, and preemption as Slurm delivers it (a worker, torchrun or the orchestrator killed
    is the same on every backend)."""
    if fault.kind == "slurmctld-restart":
        # Longer than the local orchestrator-kill's pause: several of the orchestrator's polls must meet it.
        return SlurmCluster.restart_slurmctld(fault.delay_s * 4)
    if fault.kind == "slurmd-kill":
        return SlurmCluster.kill_slurmd(run, ("n1", "n2")[fault.victim % 2])
    job = SlurmCluster.current_job(run)
    if job is None:
        return "no job submitted yet"
    argv = {
        "scancel": ["scancel", job],
        "requeue": ["scontrol", "requeue", job],
        # A preemption that signals (PreemptMode=CANCEL's grace time): SIGTERM to every process of the job.
        "preempt-term": ["scancel", "--full", "--signal=TERM", job],
        # The pre-timeout signal (`--signal=B:USR1@N`): to the batch shell, which forwards it to the step.
        "preempt-usr1": ["scancel", "--batch", "--signal=USR1", job],
    }[fault.kind]
    result = SlurmCluster.sh(*argv)
    said = (result.stderr or result.stdout).strip()
    return f"`{' '.join(argv)}` ({SlurmCluster.job_state(job) or 'gone'}{'; ' + said if said else ''})"


# ------------------------------------------------------------------------------------------------ checks


def final_parameters(run_root: Path) -> dict[str, Any]:
    from cona.protocol.rundir import RunDir
    from cona.trainer.checkpoint import read_checkpoint_tensors

    latest = RunDir(run_root).latest_checkpoint()
    if latest is None:
        raise FaultFailed(f"{run_root}: no complete checkpoint at the end")
    return {k: v for k, v in read_checkpoint_tensors(latest).items() if k.startswith("model.")}


def layout_sequence(run_root: Path) -> list[tuple[int, str]]:
    """[(first sample, strategy)] of the surviving training history, merged where the strategy stays; raises
    FaultFailed unless the samples log is exactly 0 … N−1 in order."""
    from cona.protocol.rundir import RunDir
    from cona.protocol.samples_log import SamplesAuditError, audit_samples

    run_dir = RunDir(run_root)
    try:
        ranges = audit_samples(run_dir)
    except SamplesAuditError as e:
        raise FaultFailed(f"samples audit: {e}") from None
    if not ranges or ranges[0][0] != 0 or any(a[1] != b[0] for a, b in itertools.pairwise(ranges)):
        raise FaultFailed(f"samples are not 0 … N−1 in order: {ranges[:3]} … {ranges[-3:]}")
    if ranges[-1][1] < MAX_SAMPLES:
        raise FaultFailed(f"the run ended at samples {ranges[-1][1]} < {MAX_SAMPLES}")
    owner: dict[tuple[int, int], int] = {}  # a range re-trained after a crash belongs to the newest attempt
    for path in sorted(run_dir.samples_log.glob("*.jsonl"), key=lambda p: int(p.stem)):
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "start" in record:
                owner[(record["start"], record["end"])] = int(path.stem)
    sequence: list[tuple[int, str]] = []
    for start, end in ranges:
        launch = run_dir.read_launch(owner[(start, end)])
        strategy = launch.strategy.short() if launch else "?"
        if not sequence or sequence[-1][1] != strategy:
            sequence.append((start, strategy))
    return sequence


def check_run(run: Run, reference: tuple[list[tuple[int, str]], dict[str, Any]]) -> str:
    """Every promise for one finished run; returns a one-line summary, raises FaultFailed otherwise."""
    import torch

    assert run.proc is not None
    if run.proc.returncode != 0:
        raise FaultFailed(f"cona run exited {run.proc.returncode}\n{run.tail()}")
    status = subprocess.run([sys.executable, "-m", "cona.orchestrator.cli", "status", "--json", str(run.root)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)  # fmt: skip
    try:
        said = json.loads(status.stdout).get("status")
    except json.JSONDecodeError:
        said = status.stdout + status.stderr
    if said != "done":
        raise FaultFailed(f"`cona status` says {said!r}, not 'done'")
    sequence = layout_sequence(run.root)
    ref_sequence, ref_params = reference
    params = final_parameters(run.root)
    if params.keys() != ref_params.keys():
        raise FaultFailed("the final checkpoint holds other tensors than the uninterrupted run's")
    same_layouts = sequence == ref_sequence
    worst = max(float((params[k].double() - ref_params[k].double()).abs().max()) for k in params)
    if same_layouts and not all(torch.equal(params[k], ref_params[k]) for k in params):
        raise FaultFailed(f"same strategies over the same samples as the uninterrupted run ({sequence}), but the "
                          f"parameters differ (max |Δ| {worst:.3g}); expected bit-identical")  # fmt: skip
    if not same_layouts and worst > 1e-5:
        raise FaultFailed(f"parameters differ by {worst:.3g} > 1e-5; strategies {sequence} vs {ref_sequence}")
    check_files(run)
    run.check_own()
    deadline = time.monotonic() + 60
    while (left := run_processes(run.root)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        raise FaultFailed(f"processes left after the run: {left}")
    return f"{'bit-identical' if same_layouts else f'max |Δ| {worst:.2g}'}, layouts {sequence}"


def check_files(run: Run) -> None:
    """No file of the run is world-writable, and no secret of the environment is in one or in the output."""
    for path in [run.root, *run.root.rglob("*"), run.log]:
        if path.is_symlink() or not path.exists():
            continue
        if path.stat().st_mode & 0o002:
            raise FaultFailed(f"{path} is world-writable ({oct(path.stat().st_mode)})")
        if path.is_file():
            data = path.read_bytes()
            for name, secret in SECRETS.items():
                if secret.encode() in data:
                    raise FaultFailed(f"{path} holds the value of ${name}")


class SlurmRun(Run):
    """A run on the local Slurm cluster: the cluster's own faults, and preemption as Slurm delivers it."""

    timeout_s = 600

    def __init__(self, root: Path, name: str, extra: tuple[str, ...] = ()) -> None:
        super().__init__(root, name, extra, backend="slurm")

    def inject_own(self, fault: Fault) -> str | None:
        if fault.kind in (*SLURM_KINDS, "preempt-term", "preempt-usr1"):
            return inject_slurm(self, fault)
        return None

    def check_own(self) -> None:
        # An idle allocation is cancelled at the end of the run; give Slurm time to finish it.
        deadline = time.monotonic() + 120
        while (queued := SlurmCluster.queue(self.root)) and time.monotonic() < deadline:
            time.sleep(1)
        if queued:
            raise FaultFailed(f"jobs of the run still in squeue after it ended: {queued}")

    def repair(self) -> None:
        SlurmCluster.repair(self.root)


def make_run(root: Path, name: str, extra: tuple[str, ...] = (), backend: str = "local") -> Run:
    """The Run of `backend` for the backends that need only a profile (Kubernetes has its own: tests/faults_k8s.py)."""
    if backend == "slurm":
        return SlurmRun(root, name, extra)
    return Run(root, name, extra, backend)


def reference_run(
    root: Path, name: str = "reference", extra: tuple[str, ...] = (), backend: str = "local"
) -> tuple[list[tuple[int, str]], dict[str, Any]]:  # fmt: skip
    """The uninterrupted run (cached under `root`, so one suite pays for it once); `extra`: more `cona run` flags."""
    root.mkdir(parents=True, exist_ok=True)
    run = make_run(root, name, extra, backend)
    if not (run.root / "state.json").exists() or json.loads((run.root / "state.json").read_text()).get("status") != "done":
        run.start()
        assert run.proc is not None
        if run.proc.wait(timeout=900) != 0:
            raise FaultFailed(f"the uninterrupted reference run failed\n{run.tail()}")
        check_files(run)
    return layout_sequence(run.root), final_parameters(run.root)


# ------------------------------------------------------------------------------------------------ the suite


@dataclasses.dataclass
class Result:
    fault: Fault
    hit: str = ""
    outcome: str = ""
    ok: bool = False


def run_group(
    root: Path, faults: list[Fault], reference: Any, *, seed: int, timeout: float | None = None,
    extra: tuple[str, ...] = (), backend: str = "local", new_run: Callable[[Path, str], Run] | None = None,
) -> list[Result]:  # fmt: skip
    """One run with `faults` (in window order), checked at the end; `timeout`: for each fault's moment (default: the
    backend's); `extra`: more `cona run` flags; `new_run`: the Run of a backend that needs more than a profile
    (Kubernetes: its emulated cluster)."""
    # The backend in the name: a suite (the CI one) may run both backends' faults of the same numbers in one root.
    name = ("" if backend == "local" else f"{backend}-") + "run-" + "-".join(str(f.index) for f in faults)
    run = new_run(root, name) if new_run is not None else make_run(root, name, extra, backend)
    timeout = run.timeout_s if timeout is None else timeout
    results = [Result(f) for f in faults]
    run.start()
    try:
        for result in results:
            where = arm(run, result.fault, timeout)
            try:
                result.hit = f"{where}: {inject(run, result.fault)}"
            finally:
                while run.after_inject:
                    run.after_inject.pop()()
            print(f"  {result.fault.describe()} → {result.hit}", flush=True)
        assert run.proc is not None
        try:
            run.proc.wait(timeout=900)
        except subprocess.TimeoutExpired:
            raise FaultFailed(f"cona run did not finish in 900 s\n{run.tail()}") from None
        summary = check_run(run, reference)
        for result in results:
            result.ok, result.outcome = True, summary
    except FaultFailed as e:
        flag = "" if backend == "local" else f" --backend {backend}"
        replay = " ; ".join(f"python -m tests.faults --seed {seed}{flag} --fault {r.fault.index}" for r in results)
        for result in results:
            result.outcome = f"FAILED: {e}\n  replay: {replay}\n  run directory: {run.root}"
    finally:
        while run.after_inject:  # a moment armed but never used (the run failed first)
            with contextlib.suppress(Exception):
                run.after_inject.pop()()
        if run.proc is not None and run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()
        run.repair()
        for pid in run_processes(run.root):  # a failed run must not leave processes for the next one
            with contextlib.suppress(ProcessLookupError):  # it may have exited meanwhile
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
    return results


def groups(faults: list[Fault]) -> dict[int, list[Fault]]:
    """The runs of `faults`: faults 2k and 2k + 1 share run k, in window order."""
    runs: dict[int, list[Fault]] = {}
    for fault in sorted(faults, key=lambda f: f.index):
        runs.setdefault(fault.index // 2, []).append(fault)
    return runs


def run_suite(*, seed: int, indices: list[int], kinds: tuple[str, ...], root: Path, backend: str = "local") -> list[Result]:
    faults = [draw(seed, i, kinds, backend) for i in indices]
    reference = reference_run(root, backend=backend)
    results = []
    for number, group in sorted(groups(faults).items()):
        print(f"run {number}: {', '.join(f.describe() for f in group)}", flush=True)
        results += run_group(root, group, reference, seed=seed, backend=backend)
        print(f"  → {results[-1].outcome.splitlines()[0]}", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=4, help="how many faults (two to a run)")
    parser.add_argument("--fault", type=int, action="append", help="replay these fault numbers of --seed alone")
    parser.add_argument("--backend", default="local", choices=list(BACKEND_KINDS),
                        help="slurm: the local cluster of slurm/local-cluster.sh; kubernetes: the API emulator of "
                             "tests/k8s_emulator.py (tests/faults_k8s.py)")  # fmt: skip
    parser.add_argument("--kinds", nargs="+", metavar="KIND",
                        help=f"fault kinds to draw from (default: all of the backend's; local: {', '.join(KINDS)}; "
                             f"slurm: these and {', '.join(SLURM_KINDS)}; kubernetes: the local ones and "
                             f"{', '.join(K8S_KINDS)})")  # fmt: skip
    parser.add_argument("--out", type=Path, help="where the runs go (default: a new temporary directory)")
    args = parser.parse_args(argv)
    valid = BACKEND_KINDS[args.backend]
    kinds = tuple(args.kinds or valid)
    unknown = sorted(set(kinds) - set(valid))
    if unknown:
        print(f"python -m tests.faults: error: --kinds {', '.join(unknown)}: not a {args.backend} fault kind; valid: "
              f"{', '.join(valid)}", file=sys.stderr)  # fmt: skip
        return 2
    if args.backend == "slurm" and (problem := SlurmCluster.problem()):
        print(f"python -m tests.faults: error: --backend slurm: {problem}", file=sys.stderr)
        return 2
    if args.count < 1:
        print("python -m tests.faults: error: --count must be at least 1", file=sys.stderr)
        return 2
    root = args.out or Path(tempfile.mkdtemp(prefix="cona-faults-"))
    root.mkdir(parents=True, exist_ok=True)
    indices = args.fault or list(range(args.count))
    started = time.monotonic()
    if args.backend == "kubernetes":
        from tests import faults_k8s  # it builds on this module

        results = faults_k8s.run_suite(seed=args.seed, indices=indices, kinds=kinds, root=root)
    else:
        results = run_suite(seed=args.seed, indices=indices, kinds=kinds, root=root, backend=args.backend)
    failed = [r for r in results if not r.ok]
    print(f"\nseed {args.seed} ({args.backend}): {len(results) - len(failed)} of {len(results)} faults passed in "
          f"{time.monotonic() - started:.0f} s (runs in {root})")  # fmt: skip
    for r in failed:
        print(f"{r.fault.describe()} [{r.hit}]: {r.outcome}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
