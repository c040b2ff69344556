"""Partial rollouts (issue 30 point 3) on the HF engine and the vLLM CPU build: a weight load waits
one segment, not the whole generation; the rest of each sample is sampled by the new weights; every
token keeps its version and the logprob it was sampled with."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM
from weight_buckets import weight_buckets  # (this folder's helper module)

from rlfleet.common.control.messages import SamplingParams
from rlfleet.rollout.engines import HFEngine
from rlfleet.rollout.engines.base import Completion
from rlfleet.rollout.partial_rollout import SEGMENT_SEED_STRIDE, generate_in_segments, segment_params
from rlfleet.rollout.service import to_rollout_tensors

PROMPTS = [[30, 11, 8, 15], [5, 40, 6, 9, 21]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, n=2)
SEGMENT = 4


def _engine(kind: str, path: Path) -> Any:
    if kind == "hf":
        return HFEngine(path, seed=0)
    pytest.importorskip("vllm", reason="vLLM is not installed (uv sync --extra cpu)")
    from rlfleet.rollout.engines.vllm import VLLMEngine

    return VLLMEngine(path, enforce_eager=True, max_model_len=64)


@pytest.fixture(params=["hf", "vllm"])
def engines(request: pytest.FixtureRequest, make_vllm_checkpoint) -> Iterator[tuple[Any, Path, Path]]:
    """An engine serving checkpoint A, and checkpoint B (other weights) to load into it."""
    a, b = make_vllm_checkpoint(seed=0), make_vllm_checkpoint(seed=1)
    engine = _engine(request.param, a)
    yield engine, a, b
    engine.close()


def _load(engine: Any, path: Path, version: int) -> None:
    for bucket in weight_buckets(AutoModelForCausalLM.from_pretrained(path).eval(), 50_000):
        engine.load_weights(bucket)
    engine.set_weight_version(version)


def _run(
    engine: Any, params: SamplingParams, during: Callable[[], None] | None = None
) -> tuple[Any, list[str]]:
    """The job in segments; ``during`` (a load) is queued for the engine right after the first segment
    starts, as a load message arriving mid-generation is. Returns the result and the order of events."""
    events: list[str] = []

    async def main() -> Any:
        gate = asyncio.Lock()
        calls = 0

        async def one_call(prompts: list[list[int]], p: SamplingParams) -> list[Completion]:
            nonlocal calls
            calls += 1
            events.append(f"segment {calls}")
            if calls == 1 and during is not None:
                loader.set()
            return await asyncio.to_thread(engine.generate, prompts, p)

        async def load() -> None:
            await loader.wait()
            async with gate:  # the worker's load takes the same gate as generation
                await asyncio.to_thread(during)
                events.append("load")

        def decode(ids: list[list[int]]) -> list[str]:  # as the worker decodes
            return engine.tokenizer.batch_decode(ids, skip_special_tokens=True)

        loader = asyncio.Event()
        task = asyncio.create_task(load()) if during is not None else None
        result = await generate_in_segments(PROMPTS, params, SEGMENT, gate, lambda: engine.weight_version,
                                            one_call, decode)  # fmt: skip
        if task is not None:
            await task
        return result

    return asyncio.run(main()), events


@pytest.mark.timeout(300)
def test_without_a_load_segments_give_the_whole_generation(engines) -> None:
    engine, _, _ = engines
    whole = engine.generate(PROMPTS, GREEDY)
    job, events = _run(engine, GREEDY)
    assert job.segments == 3 and events == ["segment 1", "segment 2", "segment 3"]  # 12 tokens in 4s
    assert [c.token_ids for c in job.completions] == [c.token_ids for c in whole]
    assert [c.finish_reason for c in job.completions] == [c.finish_reason for c in whole]
    for ours, theirs in zip(job.completions, whole, strict=True):
        torch.testing.assert_close(
            torch.tensor(ours.logprobs), torch.tensor(theirs.logprobs), atol=2e-3, rtol=0
        )
        assert ours.text == theirs.text
    assert all(v == [0] * len(c.token_ids) for v, c in zip(job.versions, job.completions, strict=True))


@pytest.mark.timeout(300)
def test_a_load_goes_in_after_one_segment_and_the_rest_is_sampled_by_the_new_weights(engines) -> None:
    engine, _, b = engines
    job, events = _run(engine, GREEDY, during=lambda: _load(engine, b, version=1))
    assert events[:3] == ["segment 1", "load", "segment 2"]  # waited one segment, not the generation
    assert job.loads_between == 1 and job.versions_used == [0, 1]
    rest_by_b = engine.generate(
        [c.prompt_token_ids + c.token_ids[:SEGMENT] for c in job.completions],
        SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens - SEGMENT),
    )
    for c, versions, rest in zip(job.completions, job.versions, rest_by_b, strict=True):
        assert versions == [0] * SEGMENT + [1] * (len(c.token_ids) - SEGMENT)
        assert c.token_ids[SEGMENT:] == rest.token_ids  # what B samples from the same prefix
        torch.testing.assert_close(
            torch.tensor(c.logprobs[SEGMENT:]), torch.tensor(rest.logprobs), atol=2e-3, rtol=0
        )  # each token's logprob is that of the weights that sampled it
    tensors = to_rollout_tensors(job.completions, engine.pad_token_id, engine.tokenizer, job.versions)
    assert tensors["response_versions"].dtype == torch.int64
    assert tensors["response_versions"][:, :SEGMENT].eq(0).all()
    assert tensors["response_versions"][:, SEGMENT:].eq(1).all()  # every sample ran to max_tokens


def test_segments_sample_apart_and_continue_one_sample_a_prefix() -> None:
    seeded = SamplingParams(n=4, max_tokens=100, seed=7)
    assert segment_params(seeded, 0, 16, continuation=False) == seeded.model_copy(update={"max_tokens": 16})
    later = segment_params(seeded, 2, 16, continuation=True)
    assert (later.n, later.max_tokens, later.seed) == (1, 16, 7 + 2 * SEGMENT_SEED_STRIDE)
    assert segment_params(SamplingParams(seed=None), 3, 8, True).seed is None  # the engine draws its own
    with pytest.raises(ValueError, match="segment_tokens"):
        asyncio.run(generate_in_segments([[1]], seeded, 0, asyncio.Lock(), lambda: 0, None, None))  # type: ignore[arg-type]


def test_rollout_tensors_refuse_versions_that_do_not_match_the_tokens() -> None:
    c = Completion(
        prompt_index=0, sample_index=0, prompt_token_ids=[1, 2], token_ids=[3, 4, 5], logprobs=[-1.0] * 3
    )
    with pytest.raises(ValueError, match="one weight version per token"):
        to_rollout_tensors([c], 0, None, [[0, 0]])
    assert to_rollout_tensors([c], 0, None, [[2, 2, 3]])["response_versions"].tolist() == [[2, 2, 3]]


@pytest.mark.timeout(180)
def test_vllm_generates_from_a_worker_thread_when_torch_threads_were_changed(make_vllm_checkpoint) -> None:
    """The worker generates (each segment too) from a thread of its own. An engine built after
    torch's thread count changed (here 1) met a fresh thread whose OpenMP pool kept the default, and
    vLLM's CPU attention refused the mismatch ("thread_num == thread_num (2 vs. 1)"); the engine
    now aligns the calling thread with torch's count."""
    import concurrent.futures

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = _engine("vllm", make_vllm_checkpoint(seed=0))
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                done = pool.submit(engine.generate, PROMPTS, GREEDY).result(timeout=120)
            assert len(done) == len(PROMPTS) * GREEDY.n
        finally:
            engine.close()
    finally:
        torch.set_num_threads(before)
