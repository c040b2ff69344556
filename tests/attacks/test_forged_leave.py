"""Membership forged in another rollout worker's name (issue 29, point 1), in a real embedded run.

The attacker holds the rollout role's NATS login, which the run hands any worker that joins it
(``fleet/join-rollout.yaml``): the server lets it publish on the rollout membership subject. In each
step, while the run's only rollout worker generates, it publishes a ``WorkerLeave`` in that worker's
name, and an announce in its name with another address, incarnation and capacity. The registry
believes neither (the worker's own subject still answers, with its own announce): the run gives up
no work, regenerates no chunk, keeps the worker as it announced itself, and finishes every step.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml

from rlfleet.common.control.messages import WorkerAnnounce, WorkerLeave
from rlfleet.common.control.transport import membership_subject, worker_subject
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
STEPS = 3


class Forger:
    """Publishes forged membership about ``rollout-0`` with the rollout role's login: a leave, or an
    announce with another address, incarnation, capacity and pid."""

    def __init__(self, url: str, cluster: str, login: NatsConnection, what: str) -> None:
        self.url, self.cluster, self.login, self.what = url, cluster, login, what
        self.sent = 0

    def message(self) -> WorkerLeave | WorkerAnnounce:
        if self.what == "leave":
            return WorkerLeave(tier="rollout", worker_id="rollout-0", reason="forged")
        return WorkerAnnounce(tier="rollout", worker_id="rollout-0", data_address="10.6.6.6:6666",
                              subject=worker_subject(self.cluster, "rollout", "rollout-0"), capacity=64,
                              incarnation="forged", pid=666)  # fmt: skip

    async def forge(self) -> None:
        client = await nats.connect(
            self.url, allow_reconnect=False, **self.login.resolved({}).connect_options()
        )
        try:
            await client.publish(
                membership_subject(self.cluster, "rollout"), self.message().model_dump_json().encode()
            )
            await client.flush()
        finally:
            await client.close()
        self.sent += 1


def _forge_during_generation(trainer: GRPOTrainer, forger: Forger) -> None:
    fleet = trainer.fleet
    generate = fleet.generate

    async def generate_attacked(*args: Any, **kwargs: Any) -> Any:
        work = asyncio.ensure_future(generate(*args, **kwargs))
        await asyncio.sleep(0)  # the generate request goes out to the only rollout worker
        await forger.forge()
        return await work

    fleet.generate = generate_attacked  # type: ignore[method-assign]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("what", ["leave", "announce"])
def test_membership_forged_in_a_rollout_workers_name_changes_nothing(
    what: str, tmp_path: Path, tiny_model_dir: Path, procs
) -> None:
    config = TrainerConfig(
        rollout_batch_size=4, train_batch_size=4, group_size=4, max_prompt_length=32, max_response_length=12,
        output_dir=str(tmp_path / "run"), loggers=["jsonl"], sample_table_size=0, device="cpu",
    )  # fmt: skip
    trainer = GRPOTrainer(str(tiny_model_dir), "charset:allowed=0123456789",
                          PromptDataset(str(DATA), max_prompt_length=32, seed=1), config)  # fmt: skip
    try:
        trainer.start()
        run = trainer.fleet_run
        joined = yaml.safe_load(run.join_config.read_text())  # what a joining worker is given
        login = NatsConnection.model_validate(joined["nats_auth"])
        assert login.user == "rollout"
        forger = Forger(trainer.nats_url, trainer.cluster, login, what)
        registry = trainer.fleet.registry
        real = registry.get("rollout", "rollout-0")
        assert real is not None
        real_announce = real.announce
        started = procs.launched(run.state.output_dir)
        _forge_during_generation(trainer, forger)
        results = list(trainer.steps(max_steps=STEPS))  # today: NoWorkerServed, the run ends
        assert forger.sent == STEPS
        now = registry.get("rollout", "rollout-0")
        assert now is not None, "the forged leave removed the worker"
        assert (now.announce.incarnation, now.data_address, now.announce.capacity, now.announce.pid) == (
            real_announce.incarnation,
            real_announce.data_address,
            real_announce.capacity,
            real_announce.pid,
        ), "the forged announce was adopted"
        assert not trainer.fleet.is_gone("rollout-0")
        assert procs.launched(run.state.output_dir) == started, "no worker was restarted"
    finally:
        trainer.close()
    assert procs.survivors(started) == []
    assert [r.step for r in results] == list(range(1, STEPS + 1))
    assert [r.metrics["rollout/chunks_regenerated"] for r in results] == [0.0] * STEPS, "work was given up"
    assert [r.metrics["rollout/samples"] for r in results] == [16.0] * STEPS
