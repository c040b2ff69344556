"""Rollouts generated ahead of training (``max_staleness: k``): the batches the fleet works on while
the trainer trains an earlier one.

A pipelined run's step ``t`` trains batch ``t`` at weight version ``W`` while the fleet generates
(and the reward tier scores) batches ``t + 1`` .. ``t + k``. Admission is by construction: a batch
``j`` steps ahead is begun only at version ``W`` or later and trained ``j <= k`` publishes later, so
no sample is trained on weights more than ``k`` versions newer than those it was generated with.
The sampler is held back (a batch is begun at the earliest step the bound allows, never earlier)
rather than made to throw work away; a rollout worker that has loaded a newer version meanwhile
serves the rest of a batch begun earlier (its chunks then carry that version: fresher, never
staler). Each chunk's reply names the version it was generated with; the step records the
distribution (``rollout/staleness_*``).

:class:`RolloutAhead` holds the batches in flight, oldest first, each as a task of its
:class:`Rollout`. The run hands the step its next batches (:class:`BatchLookahead`), so a step
begins those the bound allows; a step whose batch is not the oldest in flight (the run went back:
a trainer restored from a checkpoint, a resumed position) drops them all, releasing their chunks.

:class:`BatchLookahead` is the dataset's batches with the next few in view: taking a batch ahead
moves the dataset's position, which a checkpoint saves, past it; the lookahead keeps each batch's
position from before it was taken, so that a checkpoint saves the position after the last batch
*trained* and a resumed run generates the batches that were in flight again: it neither trains one
twice nor skips one.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.controller.dataset import PromptDataset, PromptItem
from rlfleet.controller.lost_chunks import StepChunks
from rlfleet.controller.routing import RoutedRollout

logger = logging.getLogger(__name__)


def batch_key(batch: Sequence[PromptItem]) -> tuple[int, ...]:
    """A batch's identity: its prompts' row numbers, in order."""
    return tuple(item.index for item in batch)


@dataclass
class Rollout:
    """One batch generated (each chunk scored as it arrived) and scored: what its step trains on.

    Times are ``time.perf_counter()`` seconds: when generation began and ended, and when the last
    score came (``scored``); ``overlap`` is the part of generation during which a chunk was scored.
    """

    routed: RoutedRollout
    chunks: StepChunks
    started: float
    generated: float
    scored: float
    overlap: float
    offset: int = 0
    """Steps ahead of the one in training when it was begun (0: begun by its own step)."""


@dataclass
class RolloutAhead:
    """The rollouts in flight for the batches after the one in training, oldest first."""

    _queue: deque[tuple[tuple[int, ...], asyncio.Task[Rollout]]] = field(default_factory=deque)

    def __len__(self) -> int:
        return len(self._queue)

    async def take(self, batch: Sequence[PromptItem]) -> asyncio.Task[Rollout] | None:
        """The rollout begun for ``batch`` when it is the oldest in flight (removed from the queue);
        else None, after dropping everything in flight (the run went back, or a batch ahead failed
        and its step runs again)."""
        if self._queue and self._queue[0][0] == batch_key(batch):
            return self._queue.popleft()[1]
        await self.drop()
        return None

    async def extend(
        self, upcoming: Sequence[Sequence[PromptItem]], begin: Callable[[int], Coroutine[Any, Any, Rollout]]
    ) -> int:
        """Begin the batches of ``upcoming`` (the next ones, in order) that are not in flight yet:
        ``begin(offset)`` makes the rollout of ``upcoming[offset - 1]``. In flight must be a prefix
        of ``upcoming``; when it is not (the run's order changed), everything in flight is dropped
        first. Returns how many were begun."""
        keys = [batch_key(b) for b in upcoming]
        if [k for k, _ in self._queue] != keys[: len(self._queue)]:
            await self.drop()
        begun = 0
        for offset in range(len(self._queue) + 1, len(upcoming) + 1):
            task = asyncio.get_running_loop().create_task(begin(offset), name=f"rollout-ahead-{offset}")
            self._queue.append((keys[offset - 1], task))
            begun += 1
        return begun

    async def drop(self) -> None:
        """Stop every rollout in flight; each releases what it began (its scoring, its chunks)."""
        tasks = [task for _, task in self._queue]
        self._queue.clear()
        if tasks:
            logger.info("dropping %d rollouts generated ahead (the run's next batch is another)", len(tasks))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class _Taken:
    epoch: int
    batch: list[PromptItem]
    before: dict[str, int]
    """The dataset's position before this batch was taken."""


class BatchLookahead:
    """``(epoch, batch)`` from ``batches`` (drawn from ``dataset``), with :meth:`peek` at the next
    ones and :meth:`position`, the dataset's position after the last batch :func:`next` handed out."""

    def __init__(self, batches: Iterator[tuple[int, list[PromptItem]]], dataset: PromptDataset) -> None:
        self._source = batches
        self._dataset = dataset
        self._buffer: deque[_Taken] = deque()

    def __iter__(self) -> BatchLookahead:
        return self

    def __next__(self) -> tuple[int, list[PromptItem]]:
        if not self._buffer and not self._pull():
            raise StopIteration
        taken = self._buffer.popleft()
        return taken.epoch, taken.batch

    def _pull(self) -> bool:
        before = self._dataset.state_dict()
        try:
            epoch, batch = next(self._source)
        except StopIteration:
            return False
        self._buffer.append(_Taken(epoch, batch, before))
        return True

    def peek(self, n: int) -> list[list[PromptItem]]:
        """The next ``n`` batches (fewer at the end), taken from the dataset but not handed out."""
        while len(self._buffer) < n and self._pull():
            pass
        return [taken.batch for taken in list(self._buffer)[:n]]

    def position(self) -> dict[str, int] | None:
        """The dataset's position after the last batch handed out, when batches were taken ahead of
        it (None: none are; the dataset's own position is it)."""
        return dict(self._buffer[0].before) if self._buffer else None
