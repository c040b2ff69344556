"""Trainer ranks 1..W-1: they follow rank 0's commands; rank 0 alone talks to NATS.

Rank 0 runs the :class:`~rlfleet.trainer.service.TrainerWorker`. Before it starts a step, a
publish or a save, it sends the command to the other ranks over :class:`CommandChannel`; every
rank then does the same work in the same order (the FSDP collectives pair up)::

    rank 0:  NATS request ──> channel.send({"op": "step", "request": {...}}) ──> fetch, update
    rank r:                   channel.receive() ───────────────────────────────> fetch, update

Each rank fetches the rollout chunks itself from the rollout workers' TensorStores (no central
gather; the token ids are small). Commands are JSON sent as a uint8 tensor over a gloo group of
their own, whose timeout is long: followers wait in it for as long as the trainer is idle.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlfleet.trainer.distributed import DistContext

logger = logging.getLogger(__name__)

IDLE_TIMEOUT = timedelta(days=30)
"""How long a follower waits for rank 0's next command (the trainer may idle for long)."""


class CommandChannel:
    """Rank 0 sends JSON commands, every other rank receives them in order (no pickle)."""

    def __init__(self, ctx: DistContext, timeout: timedelta = IDLE_TIMEOUT) -> None:
        self.ctx = ctx
        # every rank creates it at the same point (new_group is collective)
        self.group = dist.new_group(backend="gloo", timeout=timeout) if ctx.distributed else None

    def send(self, command: dict[str, Any]) -> None:
        """Rank 0: hand ``command`` to every other rank (a no-op with one rank)."""
        if self.group is None:
            return
        data = json.dumps(command).encode()
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=self.group)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.group)

    def receive(self) -> dict[str, Any]:
        """Ranks 1..W-1: the next command rank 0 sent (blocks until it comes)."""
        if self.group is None:
            raise RuntimeError("a single-process trainer has no commands to receive")
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.group)
        command: dict[str, Any] = json.loads(data.numpy().tobytes())
        return command


def use_rank_thread(loop: asyncio.AbstractEventLoop, device: str) -> None:
    """Run this process's ``asyncio.to_thread`` work on one thread bound to the rank's CUDA device.

    The current CUDA device is per thread; a pool thread would start on device 0, so every rank
    but the first would put its work on the wrong GPU. One thread also keeps every collective of
    a rank in one order.
    """
    initializer = None
    if device != "cpu" and torch.cuda.is_available():
        initializer = functools.partial(torch.cuda.set_device, int(os.environ.get("LOCAL_RANK", "0")))
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-rank", initializer=initializer)
    loop.set_default_executor(pool)


def rank_from_env() -> int:
    """This process's trainer rank (``RANK``; 0 when unset)."""
    return int(os.environ.get("RANK", "0"))


def follower_main(prog: str, argv: Sequence[str] | None = None) -> int:
    """``main()`` of ranks 1..W-1: same config as rank 0, no NATS; follow commands until stop."""
    from rlfleet.common.config import load_config
    from rlfleet.common.errors import ConfigError
    from rlfleet.common.service import cli_overrides, configure_logging, parse_service_args
    from rlfleet.trainer.follower import Follower
    from rlfleet.trainer.service import TrainerServiceConfig

    args = parse_service_args(prog, argv)
    try:
        config = load_config(TrainerServiceConfig, args.config, cli_overrides(args))
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_json, f"{prog}[rank {rank_from_env()}]")
    follower = Follower(config)
    try:
        asyncio.run(follower.run())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
