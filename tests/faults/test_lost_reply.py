"""A live worker that finished a job whose answer never arrives: the request is given up, not waited out.

On a real nats-server with the run's role permissions and a reply window of 2 s, a real rollout
Worker answers a generate after 3 s, and the server refuses the answer (the failure a 2-minute
window once caused on a loaded machine). The worker goes on heartbeating as idle; the watchdog
gives the request up ``lost_after_s`` later with :class:`RequestLost` naming the worker and the
job, instead of the caller waiting out a 900 s deadline. A worker still busy on the job (its
heartbeats say so) is never given up: its late answer arrives, even past the request's deadline,
which is extended while the worker is busy (up to ``max_extensions`` times), and not otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.membership import WorkerRegistry
from rlfleet.common.control.messages import Ack, AnyMessage, GenerateRequest, Message
from rlfleet.common.control.nats_roles import RunCredentials, server_config
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.worker import Worker
from rlfleet.common.errors import RequestTimeout
from rlfleet.common.schema.worker import ServiceConfig
from rlfleet.controller.watchdog import RequestLost, Watchdog

CLUSTER = "lostreply"


class SlowRollout(Worker[ServiceConfig]):
    """A rollout-tier worker whose generate takes ``delay_s``."""

    tier = "rollout"

    def __init__(self, config: ServiceConfig, transport: NatsTransport, delay_s: float) -> None:
        super().__init__(config, transport)
        self.delay_s = delay_s

    async def handle_own(self, message: AnyMessage) -> Message | None:
        await asyncio.sleep(self.delay_s)
        return Ack(detail="generated")


async def _fleet(
    window_s: float, delay_s: float
) -> AsyncIterator[tuple[NatsTransport, SlowRollout, WorkerRegistry]]:
    credentials = RunCredentials.generate(CLUSTER)
    with EmbeddedNats(jetstream=False, config=server_config(credentials, reply_window_s=window_s)) as server:
        control = await NatsTransport.connect(server.url, name="controller", tier="controller",
                                              auth=credentials.connection("controller"))  # fmt: skip
        link = await NatsTransport.connect(server.url, name="rollout-0", tier="rollout",
                                           auth=credentials.connection("rollout"))  # fmt: skip
        config = ServiceConfig(fleet={"cluster": CLUSTER}, worker_id="rollout-0", heartbeat_s=0.3)
        worker = SlowRollout(config, link, delay_s)
        registry = WorkerRegistry(control, CLUSTER, dead_after=30.0)
        try:
            await registry.start()
            await worker.start()
            await registry.wait_for("rollout", 1, 10.0)
            yield control, worker, registry
        finally:
            await registry.stop()
            await worker.stop()
            await link.close()
            await control.close()


@pytest.mark.timeout(40)
async def test_an_answer_refused_by_the_server_is_given_up_soon_naming_the_worker() -> None:
    async for control, worker, registry in _fleet(window_s=2, delay_s=3):
        watchdog = Watchdog(60.0, registry=registry, lost_after_s=2.0)
        watched = watchdog.watch(control)
        sent = time.monotonic()
        with pytest.raises(RequestLost) as caught:
            await watched.request(worker.own_subject, GenerateRequest(job_id="g-1", prompt_token_ids=[[1]]),
                                  timeout=30.0, tier="rollout")  # fmt: skip
        waited = time.monotonic() - sent
        assert 3.0 + 2.0 <= waited < 12.0, waited  # after the answer was due and 2 s of idle beats
        message = str(caught.value)
        assert "rollout worker rollout-0 is alive" in message and "rollout.generate job g-1" in message
        assert "answer was lost" in message
        assert isinstance(caught.value, RequestTimeout)  # retried and re-dispatched like a timeout
        assert watchdog.waiting == []


@pytest.mark.timeout(40)
async def test_a_worker_busy_on_the_job_is_never_given_up() -> None:
    async for control, worker, registry in _fleet(window_s=60, delay_s=5):
        watchdog = Watchdog(60.0, registry=registry, lost_after_s=1.0)
        watched = watchdog.watch(control)
        job = GenerateRequest(job_id="g-2", prompt_token_ids=[[1]])
        reply = await watched.request(worker.own_subject, job, timeout=30.0, tier="rollout")
        assert isinstance(reply, Ack) and reply.detail == "generated"


@pytest.mark.timeout(40)
async def test_a_deadline_passing_while_the_worker_is_busy_on_it_is_extended_within_a_cap() -> None:
    async for control, worker, registry in _fleet(window_s=60, delay_s=3.5):
        watched = Watchdog(60.0, registry=registry).watch(control)
        job = GenerateRequest(job_id="g-3", prompt_token_ids=[[1]])
        reply = await watched.request(worker.own_subject, job, timeout=1.0, tier="rollout")
        assert isinstance(reply, Ack) and reply.detail == "generated"  # busy, so waited past 1 s

        capped = Watchdog(60.0, registry=registry, max_extensions=1).watch(control)
        sent = time.monotonic()
        with pytest.raises(RequestTimeout) as caught:
            await capped.request(worker.own_subject, GenerateRequest(job_id="g-4", prompt_token_ids=[[1]]),
                                 timeout=1.0, tier="rollout")  # fmt: skip
        assert 1.9 <= time.monotonic() - sent < 3.4  # 1 s, extended once: 2 s in all
        assert not isinstance(caught.value, RequestLost)


@pytest.mark.timeout(40)
async def test_a_deadline_passing_with_no_busy_worker_is_not_extended() -> None:
    async for control, worker, _ in _fleet(window_s=60, delay_s=3.0):
        empty = WorkerRegistry(control, "another-cluster")  # knows no worker: nobody is busy on it
        watched = Watchdog(60.0, registry=empty).watch(control)
        sent = time.monotonic()
        with pytest.raises(RequestTimeout):
            await watched.request(worker.own_subject, GenerateRequest(job_id="g-5", prompt_token_ids=[[1]]),
                                  timeout=1.0, tier="rollout")  # fmt: skip
        assert time.monotonic() - sent < 2.5
