"""A worker stops cleanly when its nats-server does not answer (issue 12, point 4): the leave it
cannot flush is logged, not raised. A worker told to stop while its server was frozen or just gone
(the connection not yet seen down) ended with a RequestTimeout traceback from the flush. A real
nats-server, frozen with SIGSTOP under a beating worker (and resumed with SIGCONT after).

SIGSTOP takes a moment to stop every thread of the server (a thread still running may answer the
flush, and the leave is then said after all), so the test waits until all of them are stopped. The
warning is kept by a handler on the membership logger itself: in CI's isolated run of tests/common,
caplog (the root logger's handler) once came back empty although the warning is the only way out of
that ``stop``; a failure now says how long ``stop`` took and what the logger saw. A ``stop`` that
returns at once (the client wrote the leave without waiting on the frozen server) logs nothing."""

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


FLUSH_S = 5.0
"""How long the leave's flush waits (``NatsTransport.flush``'s default)."""


class _Kept(logging.Handler):
    """The records of one logger, kept on the logger itself (not through the root's handlers)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.timeout(30)
async def test_a_worker_stops_without_raising_when_its_server_does_not_answer() -> None:
    membership = logging.getLogger("rlfleet.common.control.membership")
    kept, level = _Kept(), membership.level
    membership.addHandler(kept)
    membership.setLevel(logging.WARNING)
    try:
        with EmbeddedNats(jetstream=False) as server:
            transport = await NatsTransport.connect(
                server.url, name="w0", tier="rollout", connect_timeout=2.0
            )
            beat = Heartbeater(
                transport, "frozen", WorkerAnnounce(tier="rollout", worker_id="w0"), interval=0.2
            )
            await beat.start()
            await asyncio.sleep(0.5)
            os.kill(server.pid, signal.SIGSTOP)  # this test's own nats-server, by its pid
            try:
                _wait_stopped(server.pid)
                t0 = time.monotonic()
                await beat.stop("sigterm")  # the leave's flush is never answered (5 s)
                took = time.monotonic() - t0
            finally:
                os.kill(server.pid, signal.SIGCONT)
            said = [line for line in kept.lines if "w0 left without saying so" in line]
            assert took < FLUSH_S + 3.0, f"stop took {took:.2f} s"
            if took >= FLUSH_S - 0.5:  # it waited out the flush: the unsaid leave is logged
                assert said, (
                    f"stop took {took:.2f} s, logged {kept.lines}, logger disabled={membership.disabled}"
                )
            # else the NATS client, finding its own loops gone, wrote the leave without a round trip
            # (nats-py's flush then returns at once): nothing was waited on, nothing to log
            await transport.close()
    finally:
        membership.removeHandler(kept)
        membership.setLevel(level)
