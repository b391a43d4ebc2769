"""Checkpoints that reshard between any two layouts.

Layout of `RunDir.checkpoint_dir(step)` = `checkpoints/step-<8 digits>/`:

    .metadata, __<rank>_0.distcp   DCP (`torch.distributed.checkpoint`) of {"model": …, "optim": …}: the state
                                   dicts of `get_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))`
                                   of every stage, keyed by the full model's parameter names
    trainer_state.json             step, samples, tokens, LR position, strategy, val history, control seq, RNG…
    COMPLETE                       written last by rank 0 once every rank's shards are written (fsync'd, then the
                                   directory fsync'd):
                                   JSON {"step", "time", "files": {name: size}, "crc32": {name: CRC-32}}

A checkpoint counts only with its COMPLETE marker, and only if every file listed there still has its size and
trainer_state.json parses (`verify_checkpoint`). Resuming takes the newest valid one and warns, naming it, about
each newer directory it skips; a file whose CRC-32 no longer matches (a flipped bit on storage keeps the size, and
DCP would load it without a word) or a DCP read error falls back to the next older one. Each rank computes the
CRC-32 of the shards it wrote itself, while they are still in its page cache, and checks the same ones before a
load (not after an in-place switch, whose processes checksummed those bytes moments before); checkpoints of
earlier versions, without "crc32", are checked by size only. After a save, only it and the `checkpoint.keep` - 1
complete checkpoints before it are kept, and older incomplete directories are deleted (later ones, which a resume
passed over as damaged, are left for a re-save of their step).

Saving a step that already has a complete checkpoint (a run that finishes right after a checkpoint it served during
a hold) never removes the complete one first: the new one is written beside it, as `checkpoints/.resave-step-<N>`,
and swapped in by two renames once its marker is written (the old one passes through `.replaced-step-<N>`). A crash
at any point leaves a complete checkpoint of that step: `recover_resaves` puts it back under its name.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import pickle
import re
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from cona.protocol.checkpoint_record import checkpoint_problem
from cona.protocol.heartbeat_record import HeartbeatEvent
from cona.protocol.rundir import COMPLETE_MARKER, TRAINER_STATE, RunDir, atomic_write_json, is_checkpoint_name
from cona.trainer.distributed import communication_error
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointLoadError(RuntimeError):
    """A checkpoint's files could not be read back (a damaged shard, a failed read): one line naming the file or
    the error. Raised on every rank alike, so the trainer can fall back to an older checkpoint together."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a read-only or vanished directory); one line says where,
    why, and from which checkpoint the run resumes. The partial directory is removed, so it holds no space."""


def _is_disk_full(error: BaseException) -> bool:
    """Whether `error` (or what it wraps: DCP gathers each rank's failure into a CheckpointException) is ENOSPC."""
    seen: list[BaseException] = [error]
    while seen:
        e = seen.pop()
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        seen += [c for c in (e.__cause__, e.__context__) if c is not None]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            seen += [f[0] if isinstance(f, tuple) else f for f in failures.values() if isinstance(f, BaseException | tuple)]
    return False


def first_failure(error: BaseException) -> BaseException:
    """The error itself, or for DCP's CheckpointException (which says only "ranks: [1]") the lowest failed rank's."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        first = first[0] if isinstance(first, tuple) else first
        if isinstance(first, BaseException):
            return first
    return error


def read_failure(error: BaseException) -> str:
    """One line for a failed read of a checkpoint (DCP's CheckpointException or what a damaged file raised)."""
    e = first_failure(error)
    # torch's own text for a damaged pickle advises weights_only=False, and for a damaged zip goes on about how the
    # file was saved: neither is a fix for damage, so the first sentence only.
    detail = "a file in it is damaged" if isinstance(e, pickle.UnpicklingError) else (str(e).splitlines() or [""])[0]
    return f"{type(e).__name__}: {detail.split('. ')[0][:300]}"


def _save_failure(run_dir: RunDir, path: Path, error: BaseException | None) -> str:
    """The one-line reason for a failed save of `path`, with the space it needs when the disk is full."""
    # Not `path` itself: its marker may be written when only the fsync after it failed, and it is removed.
    previous = next((p for p in reversed(run_dir.complete_checkpoints()) if p != path), None)
    resumes = f"the run resumes from {previous}" if previous is not None else "there is no earlier checkpoint to resume from"
    if error is None:
        return f"cannot write checkpoint {path}: it failed on another rank (see its output); {resumes}"
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    needed = None
    if previous is not None:  # a checkpoint of this run is as large as the last one
        try:
            needed = sum(json.loads((previous / COMPLETE_MARKER).read_text())["files"].values())
        except (OSError, ValueError, KeyError, TypeError):
            needed = None
    # torch.save's zip writer reports a short write as "unexpected pos", not as ENOSPC: the space left tells.
    full = _is_disk_full(error) or (free is not None and needed is not None and free < needed) or free == 0
    if not full:
        error = first_failure(error)
        first = str(error).splitlines()[0] if str(error) else ""
        return f"cannot write checkpoint {path}: {type(error).__name__}: {first[:300]}; {resumes}"
    free = free or 0
    need = f"about {needed / 1e6:.1f} MB needed" if needed else "the size of one checkpoint needed"
    return (f"cannot write checkpoint {path}: no space left on device ({free / 1e6:.1f} MB free there, {need}); "
            f"free space or move storage.run_root, then resume; {resumes}")


def warn(message: str) -> None:
    print(f"cona trainer: warning: {message}", file=sys.stderr, flush=True)


def _state(parts: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> tuple[dict, list]:
    """The DCP state of all stages, plus each stage's (model keys, optimizer keys) to hand back on load."""
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    keys = []
    for part, optimizer in zip(parts, optimizers, strict=True):
        fresh = not optimizer.state
        m, o = get_state_dict(part, optimizer, options=_OPTIONS)
        if fresh:
            # get_state_dict fills an empty optimizer's state by taking a step with zero gradients at lr 0: AdamW's
            # moments stay zero, but its `step` becomes 1. Saved at step 0 (`--max-steps 0`) that count was kept by
            # these processes and by every resume, so the first real update's bias correction was that of step 2
            # (about 3/4 of the size). Back to 0, the state is exactly that of an AdamW that never stepped.
            _reset_step_counts(optimizer)
            m, o = get_state_dict(part, optimizer, options=_OPTIONS)
        model_sd.update(m)
        optim_sd.update(o)
        keys.append((list(m), list(o)))
    return {"model": model_sd, "optim": optim_sd}, keys


def _reset_step_counts(optimizer: torch.optim.Optimizer) -> None:
    """Set every parameter's `step` in `optimizer`'s state to 0 (in place: the tensors stay those it holds)."""
    with torch.no_grad():
        for param_state in optimizer.state.values():
            step = param_state.get("step")
            if isinstance(step, torch.Tensor):
                step.zero_()
            elif step is not None:
                param_state["step"] = 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def set_rng_state(encoded: str) -> None:
    import numpy as np

    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(encoded), dtype=np.uint8).copy()))


def save_checkpoint(
    run_dir: RunDir,
    *,
    step: int,
    parts: list[torch.nn.Module],
    optimizers: list[torch.optim.Optimizer],
    trainer_state: dict[str, Any],
    keep: int,
) -> Path:
    """Collective: every rank writes its shards; rank 0 the trainer state, then (once all shards are written) the
    marker.

    A failure on any rank, in any of the three phases, is agreed by all of them (`_agree`) before the next
    collective: a rank that raised alone would leave the others waiting in a collective it never enters until the
    heartbeat timeout, or would meet them in a different one. Every rank then raises the same CheckpointSaveError,
    and rank 0 removes the partial directory. A communication error (a peer gone or hung) is not agreed on: the
    group is broken, so each rank that meets one raises CommunicationError at once (`_unless_broken`), and no
    marker is written."""
    rank = dist.get_rank()
    path = run_dir.checkpoint_dir(step)
    device = _device(parts)
    # A complete checkpoint of this step stays until its replacement is complete (rank 0 looks; all write there).
    shared = [rank == 0 and _is_complete(path)]
    dist.broadcast_object_list(shared, src=0)
    resave: bool = shared[0]
    target = _resave_dir(path) if resave else path
    error: BaseException | None = None
    writer = None
    own: dict[str, int] = {}
    # 1. Local preparation: nothing here is collective, so a failure on one rank is only agreed below.
    try:
        if rank == 0:
            if target.exists():  # a leftover of an attempt that died while writing it (or a corrupt one we skipped)
                shutil.rmtree(target)
            target.mkdir(parents=True)
        state, _keys = _state(parts, optimizers)
        # Made here, not inside dcp.save: there a failure (a read-only mount on one node) comes before DCP's first
        # collective, on that rank alone.
        writer = FileSystemWriter(str(target))
    except Exception as e:
        error = _unless_broken(e)
    _agree(run_dir, target, error, device)  # also the barrier: rank 0 made the directory before anyone writes to it
    # 2. DCP gathers a failure of any rank's planner or writer into a CheckpointException (a BaseException) on all.
    try:
        # Plan caching: from the second save of a layout on, a rank whose plan is unchanged sends an empty one and
        # the coordinator reuses the global plan, instead of pickling every tensor's write item both ways (a
        # third of a tiny model's save on the CPU; more ranks and tensors, more). A new layout (an in-place switch)
        # changes the plans, which are then sent in full again.
        dcp.save(state, storage_writer=writer, planner=DefaultSavePlanner(enable_plan_caching=True))
        if rank == 0:
            atomic_write_json(target / TRAINER_STATE, trainer_state)
        own = {p.name: file_crc32(p) for p in target.iterdir() if _shard_rank(p.name) == rank}
    except (Exception, CheckpointException) as e:  # a peer lost inside DCP's collectives is no storage error
        error = _unless_broken(e)
    _agree(run_dir, target, error, device)  # every rank's shards are on storage before the marker says so
    sums: list[dict[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(sums, own)
    # 3. The marker (rank 0): until it is agreed on, the others must not train on into the next step's collective.
    try:
        if rank == 0:
            files = {p.name: p.stat().st_size for p in sorted(target.iterdir()) if p.is_file() and not p.name.startswith(".tmp")}
            files.pop(COMPLETE_MARKER, None)
            known = {name: crc for part in sums if part for name, crc in part.items()}
            # Rank 0 wrote the rest (.metadata, trainer_state.json), or a DCP of another naming did: it reads them.
            crc32 = {name: known[name] if name in known else file_crc32(target / name) for name in files}
            atomic_write_json(target / COMPLETE_MARKER, {"step": step, "time": time.time(), "files": files, "crc32": crc32})
            _fsync_dir(target)
            if resave:
                _swap_in(target, path)
    except Exception as e:
        error = _unless_broken(e)
    _agree(run_dir, target, error, device)
    if rank == 0:
        prune_checkpoints(run_dir, keep=keep, newest=path)
    return path


RESAVE_PREFIX = ".resave-"
REPLACED_PREFIX = ".replaced-"


def _is_complete(path: Path) -> bool:
    """Whether `path` holds a complete checkpoint; False where it cannot even be looked at (the save then fails, on
    every rank together, when it tries to replace it)."""
    try:
        return path.exists() and verify_checkpoint(path) is None
    except OSError:
        return False


def _resave_dir(path: Path) -> Path:
    return path.with_name(RESAVE_PREFIX + path.name)


def _replaced_dir(path: Path) -> Path:
    return path.with_name(REPLACED_PREFIX + path.name)


def _swap_in(staged: Path, path: Path) -> None:
    """Put the complete `staged` checkpoint in the place of the complete `path`: two renames (a directory cannot
    replace a non-empty one in one), the old one removed only once the new one has its name."""
    replaced = _replaced_dir(path)
    if replaced.exists():
        shutil.rmtree(replaced)
    path.rename(replaced)
    try:
        staged.rename(path)
    except OSError:
        # Put the old one back: the save then fails with `path` still complete, and its one line names it as the
        # checkpoint the run resumes from (a crash here instead is repaired by `recover_resaves`).
        with contextlib.suppress(OSError):
            replaced.rename(path)
        raise
    _fsync_dir(path.parent)
    shutil.rmtree(replaced, ignore_errors=True)


def recover_resaves(run_dir: RunDir) -> list[str]:
    """Finish or undo re-saves that a crash interrupted (rank 0, before the checkpoints are listed); returns one line
    per directory it put back (or could not). For each step with a `.resave-`/`.replaced-` directory: a valid
    `step-<N>` keeps its place; else the staged one if it is complete (it is the newer state), else the replaced
    one, takes the name; the rest is removed."""
    root = run_dir.checkpoints
    if not root.is_dir():
        return []
    restored = []
    names = sorted({name for p in root.iterdir() if p.name.startswith((RESAVE_PREFIX, REPLACED_PREFIX))
                    and is_checkpoint_name(name := p.name.split("-", 1)[1])})  # fmt: skip
    for name in names:
        path, staged, replaced = root / name, root / (RESAVE_PREFIX + name), root / (REPLACED_PREFIX + name)
        try:
            if not _is_complete(path):
                source = next((p for p in (staged, replaced) if _is_complete(p)), None)
                if source is not None:
                    if path.exists():
                        shutil.rmtree(path)
                    source.rename(path)
                    _fsync_dir(root)
                    restored.append(f"restored checkpoint {path} from {source.name} (a re-save of that step was interrupted)")
        except OSError as e:  # the older checkpoints still resume; say why this one is not back
            restored.append(f"cannot restore checkpoint {path} from an interrupted re-save: {e}; move "
                            f"{root}/{RESAVE_PREFIX}{name} (or {REPLACED_PREFIX}{name}) to {path} by hand to resume from it")
            continue
        for leftover in (staged, replaced):
            if leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
    return restored


def _unless_broken(error: BaseException) -> BaseException:
    """`error`, for `_agree` to share; but a communication error (a peer died or hung inside DCP's collectives) is
    raised at once as a CommunicationError: the process group is broken, and the agreement's collective would fail
    a second time, naming no cause, or hang where the survivors meet in different collectives (one still in DCP's
    gather, the others in the agreement) until the groups' timeout. The partial directory is left for the next
    save or resume to clear: removed now, it would fail the writes of ranks that do not know yet, each with an
    error of its own."""
    broken = communication_error(error)
    if broken is not None:
        raise broken from error
    return error


def _agree(run_dir: RunDir, path: Path, error: BaseException | None, device: torch.device) -> None:
    """Collective: return if no rank failed; else raise on every rank the CheckpointSaveError of the lowest rank
    that failed (so rank 0's one line names the real error, not "another rank"), after rank 0 has removed `path`."""
    failed = torch.tensor([0.0 if error is None else 1.0], device=device)
    dist.all_reduce(failed)
    if failed.item() == 0:
        return
    # Measured before the removal: the reason gives the space left when the disk is full.
    reason = _save_failure(run_dir, path, error) if error is not None else None
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    if dist.get_rank() == 0:  # a partial directory holds space the next attempt needs, and is never resumed from
        shutil.rmtree(path, ignore_errors=True)
    raise CheckpointSaveError(next(r for r in reasons if r is not None))


def _device(parts: list[torch.nn.Module]) -> torch.device:
    """Where this rank's collectives run (a gloo group takes CPU tensors, NCCL CUDA ones)."""
    for part in parts:
        for param in part.parameters():
            return param.device
    return torch.device("cpu")


def prune_checkpoints(run_dir: RunDir, *, keep: int, newest: Path) -> None:
    """Keep `newest` and the `keep - 1` complete checkpoints before it; drop incomplete directories older than it.

    Checkpoints of later steps than `newest` are neither counted nor removed: they exist only when this attempt
    resumed from an older one because they would not load (a shard failing its CRC-32, a DCP read error). Counted
    by name they outranked the one just written, and with `keep: 1` it was removed at once — the run was left with
    only the damaged one (and an in-place switch with nothing to resume). Kept, they are replaced when training
    reaches their step again (a re-save), or skipped again by a resume that finds them still damaged."""
    complete = [p for p in run_dir.complete_checkpoints() if p.name <= newest.name]
    for old in complete[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for partial in run_dir.incomplete_checkpoints():
        if partial.name < newest.name:
            shutil.rmtree(partial, ignore_errors=True)


verify_checkpoint = checkpoint_problem
"""None if a checkpoint is complete and its records intact, else why not (one line), before a resume and a re-save:
the torch-free check that `cona status` makes too (`cona.protocol.checkpoint_record`). The CRC-32s, which read every
shard, are checked at load (`load_checkpoint`: each rank the shards its rank number wrote)."""


TRAINER_STATE_VERSION = 1
"""The `version` in trainer_state.json; a checkpoint with a larger one was written by a newer cona."""


def foreign_reason(
    path: Path,
    *,
    job_name: str,
    model: dict[str, Any],
    seed: int | None = None,
    data_tokens: list[int] | None = None,
    data_crc32: list[int] | None = None,
    run_created: float | None = None,
) -> str | None:
    """Why the intact checkpoint `path` must not be resumed by this job (one line naming the file and what to do),
    or None. A checkpoint of another job or model in this run directory is the user's mix-up, not damage: loading
    it would train on from someone else's weights (or fail deep inside DCP), and skipping it would hide the mix-up.
    With `seed` (the trainer's resume; not `cona export`, which reads only the model) a checkpoint of another seed
    is refused too: the sample order is a function of the seed, so it would go on with another data order, samples
    of the epoch seen twice and others never, while the samples log still audits clean. With `data_tokens` (the
    corpus's [training, validation] tokens) a checkpoint that recorded other sizes is refused for the same reason:
    the data changed under the run (a re-prepared or edited file, another `data.val_fraction`); with `data_crc32`
    (their sampled fingerprints) so is another corpus of the same sizes. With `run_created` (run.yaml's `created`)
    a checkpoint stamped by another run is refused: the same job, seed and data, copied in from another run
    directory, would resume at that run's sample count and skip (or repeat) this run's samples."""
    state_file = path / TRAINER_STATE
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return None  # verify_checkpoint already judged it
    fix = f"use a new --run-dir for this job, or move {path} out of {path.parent}"
    version = state.get("version", 0)
    if isinstance(version, int) and version > TRAINER_STATE_VERSION:
        return f"{state_file}: written by a newer cona (trainer state version {version} > {TRAINER_STATE_VERSION}); upgrade cona to resume it"
    other = state.get("job_name")
    if isinstance(other, str) and other and other != job_name:
        return f"{state_file}: a checkpoint of job {other!r}, not of this job {job_name!r}; {fix}"
    other_seed = state.get("seed")
    if seed is not None and type(other_seed) is int and other_seed != seed:
        return (f"{state_file}: a checkpoint of seed {other_seed}, not of this job's seed {seed} (the seed fixes the "
                f"data order); set seed: {other_seed} to resume it, or {fix}")
    trained = state.get("data_tokens")
    if data_tokens is not None and isinstance(trained, list) and len(trained) == 2 and trained != data_tokens:
        return (f"{state_file}: a checkpoint trained on {trained[0]:,} training and {trained[1]:,} validation tokens, "
                f"but data.path now gives {data_tokens[0]:,} and {data_tokens[1]:,} (the sample order depends on "
                f"them: samples would be trained twice or never); restore the data the run started with, or {fix}")
    sampled = state.get("data_crc32")
    if data_crc32 is not None and isinstance(sampled, list) and len(sampled) == 2 and sampled != data_crc32:
        split = "training" if sampled[0] != data_crc32[0] else "validation"
        return (f"{state_file}: a checkpoint trained on other data: data.path's {split} tokens have the same count "
                f"but other content (another or edited corpus); restore the data the run started with, or {fix}")
    other_run = state.get("run_created")
    if (run_created is not None and isinstance(other_run, (int, float)) and not isinstance(other_run, bool)
            and other_run != run_created):  # fmt: skip
        def when(t: float) -> str:
            return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))

        return (f"{state_file}: a checkpoint of another run of this job (created {when(other_run)}), not of this "
                f"run (created {when(run_created)}); resuming it would skip or repeat this run's samples. Move "
                f"{path} out of {path.parent}, or resume it in the run directory it came from")
    recorded = state.get("model")
    if isinstance(recorded, dict):
        differs = sorted(k for k in recorded.keys() & model.keys() if k not in ("init_from", "preset") and recorded[k] != model[k])
        if differs:
            shown = ", ".join(f"{k} {recorded[k]!r} (this job: {model[k]!r})" for k in differs[:3])
            return f"{state_file}: a checkpoint of another model: {shown}; {fix}"
    return None


def resume_candidates(run_dir: RunDir, notices: list[tuple[HeartbeatEvent, str]] | None = None) -> list[Path]:
    """Intact checkpoints, newest first; warns (naming it) about every newer directory that is not usable and every
    interrupted re-save it repaired, and appends each warning to `notices` with its heartbeat event,
    `checkpoint-skipped` or `checkpoint-restored` (the trainer reports them, the orchestrator logs them as events)."""
    if not run_dir.checkpoints.is_dir():
        return []

    def notice(event: HeartbeatEvent, line: str) -> None:
        warn(line)
        if notices is not None:
            notices.append((event, line))

    for line in recover_resaves(run_dir):
        notice(HeartbeatEvent.CHECKPOINT_RESTORED, line)
    candidates = []
    for path in sorted((p for p in run_dir.checkpoints.iterdir() if is_checkpoint_name(p.name)), reverse=True):
        problem = verify_checkpoint(path)
        if problem is None:
            candidates.append(path)
        elif not candidates:
            notice(HeartbeatEvent.CHECKPOINT_SKIPPED, f"skipping checkpoint {path}: {problem}")
    return candidates


_SHARD_NAME = re.compile(r"__(\d+)_\d+\.distcp")
"""DCP's FileSystemWriter names the files of rank r `__<r>_<i>.distcp`."""


def _shard_rank(name: str) -> int | None:
    """The rank that wrote the DCP shard file `name`; None for the coordinator's files and anything else."""
    match = _SHARD_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def file_crc32(path: Path) -> int:
    """The CRC-32 of a file, read in chunks (zlib's, about 2 GB/s on one core)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _marker_crc32(path: Path) -> dict[str, int]:
    """The marker's checksums ({} for a checkpoint that predates them). Assumes `verify_checkpoint` passed."""
    return json.loads((path / COMPLETE_MARKER).read_text()).get("crc32") or {}


def _first_mismatch(path: Path, crc32: dict[str, int], names: list[str]) -> str | None:
    for name in names:
        if file_crc32(path / name) != crc32[name]:
            return f"{name} fails its CRC-32 check: its bytes changed on storage after it was written"
    return None


def checksum_problem(path: Path) -> str | None:
    """The first file whose CRC-32 is not the marker's, in one line; None if all match, or the checkpoint predates
    checksums. Assumes `verify_checkpoint` passed."""
    crc32 = _marker_crc32(path)
    return _first_mismatch(path, crc32, sorted(crc32))


def _verify_checksums(path: Path) -> str | None:
    """Collective: each rank checks the shards its rank number wrote (in its page cache after an in-place switch),
    the other files round-robin; the lowest rank's problem, the same on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    problem = None
    try:
        crc32 = _marker_crc32(path)
        names = sorted(crc32)
        owner = {n: r if (r := _shard_rank(n)) is not None and r < world else i % world for i, n in enumerate(names)}
        problem = _first_mismatch(path, crc32, [n for n in names if owner[n] == rank])
    # Any error, not only a failed read: a rank that raised here alone would leave the others in the gather below.
    except OSError as e:
        problem = f"cannot read it ({e.strerror or e})"
    except Exception as e:
        problem = f"cannot check it ({type(e).__name__}: {e})"
    problems: list[str | None] = [None] * world
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p is not None), None)


def load_checkpoint(
    path: Path, *, parts: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer], verify: bool = True
) -> dict[str, Any]:
    """Collective: check the files' checksums (unless `verify` is False: these processes wrote and checksummed them
    moments ago), load model and optimizer state (resharded to this layout) and return the trainer state.
    CheckpointLoadError, on every rank alike, for a damaged or unreadable checkpoint."""
    problem = _verify_checksums(path) if verify else None
    if problem is not None:
        raise CheckpointLoadError(problem)
    state, keys = _state(parts, optimizers)
    try:
        dcp.load(state, checkpoint_id=str(path))
    # DCP gathers every rank's read failure into a CheckpointException, which is a BaseException: left as it is,
    # it would pass the trainer's fallback to an older checkpoint and end the attempt in a traceback.
    except CheckpointException as error:
        raise CheckpointLoadError(read_failure(error)) from None
    for part, optimizer, (model_keys, optim_keys) in zip(parts, optimizers, keys, strict=True):
        set_state_dict(
            part,
            optimizer,
            model_state_dict={k: state["model"][k] for k in model_keys},
            optim_state_dict={k: state["optim"][k] for k in optim_keys},
            options=_OPTIONS,
        )
    trainer_state = json.loads((path / TRAINER_STATE).read_text())
    if trainer_state.get("step") == 0:
        # Nothing was trained before a step-0 checkpoint, but one written by cona before `_state` reset the counts
        # holds AdamW's `step` at 1 (get_state_dict's zero-gradient fill): without this its first update would get
        # step 2's bias correction. The moments are zero either way, so 0 is exactly the state it should hold.
        for optimizer in optimizers:
            _reset_step_counts(optimizer)
    return trainer_state


def read_checkpoint_tensors(path: Path | str) -> dict[str, Any]:
    """The whole checkpoint as plain tensors in one process (for tests and tools): {"model.<fqn>": …, …}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "full.pt"
        dcp_to_torch_save(str(path), str(target))
        # Only tensors and plain containers: weights_only refuses anything that would run code on load.
        full = torch.load(target, weights_only=True)
    flat: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), sub)
        else:
            flat[prefix] = value

    walk("", full)
    return flat
