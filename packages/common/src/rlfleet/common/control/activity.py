"""What a worker is handling now, and since when: its heartbeats say so and its drain waits on it.

Every request a :class:`~rlfleet.common.control.worker.Worker` takes as work runs inside
:meth:`InFlight.track` (its kind and job id, and when it began). :meth:`InFlight.describe` turns the
oldest one into the ``activity`` and ``activity_s`` that heartbeats carry
(``"score job step3-0 (+1 more)"``, 12.5), so a controller that waits for a reply can tell "busy on
my job for 75 s" from "idle" and from "not heard" (the watchdog names it). When the worker stops,
:meth:`InFlight.wait_idle` is how it lets what it took finish before it leaves.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Job:
    """One request in progress."""

    kind: str
    job_id: str
    since: float

    def label(self) -> str:
        """``"score job step3-0"``, or just the kind when the request has no job id."""
        return f"{self.kind} job {self.job_id}" if self.job_id else self.kind


class InFlight:
    """The requests a worker is handling, each with its kind, job id and start time."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._jobs: dict[int, Job] = {}
        self._ids = itertools.count()
        self._idle: asyncio.Event | None = None

    def __len__(self) -> int:
        return len(self._jobs)

    def jobs(self) -> list[Job]:
        """The requests in progress, oldest first."""
        return sorted(self._jobs.values(), key=lambda job: job.since)

    @contextmanager
    def track(self, kind: str, job_id: str = "") -> Iterator[Job]:
        """Count a request as in progress for the time of the ``with`` block."""
        key = next(self._ids)
        job = Job(kind, job_id, self._clock())
        self._jobs[key] = job
        if self._idle is not None:
            self._idle.clear()
        try:
            yield job
        finally:
            del self._jobs[key]
            if not self._jobs and self._idle is not None:
                self._idle.set()

    def describe(self) -> tuple[str, float]:
        """``(activity, seconds)`` of the oldest request in progress; ``("", 0.0)`` when idle."""
        jobs = self.jobs()
        if not jobs:
            return "", 0.0
        more = f" (+{len(jobs) - 1} more)" if len(jobs) > 1 else ""
        return jobs[0].label() + more, max(0.0, self._clock() - jobs[0].since)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for every request in progress to end; True if none is left."""
        if not self._jobs:
            return True
        if self._idle is None:
            self._idle = asyncio.Event()
        self._idle.clear()
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout))
        except TimeoutError:
            return not self._jobs
        return True
