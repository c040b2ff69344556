"""The trainer's peak GPU memory in each phase of a train step, as step metrics (GiB floats).

A phase resets the device's peak counters when it starts and reads them when it ends, so its peak
includes what was already held (weights, optimizer state, the batch) plus what the phase added::

    run_step:  plan   (the family's plan: no-grad forwards for old/reference logprobs, critic
                       values; advantages)                      memory/plan_peak_{allocated,reserved}_gib
               update (train_loop: forward, backward and optimizer steps, the plan's finish)
                                                                memory/update_peak_{allocated,reserved}_gib
               the larger of the two                            memory/step_peak_{allocated,reserved}_gib
    publish:   staging the weight buckets (``_stage``)          memory/publish_peak_{allocated,reserved}_gib

``allocated`` is what tensors held (``torch.cuda.max_memory_allocated``); ``reserved`` what the
caching allocator held from the driver (``max_memory_reserved``: the number an OOM compares).
``trainer.publish`` answers a ``WeightsPublished``, which carries no metrics: rank 0 keeps the
publish's peaks and reports them with the NEXT step's metrics (a step with no publish since the
previous one has no ``memory/publish_*`` keys). Only rank 0's device is reported (under FSDP the
other ranks hold shards of the same size).

On CPU there is nothing to measure and no key is written: the caller checks the device
(``device.type == "cuda"``) and builds no :class:`PhasePeaks`, so a CPU step calls nothing here.
The counters are the device's, for the whole process: phases must not overlap (the worker's lock
runs one command at a time).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch

GIB = float(2**30)
KINDS = ("allocated", "reserved")


def peak_key(phase: str, kind: str) -> str:
    """The metric key of ``phase``'s peak of ``kind`` (``allocated`` or ``reserved``)."""
    return f"memory/{phase}_peak_{kind}_gib"


class MemoryReader(Protocol):
    """A device's peak memory counters."""

    def reset_peak(self) -> None:
        """Start the peaks again from the memory held now."""
        ...

    def peak_bytes(self) -> tuple[int, int]:
        """``(allocated, reserved)``: the peaks in bytes since the last :meth:`reset_peak`."""
        ...


@dataclass(frozen=True)
class CudaMemory:
    """The caching allocator's peak counters of one CUDA ``device``."""

    device: torch.device

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> tuple[int, int]:
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)


class PhasePeaks:
    """The peaks of the phases measured with :meth:`phase`, as metrics in :attr:`metrics`."""

    def __init__(self, reader: MemoryReader) -> None:
        self.reader = reader
        self.metrics: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Measure the block as phase ``name``: peaks reset on entry, read on exit (not when it raises)."""
        self.reader.reset_peak()
        yield
        allocated, reserved = self.reader.peak_bytes()
        self.metrics[peak_key(name, "allocated")] = allocated / GIB
        self.metrics[peak_key(name, "reserved")] = reserved / GIB

    def step_metrics(self) -> dict[str, float]:
        """:attr:`metrics` and, when a phase was measured, ``memory/step_peak_*``: the largest phase's."""
        metrics = dict(self.metrics)
        for kind in KINDS:
            suffix = f"_peak_{kind}_gib"
            values = [value for key, value in self.metrics.items() if key.endswith(suffix)]
            if values:
                metrics[peak_key("step", kind)] = max(values)
        return metrics
