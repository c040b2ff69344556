"""When the NATS transport sends a request again, and how its client backs off between reconnects.

A reply sent while the asker was cut off is lost, so after a reconnect a request that is safe to
repeat (:func:`resendable`: it carries a ``job_id``, which its worker answers once, or its kind is
idempotent) is sent again within its own deadline; a request nobody took within :data:`REJOIN_S`
of a reconnect is sent again until a peer is back. Reconnect attempts wait :func:`backoff_delay`.
"""

from __future__ import annotations

import random

from rlfleet.common.control.messages import Message

POLL_S = 0.25
"""How often a waiting request looks at the connection (came back after a drop, down for too long)."""

REJOIN_S = 20.0
"""After a reconnect, how long "no responders" means "not back yet": the peers reconnect on their
own backoff, so a request nobody took is sent again (safe: nobody got it) until this has passed."""

IDEMPOTENT_KINDS = frozenset({"trainer.configure", "trainer.latest", "reward.stats"})
"""Requests without a ``job_id`` that a worker may get twice with the same effect as once."""


def resendable(message: Message) -> bool:
    """Whether ``message`` may be sent again when its reply may have been lost in an outage: it
    carries a ``job_id`` (its worker answers a repeat with the first reply, or does the same work
    again) or its kind is in :data:`IDEMPOTENT_KINDS`."""
    return bool(getattr(message, "job_id", "")) or message.kind in IDEMPOTENT_KINDS


def backoff_delay(attempt: int, base: float, cap: float, jitter: float, rng: random.Random) -> float:
    """Seconds before reconnect attempt ``attempt`` (0: at once), then ``base * 2**(attempt-1)``.

    Capped at ``cap`` and scaled by a random factor in ``[1 - jitter, 1 + jitter]``.
    """
    if attempt <= 0:
        return 0.0
    delay = min(cap, base * 2 ** min(attempt - 1, 30))
    return delay * rng.uniform(1.0 - jitter, 1.0 + jitter)
