"""The memory model's tensor-parallel activations, with and without sequence parallelism, against what the trainer's
blocks really save on each tp rank (2 CPU processes, gloo; `tests/sp_memory_worker.py` measures as
tests/test_memorymodel.py does at world 1: 3 layers minus 1 layer after forward, `LiveBytes`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cona.orchestrator.memorymodel import estimate_memory
from cona.protocol.job import ModelSpec, ParallelSpec

from tests.conftest import REPO

WORKER = Path(__file__).resolve().parent / "sp_memory_worker.py"


# One worker runs this module (`ONE_WORKER_MODULES` in tests/conftest.py): one measurement, not one per worker.
@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict[str, int]]:
    out = tmp_path_factory.mktemp("sp-memory")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(WORKER), str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def _modelled(family: str, mode: str, sequence_parallel: bool) -> float:
    def activations(layers: int) -> float:
        spec = ModelSpec(
            family=family, num_layers=layers, hidden_size=64, num_heads=4, num_kv_heads=2 if family == "llama" else 4,
            ffn_hidden_size=(3 if family == "llama" else 4) * 64, vocab_size=512, seq_len=64,
        )  # fmt: skip
        parallel = ParallelSpec(recompute=mode, sequence_parallel=sequence_parallel)
        return estimate_memory(model=spec, parallel=parallel, dp=1, tp=2, pp=1, mbs=2, num_microbatches=1,
                               device="cpu").activations  # fmt: skip

    return activations(3) - activations(1)


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["gpt", "llama", "bert"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp-sp"])
def test_a_tp_block_saves_what_the_model_says_on_every_rank(measured, family, mode, sequence_parallel):
    modelled = _modelled(family, mode, sequence_parallel)
    for rank, values in enumerate(measured):
        got = values[f"{family} {mode} {sequence_parallel}"]
        assert modelled == pytest.approx(got, rel=0.01), f"rank {rank}: measured {got}, modelled {modelled}"


def test_sequence_parallelism_saves_less_in_every_recompute_mode():
    """What the measured test pins, as a property: the norms keep slices of the sequence (no recompute), the
    checkpoint keeps a slice of the block input (full), the reduce-scattered outputs are slices and the gathered
    inputs are gathered again in backward rather than kept (selective)."""
    for family in ("gpt", "llama", "bert"):
        for mode in ("none", "selective"):
            assert _modelled(family, mode, True) < _modelled(family, mode, False), (family, mode)
        assert _modelled(family, "full", True) == _modelled(family, "full", False) / 2
