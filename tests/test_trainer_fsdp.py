"""FSDP2's all-gathers per step under gradient accumulation (two CPU processes on gloo, the trainer's own
`ParallelModel`): what the cost model charges (`cona.orchestrator.costmodel`, data parallelism) is what runs."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

MICRO_BATCHES = 4  # per replica
DP = 2


def _rank(rank: int, store_path: str, results: dict) -> None:
    """Both settings of `parallel.sharded_dp`, one after the other in one process group: one spawn of the two
    processes instead of two (each pays for starting Python and importing torch)."""
    import torch.distributed as dist
    from cona.protocol.job import job_from_dict
    from cona.protocol.strategy import Strategy
    from cona.trainer.distributed import DistEnv
    from cona.trainer.parallel import ParallelModel
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    dist.init_process_group("gloo", store=dist.FileStore(store_path, DP), rank=rank, world_size=DP)
    try:
        gathers = 0
        original = _fsdp_param_group.foreach_all_gather

        def counted(*args, **kwargs):
            nonlocal gathers
            gathers += 1
            return original(*args, **kwargs)

        _fsdp_param_group.foreach_all_gather = counted
        for sharded_dp in (False, True):
            torch.manual_seed(0)
            job = job_from_dict({"model": {"preset": "tiny-gpt", "num_layers": 2},
                                 "parallel": {"sharded_dp": sharded_dp}})  # fmt: skip
            env = DistEnv(rank=rank, world_size=DP, local_rank=rank, device=torch.device("cpu"), backend="gloo")
            mbs = 2
            model = ParallelModel(job, Strategy(dp=DP, tp=1, pp=1, mbs=mbs, gbs=mbs * MICRO_BATCHES * DP), env)
            vocab, seq = job.model.vocab_size, job.model.seq_len
            generator = torch.Generator().manual_seed(1 + rank)  # each replica its own samples
            x = torch.randint(0, vocab, (mbs * MICRO_BATCHES, seq), generator=generator)
            y = torch.randint(0, vocab, (mbs * MICRO_BATCHES, seq), generator=generator)
            units = len(model.parts[0].layers) + 1  # every block, then the root
            losses = []
            for _ in range(2):
                model.zero_grad()
                model.stats.begin_step(use_adam=False)
                gathers = 0
                losses.append(float(model.forward_backward(x, y, scale=1.0 / x.numel())))
                step_gathers = gathers
                model.stats.global_terms(model.parameters())
                model.stats.local_terms()
                model.clip_and_step(grad_sqnorm=1.0, max_norm=None, lr=1e-3)
            if rank == 0:
                results[sharded_dp] = {"gathers": step_gathers, "units": units, "losses": losses}
            groups = model.own_process_groups()  # the next model makes its own, as after an in-place switch
            del model
            for group in groups:
                dist.destroy_process_group(group)
    finally:
        dist.destroy_process_group()


def _run() -> dict[bool, dict]:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), results), nprocs=DP, join=True)
        return dict(results)


@pytest.mark.distributed
def test_unsharded_dp_gathers_once_per_step_and_trains_the_same():
    runs = _run()
    kept, resharded = runs[False], runs[True]
    # sharded_dp false keeps the gathered parameters across the micro-batches: one gather per FSDP unit and
    # step. Before, FSDP2 freed them after every backward and gathered them again for each micro-batch.
    assert kept["gathers"] == kept["units"], kept
    # true (ZeRO-3-like) gathers blocks for each forward and backward: many more.
    assert resharded["gathers"] > MICRO_BATCHES * kept["units"], resharded
    # Where parameters live between micro-batches does not touch the math.
    assert kept["losses"] == resharded["losses"]
