"""A simulated-time training driver: real statistics from a tiny model, iteration times of a full-size preset.

The loss of a step does not depend on the parallel layout — the trainer's loss is layout-invariant at equal global
batch (`trainer.parallel`: the optimizer always gets ∂(mean loss over the global batch)) — only the global batch
size and the learning rate it gets matter. So one process trains a tiny model exactly as `python -m cona.trainer` would
at a given gbs (the trainer's own `ParallelModel` with dp = tp = pp = 1 and two micro-batches, the real sample order
of `trainer.data`, the real LR rule of `cona.protocol.lr` with the job's `lr_scaling` and cap, AdamW, clipping, the
trainer's gradient statistics), while a *modeled* clock advances by the cost model's iteration time of the chosen
strategy of a full-size preset on a cluster profile (`cona.orchestrator.costmodel.predict`).

**Batch mapping.** Strategy `c` of the preset (gbs_c samples of the preset) trains the tiny model at
gbs_c / scale samples, with `scale` = the preset's max_gbs / the tiny job's max_gbs (8 for gpt3-1.3b's [64, 1024]
over tiny-gpt's [8, 128]). A tiny sample stands for `scale` preset samples: gradient statistics report batch
sizes multiplied by `scale`, so the noise scale the orchestrator sees is in the preset's samples, like everything
else it ranks.

**Switch cost.** A switch costs what a cluster backend that switches in place pays, in modeled time: the preset's
checkpoint bytes (fp32 parameters and AdamW's two fp32 moments, 12 bytes per parameter, what the trainer's DCP
checkpoint holds) over the profile's storage write bandwidth, the same bytes over the read bandwidth, and between
them the backend's part — in place (`Backend.in_place_overhead_s`: exit record, barrier, release and rebuild) when
the world size stays, a restart constant (teardown, process start, imports, rendezvous, model build) when it
changes and the processes must be relaunched. `in_place=False` charges every switch a relaunch.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cona.orchestrator.planner import Candidate, enumerate_candidates, rank_by_iter_time
from cona.orchestrator.profile import ClusterProfile
from cona.orchestrator.switchcost import SwitchKind
from cona.protocol.job import JobSpec
from cona.protocol.lr import job_learning_rate
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import parse_bytes
from cona.trainer.data import Batcher
from cona.trainer.distributed import DistEnv
from cona.trainer.parallel import ParallelModel

CHECKPOINT_BYTES_PER_PARAM = 12
"""fp32 parameter + AdamW exp_avg + exp_avg_sq, as the trainer's DCP checkpoint stores them."""


@dataclasses.dataclass
class ModeledCluster:
    """The preset's candidates on the profile, their modeled iteration times and the modeled switch cost."""

    profile: ClusterProfile
    preset_job: JobSpec
    tiny_job: JobSpec
    restart_s: float
    """The backend's part of a relaunch (teardown, process start, imports, rendezvous, model build)."""
    in_place: bool = True
    """Switches that keep the world size stay in place; False: every switch is a relaunch."""
    in_place_s: float = 1.0
    """The backend's part of an in-place switch (the local backend's `in_place_overhead_s`)."""

    def __post_init__(self) -> None:
        self.candidates: list[Candidate] = [
            c for c in enumerate_candidates(profile=self.profile, job=self.preset_job) if c.feasible
        ]
        if not self.candidates:
            raise ValueError(f"no feasible strategy for {self.preset_job.name} on {self.profile.name}")
        preset_max = max(c.gbs for c in self.candidates)
        tiny_max = self.tiny_job.batch.max_gbs
        if preset_max % tiny_max:
            raise ValueError(f"the preset's largest gbs {preset_max} is not a multiple of the tiny job's {tiny_max}")
        self.scale = preset_max // tiny_max
        self.gbs_values = sorted({c.gbs for c in self.candidates if c.gbs % self.scale == 0})
        self.fastest: dict[int, Candidate] = {
            g: rank_by_iter_time([c for c in self.candidates if c.gbs == g])[0] for g in self.gbs_values
        }
        self._time = {c.strategy: c.iter_time_s for c in self.candidates}
        n = self.preset_job.model.num_params
        self.checkpoint_bytes = CHECKPOINT_BYTES_PER_PARAM * n
        storage = self.profile.storage
        self.save_s = self.checkpoint_bytes / parse_bytes(storage.write_bandwidth, per_second=True)
        self.load_s = self.checkpoint_bytes / parse_bytes(storage.read_bandwidth, per_second=True)
        self.switch_cost_s = self.kind_s(SwitchKind.RELAUNCH)
        self.in_place_cost_s = self.kind_s(SwitchKind.IN_PLACE)

    def switch_kind(self, current: Strategy, target: Strategy) -> SwitchKind:
        """In place when allowed and the world size stays (as `Backend.switch_kind` decides it), else a relaunch."""
        if self.in_place and current.world_size == target.world_size:
            return SwitchKind.IN_PLACE
        return SwitchKind.RELAUNCH

    def overhead_s(self, kind: SwitchKind) -> float:
        """The backend's part of a switch of `kind`, beyond checkpoint save and load."""
        return self.in_place_s if kind is SwitchKind.IN_PLACE else self.restart_s

    def kind_s(self, kind: SwitchKind) -> float:
        """Modeled seconds of a switch of `kind`: checkpoint save, the backend's part, checkpoint load."""
        return self.save_s + self.overhead_s(kind) + self.load_s

    def switch_s(self, current: Strategy, target: Strategy) -> float:
        """Modeled seconds of a switch from `current` to `target`."""
        return self.kind_s(self.switch_kind(current, target))

    def iter_time_s(self, strategy: Strategy) -> float:
        return self._time[strategy]

    def tiny_gbs(self, strategy: Strategy) -> int:
        return strategy.gbs // self.scale

    def describe(self) -> dict[str, Any]:
        return {
            "profile": self.profile.name,
            "preset": self.preset_job.model.preset or self.preset_job.name,
            "preset_params": self.preset_job.model.num_params,
            "num_candidates": len(self.candidates),
            "gbs_scale": self.scale,
            "checkpoint_bytes": self.checkpoint_bytes,
            "switch_cost_s": self.switch_cost_s,
            "in_place_switch_cost_s": self.in_place_cost_s if self.in_place else None,
            "switch_cost_parts_s": {"save": self.save_s, "restart": self.restart_s, "in_place": self.in_place_s,
                                    "load": self.load_s},
            "fastest_per_gbs": {
                str(g): {"strategy": c.strategy.short(), "iter_time_s": c.iter_time_s,
                         "samples_per_s": c.samples_per_s, "tiny_gbs": g // self.scale}
                for g, c in self.fastest.items()
            },
        }  # fmt: skip


@dataclasses.dataclass
class StepStats:
    """One step's loss and gradient statistics, batch sizes in tiny samples."""

    loss: float
    global_sqnorm: float
    local_sqnorm: float
    adam_global_sqnorm: float | None
    adam_local_sqnorm: float | None
    global_batch: int
    local_batch: int
    lr: float


@dataclasses.dataclass
class Snapshot:
    """Everything a branch needs to continue from here: the in-process equivalent of a checkpoint."""

    gbs: int
    samples: int
    step: int
    model: dict[str, torch.Tensor]
    optim: dict[str, Any]


def tiny_trainer(job_path: str, *, seed: int, gbs: int | None = None, stats: bool) -> SimTrainer:
    """A `SimTrainer` of the tiny job at `job_path` (relative to the repository) with `seed`, at `gbs` (default: the
    job's base batch), its data path resolved against the repository."""
    from cona.orchestrator.job import load_job
    from cona.trainer.data import load_corpus
    from cona.trainer.distributed import init_distributed

    from benchmarks.common import REPO

    job = load_job(REPO / job_path, [f"seed={seed}"])
    if not Path(job.data.path).is_absolute():
        job.data.path = str(REPO / job.data.path)
    return SimTrainer(job, Batcher(job, load_corpus(job)), init_distributed(), gbs=gbs or job.batch.base_gbs,
                      stats=stats)  # fmt: skip


class SimTrainer:
    """The tiny model trained as `python -m cona.trainer` trains it, one process, any gbs, switchable and branchable."""

    def __init__(self, job: JobSpec, batcher: Batcher, env: DistEnv, *, gbs: int, stats: bool) -> None:
        self.job, self.batcher, self.env = job, batcher, env
        self.stats = stats
        self.samples = 0
        self.step = 0
        self._models: dict[int, ParallelModel] = {}
        self.gbs = gbs
        self.model = self._model(gbs)
        windows = batcher.eval_windows()
        self._eval = (torch.from_numpy(windows.inputs), torch.from_numpy(windows.labels))

    def _model(self, gbs: int) -> ParallelModel:
        if gbs not in self._models:
            if gbs % 2:
                raise ValueError(f"the simulated trainer needs an even gbs, got {gbs}")
            # Two micro-batches: the trainer's dp = 1 statistics then compare half-batch and full-batch gradients.
            strategy = Strategy(dp=1, tp=1, pp=1, mbs=gbs // 2, gbs=gbs)
            self._models[gbs] = ParallelModel(self.job, strategy, self.env)
        return self._models[gbs]

    def set_gbs(self, gbs: int) -> None:
        """Continue under another global batch (the model and optimizer state carry over exactly)."""
        if gbs == self.gbs:
            return
        new = self._model(gbs)
        new.parts[0].load_state_dict(self.model.parts[0].state_dict())
        new.optimizers[0].load_state_dict(self.model.optimizers[0].state_dict())
        self.model, self.gbs = new, gbs

    def snapshot(self) -> Snapshot:
        return Snapshot(
            gbs=self.gbs, samples=self.samples, step=self.step,
            model={k: v.detach().clone() for k, v in self.model.parts[0].state_dict().items()},
            optim=copy.deepcopy(self.model.optimizers[0].state_dict()),
        )  # fmt: skip

    def restore(self, snap: Snapshot) -> None:
        self.model = self._model(snap.gbs)
        self.gbs = snap.gbs
        self.model.parts[0].load_state_dict(snap.model)
        self.model.optimizers[0].load_state_dict(copy.deepcopy(snap.optim))
        self.samples, self.step = snap.samples, snap.step

    def train_step(self, *, lr: float | None = None) -> StepStats:
        """One optimizer step over samples [samples, samples + gbs), as `trainer.train.Trainer.step` does it.

        `lr` overrides the job's LR rule; 0 keeps the parameters where they are while AdamW's moments still follow
        the gradients (weight decay is scaled by the LR too), which is how `benchmarks.noise_batch` holds one state.
        """
        model, gbs, start = self.model, self.gbs, self.samples
        batch = self.batcher.samples(start, start + gbs)
        count = batch.num_targets
        inputs = torch.from_numpy(np.ascontiguousarray(batch.inputs))
        labels = torch.from_numpy(np.ascontiguousarray(batch.labels))
        lr = job_learning_rate(self.job, samples=start, gbs=gbs) if lr is None else lr
        model.zero_grad()
        model.stats.begin_step(use_adam=self.stats and self.step > 0)
        loss_sum = model.forward_backward(inputs, labels, scale=1.0 / max(1, count))
        global_sq, global_adam = model.stats.global_terms(model.parameters())
        local_sq, local_adam = model.stats.local_terms()
        loss, global_sq_v, global_adam_v, local_sq_v, local_adam_v = torch.stack(
            [loss_sum / max(1, count), global_sq, global_adam, local_sq, local_adam]
        ).tolist()
        if not (math.isfinite(loss) and math.isfinite(global_sq_v)):
            raise FloatingPointError(f"step {self.step + 1} at gbs {gbs}: loss {loss}; the tiny job's LR is too high")
        model.clip_and_step(grad_sqnorm=global_sq_v, max_norm=self.job.optimizer.grad_clip, lr=lr)
        use_adam = self.stats and self.step > 0
        self.step += 1
        self.samples += gbs
        return StepStats(
            loss=loss, global_sqnorm=global_sq_v, local_sqnorm=local_sq_v,
            adam_global_sqnorm=global_adam_v if use_adam else None,
            adam_local_sqnorm=local_adam_v if use_adam else None,
            global_batch=gbs, local_batch=model.stats.local_batch(gbs=gbs, mbs=gbs // 2), lr=lr,
        )  # fmt: skip

    def evaluate(self) -> float:
        """Validation loss (nats per target token) on the job's fixed held-out windows."""
        loss_sum, count = self.model.eval_sums(*self._eval)
        return float(loss_sum) / max(1.0, float(count))
