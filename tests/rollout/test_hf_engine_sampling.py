"""The HF engine's sampling helpers on their own: logprob recorder, stop cutting, config, seeding."""

from __future__ import annotations

import pytest
import torch

from rlfleet.common.control.messages import SamplingParams
from rlfleet.rollout.engines.hf import LogprobRecorder, cut_at_stop, generation_config, seeded


def _run_recorder(recorder: LogprobRecorder, logits: torch.Tensor, tokens: torch.Tensor, calls: int) -> None:
    """Feed ``calls`` steps the way HF generate does: step k sees the tokens chosen before it."""
    prompt = torch.zeros((tokens.shape[0], 2), dtype=torch.int64)
    for k in range(calls):
        recorder(torch.cat([prompt, tokens[:, :k]], dim=1), logits[:, k])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("overshoot", [0, 1])
def test_recorder_gathers_each_chosen_token(overshoot: int) -> None:
    torch.manual_seed(0)
    batch, steps, vocab = 3, 5, 11
    logits = torch.randn(batch, steps + overshoot, vocab)
    tokens = torch.randint(0, vocab, (batch, steps + overshoot))
    recorder = LogprobRecorder(temperature=0.5)
    # overshoot: generate ran one more step than it returned (deferred stop checks), as on some devices
    _run_recorder(recorder, logits, tokens, steps + overshoot)
    got = recorder.finish(tokens[:, :steps])
    expected = torch.log_softmax(logits[:, :steps] / 0.5, dim=-1).gather(-1, tokens[:, :steps, None])[..., 0]
    torch.testing.assert_close(got, expected)


@pytest.mark.timeout(30)
def test_recorder_uses_temperature_one_for_greedy_and_passes_scores_through() -> None:
    recorder = LogprobRecorder(temperature=0.0)
    scores = torch.randn(2, 7)
    assert recorder(torch.zeros((2, 1), dtype=torch.int64), scores) is scores
    got = recorder.finish(torch.tensor([[3], [4]]))
    torch.testing.assert_close(got[:, 0], torch.log_softmax(scores, dim=-1)[[0, 1], [3, 4]])


@pytest.mark.timeout(30)
def test_cut_at_stop_keeps_the_first_stop_token() -> None:
    generated = torch.tensor([[5, 1, 0, 0], [6, 7, 9, 8], [9, 9, 9, 9]])
    assert cut_at_stop(generated, [1, 9], max_tokens=4) == ([2, 3, 1], [True, True, True])
    assert cut_at_stop(generated[:2], [1], max_tokens=4) == ([2, 4], [True, False])
    assert cut_at_stop(generated, [], max_tokens=4) == ([4, 4, 4], [False, False, False])
    with pytest.raises(RuntimeError, match="did not stop"):
        cut_at_stop(generated[:2], [1], max_tokens=8)


@pytest.mark.timeout(30)
def test_generation_config_maps_sampling_params() -> None:
    greedy = generation_config(SamplingParams(temperature=0.0, max_tokens=9), [1, 2], pad=0)
    assert (greedy.do_sample, greedy.max_new_tokens, greedy.eos_token_id) == (False, 9, [1, 2])
    sampled = generation_config(SamplingParams(temperature=0.8, top_p=0.9, top_k=-1), [1], pad=3)
    assert (sampled.do_sample, sampled.temperature, sampled.top_p, sampled.top_k) == (True, 0.8, 0.9, 0)
    assert sampled.repetition_penalty == 1.0 and sampled.pad_token_id == 3
    assert generation_config(SamplingParams(top_k=7), [], pad=0).top_k == 7


@pytest.mark.timeout(30)
def test_seeded_is_reproducible_and_restores_the_rng() -> None:
    state = torch.get_rng_state()
    with seeded(42, torch.device("cpu")):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), state)
    with seeded(42, torch.device("cpu")):
        assert torch.equal(torch.rand(4), first)
