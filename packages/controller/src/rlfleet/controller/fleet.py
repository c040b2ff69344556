"""The controller's handle on the tiers: every call is a control message; bulk data stays put.

``Fleet`` knows the workers through the membership registry and speaks to them over the
transport. It never fetches rollout tensors or weights: it hands :class:`TensorRef` s from the
tier that produced them to the tier that consumes them.

::

    generate ──► rollout workers ──(refs)──► score ──► reward tier ──(scores)──┐
        ▲                         └─────────(refs)──────────────────────────► train_step ──► trainer
        └──── load_weights(bucket refs) ◄── publish ◄─────────────────────────────────────────┘
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from rlfleet.common.errors import RemoteError, RequestTimeout
from rlfleet.common.membership import WorkerRegistry
from rlfleet.common.messages import (
    GenerateRequest,
    GenerateResult,
    LoadWeights,
    PublishWeights,
    SamplingParams,
    SaveCheckpoint,
    Saved,
    ScoreRequest,
    ScoreResult,
    SetRewardSpec,
    Shutdown,
    TrainStepRequest,
    TrainStepResult,
    WeightsLoaded,
    WeightsPublished,
)
from rlfleet.common.refs import TensorRef
from rlfleet.common.subjects import subject
from rlfleet.common.transport import Transport

logger = logging.getLogger(__name__)


class Fleet:
    """Requests to the rollout, reward and trainer tiers of one cluster."""

    def __init__(self, transport: Transport, cluster: str, *, request_timeout: float = 900.0) -> None:
        self.transport = transport
        self.cluster = cluster
        self.request_timeout = request_timeout
        self.registry = WorkerRegistry(transport, cluster)
        self.reward: Any = None  # a RewardControl (set by the runner): scores go through it, token and all
        self._jobs = itertools.count()
        self._run = uuid.uuid4().hex[:8]

    async def start(self) -> None:
        await self.registry.start()

    async def close(self) -> None:
        if self.reward is not None:
            await self.reward.close()
        await self.registry.stop()

    async def wait_ready(self, counts: dict[str, int], timeout: float) -> None:
        """Wait until each tier has announced at least ``counts[tier]`` workers.

        Raises ``TimeoutError`` (naming the first tier that fell short) after ``timeout`` seconds.
        """
        waits = [
            asyncio.ensure_future(self.registry.wait_for(tier, n, timeout)) for tier, n in counts.items() if n
        ]
        try:
            await asyncio.gather(*waits)
        finally:
            for wait in waits:
                wait.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    def _job_id(self, what: str) -> str:
        return f"{self._run}-{what}-{next(self._jobs)}"

    def rollout_workers(self) -> list[Any]:
        return sorted(self.registry.workers("rollout"), key=lambda w: w.worker_id)

    # --- rollout ----------------------------------------------------------------------------

    async def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams, weight_version: int
    ) -> list[GenerateResult]:
        """Split prompts over the live rollout workers; re-dispatch a failed chunk to another worker.

        Returns one result per chunk, in prompt order (chunk i holds a contiguous slice).
        """
        workers = self.rollout_workers()
        if not workers:
            raise RuntimeError("no rollout worker is alive in cluster " + self.cluster)
        size = -(-len(prompts) // len(workers))
        chunks = [list(map(list, prompts[i : i + size])) for i in range(0, len(prompts), size)]
        tasks = [
            self._generate_chunk(
                chunk, sampling, weight_version, preferred=workers[i % len(workers)].worker_id
            )
            for i, chunk in enumerate(chunks)
        ]
        return list(await asyncio.gather(*tasks))

    async def _generate_chunk(
        self, chunk: list[list[int]], sampling: SamplingParams, weight_version: int, preferred: str
    ) -> GenerateResult:
        request = GenerateRequest(
            job_id=self._job_id("gen"),
            prompt_token_ids=chunk,
            sampling=sampling,
            weight_version=weight_version,
        )
        tried: set[str] = set()
        while True:
            alive = {w.worker_id: w for w in self.rollout_workers()}
            candidates = [preferred] if preferred in alive and preferred not in tried else []
            candidates += [w for w in alive if w not in tried and w != preferred]
            if not candidates:
                raise RuntimeError(
                    f"generate job {request.job_id}: every rollout worker failed it ({sorted(tried)})"
                )
            worker = alive[candidates[0]]
            tried.add(worker.worker_id)
            try:
                reply = await self.transport.request(
                    worker.subject, request, timeout=self.request_timeout, tier="rollout"
                )
            except (RequestTimeout, ConnectionError) as exc:
                logger.warning("rollout worker %s failed job %s: %s; re-dispatching", worker.worker_id,
                               request.job_id, exc)  # fmt: skip
                continue
            except RemoteError as exc:
                if not exc.retryable:
                    raise
                logger.warning("rollout worker %s: %s; trying another", worker.worker_id, exc)
                continue
            assert isinstance(reply, GenerateResult), reply
            return reply

    async def load_weights(self, published: WeightsPublished) -> list[WeightsLoaded]:
        """Every rollout worker pulls the published buckets straight from the trainer's store."""
        message = LoadWeights(weight_version=published.weight_version, buckets=published.buckets)
        workers = self.rollout_workers()
        replies = await asyncio.gather(
            *(self.transport.request(w.subject, message, timeout=self.request_timeout, tier="rollout")
              for w in workers)
        )  # fmt: skip
        for reply in replies:
            assert isinstance(reply, WeightsLoaded), reply
        return list(replies)  # type: ignore[arg-type]

    # --- reward -----------------------------------------------------------------------------

    async def score(
        self, results: Sequence[GenerateResult], metadata: Sequence[Sequence[dict[str, Any]]], endpoint: str
    ) -> list[ScoreResult]:
        """Score each rollout chunk on the reward tier; ``metadata[i]`` is chunk i's per-prompt metadata."""
        if self.reward is not None:
            job_ids = [self._job_id("score") for _ in results]
            return list(await self.reward.score(results, metadata, endpoint, job_ids))
        verb = subject(self.cluster, "reward", "score")
        requests = [
            ScoreRequest(job_id=self._job_id("score"), endpoint=endpoint, rollout=r.ref, metadata=list(meta))
            for r, meta in zip(results, metadata, strict=True)
        ]
        replies = await asyncio.gather(
            *(
                self.transport.request(verb, req, timeout=self.request_timeout, tier="reward")
                for req in requests
            )
        )
        for reply in replies:
            assert isinstance(reply, ScoreResult), reply
        return list(replies)  # type: ignore[arg-type]

    async def set_reward_spec(self, spec: str | dict[str, Any], endpoint: str) -> str:
        """Switch an endpoint's reward spec on every reward worker; returns the new spec version."""
        message = SetRewardSpec(endpoint=endpoint, spec=spec)
        subjects = [w.subject for w in self.registry.workers("reward")]
        subjects = subjects or [subject(self.cluster, "reward", "set_spec")]
        replies = await asyncio.gather(
            *(
                self.transport.request(s, message, timeout=self.request_timeout, tier="reward")
                for s in subjects
            )
        )
        return str(getattr(replies[-1], "spec_version", ""))

    # --- trainer ----------------------------------------------------------------------------

    def _trainer(self, verb: str) -> str:
        return subject(self.cluster, "trainer", verb)

    async def train_step(
        self, step: int, rollouts: Sequence[TensorRef], scores: Sequence[float], hyperparams: dict[str, Any],
        *, algorithm: str = "grpo",
    ) -> TrainStepResult:
        """One update of ``algorithm`` on the referenced batches (rollouts, or DPO preference pairs)."""
        request = TrainStepRequest(step=step, rollouts=list(rollouts), scores=list(scores),
                                   hyperparams=hyperparams, algorithm=algorithm)  # fmt: skip
        reply = await self.transport.request(
            self._trainer("step"), request, timeout=self.request_timeout, tier="trainer"
        )
        assert isinstance(reply, TrainStepResult), reply
        return reply

    async def publish_weights(self, bucket_mb: float) -> WeightsPublished:
        reply = await self.transport.request(
            self._trainer("publish"), PublishWeights(bucket_mb=bucket_mb), timeout=self.request_timeout,
            tier="trainer",
        )  # fmt: skip
        assert isinstance(reply, WeightsPublished), reply
        return reply

    async def save(self, path: str) -> str:
        reply = await self.transport.request(
            self._trainer("save"), SaveCheckpoint(path=path), timeout=self.request_timeout, tier="trainer"
        )
        assert isinstance(reply, Saved), reply
        return reply.path

    async def shutdown(self, reason: str = "run finished") -> None:
        """Ask every known worker to stop (embedded runs also stop their processes)."""
        for tier in ("rollout", "reward", "trainer"):
            for worker in self.registry.workers(tier):
                try:
                    await self.transport.request(
                        worker.subject, Shutdown(reason=reason), timeout=5.0, tier=tier
                    )
                except (RequestTimeout, ConnectionError, RemoteError) as exc:
                    logger.info("worker %s did not acknowledge shutdown: %s", worker.worker_id, exc)
