"""Read a suite timeline (`CONA_TEST_TIMELINE=FILE make test`): when each worker ran what, and where the time went.

    python -m tests.timeline FILE [--top N]

Prints, per worker, its tests, busy seconds, idle seconds between tests and when it ended (from the first test's
start), then the N test files with the most worker time. The two workers of `make test` should end together: a
worker that ends long before the other sat idle while the other finished.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per worker: tests, busy and idle seconds, end; per test file: worker seconds (all phases)."""
    if not rows:
        return {"workers": {}, "files": {}, "total_s": 0.0}
    t0 = min(r["start"] for r in rows)
    spans: dict[str, list[float]] = {}  # test -> [start, stop]
    worker_of: dict[str, str] = {}
    files: Counter[str] = Counter()
    for r in rows:
        span = spans.setdefault(r["test"], [r["start"], r["stop"]])
        span[0], span[1] = min(span[0], r["start"]), max(span[1], r["stop"])
        worker_of[r["test"]] = r["worker"]
        files[r["test"].split("::")[0]] += r["stop"] - r["start"]
    by_worker: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for test, (start, stop) in spans.items():
        by_worker[worker_of[test]].append((start - t0, stop - t0))
    workers = {}
    for worker, items in sorted(by_worker.items()):
        items.sort()
        idle = sum(max(0.0, b[0] - a[1]) for a, b in itertools.pairwise(items))
        workers[worker] = {"tests": len(items), "busy_s": sum(b - a for a, b in items), "idle_s": idle,
                           "end_s": max(b for _, b in items)}  # fmt: skip
    return {"workers": workers, "files": dict(files.most_common()), "total_s": sum(files.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.timeline", description=__doc__.split("\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--top", type=int, default=15, help="test files to list (default 15)")
    args = parser.parse_args(argv)
    try:
        lines = args.file.read_text().splitlines()
    except OSError as e:
        print(f"timeline: cannot read {args.file}: {e.strerror}", file=sys.stderr)
        return 2
    rows = []
    for n, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a run cut short may leave its last line torn
            print(f"timeline: {args.file}:{n}: not a JSON line; skipped", file=sys.stderr)
    summary = summarize(rows)
    for worker, w in summary["workers"].items():
        print(f"{worker}: {w['tests']} tests, busy {w['busy_s']:.0f} s, idle {w['idle_s']:.0f} s, "
              f"ended at {w['end_s']:.0f} s")  # fmt: skip
    print(f"worker time {summary['total_s']:.0f} s; the test files with the most:")
    for path, seconds in list(summary["files"].items())[: args.top]:
        print(f"  {seconds:7.0f} s  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
