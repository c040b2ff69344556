"""CPU threads for the tiers of a pipelined run on CPU: the trainer and the rollout workers each
get their own share of the machine's cores.

In the synchronous loop one tier works at a time, so each may use every core (torch's and
vLLM's default). With ``max_staleness`` the trainer trains while the rollout workers generate:
two OpenMP pools of one thread per core each then share the cores, and their threads spin
waiting for each other's cores (measured on 2 cores: the tiny job's update went from 0.05 to 2 s,
its generation from 0.13 to 2 s). Splitting the cores makes the two run side by side instead.

:func:`cpu_thread_env` gives each worker ``OMP_NUM_THREADS`` (which torch and vLLM's CPU build
read at start-up): the trainer ranks half the cores between them, the rollout workers the other
half between them, the reward worker one thread. A variable the user set in the controller's
environment is left to them; a run on CUDA, or a synchronous one, is left to the defaults.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

THREADS_ENV = "OMP_NUM_THREADS"


def available_cores() -> int:
    """Cores this process may run on (its affinity; the CPU count where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_thread_env(
    tiers: Sequence[str], *, device: str, max_staleness: int, cores: int | None = None
) -> list[dict[str, str]]:
    """``OMP_NUM_THREADS`` for each worker of ``tiers`` (one entry per worker, in order); empty
    dicts when nothing is to be split (a synchronous run, a CUDA run, the user's own setting)."""
    none: list[dict[str, str]] = [{} for _ in tiers]
    if max_staleness == 0 or device == "cuda" or THREADS_ENV in os.environ:
        return none
    cores = cores or available_cores()
    trainers, rollouts = tiers.count("trainer"), tiers.count("rollout")
    if not trainers or not rollouts:
        return none
    trainer_cores = max(1, cores // 2)
    per_trainer = max(1, trainer_cores // trainers)
    per_rollout = max(1, (cores - trainer_cores) // rollouts)
    threads = {"trainer": per_trainer, "rollout": per_rollout}
    return [{THREADS_ENV: str(threads.get(tier, 1))} for tier in tiers]
