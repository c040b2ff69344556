"""``rlfleet status`` and the workers' /metrics and /healthz, against a real fleet (issue 13 point 5).

A real nats-server, a real ``rlfleet-reward serve`` process and a rollout-tier Worker in this
process, each serving metrics on a free port: ``rlfleet status`` (a real CLI process) lists both
with their pool, pid, version and health; /metrics counts requests by kind and outcome, busy time
and the weight version; /healthz answers 200 while a worker serves and 503 while it drains.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.membership import WorkerRegistry
from rlfleet.common.control.messages import PROTOCOL, Ack, AnyMessage, GenerateRequest, Message
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.worker import Worker
from rlfleet.common.errors import RemoteError
from rlfleet.common.schema.worker import ServiceConfig

CLUSTER = "watched"
BIN = Path(sys.executable).parent


class Rollout(Worker[ServiceConfig]):
    tier = "rollout"

    async def handle_own(self, message: AnyMessage) -> Message | None:
        await asyncio.sleep(0.2)
        return Ack(detail="generated")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedNats, Rollout, subprocess.Popen[str], Path]]:
    with EmbeddedNats(jetstream=False) as server:
        log = tmp_path / "reward.log"
        reward = subprocess.Popen(
            [str(BIN / "rlfleet-reward"), "serve", "--nats", server.url, "--cluster", CLUSTER,
             "--worker-id", "reward-0", "metrics_port=0", "heartbeat_s=0.5"],
            stdout=log.open("w"), stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        link = await NatsTransport.connect(server.url, name="rollout-0", tier="rollout")
        rollout = Rollout(ServiceConfig(fleet={"cluster": CLUSTER}, worker_id="rollout-0", pool="fast",
                                        heartbeat_s=0.5, metrics_port=0), link)  # fmt: skip
        try:
            await rollout.start()
            rollout.weight_version = 3
            yield server, rollout, reward, log
        finally:
            await rollout.stop()
            await link.close()
            reward.terminate()
            reward.wait(timeout=60)


def _status(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "rlfleet"), "status", "--nats", url, "--cluster", CLUSTER, "--wait", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.timeout(120)
async def test_status_lists_the_running_fleet(fleet) -> None:  # noqa: ANN001
    server, rollout, reward, _ = fleet
    control = await NatsTransport.connect(server.url, name="controller", tier="controller")
    registry = WorkerRegistry(control, CLUSTER)
    try:
        await registry.start()
        await registry.wait_for("reward", 1, 60.0)  # the reward process is up
    finally:
        await registry.stop()
        await control.close()
    done = await asyncio.to_thread(_status, server.url)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"fleet {CLUSTER}: rollout 1, reward 1, trainer 0", done.stdout
    assert lines[1].split() == "TIER WORKER POOL HOST PID VERSION BUSY HEALTH RELEASE WIRE ACTIVITY".split()
    by_id = {line.split()[1]: line.split() for line in lines[2:]}
    assert by_id["rollout-0"][:4] == ["rollout", "rollout-0", "fast", socket.gethostname()]
    release = importlib.metadata.version("rlfleet-rollout")  # announces carry package and wire versions
    assert by_id["rollout-0"][4:] == [str(os.getpid()), "3", "0", "ok", release, PROTOCOL, "idle"]
    assert by_id["reward-0"][0] == "reward" and by_id["reward-0"][4] == str(reward.pid)
    assert by_id["reward-0"][7:10] == ["ok", importlib.metadata.version("rlfleet-reward"), PROTOCOL]


@pytest.mark.timeout(60)
def test_status_of_an_unreachable_fleet_is_a_clear_error() -> None:
    done = _status("nats://127.0.0.1:9")  # nothing listens on the discard port
    assert done.returncode == 1 and done.stderr.startswith("rlfleet status: "), done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.timeout(120)
async def test_metrics_and_health_of_a_worker(fleet) -> None:  # noqa: ANN001
    server, rollout, _, log = fleet
    assert rollout.metrics_server is not None
    base = f"http://127.0.0.1:{rollout.metrics_server.port}"
    control = await NatsTransport.connect(server.url, name="controller", tier="controller")
    try:
        for i in range(2):
            job = GenerateRequest(job_id=f"g-{i}", prompt_token_ids=[[1]])
            reply = await control.request(rollout.own_subject, job, timeout=10)
            assert isinstance(reply, Ack)
        status, text = await asyncio.to_thread(_get, base + "/metrics")
        assert status == 200
        labels = 'kind="rollout.generate",outcome="ok",tier="rollout",worker="rollout-0"'
        assert re.search(r"rlfleet_requests_total\{" + re.escape(labels) + r"\} 2\.0", text), text
        busy = re.search(r'rlfleet_busy_seconds_total\{tier="rollout",worker="rollout-0"\} ([0-9.e+-]+)',
                         text)  # fmt: skip
        assert busy and 0.35 <= float(busy.group(1)) < 5.0
        assert 'rlfleet_weight_version{tier="rollout",worker="rollout-0"} 3.0' in text
        assert "rlfleet_worker_start_time_seconds" in text and "rlfleet_requests_in_progress" in text

        status, body = await asyncio.to_thread(_get, base + "/healthz")
        assert status == 200 and json.loads(body)["state"] == "serving"
        rollout.draining = True
        status, body = await asyncio.to_thread(_get, base + "/healthz")
        assert status == 503 and json.loads(body)["state"] == "draining"
        rollout.draining = False
        assert (await asyncio.to_thread(_get, base + "/other"))[0] == 404

        # the reward process serves its own, on the port it logged; a refused request counts as an error
        deadline = time.monotonic() + 30
        while not (found := re.search(r"metrics on http://([^/]+)/metrics", log.read_text())):
            assert time.monotonic() < deadline, log.read_text()
            await asyncio.sleep(0.2)
        with pytest.raises(RemoteError):
            wrong = GenerateRequest(job_id="wrong", prompt_token_ids=[[1]])  # not a reward worker's message
            await control.request(f"rlfleet.{CLUSTER}.reward.worker.reward-0", wrong, timeout=10)
        status, text = await asyncio.to_thread(_get, f"http://{found.group(1)}/metrics")
        assert status == 200
        assert re.search(r'rlfleet_requests_total\{kind="rollout.generate",outcome="error",tier="reward",'
                         r'worker="reward-0"\} 1\.0', text), text  # fmt: skip
    finally:
        await control.close()
