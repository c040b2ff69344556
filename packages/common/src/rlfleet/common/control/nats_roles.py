"""Who may publish and subscribe what on a run's NATS server: one user per role, generated per run.

The embedded launcher starts its nats-server with :func:`server_config` of a fresh
:class:`RunCredentials`: a random password per role, and each role allowed only the subjects it
needs (cluster ``C``, ``P = rlfleet.C``)::

    role        publishes                                   subscribes
    controller  P.> except every tier's membership          P.<tier>.membership, its inbox
    trainer     P.trainer.membership, replies               P.trainer.>, P.controller.ping, its inbox
    rollout     P.rollout.membership, P.trainer.latest,     P.rollout.>, P.controller.ping, its inbox
                P.env.reset, P.env.episode.*, replies
    reward      P.reward.membership, replies                P.reward.>, P.env.>, P.controller.ping,
                                                            its inbox
    observer    P.controller.ping                           P.<tier>.membership, its inbox

"Replies" is nats-server's ``allow_responses``: a worker may answer the requests it received, on
their reply subject, once each, and publish nowhere else. nats-server forgets that permission two
minutes after the request unless told otherwise (``allow_responses: true`` means one reply within 2
min), so a generate or train step that took longer had its answer refused ("permissions violation
for publish to _INBOX...") and the controller waited for a reply that could never come. The window
here is :data:`REPLY_WINDOW_S` (6 h), longer than any request deadline a run sets. Each role's
inbox is ``_INBOX.<role>.>`` (the client's ``inbox_prefix``), so no role reads another's replies.
So only the controller can send state-changing requests (step, publish, save, load, configure, load
weights, set reward spec, shutdown), only the trainer role can announce a trainer, and so on; a
client without a password cannot connect at all.

What remains: the workers of one role share its credential (two rollout workers could answer or
announce for each other, or read each other's own subject).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from rlfleet.common.control.transport import WORKER_TIERS, subject
from rlfleet.common.schema.connection import NatsConnection

ROLES = ("controller", *WORKER_TIERS, "observer")
"""Every role of an embedded run: the controller, one per worker tier, and an observer
(``rlfleet status``: it reads the membership subjects and asks workers to announce, nothing else)."""

WORKER_PUBLISHES: dict[str, tuple[str, ...]] = {
    "trainer": (),
    "rollout": ("trainer.latest", "env.reset", "env.episode.*"),
    "reward": (),
}
"""Requests a worker role sends besides its membership (verbs of another tier, ``tier.verb``)."""


WORKER_SUBSCRIBES: dict[str, list[str]] = {"reward": ["env.>"]}
"""Subjects a worker role serves beyond its own tier's (the environments' resets and episodes)."""

REPLY_WINDOW_S = 6 * 3600
"""How long after a request its worker may still answer it (nats-server ``allow_responses.expires``);
longer than any request deadline (``request_timeout_s``), so only the controller's own deadline ends
a wait."""


def reply_permission(window_s: float = REPLY_WINDOW_S) -> dict[str, object]:
    """nats-server ``allow_responses``: one reply per request received, within ``window_s`` seconds."""
    if window_s <= 0:
        raise ValueError(f"reply window must be positive, got {window_s} s (0 means nats-server's 2 min)")
    return {"max": 1, "expires": f"{window_s:g}s"}


def inbox(role: str) -> str:
    """The reply-subject prefix of ``role``'s clients."""
    return f"_INBOX.{role}"


def role_permissions(cluster: str, role: str, reply_window_s: float = REPLY_WINDOW_S) -> dict[str, object]:
    """nats-server ``permissions`` of ``role`` in ``cluster`` (``*``: any cluster; see the module's table)."""
    if cluster != "*":
        subject(cluster, "controller", "ping")  # ValueError unless the cluster is one token

    def on(tier: str, verb: str) -> str:
        return f"rlfleet.{cluster}.{tier}.{verb}"

    memberships = [on(tier, "membership") for tier in WORKER_TIERS]
    if role == "observer":
        return {"publish": {"allow": [on("controller", "ping")]},
                "subscribe": {"allow": [*memberships, f"{inbox(role)}.>"]}}  # fmt: skip
    if role == "controller":
        return {
            "publish": {"allow": [f"rlfleet.{cluster}.>"], "deny": memberships},
            "subscribe": {"allow": [*memberships, f"{inbox(role)}.>"]},
        }
    if role not in WORKER_TIERS:
        raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    requests = [on(*verb.split(".", 1)) for verb in WORKER_PUBLISHES[role]]
    served = [on(*verb.split(".", 1)) for verb in WORKER_SUBSCRIBES.get(role, [])]
    return {
        "publish": {"allow": [on(role, "membership"), *requests]},
        "subscribe": {"allow": [on(role, ">"), *served, on("controller", "ping"), f"{inbox(role)}.>"]},
        "allow_responses": reply_permission(reply_window_s),
    }


@dataclass(frozen=True)
class RunCredentials:
    """A random password for each role of one run's cluster (kept in memory, never logged)."""

    cluster: str
    passwords: dict[str, str] = field(repr=False)

    @classmethod
    def generate(cls, cluster: str) -> RunCredentials:
        return cls(cluster, {role: secrets.token_urlsafe(24) for role in ROLES})

    def connection(self, role: str) -> NatsConnection:
        """How a process of ``role`` connects (user ``role``, its password, its own inbox)."""
        return NatsConnection(user=role, password=self.passwords[role], inbox_prefix=inbox(role))

    def env(self, role: str) -> dict[str, str]:
        """The same, as the ``RLFLEET_NATS_*`` variables a worker reads (not argv: ``ps`` shows argv)."""
        return self.connection(role).env()


def server_config(credentials: RunCredentials, reply_window_s: float = REPLY_WINDOW_S) -> str:
    """The ``authorization`` block of a nats-server config: one user per role with its permissions."""
    users = [
        {"user": role, "password": credentials.passwords[role],
         "permissions": role_permissions(credentials.cluster, role, reply_window_s)}
        for role in ROLES
    ]  # fmt: skip
    return "authorization: " + json.dumps({"users": users}, indent=2) + "\n"
