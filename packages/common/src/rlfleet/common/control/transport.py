"""The control-plane seam: one :class:`Transport` protocol, a NATS and an in-process implementation.

Both implementations share the handler semantics defined here. A subscription's handler gets a
decoded message (:func:`rlfleet.common.control.messages.decode`) and may return a reply. Bytes that do not
decode, and exceptions the handler raises, become an :class:`ErrorReply` to the requester (and a
log line); :func:`error_reply` is the one place where exceptions map to wire error codes and
:func:`raise_for_reply` the one place where an ``ErrorReply`` turns back into a :class:`RemoteError`.
Handlers run as tasks of their own, at most ``max_concurrency`` at once per subscription; past
that, messages wait in arrival order.

Headers: a request may carry string headers beside its body (NATS headers; credentials such as
the reward tier's :data:`TOKEN_HEADER` travel there, not in the message). A handler reads the
headers of the message it is answering with :func:`request_headers`.

Subjects are built here too, in one place (:func:`subject`, :func:`worker_subject`,
:func:`membership_subject`, :func:`ping_subject`): ``rlfleet.<cluster>.<tier>.<verb>``. Each
tier's membership messages have a subject of their own, so a server that lets each role publish
only its own subjects (:mod:`rlfleet.common.control.nats_roles`) keeps one tier from announcing
itself as another.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import re
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import NamedTuple, Protocol, runtime_checkable

from rlfleet.common.control.messages import MAX_MESSAGE_BYTES, AnyMessage, ErrorReply, Message, decode, encode
from rlfleet.common.errors import (
    MessageDecodeError,
    MessageTooLarge,
    ProtocolMismatch,
    remote_error,
    wire_code,
)

logger = logging.getLogger(__name__)

Handler = Callable[[AnyMessage], Awaitable[Message | None]]
"""What a subscription runs on each message; a returned message is the reply to a request."""


class RefusingHandler:
    """A handler that also hears of each message its subscription refused for speaking another MAJOR
    wire version (``on_refused``, given the :class:`ProtocolMismatch` with its ``sender``); the
    membership registry names such workers this way (:mod:`rlfleet.common.control.membership`)."""

    def __init__(self, handle: Handler, on_refused: Callable[[ProtocolMismatch], Awaitable[None]]) -> None:
        self.handle, self.on_refused = handle, on_refused

    async def __call__(self, message: AnyMessage) -> Message | None:
        return await self.handle(message)


ReplyFn = Callable[[bytes], Awaitable[None]]
"""Sends encoded reply bytes back to whoever made the request."""

_TOKEN = re.compile(r"^[^\s.*>]+$")
_HEADER_NAME = re.compile(r"^[!-9;-~]+$")  # printable ASCII without ':' or spaces (RFC 7230 field names)

TOKEN_HEADER = "Rlfleet-Token"
"""The header a request's credential travels in (the reward tier's tenant and admin tokens)."""
TOKEN_ENV = "RLFLEET_REWARD_TOKEN"
"""The variable a process reads its reward-tier tenant token from when its config gives none."""
REWARD_NATS_ENV_PREFIX = "RLFLEET_REWARD_NATS_"
"""The prefix of the variables holding the login to a shared reward server's NATS (``<prefix>TOKEN``, ...)."""

_HEADERS: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "rlfleet_headers", default=None
)


def request_headers() -> Mapping[str, str]:
    """The headers of the message the running handler answers (empty outside a handler)."""
    return _HEADERS.get() or {}


def check_headers(headers: Mapping[str, str] | None) -> dict[str, str] | None:
    """``headers`` as a plain dict, or ``ValueError`` naming a bad name or value (None/empty: None)."""
    if not headers:
        return None
    for name, value in headers.items():
        if not isinstance(name, str) or not _HEADER_NAME.match(name):
            raise ValueError(f"bad header name {name!r}: printable ASCII without ':' or spaces")
        if not isinstance(value, str) or any(c in value for c in "\r\n\0"):
            raise ValueError(f"bad value for header {name!r}: a string without line breaks")
    return dict(headers)


@runtime_checkable
class Subscription(Protocol):
    """A live subscription; ``unsubscribe`` stops delivery and ends the handler tasks."""

    subject: str
    queue: str | None
    active: bool
    """False once unsubscribed."""

    async def unsubscribe(self, *, drain_timeout: float = 0.0) -> None:
        """Stop delivery; give running handlers ``drain_timeout`` s to finish, then cancel them."""
        ...


class Subscriptions:
    """A transport's live subscriptions, all ended when it closes."""

    def __init__(self) -> None:
        self._live: list[Subscription] = []

    def add(self, sub: Subscription) -> None:
        """Keep ``sub`` (and let go of those already unsubscribed)."""
        self._live = [s for s in self._live if s.active]
        self._live.append(sub)

    def __iter__(self) -> Iterator[Subscription]:
        return iter(list(self._live))

    async def end_all(self) -> None:
        """Unsubscribe every one of them."""
        live, self._live = self._live, []
        for sub in live:
            await sub.unsubscribe()


@runtime_checkable
class Transport(Protocol):
    """Typed request/reply, publish and queue-group subscriptions over the control plane."""

    tier: str

    async def request(
        self, subject: str, message: Message, *, timeout: float, tier: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> AnyMessage:  # fmt: skip
        """Send ``message`` (with ``headers``) and wait for one reply.

        Raises :class:`RequestTimeout` (naming ``subject`` and ``tier``) when none comes in
        ``timeout`` s, :class:`NoResponders` when nobody listens on ``subject``,
        :class:`RemoteError` when the reply is an :class:`ErrorReply`, and
        :class:`MessageTooLarge` before sending a message over the size limit. An empty
        ``tier`` is read from the subject (``rlfleet.<cluster>.<tier>.<verb>``).
        """
        ...

    async def publish(self, subject: str, message: Message) -> None:
        """Send ``message`` to every subscriber (one per queue group); no reply."""
        ...

    async def subscribe(
        self,
        subject: str,
        handler: Handler,
        *,
        queue: str | None = None,
        max_concurrency: int | None = None,
    ) -> Subscription:
        """Run ``handler`` on each message on ``subject`` (``*`` / ``>`` wildcards allowed).

        Subscribers that share a ``queue`` name split the messages: each goes to one of them.
        ``max_concurrency`` caps the handler tasks running at once (``None``: no cap; use 1 to
        keep arrival order).
        """
        ...

    async def flush(self) -> None:
        """Return once everything sent so far has reached the server."""
        ...

    async def close(self) -> None:
        """Unsubscribe everything and disconnect; later calls raise :class:`TransportClosed`."""
        ...


def check_subject(subject: str, *, wildcards: bool) -> None:
    """Raise ``ValueError`` unless ``subject`` is dot-separated NATS tokens.

    ``*`` (one token) and a final ``>`` (one or more tokens) are allowed only when ``wildcards``.
    """
    tokens = subject.split(".") if subject else [""]
    for i, token in enumerate(tokens):
        if wildcards and (token == "*" or (token == ">" and i == len(tokens) - 1)):
            continue
        if not _TOKEN.match(token):
            what = "subscription subject" if wildcards else "subject (no wildcards when sending)"
            raise ValueError(f"bad {what} {subject!r}: token {i} is {token!r}")


def tier_of(subject: str) -> str:
    """The tier named by an ``rlfleet.<cluster>.<tier>.<verb>`` subject, or ``""``."""
    parts = subject.split(".")
    return parts[2] if len(parts) >= 4 and parts[0] == "rlfleet" else ""


class Outgoing(NamedTuple):
    """A request or publish, checked and encoded, as a transport sends it."""

    payload: bytes
    headers: dict[str, str] | None
    tier: str


def outgoing(
    subject: str, message: Message, *, limit: int, tier: str = "", headers: Mapping[str, str] | None = None
) -> Outgoing:
    """What both transports send: ``subject`` checked (no wildcards), ``headers`` checked, the tier
    that answers (``tier``, else the subject's, else ``"unknown"``) and ``message`` encoded within
    ``limit`` (:class:`MessageTooLarge` past it)."""
    check_subject(subject, wildcards=False)
    checked = check_headers(headers)
    return Outgoing(encode(message, limit=limit), checked, tier or tier_of(subject) or "unknown")


def error_reply(exc: BaseException, tier: str) -> ErrorReply:
    """The :class:`ErrorReply` that tells a requester about ``exc``."""
    code, retryable = wire_code(exc)
    text = str(exc) or exc.__class__.__name__
    after = getattr(exc, "retry_after_s", 0.0)
    after = float(after) if retryable and isinstance(after, int | float) and math.isfinite(after) else 0.0
    return ErrorReply(tier=tier, code=code, message=f"{exc.__class__.__name__}: {text}", retryable=retryable,
                      retry_after_s=min(max(after, 0.0), 3600.0))  # fmt: skip


def raise_for_reply(reply: AnyMessage, tier: str) -> AnyMessage:
    """Return ``reply``, or raise :class:`RemoteError` if it is an :class:`ErrorReply`."""
    if isinstance(reply, ErrorReply):
        where = reply.tier or tier
        raise remote_error(where, reply.code, reply.message, reply.retryable, reply.retry_after_s)
    return reply


class Dispatcher:
    """Runs one subscription's handler: decode, call, reply, map failures to ErrorReply.

    ``subject`` is the subscription's (``*`` / ``>`` wildcards allowed; ``ValueError`` otherwise).
    """

    def __init__(
        self,
        subject: str,
        handler: Handler,
        *,
        tier: str,
        max_concurrency: int | None = None,
        limit: int = MAX_MESSAGE_BYTES,
    ) -> None:
        check_subject(subject, wildcards=True)
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")
        self.subject = subject
        self.handler = handler
        self.tier = tier
        self.limit = limit
        self._slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> int:
        """Handler tasks in flight."""
        return len(self._tasks)

    async def deliver(
        self, data: bytes, reply: ReplyFn | None, headers: Mapping[str, str] | None = None
    ) -> None:
        """Start the handler on ``data``; waits first while ``max_concurrency`` tasks are running."""
        if self._slots is not None:
            await self._slots.acquire()
        context = contextvars.copy_context()
        context.run(_HEADERS.set, dict(headers or {}))  # what request_headers() returns in the task
        task = asyncio.create_task(self._run(data, reply), name=f"handler:{self.subject}", context=context)
        self._tasks.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if self._slots is not None:
            self._slots.release()

    async def stop(self, drain_timeout: float = 0.0) -> None:
        """Wait up to ``drain_timeout`` s for running handlers, then cancel what is left."""
        tasks = set(self._tasks)
        if not tasks:
            return
        if drain_timeout > 0:
            _, tasks = await asyncio.wait(tasks, timeout=drain_timeout)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, data: bytes, reply: ReplyFn | None) -> None:
        answer = await self._answer(data, expects_reply=reply is not None)
        if answer is None or reply is None:
            if answer is not None and not isinstance(answer, ErrorReply):
                logger.debug(
                    "%s: handler returned %s to a message without reply subject", self.subject, answer
                )
            return
        try:
            payload = encode(answer, limit=self.limit)
        except MessageTooLarge as exc:
            logger.error("%s: reply dropped: %s", self.subject, exc)
            payload = encode(error_reply(exc, self.tier))
        try:
            await reply(payload)
        except (ConnectionError, OSError, RuntimeError) as exc:
            # The requester or the connection is gone; nothing else to tell anyone.
            logger.warning("%s: could not send reply: %s", self.subject, exc)

    async def _answer(self, data: bytes, *, expects_reply: bool) -> Message | None:
        try:
            message = decode(data)
        except (MessageDecodeError, ProtocolMismatch) as exc:
            logger.warning("%s: refused a message: %s", self.subject, exc)
            if isinstance(exc, ProtocolMismatch) and isinstance(self.handler, RefusingHandler):
                await self.handler.on_refused(exc)
            return error_reply(exc, self.tier)
        try:
            return await self.handler(message)
        except Exception as exc:  # noqa: BLE001 - the subscription boundary: every failure becomes a reply
            reply = error_reply(exc, self.tier)
            internal = reply.code == "internal"
            logger.log(
                logging.ERROR if internal else logging.WARNING,
                "%s: handler failed on %s with %s%s: %s",
                self.subject,
                getattr(message, "kind", "?"),
                reply.code,
                "" if expects_reply else " (published, no one to tell)",
                exc,
                exc_info=exc if internal else None,
            )
            return reply


# --- subject names: rlfleet.<cluster>.<tier>.<verb>, built in one place -------------------------

_NAME_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
_VERB = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


def subject(cluster: str, tier: str, verb: str) -> str:
    """The subject for ``verb`` on ``tier`` in ``cluster``.

    ``cluster`` and ``tier`` are single NATS tokens; ``verb`` may hold dots (``worker.w1``) or
    be ``*``/``>`` wildcards for subscriptions.
    """
    for name, value in (("cluster", cluster), ("tier", tier)):
        if not _NAME_TOKEN.match(value):
            raise ValueError(f"{name} {value!r} must be letters, digits, '-' or '_' (one NATS token)")
    if verb not in ("*", ">") and not _VERB.match(verb):
        raise ValueError(f"verb {verb!r} must be dot-separated tokens of letters, digits, '-' or '_'")
    return f"rlfleet.{cluster}.{tier}.{verb}"


def worker_subject(cluster: str, tier: str, worker_id: str) -> str:
    """The subject a single worker listens on for requests meant for it alone."""
    return subject(cluster, tier, f"worker.{worker_id}")


def episode_subject(cluster: str, worker_id: str) -> str:
    """Where the reward worker ``worker_id`` takes the steps and closes of the episodes it holds (issue
    33): a subject of their own, so that a rollout worker may send them without being able to send a
    reward worker anything else (its own subject takes spec swaps and shutdowns)."""
    return subject(cluster, "env", f"episode.{worker_id}")


WORKER_TIERS = ("rollout", "reward", "trainer")
"""The tiers whose workers announce themselves."""


def membership_subject(cluster: str, tier: str) -> str:
    """Where ``tier``'s workers publish announce / heartbeat / leave messages (and only they may)."""
    return subject(cluster, tier, "membership")


def ping_subject(cluster: str) -> str:
    """Where a controller (or admin) asks every worker to announce itself again."""
    return subject(cluster, "controller", "ping")
