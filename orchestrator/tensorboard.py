"""TensorBoard scalars of a run, written by the orchestrator as it tails heartbeats (`metrics.tensorboard: true`).

One writer per run, the orchestrator's: `RUN_DIR/tensorboard/` holds event files that `tensorboard --logdir
RUN_DIR/tensorboard` (or a directory above several runs) shows. The x axis is the samples trained, which stays
comparable across strategies and batch sizes. Tags:

    train/loss, train/lr, train/samples_per_s, train/gbs     every heartbeat with a training step
    val/loss, val/perplexity                                  every evaluation
    noise/estimate, noise/scale                               the noise-scale estimate, and the B_noise the
                                                              policy ranks with (prior, blend or scaled estimate)
    switch                                                    1 at each completed switch (a marker), with its cost
    strategy (text)                                           the strategy whenever it changes; a switch's line

An orchestrator that restarts opens a new event file in the same directory and goes on from the heartbeats it has
not read yet, so nothing is written twice. The writer is tensorboardX (`pip install 'cona[tensorboard]'`), which
needs no torch: it imports torch only to accept torch tensors, which this module never hands it, so torch is kept
out while it loads (the control plane stays torch-free, docs/architecture.md).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from cona.protocol.heartbeat_record import Heartbeat, HeartbeatEvent
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

TENSORBOARD_DIR = "tensorboard"


def _summary_writer_class() -> Any:
    """tensorboardX's SummaryWriter, imported with torch hidden (see the module doc)."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` now raises ImportError
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ConfigError(
            "metrics.tensorboard needs tensorboardX: pip install 'cona[tensorboard]' (or set metrics.tensorboard: false)"
        ) from None
    finally:
        if hide:
            sys.modules.pop("torch", None)
    return SummaryWriter


class TensorBoardWriter:
    """Writes a run's heartbeats, noise estimate and switches as TensorBoard scalars under `run_root/tensorboard/`."""

    def __init__(self, run_root: Path) -> None:
        writer_class = _summary_writer_class()
        self.directory = Path(run_root) / TENSORBOARD_DIR
        self._writer = writer_class(logdir=str(self.directory), flush_secs=30)
        self._strategy: str | None = None
        self._samples = 0
        self._held_switch: str | None = None
        """A switch's line that came before this writer saw any heartbeat, written at the next heartbeat's sample."""

    def heartbeats(self, beats: list[Heartbeat], *, noise_estimate: float | None, noise_scale: float | None) -> None:
        """Record what these heartbeats say; the noise values are the orchestrator's after absorbing them."""
        if beats and self._held_switch is not None:
            self._write_switch(self._held_switch, int(beats[0].samples))
            self._held_switch = None
        for hb in beats:
            step = int(hb.samples)
            self._samples = max(self._samples, step)
            strategy = Strategy.from_dict(hb.strategy).short() if hb.strategy else None
            if strategy is not None and strategy != self._strategy:
                self._writer.add_text("strategy", f"{strategy} from sample {step}", step)
                self._strategy = strategy
            if hb.train_loss is not None and hb.event in (None, HeartbeatEvent.EVAL):
                self._writer.add_scalar("train/loss", hb.train_loss, step)
                self._writer.add_scalar("train/lr", hb.lr, step)
                if hb.samples_per_s:
                    self._writer.add_scalar("train/samples_per_s", hb.samples_per_s, step)
                if hb.strategy:
                    self._writer.add_scalar("train/gbs", hb.strategy.get("gbs", 0), step)
            if hb.val_loss is not None:
                self._writer.add_scalar("val/loss", hb.val_loss, step)
                self._writer.add_scalar("val/perplexity", hb.val_perplexity, step)
        if beats and noise_estimate is not None:
            self._writer.add_scalar("noise/estimate", noise_estimate, self._samples)
        if beats and noise_scale is not None:
            self._writer.add_scalar("noise/scale", noise_scale, self._samples)
        if beats:
            self._writer.flush()

    def switch(self, *, source: Strategy | None, target: Strategy, cost_s: float, kind: str) -> None:
        """A completed switch: a marker at the current sample and a line of text. An orchestrator restarted during a
        switch completes it on the first heartbeats its new writer reads, before this writer has seen any: the
        marker then goes at the first of them (the new attempt's resume record, at the switch point), not at 0."""
        before = source.short() if source is not None else "?"
        line = f"switch {before} → {target.short()} at sample {{}} ({kind}, {cost_s:.1f} s)"
        if self._samples == 0:
            self._held_switch = line
            return
        self._write_switch(line, self._samples)

    def _write_switch(self, line: str, samples: int) -> None:
        self._writer.add_scalar("switch", 1.0, samples)
        self._writer.add_text("strategy", line.format(samples), samples)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
