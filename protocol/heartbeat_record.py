"""The heartbeat record that trainer rank 0 appends to `heartbeats/<attempt>.jsonl`. Torch-free."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable
from typing import Any


class HeartbeatEvent(enum.StrEnum):
    """The `event` of a special heartbeat record: the trainer writes these names, the orchestrator reads them."""

    START = "start"
    """The first record of a fresh run's attempt."""
    RESUME = "resume"
    """The first record of an attempt that loaded a checkpoint."""
    EVAL = "eval"
    """A validation loss was measured at this step."""
    CHECKPOINT = "checkpoint"
    """A checkpoint was saved (`reason`: why)."""
    HOLD = "hold"
    """Training waits at a switch point for the orchestrator's decision (`reason`); repeated while it waits."""
    EXIT = "exit"
    """The trainer's last record, with its `exit_code`."""
    CHECKPOINT_SKIPPED = "checkpoint-skipped"
    """Resume passed over a checkpoint that is incomplete or unreadable (`reason`: which, and why)."""
    CHECKPOINT_RESTORED = "checkpoint-restored"
    """Resume put back a checkpoint whose re-save was interrupted (`reason`: from where)."""


NOTICE_EVENTS = frozenset({HeartbeatEvent.CHECKPOINT_SKIPPED, HeartbeatEvent.CHECKPOINT_RESTORED})
"""Heartbeat events the orchestrator copies to events.jsonl under the same name, with `reason` as the detail."""


MAX_LOSS_FOR_PERPLEXITY = 50.0
"""Losses above this have this one's perplexity (e^50, `perplexity`): math.exp overflows past about 709, and a
diverged run (a validation loss of 1e6) must still be reported, not end its reader in an OverflowError."""


def perplexity(val_loss: float) -> float:
    """The perplexity of a validation loss, e^val_loss clipped at `MAX_LOSS_FOR_PERPLEXITY`: the one definition,
    for the trainer's `val_perplexity` (in its heartbeats, and checked against the job's target), the run model's
    live view and `cona report`."""
    return math.exp(min(val_loss, MAX_LOSS_FOR_PERPLEXITY))


@dataclasses.dataclass
class Heartbeat:
    """Progress and statistics over the last `heartbeat.interval_steps` optimizer steps."""

    time: float
    """Unix time of the record."""
    attempt: int
    strategy: dict[str, int]
    step: int
    """Optimizer steps completed (over the whole run)."""
    samples: int
    """Samples consumed so far (the data position)."""
    tokens: int
    train_loss: float
    """Mean training loss over the window."""
    lr: float
    step_time_s: float
    """Mean wall time per optimizer step over the window (excluding validation and checkpoints)."""
    samples_per_s: float
    local_sqnorm: float | None = None
    """|G_small|²: squared norm of one replica's gradient before the dp reduction (mean over replicas)."""
    local_batch: int | None = None
    """B_small: samples behind local_sqnorm."""
    global_sqnorm: float | None = None
    """|G_big|²: squared norm of the reduced gradient."""
    global_batch: int | None = None
    """B_big: samples behind global_sqnorm (the gbs)."""
    adam_local_sqnorm: float | None = None
    """local_sqnorm preconditioned by Adam's second-moment estimate (for the Adam-aware noise scale)."""
    adam_global_sqnorm: float | None = None
    val_loss: float | None = None
    """Validation loss, when measured at this step."""
    val_perplexity: float | None = None
    """`perplexity(val_loss)`."""
    peak_memory_gb: float | None = None
    event: str | None = None
    """A `HeartbeatEvent` on special records, None on periodic ones."""
    exit_code: int | None = None
    """On `exit` records: the trainer's `ExitCode` (torchrun itself exits 1 whatever its workers return)."""
    reason: str | None = None
    """On `exit`/`checkpoint` records: why (`switch seq 3`, `SIGTERM`, `max_steps`, `target val_perplexity`…)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Heartbeat:
        """The record in `data`; TypeError for a missing field or a value of the wrong type (a garbage line that
        happens to parse as JSON must be skipped by its reader, not crash the orchestrator later)."""
        # Said by name here: the dataclass's own TypeError lists them as Python sees them (`__init__() missing 9
        # required positional arguments`), and its reader logs the message for a person (`bad-heartbeat`).
        missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in data]
        if missing:
            raise TypeError(f"heartbeat record lacks field(s) {', '.join(missing)}")
        kwargs = {}
        for field in dataclasses.fields(cls):
            if field.name not in data:
                continue
            value = data[field.name]
            kind = str(field.type)
            if value is None:
                if "None" not in kind and field.name != "train_loss":  # a start record has no loss yet
                    raise TypeError(f"heartbeat field {field.name} is null")
            elif kind.startswith("dict"):
                if not isinstance(value, dict):
                    raise TypeError(f"heartbeat field {field.name} is not an object")
            elif kind.startswith("str"):
                if not isinstance(value, str):
                    raise TypeError(f"heartbeat field {field.name} is not a string")
            elif isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"heartbeat field {field.name} is not a number: {value!r}"[:200])
            elif kind.startswith("int") and not float(value).is_integer():
                raise TypeError(f"heartbeat field {field.name} is not an integer: {value!r}")
            kwargs[field.name] = int(value) if kind.startswith("int") else value
        return cls(**kwargs)


WARMUP_WINDOWS = 1
"""Periodic heartbeats at the start of every attempt (a launch, a relaunch, a switch in place) that measure no
throughput: their window includes compilation, the allocator's first growth and the first collectives, so their step
time is far above the steady one and would drag a strategy's measured samples/s down."""


def timed_window(hb: Heartbeat) -> bool:
    """Whether `hb` is a periodic record with a step time: a window of training steps. Special records (start,
    resume, eval, checkpoint, hold, exit) time nothing, a window before the first step reports 0, and a step time
    that is no time (JSON reads `Infinity`) is no window either: counted as an attempt's warm-up window, it would let
    the real warm-up window in as a measurement (the throughput model ignores it all the same)."""
    return hb.event is None and hb.step_time_s is not None and math.isfinite(hb.step_time_s) and hb.step_time_s > 0


def measures_throughput(window: int) -> bool:
    """Whether the `window`-th timed window (counted from 1) of an attempt is a throughput measurement: those after
    the `WARMUP_WINDOWS` warm-up ones. The one rule for the run model, which counts an attempt's windows as they
    arrive (its throughput model is what the policy ranks with), and `cona report`, which reads them all afterwards
    (`throughput_windows`): the report must show the samples/s the run was steered by."""
    return window > WARMUP_WINDOWS


def throughput_windows(beats: Iterable[Heartbeat]) -> list[Heartbeat]:
    """The heartbeats of `beats` that measure throughput (`measures_throughput`), counting the timed windows of each
    attempt on its own; `beats` must hold every record of each attempt they include, in the order written."""
    seen: dict[int, int] = {}
    measured = []
    for hb in beats:
        if timed_window(hb):
            seen[hb.attempt] = seen.get(hb.attempt, 0) + 1
            if measures_throughput(seen[hb.attempt]):
                measured.append(hb)
    return measured
