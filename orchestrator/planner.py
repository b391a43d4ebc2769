"""The strategy space: every (dp, tp, pp, mbs, gbs) for the devices at hand, feasible or rejected with a reason."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
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
    pipeline stages unless `uneven` — which `enumerate_candidates` allows at the global batches that no even split
    of the devices runs (`uneven_batches`; 3 nodes of 8 for a 16-layer model and power-of-two batches: 6, 5 and 5
    blocks, priced by the slowest stage). Its message for `uneven` False is therefore kept only by the candidates
    of a batch that an even split runs, and says so."""
    problem = layout_problem(job, tp=tp, pp=pp, gpus_per_node=profile.gpus_per_node)
    if problem:
        return problem
    model, par = job.model, job.parallel
    if par.max_tp is not None and tp > par.max_tp:
        return f"tp={tp} exceeds parallel.max_tp={par.max_tp}"
    if model.num_layers % pp and not uneven:
        return (f"pp={pp} does not divide model.num_layers={model.num_layers} and an even split of the devices runs "
                f"this global batch (stages of unequal size are planned only at a batch that none runs); choose a "
                f"pp that divides {model.num_layers}")  # fmt: skip
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


def named_world_reason(world: int, profile: ClusterProfile) -> str:
    """Why a `fixed` or `schedule` policy's strategy of dp·tp·pp = `world` devices cannot run on this profile, or ''.

    Such a strategy uses all of the profile's devices or fills whole nodes: a run plans for those worlds only
    (`scheduler.device_counts`, which asks this), and a backend launches them on fewer nodes (Slurm resubmits with
    the smaller `--nodes`)."""
    nodes, per_node = profile.nodes, profile.gpus_per_node
    if world <= profile.num_gpus and world % per_node == 0:
        return ""
    if nodes == 1:
        return (f"dp·tp·pp={world} but the profile's one node has {per_node} devices and a strategy uses them all; "
                f"choose dp, tp and pp whose product is {per_node}")  # fmt: skip
    return (f"dp·tp·pp={world}, but a fixed or schedule strategy uses all {profile.num_gpus} devices or fills whole "
            f"nodes of {per_node}; choose dp, tp and pp whose product is a multiple of {per_node} up to "
            f"{profile.num_gpus}")  # fmt: skip


def strategy_reason(strategy: Strategy, *, profile: ClusterProfile, job: Job) -> str:
    """Why the planner would not run `strategy`, a `fixed` or `schedule` policy's, on this profile, or '' if it
    would: the rules of `enumerate_candidates` for the strategy's own world and global batch, in their words.

    A named strategy may lie outside the job's `gbs_choices`/`mbs_choices` (not outside its batch bounds); whether
    its pipeline stages may be unequal is decided at its global batch, as for every candidate (`uneven_batches`)."""
    dp, tp, pp, mbs, gbs = strategy.dp, strategy.tp, strategy.pp, strategy.mbs, strategy.gbs
    # What no world or batch changes first, then the world, then the rules at its world and batch.
    problem = layout_reason(job=job, profile=profile, dp=dp, tp=tp, pp=pp, uneven=True)
    problem = problem or named_world_reason(strategy.world_size, profile)
    if problem:
        return problem
    even = _enumerate(profile=profile, job=job, devices=strategy.world_size, gbs_list=[gbs], feasible_only=True,
                      uneven=False)  # fmt: skip
    uneven = bool(uneven_batches(even, [gbs]))
    problem = layout_reason(job=job, profile=profile, dp=dp, tp=tp, pp=pp, uneven=uneven)
    return evaluate(profile=profile, job=job, dp=dp, tp=tp, pp=pp, mbs=mbs, gbs=gbs, layout_problem=problem).reason


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

    Pipeline stages are equal at every global batch that some even split of the layers runs on these devices; at a
    batch that none runs (`uneven_batches`), the layouts with the layers split as evenly as they can be are its
    candidates too (`layout_reason`'s `uneven`)."""
    devices = num_devices or profile.num_gpus
    gbs_list = gbs_values if gbs_values is not None else job.batch.candidate_gbs()
    even = _enumerate(profile=profile, job=job, devices=devices, gbs_list=gbs_list, feasible_only=feasible_only,
                      uneven=False)  # fmt: skip
    uneven_gbs = uneven_batches(even, gbs_list)
    if not uneven_gbs:
        return even
    # No even split of the layers runs these batches on these devices (the odd factor of 3 nodes of 8 GPUs, which
    # a 16-layer model's stages and heads cannot take, nor a power-of-two batch's data parallelism): split them as
    # evenly as they can be, as the trainer does.
    uneven = _enumerate(profile=profile, job=job, devices=devices, gbs_list=uneven_gbs, feasible_only=feasible_only,
                        uneven=True)  # fmt: skip
    # The uneven pass's candidates replace the even pass's rejections of the same layouts at those batches (where
    # neither pass finds anything, `cona plan --all` shows why each uneven layout failed, not only that it is one);
    # a stable sort restores the enumeration's order.
    layers, replaced = job.model.num_layers, set(uneven_gbs)
    merged = [c for c in even if layers % c.strategy.pp == 0 or c.strategy.gbs not in replaced] + uneven
    mbs_order = {m: i for i, m in enumerate(job.batch.mbs_choices)}
    gbs_order = {g: i for i, g in enumerate(gbs_list)}
    return sorted(merged, key=lambda c: (c.strategy.tp, c.strategy.pp, mbs_order[c.strategy.mbs],
                                         gbs_order[c.strategy.gbs]))  # fmt: skip


def uneven_batches(even: list[Candidate], gbs_list: list[int]) -> list[int]:
    """The global batches of `gbs_list` at which the planner plans pipeline stages of unequal size: those at which
    no candidate of the even pass (`_enumerate` with `uneven` False, on the same devices) is feasible.

    Equal stages are preferred where they run: with unequal ones every stage but the largest waits for its extra
    block at each micro-batch, their pricing rests on one published record (BLOOM's, docs/costmodel.md), and on
    devices an even split suits the plans stay the even ones. The question is asked per global batch, never once
    for all of them: candidates of one batch are the ones that compete (`ties_with_best`), so a batch added to the
    choices never takes candidates away from another, and `cona plan --gbs N`, a `fixed` strategy and a run's
    candidates agree at N. (Not per micro-batch: which layouts train a global batch is the choice, and the
    micro-batch is then tuned within the layout.)"""
    served = {c.strategy.gbs for c in even if c.feasible}
    return [g for g in gbs_list if g not in served]


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


def batch_hint(profile: ClusterProfile, job: Job, devices: int, gbs_values: list[int] | None) -> str:
    """When nothing is feasible and the device count has an odd factor that no candidate global batch is a multiple
    of (3 nodes of 8 GPUs and the default power-of-two batches), that is the usual cause: the data-parallel degree
    has to take part of the factor unless tensor and pipeline degrees take all of it. Say so, and which batches
    would do — but only when it is the cause: when some strategy the batch rule rejects at every one of the batches
    would be feasible at those it names (not when tp and pp take the factor and memory rejects everything). ''
    when that is not the cause; otherwise a clause ending in '; ' to go before the next one."""
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
    if not fitting:  # no batch of this range splits into these micro-batches on any share of the factor: not the cause
        return ""
    shown = sorted(sorted(fitting, key=lambda g: (abs(math.log(g / base)), g))[:4])
    if not _batch_rule_is_the_cause(profile, job, devices, batches, shown):
        return ""
    example = f" e.g. batch.gbs_choices={shown}" if fitting else f" a batch range that holds a multiple of {odd}"
    if fitting and job.batch.base_gbs % odd:
        example += f" with batch.base_gbs={base}"
    return (f"{devices} devices have the factor {odd}, and none of the global batches {batches} is a multiple of "
            f"it: give{example}, or use a power-of-two number of devices; ")  # fmt: skip


def _batch_rule_is_the_cause(profile: ClusterProfile, job: Job, devices: int, batches: list[int],
                             shown: list[int]) -> bool:  # fmt: skip
    """`batch_hint`'s test: some strategy would be feasible at the batches it names (`shown`) and its micro-batches
    split none of `batches` over its replicas. Without batches to name (none within the job's bounds splits), some
    layout the planner allows leaves part of the odd factor to the data-parallel degree."""
    if shown:
        return any(all(batch_reason(job=job, dp=c.dp, pp=c.pp, mbs=c.mbs, gbs=g) for g in batches)
                   for c in enumerate_candidates(profile=profile, job=job, num_devices=devices, gbs_values=shown,
                                                 feasible_only=True))  # fmt: skip
    for tp in _divisors(devices):
        for pp in _divisors(devices // tp):
            dp = devices // (tp * pp)
            if dp & (dp - 1) and not layout_reason(job=job, profile=profile, dp=dp, tp=tp, pp=pp, uneven=True):
                return True
    return False


def memory_hint(profile: ClusterProfile, candidates: list[Candidate]) -> str:
    """When nothing is feasible and memory is what rejects every candidate the layout and batch rules allow (a
    small device, a long sequence), say so with the smallest need ('' when that is not the cause; otherwise a clause
    ending in '; ' to go before the next one)."""
    predicted = [c for c in candidates if c.prediction is not None]
    if not predicted or any(c.feasible for c in candidates):
        return ""
    smallest = min(predicted, key=lambda c: c.memory_gb)
    usable = profile.accelerator.memory_bytes
    need, have = _gb_apart(smallest.memory_gb * 1e9, usable)
    head = (f"every strategy the layout and batch rules allow needs more than accelerator.memory="
            f"{profile.accelerator.memory!r} ({have} GB) per device, the least {need} GB ({smallest.strategy.short()})")
    # Parameters, gradients and optimizer states do not shrink with recompute or the sequence: when even the fewest
    # of them exceed the device, naming those would send the user after a change that cannot fit the model.
    states = min(c.prediction.model_state_bytes for c in predicted if c.prediction is not None)
    if states > usable:
        return (f"{head}, and the parameters, gradients and optimizer states alone need at least "
                f"{_gb_apart(states, usable)[0]} GB per device in every one: give more devices (FSDP shards them "
                "over the data-parallel replicas), devices with more memory, or a smaller model; ")  # fmt: skip
    return (f"{head}: give devices with more memory, parallel.recompute=full (activations recomputed in backward) if "
            "it is not, or a smaller model or model.seq_len; ")  # fmt: skip


def device_hint(profile: ClusterProfile, job: Job, devices: int, gbs_values: list[int] | None,
                batch_field: str = "batch.max_gbs") -> str:  # fmt: skip
    """When nothing is feasible because `devices` are more than any layout of the job can use, say how many it can
    and what to change ('' when that is not the cause; otherwise a clause ending in '; ' to go before the next one).
    `batch_field` names what sets the largest of `gbs_values` (default: all of the job's candidate batches).

    A layout uses dp·tp·pp devices with dp·mbs at most the largest global batch (gbs is a multiple of it), and tp
    and pp bounded by the model (`layout_reason`): tiny-llama (2 key/value heads, 4 layers, gbs ≤ 128 in
    micro-batches of 2 or more) uses at most 64·2·4 = 512 devices, so on 128 nodes of 8 every candidate is rejected
    for a reason that names no device count at all."""
    largest, smallest_mbs = max(gbs_values or job.batch.candidate_gbs()), min(job.batch.mbs_choices)
    dp_max = largest // smallest_mbs
    if not dp_max:
        return (f"no micro-batch of batch.mbs_choices fits the largest global batch {largest} (the smallest is "
                f"{smallest_mbs}): add smaller ones, or raise {batch_field}; ")  # fmt: skip
    # tp divides the heads (`feasibility.layout_problem`); uneven stages count, as the planner may split them so.
    layouts = [(tp * pp, tp, pp) for tp in _divisors(job.model.num_heads) for pp in range(1, job.model.num_layers + 1)
               if not layout_reason(job=job, profile=profile, dp=dp_max, tp=tp, pp=pp, uneven=True)]  # fmt: skip
    model_ranks, tp, pp = max(layouts, default=(0, 0, 0))
    usable = dp_max * model_ranks
    if devices <= usable:
        return ""
    if not usable:
        return f"no tp and pp of {job.name} pass the model's layout rules on {profile.name}; "
    # An elastic run starts on the largest node count of its range that can start: its lower end is what to lower.
    per_node, nodes = profile.gpus_per_node, "min_nodes" if profile.min_nodes is not None else "nodes"
    if usable >= per_node:
        change = f"set {nodes} to at most {usable // per_node} (--profile-set {nodes}={usable // per_node})"
    else:  # not one whole node: one node, with fewer devices on it
        sets = [f"--profile-set {n}=1" for n in ("nodes", "min_nodes")
                if (profile.nodes if n == "nodes" else profile.min_nodes or 1) > 1]  # fmt: skip
        sets.append(f"--profile-set gpus_per_node={usable}")
        one = "one node with " if len(sets) > 1 else ""
        change = f"use {one}at most {usable} devices ({' '.join(sets)})"
    why = f"dp ≤ {dp_max} replicas of mbs ≥ {smallest_mbs} in the largest global batch, tp ≤ {tp}, pp ≤ {pp}"
    return (f"{devices} devices are more than {job.name} can use, at most {usable} devices ({why}): {change}, or "
            f"raise {batch_field}; ")  # fmt: skip


def no_feasible_strategy(profile: ClusterProfile, job: Job) -> str:
    """What a run says when no strategy of any world it plans for is feasible: `cona render`/`submit`/`run` before
    the run exists (`cli.first_strategy`) and its scheduler after (a resumed run, the Kubernetes orchestrator),
    in the same words, with the usual cause when it is that (`device_hint`, `batch_hint`, `memory_hint`)."""
    memory = memory_hint(profile, enumerate_candidates(profile=profile, job=job))
    # The smallest world of an elastic range: a run would start there if it were small enough.
    fewest = (profile.min_nodes or profile.nodes) * profile.gpus_per_node
    return (f"no feasible strategy for {job.name} on {profile.name}; {device_hint(profile, job, fewest, None)}"
            f"{batch_hint(profile, job, profile.num_gpus, None)}{memory}run `cona plan --all` to see why")  # fmt: skip


def rank_by_iter_time(candidates: list[Candidate]) -> list[Candidate]:
    """Feasible candidates, fastest iteration first (ties: more samples/s, then fewer pipeline stages)."""
    feasible = [c for c in candidates if c.feasible]
    return sorted(feasible, key=lambda c: (c.iter_time_s, -c.samples_per_s, c.pp, c.tp, c.dp, c.mbs, c.gbs))


def ties_with_best(
    ranked: list[Candidate], *, error: float = MODEL_ERROR, time_s: Callable[[Candidate], float] | None = None
) -> set[Strategy]:  # fmt: skip
    """The feasible strategies whose predicted time is within the model's own error of the fastest at their gbs.

    Candidates of one global batch train the same samples per step, so only they compete; among them, the
    model cannot tell apart predictions closer than its error (`costmodel.MODEL_ERROR`). `time_s`: the times to
    compare instead of the predictions (`cona plan --measured` ranks by calibrated ones: a strategy measured far
    slower than the fastest of its batch is no tie with it, whatever the cost model predicted)."""
    time_of = time_s or (lambda c: c.iter_time_s)
    best: dict[int, float] = {}
    for c in ranked:
        best[c.gbs] = min(best.get(c.gbs, float("inf")), time_of(c))
    return {c.strategy for c in ranked if time_of(c) <= best[c.gbs] * (1 + error)}


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
            f"{device_hint(profile, job, devices, [job.batch.base_gbs], 'batch.base_gbs')}"
            f"{batch_hint(profile, job, devices, [job.batch.base_gbs])}reasons: {'; '.join(reasons[:3])}"
        )
    return ranked[0]
