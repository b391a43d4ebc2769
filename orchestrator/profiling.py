"""`cona profile`: measure a few strategies on the real cluster before training, and start a run from them.

The cost model ranks strategies well but misses a machine's absolute step times, and not by one factor (a fixed
cost per step that a larger batch amortises; `cona.orchestrator.throughput`). A run learns that calibration from
the strategies it runs, so its *first* choice rests on the uncalibrated model. `cona profile` runs the job for a
few steps on each of a handful of strategies — one run, switching in place between them (the `schedule` policy) —
and writes the step times it measured to `RUN_DIR/measured.json`; `cona run --measured RUN_DIR` starts a run with
those measurements in its throughput model, as if it had run them itself, so the start, the calibration of every
other strategy and the first switches already know the machine.

Which strategies: the base batch's fastest layout (by the cost model) — where a run starts — at the base batch and
at the other global batches from half the base batch to four times it, so the calibration sees the batch's effect
on one layout's step time and can separate its fixed cost from its per-sample cost; then the other layouts at the
base batch, fastest first, each once; up to `--top` in all (`pick_strategies`), or the ones named by
`--strategies`. The measurements hold only for the hardware and the model they were taken on: a run whose profile
(accelerator, network, devices per node, backend) or job (model, parallel settings, gradient statistics) differs
refuses them, naming the first field that differs.

Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

from cona.orchestrator.job import Job, job_to_dict
from cona.orchestrator.planner import Candidate
from cona.orchestrator.profile import ClusterProfile
from cona.orchestrator.throughput import checked_measurements
from cona.protocol.rundir import RunDir, atomic_write_text
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

MEASURED_FILE = "measured.json"
"""What `cona profile` writes into its run directory (its one writer)."""
DEFAULT_TOP = 6
"""Strategies measured by default."""
DEFAULT_HEARTBEATS = 15
"""Heartbeats per strategy by default: the first after each switch is warm-up and the throughput model keeps the
median of the last 9, so 15 leave a full window of steady ones."""
PROFILE_FIELDS = ("backend", "gpus_per_node", "accelerator", "network")
"""The profile's fields a measured step time depends on (not the node count: the strategies name their world)."""
JOB_FIELDS = ("model", "parallel", "heartbeat.gradient_stats", "heartbeat.adam_stats")
"""The job's fields a measured step time depends on (not the data, optimizer, batch bounds or policy)."""
UNCOMPARED = ("job.model.preset", "job.model.init_from")
"""Fields of `JOB_FIELDS`' sections that name the model or say where its first weights come from, not what a step
computes (the preset's dimensions are compared, filled in): the same model spelled out, or a run that starts from
an exported checkpoint, keeps the measurements. Left out of new records and ignored in older ones."""


def _comparable(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """`fingerprint` without the `UNCOMPARED` fields (a copy)."""
    out = dict(fingerprint)
    for dotted in UNCOMPARED:
        key, _, field = dotted.rpartition(".")
        if isinstance(out.get(key), dict):
            out[key] = {k: v for k, v in out[key].items() if k != field}
    return out


@dataclasses.dataclass
class MeasuredRecord:
    """`measured.json`: the step times `cona profile` measured, and what they were measured on."""

    measured: list[dict[str, Any]]
    """The throughput model's entries (`ThroughputModel.to_dict()["measured"]`): strategy, recent step times, count,
    the cost model's prediction."""
    fingerprint: dict[str, Any]
    """The profile's `PROFILE_FIELDS` and the job's `JOB_FIELDS` of the profiling run (`fingerprint`)."""
    profile: str
    """The profile's name, for people reading the file."""
    created: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def fingerprint(profile: ClusterProfile, job: Job) -> dict[str, Any]:
    """What a measured step time depends on, as plain data (compared field by field by `check_compatible`)."""
    prof = profile.model_dump(mode="json")
    spec = job_to_dict(job)
    out: dict[str, Any] = {f"profile.{k}": prof.get(k) for k in PROFILE_FIELDS}
    for dotted in JOB_FIELDS:
        value: Any = spec
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        out[f"job.{dotted}"] = value
    return _comparable(out)


def _first_difference(a: Any, b: Any, path: str) -> str | None:
    """The dotted path of the first leaf where `a` and `b` differ, with both values; None if equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = _first_difference(a.get(key), b.get(key), f"{path}.{key}")
            if found:
                return found
        return None
    return None if a == b else f"{path} is {b!r} here but {a!r} where it was measured"


def check_compatible(record: MeasuredRecord, source: Path, profile: ClusterProfile, job: Job) -> None:
    """Raise ConfigError (one line) when `record` was measured on another machine or model than this run's."""
    here, there = fingerprint(profile, job), _comparable(record.fingerprint)
    for key in sorted(set(there) | set(here)):
        difference = _first_difference(there.get(key), here.get(key), key)
        if difference:
            raise ConfigError(
                f"--measured {source}: measured on another setup ({difference}); profile this one with "
                f"`cona profile` and the same --profile/--job"
            )


def _check_runnable(record: MeasuredRecord, source: Path, profile: ClusterProfile, job: Job) -> None:
    """ConfigError (one line) for an entry whose strategy this job could never run on this profile: a record edited
    by hand (`cona profile` measures only what ran) would otherwise calibrate the model with it."""
    from cona.protocol.feasibility import strategy_problem

    for i, entry in enumerate(record.measured):
        strategy = Strategy.from_dict(entry["strategy"])
        problem = strategy_problem(job, strategy, gpus_per_node=profile.gpus_per_node)
        if not problem and strategy.world_size > profile.num_gpus:
            problem = f"it needs {strategy.world_size} devices, the profile has {profile.num_gpus}"
        if problem:
            raise ConfigError(f"--measured {source}: entry {i} ({strategy.short()}) is no strategy of this run: "
                              f"{problem}; profile again")  # fmt: skip


def load_compatible(path: str | Path, profile: ClusterProfile, job: Job) -> tuple[MeasuredRecord, Path]:
    """`load_measured`, refused (`check_compatible`) when measured on another setup than `profile` and `job`'s:
    what `cona run --measured` and `cona plan --measured` read."""
    record, source = load_measured(path)
    check_compatible(record, source, profile, job)
    _check_runnable(record, source, profile, job)
    return record, source


def load_measured(path: str | Path) -> tuple[MeasuredRecord, Path]:
    """The record at `path` (a `cona profile` run directory or its measured.json) and the file it came from."""
    source = Path(path)
    if source.is_dir():
        source = source / MEASURED_FILE
    if not source.is_file():
        raise ConfigError(
            f"--measured {path}: no {MEASURED_FILE} there; give the run directory of a finished `cona profile`"
        )
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
        record = MeasuredRecord(
            measured=checked_measurements(data["measured"]), fingerprint=dict(data["fingerprint"]),
            profile=str(data.get("profile", "")), created=float(data.get("created", 0.0)),
        )  # fmt: skip
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(
            f"--measured {source}: not a measurement record written by `cona profile` ({type(e).__name__}: {e}); "
            f"profile again"
        ) from None
    if not record.measured:
        raise ConfigError(f"--measured {source}: it holds no measured strategy; profile again with more --steps")
    return record, source


def write_measured(run_dir: RunDir, *, profile: ClusterProfile, job: Job, measured: list[dict[str, Any]]) -> Path:
    """Write the profiling run's record (`cona profile`, after its run ended)."""
    record = MeasuredRecord(measured=measured, fingerprint=fingerprint(profile, job), profile=profile.name,
                            created=time.time())  # fmt: skip
    path = run_dir.root / MEASURED_FILE
    atomic_write_text(path, json.dumps(record.to_dict(), indent=1) + "\n")
    return path


# ---------------------------------------------------------------------------------------------------- what to measure


def pick_strategies(candidates: list[Candidate], *, base_gbs: int, top: int) -> list[Strategy]:
    """The strategies `cona profile` measures, `top` in all, from candidates of one world size (the caller's):

    1. the base batch's fastest layout — where a run starts — at the base batch, then at the other batches of
       [base/2, 4·base] where it runs (nearest first, the larger on a tie): one layout at several batches is what
       tells its fixed cost per step from its per-sample cost (`throughput.fit_affine`), and the scale it finds
       carries to the layouts measured once;
    2. then the other layouts at the base batch, fastest first, each once: each one's own fixed cost.

    "Fastest" is the cost model's predicted iteration time per sample; a layout at a batch runs its fastest
    micro-batch there."""
    if top < 1:
        raise ValueError(f"--top must be at least 1, got {top}")
    feasible = [c for c in candidates if c.feasible]
    if not feasible:
        return []

    def speed(c: Candidate) -> tuple[float, int, int, int]:
        return (c.iter_time_s / c.gbs, c.pp, c.tp, c.mbs)

    fastest: dict[tuple[int, tuple[int, int, int]], Candidate] = {}  # (gbs, layout) → its fastest micro-batch
    for c in sorted(feasible, key=speed):
        fastest.setdefault((c.gbs, c.strategy.layout()), c)
    batches = sorted({g for g, _ in fastest})
    base = base_gbs if base_gbs in batches else min(batches, key=lambda g: (abs(g - base_gbs), g))
    at_base = sorted((c for (g, _), c in fastest.items() if g == base), key=speed)
    start = at_base[0].strategy.layout()
    others = sorted((g for g in batches if base / 2 <= g <= 4 * base and g != base and (g, start) in fastest),
                    key=lambda g: (abs(math.log(g / base)), -g))  # fmt: skip
    picked = [fastest[(g, start)].strategy for g in [base, *others]]
    picked += [c.strategy for c in at_base[1:]]
    return picked[:top]


MAX_STEPS = 100_000
"""The most `--steps` per strategy `cona profile` takes."""


def schedule_for(strategies: list[Strategy], *, steps: int) -> tuple[list[dict[str, Any]], int]:
    """`policy.schedule` entries that run each strategy for `steps` steps, one after the other, and the samples at
    which the last one ends: the profiling run stops there, not at a validation target."""
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    entries, samples = [], 0
    for s in strategies:
        entries.append({"samples": samples, "strategy": str(s)})
        samples += steps * s.gbs
    return entries, samples


def profiling_job(profile: ClusterProfile, job: Job, *, top: int | None, strategies: str | None,
                  steps: int | None) -> tuple[Job, list[Strategy], int]:  # fmt: skip
    """The job `cona profile` runs — `job` with a `schedule` policy over the strategies to measure, ending after the
    last one (no validation target, no evaluations, no periodic checkpoints: they would sit in the step times) —
    the strategies, and the steps each gets. Raises ValueError/ConfigError (one line) for a bad choice."""
    from cona.orchestrator.job import job_from_dict
    from cona.orchestrator.planner import enumerate_candidates, no_feasible_strategy

    candidates = enumerate_candidates(profile=profile, job=job, num_devices=profile.num_gpus, feasible_only=True)
    if not candidates:
        raise ConfigError(no_feasible_strategy(profile, job))
    if strategies is not None:  # an empty --strategies "" names no strategy, as ";;" does: not the default set
        if top is not None:
            raise ConfigError("give --top or --strategies, not both")
        chosen = []
        for i, text in enumerate(t for t in strategies.split(";") if t.strip()):
            try:
                chosen.append(Strategy.parse(text))
            except ValueError as e:
                raise ConfigError(f"--strategies entry {i} ({text.strip()!r}): {e}") from None
        if not chosen:
            raise ConfigError("--strategies names no strategy; e.g. 'dp=4,tp=1,pp=1,mbs=8,gbs=32'")
        _check_worth_measuring(chosen, job)
    else:
        chosen = pick_strategies(candidates, base_gbs=job.batch.base_gbs, top=DEFAULT_TOP if top is None else top)
    interval = job.heartbeat.interval_steps
    if steps is not None and steps < 2 * interval:
        # Checked before anything runs: the first heartbeat after each switch is warm-up, so with fewer steps the
        # whole profiling run (a cluster allocation) would end with no measurement.
        raise ConfigError(f"--steps {steps} gives each strategy fewer than 2 heartbeats (heartbeat.interval_steps="
                          f"{interval}; the first after each switch is warm-up): give at least {2 * interval} "
                          f"(default {DEFAULT_HEARTBEATS * interval})")  # fmt: skip
    steps = DEFAULT_HEARTBEATS * interval if steps is None else steps
    if steps > MAX_STEPS:  # a profile is minutes of measurement, not a training run (and 10**20 overflowed a field)
        raise ConfigError(f"--steps {steps}: a profile measures each strategy for a few heartbeats; give at most "
                          f"{MAX_STEPS:,} (default {DEFAULT_HEARTBEATS * interval})")  # fmt: skip
    entries, end = schedule_for(chosen, steps=steps)
    spec = job_to_dict(job)
    spec["policy"] = {**spec["policy"], "name": "schedule", "schedule": entries}
    spec["target"] = {**spec["target"], "val_perplexity": None, "max_samples": end, "max_time_s": None}
    spec["eval"] = {**spec["eval"], "interval_samples": end + 1}
    spec["checkpoint"] = {**spec["checkpoint"], "interval_steps": steps * len(chosen) + 1}
    return job_from_dict(spec, source="cona profile"), chosen, steps


def _check_worth_measuring(chosen: list[Strategy], job: Job) -> None:
    """ConfigError (one line) for a `--strategies` entry whose measurement no run could use: one named twice (the
    second visit is one more warm-up and the same numbers), or one outside the job's micro- and global batches, which
    a run never ranks and the cost model therefore never predicts, so its step time calibrates nothing (a strategy
    that cannot run at all is the schedule's to refuse, in its words)."""
    batches = job.batch.candidate_gbs()
    for i, s in enumerate(chosen):
        if s in chosen[:i]:
            raise ConfigError(f"--strategies entry {i} ({s}) repeats entry {chosen.index(s)}: each strategy is "
                              "measured once; drop one")  # fmt: skip
        if s.mbs not in job.batch.mbs_choices:
            problem = f"mbs={s.mbs} is not among batch.mbs_choices {job.batch.mbs_choices}"
        elif s.gbs not in batches:
            problem = (f"gbs={s.gbs} is not among the global batches a run ranks {batches} (batch.gbs_choices, or "
                       "the powers of two within the batch bounds and batch.base_gbs)")  # fmt: skip
        else:
            continue
        raise ConfigError(f"--strategies entry {i} ({s}): {problem}, so a run never ranks it and its step time "
                          "would calibrate nothing; name one that `cona plan` lists")  # fmt: skip


def finish_profile(run_dir: RunDir, *, profile: ClusterProfile, job: Job, state: Any) -> str:
    """Write the finished profiling run's measured.json and return its table (measured against predicted)."""
    throughput = (state.model or {}).get("throughput") or {}
    measured = [e for e in throughput.get("measured", []) if e.get("times")]
    if not measured:
        raise ConfigError(f"{run_dir.root}: the profiling run measured no step time; give it more --steps")
    path = write_measured(run_dir, profile=profile, job=job, measured=measured)
    lines = ["strategy              heartbeats  predicted   measured  measured/predicted  samples/s"]
    for e in measured:
        s = Strategy.from_dict(e["strategy"])
        t = float(e["time_s"])  # the time `ThroughputModel.to_dict` writes beside the times (`throughput.undisturbed_time_s`)
        predicted = e.get("predicted_s")
        ratio = f"{t / predicted:.2f}" if predicted else "—"
        shown = f"{predicted:.4f} s" if predicted else "—"
        lines.append(f"{s.short():<22}{e.get('count', len(e['times'])):>10}  {shown:>9}  {t:.4f} s  {ratio:>18}  "
                     f"{s.gbs / t:>9.1f}")  # fmt: skip
    for fit in throughput.get("calibration", []):
        layout = fit["layout"]
        lines.append(f"layout d{layout['dp']}t{layout['tp']}p{layout['pp']}: step ≈ {fit['fixed_s']:.4f} s + "
                     f"{fit['scale']:.2f} × predicted{'' if fit['determined'] else ' (one batch measured: the split is a guess)'}")  # fmt: skip
    lines.append(f"wrote {path}; start a run from it: cona run --profile … --job … --measured {run_dir.root}")
    return "\n".join(lines)
