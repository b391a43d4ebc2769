"""Cluster profiles: the machines a job runs on, read from YAML."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import pydantic
from cona.orchestrator.backends.kubernetes.spec import KubernetesSpec
from cona.orchestrator.backends.slurm.spec import SlurmSpec, gpu_request_problem
from cona.protocol.yamlconfig import (
    ConfigError,
    StrictModel,
    apply_overrides,
    load_yaml,
    parse_bytes,
    unindented,
    validate,
)
from pydantic import Field


class AcceleratorSpec(StrictModel):
    """One device (GPU, or a CPU process for local runs)."""

    name: str = "gpu"
    """A label, e.g. `A100-80GB`, `H100-SXM` or `cpu`."""
    peak_tflops: float = Field(ge=1e-6)  # a floor: a denormal peak divides the cost model by zero
    """Peak dense bf16 TFLOP/s of one device (one process's share of the cores for `cpu`)."""
    memory: str
    """Device memory with its unit, e.g. `80 GB` or `80 GiB`."""
    memory_bandwidth: str = "2 TB/s"
    """Device memory bandwidth with its unit, e.g. `2039 GB/s`."""
    device: Literal["cuda", "cpu"] = "cuda"
    """What the trainer runs on: `cuda` trains under bf16 autocast (bf16 activations, fp32 states), `cpu` in fp32."""
    matmul_efficiency: float = Field(0.75, ge=1e-3, le=1)  # a floor: a denormal divides the cost model by zero
    """Fraction of peak that large matmuls reach (the asymptote of the cost model's matmul efficiency). The default
    is fitted to Megatron-LM's published A100 runs (docs/costmodel.md); cona corrects it online from measured step
    times."""
    matmul_half_tokens: float = Field(128.0, ge=0)
    """Tokens per micro-batch (mbs × seq_len) at which matmuls reach half of `matmul_efficiency`: smaller GEMMs
    do not fill the device."""
    microbatch_overhead_ms: float = Field(0.5, ge=0)
    """Fixed cost of one micro-batch on one stage (kernel launches, Python), milliseconds."""
    host_layer_ms: float = Field(0.0, ge=0)
    """Host time (Python, the dispatcher, kernel launches) to issue one block's forward for one micro-batch in
    cona's eager trainer, milliseconds. A GPU runs what the host issued asynchronously, so a micro-batch costs the
    larger of the device's time and the host's; a recomputed forward is issued again (selective recompute's
    dispatch mode costs more, `costmodel.SELECTIVE_HOST_FORWARDS`). On `cpu` the host is the device: the time adds.
    0 leaves the host out (fused-kernel systems such as Megatron-LM, whose published runs fit the defaults).
    `python -m benchmarks.gpu` then `--fit` measure it (3.4 ms on an H200 machine, docs/benchmarks.md)."""
    step_overhead_ms: float = Field(0.0, ge=0)
    """Host time per optimizer step that the device does not hide, milliseconds: the gradient statistics, clipping
    and the optimizer's per-tensor work, the batch's assembly, the step's all-reduce read back. Fitted with
    `host_layer_ms`; on the H200 machine the per-block term explains it all (docs/benchmarks.md)."""

    @pydantic.model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        if isinstance(data, dict) and "mfu" in data:
            raise ValueError(
                "accelerator.mfu was replaced by accelerator.matmul_efficiency (the efficiency of large matmuls; "
                "the cost model now derives the whole step's efficiency from the shapes): remove mfu, and set "
                "matmul_efficiency only if you measured it (docs/costmodel.md)"
            )
        return data

    @pydantic.field_validator("memory")
    @classmethod
    def _memory(cls, value: str) -> str:
        parse_bytes(value)
        return value

    @pydantic.field_validator("memory_bandwidth")
    @classmethod
    def _bandwidth(cls, value: str) -> str:
        parse_bytes(value, per_second=True)
        return value

    @property
    def memory_bytes(self) -> float:
        return parse_bytes(self.memory)

    @property
    def memory_bandwidth_bytes(self) -> float:
        return parse_bytes(self.memory_bandwidth, per_second=True)

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element as the trainer computes: bf16 under CUDA autocast, fp32 on CPU."""
        return 2 if self.device == "cuda" else 4


class NetworkSpec(StrictModel):
    """Link bandwidths, each with its unit so bits and bytes are never confused (`200 Gbit/s`, `600 GB/s`)."""

    intra_node_bandwidth: str = "300 GB/s"
    """Per-device bandwidth between devices of one node (NVLink), e.g. `300 GB/s`."""
    inter_node_bandwidth: str = "200 Gbit/s"
    """Per-node bandwidth between nodes (InfiniBand, Ethernet), e.g. `200 Gbit/s`."""
    intra_node_latency_us: float = Field(5.0, ge=0)
    """Latency of one intra-node collective step, microseconds."""
    inter_node_latency_us: float = Field(10.0, ge=0)
    """Latency of one inter-node message, microseconds."""
    bandwidth_efficiency: float = Field(0.8, ge=1e-3, le=1)
    """Fraction of the nominal bandwidths that collectives reach (protocol overheads, imperfect rings, contention).
    The default is fitted to Megatron-LM's published A100 runs (docs/costmodel.md)."""

    @pydantic.field_validator("intra_node_bandwidth", "inter_node_bandwidth")
    @classmethod
    def _rate(cls, value: str) -> str:
        parse_bytes(value, per_second=True)
        return value

    @property
    def intra_node_bytes_per_s(self) -> float:
        return parse_bytes(self.intra_node_bandwidth, per_second=True)

    @property
    def inter_node_bytes_per_s(self) -> float:
        return parse_bytes(self.inter_node_bandwidth, per_second=True)


class StorageSpec(StrictModel):
    """Where run directories live; every node must see this path (a shared filesystem or a PVC mount)."""

    run_root: str = Field("runs", min_length=1)
    """Directory under which `cona run` creates run directories."""
    write_bandwidth: str = "1 GB/s"
    """Checkpoint write bandwidth, used to predict switch cost before one is measured."""
    read_bandwidth: str = "2 GB/s"
    """Checkpoint read bandwidth."""

    @pydantic.field_validator("write_bandwidth", "read_bandwidth")
    @classmethod
    def _rate(cls, value: str) -> str:
        parse_bytes(value, per_second=True)
        return value


class ClusterProfile(StrictModel):
    """A cluster: nodes × devices, their speed and memory, the network, storage and backend settings."""

    name: str = Field(min_length=1)
    backend: Literal["local", "slurm", "kubernetes"]
    nodes: int = Field(gt=0, le=65536)  # bounded: the planner enumerates the world's divisors
    """Number of nodes the job may use."""
    gpus_per_node: int = Field(gt=0, le=256)
    """Devices per node (processes per node for CPU runs)."""
    accelerator: AcceleratorSpec
    network: NetworkSpec = Field(default_factory=NetworkSpec)
    storage: StorageSpec = Field(default_factory=StorageSpec)
    slurm: SlurmSpec | None = None
    kubernetes: KubernetesSpec | None = None
    min_nodes: int | None = Field(None, gt=0)
    """Elastic lower bound on nodes; default: nodes. Below `nodes` the run trains on any node count in
    [min_nodes, nodes]: it starts on what the cluster gives, goes on with fewer when nodes are lost and grows back
    when that pays (`cona.orchestrator.elastic`)."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables of every trainer process, on every backend: what the cluster's network needs
    (`NCCL_SOCKET_IFNAME: ib0`, `NCCL_IB_HCA: mlx5`), `NCCL_DEBUG: WARN`, `OMP_NUM_THREADS: 4`. Values are taken as
    written (no `$VAR` expansion: use `slurm.setup` for shell); numbers become text. Names cona, torchrun or srun set
    (`RANK`, `MASTER_ADDR`, `CUDA_VISIBLE_DEVICES`, `CONA_*`, `SLURM_*`, ...) are refused."""

    @pydantic.field_validator("env", mode="before")
    @classmethod
    def _env_entries(cls, value: object) -> object:
        if not isinstance(value, dict):
            return value  # pydantic says it is not a mapping
        env: dict[object, object] = {}
        for name, text in value.items():
            problem = env_problem(name, text)
            if problem:
                raise ValueError(problem)
            env[name] = text if isinstance(text, str) else format(text, "d")
        return env

    @pydantic.model_validator(mode="after")
    def _backend_section(self) -> ClusterProfile:
        # Every check before the default slurm section is assigned: with validate_assignment, the assignment runs
        # this validator again on the model itself, and an error raised then quotes the whole profile's repr as
        # what was given.
        if self.backend == "kubernetes" and self.kubernetes is None:
            raise ValueError("backend 'kubernetes' needs a kubernetes: section (namespace, image, pvc)")
        if self.min_nodes is not None and self.min_nodes > self.nodes:
            raise ValueError(f"min_nodes={self.min_nodes} exceeds nodes={self.nodes}; set min_nodes to at most nodes "
                             "(the run then trains on any node count between them)")
        k8s = self.kubernetes
        if (self.backend == "kubernetes" and k8s is not None and self.min_nodes is not None
                and self.min_nodes < self.nodes and k8s.elastic_pending_timeout_s >= k8s.pending_timeout_s):  # fmt: skip
            # Past pending_timeout_s an attempt whose pods wait for what waiting does not bring fails the run; one
            # whose pods a quota refuses while it admits fewer is stuck too, and would fail before it could shrink.
            raise ValueError(f"kubernetes.elastic_pending_timeout_s={k8s.elastic_pending_timeout_s:g} is not shorter "
                             f"than kubernetes.pending_timeout_s={k8s.pending_timeout_s:g}: an elastic run would fail "
                             "before it shrinks to the pods that fit; lower elastic_pending_timeout_s or raise "
                             "pending_timeout_s")  # fmt: skip
        if self.slurm is not None and (problem := gpu_request_problem(self.slurm, self.gpus_per_node)):
            raise ValueError(problem)
        if self.backend == "slurm" and self.slurm is None:
            self.slurm = SlurmSpec()
        if (self.slurm is not None and self.accelerator.device == "cpu"
                and "gpus_per_node_flag" not in self.slurm.model_fields_set):  # fmt: skip
            # A CPU profile trains in processes, not on GPUs: `--gpus-per-node` (the flag's default, for GPU
            # clusters) would ask a CPU partition for GPUs it has none of, and the job would never start. Said
            # explicitly, `true` stays.
            self.slurm.gpus_per_node_flag = False
        if (self.kubernetes is not None and self.accelerator.device == "cpu"
                and "gpu_resource" not in self.kubernetes.model_fields_set):  # fmt: skip
            # The same on Kubernetes: each pod would ask for `nvidia.com/gpu` (one per process) and stay Pending on
            # CPU nodes; a CPU per process is what it needs. Said explicitly (an extended resource), it stays.
            self.kubernetes.gpu_resource = "cpu"
        return self

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
RESERVED_ENV = frozenset({
    # torchrun's, for each worker (and its rendezvous), and what cona's launchers set.
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "JOB_COMPLETION_INDEX", "PYTHONUNBUFFERED",
    # Which devices a process sees is the placement's (the local backend, Slurm's GRES, the device plugin).
    "CUDA_VISIBLE_DEVICES",
})  # fmt: skip
RESERVED_ENV_PREFIXES = ("CONA_", "TORCHELASTIC_", "PET_", "SLURM_")
"""`PET_*` are torchrun's flags given as variables; `SLURM_*` change how srun starts cona's tasks."""


def env_problem(name: object, value: object) -> str | None:
    """What is wrong with the entry `name: value` of a profile's `env` (one line), or None."""
    if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
        return (f"{name!r} is not a variable name (letters, digits and _, not a digit first); every shell and "
                "container runtime must be able to set it")  # fmt: skip
    if name in RESERVED_ENV or name.startswith(RESERVED_ENV_PREFIXES):
        hint = " (for a local run, set it in the shell that runs cona)" if name == "CUDA_VISIBLE_DEVICES" else ""
        return f"{name} is set by cona, torchrun or the cluster for each trainer process; leave it out{hint}"
    # YAML reads yes/no/on/off/true/false as booleans and an empty value as null: quote what was meant.
    if isinstance(value, bool):  # what was written (on, yes, True) is gone: the user quotes it
        return (f"{name}: YAML read the value as a boolean (true/false/yes/no/on/off); quote it as written (e.g. "
                f"{name}: \"{str(value).lower()}\")")  # fmt: skip
    if isinstance(value, float):
        # As written it may have been 8.0 or 2.10, which Python prints as 8.0 and 2.1: TORCH_CUDA_ARCH_LIST: 8.0
        # reached the trainers as 8. An integer keeps its value (an id, a count).
        return (f"{name}: YAML read the value as a number ({value!r}), which need not be the text written (2.10 "
                f"reads as 2.1); quote it (e.g. {name}: \"{value!r}\")")  # fmt: skip
    if value is None:
        return f"{name}: no value; give one, or quote an empty one ({name}: \"\")"
    if not isinstance(value, (str, int, float)):
        return f"{name}: a {type(value).__name__} is not text or a number; give one value"
    if isinstance(value, str) and ("\x00" in value or "\n" in value or "\r" in value):
        return f"{name}: the value holds a newline or NUL character, which no environment can carry; remove it"
    return None


def load_profile(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> ClusterProfile:
    """Load and validate a cluster profile; raises `cona.protocol.yamlconfig.ConfigError` with a one-line message."""
    from cona.orchestrator.job import Job

    for item in overrides:  # a job's field (`optimizer.lr=1`) would be answered with the profile's field list
        top = item.partition("=")[0].strip().split(".")[0]
        if top and top not in ClusterProfile.model_fields and top in Job.model_fields:
            raise ConfigError(f"--profile-set {item}: {top!r} is a field of the job, not of the cluster profile; give "
                              f"it as --set {item}")  # fmt: skip
    data = apply_overrides(load_yaml(path), list(overrides), source="--profile-set")
    if "model" in data and "backend" not in data:  # the commonest mix-up: a job file given as the profile
        raise ConfigError(f"{path}: a job file (it has a model section), given as --profile; did you swap --profile and --job?")
    unindented(ClusterProfile, data, path)
    return validate(ClusterProfile, data, source=str(path), overrides=overrides, flag="--profile-set")
