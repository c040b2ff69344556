"""The policy's forward: chunked logprob/entropy reduction, and logprobs of a real (tiny) model
under left padding."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rlfleet.common.errors import BatchContractError
from rlfleet.trainer.model_io import load_causal_lm
from rlfleet.trainer.policy import (
    build_policy_inputs,
    entropy_from_logits,
    logprobs_from_logits,
    position_ids_from_mask,
    token_logprobs,
)


def test_chunked_reduction_matches_log_softmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 5), generator=gen)
    ref = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    for chunk in (1, 4, 15, 1000):
        logp, ent = logprobs_from_logits(logits, labels, temperature=0.7, chunk_rows=chunk)
        torch.testing.assert_close(logp, ref)
        assert ent is not None
        torch.testing.assert_close(ent, entropy_from_logits(logits / 0.7))
    logp, ent = logprobs_from_logits(logits, labels, compute_entropy=False)
    assert ent is None


def test_checkpointed_chunks_give_the_plain_gradient() -> None:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2, 4, 9, generator=gen)
    labels = torch.randint(0, 9, (2, 4), generator=gen)
    weights = torch.randn(2, 4, generator=gen)

    chunked = base.clone().requires_grad_(True)
    logp, ent = logprobs_from_logits(chunked, labels, temperature=2.0, chunk_rows=3)
    ((logp + 0.1 * ent) * weights).sum().backward()

    plain = base.clone().requires_grad_(True)
    z = plain / 2.0
    ref_logp = torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ((ref_logp + 0.1 * entropy_from_logits(z)) * weights).sum().backward()
    torch.testing.assert_close(chunked.grad, plain.grad)


def test_entropy_as_a_metric_has_no_gradient_and_the_same_values() -> None:
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(2, 4, 9, generator=gen) * 300  # large logits: the max is taken out first
    labels = torch.randint(0, 9, (2, 4), generator=gen)
    weights = torch.randn(2, 4, generator=gen)

    metric = base.clone().requires_grad_(True)
    logp, ent = logprobs_from_logits(metric, labels, temperature=0.5, chunk_rows=3, entropy_grad=False)
    assert ent is not None and not ent.requires_grad and logp.requires_grad
    (logp * weights).sum().backward()

    plain = base.clone().requires_grad_(True)
    z = plain / 0.5
    ref_logp = torch.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (ref_logp * weights).sum().backward()
    torch.testing.assert_close(logp, ref_logp)
    exact = z.detach().double().log_softmax(-1)  # float64: logsumexp - sum p z cancels at this scale
    torch.testing.assert_close(ent, -(exact.exp() * exact).sum(-1).float())
    torch.testing.assert_close(metric.grad, plain.grad)


def test_bad_temperature_is_refused() -> None:
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(torch.zeros(1, 1, 2), torch.zeros(1, 1, dtype=torch.int64), temperature=0.0)


def test_position_ids_skip_left_padding() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    torch.testing.assert_close(
        position_ids_from_mask(mask), torch.tensor([[0, 0, 0, 1, 2, 2], [0, 1, 2, 3, 4, 5]])
    )


def test_build_policy_inputs_concatenates_prompt_and_response(make_batch: Callable) -> None:
    batch = make_batch([2, 3], [3, 1])
    inputs = build_policy_inputs(batch)
    assert inputs.input_ids.shape == (2, 6)
    torch.testing.assert_close(inputs.input_ids[:, 3:], batch["response_ids"])
    torch.testing.assert_close(inputs.attention_mask[0], torch.tensor([0, 1, 1, 1, 1, 1]))
    sub = inputs.select(torch.tensor([1]))  # no shared left padding: nothing trimmed
    assert sub.input_ids.shape == (1, 6)
    sub = inputs.select(torch.tensor([0]))  # one shared pad column trimmed
    assert sub.input_ids.shape == (1, 5)
    assert sub.response_len == 3


def test_invalid_batches_are_refused(make_batch: Callable) -> None:
    batch = make_batch([2, 3], [3, 1])
    with pytest.raises(BatchContractError, match="response_mask"):
        build_policy_inputs({k: v for k, v in batch.items() if k != "response_mask"})
    bad = dict(batch, prompt_mask=batch["prompt_mask"][:, 1:])
    with pytest.raises(BatchContractError, match="prompt_mask"):
        build_policy_inputs(bad)
    bad = dict(batch, rollout_logprobs=torch.zeros(2, 7))
    with pytest.raises(BatchContractError, match="rollout_logprobs"):
        build_policy_inputs(bad)


@pytest.mark.timeout(60)
def test_left_padding_does_not_change_logprobs(tiny_model_dir: Path, make_batch: Callable) -> None:
    model = load_causal_lm(tiny_model_dir)
    prompt = torch.tensor([[5, 6, 7]])
    response = torch.tensor([[8, 9, 10, 11]])
    ids = torch.cat([prompt, response], dim=1)
    unpadded, ent_unpadded = token_logprobs(model, ids, torch.ones_like(ids), 4)

    padded_ids = torch.cat([torch.zeros(1, 3, dtype=torch.int64), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.int64), torch.ones_like(ids)], dim=1)
    padded, ent_padded = token_logprobs(model, padded_ids, mask, 4)
    torch.testing.assert_close(padded, unpadded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_padded, ent_unpadded, atol=1e-5, rtol=1e-5)

    # the same, in a batch next to a longer prompt, with the response right-padded
    batch = make_batch([3, 5], [4, 2], seed=3)
    batch["prompt_ids"][0, -3:] = prompt[0]
    batch["response_ids"][0] = response[0]
    inputs = build_policy_inputs(batch)
    logp, _ = token_logprobs(
        model, inputs.input_ids, inputs.attention_mask, 4, position_ids=inputs.position_ids
    )
    torch.testing.assert_close(logp[:1], unpadded, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(60)
def test_token_logprobs_match_a_full_forward(tiny_model_dir: Path) -> None:
    model = load_causal_lm(tiny_model_dir)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    logits = model(input_ids=ids).logits[:, 2:-1] / 1.3
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, 3:].unsqueeze(-1)).squeeze(-1)
    logp, _ = token_logprobs(model, ids, torch.ones_like(ids), 3, temperature=1.3)
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="response_len"):
        token_logprobs(model, ids, torch.ones_like(ids), 6)


def test_right_padding_shared_by_every_row_is_not_computed(tiny_model_dir: Path) -> None:
    """Responses right-padded past the micro-batch's longest: the forward runs at that width and
    the outputs come back at the batch's width, with the same values and gradients as a forward
    over every column, zeros in the dropped ones."""
    model = load_causal_lm(tiny_model_dir)
    ids = torch.tensor([[3, 4, 5, 6, 7, 0, 0, 0], [3, 4, 9, 8, 0, 0, 0, 0]])
    mask = (ids > 0).long()
    widths: list[int] = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, a, out: widths.append(a[0].shape[1]))
    logp, entropy = token_logprobs(model, ids, mask, 6)  # responses of 3 and 2 tokens, width 6
    hook.remove()
    assert widths == [5] and logp.shape == entropy.shape == (2, 6)  # 2 prompt + 3 response columns
    assert logp[:, 3:].eq(0).all() and entropy[:, 3:].eq(0).all()
    logits = model(input_ids=ids, attention_mask=mask).logits[:, 1:4]
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, 2:5].unsqueeze(-1)).squeeze(-1)
    real = mask[:, 2:5].bool()
    torch.testing.assert_close(logp[:, :3][real], expected[real], atol=1e-5, rtol=1e-5)

    def grads(values: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad()
        (values[:, :3] * mask[:, 2:5]).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    trimmed = grads(token_logprobs(model, ids, mask, 6)[0])
    full = grads(torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, 1:4], -1)
                 .gather(-1, ids[:, 2:5].unsqueeze(-1)).squeeze(-1))  # fmt: skip
    for a, b in zip(trimmed, full, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    empty = token_logprobs(model, ids[:, :3], torch.tensor([[1, 1, 0], [1, 1, 0]]), 1)[0]
    assert empty.shape == (2, 1)  # no response token at all: one column is still computed
