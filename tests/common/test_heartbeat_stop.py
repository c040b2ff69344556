"""A worker stops cleanly when its nats-server does not answer (issue 12, point 4): the leave it
cannot flush is logged, not raised. A worker told to stop while its server was frozen or just gone
(the connection not yet seen down) ended with a RequestTimeout traceback from the flush. A real
nats-server, frozen with SIGSTOP under a beating worker (and resumed with SIGCONT after).

SIGSTOP takes a moment to stop every thread of the server (a thread still running may answer the
flush, and the leave is then said after all), so the test waits until all of them are stopped."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.membership import Heartbeater
from rlfleet.common.control.messages import WorkerAnnounce
from rlfleet.common.control.nats_transport import NatsTransport


def _wait_stopped(pid: int, within: float = 5.0) -> None:
    """Until every thread of ``pid`` is in state T (stopped), as /proc reports it."""
    deadline = time.monotonic() + within
    while True:
        states = {
            (t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{pid}/task").iterdir()
        }
        if states == {"T"}:
            return
        assert time.monotonic() < deadline, f"nats-server {pid} not stopped after {within} s: {states}"
        time.sleep(0.01)


@pytest.mark.timeout(30)
async def test_a_worker_stops_without_raising_when_its_server_does_not_answer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with EmbeddedNats(jetstream=False) as server:
        transport = await NatsTransport.connect(server.url, name="w0", tier="rollout", connect_timeout=2.0)
        beat = Heartbeater(transport, "frozen", WorkerAnnounce(tier="rollout", worker_id="w0"), interval=0.2)
        await beat.start()
        await asyncio.sleep(0.5)
        os.kill(server.pid, signal.SIGSTOP)  # this test's own nats-server, by its pid
        try:
            with caplog.at_level(logging.WARNING, logger="rlfleet.common.control.membership"):
                await beat.stop("sigterm")  # the leave's flush is never answered (5 s)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        assert "w0 left without saying so" in caplog.text
        await transport.close()
