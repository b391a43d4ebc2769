"""`cona export RUN_DIR [--step K] --format hf --out DIR`: a checkpoint of a run as a Hugging Face model directory.

The `cona` command line runs this module as a program (`python -m cona.trainer.export`), because the control
plane never imports the data plane or torch (docs/architecture.md, "Import rules"). It reads one DCP checkpoint of
the run (the newest complete one, or `--step K`) in this single process, whatever layout wrote it, and writes
config.json and model.safetensors (`trainer.hf`). The model comes from the checkpoint itself (trainer_state.json's
`model`), else the run's run.yaml, else `--job`; a `--job` whose model differs from the recorded one is refused.
config.json's `eos_token_id` is the end-of-document id the run trained with (the `tokens.json` that `cona data
prepare` wrote beside the job's data; none for byte-level text) and `bos_token_id` is null (no cona data has one):
both are written even when null, because transformers fills a missing one with its family's default (GPT-2's
50256, outside a byte-level vocabulary; Llama's 1 and 2), and generation then stops on a token the run never saw as
an end, or never.

Exit codes: 0 written, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NoReturn

from cona.protocol.cliargs import OptionParser
from cona.protocol.job import DataSpec, JobSpec, ModelSpec, job_from_dict, load_job
from cona.protocol.rundir import TRAINER_STATE, NotRegularFile, RunDir, file_given_as_run_dir
from cona.protocol.yamlconfig import ConfigError, load_yaml, parse_bytes, validate
from cona.trainer.data import TOKENS_FILE, TOKENS_META


class _Parser(OptionParser):
    def fail(self, message: str) -> NoReturn:  # one line, exit 2, as the rest of cona
        print(f"cona: error: {message} (see cona export --help)", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="cona export", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run directory")
    parser.add_argument("--step", type=int, help="the checkpoint's optimizer step (default: the newest complete one)")
    parser.add_argument("--format", choices=["hf"], required=True, help="hf: a transformers model directory")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="where to write (created; must be new or empty)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --out, replacing its config.json and model weights (and removing a "
                             "generation_config.json, whose token ids transformers would use)")  # fmt: skip
    parser.add_argument("--job", type=Path, metavar="JOB.yaml",
                        help="the job the run was trained with, for what the run directory does not record: the "
                             "model of a checkpoint that predates recording it, the data (for its end-of-document id) "
                             "of a run trained by hand without run.yaml; its model must be the recorded one")  # fmt: skip
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="larger models are split into shards of this size with an index (default 5GB)")  # fmt: skip
    return parser.parse_args(argv)


def find_checkpoint(run_dir: RunDir, step: int | None) -> Path:
    """The complete checkpoint to export; ValueError naming what is there otherwise."""
    from cona.trainer.checkpoint import checksum_problem, verify_checkpoint

    if (problem := file_given_as_run_dir(run_dir.root)) is not None:
        raise ValueError(problem)
    if not run_dir.root.is_dir():
        raise ValueError(f"{run_dir.root}: no such run directory")
    complete = run_dir.complete_checkpoints()
    if step is None:
        if not complete:
            raise ValueError(f"{run_dir.checkpoints}: no complete checkpoint to export")
        path = complete[-1]
    else:
        path = run_dir.checkpoint_dir(step)
        if path not in complete:
            have = ", ".join(str(int(p.name.split("-")[1])) for p in complete) or "none"
            raise ValueError(f"--step {step}: no complete checkpoint {path.name} (complete steps: {have})")
    # Sizes first (cheap); then every file's checksum, since the export reads the model's bytes from them.
    problem = verify_checkpoint(path) or checksum_problem(path)
    if problem:
        # Say what to do: the trainer resumes from the newest intact checkpoint, and the export can take that one too.
        intact = [int(p.name.split("-")[1]) for p in complete if p != path and verify_checkpoint(p) is None]
        fix = f"export an intact one with --step {intact[-1]}" if intact else "the run has no other intact checkpoint"
        raise ValueError(f"{path}: {problem}; {fix}")
    return path


def run_job(run_dir: RunDir) -> JobSpec | None:
    """The job run.yaml records (written by `cona run`; a run trained by hand has none)."""
    if not run_dir.run_yaml.exists():
        return None
    data = load_yaml(run_dir.run_yaml, run_file=True)
    if not isinstance(data.get("job"), dict):
        return None
    return job_from_dict(data["job"], source=f"{run_dir.run_yaml} job")


def model_of(run_dir: RunDir, checkpoint: Path, job: JobSpec | None, *, job_path: Path | None = None) -> ModelSpec:
    """The model the checkpoint holds: its trainer state's, else run.yaml's, else `job`'s (`--job`). A `job` whose
    model differs from the recorded one is refused (ConfigError naming the fields): its architecture over the
    checkpoint's weights (another norm eps, the other GELU) is a model that loads and computes something else."""
    from cona.trainer.checkpoint import foreign_reason

    state_file = checkpoint / TRAINER_STATE
    state = json.loads(state_file.read_text())
    recorded = state.get("model")
    if recorded:
        spec = validate(ModelSpec, recorded, source=f"{state_file} model")
        if job is not None:
            # The trainer's own test for resuming this checkpoint under another model, so both name the same fields
            # (and both ignore init_from and the preset's name). The job's name is not the export's business: the
            # same model under a renamed job exports alike.
            name = state.get("job_name") if isinstance(state.get("job_name"), str) else job.name
            reason = foreign_reason(checkpoint, job_name=name, model=job.model.model_dump(mode="json"))
            if reason:
                # Its advice is the trainer's (another --run-dir); what the export wants is no --job.
                head = reason.rpartition("; ")[0] or reason
                raise ConfigError(f"--job {job_path}: {head}; leave --job out to export the model the checkpoint records")
        return spec
    recorded_job = run_job(run_dir)
    if recorded_job is not None:
        if job is not None and job.model != recorded_job.model:
            differs = [k for k in ModelSpec.model_fields if k not in ("init_from", "preset")
                       and getattr(job.model, k) != getattr(recorded_job.model, k)]  # fmt: skip
            if differs:  # a checkpoint from before trainer states recorded their model: run.yaml is its record
                shown = ", ".join(f"{k} {getattr(recorded_job.model, k)!r} (this job: {getattr(job.model, k)!r})"
                                  for k in differs[:3])  # fmt: skip
                raise ConfigError(f"--job {job_path}: {run_dir.run_yaml} records another model: {shown}; leave --job "
                                  "out to export the model the run recorded")  # fmt: skip
        return recorded_job.model
    if job is not None:
        return job.model
    raise ValueError(f"{checkpoint}: records no model and {run_dir.run_yaml} does not exist; pass --job JOB.yaml")


def eos_of(data: DataSpec) -> tuple[int | None, str | None]:
    """(the end-of-document id of the data the run trained on, None or why it cannot be known). The tokens.json of
    `cona data prepare` records the id (null when the tokenizer has none); byte-level text has none (its documents
    are read back to back); a raw token file says nothing."""
    path = Path(data.path)
    meta_path = (path if path.is_dir() else path.parent) / TOKENS_META
    # Where the trainer applies a tokens.json (`cona.protocol.inputs.read_token_metadata`): a directory, or its tokens.bin.
    if (path.is_dir() or path.name == TOKENS_FILE) and meta_path.exists():
        try:
            eos = json.loads(meta_path.read_text())["eos_id"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return None, f"{meta_path}: unreadable ({e}), so the end-of-document id is unknown"
        if eos is not None and (isinstance(eos, bool) or not isinstance(eos, int) or eos < 0):
            return None, f"{meta_path}: eos_id {eos!r} is not a token id"
        return eos, None
    tokens = data.format == "tokens" or (data.format == "auto" and path.suffix in (".bin", ".npy"))
    if not tokens and (data.format == "bytes" or path.exists() or path.suffix in (".txt", ".md")):
        return None, None
    where = "no longer exists" if not path.exists() else f"has no {TOKENS_META} beside it"
    return None, f"data.path {data.path} {where}, so the end-of-document id is unknown"


def run_eos(run_dir: RunDir, job: JobSpec | None, *, vocab_size: int) -> tuple[int | None, str | None]:
    """(the end-of-document id the run trained with, None), or (None, a warning saying why it is unknown and what to
    do). The data is run.yaml's (the run's record), else `job`'s (`--job`)."""
    null = "config.json says eos_token_id: null"
    try:
        recorded = run_job(run_dir)
    except ConfigError as e:  # a damaged run.yaml: the checkpoint still holds the model, only the data is lost
        recorded, why = None, str(e)
    else:
        why = f"{run_dir.root} records no job (no run.yaml: trained by hand?)"
    data_job = recorded or job
    if data_job is None:
        return None, (f"{why} and no --job names its data, so its end-of-document id is unknown; {null} (pass "
                      "--job JOB.yaml to take it from the job's data)")  # fmt: skip
    eos, unknown = eos_of(data_job.data)
    if eos is not None and eos >= vocab_size:
        eos, unknown = None, f"the data's end-of-document id {eos} is outside the model's vocabulary of {vocab_size}"
    return eos, (f"{unknown}; {null} (set it there if the data has one)" if unknown else None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        max_shard = int(parse_bytes(args.max_shard_size))
        if max_shard <= 0:
            raise ValueError("must be positive")
    except ValueError as e:
        print(f"cona: error: --max-shard-size {args.max_shard_size!r}: {e}", file=sys.stderr)
        return 2
    if args.step is not None and args.step < 0:
        print(f"cona: error: --step {args.step}: give an optimizer step (0 or more), or leave it out for the newest",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        run_dir = RunDir(args.run_dir)
        checkpoint = find_checkpoint(run_dir, args.step)
        job = load_job(args.job) if args.job is not None else None
        spec = model_of(run_dir, checkpoint, job, job_path=args.job)
        eos, unknown = run_eos(run_dir, job, vocab_size=spec.vocab_size)
        from cona.trainer import hf

        if args.out.exists() and not args.out.is_dir():
            raise ConfigError(f"--out {args.out}: a file, not a directory; give a directory for config.json and the weights")
        inside = args.out.resolve()
        if inside == run_dir.checkpoints.resolve() or run_dir.checkpoints.resolve() in inside.parents:
            # --overwrite there wrote config.json and weights into a DCP checkpoint (or beside them, as a checkpoint
            # name the trainer would try to resume).
            raise ConfigError(f"--out {args.out}: inside the run's checkpoints ({run_dir.checkpoints}); give a "
                              "directory outside them")  # fmt: skip
        # Another model may live there (the one the run started from, say): replacing its weights takes a decision.
        if args.out.is_dir() and any(args.out.iterdir()) and not args.overwrite:
            raise ConfigError(f"--out {args.out}: not empty; give a new directory, or --overwrite to replace its "
                              "config.json and model weights")  # fmt: skip
        files = hf.export_checkpoint(checkpoint, args.out, spec=spec, max_shard_bytes=max_shard, eos_token_id=eos,
                                     bos_token_id=None)  # fmt: skip
    except (ConfigError, ValueError, NotRegularFile) as e:
        print(f"cona: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # a control-plane-only install: the export reads torch checkpoints
        print(f"cona: error: cona export needs torch and safetensors (pip install cona in the trainer's environment): "
              f"{e}", file=sys.stderr)  # fmt: skip
        return 2
    if unknown:  # the export is still right; only generation will not stop at an end of document
        print(f"cona export: warning: {unknown}", file=sys.stderr)
    family = hf.ARCHITECTURES[spec.family]
    print(f"wrote {args.out} ({family}, {spec.num_params:,} parameters, step {int(checkpoint.name.split('-')[1])}): "
          f"{', '.join(p.name for p in files)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
