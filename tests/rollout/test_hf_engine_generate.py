"""HFEngine.generate: greedy parity with HF, exact logprobs, ordering, seeding, stops, limits, deadlines."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfleet.common.control.messages import SamplingParams
from rlfleet.rollout.engines import Completion, HFEngine
from rlfleet.rollout.errors import DeadlinePassed, EngineClosed, InvalidPrompt

PROMPTS = ["hello", "a b", "The quick brown fox", "x"]
EOS_ID = 1


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> HFEngine:
    return HFEngine(tiny_checkpoint, seed=7)


@pytest.fixture(scope="module")
def prompts(engine: HFEngine) -> list[list[int]]:
    return [engine.tokenizer(p)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()


def _forward_logprobs(model: torch.nn.Module, c: Completion, temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / temperature) of each generated token from one unpadded forward pass."""
    ids = torch.tensor([c.prompt_token_ids + c.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(c.prompt_token_ids) - 1 : -1]  # (T, V)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)


@pytest.mark.timeout(60)
def test_greedy_matches_hf_generate_token_for_token(
    engine: HFEngine, prompts: list[list[int]], reference: torch.nn.Module
) -> None:
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    assert len(out) == len(prompts)
    for c, prompt in zip(out, prompts, strict=True):
        expected = reference.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=12, eos_token_id=EOS_ID, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert c.token_ids == expected
        assert c.finish_reason == ("stop" if expected[-1] == EOS_ID else "length")
        assert c.text == engine.tokenizer.decode(expected, skip_special_tokens=True)


@pytest.mark.timeout(60)
def test_greedy_logprobs_equal_forward_log_softmax(
    engine: HFEngine, prompts: list[list[int]], reference: torch.nn.Module
) -> None:
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10))
    for c in out:
        assert len(c.logprobs) == len(c.token_ids) > 0
        torch.testing.assert_close(
            torch.tensor(c.logprobs), _forward_logprobs(reference, c), atol=1e-4, rtol=0
        )


@pytest.mark.timeout(60)
def test_sampled_logprobs_use_temperature_not_truncation(
    engine: HFEngine, prompts: list[list[int]], reference: torch.nn.Module
) -> None:
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_tokens=8, n=3, seed=11)
    for c in engine.generate(prompts, params):
        expected = _forward_logprobs(reference, c, temperature=0.7)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
        # top-k was applied: every sampled token is among the 5 most likely of its step
        ids = torch.tensor([c.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(c.prompt_token_ids) - 1 : -1]
        top5 = logits.topk(5, dim=-1).indices
        assert (top5 == torch.tensor(c.token_ids)[:, None]).any(dim=-1).all()


@pytest.mark.timeout(60)
def test_n_samples_are_prompt_major(engine: HFEngine, prompts: list[list[int]]) -> None:
    out = engine.generate(prompts[:3], SamplingParams(n=4, max_tokens=4, seed=1))
    assert [(c.prompt_index, c.sample_index) for c in out] == [(p, s) for p in range(3) for s in range(4)]
    assert all(c.prompt_token_ids == prompts[c.prompt_index] for c in out)
    assert len({tuple(c.token_ids) for c in out if c.prompt_index == 0}) > 1  # samples differ


@pytest.mark.timeout(60)
def test_seeded_sampling_is_reproducible(engine: HFEngine, prompts: list[list[int]]) -> None:
    params = SamplingParams(n=3, max_tokens=8, seed=1234)
    rng_before = torch.get_rng_state()
    first = engine.generate(prompts, params)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is untouched
    assert engine.generate(prompts, params) == first
    other = engine.generate(prompts, params.model_copy(update={"seed": 99}))
    assert [c.token_ids for c in other] != [c.token_ids for c in first]


@pytest.mark.timeout(60)
def test_engine_seed_replays_unseeded_calls(tiny_checkpoint: Path, prompts: list[list[int]]) -> None:
    params = SamplingParams(n=2, max_tokens=6)
    a, b = HFEngine(tiny_checkpoint, seed=5), HFEngine(tiny_checkpoint, seed=5)
    a1, a2 = a.generate(prompts, params), a.generate(prompts, params)
    assert [c.token_ids for c in a1] != [c.token_ids for c in a2]  # each call draws a new seed
    assert (b.generate(prompts, params), b.generate(prompts, params)) == (a1, a2)


@pytest.mark.timeout(60)
def test_batching_does_not_change_greedy_output(tiny_checkpoint: Path, prompts: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, n=2)
    small = HFEngine(tiny_checkpoint, max_batch_size=3).generate(prompts, params)
    big = HFEngine(tiny_checkpoint, max_batch_size=64).generate(prompts, params)
    assert [(c.prompt_index, c.sample_index, c.token_ids) for c in small] == [
        (c.prompt_index, c.sample_index, c.token_ids) for c in big
    ]
    for a, b in zip(small, big, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@pytest.mark.timeout(60)
def test_max_tokens_is_respected(engine: HFEngine, prompts: list[list[int]]) -> None:
    out = engine.generate(prompts, SamplingParams(n=8, max_tokens=5, seed=3))
    for c in out:
        assert 1 <= len(c.token_ids) <= 5
        if c.finish_reason == "length":
            assert len(c.token_ids) == 5 and EOS_ID not in c.token_ids
        else:
            assert c.token_ids[-1] == EOS_ID and EOS_ID not in c.token_ids[:-1]


@pytest.mark.timeout(60)
def test_stop_token_ids_end_the_sample_and_are_kept(engine: HFEngine, prompts: list[list[int]]) -> None:
    free = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    tokens = free[0].token_ids
    assert len(tokens) >= 4
    stop = tokens[3]
    cut = tokens.index(stop) + 1
    stopped = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop]))
    assert stopped[0].token_ids == tokens[:cut]
    assert stopped[0].finish_reason == "stop"
    assert len(stopped[0].logprobs) == cut
    for before, after in zip(free[1:], stopped[1:], strict=True):  # other rows cut at their own first stop
        expected = before.token_ids[: before.token_ids.index(stop) + 1] if stop in before.token_ids else None
        assert after.token_ids == (expected or before.token_ids)


@pytest.mark.timeout(60)
def test_logprobs_can_be_turned_off(engine: HFEngine, prompts: list[list[int]]) -> None:
    out = engine.generate(prompts, SamplingParams(max_tokens=4, logprobs=False, seed=0))
    assert all(c.logprobs == [] and c.token_ids for c in out)


@pytest.mark.timeout(60)
def test_bad_prompts_are_refused(engine: HFEngine) -> None:
    with pytest.raises(InvalidPrompt, match="prompt 1: is empty"):
        engine.generate([[5], []], SamplingParams())
    with pytest.raises(InvalidPrompt, match=r"\[500\] outside the vocabulary"):
        engine.generate([[5, 500]], SamplingParams())


@pytest.mark.timeout(60)
def test_a_prompt_beyond_the_model_s_positions_is_refused(engine: HFEngine) -> None:
    """Issue 29, point 5: as in vLLM, prompt + max_tokens over max_position_embeddings (256) is refused."""
    assert engine.max_model_len == 256
    with pytest.raises(InvalidPrompt, match="prompt 1: has 200 tokens; with max_tokens=57 it needs 257 > "):
        engine.generate([[5], [5] * 200], SamplingParams(max_tokens=57))
    assert len(engine.generate([[5] * 200], SamplingParams(max_tokens=56, seed=0))) == 1


@pytest.mark.timeout(60)
def test_a_deadline_stops_generation_between_decode_steps(tiny_checkpoint: Path) -> None:
    """Issue 29, point 5: past its deadline a call stops (64 samples of up to 250 tokens, one at a
    time, would run on) and says so; the engine then serves the next call."""
    engine = HFEngine(tiny_checkpoint, max_batch_size=1)
    params = SamplingParams(n=64, max_tokens=250, temperature=1.0, seed=0)
    t0 = time.monotonic()
    with pytest.raises(DeadlinePassed, match="cancelled after") as info:
        engine.generate([[5, 6]], params, deadline=time.monotonic() + 0.2)
    assert time.monotonic() - t0 < 5.0 and info.value.ran_s is not None
    with pytest.raises(DeadlinePassed):  # already passed: stops before its first step
        engine.generate([[5, 6]], params, deadline=time.monotonic() - 1)
    later = time.monotonic() + 60
    assert len(engine.generate([[5]], SamplingParams(max_tokens=4, seed=0), deadline=later)) == 1


@pytest.mark.timeout(60)
def test_pad_token_defaults_to_eos(make_checkpoint, prompts: list[list[int]]) -> None:
    engine = HFEngine(make_checkpoint(with_pad=False))
    assert engine.tokenizer.pad_token_id == EOS_ID == engine.pad_token_id
    assert engine.tokenizer.padding_side == "left"
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    reference = HFEngine(make_checkpoint()).generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    assert [c.token_ids for c in out] == [c.token_ids for c in reference]


@pytest.mark.timeout(60)
def test_closed_engine_refuses_work(tiny_checkpoint: Path) -> None:
    engine = HFEngine(tiny_checkpoint)
    engine.close()
    with pytest.raises(EngineClosed, match="is closed"):
        engine.generate([[5]], SamplingParams())
    with pytest.raises(EngineClosed):
        engine.load_weights({})
