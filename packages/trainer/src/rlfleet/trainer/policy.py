"""The policy's forward: a batch's inputs, each rank's rows, shared prompts packed, token logprobs.

"Run the policy on these rows" is one idea, from a rollout batch to the logprobs (and entropy) of
its response tokens: with grad for one micro-batch of the loss (:func:`logprobs`), or without for
every row of a batch (:func:`compute_logprobs`: the old and the reference logprobs)::

    batch ──build_policy_inputs──> PolicyInputs (N, P + R), every row on every rank
      rows ──local_rows──> this rank's share, longest first (one process: a prompt's rows in one
                           micro-batch where that runs fewer positions, PromptLayout.order)
        micro-batch ──select──> its own width ──token_logprobs──> logprobs, entropy (B, R) float32
                                  packed: the rows of a prompt as one sequence, the prompt once
                                  plain:  one forward, the logits of the R predicting positions only
      no grad: every row's results summed over the ranks (forward_rows), so every rank holds all N

The actor (:mod:`rlfleet.trainer.actor`) holds the models; what runs them in a step is here. A
step reads the actor as a :class:`Policy`: its models, its ranks and how it runs them.

Inputs: the training sequence of a sample is ``prompt (left-padded) ++ response (right-padded)``,
so every row has length T = P + R and its response starts at column P. Position ids come from the
cumulative sum of the attention mask, which makes left padding invisible to the model: a prompt
padded to any width gives the same logprobs as the unpadded prompt.

Rows: the whole batch is on every rank; rank r takes rows ``order[r::W]`` where ``order`` sorts
the rows by length (longest first, ties by index), so ranks get similar token counts and a
micro-batch holds rows of similar length. All ranks must run the same number of forwards (each
one all-gathers under FSDP), so a rank with fewer rows pads with copies of a real row of weight 0.
Sums over the ranks (:func:`all_reduce_sum`: no-grad results, a loss's metric sums) are the
collectives of a step besides FSDP's own; the process group is :mod:`rlfleet.trainer.distributed`'s.

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

Shared prompts, packed: GRPO, RLOO and REINFORCE++ sample a group of answers to every prompt, and
a training row is ``prompt ++ response`` padded to the micro-batch's width, so a micro-batch of B
rows from U prompts pushes each prompt through every layer B / U times, and every row through the
padding up to the longest one. Here the rows of one prompt become one packed sequence::

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
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlfleet.common.errors import BatchContractError
from rlfleet.trainer.distributed import DistContext

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


LOSS_MASK = "loss_mask"
"""An optional (N, R) mask of the response tokens the losses count (overlong filtering zeroes the rows
of samples cut at the cap); attention still sees every response token."""


def build_policy_inputs(batch: Mapping[str, Tensor]) -> PolicyInputs:
    """Concatenate prompt and response of a contract batch into :class:`PolicyInputs` (same device);
    the inputs' ``response_mask`` is the batch's ``loss_mask`` where it has one."""
    validate_batch(batch)
    input_ids = torch.cat([batch["prompt_ids"], batch["response_ids"]], dim=1).long()
    attention_mask = torch.cat([batch["prompt_mask"], batch["response_mask"]], dim=1).long()
    return PolicyInputs(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        response_mask=batch.get(LOSS_MASK, batch["response_mask"]).long(),  # what the losses count
    )


# --- each rank's rows -----------------------------------------------------------------------------


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place (a no-op with one rank); returns it."""
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


@dataclass(frozen=True)
class LocalRows:
    """One rank's share of a set of batch rows.

    Attributes:
        rows: (K,) int64 row indices into the batch, padded to the same K on every rank.
        weights: (K,) float32, 1 for the rank's own rows, 0 for padding copies.
    """

    rows: Tensor
    weights: Tensor

    @property
    def real(self) -> Tensor:
        """(K,) bool: the rows that are this rank's own (not padding)."""
        return self.weights > 0


def local_rows(
    rows: Tensor,
    lengths: Tensor,
    rank: int,
    world_size: int,
    prompts: PromptLayout | None = None,
    micro_batch_size: int = 1,
) -> LocalRows:
    """Rank ``rank``'s rows of ``rows`` (M,) given every row's token count ``lengths`` (N,).

    The rows are sorted by length, longest first (stable): consecutive micro-batches then hold
    rows of similar length, so each runs at its own width (the padding columns that none of its
    rows uses are dropped, :meth:`PolicyInputs.select` and :func:`trim_response_padding`). With
    one rank that is all; otherwise they are dealt out ``rank::world_size``, and every rank gets
    ``ceil(M / world_size)`` rows, the last ones padding (weight 0) where M does not divide. With
    ``prompts`` (a forward that packs the rows of a prompt) one process keeps a prompt's rows in one
    micro-batch of ``micro_batch_size`` instead where that runs fewer positions
    (:meth:`PromptLayout.order`).
    """
    order = torch.sort(lengths[rows].cpu(), descending=True, stable=True).indices
    if world_size == 1:
        mine = rows[order.to(rows.device)]
        if prompts is not None:
            mine = prompts.order(mine, micro_batch_size)
        return LocalRows(mine, torch.ones(len(rows), dtype=torch.float32, device=rows.device))
    if len(rows) == 0:
        raise ValueError("cannot split an empty set of rows over ranks")
    mine = rows[order.to(rows.device)][rank::world_size]
    target = -(-len(rows) // world_size)
    weights = torch.ones(target, dtype=torch.float32, device=rows.device)
    if len(mine) < target:
        weights[len(mine) :] = 0.0
        filler = rows[:1].expand(target - len(mine))
        mine = torch.cat([mine, filler])
    return LocalRows(mine, weights)


@torch.no_grad()
def forward_rows(
    inputs: PolicyInputs,
    micro_batch_size: int,
    ctx: DistContext,
    forward: Callable[[PolicyInputs], Tensor],
    prompts: PromptLayout | None = None,
) -> Tensor:
    """``forward`` of every row without grad: inputs (N, P + R) -> (N, R) float32, 0 at padding.

    Each rank runs its rows (:func:`local_rows`; the same number of forwards on every rank) in
    micro-batches, and the results are summed over ranks, so every rank returns all N rows
    (``prompts``: see :func:`local_rows`).
    """
    device = inputs.input_ids.device
    share = local_rows(torch.arange(inputs.num_samples, device=device), inputs.attention_mask.sum(dim=-1),
                       ctx.rank, ctx.world_size, prompts, micro_batch_size)  # fmt: skip
    out = torch.zeros(inputs.response_mask.shape, dtype=torch.float32, device=device)
    for chunk, weight in zip(share.rows.split(micro_batch_size), share.weights.split(micro_batch_size),
                             strict=True):  # fmt: skip
        mb = inputs.select(chunk)
        real = weight > 0
        out[chunk[real]] = (forward(mb) * mb.response_mask)[real]
    return all_reduce_sum(out, ctx)


# --- the policy: its forward on a micro-batch, and on every row -----------------------------------


class Policy(Protocol):
    """What a step's forward reads of the actor (:class:`~rlfleet.trainer.actor.Actor`)."""

    @property
    def model(self) -> nn.Module:
        """The trained policy."""
        ...

    @property
    def ref_model(self) -> nn.Module | None:
        """The frozen reference, once loaded (:meth:`reference` loads it)."""
        ...

    @property
    def dist(self) -> DistContext:
        """The trainer's ranks."""
        ...

    @property
    def compiled(self) -> bool:
        """The logprob reduction runs ``torch.compile``d."""
        ...

    @property
    def share_prompts(self) -> bool:
        """A prompt's rows run as one packed sequence where that costs less."""
        ...

    @property
    def logprob_chunk_rows(self) -> int:
        """Tokens per chunk of the logprob reduction."""
        ...

    def computing(self) -> AbstractContextManager[None]:
        """How the policy's forwards run (bf16 autocast in one process when it computes in bf16;
        attention kernels: :meth:`rlfleet.trainer.loop.Trainable.computing`)."""
        ...

    def reference(self) -> nn.Module:
        """The frozen reference model, loaded on first use."""
        ...


def logprobs(
    policy: Policy,
    mb: PolicyInputs,
    *,
    temperature: float,
    entropy: bool = True,
    entropy_grad: bool = True,
    model: nn.Module | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs (and entropy) of one micro-batch's response tokens: (B, P + R) -> (B, R) float32.

    With grad when grad is enabled; the entropy only with ``entropy_grad`` (otherwise a metric,
    whose backward costs nothing). ``model`` defaults to the policy. Values at padding are
    meaningless (mask them).
    """
    with policy.computing():
        return token_logprobs(
            model if model is not None else policy.model, mb.input_ids, mb.attention_mask, mb.response_len,
            position_ids=mb.position_ids, temperature=temperature, compute_entropy=entropy,
            entropy_grad=entropy_grad, chunk_rows=policy.logprob_chunk_rows, compiled=policy.compiled,
            share_prompts=policy.share_prompts,
        )  # fmt: skip


@torch.no_grad()
def compute_logprobs(
    policy: Policy,
    inputs: PolicyInputs,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
    reference: bool = False,
) -> Tensor:
    """Logprobs of the response tokens without grad: inputs (N, P+R) -> (N, R) float32, 0 at padding.

    Of the policy, or of its frozen reference with ``reference``. Under FSDP each rank computes its
    rows and the results are summed over ranks (:func:`forward_rows`), so every rank returns all N.
    """
    model = reference_model(policy) if reference else policy.model
    model.eval()

    def forward(mb: PolicyInputs) -> Tensor:
        return logprobs(policy, mb, temperature=temperature, entropy=False, model=model)[0]

    return forward_rows(inputs, micro_batch_size, policy.dist, forward, prompt_layout(policy, inputs))


def reference_model(policy: Policy) -> nn.Module:
    """The policy's frozen reference: loaded by the actor the first time a step needs it, held after."""
    return policy.ref_model if policy.ref_model is not None else policy.reference()


def prompt_layout(policy: Policy, inputs: PolicyInputs) -> PromptLayout | None:
    """Which prompt each row of ``inputs`` has, to order micro-batches by; None when ``policy`` does
    not pack the rows of a prompt."""
    if not policy.share_prompts:
        return None
    return PromptLayout.of(inputs.input_ids, inputs.attention_mask, inputs.position_ids, inputs.response_len)


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
    """``_chunk_logprob_entropy`` under ``torch.compile``, built on first use.

    A chunk's rows (dim 0 of the logits and labels) are a symbol from the first call, so a chunk of
    another length reuses the graph (compiled for the first length it met, torch compiled again for
    the second); the vocabulary stays a constant. The labels go in as a fresh copy (C int64s): a
    view of the batch's ids has a stride and an offset that change with the sequence length, and
    torch compiled again for those. Grad on and off, the entropy asked for or not, and a chunk of a
    single row (torch treats sizes 0 and 1 apart, and then the chunk's offset in the logits too) are
    graphs of their own, each compiled once.
    """
    compiled = torch.compile(_chunk_logprob_entropy)

    def reduce(
        logits: Tensor, labels: Tensor, temperature: float, with_entropy: bool, entropy_grad: bool = True
    ) -> tuple[Tensor, Tensor]:
        labels = labels.clone()
        # a hint, not a demand (mark_dynamic): a chunk of one row is compiled for that size
        torch._dynamo.maybe_mark_dynamic(logits, 0)
        torch._dynamo.maybe_mark_dynamic(labels, 0)
        return compiled(logits, labels, temperature, with_entropy, entropy_grad)

    return reduce


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
    grouped by length, :func:`local_rows`) carries columns no row
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
            padding (see the module docstring), where the model can and that costs less.

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


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax distribution over the last dim: (..., V) -> (...).

    ``H = logsumexp(z) - sum(softmax(z) * z)``, computed in float32 (no (…, V) log-softmax kept).
    """
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


# --- shared prompts, packed -----------------------------------------------------------------------

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


# --- which models pack ----------------------------------------------------------------------------


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


# --- ordering a mini-batch's rows -----------------------------------------------------------------


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
