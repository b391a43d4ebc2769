"""The local backend: `torchrun --standalone` on this machine (CPU + gloo when there is no GPU).

Each launch runs in its own process session under a tiny shell wrapper that records torchrun's exit code in
`attempts/<n>/exit_code`, so an orchestrator that was killed and restarted can still tell how the attempt ended.
An in-place switch keeps the processes: the next attempt is the same process group, and its exit code lands in the
directory of the attempt that launched it (`extra.launched_as`).

Elastic runs (`min_nodes` < `nodes`; the machine described as `nodes` × `gpus_per_node`, e.g. 2 × 2 for 4 GPUs):
the devices the machine has now are the profile's, unless the run directory's `devices` file says fewer (one
integer: `echo 2 > runs/<name>/devices` when two GPUs are taken away, `rm` it when they are back). It is read at
each launch and poll: fewer devices than the attempt runs on end it as lost (`Outcome.lost_nodes`, whole nodes of
`gpus_per_node` devices), the scheduler replans and relaunches the table's strategy for what is left, and
`available_nodes` lets the run grow back when the devices return and the policy says it pays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from cona.orchestrator.backends.base import Attempt, AttemptStatus, Backend, BackendError, Outcome
from cona.orchestrator.backends.crashcause import crash_cause
from cona.orchestrator.elastic import is_elastic, node_range, nodes_of, table_choice
from cona.orchestrator.job import Job
from cona.orchestrator.profile import ClusterProfile
from cona.protocol import procstat
from cona.protocol.rundir import RunDir, open_regular
from cona.protocol.strategy import Strategy

EXIT_CODE_FILE = "exit_code"
DEVICES_FILE = "devices"
"""In the run directory: how many devices an elastic run has now, when fewer than the profile's (one integer)."""
PROCESSES_PER_CPU = 2
"""Trainer processes a CPU of this machine carries before the backend warns. Not 1: the shipped `local-cpu` profile
runs 4 processes on the 2-core machine it was measured on (docs/benchmarks.md), a load cona trains at as planned, and
a warning on every default run would teach users to ignore it. Far beyond it, e.g. a profile that emulates 4 nodes
× 32 devices (128 processes on one machine), every collective waits on processes the kernel has not scheduled, each
process holds its own torch and model in the machine's one memory, and the profile's nodes describe machines that
are not there: the step times the planner expects are out of reach."""
CPU_PROCESS_RUNTIME_BYTES = 2**29
"""What a CPU trainer process holds besides what the memory model counts (torch, gloo, the corpus's index): its
heartbeats report a peak resident set of 0.33-0.36 GB before and after the first step of the tiny presets; half a GiB
with room to spare."""


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (a container's cpuset, `taskset`), which `os.cpu_count()`
    ignores; all of the machine's where the platform has no affinity."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def visible_gpus(dev: Path = Path("/dev")) -> int | None:
    """The NVIDIA GPUs a process started here would see, or None when this machine's count is unknown.

    Read without torch (the orchestrator never imports it): the device nodes `/dev/nvidia0`, `/dev/nvidia1`, ...
    (a container gets only its own), narrowed by `CUDA_VISIBLE_DEVICES` as CUDA narrows them (the list ends at its
    first negative entry). None without any device node: no NVIDIA driver, or another vendor's (ROCm), which cona
    cannot count here, so it says nothing rather than something wrong."""
    nodes = [entry for entry in dev.glob("nvidia[0-9]*") if entry.name[6:].isdigit()]
    if not nodes:
        return None
    count = len(nodes)
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        visible = 0
        for item in listed.split(","):
            item = item.strip()
            if not item or (item.lstrip("-").isdigit() and int(item) < 0):
                break
            visible += 1
        count = min(count, visible)
    return count


def machine_memory_bytes() -> int | None:
    """The memory of this machine the trainer processes share: its RAM, or the container's cgroup limit when lower
    (`memory.max`, cgroup v2); None where the platform does not say."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        limit = "max"
    return min(total, int(limit)) if limit.isdigit() else total


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, ...), from /proc's parent links."""
    children = procstat.children()
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class LocalBackend(Backend):
    """Runs each attempt as `torchrun --standalone --nproc-per-node=dp·tp·pp -m cona.trainer` on this machine."""

    name = "local"

    def __init__(
        self, *, run_dir: RunDir, profile: ClusterProfile | None = None, job: Job | None = None,
        python: str | None = None, extra_env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        # Absolute: the wrapper runs in the run directory, so a relative path (the default `runs/<name>`) would point
        # elsewhere there and the exit code would be lost.
        super().__init__(run_dir=RunDir(Path(run_dir.root).resolve()), profile=profile, job=job)
        self.python = python or sys.executable
        self.extra_env = dict(extra_env or {})
        self._children: dict[int, subprocess.Popen] = {}
        self._warned_processes: dict[str, int] = {}
        """The most processes `_warn_if_crowded` has warned about, per kind of warning: said once, not at every
        relaunch."""

    @property
    def elastic(self) -> bool:
        """Whether the run may train on fewer nodes than the profile's `nodes` (`min_nodes` below it)."""
        return self.profile is not None and is_elastic(self.profile)

    def devices(self) -> int:
        """The devices this machine offers the run now: the run directory's `devices` file, else the profile's."""
        assert self.profile is not None
        path = self.run_dir.root / DEVICES_FILE
        try:
            with open_regular(path) as file:
                text = file.read().decode(errors="replace").strip()
        except FileNotFoundError:
            return self.profile.num_gpus
        except OSError as e:
            raise BackendError(f"{path}: cannot be read ({e.strerror}); write the number of devices there or remove it") from None
        try:
            count = int(text)
            if count < 0:
                raise ValueError
        except ValueError:
            raise BackendError(f"{path}: {text[:40]!r} is not a device count; write one integer (0 to "
                               f"{self.profile.num_gpus}) or remove the file") from None  # fmt: skip
        return min(count, self.profile.num_gpus)

    def available_nodes(self, attempt: Attempt) -> int | None:
        """Whole nodes of `gpus_per_node` among the devices there are now (`devices`)."""
        if not self.elastic:
            return None
        assert self.profile is not None
        return self.devices() // self.profile.gpus_per_node

    def command(self, *, attempt: int, strategy: Strategy) -> list[str]:
        return [
            self.python, "-m", "torch.distributed.run",
            "--standalone", "--nnodes=1", f"--nproc-per-node={strategy.world_size}", "--max-restarts=0",
            "-m", "cona.trainer", "--run-dir", str(self.run_dir.root.resolve()), "--attempt", str(attempt),
        ]  # fmt: skip

    def wrapper(self, *, attempt: int, strategy: Strategy) -> str:
        """The shell command of one attempt: torchrun, then its exit code written atomically to `exit_code`, so an
        orchestrator that restarted meanwhile can still tell how the attempt ended."""
        exit_file = shlex.quote(str(self.run_dir.attempt_dir(attempt) / EXIT_CODE_FILE))
        cmd = shlex.join(self.command(attempt=attempt, strategy=strategy))
        return f"{cmd}; rc=$?; echo $rc > {exit_file}.tmp && mv {exit_file}.tmp {exit_file}; exit $rc"

    def _warn_if_crowded(self, strategy: Strategy) -> None:
        """One stderr line for each way `strategy` asks more of this machine than it has: all its processes run
        here, whatever nodes the profile describes. A warning, not a refusal (a test may want exactly that load),
        each said once per process count, not at every relaunch:

        - more processes than `PROCESSES_PER_CPU` per CPU: they train far slower than planned;
        - on `cuda`, more processes than the GPUs this machine shows (`visible_gpus`): process k takes GPU k, so
          the ones past the last GPU fail to start;
        - on `cpu`, processes × what each will hold (`_cpu_process_bytes`) above this machine's memory
          (`machine_memory_bytes`): the planner lets each process fill `accelerator.memory`, so a strategy it calls
          feasible can run the machine out of memory."""
        processes = strategy.world_size
        layout = ""
        if self.profile is not None:
            layout = f" (the profile's nodes × gpus_per_node, {self.profile.nodes} × {self.profile.gpus_per_node}, all run here)"
        cpus = usable_cpus()
        if processes > PROCESSES_PER_CPU * cpus:
            self._warn_once("cpus", processes, f"the local backend starts {processes} trainer processes on this one "
                            f"machine, which has {cpus} CPU(s) for them, more than {PROCESSES_PER_CPU} per CPU{layout}; "
                            "they train far slower than planned: lower nodes or gpus_per_node in the profile to what "
                            "this machine has")  # fmt: skip
        if self.profile is None:
            return
        accelerator = self.profile.accelerator
        if accelerator.device == "cuda":
            gpus = visible_gpus()
            if gpus is not None and processes > gpus:
                self._warn_once("gpus", processes, f"the local backend starts {processes} trainer processes on this "
                                f"one machine, which shows {gpus} GPU(s){layout}; process k takes GPU k, so the ones "
                                "without a GPU fail: lower nodes or gpus_per_node in the profile to the GPUs this "
                                "machine has (CUDA_VISIBLE_DEVICES counts)")  # fmt: skip
        else:
            memory = machine_memory_bytes()
            need, what = self._cpu_process_bytes(strategy)
            if memory is not None and processes * need > memory:
                self._warn_once("memory", processes, f"the local backend starts {processes} trainer processes on the "
                                f"CPU, each {what} ({processes * need / 2**30:.1f} GiB in all), but this machine has "
                                f"{memory / 2**30:.1f} GiB; the planner's memory check cannot keep them in it: lower "
                                "accelerator.memory to this machine's memory divided by the processes, or lower "
                                "gpus_per_node")  # fmt: skip

    def _cpu_process_bytes(self, strategy: Strategy) -> tuple[int, str]:
        """What one CPU trainer process of `strategy` will hold, and how the warning says where that comes from: the
        memory model's peak plus the runtime when the job is known and the cost model prices the strategy, else all
        the planner lets it have (`accelerator.memory`). Not the cap alone: on `local-cpu` (4 GiB per process) every
        default run on a machine under 16 GiB would warn, for a model of megabytes."""
        assert self.profile is not None
        accelerator = self.profile.accelerator
        cap = (accelerator.memory_bytes, f"planned to use up to accelerator.memory={accelerator.memory!r}")
        if self.job is None:
            return cap
        from cona.orchestrator.costmodel import predict

        try:
            peak = predict(profile=self.profile, job=self.job, dp=strategy.dp, tp=strategy.tp, pp=strategy.pp,
                           mbs=strategy.mbs, gbs=strategy.gbs).memory_bytes  # fmt: skip
        except ValueError:  # a strategy the cost model cannot price is refused elsewhere, with its reason
            return cap
        if not math.isfinite(peak):
            return cap
        need = int(peak) + CPU_PROCESS_RUNTIME_BYTES
        return need, (f"predicted to need {need / 2**30:.2f} GiB (the memory model's peak for {strategy.short()} and "
                      f"{CPU_PROCESS_RUNTIME_BYTES / 2**30:.1f} GiB of runtime)")  # fmt: skip

    def _warn_once(self, kind: str, processes: int, message: str) -> None:
        """Print `cona: warning: <message>` unless this kind was said already for as many processes or more."""
        if processes <= self._warned_processes.get(kind, 0):
            return
        self._warned_processes[kind] = processes
        print(f"cona: warning: {message}", file=sys.stderr, flush=True)

    def render(self, *, strategy: Strategy) -> str:
        self._warn_if_crowded(strategy)
        env = self.profile.env if self.profile is not None else {}
        header = ("# cona local backend: each attempt runs in its own session, from the run directory, with\n"
                  "# OMP_NUM_THREADS=1 (unless set) and PYTHONUNBUFFERED=1")  # fmt: skip
        if env:  # one per line, as `export` would take it
            header += ", and the profile's env:\n" + "".join(f"#   {k}={shlex.quote(v)}\n" for k, v in env.items())
            header += "# The first attempt would be:\n"
        else:
            header += "; the first attempt would be:\n"
        return f"{header}{self.wrapper(attempt=1, strategy=strategy)}\n"

    def launch(
        self, *, attempt: int, strategy: Strategy, previous: Attempt | None = None,
        elastic: dict[int, Strategy] | None = None,
    ) -> Attempt:  # fmt: skip
        planned = strategy
        if elastic and len(elastic) > 1 and self.elastic:
            # The table's strategy for the whole nodes there are devices for; the smallest when there are fewer
            # (nothing smaller is planned: a worker without its device crashes, and the run retries as after any).
            strategy = table_choice(elastic, self.available_nodes(Attempt(number=attempt, strategy=strategy)) or 0)
        self._warn_if_crowded(strategy)
        attempt_dir = self.run_dir.attempt_dir(attempt)
        attempt_dir.mkdir(parents=True, exist_ok=True)
        self.write_launch(attempt, strategy)
        (attempt_dir / EXIT_CODE_FILE).unlink(missing_ok=True)
        log = attempt_dir / "torchrun.log"
        # The wrapper outlives an orchestrator restart.
        wrapper = self.wrapper(attempt=attempt, strategy=strategy)
        env = {**os.environ, **self.extra_env, **(self.profile.env if self.profile is not None else {})}
        # Two cores shared by several processes: one thread each avoids oversubscription.
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONUNBUFFERED"] = "1"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["/bin/sh", "-c", wrapper], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True, cwd=str(self.run_dir.root),
            )  # fmt: skip
        self._children[proc.pid] = proc
        # The scheduler knows the attempt by the strategy it planned; `poll` reports the one it runs.
        chosen = Attempt.started_as(strategy, planned)
        return Attempt(
            number=attempt,
            strategy=planned,
            backend_id=str(proc.pid),
            started_at=time.time(),
            # The host: its PID and start time mean something only in this machine's process table (`gone`).
            extra={"start_time": procstat.start_time(proc.pid), "host": socket.gethostname(), "log": str(log), **chosen},
        )

    supports_in_place_switch = True
    # Measured by `python -m benchmarks.switch` (docs/benchmarks.md) with 4 processes on 2 cores: in place, the
    # exit record, barrier, release and rebuild plus DCP's fixed cost took about 1 s beyond moving the bytes; a
    # relaunch spent about 2 s tearing torchrun down and 5.5 s starting, importing and meeting at the rendezvous.
    in_place_overhead_s = 1.0
    relaunch_overhead_s = 8.0

    def continued(self, attempt: Attempt, *, number: int, strategy: Strategy) -> Attempt:
        # Same processes: the exit code and log stay in the directory of the attempt that launched them.
        extra = {**attempt.extra, "launched_as": attempt.extra.get("launched_as", attempt.number)}
        return Attempt(number=number, strategy=strategy, backend_id=attempt.backend_id, started_at=time.time(),
                       extra=extra)  # fmt: skip

    def _reap(self, pid: int) -> None:
        child = self._children.get(pid)
        if child is not None and child.poll() is not None:
            self._children.pop(pid, None)

    def _ours_and_alive(self, attempt: Attempt) -> bool:
        pid = int(attempt.backend_id)
        self._reap(pid)
        if not procstat.alive(pid):
            return False
        recorded = attempt.extra.get("start_time")
        return recorded is None or recorded == procstat.start_time(pid)

    def crash_logs(self, attempt: Attempt) -> list[Path]:
        """torchrun's output, in the directory of the attempt that started the processes."""
        return [self._launched_dir(attempt) / "torchrun.log"]

    def _launched_dir(self, attempt: Attempt) -> Path:
        """The directory of the attempt that started `attempt`'s processes (`launched_as`: itself, or the attempt
        it went on from in place), where their log and exit code lie."""
        return self.run_dir.attempt_dir(int(attempt.extra.get("launched_as", attempt.number)))

    def gone(self, attempt: Attempt) -> bool:
        """Whether the attempt's wrapper process is gone (or its PID now another process's): torchrun and its workers
        end before it. Not told for an attempt launched on another machine (a `cona status` from another host of a
        shared filesystem), where this machine's process table says nothing of it."""
        host = attempt.extra.get("host")
        if (host is not None and host != socket.gethostname()) or not attempt.backend_id.isdigit():
            return False
        return not self._ours_and_alive(attempt)

    def _stray_workers(self) -> list[int]:
        """Trainer processes of this run directory that outlived their torchrun (killed outright)."""
        marker = f"--run-dir\0{self.run_dir.root.resolve()}\0".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    argv = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if marker in argv and b"cona.trainer" in argv and b"torch.distributed.run" not in argv and procstat.alive(int(entry.name)):
                    found.append(int(entry.name))
        return found

    def _lost(self, strategy: Strategy) -> tuple[tuple[str, ...], str]:
        """An elastic run's nodes whose devices are gone (the `devices` file says fewer than `strategy` runs on),
        each named by its devices, and why. An attempt on `min_nodes` has nowhere smaller to go: it goes on (a
        device really gone makes it crash, handled as any crash), rather than being relaunched as it is, again."""
        if not self.elastic:
            return (), ""
        assert self.profile is not None
        per_node = self.profile.gpus_per_node
        have = self.devices()
        if have >= strategy.world_size or nodes_of(strategy, self.profile) <= node_range(self.profile)[0]:
            return (), ""
        nodes = -(-strategy.world_size // per_node)
        left = have // per_node
        lost = tuple(f"devices {n * per_node}-{(n + 1) * per_node - 1}" for n in range(left, nodes))
        return lost, f"{DEVICES_FILE} file: {have} device(s), the attempt runs on {strategy.world_size}"

    def poll(self, attempt: Attempt) -> Outcome:
        running = attempt.running
        outcome = self._poll(attempt)
        if not outcome.status.finished or outcome.status is AttemptStatus.CRASHED:
            lost, why = self._lost(running)
            if lost:
                outcome = dataclasses.replace(outcome, lost_nodes=lost, detail=why)
        if running != attempt.strategy:
            outcome = dataclasses.replace(outcome, strategy=running)
        return outcome

    def _poll(self, attempt: Attempt) -> Outcome:
        if self._ours_and_alive(attempt):
            return Outcome(AttemptStatus.RUNNING)
        # Never report an attempt ended while a worker of it still trains: the next launch would run beside it.
        # (The trainer asks to die with torchrun; this is for a kernel or launcher that does not.)
        deadline = time.time() + 15
        while (strays := self._stray_workers()) and time.time() < deadline:
            for pid in strays:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
        launched = self._launched_dir(attempt)
        cause = functools.partial(crash_cause, self.run_dir, attempt.number, self.crash_logs(attempt))
        try:
            with open_regular(launched / EXIT_CODE_FILE) as file:
                code = int(file.read().strip())
        except (OSError, ValueError):
            said = cause()
            return Outcome(AttemptStatus.CRASHED, None, "the attempt's processes are gone without an exit code"
                           + (f" ({said})" if said else ""))  # fmt: skip
        # torchrun exits 1 whatever protocol code its workers returned, and 0 for a `--max-steps` stop; rank 0
        # recorded the real one.
        outcome = Outcome.of_exit(self.run_dir.attempt_exit_code(attempt.number, code), who="torchrun")
        if outcome.status is AttemptStatus.CRASHED and (said := cause()):
            # "torchrun exited 1" alone: which rank died of what is in the attempt's log, far from the crash line.
            outcome = dataclasses.replace(outcome, detail=f"{said} (torchrun exited {code})")
        return outcome

    def cancel(self, attempt: Attempt) -> None:
        pid = int(attempt.backend_id)
        if not self._ours_and_alive(attempt):
            return
        # torchrun starts each worker in a session of its own, so signalling the wrapper's group reaches the shell
        # and torchrun only. Note the workers first: once torchrun is gone they belong to init, and a worker stuck
        # in a collective (a hang is why most cancels happen) ignores the SIGTERM that torchrun forwards.
        tree = {p: procstat.start_time(p) for p in _descendants(pid)}

        def still_ours(p: int) -> bool:  # alive, and not a new process that got a recycled PID
            return procstat.alive(p) and procstat.start_time(p) == tree[p]

        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.time() + 15
        while time.time() < deadline and (self._ours_and_alive(attempt) or any(map(still_ours, tree))):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        for worker in filter(still_ours, tree):
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        self._reap(pid)
