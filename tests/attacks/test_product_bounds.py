"""A generate request whose fields are each in bounds but whose product is not is refused before any
work (issue 29, point 5).

``SamplingParams`` bounds each field (``n`` <= 4096, ``max_tokens`` <= 2**20, 65536 prompts), so
16 prompts x 4096 samples, or a 200-token prompt with 100 new tokens on a 256-position model, were
accepted and held the worker for as long as they took. Now a real rollout worker process (the
console script, tiny model, CPU, a real nats-server) answers each with a ``bad_request`` naming
the product, its value and the limit (the worker's ``limits`` settings, or the served model's
context), and serves a normal request straight after: no work started.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import GenerateRequest, GenerateResult, SamplingParams
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.errors import RemoteUserError
from rlfleet.controller.fleet import Fleet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

CLUSTER = "product-bounds"
ANSWER_S = 20.0
"""A refusal is checked before any work: it comes within this, where the work would take minutes."""

Start = Callable[..., str]


@pytest.fixture
def nats() -> Iterator[EmbeddedNats]:
    with EmbeddedNats(jetstream=False) as server:
        yield server


@pytest.fixture
def start_worker(
    nats: EmbeddedNats, tiny_model_dir: Path, rlfleet_cache: Path, tmp_path: Path
) -> Iterator[Start]:
    """``start(worker_id, *overrides)``: a real ``rlfleet-rollout serve`` on the tiny model (256
    positions), CPU; stops exactly the processes it started."""
    script = str(Path(sys.executable).parent / "rlfleet-rollout")
    env = {**os.environ, "RLFLEET_CACHE": str(rlfleet_cache), "PYTHONUNBUFFERED": "1"}
    started: list[subprocess.Popen[bytes]] = []

    def start(worker_id: str, *overrides: str) -> str:
        with (tmp_path / f"{worker_id}.log").open("wb") as log:
            started.append(subprocess.Popen(
                [script, "serve", "--model", str(tiny_model_dir), "--nats", nats.url, "--cluster", CLUSTER,
                 "--worker-id", worker_id, "placement.device=cpu", "rollout.max_batch_size=64",
                 "heartbeat_s=0.3", "catch_up_timeout_s=1", *overrides],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            ))  # fmt: skip
        return worker_id

    yield start
    for proc in started:
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


async def _ask(fleet: Fleet, worker_id: str, request: GenerateRequest, timeout: float = ANSWER_S) -> object:
    info = fleet.registry.get("rollout", worker_id)
    assert info is not None, f"{worker_id} has not announced"
    return await fleet.transport.request(info.subject, request, timeout=timeout, tier="rollout")


async def _refused(fleet: Fleet, worker_id: str, request: GenerateRequest) -> str:
    """The worker's refusal of ``request`` (a bad_request), within :data:`ANSWER_S`."""
    t0 = time.monotonic()
    with pytest.raises(RemoteUserError) as info:
        await _ask(fleet, worker_id, request)
    assert info.value.code == "bad_request", info.value
    assert time.monotonic() - t0 < ANSWER_S
    return info.value.remote_message


async def _serves_at_once(fleet: Fleet, worker_id: str) -> None:
    request = GenerateRequest(job_id=f"normal-{worker_id}", prompt_token_ids=[[5, 6, 7], [8, 9]],
                              sampling=SamplingParams(n=2, max_tokens=8, seed=1))  # fmt: skip
    t0 = time.monotonic()
    reply = await _ask(fleet, worker_id, request, timeout=15.0)
    assert isinstance(reply, GenerateResult) and reply.num_samples == 4
    assert time.monotonic() - t0 < 15.0


def _prompts(count: int, length: int) -> list[list[int]]:
    return [[4 + (i + j) % 10 for j in range(length)] for i in range(count)]


async def test_default_limits_refuse_samples_and_context_then_serve(
    start_worker: Start, fleet: Fleet
) -> None:
    worker = start_worker("rollout-defaults")
    await fleet.wait_ready({"rollout": 1}, timeout=120)
    # 16 prompts and n=4096 are each in bounds; 65536 samples is over the default 32768
    many = GenerateRequest(job_id="many", prompt_token_ids=_prompts(16, 3),
                           sampling=SamplingParams(n=4096, max_tokens=8))  # fmt: skip
    said = await _refused(fleet, worker, many)
    assert "samples" in said and "65536" in said and "32768" in said and "limits.max_samples" in said, said
    # a 200-token prompt and 100 new tokens are each in bounds; 300 is over the model's 256 positions
    long = GenerateRequest(job_id="long", prompt_token_ids=[[5] * 10, [6] * 200],
                           sampling=SamplingParams(n=1, max_tokens=100))  # fmt: skip
    said = await _refused(fleet, worker, long)
    assert "prompt 1" in said and "300" in said and "256" in said, said
    await asyncio.wait_for(_serves_at_once(fleet, worker), timeout=30)


async def test_configured_limits_refuse_each_product_then_serve(start_worker: Start, fleet: Fleet) -> None:
    worker = start_worker("rollout-limits", "limits.max_samples=64", "limits.max_new_tokens=4096",
                          "limits.max_prompt_tokens=2048")  # fmt: skip
    await fleet.wait_ready({"rollout": 1}, timeout=120)
    cases = {
        # 16 x 16 = 256 samples > 64
        "samples": (GenerateRequest(job_id="s", prompt_token_ids=_prompts(16, 3),
                                    sampling=SamplingParams(n=16, max_tokens=4)), ("256", "64")),
        # 8 x 8 = 64 samples (at the limit) x 100 tokens = 6400 new tokens > 4096
        "new tokens": (GenerateRequest(job_id="t", prompt_token_ids=_prompts(8, 3),
                                       sampling=SamplingParams(n=8, max_tokens=100)), ("6400", "4096")),
        # 16 prompts of 150 tokens x 1 sample = 2400 prompt tokens > 2048 (each 150 + 4 fits 256)
        "prompt tokens": (GenerateRequest(job_id="p", prompt_token_ids=_prompts(16, 150),
                                          sampling=SamplingParams(n=1, max_tokens=4)), ("2400", "2048")),
    }  # fmt: skip
    for product, (request, numbers) in cases.items():
        said = await _refused(fleet, worker, request)
        assert product in said and all(n in said for n in numbers), (product, said)
    await asyncio.wait_for(_serves_at_once(fleet, worker), timeout=30)
