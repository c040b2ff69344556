"""NATS subject names: ``rlfleet.<cluster>.<tier>.<verb>``, built in one place."""

from __future__ import annotations

import re

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
_VERB = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


def subject(cluster: str, tier: str, verb: str) -> str:
    """The subject for ``verb`` on ``tier`` in ``cluster``.

    ``cluster`` and ``tier`` are single NATS tokens; ``verb`` may hold dots (``worker.w1``) or
    be ``*``/``>`` wildcards for subscriptions.
    """
    for name, value in (("cluster", cluster), ("tier", tier)):
        if not _TOKEN.match(value):
            raise ValueError(f"{name} {value!r} must be letters, digits, '-' or '_' (one NATS token)")
    if verb not in ("*", ">") and not _VERB.match(verb):
        raise ValueError(f"verb {verb!r} must be dot-separated tokens of letters, digits, '-' or '_'")
    return f"rlfleet.{cluster}.{tier}.{verb}"


def worker_subject(cluster: str, tier: str, worker_id: str) -> str:
    """The subject a single worker listens on for requests meant for it alone."""
    return subject(cluster, tier, f"worker.{worker_id}")


def membership_subject(cluster: str) -> str:
    """Where every tier publishes announce / heartbeat / leave messages."""
    return subject(cluster, "controller", "membership")
