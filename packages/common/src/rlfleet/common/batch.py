"""The rollout-batch tensor contract shared by rollout, reward and trainer, and its helpers.

A rollout result is a dict of tensors stored in a TensorStore under one key. N = num_prompts * n,
prompt-major (sample j of prompt i is row i*n + j):

- ``prompt_ids`` (N, P) int64, LEFT-padded with the pad id; ``prompt_mask`` (N, P) int64, 1 on tokens
- ``response_ids`` (N, R) int64, RIGHT-padded; ``response_mask`` (N, R) int64, 1 on generated
  tokens (a generated EOS counts); ``rollout_logprobs`` (N, R) float32, 0 at padding, NaN on
  tokens no engine produced (responses the controller's rollout fn wrote itself)
- ``group_index`` (N,) int64: the prompt (0..num_prompts-1) each sample answers
- ``prompt_text`` / ``response_text`` uint8 (total utf-8 bytes,) with ``*_offsets`` (N+1,) int64:
  text ``i`` is ``data[offsets[i]:offsets[i+1]]`` (:func:`pack_texts` / :func:`unpack_texts`)

:class:`RolloutBatch` holds one batch with its texts as ``str`` and converts both ways, checking
every shape and dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rlfleet.common.errors import BatchContractError

logger = logging.getLogger(__name__)

TOKEN_FIELDS = (
    "prompt_ids",
    "prompt_mask",
    "response_ids",
    "response_mask",
    "rollout_logprobs",
    "group_index",
)
TEXT_FIELDS = ("prompt_text", "prompt_text_offsets", "response_text", "response_text_offsets")
DTYPES: dict[str, torch.dtype] = {
    "prompt_ids": torch.int64,
    "prompt_mask": torch.int64,
    "response_ids": torch.int64,
    "response_mask": torch.int64,
    "rollout_logprobs": torch.float32,
    "group_index": torch.int64,
    "prompt_text": torch.uint8,
    "prompt_text_offsets": torch.int64,
    "response_text": torch.uint8,
    "response_text_offsets": torch.int64,
}


def pack_texts(texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Texts -> (uint8 data (sum of utf-8 lengths,), int64 offsets (N+1,))."""
    encoded = [t.encode("utf-8") for t in texts]
    offsets = [0]
    for raw in encoded:
        offsets.append(offsets[-1] + len(raw))
    joined = bytearray(b"".join(encoded))
    data = (
        torch.frombuffer(joined, dtype=torch.uint8).clone() if joined else torch.zeros(0, dtype=torch.uint8)
    )
    return data, torch.tensor(offsets, dtype=torch.int64)


def unpack_texts(data: torch.Tensor, offsets: torch.Tensor) -> list[str]:
    """Inverse of :func:`pack_texts`; :class:`BatchContractError` when the offsets do not fit."""
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


def pad_left(
    rows: Sequence[Sequence[int]], pad_value: int, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token rows to ``width`` (default: the longest row).

    Returns ``(ids, mask)``, both (len(rows), width) int64; mask is 1 on real tokens.
    """
    width = _width(rows, width)
    ids = torch.full((len(rows), width), pad_value, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        if len(row):
            ids[i, width - len(row) :] = torch.as_tensor(row, dtype=torch.int64)
            mask[i, width - len(row) :] = 1
    return ids, mask


def pad_right(
    rows: Sequence[Sequence[float | int]],
    pad_value: float | int,
    dtype: torch.dtype,
    width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad rows to ``width`` (default: the longest row).

    Returns ``(values, mask)``: values (len(rows), width) of ``dtype``; mask int64, 1 on real entries.
    """
    width = _width(rows, width)
    values = torch.full((len(rows), width), pad_value, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        if len(row):
            values[i, : len(row)] = torch.as_tensor(row, dtype=dtype)
            mask[i, : len(row)] = 1
    return values, mask


def _width(rows: Sequence[Sequence[float | int]], width: int | None) -> int:
    longest = max((len(r) for r in rows), default=0)
    if width is None:
        return longest
    if width < longest:
        raise BatchContractError("width", f"{width} is shorter than the longest row ({longest})")
    return width


@dataclass
class RolloutBatch:
    """One rollout batch: token tensors as in the contract above, texts as Python strings.

    Shapes: ``prompt_ids``/``prompt_mask`` (N, P); ``response_ids``/``response_mask``/
    ``rollout_logprobs`` (N, R); ``group_index`` (N,); ``prompt_text``/``response_text`` N strings.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    group_index: torch.Tensor
    prompt_text: list[str]
    response_text: list[str]

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_samples(self) -> int:
        """N, the number of rows."""
        return int(self.prompt_ids.shape[0])

    def validate(self) -> None:
        """:class:`BatchContractError` naming the first field whose dtype or shape breaks the contract."""
        for name in TOKEN_FIELDS:
            tensor = getattr(self, name)
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != DTYPES[name]:
                got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise BatchContractError(name, f"expected a {DTYPES[name]} tensor, got {got}")
        for name in ("prompt_ids", "response_ids"):
            if getattr(self, name).dim() != 2:
                raise BatchContractError(
                    name, f"expected 2 dims, got shape {list(getattr(self, name).shape)}"
                )
        n, p = self.prompt_ids.shape
        r = self.response_ids.shape[1]
        expected = {
            "prompt_mask": (n, p),
            "response_ids": (n, r),
            "response_mask": (n, r),
            "rollout_logprobs": (n, r),
            "group_index": (n,),
        }
        for name, shape in expected.items():
            if tuple(getattr(self, name).shape) != shape:
                raise BatchContractError(
                    name, f"shape {list(getattr(self, name).shape)}, expected {list(shape)}"
                )
        for name in ("prompt_text", "response_text"):
            texts = getattr(self, name)
            if len(texts) != n:
                raise BatchContractError(name, f"{len(texts)} texts for {n} rows")

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The contract's dict of tensors, ready for ``TensorStore.put``."""
        out = {name: getattr(self, name) for name in TOKEN_FIELDS}
        out["prompt_text"], out["prompt_text_offsets"] = pack_texts(self.prompt_text)
        out["response_text"], out["response_text_offsets"] = pack_texts(self.response_text)
        return out

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> RolloutBatch:
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
        for i, (resp, lp) in enumerate(zip(responses, logprobs, strict=True)):
            if len(resp) != len(lp):
                raise BatchContractError(
                    "rollout_logprobs", f"row {i}: {len(lp)} logprobs for {len(resp)} tokens"
                )
        prompt_ids, prompt_mask = pad_left(prompts, pad_id)
        response_ids, response_mask = pad_right(responses, pad_id, torch.int64)
        rollout_logprobs, _ = pad_right(logprobs, 0.0, torch.float32, width=response_ids.shape[1])
        n = len(prompts)
        return cls(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=response_ids,
            response_mask=response_mask,
            rollout_logprobs=rollout_logprobs,
            group_index=torch.as_tensor(list(group_index), dtype=torch.int64).reshape(-1),
            prompt_text=list(prompt_text) if prompt_text is not None else [""] * n,
            response_text=list(response_text) if response_text is not None else [""] * n,
        )
