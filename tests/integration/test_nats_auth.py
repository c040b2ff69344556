"""Role permissions of an embedded run's nats-server, tried against a real nats-server.

A client without credentials (or with a wrong password) cannot connect; each role reaches only its
own subjects: a rollout-role client cannot drive the trainer, shut a worker down, load weights,
join the reward queue group, read the controller's replies or announce itself as another tier.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.membership import Heartbeater, WorkerRegistry
from rlfleet.common.control.messages import (
    Ack,
    AnyMessage,
    LatestWeights,
    Message,
    Shutdown,
    WorkerAnnounce,
    WorkerLeave,
)
from rlfleet.common.control.nats_roles import RunCredentials, server_config
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import membership_subject, subject, worker_subject
from rlfleet.common.errors import NatsServerError, NoResponders, RequestTimeout
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.controller.launcher import EmbeddedFleet, WorkerSpec

pytestmark = pytest.mark.timeout(30)

CLUSTER = "authrun"


@pytest.fixture(scope="module")
def secured() -> Iterator[tuple[EmbeddedNats, RunCredentials]]:
    credentials = RunCredentials.generate(CLUSTER)
    with EmbeddedNats(jetstream=False, config=server_config(credentials)) as server:
        yield server, credentials


@pytest.fixture
async def roles(secured: tuple[EmbeddedNats, RunCredentials]) -> AsyncIterator[dict[str, NatsTransport]]:
    server, credentials = secured
    clients = {
        role: await NatsTransport.connect(server.url, name=f"test-{role}", tier=role,
                                          auth=credentials.connection(role))
        for role in ("controller", "trainer", "rollout", "reward")
    }  # fmt: skip
    yield clients
    for client in clients.values():
        await client.close()


class Inbox:
    """What a subscription received."""

    def __init__(self) -> None:
        self.got: list[AnyMessage] = []

    async def __call__(self, message: AnyMessage) -> Message | None:
        self.got.append(message)
        return Ack(detail="obeyed")


async def _settle(*clients: NatsTransport) -> None:
    for client in clients:
        await client.flush()
    await asyncio.sleep(0.2)


async def test_a_client_without_credentials_cannot_connect(
    secured: tuple[EmbeddedNats, RunCredentials],
) -> None:
    server, _ = secured
    with pytest.raises(NatsServerError, match="refused these credentials"):
        await NatsTransport.connect(server.url, name="anon", connect_timeout=3.0, max_reconnect_attempts=0)


async def test_a_wrong_password_is_refused_and_not_shown(
    secured: tuple[EmbeddedNats, RunCredentials],
) -> None:
    server, _ = secured
    wrong = NatsConnection(user="controller", password="guessed-wrong-123")
    with pytest.raises(NatsServerError) as caught:
        await NatsTransport.connect(server.url, name="guess", connect_timeout=3.0, auth=wrong,
                                    max_reconnect_attempts=0)  # fmt: skip
    assert "guessed-wrong-123" not in str(caught.value)


async def test_only_the_controller_drives_the_trainer(roles: dict[str, NatsTransport]) -> None:
    trainer, rollout, controller = roles["trainer"], roles["rollout"], roles["controller"]
    step, own = Inbox(), Inbox()
    await trainer.subscribe(subject(CLUSTER, "trainer", "step"), step, queue="trainer")
    await trainer.subscribe(worker_subject(CLUSTER, "trainer", "trainer-0"), own)
    for forged in ("step", "publish", "save", "load", "configure"):
        await rollout.publish(subject(CLUSTER, "trainer", forged), Shutdown(reason="forged"))
    await rollout.publish(worker_subject(CLUSTER, "trainer", "trainer-0"), Shutdown(reason="forged"))
    await roles["reward"].publish(worker_subject(CLUSTER, "trainer", "trainer-0"), Shutdown(reason="forged"))
    await _settle(rollout, roles["reward"])
    assert step.got == [] and own.got == []
    # the controller's request gets through and the trainer role may answer it
    reply = await controller.request(worker_subject(CLUSTER, "trainer", "trainer-0"), Shutdown(), timeout=5)
    assert isinstance(reply, Ack) and len(own.got) == 1


async def test_only_the_controller_commands_rollout_and_reward_workers(
    roles: dict[str, NatsTransport],
) -> None:
    rollout, reward, trainer = roles["rollout"], roles["reward"], roles["trainer"]
    rollout_own, reward_own = Inbox(), Inbox()
    await rollout.subscribe(worker_subject(CLUSTER, "rollout", "rollout-0"), rollout_own)
    await reward.subscribe(worker_subject(CLUSTER, "reward", "reward-0"), reward_own)
    await trainer.publish(worker_subject(CLUSTER, "rollout", "rollout-0"), Shutdown(reason="load weights?"))
    await rollout.publish(worker_subject(CLUSTER, "reward", "reward-0"), Shutdown(reason="forged"))
    await reward.publish(subject(CLUSTER, "rollout", "generate"), Shutdown(reason="forged"))
    await _settle(trainer, rollout, reward)
    assert rollout_own.got == [] and reward_own.got == []


async def test_no_other_role_joins_the_reward_queue_group(roles: dict[str, NatsTransport]) -> None:
    thief = Inbox()
    await roles["rollout"].subscribe(subject(CLUSTER, "reward", "score"), thief, queue="reward")
    await _settle(roles["rollout"])
    with pytest.raises((NoResponders, RequestTimeout)):
        await roles["controller"].request(subject(CLUSTER, "reward", "score"), Shutdown(), timeout=1.0)
    assert thief.got == []


async def test_workers_ask_the_trainer_for_its_weights(roles: dict[str, NatsTransport]) -> None:
    await roles["trainer"].subscribe(subject(CLUSTER, "trainer", "latest"), Inbox(), queue="trainer")
    latest = subject(CLUSTER, "trainer", "latest")
    reply = await roles["rollout"].request(latest, LatestWeights(worker_id="r"), timeout=5)
    assert isinstance(reply, Ack)


async def test_no_role_reads_another_roles_replies(roles: dict[str, NatsTransport]) -> None:
    sniffed = Inbox()
    await roles["rollout"].subscribe("_INBOX.controller.>", sniffed)
    await roles["rollout"].subscribe("_INBOX.>", sniffed)
    await roles["trainer"].subscribe(worker_subject(CLUSTER, "trainer", "t"), Inbox())
    await _settle(roles["rollout"], roles["trainer"])
    await roles["controller"].request(worker_subject(CLUSTER, "trainer", "t"), Shutdown(), timeout=5)
    await _settle(roles["controller"])
    assert sniffed.got == []


async def test_membership_cannot_be_forged_by_another_role(roles: dict[str, NatsTransport]) -> None:
    registry = WorkerRegistry(roles["controller"], CLUSTER, dead_after=30)
    async with registry:
        rollout = roles["rollout"]
        fake = WorkerAnnounce(
            tier="trainer", worker_id="evil", subject=worker_subject(CLUSTER, "trainer", "evil")
        )
        await rollout.publish(membership_subject(CLUSTER, "trainer"), fake)  # refused by the server
        await rollout.publish(membership_subject(CLUSTER, "rollout"), fake)  # wrong tier: ignored
        away = WorkerAnnounce(tier="rollout", worker_id="r1", subject="rlfleet.elsewhere.steal.tokens")
        await rollout.publish(membership_subject(CLUSTER, "rollout"), away)  # foreign subject: ignored
        real = WorkerAnnounce(tier="trainer", worker_id="trainer-0")
        async with Heartbeater(roles["trainer"], CLUSTER, real, interval=5.0):
            found = await registry.wait_for("trainer", 1, timeout=5)
            assert [w.worker_id for w in found] == ["trainer-0"]
            assert found[0].subject == worker_subject(CLUSTER, "trainer", "trainer-0")
            await rollout.publish(membership_subject(CLUSTER, "trainer"),
                                  WorkerLeave(tier="trainer", worker_id="trainer-0"))  # fmt: skip
            await _settle(rollout)
            assert registry.get("trainer", "trainer-0") is not None
        assert registry.workers("rollout") == [] and registry.get("trainer", "evil") is None


async def test_the_controller_cannot_announce_workers(roles: dict[str, NatsTransport]) -> None:
    registry = WorkerRegistry(roles["controller"], CLUSTER, dead_after=30)
    async with registry:
        await roles["controller"].publish(membership_subject(CLUSTER, "reward"),
                                          WorkerAnnounce(tier="reward", worker_id="fake"))  # fmt: skip
        await _settle(roles["controller"])
        assert registry.workers("reward") == []


def test_an_embedded_fleet_gives_each_worker_its_role_in_the_environment(tmp_path: Path, procs) -> None:
    script = ("import os, sys; print('ARGV', sys.argv); print('ROLE', os.environ.get('RLFLEET_NATS_USER'));"
              "print('HASPW', bool(os.environ.get('RLFLEET_NATS_PASSWORD'))); print('TOKEN', "
              "os.environ.get('RLFLEET_NATS_TOKEN'))")  # fmt: skip
    os.environ["RLFLEET_NATS_TOKEN"] = "from-the-users-shell"
    try:
        with EmbeddedFleet(tmp_path) as fleet:
            fleet.start_nats(CLUSTER)
            worker = fleet.spawn(
                WorkerSpec("rollout", "rollout-0", {}, command=[sys.executable, "-c", script])
            )
            worker.process.wait(timeout=20)
            password = fleet.connection("rollout").password.get_secret_value()
            out = worker.log_path.read_text()
            assert "ROLE rollout" in out and "HASPW True" in out and "TOKEN None" in out
            assert password not in out  # not in argv
            assert password not in (tmp_path / "workers" / "rollout-0.yaml").read_text()
            assert password not in (tmp_path / "processes.json").read_text()
    finally:
        del os.environ["RLFLEET_NATS_TOKEN"]
