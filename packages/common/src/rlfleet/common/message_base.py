"""The base every control message shares: the wire schema version and its check.

:mod:`rlfleet.common.messages` re-exports all of it; import from there.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlfleet.common.errors import MessageDecodeError, ProtocolMismatch

PROTOCOL = "1.3"
"""The wire schema version this code speaks: bump MINOR for additive changes, MAJOR otherwise."""

Tier = Literal["controller", "rollout", "reward", "trainer"]


class Message(BaseModel):
    """Base of every control message."""

    model_config = ConfigDict(extra="ignore", frozen=False)

    protocol: str = Field(default=PROTOCOL, description="wire schema version, MAJOR.MINOR")


MAX_MESSAGE_BYTES = 1 << 20
"""nats-server's default max_payload; a message over it belongs on the tensor plane."""


def _major(version: str) -> str:
    return version.split(".", 1)[0]


def check_protocol(theirs: object) -> None:
    """Raise :class:`ProtocolMismatch` unless ``theirs`` shares our MAJOR version."""
    if not isinstance(theirs, str) or not theirs:
        raise MessageDecodeError(f"'protocol' must be a 'MAJOR.MINOR' string, got {theirs!r}")
    if _major(theirs) != _major(PROTOCOL):
        raise ProtocolMismatch(PROTOCOL, theirs)
