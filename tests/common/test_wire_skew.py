"""Wire version skew on a real nats-server: a worker of another MAJOR version is refused at connect.

A registry that hears an announce of another MAJOR version keeps who sent it, stops ``wait_for``
at once with an error naming the worker, its release and both versions, and tells the worker on
its own subject; a worker that comes back with our MAJOR version joins. Announces carry the
worker's package and version (wire 2.4); config models in messages travel without their defaults.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import time

import pytest

from rlfleet.common.control.membership import WorkerRegistry, WorkerWireRefused, release_of
from rlfleet.common.control.messages import (
    PROTOCOL,
    AnyMessage,
    ErrorReply,
    Message,
    TrainerConfigure,
    WorkerAnnounce,
    decode,
    encode,
    speaks,
)
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import membership_subject, worker_subject
from rlfleet.common.errors import ProtocolMismatch, wire_code
from rlfleet.common.schema.trainer import ModelSettings

CLUSTER = "skew"
OTHER = f"{int(PROTOCOL.split('.')[0]) + 1}.0"


def _announce(worker_id: str, protocol: str = PROTOCOL) -> WorkerAnnounce:
    return WorkerAnnounce(tier="rollout", worker_id=worker_id, protocol=protocol, host="node-7",
                          package="rlfleet-rollout", package_version="9.9.9")  # fmt: skip


async def test_a_worker_of_another_major_version_is_refused_at_connect(nats_server) -> None:  # noqa: ANN001
    control = await NatsTransport.connect(nats_server.url, name="controller", tier="controller")
    worker = await NatsTransport.connect(nats_server.url, name="rollout-9", tier="rollout")
    told: list[AnyMessage] = []

    async def own(message: AnyMessage) -> Message | None:
        told.append(message)
        return None

    registry = WorkerRegistry(control, CLUSTER)
    try:
        await worker.subscribe(worker_subject(CLUSTER, "rollout", "rollout-9"), own)
        await registry.start()
        started = time.monotonic()
        await worker.publish(membership_subject(CLUSTER, "rollout"), _announce("rollout-9", OTHER))
        with pytest.raises(WorkerWireRefused) as refused:
            await registry.wait_for("rollout", 1, 30.0)
        assert time.monotonic() - started < 10, "refused at once, not after the timeout"
        said = str(refused.value)
        assert said.startswith("rollout worker rollout-9 (rlfleet-rollout 9.9.9 on node-7) speaks wire "
                               f"protocol {OTHER}, but this process (rlfleet-common "), said  # fmt: skip
        assert f"speaks wire protocol {PROTOCOL}: MAJOR versions must match" in said, said
        assert wire_code(refused.value) == ("protocol_mismatch", False)
        assert [r.worker_id for r in registry.refused("rollout")] == ["rollout-9"]
        assert registry.workers("rollout") == []
        for _ in range(100):
            if told:
                break
            await asyncio.sleep(0.05)
        assert isinstance(told[0], ErrorReply) and told[0].code == "protocol_mismatch"
        assert OTHER in told[0].message and PROTOCOL in told[0].message

        await worker.publish(membership_subject(CLUSTER, "rollout"), _announce("rollout-9"))  # restarted
        for _ in range(100):  # with our MAJOR version: it joins
            if registry.workers("rollout"):
                break
            await asyncio.sleep(0.05)
        joined = await registry.wait_for("rollout", 1, 1.0)
        assert [w.worker_id for w in joined] == ["rollout-9"] and registry.refused("rollout") == []
        assert (joined[0].announce.package_version, joined[0].announce.protocol) == ("9.9.9", PROTOCOL)
    finally:
        await registry.stop()
        await worker.close()
        await control.close()


def test_a_refused_message_names_its_sender_as_printable_text_only() -> None:
    raw = encode(_announce("w\x1b[2J" + "x" * 300, OTHER)).replace(b'"node-7"', b'"a\\nb"')
    with pytest.raises(ProtocolMismatch) as refused:
        decode(raw)
    sender = refused.value.sender
    assert sender["worker_id"].startswith("w?[2J") and len(sender["worker_id"]) == 128
    assert sender["host"] == "a?b" and sender["tier"] == "rollout" and sender["package_version"] == "9.9.9"


def test_a_tier_announces_its_package_and_version() -> None:
    assert release_of("common") == {  # the one rlfleet package every tier has (tests/common runs alone)
        "package": "rlfleet-common",
        "package_version": importlib.metadata.version("rlfleet-common"),
    }
    assert release_of("no-such-tier") == {"package": "rlfleet-no-such-tier", "package_version": ""}
    older = decode(b'{"protocol": "2.3", "kind": "worker.announce", "tier": "reward", "worker_id": "r"}')
    assert isinstance(older, WorkerAnnounce) and (older.package, older.package_version) == ("", "")


def test_config_models_in_messages_travel_without_their_defaults() -> None:
    plain = TrainerConfigure(model=ModelSettings(), device="cpu", critic=False)
    assert b'"model":{}' in encode(plain) and decode(encode(plain)) == plain
    trusting = TrainerConfigure(model=ModelSettings(trust_remote_code=True), device="cpu", critic=False)
    assert b'"model":{"trust_remote_code":true}' in encode(trusting) and decode(encode(trusting)) == trusting


def test_wire_versions_compare_as_numbers() -> None:
    assert speaks("2.10", "2.10") and speaks("2.11", "2.10") and speaks("2.9", "2.9")
    assert not speaks("2.9", "2.10") and not speaks("3.10", "2.10") and not speaks("2", "2.10")
    assert not speaks("2.x", "2.10") and not speaks("", "2.10")
