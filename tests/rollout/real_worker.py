"""A real rollout worker for tests: the HF engine on CPU, on a real nats-server (the ``worker``
fixture of conftest.py, and workers a test starts itself, such as a late joiner)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.schema.rollout import HFEngineSettings, RolloutSettings, RolloutWorkerConfig
from rlfleet.common.schema.worker import FleetAddress, Placement
from rlfleet.rollout.service import RolloutWorker

WORKER_CLUSTER = "atomic-loads"


@asynccontextmanager
async def running_worker(
    url: str, model_path: Path, worker_id: str = "rollout-0", catch_up_timeout_s: float = 0.5, *,
    cluster: str = WORKER_CLUSTER, **connect: Any,
) -> AsyncIterator[RolloutWorker]:  # fmt: skip
    """A real rollout worker (HF engine, CPU) of ``cluster`` on the nats-server at ``url``, started
    (it catches up with a trainer that answers within ``catch_up_timeout_s``), then stopped;
    ``connect``: more arguments of its NATS connection."""
    config = RolloutWorkerConfig(fleet=FleetAddress(cluster=cluster), worker_id=worker_id,
                                 model_path=str(model_path), placement=Placement(device="cpu"),
                                 rollout=RolloutSettings(engine=HFEngineSettings(type="hf")),
                                 catch_up_timeout_s=catch_up_timeout_s)  # fmt: skip
    transport = await NatsTransport.connect(url, name=worker_id, tier="rollout", **connect)
    worker = RolloutWorker(config, transport)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop("test over")
        await transport.close()
