"""The strategy space: every (dp, tp, pp, mbs, gbs) for the devices at hand, feasible or rejected with a reason."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from cona.orchestrator.costmodel import MODEL_ERROR, Attention, Prediction, predict
from cona.orchestrator.job import Job
from cona.orchestrator.profile import ClusterProfile
from cona.protocol.feasibility import layout_problem, split_problem, virtual_stages
from cona.protocol.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A strategy with its predicted cost, or the reason it cannot run."""

    strategy: Strategy
    feasible: bool
    reason: str
    """Empty when feasible; otherwise the first constraint it breaks, in words."""
    prediction: Prediction | None

    @property
    def dp(self) -> int:
        return self.strategy.dp

    @property
    def tp(self) -> int:
        return self.strategy.tp

    @property
    def pp(self) -> int:
        return self.strategy.pp

    @property
    def mbs(self) -> int:
        return self.strategy.mbs

    @property
    def gbs(self) -> int:
        return self.strategy.gbs

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
    """The divisors of `n`, ascending. Found up to √n (a 2,048-node range asks for those of numbers up to 16,384,
    tens of thousands of times)."""
    low, high = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            low.append(d)
            if d * d != n:
                high.append(n // d)
        d += 1
    return low + high[::-1]


def layout_reason(*, job: Job, profile: ClusterProfile, dp: int, tp: int, pp: int, uneven: bool = False) -> str:
    """Why the planner does not consider the degrees (dp, tp, pp) for this model on this cluster, or '' if it does.

    What can run at all is decided by `cona.protocol.feasibility`; the planner adds its own choices: the job's
    `parallel.max_tp`/`max_pp`, equal chunks under the interleaved schedule (which its cost assumes), and equal
    pipeline stages unless `uneven` — which `enumerate_candidates` allows where the devices leave no feasible even
    split (3 nodes of 8 for a 16-layer model: 6, 5 and 5 blocks, priced by the slowest stage)."""
    problem = layout_problem(job, tp=tp, pp=pp, gpus_per_node=profile.gpus_per_node)
    if problem:
        return problem
    model, par = job.model, job.parallel
    if par.max_tp is not None and tp > par.max_tp:
        return f"tp={tp} exceeds parallel.max_tp={par.max_tp}"
    if model.num_layers % pp and not uneven:
        return (f"pp={pp} does not divide model.num_layers={model.num_layers} (stages of unequal size are planned "
                "only where no even split of the devices is feasible)")  # fmt: skip
    if par.max_pp is not None and pp > par.max_pp:
        return f"pp={pp} exceeds parallel.max_pp={par.max_pp}"
    chunks = pp * virtual_stages(job, pp)
    if chunks > pp and model.num_layers % chunks:
        return (f"interleaved schedule needs model.num_layers={model.num_layers} divisible by pp·virtual_stages={chunks} "
                f"(the planner keeps chunks equal)")  # fmt: skip
    return ""


def batch_reason(*, job: Job, dp: int, pp: int, mbs: int, gbs: int) -> str:
    """Why the planner does not consider the batch sizes (mbs, gbs) on dp replicas of pp stages, or '' if it does:
    they must split (`cona.protocol.feasibility`) and gbs lie within the job's batch bounds, the planner's choice."""
    problem = split_problem(job, dp=dp, pp=pp, mbs=mbs, gbs=gbs)
    if problem:
        return problem
    if not job.batch.min_gbs <= gbs <= job.batch.max_gbs:
        return f"gbs={gbs} outside batch bounds [{job.batch.min_gbs}, {job.batch.max_gbs}]"
    return ""


def _gb_apart(need: float, have: float) -> tuple[str, str]:
    """Two byte counts in GB with as many decimals (1 to 4) as it takes to tell them apart: a need just above the
    memory would otherwise read "needs 1.0 GB per device > 1.0 GB usable", which explains nothing."""
    digits = 1
    while digits < 4 and f"{need / 1e9:.{digits}f}" == f"{have / 1e9:.{digits}f}":
        digits += 1
    return f"{need / 1e9:.{digits}f}", f"{have / 1e9:.{digits}f}"


def evaluate(
    *, profile: ClusterProfile, job: Job, dp: int, tp: int, pp: int, mbs: int, gbs: int, layout_problem: str = "",
    attention: Attention = "sdpa",
) -> Candidate:
    """One candidate: checks every constraint, then predicts its cost (`attention` as in `costmodel.predict`)."""

    strategy = Strategy(dp=dp, tp=tp, pp=pp, mbs=mbs, gbs=gbs)

    def rejected(reason: str, prediction: Prediction | None = None) -> Candidate:
        return Candidate(strategy, False, reason, prediction)

    if layout_problem:
        return rejected(layout_problem)
    problem = batch_reason(job=job, dp=dp, pp=pp, mbs=mbs, gbs=gbs)
    if problem:
        return rejected(problem)
    prediction = predict(profile=profile, job=job, dp=dp, tp=tp, pp=pp, mbs=mbs, gbs=gbs, attention=attention)
    usable = profile.accelerator.memory_bytes  # the memory model counts the allocator's overhead itself
    if prediction.memory_bytes > usable:
        need, have = _gb_apart(prediction.memory_bytes, usable)
        return rejected(f"needs {need} GB per device > {have} GB usable", prediction)
    return Candidate(strategy, True, "", prediction)


def enumerate_candidates(
    *, profile: ClusterProfile, job: Job, num_devices: int | None = None, gbs_values: list[int] | None = None,
    feasible_only: bool = False,
) -> list[Candidate]:  # fmt: skip
    """Every (dp, tp, pp, mbs, gbs) with dp·tp·pp = `num_devices` (default: all of the profile's), by tp, pp, mbs
    and gbs ascending.

    `feasible_only`: only the feasible ones, the same and in the same order as filtering the full list, for the
    callers that never show a rejection (a run's scheduler, its start strategy, which nodes can start). The rules
    are the same ones (`layout_reason`, `batch_reason`, then `evaluate`'s memory check), but a layout or a batch
    split they reject is passed over before a `Candidate` is built for it: a 2,048-node elastic range has ~7 million
    candidates of which a few thousand are feasible, and building all of them kept a run from starting for 22 s
    (1.1 s this way). `cona plan --all` lists the rejected ones with their reasons, so it enumerates them all.

    Pipeline stages are equal where some even split of the layers is feasible on these devices; where none is,
    the candidates are those with the layers split as evenly as they can be (`layout_reason`'s `uneven`)."""
    devices = num_devices or profile.num_gpus
    gbs_list = gbs_values if gbs_values is not None else job.batch.candidate_gbs()
    even = _enumerate(profile=profile, job=job, devices=devices, gbs_list=gbs_list, feasible_only=feasible_only,
                      uneven=False)  # fmt: skip
    if any(c.feasible for c in even):
        return even
    # No even split of the layers is feasible on these devices (the odd factor of 3 nodes of 8 GPUs, which a
    # 16-layer model's stages and heads cannot take): split them as evenly as they can be, as the trainer does.
    uneven = _enumerate(profile=profile, job=job, devices=devices, gbs_list=gbs_list, feasible_only=feasible_only,
                        uneven=True)  # fmt: skip
    # The layouts of the two passes are disjoint; a stable sort by (tp, pp) restores the enumeration's order. (Where
    # neither pass finds anything, `cona plan --all` shows why each uneven layout failed, not only that it is one.)
    merged = [c for c in even if job.model.num_layers % c.strategy.pp == 0] + uneven
    return sorted(merged, key=lambda c: (c.strategy.tp, c.strategy.pp))


def _enumerate(*, profile: ClusterProfile, job: Job, devices: int, gbs_list: list[int], feasible_only: bool,
               uneven: bool) -> list[Candidate]:  # fmt: skip
    """`enumerate_candidates`' pass over the even layouts (`uneven` False: every layout, the uneven ones rejected)
    or over only the uneven ones (`uneven` True)."""
    out = []
    layers = job.model.num_layers
    for tp in _divisors(devices):
        for pp in _divisors(devices // tp):
            if uneven and layers % pp == 0:
                continue  # the even pass's
            dp = devices // (tp * pp)
            problem = layout_reason(job=job, profile=profile, dp=dp, tp=tp, pp=pp, uneven=uneven)
            if problem and feasible_only:
                continue
            for mbs in job.batch.mbs_choices:
                for gbs in gbs_list:
                    if feasible_only and batch_reason(job=job, dp=dp, pp=pp, mbs=mbs, gbs=gbs):
                        continue
                    candidate = evaluate(
                        profile=profile, job=job, dp=dp, tp=tp, pp=pp, mbs=mbs, gbs=gbs, layout_problem=problem
                    )
                    if candidate.feasible or not feasible_only:
                        out.append(candidate)
    return out


def batch_hint(job: Job, devices: int, gbs_values: list[int] | None) -> str:
    """When nothing is feasible and the device count has an odd factor that no candidate global batch is a multiple
    of (3 nodes of 8 GPUs and the default power-of-two batches), that is the usual cause: the data-parallel degree
    has to take part of the factor unless tensor and pipeline degrees take all of it. Say so, and which batches
    would do ('' when that is not the cause; otherwise a clause ending in '; ' to go before the next one)."""
    odd = devices
    while odd % 2 == 0:
        odd //= 2
    batches = gbs_values or job.batch.candidate_gbs()
    if odd == 1 or any(g % odd == 0 for g in batches):
        return ""
    # A batch the data-parallel degree's share of the factor can split: a multiple of it whose quotient is a power
    # of two that a micro-batch size divides (18 devices: 9 · mbs, never 9 itself with micro-batches of 2 or more).
    fitting = [g for g in range(job.batch.min_gbs, job.batch.max_gbs + 1) if g % odd == 0
               and (g // odd) & (g // odd - 1) == 0 and any((g // odd) % mbs == 0 for mbs in job.batch.mbs_choices)]  # fmt: skip
    base = job.batch.base_gbs
    if fitting and base % odd:
        # The base batch has to be one of them too, or the static policy and the prior still find nothing to run.
        base = next((g for g in fitting if g >= base), fitting[-1])
    # The four nearest the base batch (by ratio), the base among them: the first four of a wide range (96 … 768 for
    # a base of 1536) would name a base batch the choices do not hold.
    shown = sorted(sorted(fitting, key=lambda g: (abs(math.log(g / base)), g))[:4])
    example = f" e.g. batch.gbs_choices={shown}" if fitting else f" a batch range that holds a multiple of {odd}"
    if fitting and job.batch.base_gbs % odd:
        example += f" with batch.base_gbs={base}"
    return (f"{devices} devices have the factor {odd}, and none of the global batches {batches} is a multiple of "
            f"it: give{example}, or use a power-of-two number of devices; ")  # fmt: skip


def memory_hint(profile: ClusterProfile, candidates: list[Candidate]) -> str:
    """When nothing is feasible and memory is what rejects every candidate the layout and batch rules allow (a
    small device, a long sequence), say so with the smallest need ('' when that is not the cause; otherwise a clause
    ending in '; ' to go before the next one)."""
    predicted = [c for c in candidates if c.prediction is not None]
    if not predicted or any(c.feasible for c in candidates):
        return ""
    smallest = min(predicted, key=lambda c: c.memory_gb)
    need, have = _gb_apart(smallest.memory_gb * 1e9, profile.accelerator.memory_bytes)
    return (f"every strategy the layout and batch rules allow needs more than accelerator.memory="
            f"{profile.accelerator.memory!r} ({have} GB) per device, the least {need} GB "
            f"({smallest.strategy.short()}): give devices with more memory, parallel.recompute=full (activations "
            "recomputed in backward) if it is not, or a smaller model or model.seq_len; ")


def no_feasible_strategy(profile: ClusterProfile, job: Job) -> str:
    """What a run says when no strategy of any world it plans for is feasible: `cona render`/`submit`/`run` before
    the run exists (`cli.first_strategy`) and its scheduler after (a resumed run, the Kubernetes orchestrator),
    in the same words, with the usual cause when it is that (`batch_hint`)."""
    memory = memory_hint(profile, enumerate_candidates(profile=profile, job=job))
    return (f"no feasible strategy for {job.name} on {profile.name}; {batch_hint(job, profile.num_gpus, None)}"
            f"{memory}run `cona plan --all` to see why")  # fmt: skip


def rank_by_iter_time(candidates: list[Candidate]) -> list[Candidate]:
    """Feasible candidates, fastest iteration first (ties: more samples/s, then fewer pipeline stages)."""
    feasible = [c for c in candidates if c.feasible]
    return sorted(feasible, key=lambda c: (c.iter_time_s, -c.samples_per_s, c.pp, c.tp, c.dp, c.mbs, c.gbs))


def ties_with_best(ranked: list[Candidate], *, error: float = MODEL_ERROR) -> set[Strategy]:
    """The feasible strategies whose predicted time is within the model's own error of the fastest at their gbs.

    Candidates of one global batch train the same samples per step, so only they compete; among them, the
    model cannot tell apart predictions closer than its error (`costmodel.MODEL_ERROR`)."""
    best: dict[int, float] = {}
    for c in ranked:
        best[c.gbs] = min(best.get(c.gbs, float("inf")), c.iter_time_s)
    return {c.strategy for c in ranked if c.iter_time_s <= best[c.gbs] * (1 + error)}


def static_choice(*, profile: ClusterProfile, job: Job, num_devices: int | None = None) -> Candidate:
    """What an offline searcher picks: the lowest iteration time at the job's base global batch."""
    candidates = enumerate_candidates(
        profile=profile, job=job, num_devices=num_devices, gbs_values=[job.batch.base_gbs]
    )
    ranked = rank_by_iter_time(candidates)
    if not ranked:
        reasons = sorted({c.reason for c in candidates})
        devices = num_devices or profile.num_gpus
        raise ValueError(
            f"no feasible strategy at batch.base_gbs={job.batch.base_gbs} on {devices} devices; "
            f"{batch_hint(job, devices, [job.batch.base_gbs])}reasons: {'; '.join(reasons[:3])}"
        )
    return ranked[0]
