"""Weight buckets on their way into vLLM: tied names, per-block staging and the wire payload.

No vLLM import here: this is the main-process side of :class:`~rlfleet.rollout.engines.vllm.VLLMEngine`.

Why staging: vLLM fuses HF tensors into kernel tensors (``q/k/v_proj`` into ``qkv_proj``,
``gate/up_proj`` into ``gate_up_proj``) and its in-place reload processes a layer as a whole; a
reload that brings only part of a fused layer leaves the rest of it undefined. The trainer cuts
buckets by size, so a bucket boundary can fall inside a transformer block. :class:`WeightStager`
therefore holds the tensors of a block (everything under ``*.layers.<i>.``; any other module on
its own) until the whole block has arrived, and hands it over then. Extra memory: at most the
part of one block that a bucket boundary splits.

Tied embeddings: vLLM skips ``lm_head.weight`` for tied models and reads the head from the
embedding, so a tensor sent only under the head's name is renamed to the embedding's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

logger = logging.getLogger(__name__)

Items = list[tuple[str, torch.Tensor]]

_BLOCK = re.compile(r"^(.*?\.layers\.\d+)\.")


def group_of(name: str) -> str:
    """The load group of an HF tensor name: its transformer block, else its module.

    ``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.3``; ``model.norm.weight`` -> ``model.norm``.
    """
    match = _BLOCK.match(name)
    if match:
        return match.group(1)
    module = name.rpartition(".")[0]
    return module or name


def resolve_tied(items: Sequence[tuple[str, torch.Tensor]], embed_name: str, head_name: str) -> Items:
    """For a tied model: send the head's tensor under the embedding's name (once, never twice)."""
    names = {name for name, _ in items}
    out: Items = []
    for name, tensor in items:
        if name == head_name:
            if embed_name in names:
                continue
            name = embed_name
        out.append((name, tensor))
    return out


class WeightStager:
    """Holds tensors per load group until every tensor of the group has arrived.

    ``names`` are all HF names the engine loads (the checkpoint's, less a tied head).
    """

    def __init__(self, names: Iterable[str]) -> None:
        members: dict[str, set[str]] = {}
        for name in names:
            members.setdefault(group_of(name), set()).add(name)
        self._members = {group: frozenset(m) for group, m in members.items()}
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def groups(self) -> frozenset[str]:
        """Every load group of the model."""
        return frozenset(self._members)

    def groups_members(self) -> list[str]:
        """Every name this stager waits for (to build a fresh stager over the same model)."""
        return sorted(name for members in self._members.values() for name in members)

    @property
    def pending(self) -> list[str]:
        """Names of the tensors still missing from the groups that have started arriving."""
        return sorted(
            name for group, got in self._pending.items() for name in self._members[group] - got.keys()
        )

    def add(self, items: Iterable[tuple[str, torch.Tensor]]) -> tuple[Items, set[str]]:
        """Stage ``items`` (known names only); return the tensors of the groups now complete and those groups.

        A name sent twice before its group completes keeps the later tensor.
        """
        ready: Items = []
        done: set[str] = set()
        for name, tensor in items:
            group = group_of(name)
            got = self._pending.setdefault(group, {})
            got[name] = tensor
            if got.keys() >= self._members[group]:
                ready.extend(self._pending.pop(group).items())
                done.add(group)
        return ready, done

    def clear(self) -> list[str]:
        """Drop the incomplete groups; return the names they were missing."""
        missing = self.pending
        self._pending.clear()
        return missing


def encode_bucket(items: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """Serialize ``items`` as one safetensors blob (the only form vLLM's worker RPC carries intact)."""
    return save_safetensors({name: t.detach().to("cpu").contiguous() for name, t in items})


def decode_bucket(payload: bytes | Sequence[tuple[str, torch.Tensor]]) -> Items:
    """Inverse of :func:`encode_bucket`; ``(name, tensor)`` pairs pass through (in-process calls)."""
    if isinstance(payload, bytes | bytearray | memoryview):
        return list(load_safetensors(bytes(payload)).items())
    return list(payload)
