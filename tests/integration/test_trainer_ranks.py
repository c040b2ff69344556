"""A trainer of two gloo ranks behind one NATS worker, started as the embedded launcher does.

Rank 0 answers ``trainer.step``, ``trainer.publish`` and ``trainer.save``; rank 1 follows its
commands, fetches the rollouts itself and trains with the settings the step carries. The step's
metrics, the published weights and the saved checkpoint must equal what one process computes on
the same batch with the same settings.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import torch

from rlfleet.common.control.messages import (
    PublishWeights,
    SaveCheckpoint,
    Saved,
    TrainStepRequest,
    TrainStepResult,
    WeightsPublished,
)
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject
from rlfleet.common.errors import NoResponders
from rlfleet.common.schema.trainer import BatchSettings, StepSettings, TrainerWorkerConfig, UpdateSettings
from rlfleet.common.tensors.store import TensorStoreClient, TensorStoreServer
from rlfleet.controller.launcher import EmbeddedFleet, trainer_rank_specs
from rlfleet.trainer.model_io import load_causal_lm
from rlfleet.trainer.ranks import build_models
from rlfleet.trainer.service import merge_batch, run_step

CLUSTER = "ranks"
PROMPTS, RESPONSES = [3, 5, 2, 4, 5, 3], [4, 2, 6, 1, 3, 5]


def _rollouts(vocab: int) -> dict[str, torch.Tensor]:
    """A contract batch of 3 prompts x 2 samples (left-padded prompts, right-padded responses)."""
    gen = torch.Generator().manual_seed(5)
    n, p, r = len(PROMPTS), max(PROMPTS), max(RESPONSES)
    batch = {key: torch.zeros((n, width), dtype=torch.int64) for key, width in
             (("prompt_ids", p), ("prompt_mask", p), ("response_ids", r), ("response_mask", r))}  # fmt: skip
    for i, (pl, rl) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        batch["prompt_ids"][i, p - pl :] = torch.randint(3, vocab, (pl,), generator=gen)
        batch["prompt_mask"][i, p - pl :] = 1
        batch["response_ids"][i, :rl] = torch.randint(3, vocab, (rl,), generator=gen)
        batch["response_mask"][i, :rl] = 1
    batch["rollout_logprobs"] = -torch.rand((n, r), generator=gen) * batch["response_mask"]
    batch["group_index"] = torch.arange(n) // 2
    return batch


def worker_settings(model_dir: Path, algorithm: str = "grpo", **update: object) -> dict[str, object]:
    """A trainer worker's config on CPU (seed 0, one thread) with its default step settings: micro-batches
    of 2 at learning rate 1e-3, and ``update``'s over them."""
    step = {"algorithm": algorithm, "update": {"micro_batch_size": 2, "learning_rate": 1e-3, **update}}
    return {"fleet": {"cluster": CLUSTER}, "model_path": str(model_dir), "threads": 1,
            "placement": {"device": "cpu", "seed": 0}, "step": step}  # fmt: skip


async def _ask(transport: NatsTransport, verb: str, message: object, deadline: float) -> object:
    """Request ``trainer.<verb>``, waiting for the worker to subscribe (it loads its model first)."""
    while True:
        try:
            return await transport.request(subject(CLUSTER, "trainer", verb), message, timeout=120)  # type: ignore[arg-type]
        except NoResponders:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


class TwoRanks:
    """A nats-server, two trainer ranks of ``settings`` and a store holding ``batch``; ``ask`` a verb.

    ``async with TwoRanks(...) as ranks``: on leaving, everything is stopped; ``ranks.pids`` were its
    rank processes.
    """

    def __init__(self, run_dir: Path, settings: dict, batch: dict[str, torch.Tensor]) -> None:
        # save/load paths must lie under the trainer's checkpoint root: the test's own directory
        self.settings, self.batch = {"checkpoint_root": str(run_dir.parent), **settings}, batch
        self.store = TensorStoreServer(capacity_bytes=1 << 28, ttl_s=600)
        self.fleet = EmbeddedFleet(run_dir, jetstream=False)
        self.transport: NatsTransport | None = None
        self.pids: list[int] = []

    async def __aenter__(self) -> TwoRanks:
        await self.store.start()
        self.ref = self.store.put_local("rollouts/0", self.batch)
        try:
            url = self.fleet.start_nats()
            specs = trainer_rank_specs(self.settings, 2)
            assert [s.env["RANK"] for s in specs] == ["0", "1"] and specs[0].env["MASTER_PORT"]
            for spec in specs:
                self.fleet.spawn(spec)
            self.pids = [w.pid for w in self.fleet.workers]
            credentials = self.fleet.processes.credentials
            assert credentials is not None  # the embedded server takes only the run's roles
            self.transport = await NatsTransport.connect(
                url, name="test", tier="controller", auth=credentials.connection("controller")
            )
        except BaseException:
            await self.__aexit__()
            raise
        self.deadline = time.monotonic() + 150
        return self

    async def ask(self, verb: str, message: object) -> object:
        assert self.transport is not None
        return await _ask(self.transport, verb, message, self.deadline)

    async def __aexit__(self, *exc: object) -> None:
        if self.transport is not None:
            await self.transport.close()
        self.fleet.stop()
        await self.store.stop()


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_two_trainer_ranks_serve_like_one_process(tmp_path: Path, tiny_model_dir: Path, procs) -> None:
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    settings = worker_settings(tiny_model_dir)
    batch = _rollouts(vocab)
    # the step's own settings, not the worker's: rank 1 must train with them too (two updates of 3
    # rows in micro-batches of 1; another count of forwards or steps would hang the collectives, and
    # another learning rate would give other weights)
    update = UpdateSettings(learning_rate=2e-3, micro_batch_size=1, clip_eps=0.1, kl_coef=0.05)
    step = StepSettings(update=update, batch=BatchSettings(rollout_batch_size=2, train_batch_size=1))
    async with TwoRanks(tmp_path / "fleet", settings, batch) as ranks:
        request = TrainStepRequest(step=1, rollouts=[ranks.ref], scores=[1.0, 0.0, 0.0, 1.0, 1.0, 0.5],
                                   settings=step)  # fmt: skip
        result = await ranks.ask("step", request)
        assert isinstance(result, TrainStepResult), result
        assert result.metrics["lr"] == pytest.approx(2e-3) and result.metrics["num_optimizer_steps"] == 2
        assert result.metrics["settings/micro_batch_size"] == 1 and result.metrics["settings/clip_eps"] == 0.1
        published = await ranks.ask("publish", PublishWeights(weight_version=1, bucket_mb=0.01))
        assert isinstance(published, WeightsPublished) and len(published.buckets) > 2
        saved = await ranks.ask("save", SaveCheckpoint(path=str(tmp_path / "saved")))
        assert isinstance(saved, Saved)
        client = TensorStoreClient(published.buckets[0].address)
        weights: dict[str, torch.Tensor] = {}
        for bucket in published.buckets:
            weights.update(await client.fetch(bucket))
        # in the engines' dtype: rank 1 gathers in bf16 too (a dtype mismatch would hang the gathers)
        halved = await ranks.ask(
            "publish", PublishWeights(weight_version=2, bucket_mb=0.01, dtype="bfloat16")
        )
        assert isinstance(halved, WeightsPublished) and halved.nbytes * 2 == published.nbytes
        first = await client.fetch(halved.buckets[0])
        assert {t.dtype for t in first.values()} == {torch.bfloat16}
        await client.close()
        ranks.fleet.check()  # both ranks still run
    assert procs.survivors(ranks.pids) == []

    # the same step in this process (one rank, no FSDP)
    _, actor, critic = build_models(TrainerWorkerConfig(**settings))
    expected = run_step(actor, critic, merge_batch("grpo", [batch]), request.scores, step)
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "approx_kl", "lr"):
        assert result.metrics[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    state = actor.model.state_dict()
    assert set(weights) == set(state) - {"lm_head.weight"} or set(weights) == set(state)
    for name, value in weights.items():
        torch.testing.assert_close(value, state[name], atol=1e-5, rtol=1e-4, msg=name)
    reloaded = load_causal_lm(tmp_path / "saved").state_dict()
    for name, value in weights.items():
        torch.testing.assert_close(reloaded[name], value, msg=name)


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_two_ranks_shard_the_ppo_critic_and_step_like_one_process(
    tmp_path: Path, tiny_model_dir: Path, procs
) -> None:
    """PPO over two gloo ranks: actor, reference and critic are all FSDP-sharded (each rank writes its
    own critic shards in a full checkpoint), and the step's actor and critic metrics equal one process's."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    settings = worker_settings(tiny_model_dir, "ppo", kl_coef=0.05)
    batch = _rollouts(vocab)
    full = tmp_path / "full"
    async with TwoRanks(tmp_path / "fleet", settings, batch) as ranks:
        request = TrainStepRequest(step=1, rollouts=[ranks.ref], scores=[1.0, 0.0, 0.0, 1.0, 1.0, 0.5],
                                   settings=StepSettings.of(TrainerWorkerConfig(**settings)))  # fmt: skip
        result = await ranks.ask("step", request)
        assert isinstance(result, TrainStepResult), result
        saved = await ranks.ask("save", SaveCheckpoint(path=str(full), mode="full"))
        assert isinstance(saved, Saved)
        ranks.fleet.check()
    assert procs.survivors(ranks.pids) == []

    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(full / "trainer" / "critic")).read_metadata().state_dict_metadata
    weights = {key: meta for key, meta in stored.items() if key.startswith("model.") and "weight" in key}
    assert weights and all(len(meta.chunks) == 2 for meta in weights.values()), (
        "every critic weight is stored as two shards, one per rank"
    )

    _, actor, critic = build_models(TrainerWorkerConfig(**settings))
    assert critic is not None
    expected = run_step(actor, critic, merge_batch("ppo", [batch]), request.scores, request.settings)
    keys = ("loss", "pg_loss", "grad_norm", "critic/vf_loss", "critic/grad_norm", "critic/vpred_mean",
            "critic/values_mean", "critic/explained_variance", "kl_reward")  # fmt: skip
    for key in keys:
        assert result.metrics[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key


def _pairs(vocab: int) -> dict[str, torch.Tensor]:
    """A preference batch of 5 pairs (odd: one rank gets a padding copy) of uneven lengths."""
    rollouts = _rollouts(vocab)
    n = 5
    flipped = {key: rollouts[key][1:].flip(0) for key in ("response_ids", "response_mask")}
    return {"prompt_ids": rollouts["prompt_ids"][:n], "prompt_mask": rollouts["prompt_mask"][:n],
            "chosen_ids": rollouts["response_ids"][:n], "chosen_mask": rollouts["response_mask"][:n],
            "rejected_ids": flipped["response_ids"], "rejected_mask": flipped["response_mask"]}  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_two_ranks_split_dpo_pairs_and_step_like_one_process(
    tmp_path: Path, tiny_model_dir: Path, procs
) -> None:
    """DPO over two gloo ranks: each rank takes its share of the pairs; two steps equal one process's.

    At step 1 the policy is the reference, so each pair's margin is float noise (ranks pad their pairs
    otherwise than one process does) and ``dpo/accuracy`` counts the noise's sign: it is compared at
    step 2, where one update has moved the policy off the reference."""
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    settings = worker_settings(tiny_model_dir, "dpo")
    batch = _pairs(vocab)
    own = StepSettings.of(TrainerWorkerConfig(**settings))
    results = []
    async with TwoRanks(tmp_path / "fleet", settings, batch) as ranks:
        for step in (1, 2):
            request = TrainStepRequest(step=step, rollouts=[ranks.ref], scores=[], settings=own)
            results.append(await ranks.ask("step", request))
            assert isinstance(results[-1], TrainStepResult), results[-1]
        ranks.fleet.check()
    assert procs.survivors(ranks.pids) == []

    _, actor, critic = build_models(TrainerWorkerConfig(**settings))
    keys = ("loss", "grad_norm", "dpo/chosen_reward", "dpo/rejected_reward", "dpo/margin", "dpo/accuracy")
    for step, result in enumerate(results, start=1):
        expected = run_step(actor, critic, merge_batch("dpo", [batch]), [], own)
        for key in keys[:-1] if step == 1 else keys:
            assert result.metrics[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), (step, key)
    assert abs(results[1].metrics["dpo/margin"]) > 1e-4, "step 2's margins are past float noise"
