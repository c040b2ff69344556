"""Partial rollouts: a long generation yields to a weight load between segments and goes on under
the new weights, each token recording the version that sampled it.

With ``rollout.partial_rollout_tokens: S`` (0: off) a rollout worker generates a job in segments of
at most ``S`` new tokens. Between two segments it lets go of the engine, so a weight load waiting for
it goes first (the worker's engine gate is first come, first served) and waits at most one segment,
never the longest generation of the job. The samples still running (every one that ran to the
segment's cap: they all have the same length so far) continue from their prompt plus the tokens
they have, one continuation per sample, under whatever weights the worker then holds: stopped and
resumed, their keys and values computed again under the new weights (the engine's prefix cache is
reset by a load, and reused between segments otherwise). A sample ends on a stop token or at the
job's ``max_tokens``, as without segments.

Each continuation samples with its own seed (the job's seed, if it has one, mixed with the
segment's number), so two segments never replay the same random draws. What a partial rollout
gives up: a job is reproducible for its seed only when the loads fall between the same segments.

Every token keeps the engine logprob it was sampled with (the behaviour policy of the off-policy
corrections) and its weight version (``response_versions`` in the rollout batch); the job's reply
names the oldest, the version its first segment used, which the controller's staleness bound holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.common.control.messages import SamplingParams
from rlfleet.rollout.engines.base import Completion

SEGMENT_SEED_STRIDE = 1_000_003
"""Added to a job's seed per segment (a prime, far from the per-prompt offsets engines add)."""
SEED_CAP = 2**63 - 1


@dataclass
class Segmented:
    """A job's completions (prompt-major, as ``Engine.generate`` returns them) and, per completion,
    the weight version of each of its tokens; ``segments``: the engine calls it took."""

    completions: list[Completion]
    versions: list[list[int]]
    segments: int = 1
    loads_between: int = 0
    """How many times the weights changed between two of the job's segments."""
    versions_used: list[int] = field(default_factory=list)


Generate = Callable[[list[list[int]], SamplingParams], Awaitable[list[Completion]]]
"""One engine call, run while the caller holds the engine (the worker's gate)."""


def segment_params(
    params: SamplingParams, segment: int, max_tokens: int, continuation: bool
) -> SamplingParams:
    """The sampling of segment ``segment`` (0-based): at most ``max_tokens`` new tokens; a
    continuation is one sample of one prefix, seeded apart from every other segment."""
    update: dict[str, Any] = {"max_tokens": max_tokens}
    if continuation:
        update["n"] = 1
    if params.seed is not None and segment:
        update["seed"] = (params.seed + segment * SEGMENT_SEED_STRIDE) % SEED_CAP
    return params.model_copy(update=update)


async def generate_in_segments(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    segment_tokens: int,
    gate: asyncio.Lock,
    version: Callable[[], int],
    generate: Generate,
    decode: Callable[[list[list[int]]], list[str]],
) -> Segmented:
    """Generate ``params.n`` samples of each prompt in segments of ``segment_tokens`` (see the module
    docstring). ``gate`` is held for each engine call and let go between them; ``version()`` is read
    at the start of each; ``decode`` re-decodes the texts of samples that took several segments."""
    if segment_tokens < 1:
        raise ValueError(f"segment_tokens must be at least 1, got {segment_tokens}")
    first = segment_params(params, 0, min(segment_tokens, params.max_tokens), continuation=False)
    async with gate:
        start = version()
        completions = await generate([list(p) for p in prompts], first)
    versions = [[start] * len(c.token_ids) for c in completions]
    result = Segmented(completions, versions, versions_used=[start])
    running = [k for k, c in enumerate(completions) if _runs_on(c, params.max_tokens)]
    while running:
        done = len(completions[running[0]].token_ids)
        step = segment_params(params, result.segments, min(segment_tokens, params.max_tokens - done), True)
        prefixes = [completions[k].prompt_token_ids + completions[k].token_ids for k in running]
        async with gate:
            now = version()
            outputs = await generate(prefixes, step)
        if now != result.versions_used[-1]:
            result.loads_between += 1
            result.versions_used.append(now)
        result.segments += 1
        for k, out in zip(running, outputs, strict=True):
            c = completions[k]
            c.token_ids = c.token_ids + out.token_ids
            c.logprobs = c.logprobs + out.logprobs if c.logprobs or out.logprobs else []
            c.finish_reason = out.finish_reason
            versions[k].extend([now] * len(out.token_ids))
        running = [k for k in running if _runs_on(completions[k], params.max_tokens)]
    continued = [k for k, v in enumerate(versions) if len(v) > segment_tokens]
    if continued:
        texts = decode([completions[k].token_ids for k in continued])
        for k, text in zip(continued, texts, strict=True):
            completions[k].text = text
    return result


def _runs_on(completion: Completion, max_tokens: int) -> bool:
    return completion.finish_reason == "length" and len(completion.token_ids) < max_tokens
