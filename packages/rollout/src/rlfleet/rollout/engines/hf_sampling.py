"""Sampling helpers for the HF engine: generation config, exact logprobs, seeding, stop detection.

Logprobs are recorded by :class:`LogprobRecorder`, a logits processor placed ahead of HF's
temperature / top-k / top-p warpers (``generate`` appends user processors before the warpers), so
it sees the raw float32 logits of each step. It keeps only the current step's
``log_softmax(logits / temperature)`` (B, V) and gathers the chosen token's entry on the next
step, so memory stays O(B * V) instead of the O(B * T * V) that ``output_logits=True`` holds.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import GenerationConfig, LogitsProcessor

from rlfleet.common.messages import SamplingParams

logger = logging.getLogger(__name__)


class LogprobRecorder(LogitsProcessor):
    """Records ``log_softmax(raw_logits / temperature)`` of every sampled token; passes scores through.

    ``temperature == 0`` (greedy) records the plain ``log_softmax(raw_logits)``.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature if temperature > 0 else 1.0
        self._steps: list[torch.Tensor] = []
        self._previous: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """input_ids (B, L): prompt plus tokens so far; scores (B, V): this step's raw logits."""
        if self._previous is not None:
            self._steps.append(self._previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """Logprobs (B, T) of ``generated`` (B, T), the tokens ``generate`` returned after the prompt.

        ``generate`` may run one step more than it returns (deferred stop checks on GPU); only the
        first T steps are kept.
        """
        steps = generated.shape[1]
        if len(self._steps) < steps:
            assert self._previous is not None and len(self._steps) == steps - 1
            self._steps.append(self._previous.gather(-1, generated[:, -1:]).squeeze(-1))
        self._previous = None
        if steps == 0:
            return torch.zeros((generated.shape[0], 0), dtype=torch.float32, device=generated.device)
        return torch.stack(self._steps[:steps], dim=1)


def neutral_generation_config(bos: int | None, eos: Sequence[int], pad: int) -> GenerationConfig:
    """A model-level config with no sampling defaults, so a checkpoint's generation_config.json
    (repetition penalties, top_k=20, suppressed tokens...) never leaks into RL sampling."""
    return GenerationConfig(bos_token_id=bos, eos_token_id=list(eos) or None, pad_token_id=pad)


def generation_config(params: SamplingParams, stop_ids: Sequence[int], pad: int) -> GenerationConfig:
    """The per-call HF config for ``params``: every sampling knob set explicitly.

    Greedy at ``temperature == 0``; ``top_k <= 0`` disables top-k (HF's 0), as -1 does in vLLM.
    """
    common = {
        "max_new_tokens": params.max_tokens,
        "min_new_tokens": 0,
        "repetition_penalty": 1.0,
        "num_beams": 1,
        "eos_token_id": list(stop_ids) or None,
        "pad_token_id": pad,
        "use_cache": True,
        "return_dict_in_generate": True,
        "output_scores": False,
        "output_logits": False,
    }
    if params.temperature == 0:  # warpers are not applied without do_sample: leave them unset
        return GenerationConfig(do_sample=False, **common)
    return GenerationConfig(
        do_sample=True,
        temperature=params.temperature,
        top_k=params.top_k if params.top_k > 0 else 0,
        top_p=params.top_p,
        **common,
    )


def cut_at_stop(
    generated: torch.Tensor, stop_ids: Sequence[int], max_tokens: int
) -> tuple[list[int], list[bool]]:
    """Per row of ``generated`` (B, T): how many tokens to keep, and whether it stopped on a stop id.

    A row keeps everything up to and including its first stop token; a row without one keeps
    all ``T`` tokens, which is ``max_tokens`` (HF only ends early once every row has stopped).
    """
    rows, steps = generated.shape
    if not stop_ids or steps == 0:
        return [steps] * rows, [False] * rows
    is_stop = torch.isin(generated, torch.tensor(list(stop_ids), device=generated.device))
    stopped = is_stop.any(dim=1)
    first = is_stop.to(torch.int8).argmax(dim=1)
    lengths = torch.where(stopped, first + 1, torch.full_like(first, steps))
    stopped_list = stopped.tolist()
    if not all(stopped_list) and steps != max_tokens:
        raise RuntimeError(f"generate returned {steps} tokens for a row that did not stop (max {max_tokens})")
    return lengths.tolist(), stopped_list


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run the block with the global RNG (CPU, and ``device`` if CUDA) seeded, restoring it after.

    HF ``generate`` samples with ``torch.multinomial`` on the global generator, so forking and
    seeding it is the only way to make a call reproducible without touching the caller's RNG.
    """
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    with torch.random.fork_rng(devices=[index] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield
