"""Answer a retried request once: a repeated ``job_id`` gets the first reply, never a second run.

The controller retries a request whose reply it did not get (a timeout, a lost connection, a
retryable refusal) with the same ``job_id``, and the NATS transport sends one again when its
connection came back (the reply may have been lost). Stepping twice would apply one batch twice;
publishing twice would make a version nobody asked for; generating twice costs a whole job and
loading weights twice a whole transfer. :class:`ReplyCache` (the trainer's and the rollout
worker's) runs the work of a ``(kind, job_id)`` once and hands every repeat the same outcome::

    first request   ──> work() runs ──> reply (kept: the last ``size`` job ids)
    repeat, later   ──────────────────> the kept reply
    repeat, during  ──> waits for the first one's reply
    failed first    ──> nothing kept: a repeat runs the work again (no update was applied)

A repeat must be the same request (every field but ``protocol``); a job id reused for another
request is refused with :class:`~rlfleet.common.errors.JobIdReused`. An empty ``job_id`` (an
older controller) is never cached. The cache lives in the process: a restarted worker has a new
incarnation (the controller checks the trainer's before it adopts any reply).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from rlfleet.common.errors import JobIdReused

logger = logging.getLogger(__name__)

R = TypeVar("R")

Entry = tuple[dict[str, Any], "asyncio.Future[Any]"]
"""A job's request (its fields, to tell a repeat from a reuse) and its reply, once there is one."""

DEFAULT_SIZE = 64
"""Job ids remembered per worker: far more than the controller keeps in flight to one worker."""


class ReplyCache:
    """The outcome of the last ``size`` job ids (see the module docstring)."""

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        if size < 1:
            raise ValueError(f"a reply cache holds at least one job id; got size={size}")
        self.size = size
        self._entries: OrderedDict[tuple[str, str], tuple[dict[str, Any], asyncio.Future[Any]]] = (
            OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._entries)

    async def once(self, request: BaseModel, job_id: str, work: Callable[[], Awaitable[R]]) -> R:
        """``work()``'s reply, run at most once per ``(request.kind, job_id)`` while remembered.

        Raises:
            JobIdReused: ``job_id`` was first used for a different request.
            whatever ``work()`` raised (the job id is then forgotten, so a retry runs it again).
        """
        if not job_id:
            return await work()
        kind = str(getattr(request, "kind", type(request).__name__))
        key = (kind, job_id)
        identity = request.model_dump(mode="json", exclude={"protocol"})
        entry = self._entries.get(key)
        if entry is not None:
            first, future = entry
            if first != identity:
                raise JobIdReused(kind, job_id, _differences(first, identity))
            logger.info("%s job %s repeated: answering with its first reply", kind, job_id)
            result: R = await asyncio.shield(future)
            return result
        future = asyncio.get_running_loop().create_future()
        self._entries[key] = (identity, future)
        self._evict()
        try:
            result = await work()
        except BaseException as exc:
            self._entries.pop(key, None)
            if isinstance(exc, asyncio.CancelledError):
                future.cancel()
            else:
                future.set_exception(exc)
                future.exception()  # retrieved: a failure nobody else waited for is not logged twice
            raise
        future.set_result(result)
        return result

    def _evict(self) -> None:
        """Forget the oldest finished job ids beyond ``size`` (one still running is kept)."""
        for key in list(self._entries):
            if len(self._entries) <= self.size:
                return
            if self._entries[key][1].done():
                del self._entries[key]


def _differences(first: dict[str, Any], again: dict[str, Any]) -> list[str]:
    """The top-level fields in which two requests differ, sorted."""
    return sorted(name for name in first.keys() | again.keys() if first.get(name) != again.get(name))
