"""Shared prompts, packed: the rows of a micro-batch that share a prompt run as one sequence.

GRPO, RLOO and REINFORCE++ sample a group of answers to every prompt, and a training row is
``prompt ++ response`` padded to the micro-batch's width, so a micro-batch of B rows from U prompts
pushes each prompt through every layer B / U times, and every row through the padding up to the
longest one. Here the rows of one prompt become one packed sequence::

    prompt | response 1 | response 2 | ... | response k | padding up to the longest packed sequence

with their own position ids (each response continues from the prompt, as in its row) and a 4D
attention mask in which a response token sees the prompt and the earlier tokens of its own
response, never another response. A causal LM then computes, for every response token, exactly
what the row's own forward computes (the same keys and values at the same positions; only float
rounding differs), and so does the gradient: the prompt's positions receive the gradient of
every response that attends to them. The cost of a micro-batch falls from ``B * (P + R)`` token
positions to about ``U * (P + R_1 + ... + R_k)``: each prompt once, no response padding.

Which rows share a prompt is read from the rows themselves (the same prompt token ids, mask and
positions), so nothing upstream has to say so. A micro-batch packs only when that costs fewer
positions than the plain forward; :class:`PromptLayout` orders a mini-batch's rows so that a
prompt's rows fall in one micro-batch where that costs less. Rows must have the contract's
layout (left-padded prompt, right-padded response, no holes), else the plain forward runs.

Models: a Hugging Face causal LM that takes a ready 4D mask (``attention_mask`` of shape
(U, 1, L, L)) and ``logits_to_keep``, with ``sdpa`` attention (a boolean mask) or ``eager`` (an
additive one). :func:`packing_works` checks each model once, on a tiny packed batch against its
plain forward, and the plain forward is used for a model that fails (logged): a model that ignored
the mask would otherwise train on the wrong numbers. A model with sliding-window attention packs
only rows no longer than its window (:func:`window_allows`). The actor packs in one process only
(not under FSDP ranks) and not with ``torch.compile``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

logger = logging.getLogger(__name__)

PACKING_ATTENTION = ("sdpa", "eager")
"""Attention implementations the packed mask is built for."""


def prompt_key(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_len: int) -> Tensor:
    """(B, 3 P) int64 rows that are equal exactly when two rows' prompts give the same keys and values.

    Padding ids are replaced by -1, so the pad token does not matter; the mask and the positions
    are part of the key (two rows agree on the model's whole input over the prompt columns).
    """
    prompt = slice(0, input_ids.shape[1] - response_len)
    mask = attention_mask[:, prompt].long()
    ids = torch.where(mask.bool(), input_ids[:, prompt].long(), -1)
    return torch.cat([ids, mask, position_ids[:, prompt].long()], dim=1)


def group_rows(key: Tensor) -> tuple[Tensor, Tensor]:
    """``(first, inverse)`` of rows ``key`` (B, K): ``first`` (U,) the first row of each distinct
    key in order of appearance, ``inverse`` (B,) the index into ``first`` of every row's key."""
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    count = int(inverse.max().item()) + 1 if inverse.numel() else 0
    rows = torch.arange(key.shape[0], device=key.device)
    first = torch.full((count,), key.shape[0], dtype=torch.long, device=key.device)
    first = first.scatter_reduce(0, inverse, rows, reduce="amin")
    # renumber by first appearance so that the order of ``first`` follows the rows
    order = torch.argsort(first)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(count, device=key.device)
    return first[order], rank[inverse]


# --- packing ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Packing:
    """A micro-batch of B rows as U packed sequences of length L.

    Attributes:
        input_ids, position_ids: (U, L) int64.
        segments: (U, L) int64: 0 the prompt, k the k-th response packed there, -1 padding.
        keep: (K,) int64 the positions whose logits are computed (``logits_to_keep``).
        labels: (U, K) int64 the token each kept position predicts within its own response (the
            next packed token); 0 where there is none (the prompt, a response's last token, padding).
        source: (B,) the packed sequence of each row.
        predictors: (B, R) index into ``keep`` of the position whose logit predicts each response
            token of the row (the last prompt position for the first one); any at padding.
        first_labels: (B,) each row's first response token (all of a group's rows are predicted
            from the same position, the prompt's last, each with its own label).
    """

    input_ids: Tensor
    position_ids: Tensor
    segments: Tensor
    keep: Tensor
    labels: Tensor
    source: Tensor
    predictors: Tensor
    first_labels: Tensor

    def mask(self, attn_implementation: str, dtype: torch.dtype) -> Tensor:
        """The (U, 1, L, L) mask: a token sees the earlier prompt tokens and the earlier tokens of its
        own response; padding sees itself only (no empty row). Boolean for ``sdpa`` (True: attend),
        additive in ``dtype`` for ``eager``."""
        seg = self.segments
        length = seg.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=seg.device).tril()
        query, key = seg[:, :, None], seg[:, None, :]
        allowed = causal & (key >= 0) & ((key == 0) | (key == query))
        allowed = allowed | torch.eye(length, dtype=torch.bool, device=seg.device)
        allowed = allowed[:, None]
        if attn_implementation == "sdpa":
            return allowed
        additive = torch.zeros(allowed.shape, dtype=dtype, device=seg.device)
        return additive.masked_fill(~allowed, torch.finfo(dtype).min)


def pack_rows(
    input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_len: int, inverse: Tensor
) -> Packing | None:
    """The :class:`Packing` of rows (B, P + R) grouped by ``inverse`` (:func:`group_rows`), or None
    when a row is not in the contract's layout (a prompt not ending in the last prompt column or
    with holes, a response with holes)."""
    prompt_cols = input_ids.shape[1] - response_len
    mask = attention_mask.long()
    prompt_len, response_lens = mask[:, :prompt_cols].sum(dim=1), mask[:, prompt_cols:].sum(dim=1)
    cols = torch.arange(input_ids.shape[1], device=mask.device)
    expected = (cols >= prompt_cols - prompt_len[:, None]) & (cols < prompt_cols + response_lens[:, None])
    if not torch.equal(mask.bool(), expected) or bool((prompt_len == 0).any()):
        return None
    count = int(inverse.max().item()) + 1
    rows_of = [torch.nonzero(inverse == u).flatten().tolist() for u in range(count)]
    plens, rlens = prompt_len.tolist(), response_lens.tolist()
    totals = [plens[rows[0]] + sum(rlens[b] for b in rows) for rows in rows_of]
    length = max(totals)
    device = input_ids.device
    ids = torch.zeros(count, length, dtype=torch.long, device=device)
    pos = torch.zeros(count, length, dtype=torch.long, device=device)
    seg = torch.full((count, length), -1, dtype=torch.long, device=device)
    predictor = torch.zeros(len(plens), response_len, dtype=torch.long, device=device)
    steps = torch.arange(response_len, device=device)
    for u, rows in enumerate(rows_of):
        p = plens[rows[0]]
        ids[u, :p] = input_ids[rows[0], prompt_cols - p : prompt_cols]
        pos[u, :p] = position_ids[rows[0], prompt_cols - p : prompt_cols]
        seg[u, :p] = 0
        offset = p
        for k, b in enumerate(rows, start=1):
            r = rlens[b]
            ids[u, offset : offset + r] = input_ids[b, prompt_cols : prompt_cols + r]
            pos[u, offset : offset + r] = position_ids[b, prompt_cols : prompt_cols + r]
            seg[u, offset : offset + r] = k
            # token t is predicted at offset + t - 1; the first one at the prompt's last position
            predictor[b] = torch.where(steps == 0, p - 1, offset + steps - 1).clamp(max=length - 1)
            offset += r
    start = min(plens[rows[0]] for rows in rows_of) - 1
    keep = torch.arange(start, length, device=device)
    # the label of position q is token q + 1 when both lie in the same response
    follows = torch.zeros_like(seg, dtype=torch.bool)
    follows[:, :-1] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
    labels = torch.where(follows, torch.roll(ids, -1, dims=1), 0)[:, start:]
    first_labels = input_ids[:, prompt_cols].long()
    return Packing(ids, pos, seg, keep, labels, inverse, (predictor - start).clamp(min=0), first_labels)


def packed_logits(model: nn.Module, packing: Packing) -> Tensor:
    """The logits (U, K, V) of the packed forward at the kept positions."""
    implementation = model.config._attn_implementation
    dtype = next(model.parameters()).dtype
    return model(
        input_ids=packing.input_ids, attention_mask=packing.mask(implementation, dtype),
        position_ids=packing.position_ids, use_cache=False, logits_to_keep=packing.keep,
    ).logits  # fmt: skip


def unpack(packing: Packing, packed: Tensor, first: Tensor) -> Tensor:
    """Per-row values (B, R) from values at the kept positions ``packed`` (U, K) and of each row's
    first response token ``first`` (B,)."""
    values = packed[packing.source[:, None], packing.predictors]
    return torch.cat([first[:, None], values[:, 1:]], dim=1)


# --- which models pack -----------------------------------------------------------------------------


@functools.cache
def _forward_params(model_type: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_type.forward).parameters)


_CHECKED: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def can_pack(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes what packing needs (before :func:`packing_works` checks it)."""
    if not {"logits_to_keep", "position_ids", "attention_mask"} <= _forward_params(type(model)):
        return False
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    return getattr(config, "_attn_implementation", None) in PACKING_ATTENTION


def window_allows(model: nn.Module, row_len: int) -> bool:
    """False when ``model`` has sliding-window attention narrower than ``row_len``: its own mask
    would limit a row's attention to the window, which the packed mask does not do."""
    config = model.config
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return True
    return row_len <= int(window)


def packing_works(
    model: nn.Module, logprobs: Callable[[nn.Module, Tensor, Tensor, int, bool], Tensor]
) -> bool:
    """Whether ``model`` computes a tiny packed batch as it computes the rows one by one; checked once
    per model (float32, no grad). ``logprobs(model, ids, mask, R, packed)`` gives the
    rows' response logprobs (B, R), packed or plain."""
    known = _CHECKED.get(model)
    if known is not None:
        return known
    works = can_pack(model)
    if works:
        device = next(model.parameters()).device
        vocab = int(model.config.vocab_size)
        ids = (torch.arange(2 * 7, device=device).reshape(2, 7) * 7 + 3) % max(vocab - 3, 1) + 3
        mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]], device=device)
        ids[1, :3] = ids[0, :3]  # one prompt of 3 tokens, answered with 2 and 4 tokens
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            plain = logprobs(model, ids, mask, 4, False).float()
            packed = logprobs(model, ids, mask, 4, True).float()
        real = mask[:, 3:].bool()
        works = bool(torch.allclose(packed[real], plain[real], atol=1e-4))
        if not works:
            logger.warning("%s does not compute packed rows like single ones (attention %r): prompts are "
                           "not shared, every row runs whole", type(model).__name__,
                           getattr(model.config, "_attn_implementation", None))  # fmt: skip
    _CHECKED[model] = works
    return works


# --- ordering a mini-batch's rows -------------------------------------------------------------------


@dataclass(frozen=True)
class PromptLayout:
    """Which prompt each row of a batch has, and its length, to order micro-batches by.

    Attributes:
        groups: (N,) int64, equal for rows with the same prompt.
        prompt_lengths: (N,) int64 real prompt tokens.
        response_lengths: (N,) int64 real response tokens.
    """

    groups: Tensor
    prompt_lengths: Tensor
    response_lengths: Tensor

    @classmethod
    def of(
        cls, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_len: int
    ) -> PromptLayout:
        """The layout of a batch of rows (N, P + R)."""
        _, groups = group_rows(prompt_key(input_ids, attention_mask, position_ids, response_len))
        mask = attention_mask.long()
        response = mask[:, input_ids.shape[1] - response_len :].sum(dim=1)
        return cls(groups.cpu(), (mask.sum(dim=1) - response).cpu(), response.cpu())

    def cost(self, order: Tensor, micro_batch_size: int) -> int:
        """Token positions the forwards of ``order``'s micro-batches run: each micro-batch packed or
        plain, whichever runs fewer (as the forward chooses)."""
        total = 0
        for chunk in order.cpu().split(micro_batch_size):
            groups = self.groups[chunk].tolist()
            prompts, responses = self.prompt_lengths[chunk].tolist(), self.response_lengths[chunk].tolist()
            packed: dict[int, int] = {}
            for group, prompt, response in zip(groups, prompts, responses, strict=True):
                packed[group] = packed.get(group, prompt) + response
            plain = len(groups) * (max(prompts) + max(responses))
            total += min(plain, len(packed) * max(packed.values()))
        return total

    def grouped(self, rows: Tensor) -> Tensor:
        """``rows`` with each prompt's rows together: prompts longest row first, rows longest first."""
        cpu = rows.cpu()
        lengths = self.prompt_lengths[cpu] + self.response_lengths[cpu]
        groups = self.groups[cpu]
        longest = torch.zeros(int(self.groups.max()) + 1, dtype=torch.long).scatter_reduce(
            0, groups, lengths, reduce="amax", include_self=False
        )
        # one sort key: the group's longest row, then the group, then the row's length (all descending)
        span = int(lengths.max()) + 1
        key = (longest[groups] * (int(groups.max()) + 1) + groups) * span + lengths
        return rows[torch.sort(key, descending=True, stable=True).indices.to(rows.device)]

    def order(self, rows: Tensor, micro_batch_size: int) -> Tensor:
        """``rows`` (in length order) or :meth:`grouped`, whichever costs fewer token positions."""
        together = self.grouped(rows)
        if self.cost(together, micro_batch_size) < self.cost(rows, micro_batch_size):
            return together
        return rows
