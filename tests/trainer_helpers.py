"""Helpers for the trainer tests: tiny jobs, real `torchrun` launches and readers of what the trainer wrote."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from cona.protocol.rundir import ExitRecord

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE = REPO / "data" / "shakespeare.txt"
_SYNTHETIC = Path(os.environ.get("TMPDIR", "/tmp")) / "cona-test-corpus.txt"


def corpus_path() -> Path:
    """The Shakespeare corpus when fetched, else a deterministic synthetic text (so tests never need the network)."""
    if SHAKESPEARE.exists() and SHAKESPEARE.stat().st_size > 1_000_000:
        return SHAKESPEARE
    if not _SYNTHETIC.exists():
        import random

        rng = random.Random(0)
        words = [
            "".join(rng.choice("etaoinshrdlucmfwypvbgkjqxz") for _ in range(rng.randint(1, 8))) for _ in range(500)
        ]
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(40_000)]
        tmp = _SYNTHETIC.with_suffix(".tmp")
        tmp.write_text("\n".join(lines))
        tmp.replace(_SYNTHETIC)
    return _SYNTHETIC


def write_job(directory: Path, *, preset: str = "tiny-gpt", name: str = "job.yaml", **sections: dict) -> Path:
    """A tiny job YAML: small eval, no warmup surprises, frequent heartbeats; `sections` override by section."""
    job: dict[str, Any] = {
        "name": f"test-{preset}",
        "seed": 0,
        "model": {"preset": preset},
        "data": {"path": str(corpus_path())},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4, "warmup_samples": 64, "weight_decay": 0.1, "grad_clip": 1.0},
        "batch": {"min_gbs": 8, "max_gbs": 128, "base_gbs": 16},
        "target": {"max_samples": 100_000},
        "eval": {"interval_samples": 100_000, "num_windows": 8, "batch_size": 8},
        "checkpoint": {"interval_steps": 1000, "keep": 20},
        "heartbeat": {"interval_steps": 1},
    }
    for section, values in sections.items():
        job.setdefault(section, {}).update(values)
    path = directory / name
    path.write_text(yaml.safe_dump(job))
    return path


@dataclasses.dataclass
class Launch:
    returncode: int
    exit: ExitRecord | None
    """attempts/<n>/exit.json (the trainer's own exit code; torchrun exits 1 whenever a worker does not exit 0)."""
    stdout: str
    stderr: str

    @property
    def exit_code(self) -> int | None:
        return self.exit.exit_code if self.exit else None


def trainer_env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def trainer_command(
    run_dir: Path, *, nproc: int, strategy: str | None, job: Path | None, max_steps: int | None = None,
    attempt: int | None = 0, extra: tuple[str, ...] = (), module: str = "cona.trainer",
) -> list[str]:  # fmt: skip
    """`torchrun --standalone --nproc-per-node=N -m cona.trainer ...`, or plain `python -m cona.trainer` for nproc=0.

    `None` for job, strategy or attempt leaves the flag out (the trainer then reads the run directory). `module`
    replaces `cona.trainer`, e.g. with a test's wrapper that injects a fault (`tests.save_fault_trainer`).
    """
    args = ["--run-dir", str(run_dir)]
    if attempt is not None:
        args += ["--attempt", str(attempt)]
    if job is not None:
        args += ["--job", str(job)]
    if strategy is not None:
        args += ["--strategy", strategy]
    if max_steps is not None:
        args += ["--max-steps", str(max_steps)]
    args += list(extra)
    if nproc == 0:
        return [sys.executable, "-m", module, *args]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*launcher, "--max-restarts=0", "-m", module, *args]


def launch(
    run_dir: Path, *, nproc: int, strategy: str | None, job: Path | None, max_steps: int | None = None,
    attempt: int | None = 0, extra: tuple[str, ...] = (), timeout: float = 300, module: str = "cona.trainer",
    env: dict[str, str] | None = None,
) -> Launch:  # fmt: skip
    """Run the trainer to completion (nproc=0: without torchrun, a world of one); `env` adds to its environment."""
    cmd = trainer_command(run_dir, nproc=nproc, strategy=strategy, job=job, max_steps=max_steps, attempt=attempt,
                          extra=extra, module=module)  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env={**trainer_env(), **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    from cona.protocol.rundir import RunDir

    if attempt is None:  # the trainer took the newest launch record's attempt
        newest = RunDir(run_dir).latest_launch()
        attempt = newest.attempt if newest else 0
    exit_data = RunDir(run_dir).read_exit(attempt)
    return Launch(returncode=proc.returncode, exit=exit_data, stdout=proc.stdout, stderr=proc.stderr)


def heartbeats(run_dir: Path, attempt: int = 0) -> list[dict[str, Any]]:
    path = run_dir / "heartbeats" / f"{attempt}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def step_records(run_dir: Path, attempt: int) -> dict[int, dict[str, Any]]:
    """The periodic (per-step) heartbeats of one attempt by step."""
    return {hb["step"]: hb for hb in heartbeats(run_dir, attempt) if hb.get("event") is None}


def describe(result: Launch) -> str:
    """The tail of a failed launch's output, for assertion messages."""
    lines = [line for line in result.stderr.splitlines() if "Warning" not in line and "warnings.warn" not in line]
    return f"returncode={result.returncode} exit={result.exit}\n" + "\n".join(lines[-40:])


def one_rank_main(tmp_path: Path, monkeypatch: Any, *, step: Any, attempt: int, extra: tuple[str, ...] = ()) -> tuple[Any, list[str]]:
    """A fresh run directory and `cona.trainer.main`'s arguments for one rank in this process (no torchrun
    environment) whose `Trainer.step` is `step`: how a rank ends when its step raises, without launching torchrun."""
    from cona.protocol.rundir import RunDir
    from cona.trainer.train import Trainer

    monkeypatch.setattr(Trainer, "step", step)
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    job = write_job(tmp_path)
    return run, ["--run-dir", str(run.root), "--job", str(job), "--strategy", "dp=1,tp=1,pp=1,mbs=4,gbs=16",
                 "--attempt", str(attempt), *extra]  # fmt: skip
