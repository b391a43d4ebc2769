"""Commands from the orchestrator (control.json) and from the cluster (SIGTERM, SIGUSR1). Torch-free.

Rank 0 polls control.json once per step; a record whose `seq` is above the last handled one is acted on once.
Every rank's signal handler only sets a flag. The decision is encoded as small numbers that ride on the step's
statistics all-reduce (a SUM): rank 0 contributes the command code, every rank its signal flag, so all ranks agree
on the same step without an extra collective. The trainer stores the last handled seq in trainer_state.json so a
relaunch does not act on an old record again.

Python runs a signal handler only between bytecodes of the main thread, so a rank blocked in a collective that never
completes — a peer died, and the survivors wait on each other in mismatched collectives — never sees its SIGTERM,
and torchrun, which sends it to the survivors of a failed worker, waits its 30 s grace before it kills them. So
under torchrun a thread watches for the signal (`signal.set_wakeup_fd` wakes it while the main thread is blocked):
once SIGTERM has come, a trainer process of this node that is gone means the world is broken — no collective of the
graceful stop can complete — and the rank exits at once (`LocalPeers`). A preemption, which signals live ranks, is
not touched: they checkpoint and exit STOPPED as before. Exiting there never makes a checkpoint look whole: the
COMPLETE marker is written by rank 0 only after every rank has agreed that its shards are written. A peer on another
node, or a hung one, is not seen here: the collective then fails (at once, or after `parallel.collective_timeout_s`)
and the rank ends as a crash without a checkpoint (`cona.trainer.distributed.CommunicationError`).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from cona.protocol import procstat
from cona.protocol.rundir import ControlRecord, RunDir


class Action(enum.IntEnum):
    """What the trainer does at the end of the current step (larger wins when several apply)."""

    NONE = 0
    CHECKPOINT = 1
    """Write a checkpoint and continue."""
    SWITCH = 2
    """Checkpoint and exit with ExitCode.SWITCH."""
    STOP = 3
    """Checkpoint and exit with ExitCode.STOPPED."""


_COMMAND_ACTIONS = {"checkpoint": Action.CHECKPOINT, "switch": Action.SWITCH, "stop": Action.STOP}


@dataclasses.dataclass
class ControlState:
    """Rank 0's view of control.json plus this process's signal flag."""

    last_seq: int = -1
    """The last control record seq handled (−1: none yet)."""
    pending: ControlRecord | None = None
    """The record behind the command code returned by the last `poll`, until `mark_handled`."""
    signal_name: str | None = None
    launched_as: int | None = None
    """The attempt these processes were launched as: the lowest `poll` was asked for (in-place switches hand this
    state on as they go on as later attempts)."""
    ending: bool = False
    """Set once the trainer is past its last collective (its exit record written, the final barrier passed): a peer
    that exits then has ended normally, and the watcher leaves this rank to end too."""
    _signalled: threading.Event = dataclasses.field(default_factory=threading.Event)
    _watching: bool = False
    _wakeup: tuple[socket.socket, socket.socket] | None = dataclasses.field(default=None, repr=False)
    """The watcher's socket pair (`signal.set_wakeup_fd` writes the signal's byte to the second), kept open."""

    def poll(self, run_dir: RunDir, attempt: int | None = None) -> Action:
        """The command of a new control record for these processes, or NONE: a record for any attempt, or for one
        they ran as — `attempt`, or one before it that they went on from in place (a `cona stop` sent to the trainer
        of an orchestrator that was gone names the attempt it saw, which may have switched in place since). Never one
        for an attempt of other processes: a relaunch must not act on a record its predecessor was sent. Reads one
        small file; call on rank 0 only."""
        if attempt is not None:
            self.launched_as = attempt if self.launched_as is None else min(self.launched_as, attempt)
        record = run_dir.read_control()
        if record is None or record.seq <= self.last_seq or not self._ours(record.attempt, attempt):
            self.pending = None
            return Action.NONE
        self.pending = record
        return _COMMAND_ACTIONS[record.command]

    def _ours(self, addressed: int | None, attempt: int | None) -> bool:
        """Whether a record for attempt `addressed` (None: any) is for these processes, now running as `attempt`."""
        if addressed is None or attempt is None:
            return True
        return (self.launched_as if self.launched_as is not None else attempt) <= addressed <= attempt

    def mark_handled(self) -> ControlRecord | None:
        """Remember the pending record as handled (so neither this process nor a relaunch acts on it again)."""
        record, self.pending = self.pending, None
        if record is not None:
            self.last_seq = max(self.last_seq, record.seq)
        return record

    # Signals --------------------------------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """SIGTERM (preemption, torchrun shutting down) and SIGUSR1 (Slurm's pre-timeout signal) set a flag; under
        torchrun, a SIGTERM with a process of this node gone ends the rank at once (`_watch`). Call after the
        process group is up: every local peer has started by then."""
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)
        self.ending = False  # an in-place switch goes on with more collectives
        if self._watching or "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
            return
        peers = LocalPeers.of_this_process()
        if not peers.pids:
            return
        reader, writer = socket.socketpair()
        writer.setblocking(False)  # required by set_wakeup_fd: a signal handler must never block
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        self._watching = True
        self._wakeup = (reader, writer)
        threading.Thread(target=self._watch, args=(reader, peers), name="cona-sigterm-watch", daemon=True).start()

    def _watch(self, reader: socket.socket, peers: LocalPeers) -> None:
        """Wait for SIGTERM's byte, then end this rank as soon as a local peer is gone (see the module's doc)."""
        while int(signal.SIGTERM) not in reader.recv(64):
            pass
        while not self.ending:
            gone = peers.gone()
            if gone:
                print(f"cona trainer: rank {os.environ.get('RANK', '?')}: SIGTERM, and a process of this node is gone "
                      f"({gone}): the world is broken and no collective can complete, so this rank exits now, without "
                      "a checkpoint (the last complete one stays)", file=sys.stderr, flush=True)  # fmt: skip
                os._exit(128 + int(signal.SIGTERM))  # as the shell reports a process ended by SIGTERM
            time.sleep(0.1)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name
        self._signalled.set()

    @property
    def signalled(self) -> bool:
        return self._signalled.is_set()


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid`, None when it is gone or has exited (a zombie is a dead peer here)."""
    stat = procstat.read(pid)
    return None if stat is None or stat.exited else stat.start_ticks


@dataclasses.dataclass(frozen=True)
class LocalPeers:
    """The other trainer processes torchrun started on this node beside this one: {pid: (start time, name)}."""

    pids: dict[int, tuple[str, str]]

    @classmethod
    def of_this_process(cls) -> LocalPeers:
        """This process's siblings that torchrun made workers of this run (its `TORCHELASTIC_RUN_ID`, a
        `LOCAL_RANK`): not the helper processes it may also have started. Empty where /proc cannot say."""
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "").encode()
        found: dict[int, tuple[str, str]] = {}
        for pid in procstat.children().get(os.getppid(), []):
            if pid == os.getpid():
                continue
            try:
                env = dict(v.split(b"=", 1) for v in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in v)
            except (OSError, ValueError):
                continue
            started = _start_time(pid)
            if started is not None and env.get(b"TORCHELASTIC_RUN_ID") == run_id and b"LOCAL_RANK" in env:
                found[pid] = (started, f"rank {env.get(b'RANK', b'?').decode()} (pid {pid})")
        return cls(found)

    def gone(self) -> str:
        """The peers that have exited (or been replaced by a new process of the same pid), named; "" for none."""
        return ", ".join(name for pid, (started, name) in self.pids.items() if _start_time(pid) != started)


def decide(*, command_code: float, signal_count: float) -> Action:
    """The agreed action from the all-reduced (summed) command code and signal flags."""
    code = round(command_code)
    action = Action(code) if 0 <= code <= max(Action) else Action.NONE
    if signal_count > 0:
        action = max(action, Action.STOP)
    return action
