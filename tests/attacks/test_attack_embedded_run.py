"""A real embedded GRPO run (tiny model, every tier a process) under attack while it trains.

While the run takes its steps, an attacker thread with its own connections tries every hole of
issue 11 on the control plane, round after round: without credentials (the server refuses the
connection), and with each worker role's own credential (the rollout role's from the run's join
file, the trainer's and reward's as the run made them): shut each worker down, drive
``trainer.step/publish/save/load/configure``, push weights into the rollout worker, generate,
forge announces and leaves of other tiers, join the reward queue group, read the controller's
replies or the trainer's subjects. Every publish and subscription must come back as the server's
permissions violation naming its subject.

Inside a step, after the rollout batch is made and before it is trained on, a tensor-plane
attacker holding the batch's ref (what a reward worker holds) tries to delete the batch with the
ref's capability and to overwrite its key, and one without the capability tries to read it; after
each publish, one without capabilities tries to read the trainer's weights (with the key itself,
with a rollout ref's capability) and list the trainer's store. Each gets ``TensorAccessDenied``
naming what it lacks. Then the run must finish every step unharmed: the same workers alive and
registered, one weight version per step, the batch trained on as it was made.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import grpc
import nats
import pytest
import torch
import yaml

from rlfleet.common.control.messages import LoadWeights, Message, Shutdown, WorkerAnnounce, WorkerLeave
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import membership_subject, subject, worker_subject
from rlfleet.common.errors import NatsServerError, TensorAccessDenied
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.tensors.codec import encode_chunk, split_tensors
from rlfleet.common.tensors.rpc import error_from_rpc, method
from rlfleet.common.tensors.store import TensorStoreClient
from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
STEPS = 3
WORKERS = {"trainer": "trainer-0", "rollout": "rollout-0", "reward": "reward-0"}


def control_attacks(cluster: str, role: str) -> tuple[dict[str, tuple[str, Message]], dict[str, str]]:
    """What a client of ``role`` tries: publishes (name -> subject, message) and subscriptions."""
    fake = TensorRef(address="10.6.6.6:6666", key="weights/v99/0")
    publishes: dict[str, tuple[str, Message]] = {
        f"shut {worker} down": (worker_subject(cluster, tier, worker), Shutdown(reason="attack"))
        for tier, worker in WORKERS.items()
    }
    for verb in ("step", "publish", "save", "load", "configure"):
        publishes[f"trainer.{verb}"] = (subject(cluster, "trainer", verb), Shutdown(reason="attack"))
    publishes["push weights"] = (worker_subject(cluster, "rollout", "rollout-0"),
                                 LoadWeights(weight_version=99, buckets=[fake]))  # fmt: skip
    publishes["generate"] = (subject(cluster, "rollout", "generate"), Shutdown(reason="attack"))
    for tier, worker in WORKERS.items():
        if tier == role:
            continue  # a role announces its own tier: the shared credential (README, what remains)
        evil = WorkerAnnounce(tier=tier, worker_id="evil", subject=worker_subject(cluster, tier, "evil"))
        publishes[f"announce a {tier}"] = (membership_subject(cluster, tier), evil)
        publishes[f"make {worker} leave"] = (membership_subject(cluster, tier),
                                            WorkerLeave(tier=tier, worker_id=worker))  # fmt: skip
    subscriptions = {"read the controller's replies": "_INBOX.controller.>"}
    if role != "reward":
        subscriptions["join the reward queue group"] = subject(cluster, "reward", "score")
    if role != "trainer":
        subscriptions["hear the trainer's commands"] = subject(cluster, "trainer", ">")
    return publishes, subscriptions


async def attack_as(url: str, cluster: str, role: str, auth: NatsConnection) -> dict[str, str]:
    """One round as ``role``: every attack and the server's answer to it (``''``: no refusal seen)."""
    errors: list[str] = []

    async def collect(exc: Exception) -> None:
        errors.append(str(exc).lower())

    client = await nats.connect(url, error_cb=collect, allow_reconnect=False,
                                **auth.resolved({}).connect_options())  # fmt: skip
    publishes, subscriptions = control_attacks(cluster, role)
    try:
        for target, message in publishes.values():
            await client.publish(target, message.model_dump_json().encode())
        for target in subscriptions.values():
            queue = "reward" if target.endswith(".reward.score") else ""
            await client.subscribe(target, queue=queue)
        await client.flush()
        await asyncio.sleep(0.5)  # the server's -ERR lines arrive after the flush
    finally:
        await client.close()
    answers = {}
    for name, (target, _) in publishes.items():
        answers[name] = next((e for e in errors if f'publish to "{target.lower()}"' in e), "")
    for name, target in subscriptions.items():
        answers[name] = next((e for e in errors if f'subscription to "{target.lower()}"' in e), "")
    return answers


class Attacker(threading.Thread):
    """Attacks the control plane in rounds, on its own event loop, until told to stop."""

    def __init__(self, url: str, cluster: str, roles: dict[str, NatsConnection]) -> None:
        super().__init__(name="attacker", daemon=True)
        self.url, self.cluster, self.roles = url, cluster, roles
        self.stop = threading.Event()
        self.rounds: list[dict[str, dict[str, str]]] = []
        self.anonymous: list[str] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._rounds())
        except BaseException as exc:  # reported by the test
            self.failure = exc

    async def _rounds(self) -> None:
        while not self.stop.is_set() or not self.rounds:
            try:
                await NatsTransport.connect(self.url, name="anonymous", env={}, connect_timeout=3.0,
                                            max_reconnect_attempts=0)  # fmt: skip
                self.anonymous.append("")
            except NatsServerError as exc:
                self.anonymous.append(str(exc))
            answers = {}
            for role, auth in self.roles.items():
                answers[role] = await attack_as(self.url, self.cluster, role, auth)
            self.rounds.append(answers)


async def _raw_put(ref: TensorRef, tensors: dict[str, torch.Tensor]) -> Exception:
    """A Put of ``tensors`` under the ref's own key, without the store's secret (an overwrite)."""
    async with grpc.aio.insecure_channel(ref.address) as channel:
        call = channel.stream_unary(method("Put"))()
        try:
            for chunk in split_tensors(ref.key, tensors, 1 << 16):
                await call.write(encode_chunk(chunk))
            await call.done_writing()
        except (asyncio.InvalidStateError, grpc.RpcError):  # the store ended the call: its answer is below
            pass
        try:
            await call
        except grpc.RpcError as err:
            return error_from_rpc(err, ref.address, tuple(await call.initial_metadata() or ()))
    raise AssertionError(f"the store took a put of {ref.key!r} without its secret")


class TensorAttacks:
    """Tensor-plane attacks run inside the run's steps; ``tried`` records what each got back."""

    def __init__(self) -> None:
        self.tried: dict[str, list[str]] = {}
        self.rollout_ref: TensorRef | None = None

    def refused(self, name: str, exc: pytest.ExceptionInfo[TensorAccessDenied]) -> None:
        self.tried.setdefault(name, []).append(str(exc.value))

    async def on_batch(self, ref: TensorRef) -> None:
        """A fresh rollout batch, not yet scored nor trained on."""
        self.rollout_ref = ref
        async with TensorStoreClient(ref.address) as holder:  # holds the ref, as a reward worker does
            before = await holder.fetch(ref)
            with pytest.raises(TensorAccessDenied, match="delete needs the store's secret") as info:
                await holder.delete(ref)
            self.refused("delete a batch with its capability", info)
            overwrite = await _raw_put(ref, {name: torch.zeros_like(t) for name, t in before.items()})
            assert isinstance(overwrite, TensorAccessDenied) and "put needs the store's secret" in str(
                overwrite
            )
            self.tried.setdefault("overwrite a rollout key", []).append(str(overwrite))
            with pytest.raises(TensorAccessDenied, match="no valid capability") as info:
                await holder.get(ref.key)  # the key without its capability
            self.refused("read a batch without its capability", info)
            after = await holder.fetch(ref)
        assert all(torch.equal(before[name], after[name]) for name in before), "the batch was changed"

    async def on_publish(self, bucket: TensorRef) -> None:
        """A weight bucket the trainer just published (its key is in hand, its capability is not)."""
        assert self.rollout_ref is not None
        async with TensorStoreClient(bucket.address) as stranger:
            with pytest.raises(TensorAccessDenied, match="no valid capability") as info:
                await stranger.get(bucket.key)
            self.refused("read the trainer's weights without the capability", info)
            borrowed = bucket.model_copy(update={"capability": self.rollout_ref.capability})
            with pytest.raises(TensorAccessDenied, match="no valid capability") as info:
                await stranger.fetch(borrowed)
            self.refused("read the weights with another key's capability", info)
            with pytest.raises(TensorAccessDenied, match="store-wide stat needs the store's secret") as info:
                await stranger.stat()
            self.refused("list the trainer's store", info)
            with pytest.raises(TensorAccessDenied, match="delete needs the store's secret") as info:
                await stranger.delete(bucket)
            self.refused("delete the trainer's weights", info)


def _watch(trainer: GRPOTrainer, attacks: TensorAttacks) -> list[Any]:
    """Run ``attacks`` inside each step (after generation; after the publish); the steps' batches."""
    fleet = trainer.fleet
    score, load = fleet.score, fleet.load_weights
    batches: list[Any] = []

    async def score_attacked(results: list[Any], *args: Any, **kwargs: Any) -> Any:
        if results[0].worker_id != "controller":
            await attacks.on_batch(results[0].ref)
            batches.append(results[0].ref)
        return await score(results, *args, **kwargs)

    async def load_attacked(published: Any, *keep: int) -> Any:  # the publish: the buckets, then every load
        done = await load(published, *keep)
        await attacks.on_publish(published.buckets[0])
        return done

    fleet.score = score_attacked  # type: ignore[method-assign]
    fleet.load_weights = load_attacked  # type: ignore[method-assign]
    return batches


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_embedded_run_under_attack_trains_unharmed(tmp_path: Path, tiny_model_dir: Path, procs) -> None:
    config = TrainerConfig(
        rollout_batch_size=4, train_batch_size=4, group_size=2, max_prompt_length=32, max_response_length=8,
        output_dir=str(tmp_path / "run"), loggers=["jsonl"], sample_table_size=0, device="cpu",
    )  # fmt: skip
    trainer = GRPOTrainer(str(tiny_model_dir), "charset:allowed=0123456789",
                          PromptDataset(str(DATA), max_prompt_length=32, seed=1), config)  # fmt: skip
    attacks = TensorAttacks()
    try:
        trainer.start()
        run = trainer.fleet_run
        assert run.launcher is not None
        joined = yaml.safe_load(run.join_config.read_text())  # the rollout role's, as a joiner reads it
        roles = {"rollout": NatsConnection.model_validate(joined["nats_auth"]),
                 **{role: run.launcher.connection(role) for role in ("trainer", "reward")}}  # fmt: skip
        batches = _watch(trainer, attacks)
        attacker = Attacker(trainer.nats_url, trainer.cluster, roles)
        attacker.start()
        try:
            results = list(trainer.steps(max_steps=STEPS))  # trained while the attacker works
        finally:
            attacker.stop.set()
            attacker.join(timeout=60)
        assert attacker.failure is None, attacker.failure
        run.launcher.check()  # every worker process still runs
        registry = trainer.fleet.registry
        assert {tier: [w.worker_id for w in registry.workers(tier)] for tier in WORKERS} == {
            tier: [worker] for tier, worker in WORKERS.items()
        }  # nothing forged joined, nothing real left
        started = procs.launched(run.state.output_dir)
    finally:
        trainer.close()
    assert procs.survivors(started) == []

    assert [r.step for r in results] == list(range(1, STEPS + 1))
    assert [r.weight_version for r in results] == list(range(1, STEPS + 1))
    assert len(batches) == STEPS and all("reward/mean" in r.metrics for r in results)
    assert attacker.rounds and all("refused these credentials" in text for text in attacker.anonymous)
    for answers in attacker.rounds:
        for role, tried in answers.items():
            missed = [name for name, answer in tried.items() if "permissions violation" not in answer]
            assert missed == [], f"{role} was not refused: {missed}"
    assert sorted(attacks.tried) == sorted([
        "delete a batch with its capability", "overwrite a rollout key",
        "read a batch without its capability", "read the trainer's weights without the capability",
        "read the weights with another key's capability", "list the trainer's store",
        "delete the trainer's weights",
    ])  # fmt: skip
    assert all(len(answers) == STEPS for answers in attacks.tried.values())
