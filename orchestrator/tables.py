"""Human-readable tables for the terminal (rich)."""

from __future__ import annotations

from cona.orchestrator.costmodel import MODEL_ERROR
from cona.orchestrator.job import Job
from cona.orchestrator.planner import Candidate
from cona.orchestrator.profile import ClusterProfile
from cona.protocol.strategy import Strategy
from rich.console import Console
from rich.markup import escape
from rich.table import Table


def _fmt_time(seconds: float) -> str:
    if seconds >= 1e5:  # a profile with an absurdly slow link: keep the column readable
        return f"{seconds:.2e} s"
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def _fmt_memory(gb: float) -> str:
    """GB to two decimals, MB below 0.1 GB: a tiny model on the CPU (no CUDA context) needs a few MB, which would
    read `0.00 GB` as if it needed nothing."""
    return f"{gb:.2f} GB" if gb >= 0.1 else f"{gb * 1e3:.1f} MB"


def _fmt_rate(per_s: float) -> str:
    return f"{per_s:,.1f}" if per_s >= 0.1 or per_s == 0 else f"{per_s:.2e}"


_SOURCE_WORD = {"measured": "measured", "layout": "fitted", "degrees": "one point", "calibrated": "others"}
"""`ThroughputModel`'s tiers, as the plan table's `from` column says them."""


def print_plan(
    *, profile: ClusterProfile, job: Job, shown: list[Candidate], rejected: list[Candidate], num_feasible: int,
    num_total: int, ties: set[Strategy] = frozenset(),
    calibrated: dict[Strategy, tuple[float, str]] | None = None, measured_in: str | None = None,
) -> None:  # fmt: skip
    """The plan table. With `calibrated` (step time and its source per strategy, from measured step times in
    `measured_in`), `shown` is in that order and the table shows both times: the cost model's and the calibrated one."""
    console = Console(width=160)
    model = job.model
    # Names come from the user's YAML: `[...]` in them is text, not rich markup (`[/]` would raise, `[old]` vanish).
    console.print(
        f"[bold]{escape(job.name)}[/]: {escape(model.preset or model.family)} ({model.num_params / 1e6:,.1f}M "
        f"parameters, seq {model.seq_len}{', sequence-parallel under tp' if job.parallel.sequence_parallel else ''}) "
        f"on [bold]{escape(profile.name)}[/]: {profile.nodes} node(s) × "
        f"{profile.gpus_per_node} {escape(profile.accelerator.name)}"
    )
    if calibrated is None:
        console.print(f"{num_feasible} feasible of {num_total} candidates; fastest iteration first")
    else:
        console.print(f"{num_feasible} feasible of {num_total} candidates; fastest calibrated iteration first (the "
                      f"step times measured in {escape(str(measured_in))}; `from`: measured, fitted on its layout, "
                      "scaled from one point of its layout, or calibrated on the other layouts)")  # fmt: skip
    table = Table(show_lines=False)
    timing = ("iter time", "samples/s") if calibrated is None else ("model", "calibrated", "from", "samples/s")
    for column in ("#", "dp", "tp", "pp", "mbs", "gbs", *timing, "≈best", "mem/device", "compute", "bubble", "comm"):
        table.add_column(column, justify="right")
    for i, c in enumerate(shown, 1):
        p = c.prediction
        assert p is not None
        comm = p.tp_comm_s + p.p2p_s + p.dp_comm_s
        if calibrated is None:
            times = (_fmt_time(c.iter_time_s), _fmt_rate(c.samples_per_s))
        else:
            t, source = calibrated[c.strategy]
            times = (_fmt_time(c.iter_time_s), _fmt_time(t), _SOURCE_WORD.get(source, source),
                     _fmt_rate(c.gbs / t if 0 < t < float("inf") else 0.0))  # fmt: skip
        table.add_row(
            str(i), str(c.dp), str(c.tp), str(c.pp), str(c.mbs), str(c.gbs), *times,
            "≈" if c.strategy in ties else "", _fmt_memory(c.memory_gb), _fmt_time(p.compute_s),
            _fmt_time(p.pipeline_bubble_s), _fmt_time(comm),
        )  # fmt: skip
    if shown:  # with nothing feasible (`plan --all`), only the rejected table says something
        console.print(table)
    by_gbs: dict[int, int] = {}
    for c in shown:
        if c.strategy in ties:
            by_gbs[c.gbs] = by_gbs.get(c.gbs, 0) + 1
    close = {gbs: n for gbs, n in by_gbs.items() if n > 1}
    if close:
        listed = ", ".join(f"{n} at gbs {gbs}" for gbs, n in sorted(close.items()))
        fastest = "fastest strategy" if calibrated is None else "fastest calibrated time"
        console.print(
            f"≈best: within the cost model's error ({MODEL_ERROR:.0%}, docs/costmodel.md) of the {fastest} of "
            f"its global batch ({listed}); the model cannot rank these, `cona run` measures them."
        )
    if rejected:
        rej = Table(title=f"{len(rejected)} rejected")
        for column in ("dp", "tp", "pp", "mbs", "gbs", "reason"):
            rej.add_column(column, justify="right" if column != "reason" else "left")
        for c in rejected:
            rej.add_row(str(c.dp), str(c.tp), str(c.pp), str(c.mbs), str(c.gbs), escape(c.reason))
        console.print(rej)
