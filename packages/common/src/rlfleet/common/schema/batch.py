"""The batch contracts every tier shares, and the only padding code: rollout batches and preference pairs.

**Rollout batch** (a rollout worker's result; what reward and trainer read). N = prompts x samples,
prompt-major (sample j of prompt i is row i*n + j):

- ``prompt_ids`` (N, P) int64, LEFT-padded with the pad id; ``prompt_mask`` (N, P) int64, 1 on tokens
- ``response_ids`` (N, R) int64, RIGHT-padded; ``response_mask`` (N, R) int64, 1 on generated
  tokens (a generated EOS counts); ``rollout_logprobs`` (N, R) float32, 0 at padding, NaN on
  tokens no engine produced (responses the controller's rollout fn wrote itself)
- ``group_index`` (N,) int64: the prompt (0..num_prompts-1) each sample answers
- optional ``response_versions`` (N, R) int64: the weight version that sampled each response token,
  -1 at padding and where unknown (a rollout worker writes it; with partial rollouts a sample's
  tokens may come from several versions)
- ``prompt_text`` / ``response_text`` uint8 (total utf-8 bytes,) with ``*_offsets`` (N+1,) int64:
  text ``i`` is ``data[offsets[i]:offsets[i+1]]`` (:func:`pack_texts` / :func:`unpack_texts`)

A multi-turn batch (episodes against an environment, issue 33: each response is the model's turns
with the environment's observations between them, token for token as the model was conditioned on
them) adds the optional fields of :data:`OPTIONAL_FIELDS`; ``response_mask`` stays 1 on every
response token (attention reads them all) and ``rollout_logprobs`` is NaN on the observations':

- ``loss_mask`` (N, R) int64: 1 on the tokens the model sampled, 0 on observation tokens and
  padding: the tokens the trainer's losses count
- ``episode_reward`` (N,) float32: the environment's reward for the episode (0 unless it ended done)
- ``episode_turns`` (N,) int64: the model's turns; ``episode_tool_calls`` (N,) int64 and
  ``episode_tool_errors`` (N,) int64 (tool errors plus malformed calls): the environment's counts
- ``episode_env_s`` (N,) float32: seconds the episode waited on the environment
- ``episode_end`` (N,) int64: why it ended, an index into :data:`EPISODE_ENDS` (``done``,
  ``max_turns``, ``max_tokens``: cut at the token cap, ``env_error``: the environment failed)
- ``episode_obs_cut`` (N,) int64: observation tokens cut off at the per-observation cap

Merged with chunks that lack them, a chunk's missing ``loss_mask`` is its ``response_mask`` (every
response token sampled), its missing ``response_versions`` -1, its missing episode fields 0.

**Preference batch** (DPO pairs, from the controller's dataset): ``prompt_ids``/``prompt_mask``
(N, P) left-padded, ``chosen_ids``/``chosen_mask`` (N, C) and ``rejected_ids``/``rejected_mask``
(N, J) right-padded, all int64; optionally ``ref_chosen_logps``/``ref_rejected_logps`` (N,).

Several chunks (from several workers) merge into one batch with :func:`merge_rollouts` /
:func:`merge_preferences`: prompts are re-padded on the left, responses on the right, group
indices offset so each prompt keeps its own group; :func:`select_groups` keeps a chunk's rows of
some of its prompts (dynamic sampling). Every violation is a
:class:`~rlfleet.common.errors.BatchContractError` naming the field.

Importing this module does not import torch; its functions do, but for the texts' two
(:func:`pack_texts`, :func:`unpack_texts`), which also work on numpy arrays without torch.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rlfleet.common.errors import BatchContractError

if TYPE_CHECKING:
    from torch import Tensor

TOKEN_FIELDS = (
    "prompt_ids",
    "prompt_mask",
    "response_ids",
    "response_mask",
    "rollout_logprobs",
    "group_index",
)
TEXT_FIELDS = ("prompt_text", "prompt_text_offsets", "response_text", "response_text_offsets")
DTYPES: dict[str, str] = {
    "prompt_ids": "int64", "prompt_mask": "int64", "response_ids": "int64", "response_mask": "int64",
    "rollout_logprobs": "float32", "group_index": "int64", "prompt_text": "uint8",
    "prompt_text_offsets": "int64", "response_text": "uint8", "response_text_offsets": "int64",
}  # fmt: skip
"""Rollout-batch field -> torch dtype name."""
VERSIONS = "response_versions"
"""The optional per-token weight versions of a rollout batch (int64, (N, R), -1 = unknown)."""
LOSS_MASK = "loss_mask"
"""The optional (N, R) int64 mask of the response tokens the losses count (a multi-turn batch: the
model's own tokens, not the observations between its turns)."""
EPISODE_ENDS = ("done", "max_turns", "max_tokens", "env_error")
"""Why an episode ended: ``episode_end`` holds an index into this tuple."""


@dataclass(frozen=True)
class OptionalField:
    """An optional rollout-batch field: its dtype, its shape ((N, R) per token, else (N,)) and its
    value at padding and in a merged chunk that lacks it (a chunk's own ``response_mask`` for
    ``loss_mask``)."""

    dtype: str
    per_token: bool
    absent: float


OPTIONAL_FIELDS: dict[str, OptionalField] = {
    VERSIONS: OptionalField("int64", True, -1),
    LOSS_MASK: OptionalField("int64", True, 0),
    "episode_reward": OptionalField("float32", False, 0.0),
    "episode_turns": OptionalField("int64", False, 0),
    "episode_tool_calls": OptionalField("int64", False, 0),
    "episode_tool_errors": OptionalField("int64", False, 0),
    "episode_env_s": OptionalField("float32", False, 0.0),
    "episode_end": OptionalField("int64", False, 0),
    "episode_obs_cut": OptionalField("int64", False, 0),
}
"""The optional fields of a rollout batch (module docstring), checked, merged and selected with it."""
PAIR_FIELDS = ("prompt_ids", "prompt_mask", "chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")
REF_FIELDS = ("ref_chosen_logps", "ref_rejected_logps")
"""Optional precomputed reference sequence log-probs of a preference batch."""


# --- padding (the only implementation) ---------------------------------------------------------


def pad_rows(
    rows: Sequence[Sequence[float | int]],
    pad_value: float | int,
    *,
    left: bool,
    dtype: str = "int64",
    width: int | None = None,
    min_width: int = 0,
) -> tuple[Tensor, Tensor]:
    """Rows of numbers -> ``(values, mask)`` (len(rows), width): padded on the left or the right.

    ``width`` defaults to the longest row (at least ``min_width``); ``mask`` is int64, 1 on real entries.
    """
    import torch

    longest = max((len(r) for r in rows), default=0)
    if width is None:
        width = max(min_width, longest)
    elif width < longest:
        raise BatchContractError("width", f"{width} is shorter than the longest row ({longest})")
    values = torch.full((len(rows), width), pad_value, dtype=getattr(torch, dtype))
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        if len(row):
            span = slice(width - len(row), width) if left else slice(0, len(row))
            values[i, span] = torch.as_tensor(row, dtype=values.dtype)
            mask[i, span] = 1
    return values, mask


def pad_left(
    rows: Sequence[Sequence[int]], pad_value: int, width: int | None = None
) -> tuple[Tensor, Tensor]:
    """Left-pad token rows: ``(ids, mask)``, both (len(rows), width) int64."""
    return pad_rows(rows, pad_value, left=True, width=width)


def pad_right(
    rows: Sequence[Sequence[float | int]],
    pad_value: float | int,
    dtype: str = "int64",
    width: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Right-pad rows: ``(values, mask)``; values of ``dtype`` (a torch dtype name), mask int64."""
    return pad_rows(rows, pad_value, left=False, dtype=dtype, width=width)


def widen(tensor: Tensor, width: int, *, left: bool, value: float = 0) -> Tensor:
    """A (N, L) tensor padded with ``value`` to (N, ``width``) on the left or the right."""
    import torch

    extra = width - tensor.shape[1]
    if extra <= 0:
        return tensor
    pad = torch.full((tensor.shape[0], extra), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([pad, tensor] if left else [tensor, pad], dim=1)


# --- texts --------------------------------------------------------------------------------------


def pack_texts(
    texts: Sequence[str], *, arrays: Literal["torch", "numpy"] | None = None
) -> tuple[Tensor, Tensor]:
    """Texts -> (uint8 data (sum of utf-8 lengths,), int64 offsets (N+1,)).

    torch tensors, or numpy arrays with ``arrays="numpy"`` (the default where torch is not
    installed: the reward server's ``admin score`` packs texts without it).
    """
    encoded = [t.encode("utf-8") for t in texts]
    offsets = [0]
    for raw in encoded:
        offsets.append(offsets[-1] + len(raw))
    joined = bytearray(b"".join(encoded))
    if (arrays or _default_arrays()) == "numpy":
        import numpy as np

        return np.frombuffer(joined, dtype=np.uint8).copy(), np.asarray(offsets, dtype=np.int64)
    import torch

    data = (
        torch.frombuffer(joined, dtype=torch.uint8).clone() if joined else torch.zeros(0, dtype=torch.uint8)
    )
    return data, torch.tensor(offsets, dtype=torch.int64)


def _default_arrays() -> Literal["torch", "numpy"]:
    """torch where it is installed, else numpy (as the tensor plane's codec decides)."""
    from rlfleet.common.tensors.codec import DEFAULT_ARRAYS

    return DEFAULT_ARRAYS


def unpack_texts(data: Tensor, offsets: Tensor) -> list[str]:
    """Inverse of :func:`pack_texts` (torch tensors or numpy arrays); :class:`BatchContractError` when
    the offsets do not fit."""
    torch = sys.modules.get("torch")  # a torch tensor exists only where torch was imported
    if torch is not None and isinstance(data, torch.Tensor) and isinstance(offsets, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise BatchContractError(
                "text", f"expected 1-d uint8 data, got {data.dtype} of shape {list(data.shape)}"
            )
        if offsets.dim() != 1 or offsets.dtype.is_floating_point:
            raise BatchContractError(
                "text_offsets", f"expected 1-d integer offsets, got shape {list(offsets.shape)}"
            )
        bounds = [int(x) for x in offsets.tolist()]
        raw = data.contiguous().numpy().tobytes()
    else:
        import numpy as np

        data, offsets = np.asarray(data), np.asarray(offsets)
        if data.dtype != np.uint8 or data.ndim != 1:
            raise BatchContractError(
                "text", f"expected 1-d uint8 data, got {data.dtype} of shape {list(data.shape)}"
            )
        if offsets.ndim != 1 or offsets.dtype.kind not in "iub":
            raise BatchContractError(
                "text_offsets",
                f"expected 1-d integer offsets, got {offsets.dtype} of shape {list(offsets.shape)}",
            )
        bounds = [int(x) for x in offsets.tolist()]
        raw = data.tobytes()
    if (
        not bounds
        or bounds[0] != 0
        or bounds[-1] != len(raw)
        or any(a > b for a, b in zip(bounds, bounds[1:], strict=False))
    ):
        raise BatchContractError(
            "text_offsets", f"offsets {bounds[:4]}... do not fit {len(raw)} bytes of text"
        )
    try:
        return [raw[a:b].decode("utf-8") for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    except UnicodeDecodeError as exc:
        raise BatchContractError("text", f"not valid utf-8 between the offsets ({exc.reason})") from None


# --- rollout batches ----------------------------------------------------------------------------


@dataclass
class RolloutBatch:
    """One rollout batch: token tensors as in the contract, texts as Python strings.

    Shapes: ``prompt_ids``/``prompt_mask`` (N, P); ``response_ids``/``response_mask``/
    ``rollout_logprobs`` (N, R); ``group_index`` (N,); ``prompt_text``/``response_text`` N strings.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    rollout_logprobs: Tensor
    group_index: Tensor
    prompt_text: list[str]
    response_text: list[str]

    def __post_init__(self) -> None:
        check_rollout_tensors({name: getattr(self, name) for name in TOKEN_FIELDS})
        n = self.num_samples
        for name in ("prompt_text", "response_text"):
            if len(getattr(self, name)) != n:
                raise BatchContractError(name, f"{len(getattr(self, name))} texts for {n} rows")

    @property
    def num_samples(self) -> int:
        """N, the number of rows."""
        return int(self.prompt_ids.shape[0])

    def to_tensors(self) -> dict[str, Tensor]:
        """The contract's dict of tensors, ready for ``TensorStore.put``."""
        out = {name: getattr(self, name) for name in TOKEN_FIELDS}
        out["prompt_text"], out["prompt_text_offsets"] = pack_texts(self.prompt_text)
        out["response_text"], out["response_text_offsets"] = pack_texts(self.response_text)
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, Tensor]) -> RolloutBatch:
        """Rebuild a batch from the contract's dict; :class:`BatchContractError` names a bad field."""
        missing = [name for name in (*TOKEN_FIELDS, *TEXT_FIELDS) if name not in tensors]
        if missing:
            raise BatchContractError(missing[0], "missing from the tensor dict")
        return cls(
            **{name: tensors[name] for name in TOKEN_FIELDS},
            prompt_text=unpack_texts(tensors["prompt_text"], tensors["prompt_text_offsets"]),
            response_text=unpack_texts(tensors["response_text"], tensors["response_text_offsets"]),
        )

    @classmethod
    def from_rows(
        cls,
        *,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]],
        group_index: Sequence[int],
        pad_id: int,
        prompt_text: Sequence[str] | None = None,
        response_text: Sequence[str] | None = None,
    ) -> RolloutBatch:
        """Pad per-sample token lists into a batch (prompts left, responses and logprobs right).

        Texts default to empty strings; each ``logprobs`` row must match its response's length.
        """
        import torch

        for i, (resp, lp) in enumerate(zip(responses, logprobs, strict=True)):
            if len(resp) != len(lp):
                raise BatchContractError(
                    "rollout_logprobs", f"row {i}: {len(lp)} logprobs for {len(resp)} tokens"
                )
        prompt_ids, prompt_mask = pad_left(prompts, pad_id)
        response_ids, response_mask = pad_right(responses, pad_id)
        rollout_logprobs, _ = pad_right(logprobs, 0.0, "float32", width=response_ids.shape[1])
        n = len(prompts)
        return cls(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
            response_mask=response_mask, rollout_logprobs=rollout_logprobs,
            group_index=torch.as_tensor(list(group_index), dtype=torch.int64).reshape(-1),
            prompt_text=list(prompt_text) if prompt_text is not None else [""] * n,
            response_text=list(response_text) if response_text is not None else [""] * n,
        )  # fmt: skip


def check_rollout_tensors(tensors: Mapping[str, Tensor]) -> int:
    """Raise :class:`BatchContractError` naming the first token field that breaks the contract; returns N."""
    import torch

    for name in TOKEN_FIELDS:
        tensor = tensors.get(name)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != getattr(torch, DTYPES[name]):
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise BatchContractError(name, f"expected a {DTYPES[name]} tensor, got {got}")
    for name in ("prompt_ids", "response_ids"):
        if tensors[name].dim() != 2:
            raise BatchContractError(name, f"expected 2 dims, got shape {list(tensors[name].shape)}")
    n, p = tensors["prompt_ids"].shape
    r = tensors["response_ids"].shape[1]
    expected = {
        "prompt_mask": (n, p),
        "response_mask": (n, r),
        "rollout_logprobs": (n, r),
        "group_index": (n,),
    }
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise BatchContractError(name, f"shape {list(tensors[name].shape)}, expected {list(shape)}")
    for name, spec in OPTIONAL_FIELDS.items():
        tensor = tensors.get(name)
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != getattr(torch, spec.dtype):
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            article = "an" if spec.dtype.startswith("int") else "a"
            raise BatchContractError(name, f"expected {article} {spec.dtype} tensor, got {got}")
        shape = [n, r] if spec.per_token else [n]
        if list(tensor.shape) != shape:
            raise BatchContractError(name, f"shape {list(tensor.shape)}, expected {shape}")
    return int(n)


ID_FIELDS = ("prompt_ids", "response_ids", "chosen_ids", "rejected_ids")
"""The token-id fields of either batch contract."""


def check_token_ids(batch: Mapping[str, Tensor], vocab_size: int) -> None:
    """Raise :class:`BatchContractError` naming the first token-id field with an id outside
    ``[0, vocab_size)`` (an embedding lookup with it would crash the rank, on a GPU the process)."""
    for name in ID_FIELDS:
        ids = batch.get(name)
        if ids is None or ids.numel() == 0:
            continue
        low, high = int(ids.min().item()), int(ids.max().item())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise BatchContractError(name, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def merge_rollouts(chunks: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Concatenate rollout chunks into one batch: (N_total, P_max) and (N_total, R_max) token fields.

    Group indices are offset chunk by chunk, so every prompt keeps its own group. An optional field
    (:data:`OPTIONAL_FIELDS`) any chunk has is in the batch, padded with its absent value.
    """
    import torch

    if not chunks:
        raise BatchContractError("rollouts", "a train step needs at least one rollout chunk")
    for chunk in chunks:
        check_rollout_tensors(chunk)
    p_width = max(c["prompt_ids"].shape[1] for c in chunks)
    r_width = max(c["response_ids"].shape[1] for c in chunks)
    merged: dict[str, list[Tensor]] = {name: [] for name in TOKEN_FIELDS}
    offset = 0
    for chunk in chunks:
        for name in TOKEN_FIELDS[:2]:
            merged[name].append(widen(chunk[name], p_width, left=True))
        for name in TOKEN_FIELDS[2:5]:
            merged[name].append(widen(chunk[name], r_width, left=False))
        groups = chunk["group_index"]
        merged["group_index"].append(groups + offset)
        offset += int(groups.max().item()) + 1 if groups.numel() else 0
    out = {name: torch.cat(parts) for name, parts in merged.items()}
    for name, spec in OPTIONAL_FIELDS.items():
        if any(name in c for c in chunks):  # a chunk without it (a rollout fn's) gets its absent value
            parts = [c[name] if name in c else _absent(c, name) for c in chunks]
            if spec.per_token:
                parts = [widen(part, r_width, left=False, value=spec.absent) for part in parts]
            out[name] = torch.cat(parts)
    return out


def _absent(chunk: Mapping[str, Tensor], name: str) -> Tensor:
    """The optional field ``name`` of a chunk that lacks it: (N, R) or (N,) of its absent value, or
    the chunk's ``response_mask`` for ``loss_mask`` (a single-turn chunk's tokens are all sampled)."""
    import torch

    spec = OPTIONAL_FIELDS[name]
    if name == LOSS_MASK:
        return chunk["response_mask"]
    like = chunk["response_ids"] if spec.per_token else chunk["group_index"]
    return torch.full(like.shape, spec.absent, dtype=getattr(torch, spec.dtype))


def select_groups(chunk: Mapping[str, Tensor], groups: Sequence[int]) -> dict[str, Tensor]:
    """The rows of the rollout chunk ``chunk`` that answer the prompts ``groups`` (its group indices,
    ascending, each one in the chunk), with ``group_index`` renumbered ``0..len(groups)-1``: what a
    step trains of a chunk whose other groups dynamic sampling dropped. Like :func:`merge_rollouts`
    it keeps the token fields and the optional fields (:data:`OPTIONAL_FIELDS`), not the texts."""
    import torch

    check_rollout_tensors(chunk)
    index = chunk["group_index"]
    wanted = torch.as_tensor(list(groups), dtype=torch.int64)
    if not wanted.numel():
        raise BatchContractError("groups", "a chunk the step trains on needs at least one of its groups")
    if bool((wanted[1:] <= wanted[:-1]).any()):
        raise BatchContractError("groups", f"must be ascending without repeats, got {list(groups)[:16]}")
    present = torch.unique(index)
    missing = wanted[~torch.isin(wanted, present)]
    if missing.numel():
        held = f"0..{int(present.max().item())}" if present.numel() else "none"
        first = int(missing[0].item())
        raise BatchContractError("groups", f"group {first} is not in the chunk (it holds {held})")
    rows = torch.isin(index, wanted)
    out = {name: chunk[name][rows] for name in TOKEN_FIELDS}
    out["group_index"] = torch.searchsorted(wanted, index[rows])
    for name in OPTIONAL_FIELDS:
        if name in chunk:
            out[name] = chunk[name][rows]
    return out


# --- preference batches -------------------------------------------------------------------------


def collate_pairs(
    prompts: Sequence[Sequence[int]],
    chosen: Sequence[Sequence[int]],
    rejected: Sequence[Sequence[int]],
    pad_id: int,
) -> dict[str, Tensor]:
    """Token lists of N pairs -> a preference batch (prompts left-padded, responses right-padded)."""
    if not prompts:
        raise BatchContractError("prompt_ids", "a preference batch needs at least one pair")
    out: dict[str, Tensor] = {}
    out["prompt_ids"], out["prompt_mask"] = pad_rows(prompts, pad_id, left=True, min_width=1)
    out["chosen_ids"], out["chosen_mask"] = pad_rows(chosen, pad_id, left=False, min_width=1)
    out["rejected_ids"], out["rejected_mask"] = pad_rows(rejected, pad_id, left=False, min_width=1)
    return out


def check_pairs(batch: Mapping[str, Tensor]) -> int:
    """Raise :class:`BatchContractError` unless ``batch`` is a preference batch; returns N."""
    for key in PAIR_FIELDS:
        if key not in batch:
            raise BatchContractError(key, f"missing; a preference batch needs {', '.join(PAIR_FIELDS)}")
        if batch[key].ndim != 2:
            raise BatchContractError(key, f"expected (N, L), got shape {tuple(batch[key].shape)}")
    n = int(batch["prompt_ids"].shape[0])
    for ids, mask in (
        ("prompt_ids", "prompt_mask"),
        ("chosen_ids", "chosen_mask"),
        ("rejected_ids", "rejected_mask"),
    ):
        if batch[ids].shape != batch[mask].shape or batch[ids].shape[0] != n:
            raise BatchContractError(
                mask, f"shape {tuple(batch[mask].shape)} vs {ids} {tuple(batch[ids].shape)}, N={n}"
            )
        if ids != "prompt_ids" and bool((batch[mask].sum(dim=-1) == 0).any()):
            raise BatchContractError(mask, "a pair has an empty response")
    for key in REF_FIELDS:
        if key in batch and tuple(batch[key].shape) != (n,):
            raise BatchContractError(key, f"expected ({n},), got {tuple(batch[key].shape)}")
    return n


def merge_preferences(chunks: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Concatenate preference chunks (prompts re-padded left, responses right)."""
    import torch

    if not chunks:
        raise BatchContractError("rollouts", "a DPO step needs at least one preference batch")
    for chunk in chunks:
        check_pairs(chunk)
    if len(chunks) == 1:
        return dict(chunks[0])
    merged: dict[str, Tensor] = {}
    for key in PAIR_FIELDS:
        width = max(c[key].shape[1] for c in chunks)
        merged[key] = torch.cat([widen(c[key], width, left=key.startswith("prompt")) for c in chunks])
    for key in REF_FIELDS:
        if all(key in c for c in chunks):
            merged[key] = torch.cat([c[key] for c in chunks])
    return merged


def pairs_as_rollouts(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The 2N-row rollout-contract view of N pairs: chosen rows first, then rejected rows."""
    import torch

    width = max(batch["chosen_ids"].shape[1], batch["rejected_ids"].shape[1])
    return {
        "prompt_ids": torch.cat([batch["prompt_ids"], batch["prompt_ids"]]),
        "prompt_mask": torch.cat([batch["prompt_mask"], batch["prompt_mask"]]),
        "response_ids": torch.cat(
            [widen(batch[f"{k}_ids"], width, left=False) for k in ("chosen", "rejected")]
        ),
        "response_mask": torch.cat(
            [widen(batch[f"{k}_mask"], width, left=False) for k in ("chosen", "rejected")]
        ),
    }
