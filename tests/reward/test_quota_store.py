"""The shared quota store on a real nats-server: compare-and-set reservations in a JetStream key-value bucket.

Several stores on their own NATS connections stand for the replicas of one reward server: however
many reservations race, no more succeed than the bucket holds; the bucket refills on the shared
clock; a key holding garbage is read as a full bucket and repaired. A NATS server without
JetStream is refused when the store opens; a NATS server that goes away refuses the request in
flight with a retryable error, and after it comes back (its memory bucket lost) the store makes the
bucket again.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.reward.errors import QuotaStoreMissing, QuotaStoreUnavailable
from rlfleet.reward.quota_store import SharedQuotas, quota_bucket, quota_key

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def connect(nats_server: EmbeddedNats) -> AsyncIterator:
    """``await connect(url=None)`` -> a NatsTransport (closed after the test)."""
    opened: list[NatsTransport] = []

    async def make(url: str | None = None) -> NatsTransport:
        transport = await NatsTransport.connect(url or nats_server.url, name=f"replica-{len(opened)}",
                                                reconnect_time_wait=0.05, reconnect_max_wait=0.2)  # fmt: skip
        opened.append(transport)
        return transport

    yield make
    for transport in opened:
        await transport.close()


def cluster() -> str:
    return f"q{uuid.uuid4().hex[:8]}"  # a bucket of its own for each test on the session's server


async def test_racing_replicas_never_take_more_than_the_bucket_holds(connect) -> None:
    name = cluster()
    replicas = [await SharedQuotas.open((await connect()).client, name) for _ in range(6)]
    takes = [replicas[i % 6].take("team.a", 0.001, 10.0) for i in range(120)]
    waits = await asyncio.gather(*takes)
    assert sum(w == 0.0 for w in waits) == 10
    assert all(w > 900 for w in waits if w), "the rest wait for a token at 0.001/s"
    assert await replicas[1].take("team-b", 0.001, 10.0) == 0.0, "another tenant has its own bucket"
    entry = await replicas[0].kv.get(quota_key("team.a"))
    assert quota_key("team.a") == "requests.team=a" and json.loads(entry.value)["tokens"] < 1.0
    status = await replicas[0].kv.status()
    assert status.values == 2, "one revision per key: team.a and team-b"


async def test_the_bucket_refills_on_the_clock_whichever_replica_asks(connect) -> None:
    name, clock = cluster(), Clock()
    one = await SharedQuotas.open((await connect()).client, name)
    two = await SharedQuotas.open((await connect()).client, name)
    one.clock = two.clock = clock
    assert [await one.take("t", 1.0, 2.0), await two.take("t", 1.0, 2.0)] == [0.0, 0.0]
    assert await one.take("t", 1.0, 2.0) == pytest.approx(1.0)
    clock.now += 0.5
    assert await two.take("t", 1.0, 2.0) == pytest.approx(0.5)
    clock.now += 60  # refills up to the burst only
    assert [await one.take("t", 1.0, 2.0) == 0.0 for _ in range(3)] == [True, True, False]


async def test_a_key_holding_garbage_is_read_as_a_full_bucket_and_repaired(connect) -> None:
    store = await SharedQuotas.open((await connect()).client, cluster())
    for junk in (b"not json", b'{"tokens": "NaN", "at": 1}', b"[1, 2]", b"x" * 4096):
        await store.kv.put(quota_key("t"), junk)
        assert await store.take("t", 0.001, 3.0) == 0.0
        state = json.loads((await store.kv.get(quota_key("t"))).value)
        assert state["tokens"] == pytest.approx(2.0)


async def test_a_nats_server_without_jetstream_is_refused_when_the_store_opens() -> None:
    with EmbeddedNats(jetstream=False) as plain:
        transport = await NatsTransport.connect(plain.url, name="replica")
        try:
            with pytest.raises(QuotaStoreMissing) as missing:
                await SharedQuotas.open(transport.client, "shared")
        finally:
            await transport.close()
    text = str(missing.value)
    assert "no JetStream" in text and "rlfleet-quotas-shared" in text and "quota_store: process" in text


async def test_a_lost_nats_server_refuses_the_request_then_the_bucket_is_made_again(connect) -> None:
    first = EmbeddedNats().start()
    port = first.port
    try:
        store = await SharedQuotas.open((await connect(first.url)).client, "shared", timeout=0.5)
        assert await store.take("t", 0.001, 2.0) == 0.0
        assert await store.take("t", 0.001, 2.0) == 0.0
        first.stop()
        with pytest.raises(QuotaStoreUnavailable) as lost:
            await store.take("t", 0.001, 2.0)
        assert lost.value.code == "unavailable" and lost.value.retryable
        assert quota_bucket("shared") in str(lost.value)
        again = EmbeddedNats(port=port).start()  # memory storage: the bucket is gone with the old server
        waited: float | None = None
        try:
            for _ in range(100):  # the client reconnects within a few backoff waits
                try:
                    waited = await store.take("t", 0.001, 2.0)
                    break
                except QuotaStoreUnavailable:
                    await asyncio.sleep(0.1)
            assert waited == 0.0, "made again, full"
            assert (await store.kv.get(quota_key("t"))).value
        finally:
            again.stop()
    finally:
        first.stop()
