"""The seam every rollout engine sits behind: the :class:`Engine` protocol and its :class:`Completion`.

An engine turns prompts (token ids) into completions and takes new weights in place, bucket by
bucket, while it serves. The rollout service only ever talks to this protocol, so the HF
transformers engine (CPU, tests, fallback) and the vLLM engine (GPU, throughput) are interchangeable.

Logprob convention (shared with the trainer, which computes ``log_softmax(logits / temperature)``):
``Completion.logprobs[t]`` is ``log p(token_t)`` under ``softmax(raw_logits_t / temperature)``,
where ``raw_logits_t`` are the model's logits before any top-p / top-k truncation. With
``temperature == 0`` (greedy) the temperature is taken as 1, i.e. the logprob is under the
model's plain ``softmax(raw_logits_t)``. These are exactly the numbers the trainer recomputes,
so the importance ratio is 1 at the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from rlfleet.common.control.messages import SamplingParams
from rlfleet.common.schema.trainer import LoraSettings

FinishReason = Literal["stop", "length"]

WeightsInput = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
"""What ``load_weights`` takes: ``(name, tensor)`` pairs or a ``{name: tensor}`` mapping (one bucket)."""


@dataclass
class Completion:
    """One generated sample.

    ``token_ids`` are the generated tokens only (the prompt is in ``prompt_token_ids``). When the
    sample stopped on the model's EOS or one of ``SamplingParams.stop_token_ids``, that stop token
    is kept as the last element of ``token_ids`` (and has a logprob) and ``finish_reason`` is
    ``"stop"``; otherwise exactly ``max_tokens`` tokens were generated and it is ``"length"``.
    ``logprobs`` has one entry per element of ``token_ids`` (see the module docstring for which
    distribution), or is empty when ``SamplingParams.logprobs`` was false. ``text`` is
    ``token_ids`` decoded with ``skip_special_tokens=True``: a stop token that is not a special
    token stays in the text (vLLM drops stop tokens from its text; rewards see it here).
    """

    prompt_index: int
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason = "length"


@runtime_checkable
class Engine(Protocol):
    """A generation engine holding one model whose weights can be replaced in place.

    ``generate`` returns ``len(prompt_token_ids) * params.n`` completions ordered prompt-major:
    all ``n`` samples of prompt 0 (``sample_index`` 0..n-1), then prompt 1, and so on.
    ``weight_version`` is 0 right after the model is loaded from disk; a weight publish loads
    every bucket with ``load_weights(bucket)`` and then calls ``set_weight_version(v)`` once
    (or passes ``version=v`` with the last bucket).
    """

    model_id: str
    max_model_len: int | None
    """The longest prompt + ``max_tokens`` a request may use (None: the model does not say)."""

    def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, *, deadline: float | None = None
    ) -> list[Completion]:
        """Sample ``params.n`` completions for each prompt; once ``deadline`` (``time.monotonic()``
        seconds) has passed, stop and raise :class:`~rlfleet.rollout.errors.DeadlinePassed`."""
        ...

    def load_weights(self, weights: WeightsInput, version: int | None = None) -> None:
        """Copy tensors into the live model by HF parameter name; set the version if given."""
        ...

    def load_adapter(self, weights: WeightsInput, settings: LoraSettings, version: int | None = None) -> None:
        """Serve a published LoRA adapter (PEFT's tensor names) on the base weights, in place of the
        adapter served; set the version if given. All or nothing."""
        ...

    @property
    def weight_version(self) -> int:
        """The version of the weights being served (0 after loading from disk)."""
        ...

    def set_weight_version(self, version: int) -> None:
        """Record that the weights now loaded are ``version``."""
        ...

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (a ``transformers`` tokenizer)."""
        ...

    def close(self) -> None:
        """Free the model; later calls raise ``EngineClosed``."""
        ...


@runtime_checkable
class DeltaEngine(Protocol):
    """An engine that holds its weights under the trainer's names and takes a weight delta straight
    into them (the HF engine). A worker on one keeps no host copy of the version for delta sync: the
    engine's own weights are the version the next delta applies to. (vLLM holds some weights fused
    under other names; its worker writes a delta into a host copy and loads the whole version.)"""

    def load_delta(
        self,
        deltas: Iterable[Mapping[str, torch.Tensor]],
        names: Sequence[str],
        version: int | None = None,
        written: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Write a delta (:mod:`rlfleet.common.tensors.weight_sync`'s form), bucket by bucket as
        ``deltas`` yields them (the next may still be on its way), on the version served into the
        live weights, all or nothing; set the version if given. Returns the version's weights
        ``names`` as now served (the engine's own tensors, for the fingerprint); ``written`` is
        given each bucket's weights as soon as they are written (the worker hashes them meanwhile)."""
        ...
