"""Commands from the orchestrator (control.json) and from the cluster (SIGTERM, SIGUSR1). Torch-free.

Rank 0 polls control.json once per step; a record whose `seq` is above the last handled one is acted on once.
Every rank's signal handler only sets a flag. The decision is encoded as small numbers that ride on the step's
statistics all-reduce (a SUM): rank 0 contributes the command code, every rank its signal flag, so all ranks agree
on the same step without an extra collective. The trainer stores the last handled seq in trainer_state.json so a
relaunch does not act on an old record again.
"""

from __future__ import annotations

import dataclasses
import enum
import signal
import threading
from types import FrameType

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
    _signalled: threading.Event = dataclasses.field(default_factory=threading.Event)

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
        """SIGTERM (preemption, torchrun shutting down) and SIGUSR1 (Slurm's pre-timeout signal) set a flag."""
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name
        self._signalled.set()

    @property
    def signalled(self) -> bool:
        return self._signalled.is_set()


def decide(*, command_code: float, signal_count: float) -> Action:
    """The agreed action from the all-reduced (summed) command code and signal flags."""
    code = round(command_code)
    action = Action(code) if 0 <= code <= max(Action) else Action.NONE
    if signal_count > 0:
        action = max(action, Action.STOP)
    return action
