"""The in-process transport: the Transport semantics without a server."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from rlfleet.common.control.inproc_transport import InProcessBroker, InProcessTransport, subject_matches
from rlfleet.common.control.messages import Ack, AnyMessage, ErrorReply, Message, Ping, Shutdown, decode
from rlfleet.common.control.transport import Handler, Transport
from rlfleet.common.errors import (
    WIRE_CODES,
    ConfigError,
    MessageTooLarge,
    NoResponders,
    RemoteError,
    RequestTimeout,
    TransportClosed,
    UserError,
)

pytestmark = pytest.mark.timeout(10)

SUBJECT = "rlfleet.test.rollout.echo"


@pytest.fixture
async def pair() -> AsyncIterator[tuple[InProcessTransport, InProcessTransport]]:
    """A client (controller tier) and a server (rollout tier) on one broker."""
    broker = InProcessBroker()
    client = InProcessTransport(broker, tier="controller", name="client")
    server = InProcessTransport(broker, tier="rollout", name="server")
    yield client, server
    await client.close()
    await server.close()


async def echo(message: AnyMessage) -> Message | None:
    return Ack(detail=f"got {message.kind}")


class Busy(RuntimeError):
    code = "quota_exceeded"
    retryable = True


class Odd(RuntimeError):
    code = "not-in-the-table"


def test_implements_the_protocol() -> None:
    assert isinstance(InProcessTransport(), Transport)


async def test_request_reply(pair: tuple[InProcessTransport, InProcessTransport]) -> None:
    client, server = pair
    await server.subscribe(SUBJECT, echo)
    reply = await client.request(SUBJECT, Ping(), timeout=1)
    assert reply == Ack(detail="got worker.ping")


async def test_queue_group_shares_load_and_plain_subscribers_see_all(
    pair: tuple[InProcessTransport, InProcessTransport],
) -> None:
    client, server = pair
    seen: Counter[str] = Counter()

    def member(name: str) -> Handler:
        async def handle(message: AnyMessage) -> Message:
            seen[name] += 1
            return Ack(detail=name)

        return handle

    await server.subscribe(SUBJECT, member("a"), queue="workers")
    await server.subscribe(SUBJECT, member("b"), queue="workers")
    await server.subscribe(SUBJECT, member("watcher"))
    for _ in range(10):
        await client.publish(SUBJECT, Ping())
    await asyncio.sleep(0.05)
    assert seen["a"] + seen["b"] == 10 and seen["a"] > 0 and seen["b"] > 0
    assert seen["watcher"] == 10


async def test_timeout_names_subject_and_tier(pair: tuple[InProcessTransport, InProcessTransport]) -> None:
    client, server = pair

    async def slow(message: AnyMessage) -> Message:
        await asyncio.sleep(5)
        return Ack()

    await server.subscribe(SUBJECT, slow)
    with pytest.raises(RequestTimeout) as info:
        await client.request(SUBJECT, Ping(), timeout=0.05)
    assert (info.value.subject, info.value.tier) == (SUBJECT, "rollout")
    assert SUBJECT in str(info.value) and "rollout" in str(info.value)
    with pytest.raises(RequestTimeout, match="reward tier"):
        await client.request(SUBJECT, Ping(), timeout=0.05, tier="reward")


async def test_error_reply_becomes_remote_error(pair: tuple[InProcessTransport, InProcessTransport]) -> None:
    client, server = pair

    async def refuse(message: AnyMessage) -> Message:
        return ErrorReply(tier="rollout", code="stale_weights", message="at version 3", retryable=True)

    await server.subscribe(SUBJECT, refuse)
    with pytest.raises(RemoteError) as info:
        await client.request(SUBJECT, Ping(), timeout=1)
    err = info.value
    assert (err.tier, err.code, err.remote_message, err.retryable) == (
        "rollout",
        "stale_weights",
        "at version 3",
        True,
    )


@pytest.mark.parametrize(
    ("exc", "code", "retryable"),
    [
        (ValueError("bad prompt"), "internal", False),
        (ConfigError("lr", -1, "must be > 0"), "bad_request", False),  # a user error
        (Busy("queue full"), "quota_exceeded", True),
        (Odd("?"), "internal", False),  # codes outside WIRE_CODES never travel
        (TimeoutError("engine slow"), "timeout", True),
        (RemoteError("reward", "forbidden", "no token", False), "forbidden", False),
    ],
)
async def test_handler_exception_becomes_error_reply(
    pair: tuple[InProcessTransport, InProcessTransport], exc: Exception, code: str, retryable: bool
) -> None:
    client, server = pair

    async def fail(message: AnyMessage) -> Message:
        raise exc

    await server.subscribe(SUBJECT, fail)
    with pytest.raises(RemoteError) as info:
        await client.request(SUBJECT, Ping(), timeout=1)
    assert (info.value.code, info.value.retryable, info.value.tier) == (code, retryable, "rollout")
    assert str(exc) in info.value.remote_message
    assert isinstance(info.value, UserError) == WIRE_CODES[code].user_error  # the requester's side knows


async def test_handler_failure_leaves_the_subscription_working(
    pair: tuple[InProcessTransport, InProcessTransport],
) -> None:
    client, server = pair

    async def picky(message: AnyMessage) -> Message:
        if isinstance(message, Shutdown):
            raise ValueError("no")
        return Ack()

    await server.subscribe(SUBJECT, picky)
    with pytest.raises(RemoteError):
        await client.request(SUBJECT, Shutdown(), timeout=1)
    assert await client.request(SUBJECT, Ping(), timeout=1) == Ack()


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"not json", "bad_message"),
        (json.dumps({"protocol": "3.0", "kind": "ack"}).encode(), "protocol_mismatch"),
    ],
)
async def test_undecodable_request_gets_error_reply(
    pair: tuple[InProcessTransport, InProcessTransport], data: bytes, code: str
) -> None:
    client, server = pair
    await server.subscribe(SUBJECT, echo)
    inbox, future = client.broker.open_inbox()
    assert client.broker.route(SUBJECT, data, inbox) == 1
    reply = decode(await asyncio.wait_for(future, 1))
    assert isinstance(reply, ErrorReply) and reply.code == code and reply.tier == "rollout"


async def test_no_responders(pair: tuple[InProcessTransport, InProcessTransport]) -> None:
    client, _ = pair
    with pytest.raises(NoResponders) as info:
        await client.request(SUBJECT, Ping(), timeout=1)
    assert info.value.subject == SUBJECT and info.value.tier == "rollout"


async def test_unsubscribe_stops_delivery(pair: tuple[InProcessTransport, InProcessTransport]) -> None:
    client, server = pair
    sub = await server.subscribe(SUBJECT, echo)
    await client.request(SUBJECT, Ping(), timeout=1)
    await sub.unsubscribe()
    with pytest.raises(NoResponders):
        await client.request(SUBJECT, Ping(), timeout=1)


@pytest.mark.parametrize(
    ("pattern", "subject", "matches"),
    [
        ("a.b.c", "a.b.c", True),
        ("a.*.c", "a.x.c", True),
        ("a.*.c", "a.x.y.c", False),
        ("a.>", "a.b", True),
        ("a.>", "a.b.c.d", True),
        ("a.>", "a", False),
        ("a.*", "a.b.c", False),
        ("a.b", "a.b.c", False),
        ("a.b.c", "a.b", False),
    ],
)
def test_subject_matching(pattern: str, subject: str, matches: bool) -> None:
    assert subject_matches(pattern, subject) is matches


async def test_wildcard_subscriptions_receive(pair: tuple[InProcessTransport, InProcessTransport]) -> None:
    client, server = pair
    got: list[str] = []

    async def record(message: AnyMessage) -> None:
        got.append(message.kind)

    await server.subscribe("rlfleet.test.*.echo", record)
    await server.subscribe("rlfleet.test.>", record)
    await server.subscribe("rlfleet.other.>", record)
    await client.publish(SUBJECT, Ping())
    await asyncio.sleep(0.02)
    assert got == ["worker.ping", "worker.ping"]


async def test_handlers_run_concurrently_unless_capped(
    pair: tuple[InProcessTransport, InProcessTransport],
) -> None:
    client, server = pair
    running, peak = 0, {"free": 0, "capped": 0}

    def tracked(name: str) -> Handler:
        async def handle(message: AnyMessage) -> Message:
            nonlocal running
            running += 1
            peak[name] = max(peak[name], running)
            await asyncio.sleep(0.05)
            running -= 1
            return Ack()

        return handle

    await server.subscribe(SUBJECT, tracked("free"))
    await asyncio.gather(*(client.request(SUBJECT, Ping(), timeout=1) for _ in range(4)))
    await server.close()
    server2 = InProcessTransport(client.broker, tier="rollout")
    await server2.subscribe(SUBJECT, tracked("capped"), max_concurrency=1)
    await asyncio.gather(*(client.request(SUBJECT, Ping(), timeout=1) for _ in range(3)))
    await server2.close()
    assert peak == {"free": 4, "capped": 1}


async def test_oversized_request_is_refused_before_sending(
    pair: tuple[InProcessTransport, InProcessTransport],
) -> None:
    client, server = pair
    calls: list[AnyMessage] = []

    async def record(message: AnyMessage) -> Message:
        calls.append(message)
        return Ack()

    await server.subscribe(SUBJECT, record)
    with pytest.raises(MessageTooLarge):
        await client.request(SUBJECT, Ack(detail="x" * (1 << 20)), timeout=1)
    with pytest.raises(MessageTooLarge):
        await client.publish(SUBJECT, Ack(detail="x" * (1 << 20)))
    await asyncio.sleep(0.02)
    assert calls == []


async def test_oversized_reply_becomes_too_large_error(
    pair: tuple[InProcessTransport, InProcessTransport],
) -> None:
    client, server = pair

    async def huge(message: AnyMessage) -> Message:
        return Ack(detail="x" * (1 << 20))

    await server.subscribe(SUBJECT, huge)
    with pytest.raises(RemoteError) as info:
        await client.request(SUBJECT, Ping(), timeout=1)
    assert info.value.code == "too_large"


async def test_closed_transport_refuses_use(pair: tuple[InProcessTransport, InProcessTransport]) -> None:
    client, _ = pair
    await client.close()
    with pytest.raises(TransportClosed):
        await client.publish(SUBJECT, Ping())
    with pytest.raises(TransportClosed):
        await client.subscribe(SUBJECT, echo)


async def test_bad_subjects_are_refused(pair: tuple[InProcessTransport, InProcessTransport]) -> None:
    client, _ = pair
    with pytest.raises(ValueError):
        await client.publish("rlfleet.*.x", Ping())
    with pytest.raises(ValueError):
        await client.subscribe("a..b", echo)
