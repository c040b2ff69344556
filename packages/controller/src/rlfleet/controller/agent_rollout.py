"""A step's rollout by the user's agent (issue 33, point 4): each sample an agent run against a
rollout worker's OpenAI-compatible endpoint, the batch made of exactly the tokens it recorded::

    AgentOpen(token, sampling, limits) ---> each chosen rollout worker ---> AgentOpened(url)
    per prompt x group_size, at most max_parallel at once:
        agent(url, token, session_id, item) -> reward     (its requests recorded under session_id)
    AgentCollect(sessions, rewards, failed) ---> the worker ---> GenerateResult (the batch's ref)

Prompts are split over the admitted rollout workers by capacity, as generate jobs are; each chunk's
batch is handed to the step (``on_chunk``) as soon as it is collected. An agent that raises, returns
no finite number or outruns ``agent_timeout_s`` gives its sample reward 0 (counted in
``failed``, logged), never ends the run. A sync agent runs in a thread (a timed-out one is left to
finish there: its late requests land in a dropped session).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from rlfleet.common.control.membership import WorkerInfo
from rlfleet.common.control.messages import (
    AgentCollect,
    AgentOpen,
    AgentOpened,
    GenerateResult,
    SamplingParams,
)
from rlfleet.controller.agent_settings import AgentSettings
from rlfleet.controller.dataset import PromptItem
from rlfleet.controller.errors import NoWorkerServed
from rlfleet.controller.fleet import split_by_capacity
from rlfleet.controller.ports import ChunkDone, FleetClient

logger = logging.getLogger(__name__)

AgentFn = Callable[[str, str, str, dict[str, Any]], "float | Awaitable[float]"]
"""``agent(base_url, api_key, session_id, item) -> reward``, sync or async."""
OPEN_TIMEOUT_S = 60.0


class AgentRollout:
    """Runs a run's agents (see the module docstring); ``failed`` counts the agent runs that failed."""

    def __init__(self, agent: AgentFn, settings: AgentSettings) -> None:
        if not callable(agent):
            raise TypeError(
                f"the agent must be a function (base_url, api_key, session_id, item), got {agent!r}"
            )
        self.agent, self.settings = agent, settings
        self.token = secrets.token_urlsafe(32)  # the run's bearer token: never logged
        self.tag = secrets.token_hex(4)
        self.jobs = 0
        self.failed = 0
        self.runs = 0

    async def generate(
        self, fleet: FleetClient, items: Sequence[PromptItem], sampling: SamplingParams, weight_version: int,
        on_chunk: ChunkDone | None = None,
    ) -> list[GenerateResult]:  # fmt: skip
        """One result per chunk, in prompt order (``sampling.n`` agent runs per prompt)."""
        workers = fleet.rollout_workers(None, weight_version)
        if not workers:
            raise NoWorkerServed(f"no rollout worker holds weight version {weight_version} for the agents")
        sizes = split_by_capacity(len(items), [w.announce.capacity for w in workers])
        chunks, first = [], 0
        for worker, size in zip(workers, sizes, strict=True):
            if size:
                chunks.append(
                    self._chunk(fleet, worker, items[first : first + size], first, sampling, on_chunk)
                )
            first += size
        return list(await asyncio.gather(*chunks))

    async def _chunk(
        self, fleet: FleetClient, worker: WorkerInfo, items: Sequence[PromptItem], first: int,
        sampling: SamplingParams, on_chunk: ChunkDone | None,
    ) -> GenerateResult:  # fmt: skip
        s = self.settings
        opening = AgentOpen(token=self.token, sampling=sampling.model_copy(update={"n": 1}),
                            max_session_tokens=s.max_session_tokens, idle_s=s.session_idle_s,
                            max_sessions=min(1 << 16, max(1024, 4 * len(items) * sampling.n)))  # fmt: skip
        opened = await fleet.transport.request(worker.announce.subject, opening, timeout=OPEN_TIMEOUT_S,
                                               tier="rollout")  # fmt: skip
        assert isinstance(opened, AgentOpened), opened
        self.jobs += 1
        job = f"agent-{self.tag}-{self.jobs}"
        n = sampling.n
        sessions = [f"{job}:{i}:{j}" for i in range(len(items)) for j in range(n)]
        gate = asyncio.Semaphore(s.max_parallel)

        async def one(k: int) -> tuple[float, bool]:
            async with gate:
                return await self._run(opened.url, sessions[k], items[k // n])

        outcomes = await asyncio.gather(*(one(k) for k in range(len(sessions))))
        collect = AgentCollect(job_id=job, prompt_token_ids=[list(it.token_ids) for it in items],
                               sessions=sessions, rewards=[r for r, _ in outcomes],
                               failed=[f for _, f in outcomes])  # fmt: skip
        result = await fleet.transport.request(worker.announce.subject, collect, timeout=OPEN_TIMEOUT_S,
                                               tier="rollout")  # fmt: skip
        assert isinstance(result, GenerateResult), result
        if on_chunk is not None:
            on_chunk(first, result)
        return result

    async def _run(self, url: str, session_id: str, item: PromptItem) -> tuple[float, bool]:
        """One agent run: its reward and whether it failed (reward 0 then)."""
        row = {**item.metadata, "prompt": item.prompt}
        self.runs += 1
        try:
            if inspect.iscoroutinefunction(self.agent):
                run = self.agent(url, self.token, session_id, row)
            else:
                run = asyncio.to_thread(self.agent, url, self.token, session_id, row)
            value = await asyncio.wait_for(run, self.settings.agent_timeout_s)  # type: ignore[arg-type]
            reward = float(value)
            if not math.isfinite(reward):
                raise ValueError(f"the agent returned {value!r}, not a finite reward")
            return reward, False
        except TimeoutError:
            why = f"it ran past agent_timeout_s={self.settings.agent_timeout_s}"
        except Exception as exc:  # noqa: BLE001 - the user's code: any error is its sample's, never the run's
            why = f"{type(exc).__name__}: {exc}"
        self.failed += 1
        logger.warning("agent run %s failed (%s); its reward is 0 (%d of %d runs failed so far)", session_id,
                       why, self.failed, self.runs)  # fmt: skip
        return 0.0, True
