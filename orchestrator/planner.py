"""The strategy space: every (dp, tp, pp, mbs, gbs) for the devices at hand, feasible or rejected with a reason."""

from __future__ import annotations

import dataclasses
from typing import Any

from cona.orchestrator.costmodel import Prediction, predict, usable_memory_bytes
from cona.orchestrator.profile import ClusterProfile
from cona.protocol.job import JobSpec
from cona.protocol.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A strategy with its predicted cost, or the reason it cannot run."""

    dp: int
    tp: int
    pp: int
    mbs: int
    gbs: int
    feasible: bool
    reason: str
    """Empty when feasible; otherwise the first constraint it breaks, in words."""
    prediction: Prediction | None

    @property
    def strategy(self) -> Strategy:
        assert self.feasible, "only feasible candidates are strategies"
        return Strategy(dp=self.dp, tp=self.tp, pp=self.pp, mbs=self.mbs, gbs=self.gbs)

    @property
    def iter_time_s(self) -> float:
        return self.prediction.iter_time_s if self.prediction else float("inf")

    @property
    def samples_per_s(self) -> float:
        return self.gbs / self.iter_time_s if self.prediction else 0.0

    @property
    def memory_gb(self) -> float:
        return self.prediction.memory_gb if self.prediction else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "mbs": self.mbs,
            "gbs": self.gbs,
            "feasible": self.feasible,
            "reason": self.reason,
            "iter_time_s": round(self.iter_time_s, 9) if self.prediction else None,
            "samples_per_s": round(self.samples_per_s, 6) if self.prediction else None,
            "memory_gb": round(self.memory_gb, 6) if self.prediction else None,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_reason(*, job: JobSpec, profile: ClusterProfile, dp: int, tp: int, pp: int) -> str:
    """Why the degrees (dp, tp, pp) cannot run this model on this cluster, or '' if they can."""
    model, par = job.model, job.parallel
    if model.num_heads % tp or model.num_kv_heads % tp:
        return f"tp={tp} does not divide num_heads={model.num_heads} and num_kv_heads={model.num_kv_heads}"
    if model.ffn_hidden_size % tp:
        return f"tp={tp} does not divide ffn_hidden_size={model.ffn_hidden_size}"
    if tp > profile.gpus_per_node:
        return f"tp={tp} would span nodes (gpus_per_node={profile.gpus_per_node}); tensor parallelism stays inside a node"
    if profile.gpus_per_node % tp:
        return f"tp={tp} does not divide gpus_per_node={profile.gpus_per_node}"
    if par.max_tp is not None and tp > par.max_tp:
        return f"tp={tp} exceeds parallel.max_tp={par.max_tp}"
    if model.num_layers % pp:
        return f"pp={pp} does not divide num_layers={model.num_layers}"
    if par.max_pp is not None and pp > par.max_pp:
        return f"pp={pp} exceeds parallel.max_pp={par.max_pp}"
    if par.pipeline_schedule == "interleaved" and pp > 1 and model.num_layers % (2 * pp):
        return f"interleaved schedule needs num_layers={model.num_layers} divisible by 2·pp={2 * pp}"
    return ""


def evaluate(
    *, profile: ClusterProfile, job: JobSpec, dp: int, tp: int, pp: int, mbs: int, gbs: int, layout_problem: str = ""
) -> Candidate:
    """One candidate: checks every constraint, then predicts its cost."""

    def rejected(reason: str, prediction: Prediction | None = None) -> Candidate:
        return Candidate(dp, tp, pp, mbs, gbs, False, reason, prediction)

    if layout_problem:
        return rejected(layout_problem)
    if gbs % (dp * mbs):
        return rejected(f"gbs={gbs} is not a multiple of dp·mbs={dp * mbs}")
    if not job.batch.min_gbs <= gbs <= job.batch.max_gbs:
        return rejected(f"gbs={gbs} outside batch bounds [{job.batch.min_gbs}, {job.batch.max_gbs}]")
    num_micro = gbs // (dp * mbs)
    schedule = job.parallel.pipeline_schedule
    if pp > 1 and schedule in ("1f1b", "interleaved") and num_micro < pp:
        return rejected(f"{schedule} needs micro-batches ≥ pp: gbs/(dp·mbs)={num_micro} < pp={pp}")
    prediction = predict(profile=profile, job=job, dp=dp, tp=tp, pp=pp, mbs=mbs, gbs=gbs)
    usable = usable_memory_bytes(profile)
    if prediction.memory_bytes > usable:
        return rejected(
            f"needs {prediction.memory_bytes / 1e9:.1f} GB per device > {usable / 1e9:.1f} GB usable", prediction
        )
    return Candidate(dp, tp, pp, mbs, gbs, True, "", prediction)


def enumerate_candidates(
    *, profile: ClusterProfile, job: JobSpec, num_devices: int | None = None, gbs_values: list[int] | None = None
) -> list[Candidate]:
    """Every (dp, tp, pp, mbs, gbs) with dp·tp·pp = `num_devices` (default: all of the profile's)."""
    devices = num_devices or profile.num_gpus
    gbs_list = gbs_values if gbs_values is not None else job.batch.candidate_gbs()
    out = []
    for tp in _divisors(devices):
        for pp in _divisors(devices // tp):
            dp = devices // (tp * pp)
            problem = layout_reason(job=job, profile=profile, dp=dp, tp=tp, pp=pp)
            for mbs in job.batch.mbs_choices:
                for gbs in gbs_list:
                    out.append(
                        evaluate(
                            profile=profile, job=job, dp=dp, tp=tp, pp=pp, mbs=mbs, gbs=gbs, layout_problem=problem
                        )
                    )
    return out


def rank_by_iter_time(candidates: list[Candidate]) -> list[Candidate]:
    """Feasible candidates, fastest iteration first (ties: more samples/s, then fewer pipeline stages)."""
    feasible = [c for c in candidates if c.feasible]
    return sorted(feasible, key=lambda c: (c.iter_time_s, -c.samples_per_s, c.pp, c.tp, c.dp, c.mbs, c.gbs))


def static_choice(*, profile: ClusterProfile, job: JobSpec, num_devices: int | None = None) -> Candidate:
    """What an offline searcher picks: the lowest iteration time at the job's base global batch."""
    candidates = enumerate_candidates(
        profile=profile, job=job, num_devices=num_devices, gbs_values=[job.batch.base_gbs]
    )
    ranked = rank_by_iter_time(candidates)
    if not ranked:
        reasons = sorted({c.reason for c in candidates})
        raise ValueError(
            f"no feasible strategy at batch.base_gbs={job.batch.base_gbs} on {num_devices or profile.num_gpus} "
            f"devices; reasons: {'; '.join(reasons[:3])}"
        )
    return ranked[0]
