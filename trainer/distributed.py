"""The process group, the device mesh of one strategy, and whether a strategy can run a job at all.

One process group per process (`init_distributed`, torchrun's environment or a world of one), and per strategy one
3-D mesh ("pp", "dp", "tp") from `init_device_mesh` (`build_mesh`): tp innermost, so a tensor-parallel group is
consecutive ranks (inside a node, or whole nodes when tp is a multiple of the devices per node), then dp, then pp
outermost. The trainer builds a new mesh for every strategy of an in-place switch; the process group stays.

Whether a strategy fits is decided by `cona.protocol.feasibility`, the single authority the planner uses too:
`check_layout` only turns its answer into a `LayoutError`, and `num_virtual_stages` reads its stage count.

A collective that fails because a peer is gone or hung (`communication_error`) leaves the process group broken:
the trainer starts no collective after it — not the agreement of a save, not a fallback to an older checkpoint —
and ends the rank as a crash (`CommunicationError`). Every group a model trains on waits at most
`parallel.collective_timeout_s` in one collective (`bound_collectives`), so a peer that hangs or whose node is lost
without closing its connections ends the others too, instead of after torch's default (30 minutes under gloo).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re

import torch
import torch.distributed as dist
from cona.protocol.feasibility import strategy_problem, virtual_stages, world_problem
from cona.protocol.job import JobSpec
from cona.protocol.strategy import Strategy
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "tp")
"""The mesh's dimension names, outermost first (`DeviceMesh.get_group(name)`, `mesh[name]`)."""


class LayoutError(ValueError):
    """The strategy cannot run this job (a one-line reason); `bad_world` when only the world size is wrong."""

    def __init__(self, message: str, *, bad_world: bool = False) -> None:
        super().__init__(message)
        self.bad_world = bad_world


class CommunicationError(RuntimeError):
    """A collective failed because a peer is gone or hung (`communication_error`): the process group is broken, so
    the rank saves nothing (a save is collective: it could only be partial, or hang in mismatched collectives) and
    ends as a crash, its record naming this; the last complete checkpoint stands."""


_GLOO_LOCATION = re.compile(r"^\[[^\]]*gloo[^\]]*\]\s*")
"""Gloo's messages begin with the C++ source line that raised (`[/…/gloo/transport/tcp/pair.cc:553] `)."""

_GLOO_FAILURES = ("Connection closed by peer", "Connection reset by peer", "Timed out waiting", "pair closure",
                  "Broken pipe", "Connection refused", "No route to host")  # fmt: skip
"""How gloo's transport says a peer is gone or hung; gloo raises a plain RuntimeError, so its words are all that
tells it from a local error (NCCL's and the store's failures are `torch.distributed.DistError`s)."""


def communication_error(error: BaseException) -> CommunicationError | None:
    """`error` (or what it wraps: its cause, its context, a DCP `CheckpointException`'s per-rank failures) as a
    CommunicationError when it says a peer is gone or hung, else None."""
    seen: list[BaseException] = [error]
    while seen:
        e = seen.pop()
        if isinstance(e, CommunicationError):
            return e
        text = str(e)
        if isinstance(e, dist.DistError) or (type(e) is RuntimeError and any(w in text for w in _GLOO_FAILURES)):
            # One line: gloo's source location and its advice ("Check the logs of the remote worker… GLHF!") cut off.
            first = _GLOO_LOCATION.sub("", (text.strip().splitlines() or [""])[0]).split(". ")[0].rstrip(".")[:150]
            waited = " after parallel.collective_timeout_s" if "timed out" in text.lower() else ""
            return CommunicationError(f"a collective failed{waited} (a peer died, hung or lost its node): "
                                      f"{type(e).__name__}: {first}; nothing was saved after it, the last complete "
                                      "checkpoint stands")  # fmt: skip
        seen += [c for c in (e.__cause__, e.__context__) if c is not None]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            seen += [f[0] if isinstance(f, tuple) else f for f in failures.values() if isinstance(f, BaseException | tuple)]
    return None


def bound_collectives(groups: list[dist.ProcessGroup], timeout_s: float) -> None:
    """Make every collective on `groups` (this rank's) fail after `timeout_s` seconds instead of torch's default (30
    minutes under gloo, 10 under NCCL), which is also what subgroups (the device mesh's, `new_group`'s) get whatever
    the world's timeout. Set once the groups exist, not at `init_process_group`: its rendezvous waits for ranks that
    start minutes apart (imports from a shared filesystem, a corpus read), which the orchestrator's
    `policy.startup_timeout_s` watches."""
    timeout = datetime.timedelta(seconds=timeout_s)
    # The public name where torch has it (newer releases deprecate the private one), the private one before.
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    for group in groups:
        set_timeout(timeout, group)


@dataclasses.dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def init_distributed() -> DistEnv:
    """Join the process group torchrun set up (or a single-process one without torchrun)."""
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, device_id=device if use_cuda else None)
        else:  # `python -m cona.trainer` without torchrun: a world of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return DistEnv(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device, backend=backend
    )


def num_virtual_stages(job: JobSpec, strategy: Strategy) -> int:
    """Pipeline stages per pp rank: `parallel.virtual_stages` under the interleaved schedule, else 1
    (`cona.protocol.feasibility`)."""
    return virtual_stages(job, strategy.pp)


def check_layout(job: JobSpec, strategy: Strategy, *, world_size: int) -> None:
    """Raise LayoutError when `strategy` cannot run `job` on `world_size` processes (`cona.protocol.feasibility`).

    A strategy that cannot run this job at all is bad input; one that merely needs another world size is
    `bad_world` (checked last), so the orchestrator replans for the processes it has.
    """
    problem = strategy_problem(job, strategy)
    if problem:
        raise LayoutError(f"strategy {strategy}: {problem}")
    problem = world_problem(strategy, world_size)
    if problem:
        raise LayoutError(f"strategy {strategy} {problem}", bad_world=True)


def build_mesh(strategy: Strategy, device: torch.device) -> DeviceMesh:
    """The ("pp", "dp", "tp") mesh of `strategy` over the whole world (a collective: every rank calls it)."""
    return init_device_mesh(device.type, (strategy.pp, strategy.dp, strategy.tp), mesh_dim_names=MESH_DIMS)
