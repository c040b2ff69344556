"""A trainer rank other than 0: builds the same models, then runs each command rank 0 sends.

See :mod:`rlfleet.trainer.ranks` for the protocol. A follower answers nobody: rank 0 replies to
the controller. An error that every rank meets alike before any collective (a malformed batch)
is logged and the follower waits for the next command, as rank 0 does after replying with it;
any other error ends the process, which the launcher reports, and rank 0's next collective fails.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import torch

from rlfleet.common.messages import TrainStepRequest
from rlfleet.common.refs import TensorRef
from rlfleet.common.tensor_store import TensorStoreClient
from rlfleet.trainer.checkpoint import load_checkpoint, save_checkpoint
from rlfleet.trainer.errors import InvalidBatch
from rlfleet.trainer.ranks import CommandChannel, use_rank_thread
from rlfleet.trainer.service import TrainerServiceConfig, build_models
from rlfleet.trainer.updates import merge_batch, run_update

logger = logging.getLogger(__name__)


class Follower:
    """Rank r > 0 of a trainer: the actor's shards, and a loop over rank 0's commands."""

    def __init__(self, config: TrainerServiceConfig) -> None:
        self.config = config
        self._clients: dict[str, TensorStoreClient] = {}

    async def run(self) -> None:
        """Build the models (collectively with rank 0), then follow commands until ``stop``."""
        cfg = self.config
        use_rank_thread(asyncio.get_running_loop(), cfg.device)
        self.dist, self.actor, self.critic = await asyncio.to_thread(build_models, cfg)
        self.channel = CommandChannel(self.dist)
        logger.info("trainer rank %d of %d ready", self.dist.rank, self.dist.world_size)
        try:
            while True:
                command = await asyncio.to_thread(self.channel.receive)
                if command["op"] == "stop":
                    logger.info("rank 0 says stop")
                    return
                await self.handle(command)
        finally:
            for client in self._clients.values():
                await client.close()

    async def handle(self, command: dict[str, Any]) -> None:
        """Run one command: ``step``, ``publish``, ``save`` or ``load``."""
        op = command["op"]
        if op == "step":
            request = TrainStepRequest.model_validate(command["request"])
            try:
                chunks = await asyncio.gather(*(self._fetch(ref) for ref in request.rollouts))
                batch = merge_batch(request.algorithm, chunks)
                await asyncio.to_thread(run_update, self.actor, self.critic, self.config, batch, request)
            except InvalidBatch as exc:  # rank 0 met it too, before any collective
                logger.warning("step %d refused: %s", request.step, exc)
        elif op == "publish":
            await asyncio.to_thread(
                self._drain, int(command["bucket_bytes"]), str(command.get("dtype") or "")
            )
        elif op == "save":
            mode = command.get("mode", "hf")
            await asyncio.to_thread(save_checkpoint, command["path"], self.actor, self.critic, mode)
        elif op == "load":
            await asyncio.to_thread(load_checkpoint, command["path"], self.actor, self.critic)
        else:
            raise ValueError(f"unknown trainer command {op!r} from rank 0")

    def _drain(self, bucket_bytes: int, dtype: str) -> None:
        """Take part in every gather of a publish (in rank 0's publish dtype); rank 0 keeps the buckets."""
        for _ in self.actor.iter_weight_buckets(bucket_bytes, dtype=getattr(torch, dtype) if dtype else None):
            pass

    async def _fetch(self, ref: TensorRef) -> dict[str, torch.Tensor]:
        client = self._clients.get(ref.address)
        if client is None:
            client = self._clients[ref.address] = TensorStoreClient(ref.address)
        return await client.fetch(ref)
