"""Request headers on both transports (a real nats-server, and in-process): they reach the handler
of that request alone (``request_headers``), and bad names or values are refused before sending."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.inproc_transport import InProcessBroker, InProcessTransport
from rlfleet.common.control.messages import Ack, AnyMessage, Message, Ping
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import TOKEN_HEADER, Transport, request_headers

pytestmark = pytest.mark.timeout(30)

SUBJECT = "rlfleet.test.reward.whoami"


@pytest.fixture(params=["nats", "inproc"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Transport, Transport]]:
    if request.param == "inproc":
        broker = InProcessBroker()
        client, server = InProcessTransport(broker, name="client"), InProcessTransport(broker, name="server")
        yield client, server
        await client.close()
        await server.close()
        return
    with EmbeddedNats(jetstream=False) as nats:
        client = await NatsTransport.connect(nats.url, name="client", tier="controller")
        server = await NatsTransport.connect(nats.url, name="server", tier="reward")
        yield client, server
        await client.close()
        await server.close()


async def whoami(message: AnyMessage) -> Message:
    await asyncio.sleep(0.05)  # overlap the handlers: each must still see its own request's headers
    return Ack(detail=request_headers().get(TOKEN_HEADER, "<none>"))


async def test_headers_reach_the_handler_of_their_request(pair: tuple[Transport, Transport]) -> None:
    client, server = pair
    await server.subscribe(SUBJECT, whoami)
    tokens = [f"token-{i}" for i in range(8)]
    replies = await asyncio.gather(
        *(client.request(SUBJECT, Ping(), timeout=5, headers={TOKEN_HEADER: t}) for t in tokens)
    )
    assert [r.detail for r in replies] == tokens
    plain = await client.request(SUBJECT, Ping(), timeout=5)
    assert plain.detail == "<none>" and request_headers() == {}


@pytest.mark.parametrize(
    ("headers", "problem"),
    [
        ({"Bad Name": "x"}, "bad header name"),
        ({"A:B": "x"}, "bad header name"),
        ({TOKEN_HEADER: "two\r\nlines"}, "without line breaks"),
    ],  # fmt: skip
)
async def test_bad_headers_are_refused_before_sending(
    pair: tuple[Transport, Transport], headers: dict[str, str], problem: str
) -> None:
    client, server = pair
    await server.subscribe(SUBJECT, whoami)
    with pytest.raises(ValueError, match=problem):
        await client.request(SUBJECT, Ping(), timeout=5, headers=headers)
