"""The strategy record: data/tensor/pipeline degrees and micro/global batch sizes. Torch-free."""

from __future__ import annotations

import dataclasses
from typing import Any

_FIELDS = ("dp", "tp", "pp", "mbs", "gbs")


@dataclasses.dataclass(frozen=True, order=True)
class Strategy:
    """One parallel layout and batch size: dp·tp·pp processes, gbs samples per step in micro-batches of mbs."""

    dp: int
    """Data-parallel degree (FSDP2 replicas)."""
    tp: int
    """Tensor-parallel degree (within a node)."""
    pp: int
    """Pipeline-parallel degree (stages)."""
    mbs: int
    """Micro-batch size: samples per forward pass on one data-parallel replica."""
    gbs: int
    """Global batch size: samples per optimizer step."""

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"strategy field {name!r} must be a positive integer, got {value!r}")
        # Whether the batch splits over the replicas and stages, and whether the layout fits a model and a world,
        # is `cona.protocol.feasibility`'s call alone: the planner lists such strategies with the reason.

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per data-parallel replica per optimizer step (gradient accumulation × pipeline); exact
        for a strategy that `cona.protocol.feasibility.batch_problem` accepts."""
        return self.gbs // (self.dp * self.mbs)

    @property
    def measures_noise(self) -> bool:
        """Whether its steps hold a smaller batch beside the whole one — several data-parallel replicas, or several
        micro-batches — from which the two-batch noise scale is measured (`measures_noise`)."""
        return measures_noise(dp=self.dp, microbatches=self.num_microbatches)

    @property
    def local_batch(self) -> int:
        """Samples per data-parallel replica per optimizer step."""
        return self.gbs // self.dp

    def __str__(self) -> str:
        return ",".join(f"{name}={getattr(self, name)}" for name in _FIELDS)

    def short(self) -> str:
        """Compact form for tables and plots, e.g. `d2t2p1 m2 g16`."""
        return f"d{self.dp}t{self.tp}p{self.pp} m{self.mbs} g{self.gbs}"

    def layout(self) -> tuple[int, int, int]:
        return (self.dp, self.tp, self.pp)

    def to_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Strategy:
        unknown = set(data) - set(_FIELDS)
        if unknown:
            names = ", ".join(map(repr, sorted(unknown)))  # quoted as `parse` quotes one, not as a list repr
            raise ValueError(f"unknown strategy field(s) {names}; valid: {', '.join(_FIELDS)}")
        missing = [name for name in _FIELDS if name not in data]
        if missing:
            raise ValueError(f"strategy is missing {', '.join(missing)}")
        return cls(**{name: data[name] for name in _FIELDS})

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """Parse `dp=2,tp=2,pp=1,mbs=2,gbs=16`; omitted degrees default to 1."""
        values: dict[str, Any] = {"dp": 1, "tp": 1, "pp": 1}
        given: set[str] = set()
        for part in text.replace(" ", "").split(","):
            if not part:
                continue
            key, sep, raw = part.partition("=")
            if not sep:
                raise ValueError(f"strategy {text!r}: expected key=value pairs like dp=2,tp=1,pp=1,mbs=2,gbs=16")
            if key not in _FIELDS:
                import difflib

                close = difflib.get_close_matches(key, _FIELDS, n=1, cutoff=0.4)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"strategy {text!r}: unknown field {key!r}{hint}; valid: {', '.join(_FIELDS)}")
            if key in given:
                raise ValueError(f"strategy {text!r}: {key} is given twice; give each field once")
            given.add(key)
            try:
                values[key] = int(raw)
            except ValueError:
                raise ValueError(f"strategy {text!r}: {key}={raw!r} is not an integer") from None
        for name in ("mbs", "gbs"):
            if name not in values:
                raise ValueError(f"strategy {text!r}: missing {name}=")
        return cls(**values)


def measures_noise(*, dp: int, microbatches: int) -> bool:
    """The one rule of which layouts measure the gradient noise scale: a step needs a batch smaller than the whole
    one (`trainer.gradstats`: another replica's gradient, or another micro-batch's), so one replica running the whole
    batch as one micro-batch measures none, and cona could never learn which batch to train at."""
    return dp > 1 or microbatches > 1
