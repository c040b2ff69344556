"""HFEngine on a CUDA device: same tokens and logprobs as on CPU, seeding, stops and in-place loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfleet.common.control.messages import SamplingParams
from rlfleet.rollout.engines import HFEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[30, 11, 8, 15], [5, 40, 6], [50, 60, 44, 9, 13, 21]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.mark.timeout(120)
def test_cuda_greedy_matches_cpu(tiny_checkpoint: Path) -> None:
    cpu = HFEngine(tiny_checkpoint).generate(PROMPTS, GREEDY)
    gpu = HFEngine(tiny_checkpoint, device="cuda").generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in gpu] == [c.token_ids for c in cpu]
    assert [c.finish_reason for c in gpu] == [c.finish_reason for c in cpu]
    for a, b in zip(gpu, cpu, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@pytest.mark.timeout(120)
def test_cuda_sampling_is_seeded_and_leaves_the_rng_alone(tiny_checkpoint: Path) -> None:
    engine = HFEngine(tiny_checkpoint, device="cuda")
    params = SamplingParams(n=4, max_tokens=10, temperature=0.9, top_k=20, seed=5)
    cuda_state = torch.cuda.get_rng_state()
    first = engine.generate(PROMPTS, params)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_state)
    assert engine.generate(PROMPTS, params) == first
    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoint).eval()
    for c in first:
        ids = torch.tensor([c.prompt_token_ids + c.token_ids])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(c.prompt_token_ids) - 1 : -1]
        expected = torch.log_softmax(logits / 0.9, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.timeout(120)
def test_cuda_stop_tokens_and_cpu_weights(make_checkpoint) -> None:
    engine = HFEngine(make_checkpoint(seed=0), device="cuda")
    free = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16))
    stop = free[0].token_ids[2]
    stopped = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop]))
    assert stopped[0].token_ids == free[0].token_ids[: free[0].token_ids.index(stop) + 1]
    assert stopped[0].finish_reason == "stop" and len(stopped[0].logprobs) == len(stopped[0].token_ids)

    other = make_checkpoint(seed=1)
    state = AutoModelForCausalLM.from_pretrained(other).state_dict()  # CPU tensors into a CUDA model
    engine.load_weights(state, version=2)
    expected = HFEngine(other).generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == [c.token_ids for c in expected]
    assert engine.weight_version == 2


@pytest.mark.timeout(120)
def test_cuda_bfloat16_engine_runs(tiny_checkpoint: Path) -> None:
    engine = HFEngine(tiny_checkpoint, device="cuda", dtype="bfloat16")
    out = engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=8, seed=0))
    assert all(len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs) for c in out)
