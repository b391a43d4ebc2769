"""Each model family's tiny preset trains (validation loss falls) and is layout-invariant under pipelines."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from cona.protocol.rundir import ExitCode

try:
    from tests.trainer_helpers import describe, heartbeats, launch, step_records, write_job
except ImportError:  # tests/ is not a package here
    from trainer_helpers import describe, heartbeats, launch, step_records, write_job


@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-llama", "tiny-bert"])
def test_tiny_preset_trains_and_validation_loss_falls(tmp_path, preset):
    job = write_job(
        tmp_path, preset=preset, optimizer={"lr": 3e-3, "warmup_samples": 64, "weight_decay": 0.0},
        eval={"interval_samples": 320, "num_windows": 16, "batch_size": 16},
    )  # fmt: skip
    run = tmp_path / "run"
    result = launch(run, nproc=0, strategy="dp=1,mbs=16,gbs=16", job=job, max_steps=40)
    assert result.exit_code == ExitCode.STOPPED, describe(result)
    evals = [hb for hb in heartbeats(run) if hb.get("val_loss") is not None]
    assert [hb["step"] for hb in evals] == [0, 20, 40]
    first, last = evals[0]["val_loss"], evals[-1]["val_loss"]
    assert last < first - 0.5, f"{preset}: validation loss {first:.3f} → {last:.3f}"
    assert evals[-1]["val_perplexity"] == pytest.approx(2.718281828 ** last, rel=1e-6)


# One worker runs this module (ONE_WORKER_MODULES, tests/conftest.py): each reference runs once, not per worker.
@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Callable[[str, dict], Path]:
    """The run directory of one process training `preset` with `model`'s overrides for 3 steps at gbs 16, the
    reference of the parallel layouts below; one run per (preset, model) for the module. Its job has no `parallel`
    section: the parallel layouts' (pipeline schedule, sequence parallelism, recompute) change nothing in a world
    of one, where no pipeline runs, no tp splits the sequence and recompute runs the same ops again."""
    runs: dict[tuple, Path] = {}

    def run(preset: str, model: dict) -> Path:
        key = (preset, tuple(sorted(model.items())))
        if key not in runs:
            directory = tmp_path_factory.mktemp(f"one-process-{preset}")
            job = write_job(directory, preset=preset, model=model)
            single = launch(directory / "run", nproc=0, strategy="dp=1,mbs=16,gbs=16", job=job, max_steps=3)
            assert single.exit_code == ExitCode.STOPPED, describe(single)
            runs[key] = directory / "run"
        return runs[key]

    return run


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("preset", "strategy", "schedule", "model"),
    [
        pytest.param("tiny-bert", "dp=2,tp=1,pp=2,mbs=2,gbs=16", "interleaved", {}, id="bert-tied-dp2-pp2-interleaved"),
        pytest.param("tiny-llama", "dp=1,tp=2,pp=2,mbs=2,gbs=16", "gpipe", {}, id="llama-gqa-tp2-pp2-gpipe"),
        pytest.param("tiny-gpt", "dp=1,tp=2,pp=2,mbs=2,gbs=16", "1f1b", {"tie_embeddings": True},
                     id="gpt-tied-tp2-pp2-1f1b"),
        # 4 layers over 3 stages (2, 1, 1): the uneven split the planner takes where no even one fits the devices.
        pytest.param("tiny-llama", "dp=1,tp=1,pp=3,mbs=2,gbs=16", "1f1b", {}, id="llama-uneven-pp3-1f1b"),
        # 6 layers over 2 ranks × 2 chunks (2, 2, 1, 1): the planner keeps interleaved chunks equal (its cost
        # assumes them), but the trainer run by hand (`--strategy`) splits unequal ones by the same rule.
        pytest.param("tiny-gpt", "dp=1,tp=1,pp=2,mbs=2,gbs=16", "interleaved", {"num_layers": 6},
                     id="gpt-uneven-chunks-pp2-interleaved"),
    ],
)  # fmt: skip
def test_pipelines_match_one_process(tmp_path, one_process, preset, strategy, schedule, model):
    """A tied head (BERT's decoder, a tied GPT head) across the first and last stage, also under tp, llama's kv
    heads split by tp, and stages of unequal size: same losses."""
    job = write_job(tmp_path, preset=preset, parallel={"pipeline_schedule": schedule}, model=model)
    single = one_process(preset, model)
    degrees = dict(part.split("=") for part in strategy.split(","))
    nproc = int(degrees["dp"]) * int(degrees["tp"]) * int(degrees["pp"])
    parallel = launch(tmp_path / "parallel", nproc=nproc, strategy=strategy, job=job, max_steps=3)
    assert parallel.exit_code == ExitCode.STOPPED, describe(parallel)
    # Stopping at --max-steps is the end the user asked for: torchrun exits 0 and prints no failure dump.
    assert parallel.returncode == 0 and "ChildFailedError" not in parallel.stderr, describe(parallel)
    want, got = step_records(single, 0), step_records(tmp_path / "parallel", 0)
    for step in (1, 2, 3):
        assert got[step]["train_loss"] == pytest.approx(want[step]["train_loss"], abs=1e-5), step
    start = next(hb for hb in heartbeats(tmp_path / "parallel") if hb.get("event") == "eval")
    reference = next(hb for hb in heartbeats(single) if hb.get("event") == "eval")
    assert start["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)


@pytest.mark.parametrize(
    ("target", "reason"),
    [({"max_samples": 96}, "max_samples"), ({"val_perplexity": 200.0}, "val_perplexity")],
)
def test_targets_end_the_run_with_a_final_checkpoint(tmp_path, target, reason):
    job = write_job(tmp_path, target=target, eval={"interval_samples": 64, "num_windows": 8, "batch_size": 8})
    run = tmp_path / "run"
    result = launch(run, nproc=0, strategy="dp=1,mbs=16,gbs=16", job=job)
    assert result.returncode == ExitCode.DONE == result.exit_code, describe(result)
    assert reason in result.exit.reason
    last = heartbeats(run)[-1]
    assert last["event"] == "exit" and last["exit_code"] == ExitCode.DONE and last["step"] == result.exit.step
    assert (run / "checkpoints" / f"step-{result.exit.step:08d}" / "COMPLETE").exists()
    if "max_samples" in target:
        assert last["samples"] == 96
    else:
        assert last["samples"] % 64 == 0
        evals = [hb for hb in heartbeats(run) if hb.get("event") == "eval"]
        assert evals[-1]["val_perplexity"] <= 200.0 < evals[-2]["val_perplexity"]


def test_run_directory_defaults_and_bit_identical_reruns(tmp_path):
    """Without --job/--strategy/--attempt the trainer reads run.yaml and the newest launch record; reruns are
    bit-identical."""
    import yaml
    from cona.protocol.job import job_to_dict, load_job
    from cona.protocol.rundir import LaunchRecord, RunDir
    from cona.protocol.strategy import Strategy

    job = write_job(tmp_path)
    explicit = launch(tmp_path / "explicit", nproc=0, strategy="dp=1,mbs=4,gbs=16", job=job, max_steps=3)
    assert explicit.exit_code == ExitCode.STOPPED, describe(explicit)
    run = tmp_path / "from-run-dir"
    run.mkdir()
    (run / "run.yaml").write_text(yaml.safe_dump({"job": job_to_dict(load_job(job))}))
    strategy = {"dp": 1, "tp": 1, "pp": 1, "mbs": 4, "gbs": 16}
    RunDir(run).write_launch(LaunchRecord(attempt=3, strategy=Strategy.from_dict(strategy), backend="local",
                                          written_at=0.0))  # fmt: skip
    implicit = launch(run, nproc=0, strategy=None, job=None, max_steps=3, attempt=None)
    assert implicit.exit_code == ExitCode.STOPPED, describe(implicit)
    got, want = step_records(run, 3), step_records(tmp_path / "explicit", 0)
    assert got[1]["strategy"] == strategy
    assert [got[k]["train_loss"] for k in (1, 2, 3)] == [want[k]["train_loss"] for k in (1, 2, 3)]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("preset", "strategy", "recompute"),
    [
        # BERT's post-norm blocks over two stages (slices of the sequence pass between them); llama's RoPE and
        # grouped-query attention with FSDP2, under selective recompute (the gathers run again in backward).
        pytest.param("tiny-bert", "dp=1,tp=2,pp=2,mbs=2,gbs=16", "none", id="bert-tp2-pp2"),
        pytest.param("tiny-llama", "dp=2,tp=2,pp=1,mbs=2,gbs=16", "selective", id="llama-dp2-tp2-selective"),
    ],
)  # fmt: skip
def test_sequence_parallelism_matches_one_process(tmp_path, one_process, preset, strategy, recompute):
    job = write_job(tmp_path, preset=preset, parallel={"sequence_parallel": True, "recompute": recompute})
    parallel = launch(tmp_path / "parallel", nproc=4, strategy=strategy, job=job, max_steps=3)
    assert parallel.exit_code == ExitCode.STOPPED, describe(parallel)
    want, got = step_records(one_process(preset, {}), 0), step_records(tmp_path / "parallel", 0)
    for step in (1, 2, 3):
        assert got[step]["train_loss"] == pytest.approx(want[step]["train_loss"], abs=1e-5), step
