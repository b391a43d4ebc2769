"""Pipeline schedules at the edges `cona.protocol.feasibility` allows (real torchrun, CPU processes, gloo): 1F1B with
fewer micro-batches per replica than stages (run as GPipe: torch's Schedule1F1B refuses it) and the interleaved
schedule with three model chunks per rank. Each trains with the losses of one process on the same data."""

from __future__ import annotations

import pytest
from cona.protocol.rundir import ExitCode

try:
    from tests.trainer_helpers import describe, heartbeats, launch, step_records, write_job
except ImportError:  # tests/ is not a package here
    from trainer_helpers import describe, heartbeats, launch, step_records, write_job

STEPS = 2


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("nproc", "strategy", "parallel", "num_layers"),
    [
        # 2 micro-batches over 4 stages: gbs/(dp·mbs) = 16/(1·8) < pp.
        pytest.param(4, "dp=1,tp=1,pp=4,mbs=8,gbs=16", {"pipeline_schedule": "1f1b"}, 4, id="1f1b-m2-pp4"),
        # pp=2 ranks × 3 chunks = 6 stages of one layer; 4 micro-batches in 2 rounds.
        pytest.param(2, "dp=1,tp=1,pp=2,mbs=4,gbs=16", {"pipeline_schedule": "interleaved", "virtual_stages": 3},
                     6, id="interleaved-v3-pp2"),
    ],
)  # fmt: skip
def test_schedule_matches_one_process(tmp_path, nproc, strategy, parallel, num_layers):
    job = write_job(tmp_path, model={"preset": "tiny-gpt", "num_layers": num_layers}, parallel=parallel)
    single = launch(tmp_path / "single", nproc=0, strategy="dp=1,mbs=16,gbs=16", job=job, max_steps=STEPS)
    assert single.exit_code == ExitCode.STOPPED, describe(single)
    piped = launch(tmp_path / "pipeline", nproc=nproc, strategy=strategy, job=job, max_steps=STEPS)
    assert piped.exit_code == ExitCode.STOPPED, describe(piped)
    want, got = step_records(tmp_path / "single", 0), step_records(tmp_path / "pipeline", 0)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert got[step]["train_loss"] == pytest.approx(want[step]["train_loss"], abs=1e-5), step
    # The step-0 evaluation goes through the same schedule's eval.
    start = next(hb for hb in heartbeats(tmp_path / "pipeline") if hb.get("event") == "eval")
    reference = next(hb for hb in heartbeats(tmp_path / "single") if hb.get("event") == "eval")
    assert start["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)
