"""The one union of every control message, and the one way to read bytes off the wire.

:data:`AnyMessage` is the discriminated union (on ``kind``) of every message of every family;
:func:`encode` writes a message as JSON within the size limit and :func:`decode` reads any of them,
refusing bytes that are not a message of a known kind with :class:`MessageDecodeError` and a
message of another MAJOR version with :class:`ProtocolMismatch`. Every network input is hostile:
nothing else escapes :func:`decode`.

Non-finite floats: JSON has no NaN or Infinity, so :func:`decode` refuses the bare ``NaN`` /
``Infinity`` constants (and ``1e999``). A message whose floats may be non-finite by nature (a
step's metrics, :class:`~rlfleet.common.control.messages.trainer.TrainStepResult`) writes them as
the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` (``ser_json_inf_nan="strings"``), which a
float field reads back; a field that must be finite says so (``allow_inf_nan=False``) and refuses
them. Any other message writes a non-finite float as ``null``, which its float field refuses.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, Union

from pydantic import Field, TypeAdapter, ValidationError

from rlfleet.common.control.messages import agent, environment, membership, reward, rollout, trainer
from rlfleet.common.control.messages.base import (
    MAX_MESSAGE_BYTES,
    PROTOCOL,
    Ack,
    ErrorReply,
    Message,
    Shutdown,
)
from rlfleet.common.errors import MessageDecodeError, MessageTooLarge, ProtocolMismatch

AnyMessage = Annotated[
    Union[  # noqa: UP007 - a family a line reads better than a 28-way `|` chain
        membership.WorkerAnnounce, membership.Heartbeat, membership.WorkerLeave, membership.Ping,
        rollout.GenerateRequest, rollout.GenerateResult, rollout.LoadWeights, rollout.WeightsLoaded,
        reward.ScoreRequest, reward.ScoreResult, reward.SetRewardSpec, reward.RewardSpecSet,
        reward.RewardStatsRequest, reward.RewardStats,
        trainer.TrainerConfigure, trainer.TrainerConfigured, trainer.TrainStepRequest,
        trainer.TrainStepResult, trainer.PublishWeights, trainer.WeightsPublished, trainer.LatestWeights,
        trainer.SaveCheckpoint, trainer.Saved, trainer.LoadCheckpoint, trainer.CheckpointLoaded,
        environment.EnvReset, environment.EnvStep, environment.EnvClose, environment.EnvObservation,
        agent.AgentOpen, agent.AgentOpened, agent.AgentCollect,
        Ack, Shutdown, ErrorReply,
    ],
    Field(discriminator="kind"),
]  # fmt: skip
MESSAGES: TypeAdapter[AnyMessage] = TypeAdapter(AnyMessage)


def _major(version: str) -> str:
    return version.split(".", 1)[0]


def check_protocol(theirs: object) -> None:
    """Raise :class:`ProtocolMismatch` unless ``theirs`` shares our MAJOR version."""
    if not isinstance(theirs, str) or not theirs:
        raise MessageDecodeError(f"'protocol' must be a 'MAJOR.MINOR' string, got {theirs!r}")
    if _major(theirs) != _major(PROTOCOL):
        raise ProtocolMismatch(PROTOCOL, theirs)


def encode(message: Message, *, limit: int = MAX_MESSAGE_BYTES) -> bytes:
    """Serialize a message to JSON bytes, refusing ones over ``limit``."""
    data = message.model_dump_json().encode()
    if len(data) > limit:
        raise MessageTooLarge(len(data), limit, f"{getattr(message, 'kind', 'message')} message")
    return data


def decode(data: bytes | str) -> AnyMessage:
    """Read one message off the wire.

    Raises :class:`MessageDecodeError` for anything that is not a message of a known kind (including
    bytes that are not UTF-8, ``NaN``/``Infinity``, integers over Python's 4300-digit limit and
    nesting too deep to parse) and :class:`ProtocolMismatch` for a message of another MAJOR
    version (its ``sender``: the message's kind, tier, worker id, pool, package and host, as
    text); nothing else.
    """
    try:
        if isinstance(data, str):
            data = data.encode()
        raw = json.loads(data, parse_constant=_no_constant, parse_float=_finite)
    except (ValueError, TypeError, RecursionError) as exc:  # bad UTF-8 or JSON, a huge integer, too deep
        raise MessageDecodeError(f"not JSON ({exc.__class__.__name__}: {str(exc)[:120]})") from None
    if _SURROGATE_ESCAPE.search(data) and _has_lone_surrogate(raw):  # no reply could echo such a text
        raise MessageDecodeError("a string holds a lone UTF-16 surrogate (\\ud800-\\udfff), not Unicode text")
    if not isinstance(raw, dict):
        raise MessageDecodeError(f"expected a JSON object, got {type(raw).__name__}")
    try:
        check_protocol(raw.get("protocol"))
    except ProtocolMismatch as exc:
        exc.sender = _sender(raw)
        raise
    try:
        return MESSAGES.validate_python(raw)
    except (ValidationError, RecursionError) as exc:
        raise MessageDecodeError(_summarize(exc)) from None


_SENDER_FIELDS = ("kind", "tier", "worker_id", "pool", "package", "package_version", "host")


def _sender(raw: dict[str, Any]) -> dict[str, str]:
    """Who sent a refused message, as its own top-level fields say (short printable text only)."""
    found = {key: raw[key][:128] for key in _SENDER_FIELDS if isinstance(raw.get(key), str)}
    return {key: "".join(c if c.isprintable() else "?" for c in value) for key, value in found.items()}


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(raw: object) -> bool:
    """Whether any string (key or value) in ``raw`` cannot be written as UTF-8."""
    stack = [raw]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return True
    return False


def _finite(text: str) -> float:
    """A JSON number as a float, refusing one that overflows to infinity (``1e999``)."""
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:40]} overflows a float")
    return value


def _no_constant(name: str) -> Any:
    """``NaN`` / ``Infinity`` are not JSON; no message carries them bare (see the module docstring)."""
    raise ValueError(f"{name} is not a JSON value")


def _summarize(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "<root>"
        return f"{where}: {first.get('msg', 'invalid')} ({exc.error_count()} error(s))"
    return exc.__class__.__name__
