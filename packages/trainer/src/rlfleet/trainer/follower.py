"""A trainer rank other than 0: builds the same models, then runs each command rank 0 sends.

See :mod:`rlfleet.trainer.service` for the protocol. A follower answers nobody: rank 0 replies to
the controller. A step carries the settings rank 0 resolved for it, so every rank trains alike.

Each command's own part (fetch and check the batch, check a checkpoint's files) ends in
:func:`~rlfleet.trainer.commands.agree` with the other ranks, before any collective: when it failed
on any rank (this one or another), the follower logs it and waits for the next command, as rank 0
does after answering the controller with it. An error after the first collective ends the
process (the ranks' collectives are out of step then); rank 0 reports it within
``rank_silence_s`` (:mod:`rlfleet.trainer.rank_liveness`: the follower beats in the rendezvous
store, and exits when rank 0's store is gone).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from rlfleet.common.control.messages import TrainStepRequest
from rlfleet.common.schema.trainer import TrainerWorkerConfig
from rlfleet.common.tensors.store import ClientPool
from rlfleet.trainer.checkpoint import check_loadable, check_writable, load_checkpoint, save_checkpoint
from rlfleet.trainer.commands import CommandChannel, agree
from rlfleet.trainer.errors import TrainerRankDied, TrainerRankFailed
from rlfleet.trainer.rank_liveness import RANK_LOST_EXIT, VERDICT_S, RankHeartbeat
from rlfleet.trainer.ranks import build_models, rank_from_env, use_rank_thread
from rlfleet.trainer.service import fetch_batch, run_step

logger = logging.getLogger(__name__)
T = TypeVar("T")


class Skipped(Exception):
    """A command every rank skipped: some rank failed its own part (the agreed error is the cause)."""


class Follower:
    """Rank r > 0 of a trainer: the models' shards, and a loop over rank 0's commands."""

    def __init__(self, config: TrainerWorkerConfig) -> None:
        self.config = config
        self.stores = ClientPool(config.tensor_plane)  # TLS to the rollout stores, as rank 0

    async def run(self) -> None:
        """Build the models (collectively with rank 0), then follow commands until ``stop``."""
        use_rank_thread(asyncio.get_running_loop(), self.config.placement.device)
        self.dist, self.actor, self.critic = await asyncio.to_thread(build_models, self.config)
        self.channel = CommandChannel(self.dist)
        heartbeat = RankHeartbeat(self.dist).start()
        logger.info("trainer rank %d of %d ready", self.dist.rank, self.dist.world_size)
        try:
            while True:
                try:
                    command = await asyncio.to_thread(self.channel.receive)
                except RuntimeError as exc:  # gloo: the sender's connection closed
                    how = f"the command channel from it broke: {exc}"
                    raise TrainerRankDied(0, 0.0, how=how, then=f"rank {self.dist.rank} exits") from exc
                if command["op"] == "stop":
                    logger.info("rank 0 says stop")
                    return
                try:
                    await self.handle(command)
                except Skipped as skipped:  # every rank skipped it; rank 0 answered with the cause
                    logger.warning("%s skipped by every trainer rank: %s", command["op"], skipped.__cause__)
                except RuntimeError as exc:  # a collective broke: when rank 0 is gone, the heartbeat
                    logger.error("%s failed: %s", command["op"], exc)  # ends the process naming it
                    await asyncio.sleep(VERDICT_S)
                    raise
        finally:
            heartbeat.stop()
            await self.stores.close()

    async def handle(self, command: dict[str, Any]) -> None:
        """Run one command: ``step``, ``publish``, ``save`` or ``load``."""
        op = command["op"]
        if op == "step":
            request = TrainStepRequest.model_validate(command["request"])
            what = f"fetch and check the batch of step {request.step}"
            batch = await self._agreed(what, lambda: fetch_batch(self, request))
            actor, critic = self.actor, self.critic
            await asyncio.to_thread(run_step, actor, critic, batch, request.scores, request.settings)
        elif op == "publish":
            await self._agreed("publish", lambda: asyncio.sleep(0))
            await asyncio.to_thread(
                self._drain, int(command["bucket_bytes"]), str(command.get("dtype") or ""),
                bool(command.get("adapter")),
            )  # fmt: skip
        elif op == "save":
            path, mode = command["path"], command.get("mode", "hf")
            await self._agreed(f"save checkpoint {path!r}",
                               lambda: asyncio.to_thread(check_writable, path, mode))  # fmt: skip
            await asyncio.to_thread(save_checkpoint, path, self.actor, self.critic, mode)
        elif op == "load":
            path = command["path"]
            await self._agreed(f"load checkpoint {path!r}",
                               lambda: asyncio.to_thread(check_loadable, path, self.critic))  # fmt: skip
            await asyncio.to_thread(load_checkpoint, path, self.actor, self.critic)
        else:
            raise ValueError(f"unknown trainer command {op!r} from rank 0")

    async def _agreed(self, what: str, part: Callable[[], Awaitable[T]]) -> T:
        """This rank's own ``part`` of a command, then :func:`agree` with the other ranks on it;
        :class:`Skipped` (caused by the agreed error) when any rank failed."""
        value, error = None, None
        try:
            value = await part()
        except Exception as exc:
            error = exc
        try:
            await asyncio.to_thread(agree, self.channel, what, error)
        except Exception as exc:
            if exc is error or isinstance(exc, TrainerRankFailed):
                raise Skipped(what) from exc
            raise  # the agreement itself failed (rank 0 is gone): this rank ends
        return value  # type: ignore[return-value]

    def _drain(self, bucket_bytes: int, dtype: str, adapter: bool) -> None:
        """Take part in every gather of a publish (in rank 0's publish dtype; ``adapter``: a LoRA
        actor's adapter alone); rank 0 keeps the buckets."""
        publish_dtype = getattr(torch, dtype) if dtype else None
        for _ in self.actor.iter_weight_buckets(bucket_bytes, dtype=publish_dtype, adapter=adapter):
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
    except TrainerRankDied as exc:  # one line that names the cause (the launcher reports it)
        logger.error("%s", exc)
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return RANK_LOST_EXIT
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
