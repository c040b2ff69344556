"""Which GPUs each process of an embedded run sees: its ``CUDA_VISIBLE_DEVICES`` (issue 13).

The GPUs a run may use are the job's ``launcher.gpus`` setting (ids as ``CUDA_VISIBLE_DEVICES``
names them, or a count: the first N), else the controller's own ``CUDA_VISIBLE_DEVICES``, else every
GPU torch sees; with ``device: cpu`` and no ``gpus`` setting nothing is placed. With no GPU at all nothing is
set, so a CPU-only machine (CI) starts its workers exactly as before. ``gpus: []`` (or 0) hides
every GPU from every worker.

Disjoint layout (verl and OpenRLHF give each role its own GPUs unless it is colocated): trainer
rank r takes GPU r; then each rollout worker takes ``tensor_parallel_size`` GPUs of its own, pool
by pool; the reward worker takes what is left, and only when its spec names a CUDA device
(``reward_model:...,device=cuda``; ``cuda:1`` needs two): else it gets ``CUDA_VISIBLE_DEVICES=""``
and never touches GPU 0. A pool with ``colocate: true`` shares the trainer's GPUs (its engine
sleeps while the trainer steps). Too few GPUs is a :class:`~rlfleet.common.errors.ConfigError`
that says what is needed and what there is; nothing is shared silently.

Each trainer rank sees one GPU, so its device is ``cuda:0`` (the trainer takes ``LOCAL_RANK``
modulo the GPUs it sees, :func:`rlfleet.trainer.distributed.rank_cuda_index`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.rollout import RolloutSettings, RolloutWorkerConfig
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.launcher_settings import EmbeddedLauncher

logger = logging.getLogger(__name__)

GPU_ENV = "CUDA_VISIBLE_DEVICES"
_CUDA_DEVICE = re.compile(r"""device['"]?\s*[=:]\s*['"]?cuda(?::(\d+))?""")  # text or dict form


def visible_gpus(setting: Sequence[int | str] | int | None, device: str,
                 environ: Mapping[str, str] | None = None) -> list[str] | None:  # fmt: skip
    """The GPU ids a run may place its workers on; None: place nothing (leave every env as it is)."""
    environ = os.environ if environ is None else environ
    inherited = environ.get(GPU_ENV)
    parent = [g.strip() for g in inherited.split(",") if g.strip()] if inherited is not None else None
    if isinstance(setting, int):
        if parent is not None and setting > len(parent):
            raise ConfigError("gpus", setting, f"only {len(parent)} GPU(s) visible ({GPU_ENV}={inherited!r})")
        return parent[:setting] if parent is not None else [str(i) for i in range(setting)]
    if setting is not None:
        return [str(g) for g in setting]
    if device == "cpu":
        return None
    if parent is not None:
        return parent or None
    import torch  # late: only a run that may use GPUs asks

    count = torch.cuda.device_count()
    return [str(i) for i in range(count)] or None


def reward_gpu_count(config: Any) -> int:
    """GPUs a reward worker's config (its schema object or a dict) asks for: 1 + the highest ``cuda``
    index its spec names, else 0."""
    if isinstance(config, BaseModel):
        config = config.model_dump(mode="json")
    found = _CUDA_DEVICE.findall(str(config.get("endpoints", "")) if isinstance(config, Mapping) else "")
    return max((int(index or 0) + 1 for index in found), default=0)


@dataclass
class GpuLayout:
    """The run's GPUs laid out by role: trainer ranks, each pool's rollout slots, what is spare."""

    gpus: list[str]
    trainer: list[list[str]]
    pools: dict[str, list[list[str]]]
    colocated: set[str] = field(default_factory=set)

    @property
    def spare(self) -> list[str]:
        slots = [*self.trainer, *(s for pool in self.pools.values() for s in pool)]
        used = {g for ids in slots for g in ids}
        return [g for g in self.gpus if g not in used]


PoolNeed = tuple[int, int, bool]
"""A rollout pool's workers, their ``tensor_parallel_size``, and whether it is colocated."""


def plan_gpus(gpus: Sequence[str], trainer_ranks: int, pools: Mapping[str, PoolNeed]) -> GpuLayout:
    """Lay out ``gpus`` for ``trainer_ranks`` ranks and ``pools`` (name: workers, tensor_parallel_size,
    colocated); raises :class:`ConfigError` when they do not fit."""
    gpus = list(gpus)
    own = {name: n * tp for name, (n, tp, colocated) in pools.items() if not colocated}
    need = trainer_ranks + sum(own.values())
    if gpus and need > len(gpus):
        parts = [f"trainer {trainer_ranks} (one per rank)"] + [
            f"rollout pool {name} {count} ({pools[name][0]} worker(s) x tensor_parallel_size "
            f"{pools[name][1]})"
            for name, count in own.items()
        ]
        raise ConfigError("gpus", gpus, f"{need} GPUs needed for disjoint placement ({', '.join(parts)}), "
                          f"{len(gpus)} available; add GPUs, use fewer workers, or set "
                          "rollout.engine.colocate to share the trainer's GPUs")  # fmt: skip
    layout = GpuLayout(gpus, [[g] for g in gpus[:trainer_ranks]], {}, {n for n, p in pools.items() if p[2]})
    if not gpus:
        return layout
    at = trainer_ranks
    for name, (n, tp, colocated) in pools.items():
        if colocated:
            if tp > trainer_ranks:
                why = f"colocated pool {name} shards over more GPUs than the trainer's {trainer_ranks}"
                raise ConfigError("rollout.tensor_parallel_size", tp, why)
            shared = [g for ids in layout.trainer for g in ids]
            layout.pools[name] = [[shared[(i * tp + t) % len(shared)] for t in range(tp)] for i in range(n)]
        else:
            layout.pools[name] = [gpus[at + i * tp : at + (i + 1) * tp] for i in range(n)]
            at += n * tp
    return layout


class GpuAssignment:
    """Gives each started worker its GPUs from a :class:`GpuLayout`, by id (a restart keeps them)."""

    def __init__(self, layout: GpuLayout) -> None:
        self.layout = layout
        self.held: dict[str, list[str]] = {}
        """Each worker's GPUs, by worker id ([]: CPU)."""
        self.colocated: dict[str, set[str]] = {}
        """Workers of each colocated pool (they take its slots in turn)."""

    def env_for(self, tier: str, worker_id: str, config: Any, env: Mapping[str, str],
                live: Collection[str]) -> dict[str, str]:  # fmt: skip
        """``{CUDA_VISIBLE_DEVICES: ...}`` for this worker; ``live``: ids of the workers still running."""
        for gone in [w for w in self.held if w not in live and w != worker_id]:
            del self.held[gone]
        if worker_id not in self.held:
            self.held[worker_id] = self._choose(tier, worker_id, config, env) if self.layout.gpus else []
        return {GPU_ENV: ",".join(self.held[worker_id])}

    def _choose(self, tier: str, worker_id: str, config: Any, env: Mapping[str, str]) -> list[str]:
        layout, taken = self.layout, [set(ids) for ids in self.held.values()]
        if tier == "trainer":
            return layout.trainer[int(env.get("RANK", "0"))]
        if tier == "rollout":
            pool = getattr(config, "pool", "default")
            slots = layout.pools.get(pool, [])
            if pool in layout.colocated and slots:  # shared with the trainer: spread, then wrap
                mine = [w for w in self.held if w in self.colocated.get(pool, ())]
                self.colocated.setdefault(pool, set()).add(worker_id)
                return slots[len(mine) % len(slots)]
            for slot in slots:
                if not any(s & set(slot) for s in taken):
                    return slot
            engine = config.rollout.vllm() if isinstance(config, RolloutWorkerConfig) else None
            tp = engine.tensor_parallel_size if engine is not None else 1
            return self._spare(worker_id, tp, "its pool's GPUs are all in use")
        count = reward_gpu_count(config)
        if count == 0:
            return []
        try:
            return self._spare(worker_id, count, "its spec names a CUDA device")
        except ConfigError:
            if not layout.colocated:
                raise
            logger.warning("%s shares the trainer's GPUs (colocated run, no spare GPU)", worker_id)
            return layout.gpus[:count]

    def _spare(self, worker_id: str, count: int, why: str) -> list[str]:
        held = {g for ids in self.held.values() for g in ids}
        free = [g for g in self.layout.spare if g not in held]
        if len(free) < count:
            raise ConfigError("gpus", self.layout.gpus, f"worker {worker_id} needs {count} GPU(s) ({why}); "
                              f"{len(free)} spare of {len(self.layout.gpus)} ({self.table()})")  # fmt: skip
        return free[:count]

    def table(self, sep: str = "; ") -> str:
        """The layout, a row per process: ``trainer rank 0: GPU 0``, ``rollout default #0: GPU 1,2``..."""
        rows = [f"trainer rank {r}: GPU {','.join(ids)}" for r, ids in enumerate(self.layout.trainer)]
        for pool, slots in self.layout.pools.items():
            mode = " (colocated)" if pool in self.layout.colocated else ""
            rows += [f"rollout {pool} #{i}{mode}: GPU {','.join(ids)}" for i, ids in enumerate(slots)]
        rows.append(f"spare (reward when its spec names cuda): {','.join(self.layout.spare) or '-'}")
        return sep.join(rows)


def _pool_need(workers: int, settings: RolloutSettings) -> PoolNeed:
    """A pool's workers, GPUs per worker (vLLM's ``tensor_parallel_size``) and whether it is colocated."""
    engine = settings.vllm()
    if engine is None:  # the HF engine: one device, never colocated
        return workers, 1, False
    return workers, engine.tensor_parallel_size, engine.colocate


def assignment_for(config: TrainerConfig, environ: Mapping[str, str] | None = None) -> GpuAssignment | None:
    """The embedded launcher's assignment for a job's ``TrainerConfig``; None: nothing to place."""
    gpus_setting = config.launcher.gpus if isinstance(config.launcher, EmbeddedLauncher) else None
    gpus = visible_gpus(gpus_setting, config.placement.device, environ)
    if gpus is None:
        return None
    pools = {name: _pool_need(n, s) for name, (n, s) in config.pools().items()}
    layout = plan_gpus(gpus, config.num_train_workers, pools) if gpus else GpuLayout([], [], {})
    assignment = GpuAssignment(layout)
    logger.info("GPU placement over %s:\n  %s", gpus or "no GPUs (all hidden)", assignment.table("\n  "))
    return assignment
