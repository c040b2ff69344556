"""Scoring streams inside a step (issue 30, point 1): a chunk is scored as soon as its rollout worker
returns it, while the step's other chunks still generate, and the step trains on exactly what it
trained on when every chunk was scored after generation.

The real :class:`~rlfleet.controller.fleet.Fleet`, :class:`~rlfleet.controller.reward_control.RewardControl`
and :class:`~rlfleet.controller.online.OnlineStep` run against fake rollout, reward and trainer
workers on the in-process transport. The rollout workers put real batches (texts derived from the
prompts and the sampling seed) in a real TensorStore; the reward (a fake reward worker, or a
Python reward scored in the controller) scores those texts with the prompts' metadata. Rollout
worker ``r-a`` holds its chunk, the step's first, until a chunk's score was answered (or
:data:`HOLD_S` passed): with streaming, another chunk's score releases it; scored after
generation, nothing does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.control.inproc_transport import InProcessBroker, InProcessTransport
from rlfleet.common.control.messages import (
    AnyMessage,
    GenerateRequest,
    GenerateResult,
    LoadWeights,
    PublishWeights,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
    TrainStepRequest,
    TrainStepResult,
    WeightsLoaded,
    WeightsPublished,
    WorkerAnnounce,
)
from rlfleet.common.control.transport import membership_subject, subject, worker_subject
from rlfleet.common.schema.batch import unpack_texts
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.worker import TensorPlaneSettings
from rlfleet.common.tensors.server import TensorStoreServer
from rlfleet.common.tensors.store import worker_store
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.dataset import PromptItem
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.fleet import Fleet
from rlfleet.controller.online import FixedKLController, OnlineStep
from rlfleet.controller.own_store import OwnStore
from rlfleet.controller.ports import ChunkDone, RunState
from rlfleet.controller.python_reward import PythonReward
from rlfleet.controller.python_scorer import TEXT_TENSORS
from rlfleet.controller.reward_control import RewardControl
from rlfleet.controller.routing import RolloutRouter, text_batch

CLUSTER = "unit"
GROUP = 2  # samples per prompt
HOLD_S = 3.0
"""How long ``r-a`` holds its chunk when no score starts (the order before streaming)."""
POOLS = {"r-a": "p1", "r-b": "p1", "r-c": "p2"}
"""Rollout workers and their pools; ``r-a`` (first by id) generates pool p1's first chunk."""

pytestmark = pytest.mark.timeout(60)


def reward(prompt: str, response: str, bonus: int = 0) -> float:
    """The step's reward, per sample: it depends on the prompt, the response and the prompt's metadata."""
    return sum(map(ord, response)) % 13 + bonus / 10 + len(prompt) / 100


class StepFleet(Fleet):
    """The real fleet, noting when each score starts. ``streaming=False`` hides each chunk's arrival
    from the step, so every chunk is scored after generation: the order before streaming."""

    def __init__(self, transport: InProcessTransport, *, streaming: bool) -> None:
        faults = FaultSettings(retry_attempts=2, retry_backoff_s=0.01, empty_pool_wait_s=2.0)
        super().__init__(transport, CLUSTER, request_timeout=30.0, faults=faults)
        self.streaming = streaming
        self.score_started: list[tuple[float, str]] = []  # (perf_counter, the chunk's worker)
        self.answered = asyncio.Event()
        """Set once a score was answered (or failed): what ``r-a`` waits for."""

    async def generate(
        self, prompts: Any, sampling: SamplingParams, weight_version: int, *, pool: str | None = None,
        on_chunk: ChunkDone | None = None, episode: Any = None,
    ) -> list[GenerateResult]:  # fmt: skip
        told = on_chunk if self.streaming else None
        return await super().generate(prompts, sampling, weight_version, pool=pool, on_chunk=told,
                                      episode=episode)  # fmt: skip

    async def score(self, results: Any, metadata: Any, endpoint: str) -> list[ScoreResult]:
        self.score_started += [(time.perf_counter(), r.worker_id) for r in results]
        try:
            return await super().score(results, metadata, endpoint)
        finally:
            self.answered.set()


class RolloutWorker:
    """Generates a batch whose texts follow from each prompt and the sampling seed, into ``store``;
    ``hold`` (when given) keeps the reply until it is set, at most :data:`HOLD_S`."""

    def __init__(self, tiers: Tiers, worker_id: str, hold: asyncio.Event | None) -> None:
        self.tiers, self.worker_id, self.hold = tiers, worker_id, hold
        self.transport = InProcessTransport(tiers.broker, tier="rollout", name=worker_id)
        self.replied_at: list[float] = []

    async def start(self) -> None:
        own = worker_subject(CLUSTER, "rollout", self.worker_id)
        await self.transport.subscribe(own, self._on_message)
        await self.transport.publish(membership_subject(CLUSTER, "rollout"), WorkerAnnounce(
            tier="rollout", worker_id=self.worker_id, weight_version=0, pool=POOLS[self.worker_id],
            subject=own, incarnation=f"{self.worker_id}-1",
        ))  # fmt: skip

    async def _on_message(self, message: AnyMessage) -> AnyMessage:
        if isinstance(message, LoadWeights):
            return WeightsLoaded(worker_id=self.worker_id, weight_version=message.weight_version)
        assert isinstance(message, GenerateRequest)
        if self.hold is not None:
            try:
                await asyncio.wait_for(self.hold.wait(), HOLD_S)
            except TimeoutError:
                pass
        prompts = message.prompt_token_ids
        seed = message.sampling.seed
        items = [PromptItem(0, "", list(p)) for p in prompts]
        texts = [[f"{(sum(p) + seed + j) % 10}{len(p) % 7}" for j in range(GROUP)] for p in prompts]
        tensors, tokens = text_batch(items, texts, self.tiers.tokenizer, 8)
        ref = self.tiers.rollout_store.put_local(f"rollout/{self.worker_id}/{message.job_id}", tensors)
        self.replied_at.append(time.perf_counter())
        return GenerateResult(job_id=message.job_id, worker_id=self.worker_id, weight_version=0, ref=ref,
                              num_prompts=len(prompts), num_samples=GROUP * len(prompts),
                              num_tokens=tokens)  # fmt: skip


@dataclass
class Tiers:
    """One step's fake tiers on one in-process broker, and what they were sent."""

    broker: InProcessBroker
    tokenizer: Any
    rollout_store: TensorStoreServer
    own: OwnStore
    rollout: dict[str, RolloutWorker] = field(default_factory=dict)
    trained: list[TrainStepRequest] = field(default_factory=list)
    refuse: str = ""
    """A rollout worker whose first chunk the reward worker cannot fetch (lost with its store)."""
    refused: set[str] = field(default_factory=set)
    refused_at: list[float] = field(default_factory=list)
    transports: list[InProcessTransport] = field(default_factory=list)

    async def start(self, fleet: StepFleet) -> None:
        await fleet.start()  # its registry hears the workers announce
        serve = InProcessTransport(self.broker, tier="reward", name="reward-0")
        await serve.subscribe(subject(CLUSTER, "reward", "score"), self._score)
        trainer = InProcessTransport(self.broker, tier="trainer", name="trainer-0")
        await trainer.subscribe(subject(CLUSTER, "trainer", "step"), self._train)
        await trainer.subscribe(subject(CLUSTER, "trainer", "publish"), self._publish)
        self.transports += [serve, trainer]
        for worker_id in POOLS:
            worker = RolloutWorker(self, worker_id, fleet.answered if worker_id == "r-a" else None)
            self.rollout[worker_id] = worker
            self.transports.append(worker.transport)
            await worker.start()
        await fleet.wait_ready({"rollout": len(POOLS)}, timeout=5)

    async def _score(self, message: AnyMessage) -> ScoreResult:
        assert isinstance(message, ScoreRequest)
        key = message.rollout.key
        if self.refuse and key.startswith(f"rollout/{self.refuse}/") and self.refused <= {key}:
            self.refused.add(key)
            self.refused_at.append(time.perf_counter())
            raise LookupError(f"no key {key!r} in the store")
        texts = await self.texts(message.rollout)
        scores = [reward(p, r, **message.metadata[g]) for p, r, g in zip(*texts, strict=True)]
        return ScoreResult(job_id=message.job_id, endpoint=message.endpoint, spec_version="spec-r1",
                           scores=scores)  # fmt: skip

    async def texts(self, ref: TensorRef) -> tuple[list[str], list[str], list[int]]:
        """A chunk's prompt and response texts and each sample's prompt, as the reward tier reads them."""
        got = await self.own.fetch(ref, TEXT_TENSORS)
        prompts = unpack_texts(got["prompt_text"], got["prompt_text_offsets"])
        responses = unpack_texts(got["response_text"], got["response_text_offsets"])
        return prompts, responses, [int(g) for g in got["group_index"].tolist()]

    async def _train(self, message: AnyMessage) -> TrainStepResult:
        assert isinstance(message, TrainStepRequest)
        self.trained.append(message)
        loss = sum((k + 1) * s for k, s in enumerate(message.scores))  # depends on the order of the scores
        return TrainStepResult(step=message.step, metrics={"loss": loss}, weight_version=0)

    async def _publish(self, message: AnyMessage) -> WeightsPublished:
        assert isinstance(message, PublishWeights)
        return WeightsPublished(weight_version=1, buckets=[], nbytes=0, seconds=0.01)


@dataclass
class Stepped:
    """One step's metrics, its fleet and tiers (what they recorded), and what it trained on."""

    metrics: dict[str, float]
    fleet: StepFleet
    tiers: Tiers
    batches: list[tuple[list[str], list[str], list[int]]]
    """The texts of each chunk the trainer was sent, in the order sent."""


def _batch(tokenizer: Any) -> list[PromptItem]:
    texts = ["7+5=", "how many legs", "1,2,3", "two plus two", "9-4", "count to 3", "40/8", "six"]
    return [
        PromptItem(i, t, tokenizer(t)["input_ids"], metadata={"bonus": 3 * i % 5})
        for i, t in enumerate(texts)
    ]


async def _step(
    tmp_path: Path, tokenizer: Any, *, streaming: bool, python: bool = False, refuse: str = ""
) -> Stepped:
    """One online step over fresh fake tiers: pool p1 serves the even rows, p2 the odd ones."""
    broker = InProcessBroker()
    settings = TensorPlaneSettings()
    rollout_store = await worker_store(settings, capacity_bytes=1 << 26, ttl_s=600.0)
    own = OwnStore(settings, listen_all=False)
    tiers = Tiers(broker, tokenizer, rollout_store, own, refuse=refuse)
    fleet = StepFleet(InProcessTransport(broker, name="controller"), streaming=streaming)
    config = TrainerConfig(rollout_batch_size=8, train_batch_size=8, group_size=GROUP, max_prompt_length=32,
                           max_response_length=8, kl_coef=0.0, seed=5, output_dir=str(tmp_path))  # fmt: skip
    control = RewardControl(fleet.transport, CLUSTER, fleet.registry, token="", request_timeout=30.0,
                            faults=fleet.faults)  # fmt: skip
    control.store = own
    if python:
        control.use_python(PythonReward(reward), config.reward.endpoint)
    fleet.reward = control
    try:
        await tiers.start(fleet)
        router = RolloutRouter(tokenizer, 8, own.get, ["p1", "p2"])
        router.fn = lambda item: "p1" if item.index % 2 == 0 else "p2"
        step = OnlineStep(RunState(config, tmp_path, CLUSTER), own, FixedKLController(0.0), router)
        metrics = await step.step(_batch(tokenizer), fleet)
        [trained] = tiers.trained
        batches = [await tiers.texts(ref) for ref in trained.rollouts]
        return Stepped(metrics, fleet, tiers, batches)
    finally:
        await fleet.close()
        for transport in [fleet.transport, *tiers.transports]:
            await transport.close()
        await own.stop()
        await rollout_store.stop()


def _same_step(ours: Stepped, theirs: Stepped) -> None:
    """Both steps trained on the same chunks (texts, order) with the same scores and metrics."""
    assert ours.batches == theirs.batches
    assert ours.tiers.trained[0].scores == theirs.tiers.trained[0].scores
    timing = ("time/", "throughput/", "publish/", "rollout/load_s")
    kept = lambda m: {k: v for k, v in m.items() if not k.startswith(timing)}  # noqa: E731
    assert kept(ours.metrics) == kept(theirs.metrics)


@pytest.mark.parametrize("python", [False, True], ids=["reward-worker", "python-reward"])
async def test_a_chunk_is_scored_while_the_others_generate_and_the_step_trains_the_same(
    tmp_path: Path, char_tokenizer: Any, python: bool
) -> None:
    streamed = await _step(tmp_path / "streamed", char_tokenizer, streaming=True, python=python)
    after = await _step(tmp_path / "after", char_tokenizer, streaming=False, python=python)

    held = streamed.tiers.rollout["r-a"].replied_at[0]  # the step's first chunk, generated last
    first_score, by = streamed.fleet.score_started[0]
    assert first_score < held and by in ("r-b", "r-c"), "a chunk was scored while r-a still generated"
    assert {w for _, w in streamed.fleet.score_started} == set(POOLS), "every pool's chunks were scored"
    assert streamed.metrics["time/score_overlap_s"] > 0.0
    assert streamed.metrics["time/generate_s"] < HOLD_S, "r-a was released by a score, not by its timeout"

    assert min(t for t, _ in after.fleet.score_started) > after.tiers.rollout["r-a"].replied_at[0]
    assert after.metrics["time/score_overlap_s"] == 0.0

    _same_step(streamed, after)
    assert len(streamed.batches) == 3 and [len(b[1]) for b in streamed.batches] == [4, 4, 8]
    rows = [it.text for it in _batch(char_tokenizer)]
    prompts = [p for b in streamed.batches for p in dict.fromkeys(b[0])]
    assert prompts == rows[0::2] + rows[1::2], "in route, then prompt, order: p1's r-a, r-b, then p2's r-c"
    assert streamed.metrics["rollout/samples"] == 8 * GROUP
    metadata = {it.text: it.metadata for it in _batch(char_tokenizer)}  # each chunk scored with its own rows'
    expected = [reward(p, r, **metadata[p]) for b in streamed.batches for p, r, _ in zip(*b, strict=True)]
    assert streamed.tiers.trained[0].scores == expected


async def test_a_chunk_lost_while_scored_on_arrival_is_made_again_in_its_place(
    tmp_path: Path, char_tokenizer: Any
) -> None:
    """r-b's chunk, scored as it arrives, cannot be fetched (its store lost it): it is generated again
    on r-a (same prompts, same seed) and scored, in its place; the step trains what it would have."""
    lost = await _step(tmp_path / "lost", char_tokenizer, streaming=True, refuse="r-b")
    plain = await _step(tmp_path / "plain", char_tokenizer, streaming=True)
    assert len(lost.tiers.refused) == 1 and lost.metrics["rollout/chunks_regenerated"] == 1.0
    first_reply, again = lost.tiers.rollout["r-a"].replied_at  # r-a's own chunk, then r-b's made again
    assert lost.tiers.refused_at[0] < first_reply, "the lost chunk was scored as it arrived"
    assert lost.tiers.refused_at[-1] < again
    assert [r.key.split("/")[1] for r in lost.tiers.trained[0].rollouts] == ["r-a", "r-a", "r-c"]
    plain.metrics["rollout/chunks_regenerated"] = 1.0
    _same_step(lost, plain)
