"""A NATS subscription of the control plane: its messages run through a :class:`Dispatcher`, its
replies go back on the message's reply subject, and it can be drained (nothing already sent is
dropped) before it ends."""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription

from rlfleet.common.control.transport import Dispatcher, ReplyFn

logger = logging.getLogger(__name__)


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
