"""Shared prompts: the rows of one prompt run as one packed sequence, with the plain forward's numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from batches import contract_batch

from rlfleet.common.schema.trainer import ModelSettings, StepSettings, UpdateSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms.grpo import PolicyObjective, prepare
from rlfleet.trainer.loop import accumulate
from rlfleet.trainer.model_io import disable_dropout, load_causal_lm
from rlfleet.trainer.policy import (
    PromptLayout,
    build_policy_inputs,
    can_pack,
    group_rows,
    pack_rows,
    packing_works,
    prompt_key,
    token_logprobs,
)

# three prompts of different lengths (left padding differs), answered 3, 1 and 2 times, and
# responses of different lengths (right padding); rows of one prompt are not adjacent
PROMPT_OF_ROW = [0, 1, 0, 2, 0, 2]
PROMPT_LENS = [4, 2, 5]
RESPONSE_LENS = [3, 6, 1, 4, 5, 2, 4, 3]


def grouped_batch(seed: int = 0, prompt_of_row: list[int] = PROMPT_OF_ROW) -> dict[str, torch.Tensor]:
    """A contract batch whose rows repeat the prompts of ``prompt_of_row``."""
    batch = contract_batch([PROMPT_LENS[p] for p in prompt_of_row], RESPONSE_LENS[: len(prompt_of_row)],
                           seed=seed)  # fmt: skip
    for row, prompt in enumerate(prompt_of_row):
        source = prompt_of_row.index(prompt)
        batch["prompt_ids"][row] = batch["prompt_ids"][source]
        batch["prompt_mask"][row] = batch["prompt_mask"][source]
    batch["group_index"] = torch.tensor(prompt_of_row)
    return batch


def _model(path: Path) -> torch.nn.Module:
    model = load_causal_lm(path, dtype=torch.float32, device="cpu")
    disable_dropout(model)
    return model


def _shapes(model: torch.nn.Module) -> list[tuple[int, ...]]:
    """The input shape of every forward ``model`` runs from now on."""
    shapes: list[tuple[int, ...]] = []
    model.register_forward_pre_hook(lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                    with_kwargs=True)  # fmt: skip
    return shapes


def _logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], share: bool
) -> tuple[torch.Tensor, ...]:
    inputs = build_policy_inputs(batch)
    model.zero_grad(set_to_none=True)
    logp, entropy = token_logprobs(model, inputs.input_ids, inputs.attention_mask, inputs.response_len,
                                   position_ids=inputs.position_ids, share_prompts=share)  # fmt: skip
    assert entropy is not None
    mask = inputs.response_mask
    # a loss that weighs every row and token differently, so that any misplaced gradient shows
    weights = torch.arange(1, mask.numel() + 1, dtype=torch.float32).reshape(mask.shape)
    ((logp * weights * mask).sum() + (entropy * mask).sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return (logp * mask).detach(), (entropy * mask).detach(), *grads


def test_rows_group_by_their_whole_prompt_whatever_the_pad_token() -> None:
    batch = grouped_batch()
    batch["prompt_ids"][2][batch["prompt_mask"][2] == 0] = 7  # another pad id: still the same prompt
    inputs = build_policy_inputs(batch)
    first, inverse = group_rows(prompt_key(inputs.input_ids, inputs.attention_mask, inputs.position_ids,
                                           inputs.response_len))  # fmt: skip
    assert first.tolist() == [0, 1, 3] and inverse.tolist() == PROMPT_OF_ROW
    distinct = build_policy_inputs(contract_batch([3, 3], [2, 2]))
    first, inverse = group_rows(prompt_key(distinct.input_ids, distinct.attention_mask, distinct.position_ids,
                                           distinct.response_len))  # fmt: skip
    assert first.tolist() == [0, 1] and inverse.tolist() == [0, 1]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_prompts_give_the_plain_logprobs_entropy_and_gradients(
    tiny_model_dir: Path, attention: str
) -> None:
    model = load_causal_lm(tiny_model_dir, dtype=torch.float32, device="cpu", attn_implementation=attention)
    disable_dropout(model)
    shapes = _shapes(model)
    batch = grouped_batch()
    plain = _logprobs(model, batch, share=False)
    assert shapes == [(6, 11)]  # prompts padded to 5, responses to 6
    shapes.clear()
    packed = _logprobs(model, batch, share=True)
    # the check on first use (2 rows, then them packed), then 3 packed sequences of 4 + 3 + 1 + 5,
    # 2 + 6 and 5 + 4 + 2 tokens, padded to 13: 39 positions instead of 66
    assert shapes == [(2, 7), (1, 9), (3, 13)]
    assert plain[0].abs().sum() > 0 and plain[2].abs().sum() > 0
    for name, got, want in zip(["logprobs", "entropy"] + ["grad"] * (len(packed) - 2), packed, plain,
                               strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4, msg=name)


def test_one_response_token_and_distinct_prompts(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    single = grouped_batch()
    single["response_ids"], single["response_mask"] = (
        single["response_ids"][:, :1],
        single["response_mask"][:, :1],
    )
    single["response_mask"][:] = 1
    for got, want in zip(_logprobs(model, single, True), _logprobs(model, single, False), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    shapes = _shapes(model)
    _logprobs(model, contract_batch([3, 4, 2], [2, 3, 1]), share=True)
    assert shapes == [(3, 7)]  # nothing shared, and packing would not be shorter: the plain forward


def test_rows_off_the_contract_layout_are_not_packed(tiny_model_dir: Path) -> None:
    batch = grouped_batch()
    holed = dict(batch)
    holed["response_mask"] = batch["response_mask"].clone()
    holed["response_mask"][1, 2] = 0  # a hole inside a response
    for rows, packs in ((batch, True), (holed, False)):
        inputs = build_policy_inputs(rows)
        _, inverse = group_rows(prompt_key(inputs.input_ids, inputs.attention_mask, inputs.position_ids,
                                           inputs.response_len))  # fmt: skip
        packing = pack_rows(inputs.input_ids, inputs.attention_mask, inputs.position_ids, inputs.response_len,
                            inverse)  # fmt: skip
        assert (packing is not None) is packs
    model = _model(tiny_model_dir)
    for got, want in zip(_logprobs(model, holed, True), _logprobs(model, holed, False), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


class _IgnoresMasks(torch.nn.Module):
    """A causal LM that drops a 4D mask (as a model without custom-mask support would)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, logits_to_keep=0):  # noqa: ANN001, ANN201
        if attention_mask is not None and attention_mask.ndim == 4:
            attention_mask = None
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, logits_to_keep=logits_to_keep)  # fmt: skip


def test_a_model_that_ignores_the_mask_is_caught_and_runs_rows_whole(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = _IgnoresMasks(_model(tiny_model_dir))
    assert can_pack(broken)
    batch = grouped_batch()
    with caplog.at_level("WARNING"):
        got = _logprobs(broken, batch, share=True)
    assert "does not compute packed rows like single ones" in caplog.text
    assert not packing_works(broken, lambda *a: None)  # remembered: not checked again
    for got_part, want in zip(got, _logprobs(broken, batch, share=False), strict=True):
        torch.testing.assert_close(got_part, want, atol=1e-6, rtol=1e-5)
    assert not can_pack(torch.nn.Linear(2, 2))


def test_gradient_checkpointing_packs_too(tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir)
    batch = grouped_batch()
    plain = _logprobs(model, batch, share=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    shapes = _shapes(model)
    packed = _logprobs(model, batch, share=True)
    assert (3, 13) in shapes
    for got, want in zip(packed, plain, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_the_layout_keeps_a_prompts_rows_together_where_that_costs_less() -> None:
    groups = torch.tensor([0, 0, 1, 1, 0, 1, 1, 0])
    layout = PromptLayout(groups, torch.full((8,), 10), torch.tensor([5, 4, 5, 4, 3, 3, 2, 2]))
    by_length = torch.arange(8)  # what local_rows gives: longest first, the two prompts interleaved
    # packed: each prompt once plus its rows' responses, the longest packed sequence times their count
    assert layout.cost(by_length, 4) == 2 * (10 + 5 + 4) + 2 * (10 + 3 + 2)
    together = layout.order(by_length, 4)
    assert sorted(together.tolist()) == list(range(8))
    assert sorted([set(groups[together[:4]].tolist()), set(groups[together[4:]].tolist())], key=min) == [
        {0},
        {1},
    ]
    assert layout.cost(together, 4) == 2 * (10 + 5 + 4 + 3 + 2) < layout.cost(by_length, 4)
    # no prompt shared: a micro-batch runs plain (packing one row alone saves nothing) and the
    # length order stays
    distinct = PromptLayout(torch.arange(4), torch.tensor([3, 1, 2, 1]), torch.tensor([5, 5, 2, 1]))
    assert distinct.cost(torch.arange(4), 2) == 2 * (3 + 5) + 2 * (2 + 2)
    assert distinct.order(torch.arange(4), 2).tolist() == [0, 1, 2, 3]


def test_the_layout_of_a_batch() -> None:
    inputs = build_policy_inputs(grouped_batch())
    layout = PromptLayout.of(
        inputs.input_ids, inputs.attention_mask, inputs.position_ids, inputs.response_len
    )
    assert layout.groups.tolist() == PROMPT_OF_ROW
    assert layout.prompt_lengths.tolist() == [PROMPT_LENS[p] for p in PROMPT_OF_ROW]
    assert layout.response_lengths.tolist() == RESPONSE_LENS[: len(PROMPT_OF_ROW)]


@pytest.mark.parametrize("micro", [2, 4])
def test_a_policy_step_shares_prompts_and_computes_the_same_gradient(
    tiny_model_dir: Path, micro: int
) -> None:
    prompt_of_row = [0, 1, 2, 0, 1, 2, 0, 1]
    batch = grouped_batch(seed=3, prompt_of_row=prompt_of_row)
    adv = torch.linspace(-1.0, 1.0, len(prompt_of_row))
    grads, counts = [], []
    for share in (False, True):
        actor = Actor(tiny_model_dir, ModelSettings(share_prompts=share), seed=0, learning_rate=1e-3)
        assert actor.share_prompts is share
        shapes = _shapes(actor.model)
        prepared = prepare(actor, batch, adv, micro_batch_size=micro)
        settings = StepSettings(update=UpdateSettings(kl_coef=0.0, entropy_coef=0.01))
        objective = PolicyObjective(actor, prepared, settings)
        assert (objective.prompts is not None) is share
        shapes.clear()  # count the update's forwards only
        accumulate(objective, torch.arange(len(prompt_of_row)), micro)
        grads.append({n: p.grad.clone() for n, p in actor.model.named_parameters()})
        counts.append(sum(rows * width for rows, width in shapes))
    for name, grad in grads[1].items():
        torch.testing.assert_close(grad, grads[0][name], atol=1e-6, rtol=1e-4, msg=name)
    assert counts[1] < counts[0]  # the rows of a prompt ran packed: fewer token positions
    assert Actor(tiny_model_dir, ModelSettings(gradient_checkpointing=True)).share_prompts
    assert not Actor(tiny_model_dir, ModelSettings(), compile=True).share_prompts


def test_rows_longer_than_a_sliding_window_run_whole(tmp_path: Path) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                           pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(tmp_path)
    model = _model(tmp_path)
    shapes = _shapes(model)
    _logprobs(model, grouped_batch(), share=True)  # rows of 11 columns: inside the window, packed
    assert shapes[-1] == (3, 13)
    shapes.clear()
    long = contract_batch([12, 12, 12], [8, 6, 9], seed=2)  # rows of 21 columns: wider than the window
    long["prompt_ids"][1:] = long["prompt_ids"][0]
    plain = _logprobs(model, long, share=False)
    assert shapes == [(3, 21)]
    shapes.clear()
    got = _logprobs(model, long, share=True)
    assert shapes == [(3, 21)]
    for got_part, want in zip(got, plain, strict=True):
        torch.testing.assert_close(got_part, want, atol=1e-6, rtol=1e-5)
