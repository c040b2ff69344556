"""Sharing a step's prompts over the rollout fleet, and noticing a worker going (the fleet's dispatch).

- :func:`split_by_capacity`: prompts split in contiguous chunks, one per worker, sized in
  proportion to each worker's announced ``capacity`` (largest remainder, so sizes sum exactly).
- :class:`GoneWatch`: one event per worker, set when the registry sees a :class:`WorkerLeave` or
  declares the worker dead; :meth:`GoneWatch.request` races a request against that event so a
  chunk on a dying worker is re-dispatched at once instead of after the full request timeout.

Both were in :mod:`rlfleet.controller.fleet`, which still exports them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from rlfleet.common.control.membership import WorkerInfo
from rlfleet.common.control.messages import AnyMessage, Message
from rlfleet.common.control.transport import Transport
from rlfleet.controller.errors import WorkerGone


def split_by_capacity(total: int, capacities: Sequence[int]) -> list[int]:
    """Chunk sizes (summing to ``total``) proportional to ``capacities``; zero-size chunks kept."""
    if not capacities:
        raise ValueError("split_by_capacity needs at least one worker capacity")
    weight = sum(capacities)
    exact = [total * c / weight for c in capacities]
    sizes = [int(e) for e in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (sizes[i] - exact[i], i))
    for i in by_remainder[: total - sum(sizes)]:
        sizes[i] += 1
    return sizes


class GoneWatch:
    """Which workers left or died since the controller started, as awaitable events."""

    def __init__(self) -> None:
        self._gone: dict[str, asyncio.Event] = {}

    def _event(self, worker_id: str) -> asyncio.Event:
        return self._gone.setdefault(worker_id, asyncio.Event())

    def mark_gone(self, info: WorkerInfo) -> None:
        """Registry callback (``on_leave`` / ``on_dead``)."""
        self._event(info.worker_id).set()

    def mark_joined(self, info: WorkerInfo) -> None:
        """Registry callback (``on_join``): a worker that comes back is usable again."""
        self._gone.pop(info.worker_id, None)

    def is_gone(self, worker_id: str) -> bool:
        event = self._gone.get(worker_id)
        return event is not None and event.is_set()

    async def request(
        self, transport: Transport, worker: WorkerInfo, message: Message, *, timeout: float, job_id: str = ""
    ) -> AnyMessage:
        """``transport.request`` to ``worker``'s own subject, abandoned with :class:`WorkerGone`
        as soon as the worker leaves or is declared dead."""
        gone = self._event(worker.worker_id)
        if gone.is_set():
            raise WorkerGone(worker.tier, worker.worker_id, job_id)
        reply = asyncio.ensure_future(
            transport.request(worker.subject, message, timeout=timeout, tier=worker.tier)
        )
        watch = asyncio.ensure_future(gone.wait())
        try:
            done, _ = await asyncio.wait({reply, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reply, watch):
                if not task.done():
                    task.cancel()
            await asyncio.gather(reply, watch, return_exceptions=True)
        if reply in done:
            return reply.result()
        raise WorkerGone(worker.tier, worker.worker_id, job_id)
