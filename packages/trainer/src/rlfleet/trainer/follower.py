"""A trainer rank other than 0: builds the same models, then runs each command rank 0 sends.

See :mod:`rlfleet.trainer.service` for the protocol. A follower answers nobody: rank 0 replies to
the controller. A step carries the settings rank 0 resolved for it, so every rank trains alike.
An error that every rank meets alike before any collective (a malformed batch, an algorithm whose
critic the trainer does not hold) is logged and the follower waits for the next command, as rank
0 does after replying with it; any other error ends the process, which the launcher reports, and
rank 0's next collective fails.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlfleet.common.control.messages import TrainStepRequest
from rlfleet.common.errors import BatchContractError
from rlfleet.common.schema.trainer import TrainerWorkerConfig
from rlfleet.trainer.checkpoint import load_checkpoint, save_checkpoint
from rlfleet.trainer.errors import SettingsConflict
from rlfleet.trainer.ranks import build_models, rank_from_env, use_rank_thread
from rlfleet.trainer.service import CommandChannel, StoreClients, merge_batch, run_step

logger = logging.getLogger(__name__)


class Follower:
    """Rank r > 0 of a trainer: the models' shards, and a loop over rank 0's commands."""

    def __init__(self, config: TrainerWorkerConfig) -> None:
        self.config = config
        self.stores = StoreClients(config)  # TLS to the rollout stores, as rank 0

    async def run(self) -> None:
        """Build the models (collectively with rank 0), then follow commands until ``stop``."""
        use_rank_thread(asyncio.get_running_loop(), self.config.device)
        self.dist, self.actor, self.critic = await asyncio.to_thread(build_models, self.config)
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
            await self.stores.close()

    async def handle(self, command: dict[str, Any]) -> None:
        """Run one command: ``step``, ``publish``, ``save`` or ``load``."""
        op = command["op"]
        if op == "step":
            request = TrainStepRequest.model_validate(command["request"])
            try:
                batch = merge_batch(request.settings.algorithm, await self.stores.fetch(request.rollouts))
                await asyncio.to_thread(
                    run_step, self.actor, self.critic, batch, request.scores, request.settings
                )
            except (BatchContractError, SettingsConflict) as exc:  # rank 0 met it too, before any collective
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


def follower_main(prog: str, argv: Sequence[str] | None = None) -> int:
    """``main()`` of ranks 1..W-1: same config as rank 0, no NATS; follow commands until stop."""
    from rlfleet.common.control.worker import cli_overrides, configure_logging, parse_service_args
    from rlfleet.common.errors import ConfigError
    from rlfleet.common.schema.config import load_config

    args = parse_service_args(prog, argv)
    try:
        config = load_config(TrainerWorkerConfig, args.config, cli_overrides(args))
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_json, f"{prog}[rank {rank_from_env()}]")
    try:
        asyncio.run(Follower(config).run())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
