"""vLLM's side of one ``generate``: rlfleet's sampling parameters in, rlfleet :class:`Completion` s out.

The semantics are the engine protocol's (see :mod:`rlfleet.rollout.engines.base`): prompt-major,
``n`` samples per prompt, the stop token kept, the sampled token's logprob under
``log_softmax(logits / temperature)`` (vLLM's ``processed_logprobs``), text decoded by the
checkpoint's tokenizer. No vLLM import at module load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlfleet.common.control.messages import SamplingParams
from rlfleet.rollout.engines.base import Completion


def vllm_sampling(params: SamplingParams, n: int, seed: int | None, eos_ids: Sequence[int]) -> Any:
    """vLLM ``SamplingParams`` for ``n`` samples of one request: stop on ``eos_ids`` and the request's
    stop tokens, the sampled token's logprob only, no incremental detokenizing (done once at the end)."""
    from vllm import SamplingParams as VLLMSamplingParams

    return VLLMSamplingParams(
        n=n,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else 0,
        max_tokens=params.max_tokens,
        min_tokens=0,
        stop_token_ids=sorted(set(eos_ids) | set(params.stop_token_ids)),
        seed=seed,
        logprobs=0 if params.logprobs else None,
        flat_logprobs=True,
        detokenize=False,
    )


def to_completions(
    prompts: list[list[int]], params: SamplingParams, outputs: list[Any], copies: int, tokenizer: Any
) -> list[Completion]:
    """vLLM ``RequestOutput`` s -> prompt-major completions (``copies`` > 1: greedy sent as n copies)."""
    samples = []
    for i in range(len(prompts)):
        if copies > 1:
            samples.extend(outputs[i * copies + j].outputs[0] for j in range(copies))
        else:
            samples.extend(sorted(outputs[i].outputs, key=lambda c: c.index))
    texts = tokenizer.batch_decode([list(s.token_ids) for s in samples], skip_special_tokens=True)
    completions = []
    for k, (sample, text) in enumerate(zip(samples, texts, strict=True)):
        if sample.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a sample with {sample.finish_reason!r}")
        tokens = list(sample.token_ids)
        completions.append(
            Completion(
                prompt_index=k // params.n,
                sample_index=k % params.n,
                prompt_token_ids=list(prompts[k // params.n]),
                token_ids=tokens,
                logprobs=sampled_logprobs(sample.logprobs, tokens) if params.logprobs else [],
                text=text,
                finish_reason=sample.finish_reason,
            )
        )
    return completions


def sampled_logprobs(logprobs: Any, tokens: list[int]) -> list[float]:
    """The sampled token's logprob at each position, from vLLM's flat or per-position logprobs."""
    if logprobs is None:
        raise RuntimeError("vLLM returned no logprobs although they were requested")
    starts = getattr(logprobs, "start_indices", None)
    if starts is None:  # list of {token_id: Logprob}
        return [float(position[token].logprob) for position, token in zip(logprobs, tokens, strict=True)]
    ends = logprobs.end_indices
    values = []
    for start, end, token in zip(starts, ends, tokens, strict=True):
        index = logprobs.token_ids.index(token, start, end)
        values.append(float(logprobs.logprobs[index]))
    return values
