"""`cona report`: a PNG (validation loss vs wall time with switches, noise scale vs samples, throughput per
strategy) and a Markdown summary, from the run directory alone."""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cona.orchestrator.runstate import (
    RunState,
    happened_at,
    launched_without_state,
    load_run,
    read_events,
    read_state,
    switch_events,
    unlogged_attempts,
    warn_skipped,
)
from cona.protocol.heartbeat_record import Heartbeat, perplexity, throughput_windows
from cona.protocol.rundir import RunDir, read_jsonl
from cona.protocol.samples_log import SamplesAudit, SamplesAuditError, audit
from cona.protocol.strategy import Strategy


def _heartbeats(run_dir: RunDir, skipped: list[str]) -> tuple[list[dict[str, Any]], list[Heartbeat]]:
    """Every usable heartbeat of the run by time, and those that measure throughput (`throughput_windows`: after
    each attempt's warm-up, as the run model counts them), picked in each file's own order."""
    beats, measured = [], []
    if run_dir.heartbeats.is_dir():
        for path in sorted(run_dir.heartbeats.glob("*.jsonl"), key=lambda p: int(p.stem) if p.stem.isdigit() else 0):
            records = read_jsonl(path, damaged=skipped)[0]
            typed = [(b, hb) for b in records if (hb := _typed(b)) is not None]
            skipped.extend([f"{path}: a heartbeat the typed record does not accept"] * (len(records) - len(typed)))
            beats.extend(b for b, _ in typed)
            measured.extend(throughput_windows(hb for _, hb in typed))
    return sorted(beats, key=lambda b: b.get("time", 0)), sorted(measured, key=lambda hb: hb.time)


def _heartbeats_lost(run_dir: RunDir, state: RunState, beats: list[dict[str, Any]]) -> str | None:
    """A warning line when the heartbeat files end short of the samples state.json recorded from them, or None.

    The report counts samples, steps and each attempt's throughput from the heartbeat files alone: with
    `heartbeats/4.jsonl` deleted it said 11,904 samples for a run that reached 16,320, without a word."""
    recorded = state.live.get("samples")
    counted = max((b["samples"] for b in beats if isinstance(b.get("samples"), int)), default=0)
    if not isinstance(recorded, int) or recorded <= counted:
        return None
    gone = [run_dir.heartbeat_file(a.number) for a in state.attempts if not run_dir.heartbeat_file(a.number).exists()]
    if gone:
        what = f"{gone[0]} is missing" + (f" (and {len(gone) - 1} more heartbeat files)" if len(gone) > 1 else "")
    else:
        what = f"the heartbeat files in {run_dir.heartbeats} were cut short or replaced"
    return (f"cona: warning: {what}: the report counts {counted:,} samples from the heartbeats left, but state.json "
            f"recorded {recorded:,}; restore them from a backup for the whole run")  # fmt: skip


def resume_point(run_dir: RunDir) -> tuple[int, Path | None] | None:
    """Where a resume of this run would go on: the step of the checkpoint it would load (`newest_intact_checkpoint`)
    and that checkpoint, (0, None) when there is none (it starts from sample 0), None when its trainer_state.json
    cannot be read here (nothing can be said)."""
    from cona.orchestrator.live import newest_intact_checkpoint
    from cona.protocol.rundir import TRAINER_STATE, read_json

    latest, _ = newest_intact_checkpoint(run_dir)
    if latest is None:
        return 0, None
    try:
        step = read_json(latest / TRAINER_STATE)["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (step, latest) if isinstance(step, int) and not isinstance(step, bool) else None


def _sample_order(run_dir: RunDir, *, counted: int, final: bool) -> tuple[str | None, SamplesAudit | None]:
    """The report's line on the order the samples were trained in (`samples/<attempt>.jsonl`, `samples_log.audit`):
    the model's history covers samples 0..N-1 once each, or why that cannot be said (also warned on stderr, since
    nothing else reads these files); and the audit, when there is one. None for a run without a samples log (not
    started, or older than the log).

    For an ended run the history ends at the checkpoint a resume would load (`resume_point`): the steps trained
    after it (a failed run's last crash) were lost with the attempt that trained them and are said as rolled back,
    not counted as the model's."""
    point = resume_point(run_dir) if final else None
    try:
        found = audit(run_dir, resumes_at=point[0] if point is not None else None)
    except (SamplesAuditError, OSError) as e:
        print(f"cona: warning: {run_dir.samples_log}: {e}; the report cannot vouch for the order the samples were "
              "trained in (training does not read these files)", file=sys.stderr, flush=True)  # fmt: skip
        return f"- sample order: not verified ({e})", None
    if not found.files:
        return None, None
    if found.samples:
        line = (f"- sample order: the model's history covers samples 0–{found.samples - 1:,} once each, in order, "
                f"across {found.files} attempt(s) (`samples/`, audited)")  # fmt: skip
    else:
        line = f"- sample order: the model's history holds no sample yet, across {found.files} attempt(s) (`samples/`, audited)"
    if found.retrained_steps:
        line += (f"; {found.retrained_steps} step(s) trained again after a crash or a damaged checkpoint, the "
                 "checkpoint that would have kept them never written or passed over (their updates were lost with it)")  # fmt: skip
    if found.rolled_back and point is not None:
        step, checkpoint = point
        since = f"checkpoint `{checkpoint.name}` (step {step})" if checkpoint else "the start (no complete checkpoint)"
        line += (f"; rolled back: {len(found.rolled_back)} step(s) after {since}, samples "
                 f"{found.rolled_back[0][0]:,}–{found.trained - 1:,}, trained by the attempt that ended the run and "
                 "lost with it (a resume goes on from that checkpoint and trains them again)")  # fmt: skip
    if final and found.trained != counted:
        line += f"; the heartbeats count {counted:,} samples"
        if found.trained < counted:  # an attempt's log lost or cut short: the rest of the history went unseen
            print(f"cona: warning: {run_dir.samples_log}: the logs cover samples 0–{max(found.trained - 1, 0):,}, but "
                  f"the heartbeats count {counted:,}; the report cannot vouch for the order of the rest", file=sys.stderr,
                  flush=True)  # fmt: skip
    return line, found


def _typed(record: dict[str, Any]) -> Heartbeat | None:
    """The heartbeat of `record`, or None where the typed record does not accept it (a damaged line that still
    parses as JSON is skipped, as the scheduler skips it)."""
    try:
        hb = Heartbeat.from_dict(record)
        Strategy.from_dict(hb.strategy)
    except (TypeError, ValueError):
        return None
    return hb


END_EVENTS = ("done", "stopped", "failed")
"""The events the orchestrator logs when it ends a run (a resumed run logs another later)."""


def _wall_end(final: bool, events: list[dict[str, Any]], beats: list[dict[str, Any]]) -> float | None:
    """When the run's wall time ends: for an ended run, its last end event (the `elapsed_s` that `cona run` prints
    and the `done` event records: the trainer's exit and the orchestrator's follow-up are part of the run, and a
    run that ended before any heartbeat still took time); for a run going on, its latest heartbeat."""
    ends = [happened_at(e) for e in events if e.get("event") in END_EVENTS]
    if final and ends:
        return ends[-1]
    return beats[-1]["time"] if beats else None


def _pauses(events: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(ended, resumed) for each time the run lay ended (stopped or failed) until a `cona run --resume`."""
    pauses: list[tuple[float, float]] = []
    ended: float | None = None
    for e in events:
        if e.get("event") in END_EVENTS:
            ended = happened_at(e)  # a run that ended while no orchestrator watched ended then, not when logged
        elif e.get("event") == "resume-run" and ended is not None:
            pauses.append((ended, e["time"]))
            ended = None
    return pauses


def _run_clock(t0: float, pauses: list[tuple[float, float]]) -> Callable[[float], float]:
    """Seconds into the run at Unix time t: from its start, without the pauses before t (the scheduler's elapsed
    time, which a time budget and `cona run`'s `run … after` count)."""

    def run_time(t: float) -> float:
        return t - t0 - sum(max(0.0, min(t, resumed) - ended) for ended, resumed in pauses)

    return run_time


def _noise_axis_label(policy: str, critical_batch_factor: float) -> str:
    """The noise plot shows the estimator's own value (TensorBoard's noise/estimate). The cona policy ranks with
    `critical_batch_factor` times it (blended with the prior at first), which is the B_noise `cona status` and the
    live line print: say so, or the two read as disagreeing by that factor."""
    if policy == "cona":
        return f"estimate (samples); B_noise = {critical_batch_factor:g}× this"
    return "estimate (samples)"


def _short(s: dict[str, int]) -> str:
    return f"d{s['dp']}t{s['tp']}p{s['pp']} m{s['mbs']} g{s['gbs']}"


def write_report(run_dir: RunDir, *, out_dir: Path | None = None) -> tuple[Path, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from cona.orchestrator.noise import NoiseScaleEstimator

    profile, job = load_run(run_dir)
    state = read_state(run_dir)
    skipped: list[str] = []
    events = read_events(run_dir, skipped=skipped, settled=state.final)  # an ended run's torn tail is never finished
    beats, measured = _heartbeats(run_dir, skipped)
    warn_skipped(skipped)
    status, attempts = state.status, len(state.attempts)
    if launched := launched_without_state(run_dir, events):
        # As `cona status` says: launched, so state.json was written and is lost; not a run that never started.
        status, attempts = "unknown", len(launched)
        print(f"cona: warning: {run_dir.state_json} is missing, though {run_dir.events} logs launches: the report "
              "cannot say the run's status; restore it from a backup", file=sys.stderr)  # fmt: skip
    for lost in (unlogged_attempts(run_dir, state, events), _heartbeats_lost(run_dir, state, beats)):
        if lost is not None:  # records gone from the files the report counts from: say so rather than count less
            print(lost, file=sys.stderr, flush=True)
    out_dir = out_dir or run_dir.root
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = min([e["time"] for e in events if e.get("event") == "start"] or [b["time"] for b in beats[:1]] or [0.0])
    pauses = _pauses(events)
    clock = _run_clock(t0, pauses)

    # A NaN (a damaged line; a diverged trainer stops before it reports one) is no evaluation: min() of it gave
    # "best validation loss nan".
    evals = [b for b in beats if isinstance(b.get("val_loss"), int | float) and math.isfinite(b["val_loss"])]
    switches, aborted = switch_events(events)
    pol = job.policy
    noise = NoiseScaleEstimator(ema=pol.noise_ema, kind=pol.noise_estimator, min_updates=pol.min_noise_samples)
    noise_series = []
    for b in beats:
        noise.update(Heartbeat.from_dict(b))
        if noise.value is not None:
            noise_series.append((b["samples"], noise.value))
    per_strategy: dict[str, list[float]] = defaultdict(list)
    # The strategies table has a row per attempt: a strategy run again (a resume, a switch back) is measured anew.
    # Without each attempt's warm-up windows, as the run model (and so the policy and the live line) measures it.
    per_attempt: dict[int, list[float]] = defaultdict(list)
    for hb in measured:
        if hb.samples_per_s:
            per_strategy[_short(hb.strategy)].append(hb.samples_per_s)
            per_attempt[hb.attempt].append(hb.samples_per_s)

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    ax = axes[0]
    if evals:
        ax.plot([clock(b["time"]) for b in evals], [b["val_loss"] for b in evals], marker="o", ms=3, label="validation loss")
    for i, s in enumerate(switches):
        ax.axvline(clock(s["time"]), color="tab:red", ls="--", lw=1, label="switch" if i == 0 else None)
        ax.annotate(_short(s["to"]), (clock(s["time"]), ax.get_ylim()[1]), rotation=90, va="top", ha="right", fontsize=7)
    if job.target.val_perplexity:
        ax.axhline(math.log(job.target.val_perplexity), color="tab:green", ls=":", label="target")
    ax.set(xlabel="wall time (s)" + (", without the stops" if pauses else ""), ylabel="validation loss (nats/token)", title="Validation loss")
    ax.legend(fontsize=8)
    ax = axes[1]
    if noise_series:
        ax.plot(*zip(*noise_series, strict=True), color="tab:purple")
    ax.set(xlabel="samples", ylabel=_noise_axis_label(pol.name, pol.critical_batch_factor),
           title=f"Gradient noise scale estimate ({pol.noise_estimator})")  # fmt: skip
    ax = axes[2]
    names = list(per_strategy)
    ax.bar(range(len(names)), [sum(v) / len(v) for v in per_strategy.values()], color="tab:blue")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="samples/s", title="Measured throughput per strategy")
    fig.suptitle(f"{job.name} on {profile.name} — policy {pol.name}")
    fig.tight_layout()
    png = out_dir / "report.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)

    md = out_dir / "report.md"
    lines = [
        f"# {job.name} — {status}",
        "",
        f"- profile: `{profile.name}` ({profile.backend}, {profile.nodes}×{profile.gpus_per_node} {profile.accelerator.name})",
        f"- policy: `{pol.name}`; attempts: {attempts}; switches: {len(switches)}",
    ]
    end = _wall_end(state.final, events, beats)
    order, found = _sample_order(run_dir, counted=beats[-1].get("samples", 0) if beats else 0, final=state.final)
    if end is not None:  # heartbeats, or a run that ended before its first
        last = beats[-1] if beats else {}
        wall = f"{clock(end):.1f} s"
        if paused := sum(resumed - ended for ended, resumed in pauses if resumed <= end):
            wall += f" (without the {paused:.1f} s it lay stopped before `cona run --resume`)"
        counts = f"samples: {last.get('samples', 0):,}; steps: {last.get('step', 0)}"
        if found is not None and found.rolled_back:  # trained, but not the model's: said apart (sample order)
            kept = len(found.ranges)
            counts = (f"samples: {found.trained:,} trained, {found.samples:,} kept; steps: {kept + len(found.rolled_back)} "
                      f"trained, {kept} kept (the rest rolled back, see the sample order)")  # fmt: skip
        lines.append(f"- {counts}; wall time: {wall}")
    if order is not None:
        lines.append(order)
    if evals:
        best = min(evals, key=lambda b: b["val_loss"])
        lines.append(f"- best validation loss {best['val_loss']:.4f} (perplexity {perplexity(best['val_loss']):.3f}) "
                     f"at {best['samples']:,} samples")  # fmt: skip
    if job.target.val_perplexity:
        reached = [b for b in evals if perplexity(b["val_loss"]) <= job.target.val_perplexity]
        lines.append(
            f"- target perplexity {job.target.val_perplexity}: "
            + (f"reached at {clock(reached[0]['time']):.1f} s, {reached[0]['samples']:,} samples" if reached else "not reached")
        )
    lines += ["", "## Strategies", "", "| # | from (s) | strategy | samples/s (mean) | why |", "|---|---|---|---|---|"]
    launches = [e for e in events if e.get("event") == "launch"]
    for e in launches:
        name = _short(e["strategy"])
        rates = per_attempt.get(e["attempt"], [])
        # Samples over time: each window covers the same samples (one attempt's batch and heartbeat interval), so
        # that is the harmonic mean; the arithmetic one weighed the fast windows more (244.5 where 231 was trained).
        mean = f"{len(rates) / sum(1.0 / r for r in rates):.1f}" if rates else "-"
        lines.append(f"| {e['attempt']} | {clock(happened_at(e)):.1f} | `{name}` | {mean} | {e.get('reason', '')} |")
    if switches or aborted:
        lines += ["", "## Switch decisions", ""]
        listed = [(s, s.get("reason", "")) for s in switches]
        listed += [(s, f"aborted, {how} (not counted): {s.get('reason', '')}") for s, how in aborted]
        for s, why in sorted(listed, key=lambda item: item[0]["time"]):
            lines.append(f"- {clock(s['time']):.1f} s: `{_short(s['from'])}` → `{_short(s['to'])}` — {why}")
    completed = [e for e in events if e["event"] == "switch-complete"]
    if completed:
        def measured(e: dict) -> str:
            predicted = e.get("predicted_s")
            versus = f" (predicted {predicted:.1f} s)" if isinstance(predicted, int | float) else ""
            return f"{e['switch_cost_s']:.1f} s {str(e.get('kind', 'relaunch')).replace('_', ' ')}{versus}"

        lines.append("")
        lines.append("Measured switch cost (decision → first heartbeat of the new strategy): "
                     + ", ".join(measured(e) for e in completed))  # fmt: skip
    lines += ["", "![report](report.png)", ""]
    md.write_text("\n".join(lines))
    return png, md

