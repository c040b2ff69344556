"""Fixtures for controller tests: character tokenizers (with and without a chat template), data files,
and ``fake_fleet``: the tiers answered in memory, for the unit tests of the trainers' step loops."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.control.messages import (
    GenerateResult,
    SamplingParams,
    ScoreResult,
    TrainStepRequest,
    TrainStepResult,
    WeightsLoaded,
    WeightsPublished,
)
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.trainer import StepSettings
from rlfleet.common.tensors.store import TensorStoreClient
from rlfleet.controller.errors import TierDied
from rlfleet.controller.tokenizers import build_char_tokenizer

# A tiny ChatML-like template: each message as "<role>content\n", then "<assistant>" to answer.
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="session")
def char_tokenizer() -> Any:
    """Character tokenizer without a chat template (adds <bos> in front)."""
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def chat_tokenizer() -> Any:
    """Character tokenizer with ``CHAT_TEMPLATE``."""
    return build_char_tokenizer(chat_template=CHAT_TEMPLATE)


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture
def jsonl_file(tmp_path: Path) -> Callable[[list[dict[str, Any]]], Path]:
    """Write rows to ``tmp_path/data.jsonl`` and return the path."""
    return lambda rows: write_jsonl(tmp_path / "data.jsonl", rows)


class QuietRegistry:
    """The part of a membership registry the supervisor reads between checks: nobody declared dead."""

    def take_dead(self) -> list[Any]:
        return []


class FakeFleet:
    """Answers the calls a GRPO/PPO/DPO step makes of the fleet (unit layer: no NATS, no workers).

    Records each train-step request (as the trainer would decode it), fetches DPO batches from the
    controller's own store (a real TensorStore), reports ``kl`` in the step metrics when given, and
    reports the trainer dead at step ``fail_train_at``.
    """

    reward = None
    registry = QuietRegistry()

    def __init__(self, *, kl: float | None = None, fail_train_at: int | None = None) -> None:
        self.version = 0
        self.kl = kl
        self.fail_train_at = fail_train_at
        self.train_requests: list[TrainStepRequest] = []
        self.fetched: list[dict[str, Any]] = []
        self.published_with: list[tuple[str, str]] = []  # (carrier setting, dtype) of each publish

    async def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        weight_version: int,
        *,
        pool: str | None = None,
        on_chunk: Callable[[int, GenerateResult], None] | None = None,
        episode: Any = None,
    ) -> list[Any]:
        assert weight_version == self.version, "generation must be pinned to the latest weights"
        ref = TensorRef(address="fake:1", key=f"rollout/{self.version}")
        result = GenerateResult(job_id="g", worker_id="rollout-0", weight_version=self.version, ref=ref,
                                num_prompts=len(prompts), num_samples=len(prompts) * sampling.n)  # fmt: skip
        if on_chunk is not None:  # as the fleet does: the step scores the chunk as it arrives
            on_chunk(0, result)
        return [result]

    async def score(self, results: list[Any], metadata: list[Any], endpoint: str) -> list[ScoreResult]:
        return [ScoreResult(job_id="s", endpoint=endpoint, spec_version="v0", scores=[0.5] * r.num_samples)
                for r in results]  # fmt: skip

    async def train_step(
        self, step: int, rollouts: list[TensorRef], scores: list[float], settings: StepSettings,
        groups: list[list[int]] | None = None,
    ) -> TrainStepResult:  # fmt: skip
        if step == self.fail_train_at:
            raise TierDied("trainer", "trainer-0", 1, error="RuntimeError: out of memory")
        sent = TrainStepRequest(step=step, rollouts=rollouts, scores=scores, settings=settings, groups=groups)
        request = TrainStepRequest.model_validate_json(sent.model_dump_json())  # as the trainer reads it
        self.train_requests.append(request)
        if settings.algorithm.name == "dpo":
            client = TensorStoreClient(rollouts[0].address)
            try:
                self.fetched.append(await client.fetch(rollouts[0]))
            finally:
                await client.close()
        metrics = {"loss": 0.1} if self.kl is None else {"loss": 0.1, "kl": self.kl}
        return TrainStepResult(step=step, metrics=metrics, weight_version=self.version)

    async def publish_weights(
        self, bucket_mb: float, weight_version: int = -1, *, carrier: str = "grpc", dtype: str = ""
    ) -> WeightsPublished:
        self.published_with.append((carrier, dtype))
        self.version += 1
        return WeightsPublished(weight_version=self.version, buckets=[], nbytes=0, seconds=0.01)

    async def load_weights(
        self, published: WeightsPublished, keep_from_version: int = -1
    ) -> list[WeightsLoaded]:
        return [WeightsLoaded(worker_id="rollout-0", weight_version=published.weight_version)]

    async def close(self) -> None:
        return None


@pytest.fixture
def fake_fleet() -> type[FakeFleet]:
    """The :class:`FakeFleet` class: ``fake_fleet(kl=1.0)``, ``fake_fleet(fail_train_at=2)``."""
    return FakeFleet


@pytest.fixture
def attach_fleet(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any, FakeFleet], FakeFleet]:
    """``attach_fleet(trainer, fleet)`` gives the trainer's run ``fleet`` (``start()`` then sees a fleet
    and starts nothing); the fake's rollout batches, which live nowhere, are not released."""

    async def release(results: list[Any]) -> None:
        return None

    def attach(trainer: Any, fleet: FakeFleet) -> FakeFleet:
        trainer.fleet_run._fleet = fleet
        monkeypatch.setattr(trainer.fleet_run.store, "release", release)
        return fleet

    return attach
