"""The samples log and its audit: no sample lost or repeated across switches, crashes and restarts. Torch-free.

Rank 0 of every attempt appends to `samples/<attempt>.jsonl` (`RunDir.samples_log / f"{attempt}.jsonl"`):

    {"resume": k, "samples": s}             once at start-up: the attempt continues after step k, sample s
                                            (k = 0, s = 0 on a fresh start); written before any step record
    {"step": k, "start": s, "end": e}       after step k's optimizer update succeeded: it consumed samples [s, e)

A torchrun restart inside the same attempt appends a new `resume` line to the same file.

**Audit rule** (`audit_samples`). Read the files in increasing attempt number and each file's lines in order. A
`resume k` line discards every step record kept so far with step > k — those steps were trained but their state
was lost with the checkpoint that never got written — and requires the kept records to end exactly at step k and
sample s. A step record must follow the last kept one: step = previous step + 1 and start = previous end (the first
is step 1 starting at 0). What remains is the run's training history; it must cover [0, N) with no gap and no
repeat. Any violation raises `SamplesAuditError` naming the file, line and what is wrong.

An ended run (`audit(..., resumes_at=k)`, k the step of the checkpoint a resume would load) is read as if that resume
had come: the steps after k are rolled back, trained by an attempt that ended before a checkpoint kept them (a failed
run's last crash), so they are no part of the model's history; a resume trains them again.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from cona.protocol.rundir import RunDir, append_jsonl, open_regular


class SamplesAuditError(ValueError):
    """The samples log shows a lost or repeated sample (or is malformed); the message says where."""


def samples_file(run_dir: RunDir, attempt: int) -> Path:
    return run_dir.samples_log / f"{attempt}.jsonl"


def log_resume(run_dir: RunDir, *, attempt: int, step: int, samples: int) -> None:
    append_jsonl(samples_file(run_dir, attempt), {"resume": step, "samples": samples})


def log_step(run_dir: RunDir, *, attempt: int, step: int, start: int, end: int) -> None:
    append_jsonl(samples_file(run_dir, attempt), {"step": step, "start": start, "end": end})


def _attempt_files(run_dir: RunDir) -> list[tuple[int, Path]]:
    if not run_dir.samples_log.is_dir():
        return []
    found = []
    for path in run_dir.samples_log.glob("*.jsonl"):
        # Only the trainer's own names (`3.jsonl`): a copy named `01.jsonl` or `+1.jsonl` is no attempt's log, and
        # read as one it counted the whole history a second time as retrained steps.
        if path.stem.isascii() and path.stem.isdigit() and str(int(path.stem)) == path.stem:
            found.append((int(path.stem), path))
    return sorted(found)


@dataclasses.dataclass(frozen=True)
class SamplesAudit:
    """What `audit` found: the surviving history and what was trained but lost with an unwritten checkpoint."""

    ranges: list[tuple[int, int]]
    """The per-step sample ranges [(start, end), …] of the surviving history, in step order."""
    retrained_steps: int
    """Step records a later `resume` discarded: steps trained again after a crash, since the checkpoint that would
    have kept them was never written."""
    files: int
    """Attempt files read."""
    rolled_back: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """With `audit(..., resumes_at=k)`: the sample ranges of the steps after k, in step order (trained, but lost with
    the attempt that trained them; a resume trains them again)."""

    @property
    def samples(self) -> int:
        return self.ranges[-1][1] if self.ranges else 0

    @property
    def trained(self) -> int:
        """The samples the logs show trained, the rolled-back steps included."""
        return self.rolled_back[-1][1] if self.rolled_back else self.samples


def audit_samples(run_dir: RunDir | Path | str) -> list[tuple[int, int]]:
    """The per-step sample ranges [(start, end), …] of the run's surviving history, in step order.

    Consecutive ranges touch (each start equals the previous end) and the first starts at 0, so together they are
    exactly samples 0 … N−1 once each. Raises `SamplesAuditError` on a gap, an overlap or a malformed record.
    """
    return audit(run_dir).ranges


def _int(record: dict, key: str, where: str) -> int:
    value = record.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplesAuditError(f"{where}: {key} is {value!r}, not a whole number")
    return value


def audit(run_dir: RunDir | Path | str, *, resumes_at: int | None = None) -> SamplesAudit:
    """`audit_samples` with what it discarded on the way (`SamplesAudit`). A torn last line of a file is left out
    (it may still be being written); every other damaged line raises `SamplesAuditError` naming the file and line.

    `resumes_at`: for a run that has ended, the step of the checkpoint a resume would load (0: none); the steps
    after it are rolled back as a resume there would discard them (`SamplesAudit.rolled_back`)."""
    run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
    kept: list[tuple[int, int, int]] = []  # (step, start, end)
    retrained = 0
    files = _attempt_files(run_dir)
    for _attempt, path in files:
        with open_regular(path) as f:
            data = f.read()
        whole = data[: data.rfind(b"\n") + 1]  # a torn last line is still being written
        for number, raw in enumerate(whole.splitlines(), start=1):
            if not raw.strip():
                continue
            where = f"{path.name} line {number}"
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError):  # not JSON, not UTF-8, a number of thousands of digits, deep nesting
                raise SamplesAuditError(f"{where}: not valid JSON") from None
            if not isinstance(record, dict):
                raise SamplesAuditError(f"{where}: expected {{step, start, end}} or {{resume, samples}}")
            if "resume" in record:
                step = _int(record, "resume", where)
                samples = _int(record, "samples", where) if "samples" in record else -1
                retrained += sum(1 for r in kept if r[0] > step)
                kept = [r for r in kept if r[0] <= step]
                last_step, last_end = (kept[-1][0], kept[-1][2]) if kept else (0, 0)
                if last_step != step:
                    raise SamplesAuditError(
                        f"{where}: resumes after step {step}, but the log before it ends at step {last_step} "
                        f"(steps {last_step + 1}..{step} are missing)"
                    )
                if samples >= 0 and samples != last_end:
                    raise SamplesAuditError(
                        f"{where}: resumes at sample {samples}, but step {step} ended at sample {last_end}"
                    )
                continue
            if not {"step", "start", "end"} <= record.keys():
                raise SamplesAuditError(f"{where}: expected {{step, start, end}} or {{resume, samples}}")
            step, start, end = (_int(record, key, where) for key in ("step", "start", "end"))
            last_step, last_end = (kept[-1][0], kept[-1][2]) if kept else (0, 0)
            if step != last_step + 1:
                raise SamplesAuditError(f"{where}: step {step} follows step {last_step} (expected {last_step + 1})")
            if start != last_end:
                kind = "gap" if start > last_end else "overlap"
                raise SamplesAuditError(
                    f"{where}: step {step} starts at sample {start} but the previous step ended at {last_end} ({kind})"
                )
            if end <= start:
                raise SamplesAuditError(f"{where}: step {step} has an empty range [{start}, {end})")
            kept.append((step, start, end))
    # The rule of a `resume` line, for the resume that has not come yet (a log cut short before that step is for the
    # caller to compare with what else counts the samples).
    rolled_back = [(start, end) for step, start, end in kept if resumes_at is not None and step > resumes_at]
    kept = kept[: len(kept) - len(rolled_back)]
    return SamplesAudit([(start, end) for _step, start, end in kept], retrained, len(files), rolled_back)
