"""Elastic runs: a profile whose `min_nodes` is below `nodes` trains on any node count in [min_nodes, nodes].

The orchestrator plans for every node count of that range (the planning table, `plan_table`): the strategy the
policy would run on that world. A launch may then start on whatever the cluster gives — Slurm `--nodes=MIN-MAX`,
the batch script's helper picking the table's strategy for `$SLURM_NNODES` inside the allocation — and a run that
loses a node goes on, replanned, on the nodes that are left (`Scheduler`). The table is kept in the run directory
(`elastic.json`, `ElasticPlan`) for `cona status`. Which counts of the range can start the job at all is decided
in one place, `startable_nodes`: the table, the start strategy `cona render`/`submit` show and the `--nodes` of a
Slurm submission all ask it.

No I/O beyond `write_plan`/`read_plan`; torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from cona.protocol.feasibility import placement
from cona.protocol.rundir import RunDir, atomic_write_json, read_json
from cona.protocol.strategy import Strategy

if TYPE_CHECKING:
    from cona.orchestrator.job import Job
    from cona.orchestrator.planner import Candidate
    from cona.orchestrator.profile import ClusterProfile
    from cona.orchestrator.runmodel import RunModel

PLAN_FILE = "elastic.json"


def node_range(profile: ClusterProfile) -> list[int]:
    """The node counts a run of `profile` may train on: [min_nodes, nodes] (just `nodes` unless elastic)."""
    low = profile.min_nodes if profile.min_nodes is not None else profile.nodes
    return list(range(low, profile.nodes + 1))


def is_elastic(profile: ClusterProfile) -> bool:
    """Whether runs of `profile` may train on fewer nodes than `nodes` (`min_nodes` < `nodes`)."""
    return len(node_range(profile)) > 1


def nodes_of(strategy: Strategy, profile: ClusterProfile) -> int:
    """How many nodes `strategy` runs on (the same placement every backend uses)."""
    return placement(strategy, profile.gpus_per_node, profile.nodes)[0]


@dataclasses.dataclass(frozen=True)
class NodePlan:
    """What the run does on one node count."""

    nodes: int
    """The node count."""
    devices: int
    """Devices (processes) on that many nodes: nodes × gpus_per_node."""
    strategy: Strategy | None
    """The strategy planned for that world; None when no strategy is feasible there (the run waits instead)."""
    feasible: int
    """How many strategies are feasible on that world (the policy chooses among them)."""

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "devices": self.devices, "feasible": self.feasible,
                "strategy": self.strategy.to_dict() if self.strategy else None}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodePlan:
        strategy = data.get("strategy")
        return cls(nodes=int(data["nodes"]), devices=int(data["devices"]), feasible=int(data.get("feasible", 0)),
                   strategy=Strategy.from_dict(strategy) if strategy else None)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ElasticPlan:
    """The planning table: for every node count in [min_nodes, max_nodes], the strategy the run would train with."""

    min_nodes: int
    max_nodes: int
    plans: tuple[NodePlan, ...]
    """One per node count, ascending."""
    noise_scale: float | None
    """The B_noise the cona policy ranked under (None for the other policies)."""
    reason: str
    """Why the table was made (the run's start, a lost node, ...)."""
    time: float

    def strategy_for(self, nodes: int) -> Strategy | None:
        """The strategy planned for `nodes` nodes, or None (outside the range, or nothing feasible there)."""
        return next((p.strategy for p in self.plans if p.nodes == nodes), None)

    def by_nodes(self, *, up_to: int | None = None) -> dict[int, Strategy]:
        """{node count: strategy} for every node count with a feasible strategy (at most `up_to` nodes)."""
        return {p.nodes: p.strategy for p in self.plans if p.strategy is not None and (up_to is None or p.nodes <= up_to)}

    def to_dict(self) -> dict[str, Any]:
        return {"min_nodes": self.min_nodes, "max_nodes": self.max_nodes, "plans": [p.to_dict() for p in self.plans],
                "noise_scale": self.noise_scale, "reason": self.reason, "time": self.time}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ElasticPlan:
        return cls(min_nodes=int(data["min_nodes"]), max_nodes=int(data["max_nodes"]),
                   plans=tuple(NodePlan.from_dict(p) for p in data.get("plans", [])),
                   noise_scale=data.get("noise_scale"), reason=str(data.get("reason", "")),
                   time=float(data.get("time", 0.0)))  # fmt: skip


def table_choice(table: dict[int, Strategy], nodes: int) -> Strategy:
    """The strategy of `table` ({node count: strategy}) for the most nodes up to `nodes`; the smallest node count's
    when there are fewer (nothing smaller is planned: its launch waits for nodes, or crashes and is retried)."""
    fits = [n for n in table if n <= nodes]
    return table[max(fits) if fits else min(table)]


def world_candidates(candidates: list[Candidate], devices: int) -> list[Candidate]:
    """The feasible candidates that use exactly `devices` devices."""
    return [c for c in candidates if c.feasible and c.strategy.world_size == devices]


def startable_nodes(
    profile: ClusterProfile, job: Job, *, candidates: Sequence[Candidate] | None = None, descending: bool = False,
) -> Iterator[tuple[int, list[Candidate]]]:  # fmt: skip
    """The node counts of `profile`'s range ([min_nodes, nodes], `node_range`) on which `job` can start, each with
    its feasible candidates on exactly that many devices: (node count, candidates), ascending (`descending`: from
    the top). A count where nothing is feasible is left out; nothing at all when nothing fits anywhere (the caller
    says what that means: `cona render` refuses, the planning table waits).

    The one place that decides it, because three callers must agree: the run's planning table (`plan_table`: a
    strategy for each count), the strategy `cona render`/`submit` show the run starting with (`cli.first_strategy`)
    and the `--nodes MIN-MAX` of a Slurm submission (`SlurmBackend.render`), which must ask for the counts the run
    itself would launch on. A count's candidates are the planner's own (`enumerate_candidates` for its devices), or
    those of `candidates` on that world when the caller has them already (a run's model, planned for every count
    of the range by `scheduler.device_counts`): the same either way.

    Lazy: a count is enumerated only when the caller reads that far, so a caller that needs only the ends of a
    range of thousands of counts (the Slurm range, the start on all nodes) enumerates few of them; and `candidates`
    is grouped by world size once, not scanned again for every count."""
    counts = node_range(profile)
    if descending:
        counts.reverse()
    if candidates is None:
        from cona.orchestrator.planner import enumerate_candidates

        for nodes in counts:
            devices = nodes * profile.gpus_per_node
            pool = enumerate_candidates(profile=profile, job=job, num_devices=devices, feasible_only=True)
            if pool:
                yield nodes, pool
        return
    by_world: dict[int, list[Candidate]] = {}
    for c in candidates:
        if c.feasible:
            by_world.setdefault(c.strategy.world_size, []).append(c)
    for nodes in counts:
        pool = by_world.get(nodes * profile.gpus_per_node)
        if pool:
            yield nodes, pool


def plan_table(model: RunModel, *, reason: str, time: float) -> ElasticPlan:
    """The planning table of `model`'s run: for each node count of the profile's range, the strategy its policy
    chooses among that world's candidates (`RunModel.best_for_world`, under the current noise scale). Only the
    counts that can start (`startable_nodes`) are planned; the others are listed with no strategy (the run waits
    there), so a range of thousands of counts costs about as much as the few that fit."""
    profile = model.profile
    pools = dict(startable_nodes(profile, model.job, candidates=model.candidates))
    counts = node_range(profile)
    plans = []
    for nodes in counts:
        devices = nodes * profile.gpus_per_node
        pool = pools.get(nodes, [])
        plans.append(NodePlan(nodes=nodes, devices=devices, feasible=len(pool),
                              strategy=model.best_for_world(devices) if pool else None))  # fmt: skip
    return ElasticPlan(min_nodes=counts[0], max_nodes=counts[-1], plans=tuple(plans),
                       noise_scale=model.ranking_noise_scale(), reason=reason, time=time)  # fmt: skip


def write_plan(run_dir: RunDir, plan: ElasticPlan) -> None:
    """Keep the table in the run directory (`elastic.json`) for `cona status`."""
    atomic_write_json(run_dir.root / PLAN_FILE, plan.to_dict())


def read_plan(run_dir: RunDir) -> ElasticPlan | None:
    """The run's latest planning table, or None (not elastic, or not started)."""
    try:
        data = read_json(run_dir.root / PLAN_FILE)
    except (OSError, ValueError):
        return None
    try:
        return ElasticPlan.from_dict(data) if isinstance(data, dict) else None
    except (KeyError, TypeError, ValueError):
        return None
