"""Work stops when its requester's deadline has passed (issue 29, point 5).

A generate request carries the requester's deadline (``GenerateRequest.deadline``, wall-clock
seconds). Before, a rollout worker ran every job to its end, however long after its requester had
given up, and the next job waited behind it. Now a real rollout worker process (the console script,
tiny model, HF engine, CPU, a real nats-server) cancels a long generation between decode steps once
its deadline passes, answers with a named, retryable ``timeout`` error, and serves the next request
at once; a request whose deadline passed before it arrived is refused without starting.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import GenerateRequest, GenerateResult, SamplingParams
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.errors import RemoteFailure
from rlfleet.controller.fleet import Fleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CLUSTER = "deadline-cancel"
WORKER = "rollout-deadline"
DEADLINE_S = 2.0
SLACK_S = 5.0
"""The worker's default ``limits.deadline_slack_s``: a deadline is cut this much late (clock skew)."""
FREE_WITHIN_S = 15.0
"""The cancelled job's answer, and the next job's, come within this (the long job takes minutes)."""


@pytest.fixture
def nats() -> Iterator[EmbeddedNats]:
    with EmbeddedNats(jetstream=False) as server:
        yield server


@pytest.fixture
def worker(nats: EmbeddedNats, tiny_model_dir: Path, rlfleet_cache: Path, tmp_path: Path) -> Iterator[str]:
    """A real ``rlfleet-rollout serve`` (tiny model, CPU, one sequence at a time); killed by its pid."""
    script = str(Path(sys.executable).parent / "rlfleet-rollout")
    env = {**os.environ, "RLFLEET_CACHE": str(rlfleet_cache), "PYTHONUNBUFFERED": "1"}
    with (tmp_path / "rollout.log").open("wb") as log:
        proc = subprocess.Popen(
            [script, "serve", "--model", str(tiny_model_dir), "--nats", nats.url, "--cluster", CLUSTER,
             "--worker-id", WORKER, "placement.device=cpu", "rollout.max_batch_size=1", "heartbeat_s=0.3",
             "catch_up_timeout_s=1"],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        yield WORKER
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.fixture
async def fleet(nats: EmbeddedNats) -> AsyncIterator[Fleet]:
    transport = await NatsTransport.connect(nats.url, name="test-controller")
    controller = Fleet(transport, CLUSTER, request_timeout=60.0, dead_after=5.0)
    await controller.start()
    try:
        yield controller
    finally:
        await controller.close()
        await transport.close()


async def _ask(fleet: Fleet, request: GenerateRequest, timeout: float) -> object:
    info = fleet.registry.get("rollout", WORKER)
    assert info is not None, f"{WORKER} has not announced"
    return await fleet.transport.request(info.subject, request, timeout=timeout, tier="rollout")


async def test_a_long_generation_is_cancelled_at_its_deadline_and_the_worker_is_free(
    worker: str, fleet: Fleet
) -> None:
    await fleet.wait_ready({"rollout": 1}, timeout=120)
    # 1024 samples of 250 tokens, one sequence at a time: minutes of work on the tiny model
    long = GenerateRequest(job_id="long", prompt_token_ids=[[5, 6, 7]] * 16,
                           sampling=SamplingParams(n=64, max_tokens=250, temperature=1.0, seed=0),
                           deadline=time.time() + DEADLINE_S)  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(RemoteFailure) as info:
        await _ask(fleet, long, timeout=DEADLINE_S + SLACK_S + FREE_WITHIN_S)
    waited = time.monotonic() - t0
    assert info.value.code == "timeout" and info.value.retryable, info.value
    assert "long" in info.value.remote_message and "cancelled" in info.value.remote_message, info.value
    assert DEADLINE_S + SLACK_S - 0.5 < waited < DEADLINE_S + SLACK_S + FREE_WITHIN_S, waited

    # the worker is free: the next job is served at once
    t0 = time.monotonic()
    normal = GenerateRequest(job_id="normal", prompt_token_ids=[[5, 6, 7]], deadline=time.time() + 60,
                             sampling=SamplingParams(n=2, max_tokens=8, seed=1))  # fmt: skip
    reply = await _ask(fleet, normal, timeout=FREE_WITHIN_S)
    assert isinstance(reply, GenerateResult) and reply.num_samples == 2
    assert time.monotonic() - t0 < FREE_WITHIN_S

    # a request whose deadline passed before it arrived is refused at once, without starting
    late = GenerateRequest(job_id="late", prompt_token_ids=[[5, 6, 7]] * 16, deadline=time.time() - 60,
                           sampling=SamplingParams(n=64, max_tokens=250))  # fmt: skip
    t0 = time.monotonic()
    with pytest.raises(RemoteFailure) as info:
        await _ask(fleet, late, timeout=FREE_WITHIN_S)
    assert info.value.code == "timeout" and "before it started" in info.value.remote_message, info.value
    assert time.monotonic() - t0 < 5.0
