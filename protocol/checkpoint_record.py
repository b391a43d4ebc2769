"""What makes a checkpoint directory whole, judged from its records alone: the `COMPLETE` marker (every file's size
and CRC-32) and `trainer_state.json` (the counters a resume starts from). Torch-free.

The trainer writes both (trainer/checkpoint.py documents the directory) and checks a checkpoint with
`checkpoint_problem` before it resumes from it or keeps it on a re-save; `cona status` makes the same check to name
the checkpoint a resume would load, without importing torch. What needs the shards' bytes — their CRC-32s, which
`checkpoint_problem` only checks the shape of, and DCP's own reading — stays with the trainer, which checks them at
load: it reads every shard, which `cona status` must not.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

from cona.protocol.rundir import COMPLETE_MARKER, TRAINER_STATE, NotRegularFile, open_regular

_STATE_INTS = ("step", "samples", "tokens", "lr_position", "last_control_seq", "attempt", "seed")
_STATE_NUMBERS = ("lr", "time", "elapsed_s")
"""trainer_state.json's counters (`cona.trainer.train.TrainerState`), checked by `checkpoint_problem`."""


def checkpoint_problem(path: Path) -> str | None:
    """None if `path` is a complete checkpoint whose records are intact; else why a resume passes over it (one
    line): no or an unreadable COMPLETE marker, a file it lists missing, of another size or no regular file (a FIFO),
    trainer_state.json
    unreadable or its counters not numbers; a directory or file this user may not read, named with what to do."""
    try:
        return _problem(path)
    except OSError as e:  # no permission (a run directory shared between users): not damage, and fixable
        where = e.filename or path
        return f"cannot read {where} ({e.strerror or type(e).__name__}); give this user read access to {path} to resume from it"


def _problem(path: Path) -> str | None:
    marker = path / COMPLETE_MARKER
    if not marker.exists():
        return "no COMPLETE marker (it was being written when the trainer stopped)"
    try:
        with open_regular(marker) as f:
            manifest = json.loads(f.read().decode())
        files = manifest["files"]
    except NotRegularFile:  # a FIFO would block the read: as damaged as a torn marker, and passed over alike
        return "its COMPLETE marker is not a regular file"
    except (OSError, ValueError, KeyError, TypeError):
        return "its COMPLETE marker is unreadable"
    # Valid JSON of the wrong shape is as damaged as a torn marker: judged here, not left to crash the size checks.
    if not isinstance(files, dict) or not all(isinstance(n, str) and type(v) is int for n, v in files.items()):
        return "its COMPLETE marker is unreadable (its files are not a mapping of names to sizes)"
    for name, size in files.items():
        try:
            found = (path / name).stat()
        except FileNotFoundError:
            return f"{name} is missing"
        if not stat.S_ISREG(found.st_mode):  # a FIFO in its place: whoever reads the bytes (DCP, CRC-32s) would block
            return f"{name} is not a regular file"
        actual = found.st_size
        if actual != size:
            return f"{name} has {actual} bytes, expected {size} (truncated or overwritten)"
    crc32 = manifest.get("crc32")
    if crc32 is not None and (not isinstance(crc32, dict) or crc32.keys() != files.keys()
                              or not all(type(v) is int for v in crc32.values())):  # fmt: skip
        return "its COMPLETE marker is unreadable (its crc32 is not a mapping of its files to checksums)"
    if ".metadata" not in files or TRAINER_STATE not in files:
        return "it lacks .metadata or trainer_state.json"
    try:
        with open_regular(path / TRAINER_STATE) as f:
            state = json.loads(f.read().decode())
        int(state["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"{TRAINER_STATE} is corrupt"
    # Valid JSON of the wrong types (`"samples": "many"`) would pass and crash every rank at its first step on
    # resume, attempt after attempt: the counters the trainer resumes from are judged here, like the sizes.
    for key, kinds in [*((k, int) for k in _STATE_INTS), *((k, (int, float)) for k in _STATE_NUMBERS)]:
        value = state.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, kinds):
            return f"{TRAINER_STATE} is corrupt ({key} is {value!r}, not a number)"
    return None
