"""The policy's forward on a batch: the forward inputs of a rollout batch, and token logprobs.

Inputs: the training sequence of a sample is ``prompt (left-padded) ++ response (right-padded)``,
so every row has length T = P + R and its response starts at column P. Position ids come from the
cumulative sum of the attention mask, which makes left padding invisible to the model: a prompt
padded to any width gives the same logprobs as the unpadded prompt.

Logprobs (and entropy) of the response tokens under a causal LM. Memory: the model is asked only
for the logits of the R positions that predict response tokens (``logits_to_keep`` as an index
tensor), never the whole (B, T, V). They are then reduced in chunks of rows; each chunk is cast
to float32, divided by the temperature, and reduced to ``logit[label] - logsumexp`` and to the
entropy (one max, then both sums in one pass; the entropy carries a gradient only when the loss
has an entropy term). Under autograd each chunk runs inside an activation checkpoint, so the
float32 copies and softmax of the (B, R, V) logits are not kept for backward: only the logits
themselves are, and the chunk's intermediates are rebuilt in backward.

With ``compiled=True`` the per-chunk reduction runs as one ``torch.compile``d kernel chain: the
(C, V) float32 intermediates then never reach device memory, which matters for large vocabularies
(it is memory-bound: a 150k vocabulary makes each token's reduction read and write megabytes),
and it runs without the activation checkpoint (its backward recomputes the softmax itself).

Temperature: logits are divided by the sampling temperature exactly as the rollout engine does
before sampling, so the logprobs are those of the distribution the tokens were drawn from
(top-p/top-k truncation is not modelled).
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlfleet.common.errors import BatchContractError
from rlfleet.trainer.shared_prompt import (
    Packing,
    can_pack,
    group_rows,
    pack_rows,
    packed_logits,
    packing_works,
    prompt_key,
    unpack,
    window_allows,
)

logger = logging.getLogger(__name__)


# --- inputs ---------------------------------------------------------------------------------------

TOKEN_KEYS = ("prompt_ids", "prompt_mask", "response_ids", "response_mask")
"""Batch fields every update needs; ``rollout_logprobs`` and ``group_index`` are optional."""


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """(B, T) 0/1 mask -> (B, T) int64 positions: 0 at the first real token; padding gets 0."""
    positions = attention_mask.long().cumsum(dim=-1) - 1
    return positions.clamp(min=0)


def validate_batch(batch: Mapping[str, Tensor]) -> None:
    """Raise :class:`~rlfleet.common.errors.BatchContractError` unless the token fields are present
    and shaped (N, P) / (N, R)."""
    for key in TOKEN_KEYS:
        if key not in batch:
            raise BatchContractError(key, f"missing; a rollout batch needs {', '.join(TOKEN_KEYS)}")
        if batch[key].ndim != 2:
            raise BatchContractError(key, f"expected 2 dims (N, L), got shape {tuple(batch[key].shape)}")
    n = batch["prompt_ids"].shape[0]
    pairs = (("prompt_mask", "prompt_ids"), ("response_mask", "response_ids"))
    for mask_key, ids_key in pairs:
        if batch[mask_key].shape != batch[ids_key].shape:
            raise BatchContractError(
                mask_key, f"shape {tuple(batch[mask_key].shape)} != {ids_key} {tuple(batch[ids_key].shape)}"
            )
    if batch["response_ids"].shape[0] != n:
        raise BatchContractError("response_ids", f"{batch['response_ids'].shape[0]} rows, prompt_ids has {n}")
    rollout = batch.get("rollout_logprobs")
    if rollout is not None and rollout.shape != batch["response_ids"].shape:
        raise BatchContractError(
            "rollout_logprobs",
            f"shape {tuple(rollout.shape)} != response_ids {tuple(batch['response_ids'].shape)}",
        )


@dataclass(frozen=True)
class PolicyInputs:
    """Forward inputs of a batch of N samples, prompt length P and response length R.

    Attributes:
        input_ids: (N, P + R) int64, prompt then response.
        attention_mask: (N, P + R) int64.
        position_ids: (N, P + R) int64, cumsum of the mask.
        response_mask: (N, R) int64, 1 for generated tokens.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    response_mask: Tensor

    @property
    def response_len(self) -> int:
        """R, the response width."""
        return self.response_mask.shape[1]

    @property
    def num_samples(self) -> int:
        """N."""
        return self.input_ids.shape[0]

    def select(self, rows: Tensor) -> PolicyInputs:
        """The sub-batch of ``rows`` (K,), with columns of left padding shared by all its rows dropped."""
        mask = self.attention_mask[rows]
        real_cols = mask.any(dim=0).nonzero()
        start = int(real_cols[0].item()) if real_cols.numel() else 0
        start = min(start, mask.shape[1] - self.response_len)
        return PolicyInputs(
            input_ids=self.input_ids[rows, start:],
            attention_mask=mask[:, start:],
            position_ids=self.position_ids[rows, start:],
            response_mask=self.response_mask[rows],
        )

    def to(self, device: torch.device | str) -> PolicyInputs:
        """A copy on ``device``."""
        return PolicyInputs(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            position_ids=self.position_ids.to(device),
            response_mask=self.response_mask.to(device),
        )


def build_policy_inputs(batch: Mapping[str, Tensor]) -> PolicyInputs:
    """Concatenate prompt and response of a contract batch into :class:`PolicyInputs` (same device)."""
    validate_batch(batch)
    input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1).long()
    attention_mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).long()
    return PolicyInputs(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        response_mask=batch["response_mask"].long(),
    )


# --- token logprobs -------------------------------------------------------------------------------

DEFAULT_CHUNK_ROWS = 1024
"""Token rows reduced at once: one chunk's float32 (rows, V) copy is the transient peak."""


def _chunk_logprob_entropy(
    logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool, entropy_grad: bool = True
) -> tuple[Tensor, Tensor]:
    """(C, V) logits, (C,) labels -> logprob (C,), entropy (C,) (zeros when not asked).

    One max, then the two sums ``s = sum exp(z - m)`` and ``sum exp(z - m) (z - m)`` over the same
    row (one pass each when compiled): ``logsumexp = m + log s``, entropy ``log s - sum / s``. The
    max is detached (the gradient of either does not depend on it). Without ``entropy_grad`` the
    entropy is computed from detached values: a metric only, so backward does no work for it.
    """
    z = logits.float() / temperature
    peak = z.detach().amax(dim=-1, keepdim=True)
    shifted = z - peak
    exp = shifted.exp()
    total = exp.sum(dim=-1)
    log_total = total.log()
    logprob = shifted.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - log_total
    if not with_entropy:
        return logprob, torch.zeros_like(logprob)
    if not entropy_grad:
        shifted, exp, total, log_total = shifted.detach(), exp.detach(), total.detach(), log_total.detach()
    return logprob, log_total - (exp * shifted).sum(dim=-1) / total


@functools.cache
def _compiled_chunk() -> Callable[[Tensor, Tensor, float, bool, bool], tuple[Tensor, Tensor]]:
    """``_chunk_logprob_entropy`` under ``torch.compile``, built on first use."""
    return torch.compile(_chunk_logprob_entropy)  # type: ignore[return-value]


def logprobs_from_logits(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    entropy_grad: bool = True,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    compiled: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Gathered log-softmax and entropy, chunked over tokens.

    Args:
        logits: (B, R, V) logits predicting ``labels`` (any float dtype).
        labels: (B, R) int64 token ids.
        temperature: logits are divided by it first (> 0).
        compute_entropy: also return the entropy of each position's distribution.
        entropy_grad: the entropy takes part in the loss (False: a metric, returned without grad).
        chunk_rows: tokens reduced at once.
        compiled: reduce each chunk with the ``torch.compile``d kernel (see the module docstring).

    Returns:
        logprobs (B, R) float32 and entropy (B, R) float32 (None without ``compute_entropy``).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to compute logprobs; got {temperature}")
    b, r, v = logits.shape
    flat_logits, flat_labels = logits.reshape(b * r, v), labels.reshape(b * r)
    # the compiled reduction keeps for backward only what it needs (it recomputes the softmax
    # itself), so it needs no activation checkpoint, and skipping it saves a pass over the logits
    use_checkpoint = torch.is_grad_enabled() and logits.requires_grad and not compiled
    reduce = _compiled_chunk() if compiled else _chunk_logprob_entropy
    if b * r == 0:
        empty = logits.new_zeros((b, r), dtype=torch.float32)
        return empty, (empty.clone() if compute_entropy else None)
    logprob_parts: list[Tensor] = []
    entropy_parts: list[Tensor] = []
    # split, not slicing in a loop: one SplitBackward puts the chunks' gradients together once,
    # where each slice's backward would write a zero-filled full-size (B * R, V) gradient
    step = max(chunk_rows, 1)
    for chunk, chunk_labels in zip(flat_logits.split(step), flat_labels.split(step), strict=True):
        args = (chunk, chunk_labels, temperature, compute_entropy, entropy_grad)
        if use_checkpoint:
            logprob, entropy = checkpoint(reduce, *args, use_reentrant=False)
        else:
            logprob, entropy = reduce(*args)
        logprob_parts.append(logprob)
        entropy_parts.append(entropy)
    logprobs = torch.cat(logprob_parts).reshape(b, r)
    entropy = torch.cat(entropy_parts).reshape(b, r) if compute_entropy else None
    return logprobs, entropy


def trim_response_padding(
    input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_len: int
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Drop the trailing columns that are padding in every row: ``(ids, mask, positions, R')``.

    Responses are right-padded to the batch's longest, so a micro-batch of shorter ones (rows are
    grouped by length, :func:`~rlfleet.trainer.distributed.local_rows`) carries columns no row
    uses; the forward skips them. R' >= 1 is the micro-batch's own response width; put the
    outputs back to width R with :func:`pad_response`.
    """
    used = attention_mask[:, -response_len:].any(dim=0).nonzero()
    kept = int(used[-1].item()) + 1 if used.numel() else 1
    if kept == response_len:
        return input_ids, attention_mask, position_ids, response_len
    end = input_ids.shape[1] - (response_len - kept)
    return input_ids[:, :end], attention_mask[:, :end], position_ids[:, :end], kept


def pad_response(values: Tensor, width: int) -> Tensor:
    """(B, R') -> (B, ``width``): zeros in the trimmed padding columns."""
    missing = width - values.shape[1]
    return values if missing == 0 else torch.nn.functional.pad(values, (0, missing))


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``logits_to_keep`` (every recent HF causal LM does)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _one_pass_logits(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_len: int
) -> Tensor:
    """The logits (B, R, V) at the positions that predict the response tokens, in one forward."""
    # the logit at position t predicts token t + 1: keep positions T-R-1 .. T-2
    total = input_ids.shape[1]
    kwargs: dict[str, object] = {"use_cache": False}
    trim = not _accepts_logits_to_keep(model)
    if not trim:  # only these positions reach the lm_head, and the logits come out contiguous
        kwargs["logits_to_keep"] = torch.arange(total - response_len - 1, total - 1, device=input_ids.device)
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **kwargs
    ).logits
    return logits[:, -(response_len + 1) : -1] if trim else logits


def _packing(
    input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_len: int
) -> Packing | None:
    _, inverse = group_rows(prompt_key(input_ids, attention_mask, position_ids, response_len))
    return pack_rows(input_ids, attention_mask, position_ids, response_len, inverse)


def _packed_logprobs(
    model: nn.Module, packing: Packing, reduce: Callable[[Tensor, Tensor], tuple[Tensor, Tensor | None]]
) -> tuple[Tensor, Tensor | None]:
    """Per-row logprobs and entropy (B, R) from the packed forward: reduced where the logits are
    (U, K, V), then the small results picked per row; a group's first response tokens all come from
    the prompt's last position, each with its own label, so those B rows are reduced apart."""
    logits = packed_logits(model, packing)
    logp, entropy = reduce(logits, packing.labels)
    firsts = logits[packing.source, packing.predictors[:, 0]][:, None]  # (B, 1, V)
    first_logp, first_entropy = reduce(firsts, packing.first_labels[:, None])
    logp = unpack(packing, logp, first_logp[:, 0])
    if entropy is None or first_entropy is None:
        return logp, None
    return logp, unpack(packing, entropy, first_entropy[:, 0])


def _check_logprobs(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, response_len: int, packed: bool
) -> Tensor:
    """The rows' response logprobs, packed or plain: what :func:`packing_works` compares."""
    reduce = functools.partial(logprobs_from_logits, compute_entropy=False)
    position_ids = position_ids_from_mask(attention_mask)
    if packed:
        packing = _packing(input_ids, attention_mask, position_ids, response_len)
        if packing is None:  # cannot happen for the check's rows; never let it pass as plain
            return torch.full(input_ids[:, -response_len:].shape, float("nan"))
        return _packed_logprobs(model, packing, reduce)[0]
    logits = _one_pass_logits(model, input_ids, attention_mask, position_ids, response_len)
    return reduce(logits, input_ids[:, -response_len:])[0]


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    response_len: int,
    *,
    position_ids: Tensor | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    entropy_grad: bool = True,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    compiled: bool = False,
    share_prompts: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs and entropy of the last ``response_len`` tokens of each row.

    Args:
        model: an HF causal LM (``model(...).logits``).
        input_ids: (B, T) prompt (left-padded) then response (right-padded), T > R.
        attention_mask: (B, T) 1 for real tokens.
        response_len: R, the response width at the end of each row.
        position_ids: (B, T); defaults to the cumsum of the mask (left padding harmless).
        temperature: sampling temperature of the rollout engine.
        compute_entropy: also return per-token entropy.
        entropy_grad: the entropy takes part in the loss (False: returned without grad).
        chunk_rows: tokens reduced at once (see the module docstring).
        compiled: reduce with the ``torch.compile``d kernel.
        share_prompts: rows with the same prompt run as one packed sequence, the prompt once and no
            padding (:mod:`rlfleet.trainer.shared_prompt`), where the model can and that costs less.

    Returns:
        logprobs (B, R) float32 and entropy (B, R) float32 or None; values at padding are
        meaningless, mask them with the response mask.
    """
    if not 0 < response_len < input_ids.shape[1]:
        raise ValueError(f"response_len must be in (0, T={input_ids.shape[1]}); got {response_len}")
    if position_ids is None:
        position_ids = position_ids_from_mask(attention_mask)
    width = response_len
    input_ids, attention_mask, position_ids, response_len = trim_response_padding(
        input_ids, attention_mask, position_ids, response_len
    )
    reduce = functools.partial(
        logprobs_from_logits, temperature=temperature, compute_entropy=compute_entropy,
        entropy_grad=entropy_grad, chunk_rows=chunk_rows, compiled=compiled,
    )  # fmt: skip
    packing = None
    if (share_prompts and can_pack(model) and window_allows(model, input_ids.shape[1])
            and packing_works(model, _check_logprobs)):  # fmt: skip
        packing = _packing(input_ids, attention_mask, position_ids, response_len)
        if packing is not None and packing.input_ids.numel() >= input_ids.numel():
            packing = None  # nothing shared and no padding saved: the plain forward is as short
    if packing is not None:
        logp, entropy = _packed_logprobs(model, packing, reduce)
    else:
        logits = _one_pass_logits(model, input_ids, attention_mask, position_ids, response_len)
        logp, entropy = reduce(logits, input_ids[:, -response_len:])
    return pad_response(logp, width), None if entropy is None else pad_response(entropy, width)
