"""A train step under ``torch.profiler``, on request: where an update's time goes, kernel by kernel.

Set ``RLFLEET_PROFILE_DIR`` in the trainer's environment (the launcher's children inherit it) and
the steps named by ``RLFLEET_PROFILE_STEPS`` (comma-separated step numbers, ``2,3`` by default: the
first step warms caches and kernels up) run under the profiler, CPU and (on a GPU) CUDA activity.
Each writes ``trainer-step-<N>-rank<R>.txt`` into that folder: the operators by their own time on
the device (CUDA) or on the host (CPU), then by their total host time (what the Python side spends
launching them); beside it ``trainer-step-<N>-rank<R>.trace.json``, the step's timeline (Chrome's
trace format: open it in Perfetto to see where the device waits on the host). Every other step,
and every step without the variable, runs as it would without this module (one environment lookup).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DIR_ENV = "RLFLEET_PROFILE_DIR"
STEPS_ENV = "RLFLEET_PROFILE_STEPS"
DEFAULT_STEPS = (2, 3)
ROWS = 40


def profiled_steps(value: str | None) -> frozenset[int]:
    """The step numbers of ``RLFLEET_PROFILE_STEPS`` (``None`` or blank: the default two).

    Raises:
        ValueError: an entry that is not a positive integer, named.
    """
    if value is None or not value.strip():
        return frozenset(DEFAULT_STEPS)
    steps = set()
    for part in value.split(","):
        text = part.strip()
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{STEPS_ENV}={value!r}: {text!r} is not a step number (1, 2, ...)")
        steps.add(int(text))
    return frozenset(steps)


def profile_target(step: int, rank: int) -> Path | None:
    """Where step ``step``'s profile goes on ``rank``, or None when it is not profiled."""
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return None
    try:
        wanted = profiled_steps(os.environ.get(STEPS_ENV))
    except ValueError as exc:  # a bad variable is the operator's: said once a step, never fatal
        logger.warning("no profile: %s", exc)
        return None
    return Path(folder) / f"trainer-step-{step}-rank{rank}.txt" if step in wanted else None


@contextmanager
def maybe_profiled(step: int, rank: int, device: torch.device) -> Iterator[None]:
    """Run the body under the profiler when ``step`` is asked for (see the module), else plainly."""
    target = profile_target(step, rank)
    if target is None:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, record_shapes=False) as prof:
        yield
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    averages = prof.key_averages()
    own = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    text = (f"# trainer step {step}, rank {rank}, {device}: by {own}\n"
            f"{averages.table(sort_by=own, row_limit=ROWS)}\n"
            f"# by cpu_time_total (host time, launches included)\n"
            f"{averages.table(sort_by='cpu_time_total', row_limit=ROWS)}\n")  # fmt: skip
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        prof.export_chrome_trace(str(target.with_suffix(".trace.json")))
    except OSError as exc:
        logger.warning("could not write the profile of step %d to %s: %s", step, target, exc)
        return
    logger.info("profile of step %d written to %s", step, target)
