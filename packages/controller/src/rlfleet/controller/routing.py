"""Hybrid rollout routing: a user function picks the rollout pool of each prompt, or answers it itself.

``trainer.set_rollout_fn(fn)``; ``fn(item)`` sees each :class:`~rlfleet.controller.dataset.PromptItem`
of a step (``item.text``, ``item.token_ids``, ``item.metadata``) and returns:

- the name of a rollout pool (``"small"``), or ``Pool("small")``: that pool's workers generate it.
  A pool is one named in ``TrainerConfig.rollout.pools`` or announced by a joined worker
  (``rlfleet-rollout serve --pool NAME``); ``Pool`` with an unknown name is an error.
- ``None``: any pool (the fleet splits such prompts over every worker, as without a fn).
- the response text itself: any other string (used for all ``group_size`` samples), a list of
  ``group_size`` strings, or ``Response(...)`` holding either (for a text that equals a pool name).

The pools generate at the same time, and each chunk of every route (the fn's texts are one chunk) is
handed to the step as soon as it is made (``on_chunk``), to be scored while the rest generate; the
step's chunks are still ordered by route, then by prompt. Responses the fn wrote become one rollout
batch in the controller's own TensorStore, in the batch contract (the prompt as the model sees it,
the text tokenized, EOS appended unless cut at ``max_response_length``, ``rollout_logprobs`` NaN
since no engine produced them); the reward and trainer tiers read it like any rollout worker's
batch.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlfleet.common.control.messages import GenerateResult, SamplingParams
from rlfleet.common.control.messages.rollout import EpisodeSpec
from rlfleet.common.schema.batch import RolloutBatch, pad_left, pad_right
from rlfleet.common.tensors.server import TensorStoreServer
from rlfleet.controller.agent_rollout import AgentRollout
from rlfleet.controller.dataset import PromptItem
from rlfleet.controller.environment_settings import EnvironmentSettings
from rlfleet.controller.errors import RouteError
from rlfleet.controller.ports import ChunkDone, FleetClient

logger = logging.getLogger(__name__)

ANY, TEXT = "any", "text"
"""Route names besides the pools: every pool serves; the fn wrote the response."""

RolloutFn = Callable[[PromptItem], Any]

ChunkArrived = Callable[[GenerateResult, list[dict[str, Any]]], None]
"""Told of each chunk of a step's rollout as it is generated, with its prompts' metadata."""


@dataclass(frozen=True)
class Pool:
    """The rollout pool named ``name`` serves this prompt (an unknown name is an error)."""

    name: str


@dataclass(frozen=True)
class Response:
    """The response to this prompt: one text for every sample, or a list of ``group_size`` texts."""

    texts: str | Sequence[str]


def import_rollout_fn(name: str, python_path: Sequence[str] = ()) -> RolloutFn:
    """The function ``package.module:function`` names (a job file's ``rollout_fn``), or a ConfigError.

    The working directory and ``python_path`` (the job file's folder, with ``rlfleet train``) are
    searched too (:mod:`rlfleet.controller.user_code`).
    """
    from rlfleet.controller.user_code import import_user_function

    return import_user_function(name, "rollout_fn", python_path)


@dataclass
class RoutePlan:
    """Where each prompt of a batch goes: route name -> positions in the batch, in batch order."""

    routes: dict[str, list[int]] = field(default_factory=dict)
    texts: dict[int, list[str]] = field(default_factory=dict)
    """Batch position -> its ``n`` response texts, for the prompts routed to ``text``."""


def plan_routes(fn: RolloutFn | None, batch: Sequence[PromptItem], pools: Sequence[str], n: int) -> RoutePlan:
    """Ask ``fn`` about every prompt of ``batch`` (before anything is generated, so a bad answer
    costs nothing); ``pools`` are the known pool names, ``n`` the samples per prompt."""
    plan = RoutePlan()
    for position, item in enumerate(batch):
        route, texts = (ANY, None) if fn is None else _decide(fn, item, pools, n)
        plan.routes.setdefault(route, []).append(position)
        if texts is not None:
            plan.texts[position] = texts
    return plan


_near_misses: set[str] = set()


def _decide(fn: RolloutFn, item: PromptItem, pools: Sequence[str], n: int) -> tuple[str, list[str] | None]:
    try:
        answer = fn(item)
    except Exception as exc:
        raise RouteError(item, f"it raised {type(exc).__name__}: {exc}") from exc
    if answer is None:
        return ANY, None
    if isinstance(answer, Pool):
        if answer.name not in pools:
            raise RouteError(item, f"no rollout pool {answer.name!r}; the pools are {sorted(pools)}")
        return answer.name, None
    if isinstance(answer, str) and answer in pools:
        return answer, None
    if (
        isinstance(answer, str)
        and answer not in _near_misses
        and difflib.get_close_matches(answer, pools, 1, 0.8)
    ):
        _near_misses.add(answer)
        logger.warning(
            "rollout fn returned %r, close to a pool name but not one (pools %s): it is used as the "
            "response text; return Pool(name) to route strictly", answer, sorted(pools),
        )  # fmt: skip
    texts = answer.texts if isinstance(answer, Response) else answer
    return TEXT, _texts(item, texts, n)


def _texts(item: PromptItem, texts: Any, n: int) -> list[str]:
    if isinstance(texts, str):
        return [texts] * n
    if not isinstance(texts, Sequence) or not all(isinstance(t, str) for t in texts):
        raise RouteError(item, f"expected a pool name, None or response text(s), got {type(texts).__name__}")
    if len(texts) != n:
        raise RouteError(item, f"returned {len(texts)} responses; a prompt takes group_size={n} (or one str)")
    return list(texts)


def text_batch(
    items: Sequence[PromptItem], texts: Sequence[Sequence[str]], tokenizer: Any, max_response_length: int
) -> tuple[dict[str, torch.Tensor], int]:
    """The rollout batch (contract tensors) of responses written by the fn, and its response tokens.

    ``texts[i]`` are the samples of ``items[i]``. A text longer than ``max_response_length`` tokens
    is cut there (no EOS, like an engine that hit the limit); otherwise EOS ends it.
    """
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    prompts, responses, response_texts, groups = [], [], [], []
    for group, (item, samples) in enumerate(zip(items, texts, strict=True)):
        for text in samples:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) >= max_response_length or eos is None:
                cut = ids[:max_response_length]
                text = text if len(cut) == len(ids) else tokenizer.decode(cut, skip_special_tokens=True)
                ids = cut
            else:
                ids = [*ids, eos]
            prompts.append(list(item.token_ids or []))
            responses.append(ids)
            response_texts.append(text)
            groups.append(group)
    prompt_ids, prompt_mask = pad_left(prompts, pad)
    response_ids, response_mask = pad_right(responses, pad)
    unknown = [[math.nan] * len(ids) for ids in responses]  # no engine logprob: NaN, 0 at padding
    logprobs, _ = pad_right(unknown, 0.0, "float32")
    batch = RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        response_ids=response_ids, response_mask=response_mask,
        rollout_logprobs=logprobs, group_index=torch.tensor(groups, dtype=torch.int64),
        prompt_text=tokenizer.batch_decode(prompts, skip_special_tokens=True), response_text=response_texts,
    )  # fmt: skip
    return batch.to_tensors(), sum(len(ids) for ids in responses)


def episode_items(items: Sequence[PromptItem]) -> list[dict[str, Any]]:
    """What each prompt's episode starts from: its dataset row's columns (its ``answer``...) and its
    prompt as stored, under ``prompt``."""
    return [{**item.metadata, "prompt": item.prompt} for item in items]


def chunk_metadata(
    items: Sequence[PromptItem], results: Sequence[GenerateResult]
) -> list[list[dict[str, Any]]]:
    """Per-prompt metadata (for the reward tier), split the way the results split the prompts:
    ``results[i]`` answers the next ``num_prompts`` of ``items``, in order."""
    out: list[list[dict[str, Any]]] = []
    start = 0
    for result in results:
        out.append([dict(item.metadata) for item in items[start : start + result.num_prompts]])
        start += result.num_prompts
    return out


@dataclass
class RouteSummary:
    """What one route served in a step: dataset rows, and the workers that generated them."""

    rows: list[int]
    workers: list[str]


@dataclass
class RoutedRollout:
    """A step's rollout: ``results[i]`` answers a contiguous slice of ``items`` (the batch regrouped
    by route), in order, so per-prompt metadata splits the same way."""

    items: list[PromptItem]
    results: list[GenerateResult]
    routes: dict[str, RouteSummary]

    def metrics(self) -> dict[str, float]:
        """``rollout/routed/<route>``: prompts per route (only when a rollout fn routed the step)."""
        if list(self.routes) == [ANY]:
            return {}
        return {f"rollout/routed/{route}": float(len(s.rows)) for route, s in self.routes.items()}


class RolloutRouter:
    """Runs a step's rollout through the fleet, the way the rollout fn (if any) routes it.

    ``store`` returns the controller's own TensorStore (started on first use) for fn-written responses.
    """

    def __init__(
        self, tokenizer: Any, max_response_length: int, store: Callable[[], Awaitable[TensorStoreServer]],
        config_pools: Sequence[str],
    ) -> None:  # fmt: skip
        self.fn: RolloutFn | None = None
        self.tokenizer = tokenizer
        self.max_response_length = max_response_length
        self._store = store
        self._config_pools = list(config_pools)
        self._texts = 0
        self.episode: EnvironmentSettings | None = None
        """Multi-turn runs: the environment each prompt's episode plays."""
        self.max_turn_tokens = max_response_length
        self.agent: AgentRollout | None = None
        """Agent runs: each sample an episode of the user's agent (``agent_rollout``)."""

    def pools(self, fleet: FleetClient) -> list[str]:
        """Known pool names: the configured ones, then those of joined workers."""
        joined = sorted({w.pool for w in fleet.rollout_workers()} - set(self._config_pools))
        return [*self._config_pools, *joined]

    async def generate(
        self, fleet: FleetClient, batch: Sequence[PromptItem], sampling: SamplingParams, weight_version: int,
        on_chunk: ChunkArrived | None = None,
    ) -> RoutedRollout:  # fmt: skip
        """The step's rollout, every route at once; ``on_chunk(result, metadata)`` is told of each chunk
        of every route as soon as it is generated (``metadata``: its prompts', as
        :func:`chunk_metadata` splits them)."""
        pools = self.pools(fleet) if self.fn is not None else []
        plan = await asyncio.to_thread(plan_routes, self.fn, batch, pools, sampling.n)
        order = [route for route in [*pools, ANY, TEXT] if route in plan.routes]
        jobs = []
        for route in order:
            items = [batch[p] for p in plan.routes[route]]
            told = _telling(on_chunk, items)
            if route == TEXT:
                texts = [plan.texts[p] for p in plan.routes[route]]
                jobs.append(self._answer(items, texts, weight_version, told))
            elif self.agent is not None:  # the agents' endpoints on any pool's workers
                jobs.append(self.agent.generate(fleet, items, sampling, weight_version, told))
            else:
                pool = None if route == ANY else route
                prompts = [it.token_ids for it in items]
                episode = self._episodes(items) if self.episode is not None else None
                jobs.append(fleet.generate(prompts, sampling, weight_version, pool=pool, on_chunk=told,
                                           episode=episode))  # fmt: skip
        done = await asyncio.gather(*jobs)
        routed = RoutedRollout([], [], {})
        for route, results in zip(order, done, strict=True):
            items = [batch[p] for p in plan.routes[route]]
            routed.items += items
            routed.results += results
            workers = sorted({r.worker_id for r in results})
            routed.routes[route] = RouteSummary([it.index for it in items], workers)
        return routed

    def _episodes(self, items: Sequence[PromptItem]) -> EpisodeSpec:
        """The episodes of ``items`` (see :func:`episode_items`)."""
        assert self.episode is not None
        return self.episode.episodes(self.max_turn_tokens, episode_items(items))

    async def _answer(
        self, items: list[PromptItem], texts: list[list[str]], weight_version: int, told: ChunkDone | None
    ) -> list[GenerateResult]:
        t0 = time.perf_counter()
        tensors, num_tokens = await asyncio.to_thread(
            text_batch, items, texts, self.tokenizer, self.max_response_length
        )
        store = await self._store()
        self._texts += 1
        job_id = f"text-{self._texts}"
        ref = store.put_local(f"rollout/controller/{job_id}", tensors)
        result = GenerateResult(
            job_id=job_id, worker_id="controller", weight_version=weight_version, ref=ref,
            num_prompts=len(items), num_samples=sum(len(t) for t in texts), num_tokens=num_tokens,
            seconds=time.perf_counter() - t0,
        )  # fmt: skip
        if told is not None:
            told(0, result)
        return [result]


def _telling(on_chunk: ChunkArrived | None, items: Sequence[PromptItem]) -> ChunkDone | None:
    """The fleet's per-chunk callback for one route's ``items``: ``on_chunk`` with the chunk's metadata."""
    if on_chunk is None:
        return None

    def arrived(first: int, result: GenerateResult) -> None:
        [metadata] = chunk_metadata(items[first:], [result])
        on_chunk(result, metadata)

    return arrived
