"""The control plane over a real NATS server: :class:`NatsTransport`, built on nats-py.

The client reconnects forever by default, waiting ``reconnect_time_wait`` doubled on each failed
attempt up to ``reconnect_max_wait``, with random jitter so that a fleet of workers does not
reconnect in lock step after a server restart. Subscriptions survive a reconnect (nats-py replays
them), and what is published while the connection is down waits in the client's buffer.

Outages (issue 12): ``url`` may name several servers, the nodes of one NATS cluster
(``nats://a:4222,nats://b:4222``), and the client fails over between them. A reply sent while the
asker was cut off is lost, so a request that is safe to repeat (it carries a ``job_id``, which the
worker answers once, or is idempotent by what it says) is sent again as soon as the connection
returns, within the same deadline (:func:`resendable`); a request nobody took within
:data:`REJOIN_S` of a reconnect is sent again until a peer is back. A connection down for longer
than ``outage_grace_s`` fails the requests waiting on it with :class:`NatsServerError`, which
names the servers and how long; closing it then does not raise.

Each subscription (:class:`NatsSubscriptionHandle`) runs its messages through a
:class:`~rlfleet.common.control.transport.Dispatcher`, sends replies back on the message's reply
subject, and can be drained (nothing already sent is dropped) before it ends.

Credentials and TLS come from a :class:`~rlfleet.common.schema.connection.NatsConnection` (its
unset fields from ``RLFLEET_NATS_*``); URLs are logged and reported with their credentials masked.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client, Server
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription

from rlfleet.common.control.messages import MAX_MESSAGE_BYTES, AnyMessage, Message, decode
from rlfleet.common.control.transport import (
    Dispatcher,
    Handler,
    ReplyFn,
    Subscriptions,
    outgoing,
    raise_for_reply,
)
from rlfleet.common.errors import NatsServerError, NoResponders, RequestTimeout, TransportClosed
from rlfleet.common.schema.connection import NatsConnection, mask_url, server_urls

logger = logging.getLogger(__name__)

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


def _is_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is the server refusing the client's credentials."""
    text = f"{type(exc).__name__} {exc}".lower()
    return "authorization" in text or "authentication" in text


def _masked(exc: BaseException) -> str:
    """``repr(exc)`` with any URL credentials in it hidden."""
    return " ".join(mask_url(word) if "://" in word else word for word in repr(exc).split(" "))


class NatsTransport:
    """A :class:`~rlfleet.common.control.transport.Transport` over a nats-server."""

    def __init__(
        self, client: Client, *, tier: str = "", name: str = "", outage_grace_s: float | None = None
    ) -> None:
        if outage_grace_s is not None and outage_grace_s <= 0:
            raise ValueError(f"outage_grace_s must be > 0 s (or None: no limit), got {outage_grace_s}")
        self.client = client
        self.tier = tier
        self.name = name
        self.outage_grace_s = outage_grace_s
        self.drops = 0
        """How many times the connection was lost (each outage counts once)."""
        self._down_since: float | None = None  # time.monotonic() of the current outage's start
        self._back_at = -float("inf")  # time.monotonic() of the last reconnect
        self._servers = ""
        self._subs = Subscriptions()
        self._closed = False
        self._refusal: Exception | None = None  # the server's "Authorization Violation" while connecting
        self._refused = asyncio.Event()

    @classmethod
    async def connect(
        cls,
        url: str | Sequence[str],
        *,
        name: str,
        connect_timeout: float = 5.0,
        max_reconnect_attempts: int = -1,
        reconnect_time_wait: float = 0.25,
        reconnect_max_wait: float = 5.0,
        reconnect_jitter: float = 0.25,
        tier: str = "",
        auth: NatsConnection | None = None,
        env: Mapping[str, str] | None = None,
        outage_grace_s: float | None = None,
    ) -> NatsTransport:
        """Connect to ``url`` (or any of several) within ``connect_timeout`` s, with ``auth``'s
        credentials and TLS (None: only what ``RLFLEET_NATS_*`` says; unset fields are read there, or
        in ``env`` when given: ``{}`` for a connection that must not take anything from the shell).

        After a disconnect it retries ``max_reconnect_attempts`` times per server (-1: forever),
        with exponential backoff from ``reconnect_time_wait`` to ``reconnect_max_wait`` s and
        ``reconnect_jitter`` (a fraction) of randomness. ``url`` may be several servers
        (comma-separated or a list: the nodes of a cluster); the client fails over between them.
        Requests waiting on a connection down for over ``outage_grace_s`` s fail (None: they wait
        for their own deadline). Raises :class:`NatsServerError` when the first connection does
        not succeed in time.
        """
        servers = server_urls(url)
        shown = ", ".join(mask_url(s) for s in servers)
        secure = (auth or NatsConnection()).resolved(env).connect_options()
        transport = cls(nats.NATS(), tier=tier, name=name, outage_grace_s=outage_grace_s)
        transport._servers = shown
        rng = random.Random()

        def choose(pool: list[Server], info: dict[str, Any]) -> tuple[Server | None, float]:
            server = min(pool, key=lambda s: s.reconnects)
            wait = backoff_delay(
                server.reconnects, reconnect_time_wait, reconnect_max_wait, reconnect_jitter, rng
            )
            return server, wait

        options: dict[str, Any] = dict(
            servers=servers,
            name=name,
            connect_timeout=connect_timeout,
            max_reconnect_attempts=max_reconnect_attempts,
            reconnect_time_wait=reconnect_time_wait,
            reconnect_to_server_handler=choose,
            error_cb=transport._on_error,
            disconnected_cb=transport._on_disconnected,
            reconnected_cb=transport._on_reconnected,
            closed_cb=transport._on_closed,
            **secure,
        )
        try:
            await transport._first_connect(options, connect_timeout)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            await transport.client.close()
            exc = transport._refusal or exc
            refused = transport._refusal is not None or _is_refusal(exc)
            hint = ("the server refused these credentials; check nats_auth / RLFLEET_NATS_*" if refused
                    else "is nats-server running there?")  # fmt: skip
            raise NatsServerError(
                f"cannot connect to NATS at {shown} within {connect_timeout:g}s ({_masked(exc)}); {hint}"
            ) from None
        logger.info("%s connected to NATS at %s", name, transport._url())
        return transport

    async def _first_connect(self, options: dict[str, Any], timeout: float) -> None:
        """``client.connect``, given up at once when the server refuses the credentials (nats-py
        would retry them until the timeout)."""
        self._refused = asyncio.Event()
        connecting = asyncio.ensure_future(self.client.connect(**options))
        refused = asyncio.ensure_future(self._refused.wait())
        try:
            done, _ = await asyncio.wait({connecting, refused}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        finally:
            refused.cancel()
        if connecting in done:
            connecting.result()
            return
        connecting.cancel()
        await asyncio.gather(connecting, return_exceptions=True)
        raise self._refusal or TimeoutError()

    def _url(self) -> str:
        url = self.client.connected_url
        return mask_url(url.geturl()) if url is not None else "?"

    async def _on_error(self, exc: Exception) -> None:
        if not self.client.is_connected and _is_refusal(exc) and self._refusal is None:
            self._refusal = exc
            self._refused.set()
        if self.client.is_reconnecting or self.client.is_connecting:
            logger.debug("%s: NATS connection attempt failed: %s", self.name, _masked(exc))
        else:
            logger.warning("%s: NATS error: %s", self.name, _masked(exc))

    async def _on_disconnected(self) -> None:
        if self._down_since is None:
            self.drops += 1
            self._down_since = time.monotonic()
        if not self._closed:
            logger.warning("%s: disconnected from NATS; reconnecting", self.name)

    async def _on_reconnected(self) -> None:
        down = self.down_for
        self._down_since = None
        self._back_at = time.monotonic()
        logger.info("%s: reconnected to NATS at %s after %.1fs", self.name, self._url(), down)

    async def _on_closed(self) -> None:
        logger.info("%s: NATS connection closed", self.name)

    @property
    def is_connected(self) -> bool:
        """Whether the client holds a live connection right now."""
        return self.client.is_connected

    @property
    def down_for(self) -> float:
        """Seconds the connection has been lost for (0.0 while it is up)."""
        since = self._down_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def max_payload(self) -> int:
        """The size limit of a message: the server's ``max_payload`` or 1 MiB, the smaller."""
        server = self.client.max_payload
        return min(MAX_MESSAGE_BYTES, server) if server else MAX_MESSAGE_BYTES

    def _check_open(self) -> None:
        if self._closed or self.client.is_closed:
            raise TransportClosed(f"NATS transport {self.name!r}")

    async def request(
        self, subject: str, message: Message, *, timeout: float, tier: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> AnyMessage:  # fmt: skip
        """See :meth:`Transport.request`.

        A :func:`resendable` request whose connection dropped and came back while it waited is
        sent again (its reply may have been lost), within the same ``timeout``; any request
        nobody took within :data:`REJOIN_S` of a reconnect is sent again until somebody does.
        """
        self._check_open()
        payload, sent_headers, tier = outgoing(subject, message, limit=self.max_payload, tier=tier,
                                               headers=headers)  # fmt: skip
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        again = resendable(message)
        while True:
            drops, left = self.drops, deadline - loop.time()
            if left <= 0:
                raise RequestTimeout(subject, tier, timeout)
            attempt = asyncio.ensure_future(self.client.request(subject, payload, timeout=left,
                                                                headers=sent_headers))  # fmt: skip
            try:
                lost = await self._wait_reply(attempt, drops if again else None, subject, tier)
            finally:
                if not attempt.done():
                    attempt.cancel()
                    await asyncio.gather(attempt, return_exceptions=True)
            if not lost and not self._rejoining(attempt):
                break
            if not lost:
                await asyncio.sleep(POLL_S)  # nobody took it: the peers are still reconnecting
                continue
            logger.warning("%s: NATS connection came back; sending %s on %s again (its reply may be lost)",
                           self.name, message.kind, subject)  # fmt: skip
        try:
            msg = attempt.result()
        except nats.errors.NoRespondersError:
            raise NoResponders(subject, tier) from None
        except nats.errors.TimeoutError:
            raise RequestTimeout(subject, tier, timeout) from None
        except nats.errors.ConnectionClosedError:
            raise TransportClosed(f"NATS transport {self.name!r}") from None
        except nats.errors.OutboundBufferLimitError:
            raise ConnectionError(f"request on {subject!r} not sent: the NATS connection is down and "
                                  "its send buffer is full") from None  # fmt: skip
        return raise_for_reply(decode(msg.data), tier)

    def _rejoining(self, attempt: asyncio.Future[Msg]) -> bool:
        """Whether ``attempt`` found no responders within :data:`REJOIN_S` of a reconnect."""
        if attempt.cancelled() or not isinstance(attempt.exception(), nats.errors.NoRespondersError):
            return False
        return time.monotonic() - self._back_at < REJOIN_S

    async def _wait_reply(
        self, attempt: asyncio.Future[Msg], drops: int | None, subject: str, tier: str
    ) -> bool:
        """Wait for ``attempt``; True when it should be sent again: ``drops`` is not None and the
        connection dropped since (``self.drops > drops``) and is back.

        Raises :class:`NatsServerError` when the connection stays down past ``outage_grace_s``.
        """
        while True:
            done, _ = await asyncio.wait({attempt}, timeout=POLL_S)
            if done:
                return False
            grace = self.outage_grace_s
            if grace is not None and self.down_for > grace:
                raise NatsServerError(
                    f"{self.name}: the NATS connection to {self._servers or self._url()} has been down for "
                    f"{self.down_for:.0f}s (outage_grace_s {grace:g}); a request on {subject!r} to the "
                    f"{tier or 'remote'} tier cannot be answered. Is nats-server running?"
                )
            if drops is not None and self.drops > drops and self.client.is_connected:
                return True

    async def publish(self, subject: str, message: Message) -> None:
        """See :meth:`Transport.publish`."""
        self._check_open()
        payload = outgoing(subject, message, limit=self.max_payload).payload
        try:
            await self.client.publish(subject, payload)
        except nats.errors.ConnectionClosedError:
            raise TransportClosed(f"NATS transport {self.name!r}") from None
        except nats.errors.OutboundBufferLimitError:
            raise ConnectionError(f"{message.kind} on {subject!r} not sent: the NATS connection is down "
                                  "and its send buffer is full") from None  # fmt: skip

    async def subscribe(
        self,
        subject: str,
        handler: Handler,
        *,
        queue: str | None = None,
        max_concurrency: int | None = None,
    ) -> NatsSubscriptionHandle:
        """See :meth:`Transport.subscribe`."""
        self._check_open()
        dispatcher = Dispatcher(
            subject, handler, tier=self.tier, max_concurrency=max_concurrency, limit=self.max_payload
        )
        sub = NatsSubscriptionHandle(self.client, subject, queue, dispatcher)
        await sub.start()
        self._subs.add(sub)
        if self.client.is_connected:
            await self.flush()  # the subscription is live on the server when this returns
        return sub

    async def flush(self, timeout: float = 5.0) -> None:
        """Round trip to the server: everything sent before has reached it."""
        self._check_open()
        # nats-py (2.16) writes the PING of flush() straight to the socket while earlier commands
        # may still sit in its pending buffer, so the PONG can come back before a SUB or PUB sent
        # earlier has reached the server. Push the buffer out first.
        await self.client._flush_pending(force_flush=True)
        try:
            await self.client.flush(timeout=timeout)
        except nats.errors.TimeoutError:
            raise RequestTimeout("<flush>", "nats-server", timeout) from None

    async def close(self) -> None:
        """Unsubscribe everything, stop handlers and close the connection."""
        if self._closed:
            return
        self._closed = True
        await self._subs.end_all()
        if not self.client.is_closed:
            try:
                await self.client.close()
            except ConnectionError as exc:  # the server is gone (an outage): nothing is left to flush to
                logger.info("%s: NATS connection closed, the server unreachable (%r)", self.name, exc)

    async def __aenter__(self) -> NatsTransport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class NatsSubscriptionHandle:
    """A NATS subscription whose messages run through a :class:`Dispatcher`."""

    def __init__(self, client: Client, subject: str, queue: str | None, dispatcher: Dispatcher) -> None:
        self.subject = subject
        self.queue = queue
        self.active = True
        self._client = client
        self._dispatcher = dispatcher
        self._sub: NatsSubscription | None = None

    async def start(self) -> None:
        """Subscribe on the server."""
        self._sub = await self._client.subscribe(self.subject, queue=self.queue or "", cb=self._on_msg)

    async def _on_msg(self, msg: Msg) -> None:
        # nats-py awaits this callback before the next message of the subscription, so waiting
        # for a free handler slot here holds later messages back in arrival order.
        await self._dispatcher.deliver(msg.data, self._reply_fn(msg.reply), msg.headers)

    def _reply_fn(self, reply: str) -> ReplyFn | None:
        if not reply:
            return None
        client = self._client

        async def send(payload: bytes) -> None:
            try:
                await client.publish(reply, payload)
            except (nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError) as exc:
                raise ConnectionError(f"reply to {reply!r} not sent: {exc!r}") from exc

        return send

    async def unsubscribe(self, *, drain_timeout: float = 0.0) -> None:
        """Stop delivery; give running handlers ``drain_timeout`` s, then cancel them.

        With a ``drain_timeout`` the subscription is drained: the server stops sending at once and
        the messages it had sent already still reach the handler (none is dropped), within the bound.
        """
        if not self.active:
            return
        self.active = False
        deadline = time.monotonic() + drain_timeout
        if self._sub is not None and not self._client.is_closed:
            try:
                if drain_timeout > 0:
                    await asyncio.wait_for(self._sub.drain(), drain_timeout)
                else:
                    await self._sub.unsubscribe()
            except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError,
                    nats.errors.ConnectionDrainingError, TimeoutError) as exc:  # fmt: skip
                logger.debug("unsubscribe %s: %r", self.subject, exc)
        await self._dispatcher.stop(max(0.0, deadline - time.monotonic()))
