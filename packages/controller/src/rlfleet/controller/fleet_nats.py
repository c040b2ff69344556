"""The embedded run's own nats-server: how it is secured, and starting it again when it exits.

Every embedded run gets a private nats-server that takes only the run's generated credentials, one
per role, each allowed only its role's subjects (:mod:`rlfleet.common.control.nats_roles`).
:class:`NatsSecurity` holds the benchmark-only ways to run it otherwise (open, or with TLS too),
for ``benchmarks/security_overhead.py``.

Supervision (issue 12, point 4): a nats-server that exits (killed, crashed) is started again by
:func:`restart_nats` on the port it had, with the same generated configuration (the same
credentials and permissions, the same TLS files), so every client reconnects to the URL it knows
(the transport reconnects and sends again what nobody took; the registry does not count the
outage against anyone's heartbeats). Each restart counts against ``faults.restart_budget``, like a
worker's; past it, or when it cannot be started again, the run stops with
:class:`~rlfleet.controller.errors.TierNotRestarted` naming why. The server must be started from
the thread that keeps running (the run's main thread): it dies with the thread that forked it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.nats_roles import RunCredentials, server_config
from rlfleet.common.errors import ConfigError, NatsServerError
from rlfleet.controller.errors import TierDied, TierNotRestarted

logger = logging.getLogger(__name__)

NATS_ID = "nats-server"
"""The id the run's nats-server goes by in errors, restart counts and ``processes.json``."""

BENCHMARK_NATS_ENV = "RLFLEET_BENCHMARK_NATS"
"""Benchmark-only: ``open`` or ``tls:CERT_FILE,KEY_FILE`` (see :class:`NatsSecurity`)."""


@dataclass(frozen=True)
class NatsSecurity:
    """How an embedded run's nats-server is secured. Every run gets the default: a credential and
    permissions per role. The others exist only so that ``benchmarks/security_overhead.py`` can
    measure what security costs; no job-file setting reaches them, only the ``security`` argument
    or the ``RLFLEET_BENCHMARK_NATS`` variable of the controller's environment. ``open``: no
    credentials, no permissions (any local process may command the run). ``tls_cert`` and
    ``tls_key``: the default plus TLS; clients trust that certificate as their CA (self-signed)."""

    open: bool = False
    tls_cert: str = ""
    tls_key: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> NatsSecurity:
        """``RLFLEET_BENCHMARK_NATS`` of ``env``: unset (the default), ``open`` or ``tls:CERT,KEY``."""
        value = env.get(BENCHMARK_NATS_ENV, "").strip()
        if not value:
            return cls()
        if value == "open":
            return cls(open=True)
        cert, _, key = value.removeprefix("tls:").partition(",")
        if not value.startswith("tls:") or not cert or not key:
            raise ConfigError(
                BENCHMARK_NATS_ENV, value, "a benchmark-only switch: 'open' or 'tls:CERT_FILE,KEY_FILE'"
            )
        return cls(tls_cert=cert, tls_key=key)


def start_run_nats(
    security: NatsSecurity, cluster: str, *, jetstream: bool, host: str = "127.0.0.1"
) -> tuple[EmbeddedNats, RunCredentials | None]:
    """Start a run's nats-server on ``host`` with fresh credentials for ``cluster`` (``*``: any;
    none when open)."""
    credentials = None if security.open else RunCredentials.generate(cluster)
    config = server_config(credentials) if credentials is not None else ""
    nats = EmbeddedNats(jetstream=jetstream, config=config, host=host, tls_cert=security.tls_cert,
                        tls_key=security.tls_key)  # fmt: skip
    nats.start()
    logger.info("embedded nats-server pid %s at %s", nats.pid, nats.url)
    return nats, credentials


def nats_died(nats: EmbeddedNats) -> TierDied | None:
    """The death of the run's nats-server, or None while it runs."""
    code = nats.returncode
    if code is None:
        return None
    return TierDied("nats", NATS_ID, code, error=f"the run's own nats-server at {nats.url} is gone")


def restart_nats(nats: EmbeddedNats, died: TierDied, used: int, budget: int) -> int:
    """Start ``nats`` again on its port with the same configuration; returns the restarts used.

    Raises ``died`` when the budget is 0 (no supervision) and :class:`TierNotRestarted` when it is
    spent or the server does not come back (its port taken meanwhile, the binary gone...)."""
    if budget == 0:
        raise died
    if used >= budget:
        raise TierNotRestarted(died, f"its restart budget is spent ({used} of faults.restart_budget={budget} "
                               "restarts used)")  # fmt: skip
    url = nats.url
    logger.warning("%s; starting it again on the same port (restart %d of %d)", died, used + 1, budget)
    nats.stop(keep_port=True)
    try:
        nats.start()
    except NatsServerError as exc:
        raise TierNotRestarted(died, f"it could not be started again at {url}: {exc}") from exc
    logger.warning("embedded nats-server is back at %s (pid %d); clients reconnect", nats.url, nats.pid)
    return used + 1
