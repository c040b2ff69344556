"""The control plane inside one process: a NATS-like broker and a :class:`Transport` on top of it.

:class:`InProcessBroker` plays the server: it routes subjects with ``*`` and ``>`` wildcards,
gives each message of a queue group to one member (round robin), answers "no responders" when
nobody listens and checks the payload limit. Several :class:`InProcessTransport` s share one
broker the way several clients share one nats-server. Messages still go through
``encode``/``decode``, so code tested here is tested against the wire format. It runs the
controller as a library and the unit tests without a server; it must live in one event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import defaultdict
from collections.abc import Mapping

from rlfleet.common.control.messages import MAX_MESSAGE_BYTES, AnyMessage, Message, decode
from rlfleet.common.control.transport import (
    Dispatcher,
    Handler,
    ReplyFn,
    Subscriptions,
    outgoing,
    raise_for_reply,
)
from rlfleet.common.errors import NoResponders, RequestTimeout, TransportClosed

logger = logging.getLogger(__name__)

_INBOX = "_INBOX"


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` falls under ``pattern`` (``*``: one token, final ``>``: one or more)."""
    want = pattern.split(".")
    have = subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


class InProcessSubscription:
    """One subscription on an :class:`InProcessBroker`: a queue of messages and a reader task."""

    def __init__(
        self, broker: InProcessBroker, subject: str, queue: str | None, dispatcher: Dispatcher
    ) -> None:
        self.subject = subject
        self.queue = queue
        self._broker = broker
        self._dispatcher = dispatcher
        self._inbox: asyncio.Queue[tuple[bytes, str | None, dict[str, str] | None]] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read(), name=f"inproc-sub:{subject}")
        self.active = True

    def put(self, data: bytes, reply: str | None, headers: dict[str, str] | None = None) -> None:
        """Queue a message for the handler (called by the broker)."""
        self._inbox.put_nowait((data, reply, headers))

    async def _read(self) -> None:
        while True:
            data, reply, headers = await self._inbox.get()
            await self._dispatcher.deliver(data, self._reply_fn(reply), headers)

    def _reply_fn(self, reply: str | None) -> ReplyFn | None:
        if reply is None:
            return None
        broker = self._broker

        async def send(payload: bytes) -> None:
            broker.route(reply, payload, None)

        return send

    async def unsubscribe(self, *, drain_timeout: float = 0.0) -> None:
        """Stop delivery; give running handlers ``drain_timeout`` s, then cancel them."""
        if not self.active:
            return
        self.active = False
        self._broker.remove(self)
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self._dispatcher.stop(drain_timeout)


class InProcessBroker:
    """Routes messages between the :class:`InProcessTransport` s that share it."""

    def __init__(self, *, max_payload: int = MAX_MESSAGE_BYTES) -> None:
        self.max_payload = max_payload
        self._subs: list[InProcessSubscription] = []
        self._replies: dict[str, asyncio.Future[bytes]] = {}
        self._turn: defaultdict[tuple[str, str], int] = defaultdict(int)
        self._ids = itertools.count()

    def add(self, sub: InProcessSubscription) -> None:
        """Start routing to ``sub``."""
        self._subs.append(sub)

    def remove(self, sub: InProcessSubscription) -> None:
        """Stop routing to ``sub``."""
        if sub in self._subs:
            self._subs.remove(sub)

    def open_inbox(self) -> tuple[str, asyncio.Future[bytes]]:
        """A fresh reply subject and the future its one reply will resolve."""
        inbox = f"{_INBOX}.{next(self._ids)}"
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._replies[inbox] = future
        return inbox, future

    def close_inbox(self, inbox: str) -> None:
        """Forget a reply subject; a late reply to it is dropped."""
        self._replies.pop(inbox, None)

    def route(
        self, subject: str, data: bytes, reply: str | None, headers: dict[str, str] | None = None
    ) -> int:
        """Deliver ``data`` to every plain subscriber and one member per queue group; return how many."""
        waiting = self._replies.get(subject)
        if waiting is not None:
            if not waiting.done():
                waiting.set_result(data)
            return 1
        groups: defaultdict[str, list[InProcessSubscription]] = defaultdict(list)
        delivered = 0
        for sub in self._subs:
            if not subject_matches(sub.subject, subject):
                continue
            if sub.queue:
                groups[sub.queue].append(sub)
            else:
                sub.put(data, reply, headers)
                delivered += 1
        for queue, members in groups.items():
            turn = self._turn[(subject, queue)]
            self._turn[(subject, queue)] = turn + 1
            members[turn % len(members)].put(data, reply, headers)
            delivered += 1
        return delivered


class InProcessTransport:
    """A :class:`~rlfleet.common.control.transport.Transport` on an :class:`InProcessBroker`."""

    def __init__(self, broker: InProcessBroker | None = None, *, tier: str = "", name: str = "") -> None:
        self.broker = broker if broker is not None else InProcessBroker()
        self.tier = tier
        self.name = name or "inproc"
        self._subs = Subscriptions()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"in-process transport {self.name!r}")

    async def request(
        self, subject: str, message: Message, *, timeout: float, tier: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> AnyMessage:  # fmt: skip
        """See :meth:`Transport.request`."""
        self._check_open()
        payload, sent_headers, tier = outgoing(subject, message, limit=self.broker.max_payload, tier=tier,
                                               headers=headers)  # fmt: skip
        inbox, future = self.broker.open_inbox()
        try:
            if self.broker.route(subject, payload, inbox, sent_headers) == 0:
                raise NoResponders(subject, tier)
            try:
                data = await asyncio.wait_for(future, timeout)
            except TimeoutError:
                raise RequestTimeout(subject, tier, timeout) from None
        finally:
            self.broker.close_inbox(inbox)
        return raise_for_reply(decode(data), tier)

    async def publish(self, subject: str, message: Message) -> None:
        """See :meth:`Transport.publish`."""
        self._check_open()
        self.broker.route(subject, outgoing(subject, message, limit=self.broker.max_payload).payload, None)

    async def subscribe(
        self,
        subject: str,
        handler: Handler,
        *,
        queue: str | None = None,
        max_concurrency: int | None = None,
    ) -> InProcessSubscription:
        """See :meth:`Transport.subscribe`."""
        self._check_open()
        dispatcher = Dispatcher(
            subject, handler, tier=self.tier, max_concurrency=max_concurrency, limit=self.broker.max_payload
        )
        sub = InProcessSubscription(self.broker, subject, queue, dispatcher)
        self.broker.add(sub)
        self._subs.add(sub)
        return sub

    async def flush(self) -> None:
        """Let queued deliveries start (there is no server to reach)."""
        self._check_open()
        await asyncio.sleep(0)

    async def close(self) -> None:
        """Unsubscribe everything; later calls raise :class:`TransportClosed`."""
        if self._closed:
            return
        self._closed = True
        await self._subs.end_all()

    async def __aenter__(self) -> InProcessTransport:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
