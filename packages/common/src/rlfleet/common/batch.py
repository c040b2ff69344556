"""Helpers for the rollout-batch tensor contract: texts packed as utf-8 bytes plus offsets.

A rollout batch stores its prompt and response texts as one ``uint8`` tensor each, with an
``(N+1,)`` ``int64`` offsets tensor: text ``i`` is ``data[offsets[i]:offsets[i+1]]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pack_texts(texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Texts -> (uint8 data (sum of utf-8 lengths,), int64 offsets (N+1,))."""
    encoded = [t.encode("utf-8") for t in texts]
    offsets = [0]
    for e in encoded:
        offsets.append(offsets[-1] + len(e))
    data = torch.frombuffer(bytearray(b"".join(encoded)), dtype=torch.uint8) if offsets[-1] else torch.zeros(
        0, dtype=torch.uint8
    )
    return data.clone(), torch.tensor(offsets, dtype=torch.int64)


def unpack_texts(data: torch.Tensor, offsets: torch.Tensor) -> list[str]:
    """Inverse of :func:`pack_texts`; raises ValueError when offsets do not fit the data."""
    bounds = [int(x) for x in offsets.tolist()]
    raw = data.contiguous().numpy().tobytes()
    if not bounds or bounds[0] != 0 or bounds[-1] != len(raw) or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"text offsets {bounds[:4]}... do not fit {len(raw)} bytes of text")
    return [raw[a:b].decode("utf-8", errors="replace") for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
