"""`cona export RUN_DIR [--step K] --format hf --out DIR`: a checkpoint of a run as a Hugging Face model directory.

The `cona` command line runs this module as a program (`python -m cona.trainer.export`), because the control
plane never imports the data plane or torch (docs/architecture.md, "Import rules"). It reads one DCP checkpoint of
the run (the newest complete one, or `--step K`) in this single process, whatever layout wrote it, and writes
config.json and model.safetensors (`trainer.hf`). The model comes from the checkpoint itself (trainer_state.json's
`model`), else the run's run.yaml, else `--job`.

Exit codes: 0 written, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NoReturn

from cona.protocol.job import ModelSpec, job_from_dict, load_job
from cona.protocol.rundir import TRAINER_STATE, RunDir
from cona.protocol.yamlconfig import ConfigError, load_yaml, parse_bytes, validate


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        print(f"cona: error: {message} (see cona export --help)", file=sys.stderr)
        raise SystemExit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="cona export", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="the run directory")
    parser.add_argument("--step", type=int, help="the checkpoint's optimizer step (default: the newest complete one)")
    parser.add_argument("--format", choices=["hf"], required=True, help="hf: a transformers model directory")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="where to write (created; must be new or empty)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into a non-empty --out, replacing its config.json and model weights")  # fmt: skip
    parser.add_argument("--job", type=Path, metavar="JOB.yaml",
                        help="the job, when neither the checkpoint nor the run directory records the model")  # fmt: skip
    parser.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="larger models are split into shards of this size with an index (default 5GB)")  # fmt: skip
    return parser.parse_args(argv)


def find_checkpoint(run_dir: RunDir, step: int | None) -> Path:
    """The complete checkpoint to export; ValueError naming what is there otherwise."""
    from cona.trainer.checkpoint import checksum_problem, verify_checkpoint

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


def model_of(run_dir: RunDir, checkpoint: Path, job: Path | None) -> ModelSpec:
    """The model the checkpoint holds: `--job` when given, else its trainer state's, else run.yaml's."""
    if job is not None:
        return load_job(job).model
    recorded = json.loads((checkpoint / TRAINER_STATE).read_text()).get("model")
    if recorded:
        return validate(ModelSpec, recorded, source=f"{checkpoint / TRAINER_STATE} model")
    if run_dir.run_yaml.exists():
        data = load_yaml(run_dir.run_yaml)
        if isinstance(data.get("job"), dict):
            return job_from_dict(data["job"], source=f"{run_dir.run_yaml} job").model
    raise ValueError(f"{checkpoint}: records no model and {run_dir.run_yaml} does not exist; pass --job JOB.yaml")


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
        spec = model_of(run_dir, checkpoint, args.job)
        from cona.trainer import hf

        if args.out.exists() and not args.out.is_dir():
            raise ConfigError(f"--out {args.out}: a file, not a directory; give a directory for config.json and the weights")
        # Another model may live there (the one the run started from, say): replacing its weights takes a decision.
        if args.out.is_dir() and any(args.out.iterdir()) and not args.overwrite:
            raise ConfigError(f"--out {args.out}: not empty; give a new directory, or --overwrite to replace its "
                              "config.json and model weights")  # fmt: skip
        files = hf.export_checkpoint(checkpoint, args.out, spec=spec, max_shard_bytes=max_shard)
    except (ConfigError, ValueError) as e:
        print(f"cona: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # a control-plane-only install: the export reads torch checkpoints
        print(f"cona: error: cona export needs torch and safetensors (pip install cona in the trainer's environment): "
              f"{e}", file=sys.stderr)  # fmt: skip
        return 2
    family = hf.ARCHITECTURES[spec.family]
    print(f"wrote {args.out} ({family}, {spec.num_params:,} parameters, step {int(checkpoint.name.split('-')[1])}): "
          f"{', '.join(p.name for p in files)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
