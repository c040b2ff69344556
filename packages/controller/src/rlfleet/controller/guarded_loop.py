"""The controller's event loop: synchronous calls into async fleet code, watched for dying processes.

Users drive training with plain calls (``trainer.steps()``, ``trainer.set_reward_fn(...)``); each
runs a coroutine on :class:`GuardedLoop` to the end. While it runs, the processes the run started
are checked four times a second (:meth:`~rlfleet.controller.launcher.EmbeddedFleet.check`): the
launcher restarts a crashed rollout or reward worker there, and a death it does not recover from
ends the wait at once with its :class:`~rlfleet.controller.errors.TierDied` instead of a request
timing out later.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

from rlfleet.controller.errors import TierDied, TierRefused

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Watched(Protocol):
    """What the loop watches: the embedded launcher (``check`` raises TierDied for a death it does
    not recover from)."""

    def check(self) -> None: ...


class GuardedLoop:
    """One event loop for a run; ``watch()`` gives the launcher to check (None: nothing to watch)."""

    def __init__(self, watch: Callable[[], Watched | None]) -> None:
        self._watch = watch
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop (a new one once the last was closed)."""
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        return self._loop

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine to its end, failing fast if a watched process dies."""
        task = self.loop.create_task(self._guarded(coro))
        self._tasks.add(task)  # kept if Ctrl-C leaves it pending, so close() can cancel it
        result = self.loop.run_until_complete(task)
        self._tasks.discard(task)
        return result

    def create_task(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Start ``coro`` in the background; it progresses while later calls run the loop."""
        return self.loop.create_task(coro, name=name)

    async def _guarded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` while watching; a request that fails because its worker died is reported as
        that death (:class:`TierDied`, caused by the request's error), not as its own error."""
        task = asyncio.ensure_future(coro)
        try:
            self._check()
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                self._check()
        finally:
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # also when Ctrl-C left it failed
        error = None if task.cancelled() else task.exception()
        if error is not None and self._watch() is not None:
            try:
                for _ in range(10):  # a worker's sockets close a moment before its exit is visible
                    self._check()
                    await asyncio.sleep(0.1)
            except (TierDied, TierRefused) as died:
                raise died from error
        return task.result()

    def _check(self) -> None:
        watched = self._watch()
        if watched is not None:
            watched.check()

    def shutdown(self, leave: Callable[[], Awaitable[None]] | None) -> None:
        """Cancel what a Ctrl-C left running, await ``leave()`` (10 s at most), cancel what is left."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        _cancel(loop, list(self._tasks))
        self._tasks.clear()
        if leave is not None:
            try:
                loop.run_until_complete(asyncio.wait_for(leave(), timeout=10.0))
            except (ConnectionError, RuntimeError, TimeoutError) as exc:
                logger.debug("leaving the control plane: %s", exc)
        _cancel(loop, list(asyncio.all_tasks(loop)))

    def close(self) -> None:
        """Close the loop (idempotent)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.close()


def _cancel(loop: asyncio.AbstractEventLoop, tasks: list[asyncio.Task[Any]]) -> None:
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
