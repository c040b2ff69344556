"""The commands rank 0 sends the other trainer ranks, and every rank's word before the first collective.

Rank 0 sends each command (``step``, ``publish``, ``save``, ``load``, ``stop``) over
:class:`CommandChannel`: JSON as a uint8 tensor over a gloo group of its own (no pickle), whose
timeout is long, as followers wait in it for as long as the trainer is idle.

A command's work on a rank has two parts: what the rank does alone (fetch and check the batch,
check a checkpoint's files, resolve a dtype), then the collectives. A rank that fails the first
part and gives up would leave the others waiting in the first collective for it. So every rank
reports how its own part went (:func:`agree`: one ``all_gather`` of a short outcome), and when any
rank failed, every rank skips the command: rank 0 answers the controller with that rank's error
(its own when it failed too, else :class:`~rlfleet.trainer.errors.TrainerRankFailed` naming the
rank), and the followers log it and wait for the next command. No rank exits for such an error.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlfleet.common.errors import wire_code
from rlfleet.trainer.distributed import DistContext
from rlfleet.trainer.errors import TrainerRankFailed

IDLE_TIMEOUT = timedelta(days=30)
"""How long a follower waits for rank 0's next command (the trainer may idle for long)."""

OUTCOME_BYTES = 2048
"""The size of one rank's outcome in :func:`agree` (JSON, NUL-padded; longer error texts are cut)."""


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


def agree(channel: CommandChannel, what: str, error: BaseException | None) -> None:
    """Every rank calls it once per command, after its own part and before the first collective.

    ``what`` says what the part was for people ("fetch and check the batch of step 3"); ``error``
    is how it ended on this rank (None: fine). Returns when every rank is fine. Otherwise raises on
    every rank: this rank's own ``error`` when it has one, else :class:`TrainerRankFailed` for the
    lowest rank that failed (its error text, wire code and whether a retry can help).
    """
    if error is None and channel.group is None:
        return
    if error is not None and channel.group is None:
        raise error
    mine = torch.zeros(OUTCOME_BYTES, dtype=torch.uint8)
    if error is not None:
        code, retryable = wire_code(error)
        text = f"{type(error).__name__}: {error}"[: OUTCOME_BYTES // 2]
        data = json.dumps({"error": text, "code": code, "retryable": retryable}).encode()[:OUTCOME_BYTES]
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    outcomes = [torch.zeros(OUTCOME_BYTES, dtype=torch.uint8) for _ in range(channel.ctx.world_size)]
    dist.all_gather(outcomes, mine, group=channel.group)
    failed = [(rank, _decode(raw)) for rank, raw in enumerate(outcomes) if int(raw[0]) != 0]
    if not failed:
        return
    if error is not None:
        raise error
    rank, outcome = failed[0]
    raise TrainerRankFailed(rank, what, str(outcome.get("error", "")), str(outcome.get("code", "internal")),
                            bool(outcome.get("retryable", False)))  # fmt: skip


def _decode(raw: torch.Tensor) -> dict[str, Any]:
    """One rank's outcome; a text cut at :data:`OUTCOME_BYTES` is kept as the error itself."""
    data = raw.numpy().tobytes().rstrip(b"\x00")
    try:
        outcome = json.loads(data)
    except ValueError:
        return {"error": data.decode(errors="replace"), "code": "internal", "retryable": False}
    return outcome if isinstance(outcome, dict) else {"error": str(outcome)}
