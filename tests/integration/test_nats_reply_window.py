"""A slow answer still reaches the controller: the reply window of the run's nats-server.

nats-server lets a permissioned worker answer a request only within ``allow_responses.expires``,
which is 2 minutes when left at ``true``. A generate on 2 busy CPU cores once took longer: the
rollout worker's answer was refused ("permissions violation for publish to _INBOX.controller...")
and the run waited out the 900 s request timeout, then stopped. Tried on a real nats-server: with
a 2 s window an answer after 3 s is refused (the failure, reproduced small), with the window the
embedded run uses it arrives; deploy/nats-server.conf sets the same window for every worker user.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import Ack, AnyMessage, Message, Shutdown
from rlfleet.common.control.nats_roles import REPLY_WINDOW_S, RunCredentials, reply_permission, server_config
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import worker_subject
from rlfleet.common.errors import RequestTimeout

pytestmark = pytest.mark.timeout(60)

CLUSTER = "replywin"
DEPLOY_CONF = Path(__file__).resolve().parents[2] / "deploy" / "nats-server.conf"


class SlowWorker:
    """Answers every request after ``delay_s`` seconds."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.asked = 0

    async def __call__(self, message: AnyMessage) -> Message | None:
        self.asked += 1
        await asyncio.sleep(self.delay_s)
        return Ack(detail="late but here")


async def _pair(window_s: float) -> AsyncIterator[tuple[NatsTransport, NatsTransport]]:
    credentials = RunCredentials.generate(CLUSTER)
    with EmbeddedNats(jetstream=False, config=server_config(credentials, reply_window_s=window_s)) as server:
        controller = await NatsTransport.connect(server.url, name="controller", tier="controller",
                                                 auth=credentials.connection("controller"))  # fmt: skip
        rollout = await NatsTransport.connect(server.url, name="rollout", tier="rollout",
                                              auth=credentials.connection("rollout"))  # fmt: skip
        try:
            yield controller, rollout
        finally:
            await controller.close()
            await rollout.close()


async def _ask(window_s: float, delay_s: float) -> tuple[Message | Exception, SlowWorker]:
    async for controller, rollout in _pair(window_s):
        worker = SlowWorker(delay_s)
        await rollout.subscribe(worker_subject(CLUSTER, "rollout", "rollout-0"), worker)
        await rollout.flush()
        try:
            reply: Message | Exception = await controller.request(
                worker_subject(CLUSTER, "rollout", "rollout-0"), Shutdown(), timeout=delay_s + 3
            )
        except RequestTimeout as exc:
            reply = exc
        return reply, worker
    raise AssertionError("unreachable")


async def test_an_answer_after_the_window_is_refused_by_the_server() -> None:
    reply, worker = await _ask(window_s=2, delay_s=3)
    assert worker.asked == 1 and isinstance(reply, RequestTimeout)


async def test_within_the_run_window_a_slow_answer_arrives() -> None:
    reply, worker = await _ask(window_s=30, delay_s=3)
    assert worker.asked == 1 and isinstance(reply, Ack) and reply.detail == "late but here"


def test_the_window_is_longer_than_any_request_deadline() -> None:
    assert REPLY_WINDOW_S >= 3600
    assert reply_permission() == {"max": 1, "expires": f"{REPLY_WINDOW_S}s"}
    with pytest.raises(ValueError, match="2 min"):
        reply_permission(0)  # 0 would silently mean nats-server's default


def test_the_deploy_config_gives_every_worker_user_the_same_window() -> None:
    text = DEPLOY_CONF.read_text()
    assert "allow_responses: true" not in text
    windows = re.findall(r'allow_responses: \{ max: 1, expires: "(\d+)h" \}', text)
    assert len(windows) == 4 and all(int(hours) * 3600 >= REPLY_WINDOW_S for hours in windows)
