"""The reward tier's worker: scores rollout batches pulled straight from the rollout workers' stores.

Each endpoint maps to a reward spec. A spec switch (``SetRewardSpec``) builds the new reward first
and then swaps it in one assignment, so requests already running finish on the version they
started with and every score names the version that produced it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from pydantic import Field

from rlfleet.common.messages import AnyMessage, RewardSpecSet, ScoreRequest, ScoreResult, SetRewardSpec
from rlfleet.common.service import ServiceConfig, Worker
from rlfleet.common.subjects import subject
from rlfleet.reward.composite import CompositeReward
from rlfleet.reward.errors import UnknownEndpoint
from rlfleet.reward.registry import build_reward

logger = logging.getLogger(__name__)

TEXT_TENSORS = ["prompt_text", "prompt_text_offsets", "response_text", "response_text_offsets", "group_index"]


class RewardServiceConfig(ServiceConfig):
    """Settings of a reward worker."""

    endpoints: dict[str, str | dict[str, Any]] = Field(
        default_factory=lambda: {"default": "concise:max_words=50"},
        description="endpoint name -> reward spec (rlfleet-reward spec syntax)",
    )
    max_concurrency: int = Field(default=4, ge=1, description="score requests handled at once")


class RewardWorker(Worker[RewardServiceConfig]):
    """Serves ``reward.score`` for its endpoints."""

    tier = "reward"

    async def setup(self) -> None:
        self.rewards: dict[str, CompositeReward] = {
            name: build_reward(spec) for name, spec in self.config.endpoints.items()
        }
        self._revisions = dict.fromkeys(self.rewards, 0)
        self._clients: dict[str, Any] = {}
        cluster = self.config.cluster
        await self.transport.subscribe(subject(cluster, "reward", "score"), self._on_score, queue="reward",
                                       max_concurrency=self.config.max_concurrency)  # fmt: skip
        for name, reward in self.rewards.items():
            logger.info("endpoint %s: %s (version %s)", name, reward.spec, reward.version)

    def announce_fields(self) -> dict[str, object]:
        return {"capacity": self.config.max_concurrency, "model_id": ",".join(sorted(self.rewards))}

    async def handle_own(self, message: AnyMessage) -> AnyMessage | None:
        if isinstance(message, SetRewardSpec):
            return await self.set_spec(message)
        if isinstance(message, ScoreRequest):
            return await self.score(message)
        return await super().handle_own(message)

    async def _on_score(self, message: AnyMessage) -> AnyMessage | None:
        if not isinstance(message, ScoreRequest):
            raise ValueError(f"reward.score takes score requests, got {message.kind!r}")
        return await self.score(message)

    async def set_spec(self, message: SetRewardSpec) -> RewardSpecSet:
        """Build the new reward, then switch the endpoint to it atomically."""
        revision = self._revisions.get(message.endpoint, -1) + 1
        reward = await asyncio.to_thread(build_reward, message.spec, revision=revision)
        self.rewards[message.endpoint] = reward
        self._revisions[message.endpoint] = revision
        logger.info("endpoint %s now %s (version %s)", message.endpoint, reward.spec, reward.version)
        return RewardSpecSet(endpoint=message.endpoint, spec_version=reward.version)

    async def score(self, request: ScoreRequest) -> ScoreResult:
        reward = self.rewards.get(request.endpoint)
        if reward is None:
            raise UnknownEndpoint(request.endpoint, self.rewards)
        self.busy += 1
        try:
            prompts, responses, groups = await self._texts(request)
            metadata = [dict(request.metadata[g]) if g < len(request.metadata) else {} for g in groups]
            batch = await asyncio.to_thread(reward.score, prompts, responses, metadata)
        finally:
            self.busy -= 1
        return ScoreResult(job_id=request.job_id, endpoint=request.endpoint, spec_version=batch.version,
                           scores=batch.total, components=batch.components)  # fmt: skip

    async def _texts(self, request: ScoreRequest) -> tuple[list[str], list[str], list[int]]:
        from rlfleet.common.batch import unpack_texts
        from rlfleet.common.tensor_store import TensorStoreClient

        address = request.rollout.address
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = TensorStoreClient(address)
        got = await client.fetch(request.rollout, names=TEXT_TENSORS)
        prompts = unpack_texts(got["prompt_text"], got["prompt_text_offsets"])
        responses = unpack_texts(got["response_text"], got["response_text_offsets"])
        return prompts, responses, [int(g) for g in got["group_index"].tolist()]

    async def teardown(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
