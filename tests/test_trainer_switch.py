"""Strategy switches through a checkpoint (real torchrun, 4 CPU processes, gloo) against runs that never switched.

One run directory goes through a chain of layouts, two optimizer steps each, every segment a new attempt that
resumes from the previous segment's checkpoint:

    dp2·tp2 → dp2·pp2 → dp4 (mbs 4) → dp2·tp2 → tp2·pp2 with gbs 16→32 and mbs 2→4

which covers (dp2,tp2)→(dp2,pp2), (dp2,pp2)→(dp4), (dp4)→(dp2,tp2) and (tp2,dp2)→(tp2,pp2), mbs changes and a
gbs change, each switch once (the shortest chain that does: the dp2·tp2 layout is left two ways, so it starts
there). At every switch the parameters and AdamW state loaded under the new layout equal the saved ones
exactly. The losses equal those of a run that never switched within 1e-5: the single-process gbs-16 reference
before the gbs change, and one process resuming from the same checkpoint with gbs 32 after it. The samples
consumed are exactly the reference's, none lost or repeated (`audit_samples`), across the gbs change too.

Under sequence parallelism the same checks run on the chain without its dp4 segment, the layouts that sequence
parallelism changes (tp > 1) and the switches into and out of them:

    dp2·tp2 → dp2·pp2 → dp2·tp2 → tp2·pp2 with gbs 16→32 and mbs 2→4
"""

from __future__ import annotations

import shutil

import pytest
import torch
from cona.protocol.rundir import ExitCode
from cona.protocol.samples_log import audit_samples
from cona.trainer.checkpoint import read_checkpoint_tensors

try:
    from tests.trainer_helpers import describe, launch, step_records, write_job
except ImportError:  # tests/ is not a package here
    from trainer_helpers import describe, launch, step_records, write_job

STEPS_PER_SEGMENT = 2
CHAIN = [
    "dp=2,tp=2,pp=1,mbs=2,gbs=16",
    "dp=2,tp=1,pp=2,mbs=2,gbs=16",
    "dp=4,tp=1,pp=1,mbs=4,gbs=16",
    "dp=2,tp=2,pp=1,mbs=2,gbs=16",
    "dp=1,tp=2,pp=2,mbs=4,gbs=32",
]
# Sequence parallelism changes nothing where tp = 1, so the dp4 segment would train and save as CHAIN's does. The
# rest still starts under tp, leaves it for dp2·pp2 and comes back, then switches from tp to tp·pp across the gbs
# and mbs change: every layout that sequence parallelism changes is trained from scratch, loaded into from a
# layout without it and saved for one, and loaded from a layout with it.
SEQUENCE_PARALLEL_CHAIN = [
    "dp=2,tp=2,pp=1,mbs=2,gbs=16",
    "dp=2,tp=1,pp=2,mbs=2,gbs=16",
    "dp=2,tp=2,pp=1,mbs=2,gbs=16",
    "dp=1,tp=2,pp=2,mbs=4,gbs=32",
]


def _losses(run_dir, attempts) -> dict[int, float]:
    losses: dict[int, float] = {}
    for attempt in attempts:
        losses.update({step: hb["train_loss"] for step, hb in step_records(run_dir, attempt).items()})
    return losses


def _assert_same_state(saved: dict, loaded: dict, where: str) -> None:
    assert saved.keys() == loaded.keys(), f"{where}: keys differ: {sorted(saved.keys() ^ loaded.keys())[:5]}"
    optimizer_state = [k for k in saved if k.startswith("optim.state.")]
    assert any(k.endswith("exp_avg_sq") for k in optimizer_state), f"{where}: no AdamW state in the checkpoint"
    for key, value in saved.items():
        other = loaded[key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, other), f"{where}: {key} differs after the load"
        else:
            assert value == other, f"{where}: {key}: {value!r} != {other!r}"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("sequence_parallel", "chain"),
    [(False, CHAIN), (True, SEQUENCE_PARALLEL_CHAIN)],
    ids=["tp", "tp-sequence-parallel"],
)
def test_switch_chain_matches_a_run_that_never_switched(tmp_path, sequence_parallel, chain):
    """With sequence parallelism the tp layouts' norms are DTensors (replicated over tp) and their blocks' inputs
    slices of the sequence: the chain in and out of them loads and trains the same."""
    job = write_job(tmp_path, parallel={"sequence_parallel": sequence_parallel})
    last_gbs16_step = STEPS_PER_SEGMENT * (len(chain) - 1)

    # The never-switched reference: one process, one layout, the same gbs.
    reference = tmp_path / "reference"
    ref = launch(reference, nproc=0, strategy="dp=1,mbs=8,gbs=16", job=job, max_steps=last_gbs16_step)
    assert ref.exit_code == ExitCode.STOPPED, describe(ref)
    expected = _losses(reference, [0])
    assert sorted(expected) == list(range(1, last_gbs16_step + 1))

    run = tmp_path / "run"
    for attempt, strategy in enumerate(chain):
        start_step = attempt * STEPS_PER_SEGMENT
        dump = tmp_path / f"loaded-{attempt}"
        result = launch(
            run, nproc=4, strategy=strategy, job=job, attempt=attempt, max_steps=start_step + STEPS_PER_SEGMENT,
            extra=("--dump-loaded-state", str(dump)) if attempt else (),
        )  # fmt: skip
        assert result.exit_code == ExitCode.STOPPED, describe(result)
        if attempt:
            saved = read_checkpoint_tensors(run / "checkpoints" / f"step-{start_step:08d}")
            _assert_same_state(saved, read_checkpoint_tensors(dump), f"{chain[attempt - 1]} → {strategy}")
        if strategy.endswith("gbs=16"):
            got = _losses(run, [attempt])
            for step in range(start_step + 1, start_step + STEPS_PER_SEGMENT + 1):
                assert got[step] == pytest.approx(expected[step], abs=1e-5), f"{strategy}: step {step}"

    # After the gbs change: the same losses as one process resuming from that checkpoint with gbs 32.
    after = tmp_path / "after-gbs-change"
    (after / "checkpoints").mkdir(parents=True)
    switch_point = run / "checkpoints" / f"step-{last_gbs16_step:08d}"
    shutil.copytree(switch_point, after / "checkpoints" / switch_point.name)
    final_step = last_gbs16_step + STEPS_PER_SEGMENT
    single = launch(after, nproc=0, strategy="dp=1,mbs=8,gbs=32", job=job, max_steps=final_step)
    assert single.exit_code == ExitCode.STOPPED, describe(single)
    got, want = _losses(run, [len(chain) - 1]), _losses(after, [0])
    for step in range(last_gbs16_step + 1, final_step + 1):
        assert got[step] == pytest.approx(want[step], abs=1e-5), f"after the gbs change: step {step}"

    # No sample lost or repeated, across every switch and the gbs change.
    ranges = audit_samples(run)
    assert ranges[:last_gbs16_step] == audit_samples(reference)
    assert ranges == [(16 * k, 16 * k + 16) for k in range(last_gbs16_step)] + [
        (16 * last_gbs16_step + 32 * k, 16 * last_gbs16_step + 32 * (k + 1)) for k in range(STEPS_PER_SEGMENT)
    ]
