"""Rank 0's heartbeat: one `Heartbeat` line per `heartbeat.interval_steps` steps, plus event records.

Each periodic record averages the steps since the previous record: train loss, step time and the gradient
statistics (`trainer.gradstats` explains local/global and the Adam variants). Special records carry `event`:
`start`/`resume` at start-up, `eval` after a validation, `checkpoint` after a save and `exit` (with `exit_code`)
as the last line of the attempt.
"""

from __future__ import annotations

import dataclasses
import math
import time

from cona.protocol.heartbeat_record import Heartbeat, HeartbeatEvent
from cona.protocol.rundir import RunDir, append_jsonl


@dataclasses.dataclass
class StepRecord:
    """What one optimizer step reports."""

    loss: float
    step_time_s: float
    local_sqnorm: float | None
    local_batch: int | None
    global_sqnorm: float
    global_batch: int
    adam_local_sqnorm: float | None
    adam_global_sqnorm: float | None


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None and math.isfinite(v)]
    return sum(present) / len(present) if present else None


@dataclasses.dataclass
class HeartbeatWriter:
    run_dir: RunDir
    attempt: int
    strategy: dict[str, int]
    enabled: bool
    """True on rank 0 only; other ranks keep no window and write nothing."""
    window: list[StepRecord] = dataclasses.field(default_factory=list)
    last_loss: float | None = None
    """The newest window's mean train loss; event records between windows repeat it (None before any step)."""

    def add_step(self, record: StepRecord) -> None:
        if self.enabled:
            self.window.append(record)

    def write(
        self,
        *,
        step: int,
        samples: int,
        tokens: int,
        lr: float,
        event: HeartbeatEvent | None = None,
        val_loss: float | None = None,
        val_perplexity: float | None = None,
        peak_memory_gb: float | None = None,
        exit_code: int | None = None,
        reason: str | None = None,
    ) -> Heartbeat | None:
        """Append one record summarising the window (then start a new window)."""
        if not self.enabled:
            return None
        window, self.window = self.window, []
        step_time = _mean([r.step_time_s for r in window])
        local_batches = {r.local_batch for r in window if r.local_batch is not None}
        heartbeat = Heartbeat(
            time=time.time(),
            attempt=self.attempt,
            strategy=self.strategy,
            step=step,
            samples=samples,
            tokens=tokens,
            train_loss=_mean([r.loss for r in window]) if window else self.last_loss,  # type: ignore[arg-type]
            lr=lr,
            step_time_s=step_time or 0.0,
            samples_per_s=(window[-1].global_batch / step_time) if window and step_time else 0.0,
            local_sqnorm=_mean([r.local_sqnorm for r in window]),
            local_batch=local_batches.pop() if len(local_batches) == 1 else None,
            global_sqnorm=_mean([r.global_sqnorm for r in window]),
            global_batch=window[-1].global_batch if window else None,
            adam_local_sqnorm=_mean([r.adam_local_sqnorm for r in window]),
            adam_global_sqnorm=_mean([r.adam_global_sqnorm for r in window]),
            val_loss=val_loss,
            val_perplexity=val_perplexity,
            peak_memory_gb=peak_memory_gb,
            event=event,
            exit_code=exit_code,
            reason=reason,
        )
        if heartbeat.local_batch is None:
            heartbeat.local_sqnorm = heartbeat.adam_local_sqnorm = None
        self.last_loss = heartbeat.train_loss
        record = heartbeat.to_dict()
        record.setdefault("train_loss", None)  # a start record has no loss yet: null, never NaN (not JSON)
        append_jsonl(self.run_dir.heartbeat_file(self.attempt), record)
        return heartbeat
