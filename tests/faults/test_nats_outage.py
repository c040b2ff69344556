"""NATS outages under a real tiny run (issue 12, point 4): the run goes on, nobody is reaped.

Cluster mode, every tier a real ``rlfleet-<tier> serve`` process. (1) The nats-server is stopped
between two steps (the controller's event loop, idle between steps, finds out only when its next
step's first request goes out on the dead socket) and started again on the same port 30 s later:
that step finishes once the connection returns, no worker is declared dead, and the next step
runs. (A reply lost while a request is in flight is covered by tests/common/test_membership_outage.)
(2) On a 3-node NATS cluster (every client given all three URLs), the node the controller is on
is stopped for good mid-run: clients fail over to the others and the run finishes its steps.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats, free_port
from rlfleet.controller import GRPOTrainer, TrainerConfig
from rlfleet.controller.dataset import PromptDataset

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
REWARD = "charset:allowed=0123456789"
OUTAGE_S = 30.0

pytestmark = pytest.mark.slow

Starter = Callable[[str, str, dict[str, object]], None]


@pytest.fixture
def workers(serve_tier) -> Starter:  # noqa: ANN001 - tests/faults/conftest.py's real-process starter
    return serve_tier


def _fleet(start: Starter, url: str, cluster: str, model: str) -> None:
    common = {"fleet": {"cluster": cluster}, "heartbeat_s": 1.0}
    tier = {**common, "model_path": model, "placement": {"device": "cpu"}}
    start("trainer", url, {**tier, "worker_id": "trainer-0"})
    start("rollout", url, {**tier, "worker_id": "rollout-0"})
    start("reward", url, {**common, "endpoints": {"default": REWARD}, "worker_id": "reward-0"})


def _trainer(url: str, cluster: str, model: str, tmp_path: Path) -> GRPOTrainer:
    config = TrainerConfig(
        fleet={"nats_url": url, "cluster": cluster}, reward={"url": url, "cluster": cluster},
        rollout_batch_size=4, train_batch_size=4, group_size=2, micro_batch_size=4, max_prompt_length=32,
        max_response_length=6, kl_coef=0.0, device="cpu", seed=3, output_dir=str(tmp_path / "run"),
        loggers=["jsonl"], sample_table_size=0, startup_timeout_s=180,
    )  # fmt: skip
    dataset = PromptDataset(str(DATA), max_prompt_length=32, seed=3)
    return GRPOTrainer(model, REWARD, dataset, config)


def _deaths(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is dead" in r.getMessage()]


@pytest.mark.timeout(600)
def test_a_run_survives_a_30s_outage_of_its_nats_server(
    workers: Starter, tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    cluster = f"out-{uuid.uuid4().hex[:6]}"
    with EmbeddedNats(jetstream=False) as nats:
        _fleet(workers, nats.url, cluster, str(tiny_model_dir))
        trainer = _trainer(nats.url, cluster, str(tiny_model_dir), tmp_path)
        down: list[float] = []
        finished = threading.Event()

        stopped = threading.Event()

        def outage() -> None:
            nats.stop(keep_port=True)
            down.append(time.monotonic())
            stopped.set()
            time.sleep(OUTAGE_S)
            nats.start()
            down.append(time.monotonic())
            finished.wait()  # the server dies with the thread that started it (PDEATHSIG)

        thread = threading.Thread(target=outage, name="nats-outage")

        try:
            steps = trainer.steps(num_epochs=1, max_steps=3)
            first = next(steps)
            thread.start()
            assert stopped.wait(30)
            begun = time.monotonic()
            second = next(steps)  # its first request goes out on the dead socket: sent again later
            ended = time.monotonic()
            third = next(steps)
            registry = trainer.fleet.registry
            alive = {
                tier: [w.worker_id for w in registry.workers(tier)]
                for tier in ("trainer", "rollout", "reward")
            }
            drops = trainer.fleet_run.transport.drops
        finally:
            trainer.close()
            finished.set()
            nats.stop()  # from this thread, before the outage thread ends
            thread.join()
    assert [first.step, second.step, third.step] == [1, 2, 3]
    assert ended - begun >= OUTAGE_S - 1.0, "step 2 ran across the outage"
    assert ended - down[1] < 120.0, f"step 2 resumed {ended - down[1]:.0f}s after the server came back"
    assert drops == 1
    assert _deaths(caplog) == [], "a live worker was reaped during the outage"
    assert alive == {"trainer": ["trainer-0"], "rollout": ["rollout-0"], "reward": ["reward-0"]}


@pytest.mark.timeout(600)
def test_a_run_fails_over_when_a_node_of_its_3_node_nats_cluster_stops(
    workers: Starter, tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    cluster = f"ha-{uuid.uuid4().hex[:6]}"
    ports = [free_port() for _ in range(3)]
    routes = [f"nats://127.0.0.1:{p}" for p in ports]
    nodes = [EmbeddedNats(jetstream=False, cluster_port=p, routes=[r for r in routes if r != route])
             for p, route in zip(ports, routes, strict=True)]  # fmt: skip
    try:
        for node in nodes:
            node.start()
        url = ",".join(node.url for node in nodes)
        _fleet(workers, url, cluster, str(tiny_model_dir))
        trainer = _trainer(url, cluster, str(tiny_model_dir), tmp_path)
        try:
            steps = trainer.steps(num_epochs=1, max_steps=3)
            first = next(steps)
            transport = trainer.fleet_run.transport
            port = transport.client.connected_url.port
            [on] = [node for node in nodes if node.port == port]
            on.stop()  # the controller's node, for good
            second = next(steps)
            third = next(steps)
            now_on = transport.client.connected_url.port
            drops = transport.drops
            registry = trainer.fleet.registry
            alive = {
                tier: [w.worker_id for w in registry.workers(tier)]
                for tier in ("trainer", "rollout", "reward")
            }
        finally:
            trainer.close()
    finally:
        for node in nodes:
            node.stop()
    assert [first.step, second.step, third.step] == [1, 2, 3]
    assert drops == 1 and now_on != port, "the controller failed over to another node"
    assert _deaths(caplog) == []
    assert alive == {"trainer": ["trainer-0"], "rollout": ["rollout-0"], "reward": ["reward-0"]}
