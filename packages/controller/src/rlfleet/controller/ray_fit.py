"""Does a job fit the Ray cluster it is placed on? Checked before the Ray launcher places anything.

A job reserves, per tier, what each worker's actor asks of Ray (:class:`TierNeed`: CPUs, GPUs,
custom resources; a trainer's ranks together, on one node: their ``STRICT_PACK`` placement group).
:func:`fit_problem` compares the job's sum with what the cluster has in all (its totals, not what is
free now: a busy cluster frees resources as other work ends, a cluster that is too small never
does), and each worker (or the trainer's group) with its largest node, and says in one line what
is missing. A cluster whose autoscaler publishes its node groups (:func:`read_capacity`) counts
with the nodes it may add.

A local Ray the run starts (no ``launcher.address``, no ``launcher.num_cpus``) gets the machine's CPUs, or
as many logical CPUs as the job reserves when that is more (:func:`local_ray_cpus`): Ray counts
logical CPUs, which may be more than the cores, and each worker of the tiny job is mostly idle.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

EPSILON = 1e-6
"""Slack for float sums of fractional reservations (Ray itself counts in units of 1e-4)."""

MAIN_KEYS = ("CPU", "GPU")
"""Always named in a message, even at 0."""


@dataclass(frozen=True)
class TierNeed:
    """What the ``workers`` of one tier reserve: ``each`` (a Ray resource bundle) per worker;
    ``packed``: all of them on one node (the trainer's ranks: one ``STRICT_PACK`` placement group)."""

    tier: str
    workers: int
    each: dict[str, float]
    packed: bool = False

    def on_one_node(self) -> dict[str, float]:
        """What must fit one node: the whole group when packed, else one worker."""
        if not self.packed:
            return dict(self.each)
        return {key: value * self.workers for key, value in self.each.items()}


@dataclass(frozen=True)
class JobReservation:
    """Everything a job's workers reserve on Ray, tier by tier."""

    needs: list[TierNeed] = field(default_factory=list)

    def total(self) -> dict[str, float]:
        """The sum over every worker, by resource name."""
        out: dict[str, float] = {}
        for need in self.needs:
            for key, value in need.each.items():
                out[key] = out.get(key, 0.0) + value * need.workers
        return out

    def describe(self) -> str:
        """``the job reserves 4 CPUs (trainer 1, rollout 2 x 1, reward 1) and 0 GPUs``."""
        total = self.total()
        parts = []
        for key in _keys(total):
            by = [f"{n.tier} {n.workers} x {n.each[key]:g}" if n.workers > 1 else f"{n.tier} {n.each[key]:g}"
                  for n in self.needs if n.workers and n.each.get(key)]  # fmt: skip
            parts.append(amount(total.get(key, 0.0), key) + (f" ({', '.join(by)})" if by else ""))
        return "the job reserves " + _listed(parts)


@dataclass(frozen=True)
class ClusterCapacity:
    """What a Ray cluster has: ``total`` (``ray.cluster_resources()``, or the most its autoscaler may
    reach), each node's resources (``nodes``: those alive, then the autoscaler's node shapes), and
    ``where`` names it in a message (``the Ray cluster at 10.0.0.1:6379``)."""

    total: dict[str, float]
    nodes: list[dict[str, float]]
    where: str
    local: bool = False
    """A local Ray the run starts: only ``launcher.num_cpus`` can change what it has."""


def fit_problem(job: JobReservation, cluster: ClusterCapacity) -> str | None:
    """None when ``job`` fits ``cluster``; else one line naming what the job reserves, what the
    cluster has and what to change."""
    total = job.total()
    short = [key for key in _keys(total) if total.get(key, 0.0) > cluster.total.get(key, 0.0) + EPSILON]
    if short:
        have = ", ".join(amount(cluster.total.get(key, 0.0), key) for key in _keys(total))
        return f"{job.describe()}; {cluster.where} has {have}; {_advice(short, total, cluster.local)}"
    for need in job.needs:
        one = need.on_one_node()
        if need.workers and one and not any(_fits(one, node) for node in cluster.nodes):
            return _node_problem(need, one, cluster)
    return None


def _advice(short: list[str], total: dict[str, float], local: bool) -> str:
    lower = "lower the reservations (launcher.resources, rollout.workers, num_train_workers)"
    if local and short == ["CPU"]:
        cpus = math.ceil(total["CPU"] - EPSILON)
        return f"set launcher.num_cpus={cpus} for a local Ray (or leave it unset), or {lower}"
    if local:
        return (f"a local Ray has this machine's GPUs and no custom resources: {lower}, or join a Ray "
                "cluster that has them (launcher.address)")  # fmt: skip
    return f"add nodes that have them to the cluster, or {lower}"


def _node_problem(need: TierNeed, one: dict[str, float], cluster: ClusterCapacity) -> str:
    if need.packed:
        who = (f"the {need.tier}'s {need.workers} ranks reserve {resources_text(one)} together on one node "
               "(one STRICT_PACK placement group)")  # fmt: skip
        change = f"lower num_train_workers or the {need.tier}'s launcher.resources"
    else:
        who = f"each {need.tier} worker reserves {resources_text(one)} on one node"
        change = f"lower the {need.tier}'s launcher.resources"
    shapes = list(dict.fromkeys(resources_text({k: node.get(k, 0.0) for k in one}) for node in cluster.nodes))
    nodes = ", ".join(shapes[:4]) + (" ..." if len(shapes) > 4 else "") if shapes else "none"
    return (f"{who}, and no node of {cluster.where} has that much (its nodes: {nodes}); {change}, or add "
            "a larger node")  # fmt: skip


def _fits(want: dict[str, float], node: dict[str, float]) -> bool:
    return all(value <= node.get(key, 0.0) + EPSILON for key, value in want.items())


def _keys(total: dict[str, float]) -> list[str]:
    return [*MAIN_KEYS, *sorted(key for key in total if key not in MAIN_KEYS)]


def _listed(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def amount(value: float, key: str) -> str:
    """``4 CPUs``, ``1 GPU``, ``2 rollout_node``."""
    if key in MAIN_KEYS:
        return f"{value:g} {key}{'' if value == 1 else 's'}"
    return f"{value:g} {key}"


def resources_text(resources: dict[str, float]) -> str:
    """``{CPU: 1, GPU: 0.5}``: CPUs and GPUs first, then custom resources by name."""
    keys = [key for key in _keys(resources) if key in resources]
    return "{" + ", ".join(f"{key}: {resources[key]:g}" for key in keys) + "}"


def local_ray_cpus(reserved_cpus: float, machine_cpus: int) -> int | None:
    """Logical CPUs for a local Ray the run starts without ``launcher.num_cpus``: None (Ray's own count,
    ``machine_cpus``) when the job's ``reserved_cpus`` fit in it, else as many as the job reserves."""
    wanted = math.ceil(reserved_cpus - EPSILON)
    return wanted if wanted > machine_cpus else None


def machine_cpus() -> int:
    """The CPUs a local Ray counts on this machine by default (Ray's own count: it reads cgroup limits)."""
    try:
        from ray._private.utils import get_num_cpus
    except ImportError:  # another Ray layout: the affinity mask is the next best count
        return len(os.sched_getaffinity(0))
    return int(get_num_cpus())


def read_capacity(ray: Any, where: str, *, local: bool) -> ClusterCapacity:
    """What the connected Ray cluster has; with an autoscaler that publishes its node groups (Ray's
    autoscaler v2), the most it may reach and the node shapes it may add."""
    total = {str(k): float(v) for k, v in ray.cluster_resources().items()}
    alive = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
    nodes = [{str(k): float(v) for k, v in resources.items()} for resources in alive]
    groups = _autoscaler_groups()
    if groups:
        from ray._private.state import state

        most = state.get_max_resources_from_cluster_config() or {}
        total = {key: max(total.get(key, 0.0), float(most.get(key, 0))) for key in {*total, *most}}
        nodes += groups
    return ClusterCapacity(total, nodes, where, local)


def _autoscaler_groups() -> list[dict[str, float]]:
    """The node shapes an autoscaler may add (none without one, or where Ray does not say)."""
    try:
        from ray._private.state import state

        config = state.get_cluster_config()
    except (ImportError, AttributeError):  # a Ray without this (private) API: count what is there
        return []
    if config is None:
        return []
    return [{str(k): float(v) for k, v in group.resources.items()}
            for group in config.node_group_configs if group.max_count != 0]  # fmt: skip
