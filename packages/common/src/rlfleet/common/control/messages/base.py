"""What every control message shares: the wire schema version, the base model, the generic replies.

Messages carry the wire schema version in ``protocol`` ("MAJOR.MINOR"): another MAJOR is refused
(``codec.check_protocol``), a MINOR skew is accepted and unknown fields are ignored (``extra="ignore"``).
A config model carried in a message (a run's :class:`~rlfleet.common.schema.trainer.ModelSettings`)
refuses settings it does not know, so it travels as :data:`SETTINGS_SET`: only the settings that
differ from their defaults, in the flat form of the previous release where its class has sections
(:func:`~rlfleet.common.schema.config.legacy_dump`: the step settings), which an older reader takes
as long as newer settings keep their defaults (and refuses by name once one is used); this
release's reader takes either form. tests/compat runs older releases against this code.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PlainSerializer

from rlfleet.common.schema.config import legacy_dump

PROTOCOL = "2.10"
"""The wire schema version this code speaks: bump MINOR for additive changes, MAJOR otherwise."""


def speaks(protocol: str, version: str) -> bool:
    """Whether a peer that announced wire ``protocol`` ("MAJOR.MINOR") reads what came in ``version``
    of the same MAJOR (numbers compared: 2.10 comes after 2.9); a malformed one does not."""
    try:
        major, minor = (int(part) for part in protocol.split("."))
        since_major, since_minor = (int(part) for part in version.split("."))
    except ValueError:
        return False
    return major == since_major and minor >= since_minor


def _settings_set(settings: BaseModel) -> dict[str, Any]:
    wire_form = getattr(settings, "wire_form", None)  # the step settings flatten themselves
    return wire_form() if callable(wire_form) else legacy_dump(settings, exclude_defaults=True)


SETTINGS_SET = PlainSerializer(_settings_set, return_type=dict)
"""``Annotated[SomeConfigModel, SETTINGS_SET]``: the field is written with only its settings that
differ from their defaults (wire 2.4; the reader fills in the rest)."""

Tier = Literal["controller", "rollout", "reward", "trainer"]


class Message(BaseModel):
    """Base of every control message."""

    model_config = ConfigDict(extra="ignore", frozen=False)

    protocol: str = Field(default=PROTOCOL, description="wire schema version, MAJOR.MINOR")


MAX_MESSAGE_BYTES = 1 << 20
"""nats-server's default max_payload; a message over it belongs on the tensor plane."""


# --- replies and commands any tier sends -----------------------------------------------------


class Ack(Message):
    """Plain acknowledgement."""

    kind: Literal["ack"] = "ack"
    detail: str = ""


class Shutdown(Message):
    """Ask a worker to stop after its current job."""

    kind: Literal["shutdown"] = "shutdown"
    reason: str = ""


class ErrorReply(Message):
    """A request failed: ``code`` is machine-readable, ``message`` is for people."""

    kind: Literal["error"] = "error"
    tier: str = ""
    code: str
    message: str
    retryable: bool = False
    retry_after_s: float = Field(
        default=0.0, ge=0.0, le=3600.0, allow_inf_nan=False,
        description="a retryable error's own wait before the next try (0: the caller's backoff)",
    )  # fmt: skip
