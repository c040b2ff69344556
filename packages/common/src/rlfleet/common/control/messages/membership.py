"""Membership messages: a worker announces itself, beats, leaves; a late controller pings.

Each tier's workers publish these on their tier's membership subject
(:func:`rlfleet.common.control.transport.membership_subject`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlfleet.common.control.messages.base import Message, Tier


class WorkerAnnounce(Message):
    """A worker says it is up and what it offers."""

    kind: Literal["worker.announce"] = "worker.announce"
    tier: Tier
    worker_id: str
    subject: str = Field(default="", description="NATS subject for requests addressed to this worker alone")
    data_address: str = Field(default="", description="host:port of the worker's TensorStore, if any")
    capacity: int = Field(default=1, ge=1, description="how many jobs the worker takes at once")
    model_id: str = ""
    weight_version: int = -1
    pool: str = "default"
    pid: int = 0
    host: str = Field(default="", max_length=255, description="the worker's hostname (wire 2.3; '': unknown)")
    package: str = Field(
        default="",
        max_length=128,
        description="the worker's package, e.g. rlfleet-rollout (wire 2.4; '': unknown)",
    )
    package_version: str = Field(
        default="", max_length=64, description="the installed version of that package (wire 2.4; '': unknown)"
    )
    gpu_uuids: list[str] = Field(
        default_factory=list, max_length=64, description="GPUs the worker's model lives on (empty: CPU)"
    )
    incarnation: str = Field(
        default="",
        max_length=64,
        description="random id of this life of the process (restarted: a new one)",
    )


class Heartbeat(Message):
    """Periodic liveness from a worker."""

    kind: Literal["worker.heartbeat"] = "worker.heartbeat"
    tier: Tier
    worker_id: str
    weight_version: int = -1
    busy: int = Field(default=0, description="jobs in progress")
    pool: str = "default"
    incarnation: str = Field(
        default="",
        max_length=64,
        description="random id of this life of the process (restarted: a new one)",
    )
    activity: str = Field(default="", max_length=256, description="what the worker is doing now ('': idle)")
    activity_s: float = Field(default=0.0, ge=0.0, description="seconds since the activity began")
    step: int = Field(default=-1, ge=-1, description="last training step done (trainer, wire 2.3; -1: none)")


class WorkerLeave(Message):
    """A worker leaves on purpose (shutdown, drain)."""

    kind: Literal["worker.leave"] = "worker.leave"
    tier: Tier
    worker_id: str
    reason: str = ""


class Ping(Message):
    """Asks workers of a tier to announce themselves again (used by a controller that joins late)."""

    kind: Literal["worker.ping"] = "worker.ping"
