"""The Ray launcher's fleet on a real local Ray (issue 13): workers placed by Ray join by real addresses.

A real ``ray.init`` (4 logical CPUs), the run's nats-server listening on every interface and
named by the node IP Ray reports, and a real ``rlfleet-reward serve`` process started inside a
Ray actor: it announces itself over that address; ``processes.json`` records its node. Killed, it
is reported with its log tail and started again in a fresh actor within the restart budget, and
it announces again; past the budget the run gets a named stop. A worker process that is alive but
frozen (SIGSTOP), once declared dead, is SIGKILLed by its actor and started again in a fresh one,
counted against the budget (issue 29). ``stop()`` ends every process and actor it started.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlfleet.common.control.membership import WorkerRegistry
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.controller.errors import TierDied, TierNotRestarted
from rlfleet.controller.launcher import WorkerSpec, kill_declared_dead
from rlfleet.controller.ray_launcher import RayFleet, RayPlacement, TierResources, import_ray

ray = import_ray(local=True)  # this machine's Ray: workers run this interpreter (no uv-run copies)

CLUSTER = "rayrun"
SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _announced(fleet: RayFleet, worker_id: str, timeout: float) -> dict[str, object]:
    transport = await NatsTransport.connect(fleet.url, name="controller", tier="controller",
                                            auth=fleet.connection("controller"))  # fmt: skip
    registry = WorkerRegistry(transport, CLUSTER)
    try:
        await registry.start()
        await registry.wait_for("reward", 1, timeout)
        info = registry.get("reward", worker_id)
        assert info is not None
        return {"pid": info.announce.pid}
    finally:
        await registry.stop()
        await transport.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_ray_placed_worker_joins_by_the_node_address_and_is_restarted(
    local_ray: None, tmp_path: Path
) -> None:
    placement = RayPlacement({"reward": TierResources(num_cpus=1)})
    fleet = RayFleet(tmp_path / "fleet", placement=placement, restart_budget=1)
    pids: list[int] = []
    try:
        fleet.start_nats(CLUSTER)
        node_ip = ray.util.get_node_ip_address()
        assert fleet.url.startswith(f"nats://{node_ip}:")
        settings = {"fleet": {"cluster": CLUSTER}, "heartbeat_s": 0.5, "drain_s": 1}
        spec = WorkerSpec("reward", "reward-0", settings)
        worker = fleet.spawn(spec)
        pids.append(worker.pid)
        seen = asyncio.run(_announced(fleet, "reward-0", 90.0))
        assert seen["pid"] == worker.pid
        record = json.loads((tmp_path / "fleet" / "processes.json").read_text())["workers"][0]
        assert record["node_ip"] == node_ip and record["node_id"] and record["pid"] == worker.pid

        restarted: list[TierDied] = []
        fleet.on_restart = lambda new, died: restarted.append(died)
        os.kill(worker.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not restarted:
            assert time.monotonic() < deadline, "no restart within 30 s"
            fleet.check()
            time.sleep(0.25)
        assert "reward worker reward-0 was killed by signal SIGKILL" in str(restarted[0])
        again = fleet.workers[0]
        pids.append(again.pid)
        assert again.pid != worker.pid
        assert asyncio.run(_announced(fleet, "reward-0", 90.0))["pid"] == again.pid

        os.kill(again.pid, signal.SIGKILL)  # past the budget of 1: a named stop
        with pytest.raises(TierNotRestarted, match="restart budget is spent"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                fleet.check()
                time.sleep(0.25)
    finally:
        fleet.stop(timeout=5)
    assert not any(_alive(pid) for pid in pids)
    assert fleet.processes.nats is None


@pytest.mark.timeout(120)
def test_a_frozen_ray_placed_worker_declared_dead_is_killed_by_its_actor_and_started_again(
    local_ray: None, tmp_path: Path
) -> None:
    placement = RayPlacement({"rollout": TierResources(num_cpus=1)})
    fleet = RayFleet(tmp_path / "fleet", placement=placement, restart_budget=1)
    pids: list[int] = []
    try:
        fleet.start_nats(CLUSTER)
        worker = fleet.spawn(WorkerSpec("rollout", "rollout-0", {}, command=SLEEP))
        pids.append(worker.pid)
        os.kill(worker.pid, signal.SIGSTOP)  # alive, silent: the registry would declare it dead
        restarted: list[TierDied] = []
        fleet.on_restart = lambda new, died: restarted.append(died)
        assert kill_declared_dead(fleet.workers, "rollout", "rollout-0", worker.pid, 7.5) is worker
        deadline = time.monotonic() + 30
        while not restarted:
            assert time.monotonic() < deadline, "no restart within 30 s"
            fleet.check()
            time.sleep(0.25)
        died = str(restarted[0])
        assert died.startswith("rollout worker rollout-0 was killed by signal SIGKILL (exit code -9): "
                               "declared dead after 7.5s without a heartbeat")  # fmt: skip
        again = fleet.workers[0]
        pids.append(again.pid)
        assert again.pid != worker.pid and _alive(again.pid) and not _alive(worker.pid)
        assert fleet.processes.restarts == {"rollout-0": 1}
    finally:
        fleet.stop(timeout=5)
    assert not any(_alive(pid) for pid in pids)
