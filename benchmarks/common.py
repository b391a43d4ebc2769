"""What every benchmark shares: where results go, the machine they ran on, tables and JSON."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from cona.protocol.yamlconfig import MAX_INT

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

T = TypeVar("T")
R = TypeVar("R")


def _git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
        ).stdout.strip() or None
    except OSError:
        return None


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


_AT_START = {"git_commit": _git_commit(), "load_average": _load_average()}
"""The commit and load when the benchmark started (this module is imported first): a run of many minutes in a shared
checkout wrote, at its end, the commit that someone had made meanwhile, not the code that ran."""


def machine() -> dict[str, Any]:
    """The machine and software a result was measured on: the commit checked out and the load average when the
    benchmark started (`git_commit`, `load_average`), and both again when it wrote its result where they differ
    (`git_commit_at_end`; `load_average_at_end` always, the load being what changes)."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu_model"] = names[0] if names else None
    except OSError:
        info["cpu_model"] = None
    info["load_average"] = _AT_START["load_average"]
    info["load_average_at_end"] = _load_average()
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    info["git_commit"] = _AT_START["git_commit"]
    now = _git_commit()
    if now != info["git_commit"]:
        info["git_commit_at_end"] = now
    return info


def command_line() -> str:
    """How this benchmark was started, as a user would type it."""
    module = Path(sys.argv[0]).stem
    args = " ".join(sys.argv[1:])
    return f"python -m benchmarks.{module}" + (f" {args}" if args else "")


def results_path(name: str | Path) -> Path:
    """Where an output named `name` goes: a bare file name (`ttp.json`, an `--out` default) under
    `benchmarks/results/`; a path with a directory (`/tmp/x.json`, `out/x.json`) where it says, from the current
    directory. (Every path was put under `benchmarks/results/`: `--out ../x.json` wrote `benchmarks/x.json`.)"""
    given = Path(name)
    return given if given.is_absolute() or len(given.parts) > 1 else RESULTS / given


def write_json(name: str | Path, data: dict[str, Any], *, indent: int | None = 1) -> Path:
    """`results_path(name)` with the command line, the machine and the time in front of `data`."""
    path = results_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"command": command_line(), "machine": machine(), "written": time.strftime("%Y-%m-%d %H:%M:%S"), **data}
    path.write_text(json.dumps(payload, indent=indent, default=json_default) + "\n")
    return path


def loop_time(run_dir: Path, steps: int, attempt: int = 1) -> float:
    """Seconds of a trainer run's training loop: its `start` heartbeat to the checkpoint of step `steps` starting
    (the time in its trainer_state.json), without start-up, evaluation at the end or the final save."""
    beats = [json.loads(line) for line in (run_dir / "heartbeats" / f"{attempt}.jsonl").read_text().splitlines() if line]
    start = next(b["time"] for b in beats if b.get("event") == "start")
    ckpt = run_dir / "checkpoints" / f"step-{steps:08d}" / "trainer_state.json"
    return json.loads(ckpt.read_text())["time"] - start


def shown(path: Path) -> str:
    """`path` relative to the repository when it lies inside it (as the results name their files), else as given
    (an `--out` outside the repository)."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "to_dict"):
        return value.to_dict()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def finite(x: float | None) -> float | None:
    """JSON has no inf/NaN: those become None."""
    return x if x is not None and math.isfinite(x) else None


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """mean/min/max over seeds (None entries are runs that never reached the target)."""
    present = [v for v in values if v is not None and math.isfinite(v)]
    if not present:
        return {"mean": None, "min": None, "max": None, "per_seed": list(values)}
    return {
        "mean": statistics.fmean(present),
        "min": min(present),
        "max": max(present),
        "per_seed": [None if v is None or not math.isfinite(v) else v for v in values],
        "complete": len(present) == len(values),
    }


def fmt_tflops(rate: float) -> str:
    """TFLOP/s with one decimal, or in significant digits below 1 (a CPU: `.1f` printed 0.04 as 0.0 beside its MFU)."""
    return f"{rate:.1f}" if rate >= 1 else f"{rate:.2g}"


def fmt_s(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "—"
    if seconds >= 100:
        return f"{seconds:,.0f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def fmt_ratio(stats: dict[str, Any] | None, digits: int = 2) -> str:
    """mean [min–max] of a spread(); '≥x' marks a mean over incomplete runs."""
    if not stats or stats.get("mean") is None:
        return "—"
    mean, lo, hi = stats["mean"], stats["min"], stats["max"]
    text = f"{mean:.{digits}f}"
    if hi - lo > 10 ** (-digits) / 2:
        text += f" [{lo:.{digits}f}–{hi:.{digits}f}]"
    return text


def names_arg(parser: argparse.ArgumentParser, flag: str, text: str, valid: Sequence[str]) -> list[str]:
    """A comma-separated list of names from `valid`; a misspelled one ends the command with the valid ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in valid:
            parser.error(f"{flag}: unknown {name!r}; valid: {', '.join(valid)}")
    if not names:
        parser.error(f"{flag}: empty; valid: {', '.join(valid)}")
    if len(set(names)) < len(names):  # the same runs trained twice and counted twice
        parser.error(f"{flag}: a name is given twice, got {text!r}")
    return names


def ints_arg(parser: argparse.ArgumentParser, flag: str, text: str, *, minimum: int = 0) -> tuple[int, ...]:
    """A comma-separated list of integers ≥ `minimum`; anything else ends the command naming the flag."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        parser.error(f"{flag}: expected comma-separated integers, got {text!r}")
    if any(v < minimum for v in values):
        parser.error(f"{flag}: every value must be at least {minimum}, got {text!r}")
    if any(v > MAX_INT for v in values):  # a seed the job refuses ended a worker in a traceback, minutes in
        parser.error(f"{flag}: every value must be at most {MAX_INT:.0e}, got {text!r}")
    if len(set(values)) < len(values):  # the same run trained twice and counted twice in the means
        parser.error(f"{flag}: a value is given twice, got {text!r}")
    return values


def batches_arg(parser: argparse.ArgumentParser, flag: str, text: str) -> tuple[int, ...]:
    """Global batch sizes of a tiny run: even and at least 2 (two micro-batches per step)."""
    batches = ints_arg(parser, flag, text, minimum=2)
    if any(b % 2 for b in batches):
        parser.error(f"{flag}: every batch must be even (two micro-batches per step), got {text!r}")
    return batches


def map_workers(fn: Callable[[T], R], items: Sequence[T], *, jobs: int) -> list[R]:
    """`fn` over `items`, in order: in up to `jobs` spawned worker processes (each a fresh interpreter, so a
    benchmark's torch threads and distributed state do not leak between items), or in this process for one."""
    if jobs > 1 and len(items) > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(min(jobs, len(items))) as pool:
            return pool.map(fn, items, chunksize=1)
    return [fn(x) for x in items]


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], *, width: int = 170) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    # Text, not markup: cells like "1.02 [0.98–1.05]" must print as they are.
    table = Table()
    for i, column in enumerate(columns):
        table.add_column(Text(column), justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    # At least `width`, and as wide as the table needs: a narrower console cut headers ("static@1024/c…", the
    # standard batch's column) and wrapped cells over two lines.
    needed = Console(width=100_000).measure(table).maximum
    console = Console(width=max(width, needed))
    console.print(Text(title))  # above the table, not wrapped to its width
    console.print(table)


def positive_int(text: str) -> int:
    """argparse `type` for a count of at least 1 (`--steps 0` divided by zero after the run; `--repeats -1` had
    no median)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= MAX_INT:
        raise argparse.ArgumentTypeError(f"must be at least 1 (and at most {MAX_INT:.0e}), got {text!r}")
    return value


def run_main(main: Callable[[], int]) -> int:
    """A benchmark's `main()`, with a bad profile, job or record it loads (`ConfigError`, `FileNotFoundError`)
    answered in one line naming it, as the `cona` commands answer them, instead of a traceback."""
    from cona.protocol.yamlconfig import ConfigError

    try:
        return main()
    except (ConfigError, FileNotFoundError) as e:
        print(f"python -m benchmarks.{Path(sys.argv[0]).stem}: error: {e}", file=sys.stderr)
        return 2
