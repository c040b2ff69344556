"""The controller scoring a chunk with a Python reward: texts fetched over the real tensor plane
(the run's own store, gRPC on loopback), scores and versions as a reward worker replies, a
function that fails or hangs named within the chunk's deadline, and a shared server never given a
callable."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.common.control.messages import GenerateResult
from rlfleet.common.schema.batch import pack_texts
from rlfleet.common.schema.worker import TensorPlaneSettings
from rlfleet.controller.errors import RewardFnFailed, RewardFnNotPortable
from rlfleet.controller.own_store import OwnStore
from rlfleet.controller.python_reward import PythonReward
from rlfleet.controller.python_scorer import PythonScorer
from rlfleet.controller.request_policy import Deadlines
from rlfleet.controller.reward_control import RewardControl

DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny_digits.jsonl"
PROMPTS = ["what is 2+2?", "name a colour"]
RESPONSES = ["4", "4 again", "blue", "red and green"]  # two samples per prompt
GROUPS = [0, 0, 1, 1]


async def chunk(store: OwnStore) -> GenerateResult:
    """A chunk of texts in the run's store, as a rollout worker's batch holds them."""
    tensors: dict[str, torch.Tensor] = {"group_index": torch.tensor(GROUPS, dtype=torch.int64)}
    tensors["prompt_text"], tensors["prompt_text_offsets"] = pack_texts([PROMPTS[g] for g in GROUPS])
    tensors["response_text"], tensors["response_text_offsets"] = pack_texts(RESPONSES)
    ref = (await store.get()).put_local("rollout/test/chunk", tensors)
    return GenerateResult(job_id="gen-1", worker_id="rollout-0", weight_version=0, ref=ref, num_prompts=2,
                          num_samples=4, num_tokens=12, seconds=0.0)  # fmt: skip


async def scored(fn: Any, timeout: float = 30.0) -> Any:
    store = OwnStore(TensorPlaneSettings(), listen_all=False)
    try:
        result = await chunk(store)
        scorer = PythonScorer(PythonReward(fn), "default", "v-r0", store, Deadlines(timeout))
        metadata = [[{"answer": "4"}, {"answer": "blue"}]]
        return (await scorer.score([result], metadata, ["score-1"]))[0], scorer
    finally:
        await store.stop()


@pytest.mark.timeout(60)
def test_a_chunk_is_scored_with_the_function_and_its_rows_metadata() -> None:
    def exact(prompt: str, response: str, answer: str) -> float:
        return float(response == answer) + 0.5 * ("?" in prompt)

    reply, scorer = asyncio.run(scored(exact))
    assert reply.scores == [1.5, 0.5, 1.0, 0.0]
    assert (reply.job_id, reply.endpoint, reply.spec_version) == ("score-1", "default", "v-r0")
    stats = scorer.stats()
    assert (stats.requests, stats.samples, stats.errors, stats.raw_mean) == (1, 4, 0, 0.75)
    assert stats.spec.startswith("<python function ") and stats.spec.endswith(".exact>")


@pytest.mark.timeout(60)
def test_a_failing_function_is_named_and_counted() -> None:
    def broken(text: str) -> float:
        raise KeyError("no such judge")

    with pytest.raises(RewardFnFailed, match=r"\.broken raised KeyError: 'no such judge' \(sample 0\)"):
        asyncio.run(scored(broken))


@pytest.mark.timeout(60)
def test_a_function_that_hangs_fails_at_the_chunks_deadline() -> None:
    release = threading.Event()

    def stuck(text: str) -> float:
        release.wait(30)
        return 0.0

    t0 = time.monotonic()
    try:
        with pytest.raises(RewardFnFailed, match=r"\.stuck was still scoring 4 responses after 1 s"):
            asyncio.run(scored(stuck, timeout=1.0))
    finally:
        release.set()
    assert time.monotonic() - t0 < 10


def test_a_shared_server_is_never_sent_a_callable(tmp_path: Path) -> None:
    """Refused before anything is sent: the control has no transport to send it on."""
    control = RewardControl(transport=None, cluster="c", registry=None, token="t", remote=True)  # type: ignore[arg-type]
    with pytest.raises(RewardFnNotPortable, match="shared reward server .* never runs code sent to it"):
        asyncio.run(control.set_reward({"python": PythonReward(lambda text: 1.0)}, "default"))
    from rlfleet.controller import GRPOTrainer, TrainerConfig

    config = TrainerConfig(
        reward={"url": "nats://127.0.0.1:4222"}, output_dir=str(tmp_path), loggers=["jsonl"]
    )
    with pytest.raises(RewardFnNotPortable, match="never runs code sent to it"):
        GRPOTrainer("tiny:digits", lambda text: 1.0, DATA, config)  # before any model or process
