"""Cluster profiles users bring that differ from the shipped ones: PCIe-only nodes on Ethernet, odd GPU counts per
node, GB200-like NVLink domains of 72, single 16 GB GPUs, 1024 and 4096 GPUs. What the planner, the cost model and
the renderers make of them (fast, CPU, no training)."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from cona.orchestrator.costmodel import collective_time, data_parallel_nodes, predict
from cona.orchestrator.job import Job, load_job
from cona.orchestrator.planner import (
    enumerate_candidates,
    no_feasible_strategy,
    rank_by_iter_time,
    static_choice,
)
from cona.orchestrator.profile import ClusterProfile
from cona.protocol.feasibility import virtual_stages

from tests.conftest import EXAMPLES, run_cona

JOBS = ("gpt3-1.3b", "llama-3.2-1b", "bert-large")


def _profile(name: str, *, nodes: int, gpus_per_node: int, memory: str = "80 GB", peak_tflops: float = 989,
             memory_bandwidth: str = "3350 GB/s", intra: str = "450 GB/s", inter: str = "3200 Gbit/s",
             backend: str = "slurm", **extra: Any) -> ClusterProfile:  # fmt: skip
    data: dict[str, Any] = {
        "name": name, "backend": backend, "nodes": nodes, "gpus_per_node": gpus_per_node,
        "accelerator": {"name": name, "peak_tflops": peak_tflops, "memory": memory,
                        "memory_bandwidth": memory_bandwidth},
        "network": {"intra_node_bandwidth": intra, "inter_node_bandwidth": inter},
        **extra,
    }  # fmt: skip
    return ClusterProfile.model_validate(data)


# The range of profiles: each differs from the shipped ones (8 GPUs per node, NVLink, InfiniBand) in one way.
PROFILES = {
    "a100-pcie-4x4-eth": dict(nodes=4, gpus_per_node=4, memory="40 GB", peak_tflops=312,
                              memory_bandwidth="1555 GB/s", intra="32 GB/s", inter="25 Gbit/s"),
    "h100-1x8": dict(nodes=1, gpus_per_node=8),
    "gh200-16x4": dict(nodes=16, gpus_per_node=4, memory="96 GB", inter="800 Gbit/s"),
    "mi300x-2x8": dict(nodes=2, gpus_per_node=8, memory="192 GB", peak_tflops=1307, memory_bandwidth="5300 GB/s"),
    "v100-3x6": dict(nodes=3, gpus_per_node=6, memory="32 GB", peak_tflops=125, memory_bandwidth="900 GB/s",
                     intra="150 GB/s", inter="100 Gbit/s"),
    "gb200-nvl72": dict(nodes=1, gpus_per_node=72, memory="186 GB", peak_tflops=2500, memory_bandwidth="8000 GB/s",
                        intra="900 GB/s"),
    "gb200-2xnvl72": dict(nodes=2, gpus_per_node=72, memory="186 GB", peak_tflops=2500,
                          memory_bandwidth="8000 GB/s", intra="900 GB/s"),
    "t4-1x1": dict(nodes=1, gpus_per_node=1, memory="16 GB", peak_tflops=65, memory_bandwidth="320 GB/s",
                   backend="local"),
    "h100-128x8": dict(nodes=128, gpus_per_node=8),
}  # fmt: skip


@pytest.fixture(scope="module")
def jobs() -> dict[str, Job]:
    return {name: load_job(EXAMPLES / f"{name}.yaml") for name in JOBS}


# Sanity of every prediction on every profile -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_every_candidate_on_each_profile_is_sane(name, jobs):
    profile = _profile(name, **PROFILES[name])
    for job in jobs.values():
        candidates = enumerate_candidates(profile=profile, job=job)
        flops_per_sample = 6 * job.model.num_params * job.model.seq_len
        for c in candidates:
            p = c.prediction
            if p is None:
                continue
            parts = (p.compute_s, p.tp_comm_s, p.pipeline_bubble_s, p.p2p_s, p.dp_comm_s, p.optimizer_s, p.memory_bytes)
            assert all(math.isfinite(x) and x >= 0 for x in parts), (name, job.name, c.strategy, p)
            assert p.pipeline_bubble_s < p.iter_time_s, (name, job.name, c.strategy)
            if not c.feasible:
                continue
            assert p.memory_bytes <= profile.accelerator.memory_bytes, (name, job.name, c.strategy)
            assert c.pp * virtual_stages(job, c.pp) <= job.model.num_layers, (name, job.name, c.strategy)
            # No strategy trains faster than all devices at the matmuls' own efficiency would.
            mfu = c.samples_per_s * flops_per_sample / (profile.num_gpus * profile.accelerator.peak_tflops * 1e12)
            assert mfu <= profile.accelerator.matmul_efficiency, (name, job.name, c.strategy, mfu)


@pytest.mark.parametrize("name", [n for n in sorted(PROFILES) if n != "t4-1x1"])
def test_a_1b_model_on_each_multi_gpu_profile_has_a_feasible_strategy(name, jobs):
    profile = _profile(name, **PROFILES[name])
    for job in jobs.values():
        assert static_choice(profile=profile, job=job).feasible, (name, job.name)


def test_a_1b_model_on_one_16gb_gpu_is_refused_with_what_can_change_it(jobs):
    # 1.3B parameters hold 21 GB of fp32 parameters, gradients and Adam moments on one device: no recompute and no
    # shorter sequence fits them in 16 GB; more devices (FSDP shards them) or more memory do.
    profile = _profile("t4-1x1", **PROFILES["t4-1x1"])
    message = no_feasible_strategy(profile, jobs["gpt3-1.3b"])
    assert "accelerator.memory='16 GB'" in message and "give more devices" in message, message
    assert "recompute" not in message and "seq_len" not in message, message
    assert static_choice(profile=profile, job=jobs["bert-large"]).feasible  # BERT-Large fits one 16 GB GPU


def test_activations_over_memory_still_name_recompute(jobs):
    # Llama 3.2 1B at 32k tokens on 8 × 80 GB: the states fit, the activations and logits do not.
    profile = _profile("h100-1x8", **PROFILES["h100-1x8"])
    job = load_job(EXAMPLES / "llama-3.2-1b.yaml", ["model.seq_len=32768"])
    message = no_feasible_strategy(profile, job)
    assert "parallel.recompute=full" in message and "model.seq_len" in message, message


@pytest.mark.parametrize("nodes", [128, 512])
def test_planning_1024_and_4096_gpus_stays_fast(nodes, jobs):
    profile = _profile("h100", nodes=nodes, gpus_per_node=8)
    for job in jobs.values():
        start = time.perf_counter()
        candidates = enumerate_candidates(profile=profile, job=job)
        assert rank_by_iter_time(candidates)
        assert time.perf_counter() - start < 2.0, (nodes, job.name)


# Data-parallel groups that straddle nodes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dp", "tp", "pp", "gpus_per_node", "nodes"),
    [
        (16, 1, 9, 72, 2),  # two NVL72 racks: stage 4 holds ranks 64..79
        (4, 1, 6, 6, 2),  # nodes of 6: stage 1 holds ranks 4..7
        (2, 1, 3, 3, 2),  # nodes of 3: stage 1 holds ranks 2 and 3
        (2, 2, 9, 6, 2),  # stage 1 holds ranks 4..7, its dp groups {4, 6} and {5, 7}
        (8, 1, 4, 8, 1),  # aligned: every stage is a node
        (4, 2, 2, 8, 1),
        (16, 1, 2, 8, 2),  # aligned: every stage is two whole nodes
        (4, 4, 2, 8, 2),  # dp peers 4 ranks apart, two per node
        (4, 16, 1, 8, 4),  # tp on two whole nodes: each dp peer on nodes of its own
        (2, 1, 9, 6, 1),  # three stages per node of 6
    ],
)
def test_data_parallel_nodes_counts_the_nodes_of_the_widest_group(dp, tp, pp, gpus_per_node, nodes):
    assert data_parallel_nodes(dp=dp, tp=tp, pp=pp, gpus_per_node=gpus_per_node) == nodes


@pytest.mark.parametrize(
    ("name", "nodes", "gpus_per_node", "dp", "tp", "pp"),
    [
        # Two NVL72 racks, power-of-two batches: dp·tp = 16 per stage of pp = 9, so stage 4 (ranks 64..79) spans both
        # racks and its gradient reduce-scatter crosses the inter-rack network, not NVLink.
        ("gb200-2xnvl72", 2, 72, 16, 1, 9),
        # Nodes of 6: stages of 4 (d4t1p6) put ranks 4..7 of stage 1 on two nodes.
        ("v100-3x6", 4, 6, 4, 1, 6),
        # Nodes of 3 (a workstation's three GPUs): stage 1 of d2t1p3 is rank 2 of node 0 and rank 3 of node 1.
        ("v100-3x6", 2, 3, 2, 1, 3),
    ],
)
def test_dp_group_straddling_nodes_is_charged_the_network(name, nodes, gpus_per_node, dp, tp, pp, jobs):
    shape = {**PROFILES[name], "nodes": nodes, "gpus_per_node": gpus_per_node}
    fast = _profile(name, **{**shape, "inter": "100000 Gbit/s"})  # a network as fast as the in-node links
    slow = _profile(name, **{**shape, "inter": "25 Gbit/s"})
    kwargs = dict(job=jobs["gpt3-1.3b"], dp=dp, tp=tp, pp=pp, mbs=1, gbs=64)
    assert predict(profile=slow, **kwargs).dp_comm_s > 2 * predict(profile=fast, **kwargs).dp_comm_s


def test_two_nvl72_racks_keep_the_fastest_layouts_dp_groups_inside_a_rack(jobs):
    # Charged NVLink, d16t1p9 (stage 4 across the racks) came out fastest at gbs 64 (70 ms); its gradients cross
    # the 400 GB/s shared by 72 GPUs, and d8t1p18 (every stage inside a rack) is faster.
    profile = _profile("gb200-2xnvl72", **PROFILES["gb200-2xnvl72"])
    best = rank_by_iter_time(enumerate_candidates(profile=profile, job=jobs["gpt3-1.3b"], gbs_values=[64]))[0]
    assert data_parallel_nodes(dp=best.dp, tp=best.tp, pp=best.pp, gpus_per_node=72) == 1, best.strategy


# Rings across nodes also cross each node's own links ---------------------------------------------------------


def test_a_ring_across_nodes_is_no_faster_than_the_links_inside_them():
    # PCIe-only nodes (no NVLink, no peer-to-peer: 10 GB/s between GPUs through the host) with fat NICs: every hop
    # of a ring that spans two nodes except one per node runs over those in-node links too.
    intra, inter = (10e9, 0.0), (50e9, 0.0)
    across = collective_time(nbytes=1e9, ranks=8, per_node=4, kind="all_reduce", intra=intra, inter=inter)
    inside = collective_time(nbytes=1e9, ranks=4, per_node=4, kind="all_reduce", intra=intra, inter=inter)
    assert across >= inside


def test_pcie_nodes_with_fat_nics_do_not_run_tensor_parallelism_faster_across_nodes(jobs):
    profile = _profile("rtx-pcie-4x4", nodes=4, gpus_per_node=4, memory="48 GB", peak_tflops=362,
                       memory_bandwidth="960 GB/s", intra="10 GB/s", inter="1600 Gbit/s")  # fmt: skip
    job = jobs["gpt3-1.3b"]
    inside = predict(profile=profile, job=job, dp=4, tp=4, pp=1, mbs=1, gbs=64)
    across = predict(profile=profile, job=job, dp=2, tp=8, pp=1, mbs=1, gbs=64)
    assert across.tp_comm_s >= inside.tp_comm_s


# More devices than the model and its batch can use -----------------------------------------------------------


def test_more_devices_than_the_job_can_use_says_how_many_it_can():
    # tiny-llama: tp ≤ 2 (2 key/value heads), pp ≤ 4 (4 layers), dp·mbs ≤ 128 with mbs ≥ 2: at most 512 devices.
    profile = _profile("h100-128x8", **PROFILES["h100-128x8"])
    job = load_job(EXAMPLES / "tiny-llama.yaml")
    message = no_feasible_strategy(profile, job)
    assert "at most 512 devices" in message and "at most 64 (--profile-set nodes=64)" in message, message
    assert "raise batch.max_gbs" in message, message
    # The static policy trains at batch.base_gbs=16 alone: 8 replicas of 2, so 64 devices.
    with pytest.raises(ValueError, match=r"at most 64 devices .*raise batch\.base_gbs"):
        static_choice(profile=profile, job=job)


def test_cona_plan_on_too_many_devices_says_what_to_change(tmp_path):
    (tmp_path / "big.yaml").write_text(
        "name: big\nbackend: slurm\nnodes: 128\ngpus_per_node: 8\n"
        "accelerator: {peak_tflops: 989, memory: 80 GB}\n"
    )
    result = run_cona("plan", "--profile", str(tmp_path / "big.yaml"), "--job", str(EXAMPLES / "tiny-llama.yaml"))
    assert result.returncode == 2, result.stderr
    assert "at most 512 devices" in result.stderr and "--profile-set nodes=64" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
