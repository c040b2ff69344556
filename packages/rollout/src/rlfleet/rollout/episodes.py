"""Multi-turn episodes: a generate job whose samples take turns with an environment (issue 33).

A :class:`~rlfleet.common.control.messages.GenerateRequest` with an ``episode``
(:class:`~rlfleet.common.control.messages.rollout.EpisodeSpec`) runs prompts x n episodes at once,
in lockstep turns::

    EnvReset(item, seed) ---> env.reset (queue group of reward workers) ---> worker_id per episode
    per turn, over the episodes still running:
      engine.generate(contexts, n=1, max_tokens=min(sampling.max_tokens, tokens left))  [engine gate]
        -> sampled tokens appended: loss_mask 1, their logprobs, the weight version
      EnvStep(text of the turn) ---> env.episode.<worker_id> ---> observation
        done -> the episode's reward; else the observation's tokens appended
        (chat_turns: its role's turn and the next assistant prompt): loss_mask 0, logprob NaN
    EnvClose ---> env.episode.<worker_id>, once each episode ends

Token in, token out: a context is the prompt plus every token appended since, never re-tokenised;
the trained tokens are exactly those sampled and the observation tokens exactly those the model
was then conditioned on. An episode ends when the environment says done (its reward is the
episode's), after ``max_turns`` turns, or when its response would reach ``max_episode_tokens``
(a turn cut short by the cap, or an observation that leaves no room for another model token): cut,
reward 0. An environment request that fails (a timeout, an error reply, a worker gone) ends its
episode with reward 0, logged and counted (``episode_end``), never the job; the job's deadline
passing raises :class:`~rlfleet.rollout.errors.DeadlinePassed` as for any job.

Seeds: with ``sampling.seed`` each engine call samples with the seed mixed with the call's number
(engines add each row's index); every sample of a prompt resets its environment with the same seed
(``sampling.seed`` or one derived from the job id, plus the prompt's index), so a GRPO group plays
the same environment. The engine gate is let go between calls, so a weight load may come between
turns: each sampled token records the version that sampled it (``response_versions``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ValidationError

from rlfleet.common.control.messages import (
    AnyMessage,
    EnvClose,
    EnvObservation,
    EnvReset,
    EnvStep,
    GenerateRequest,
    Message,
    SamplingParams,
)
from rlfleet.common.control.messages.rollout import EpisodeSpec
from rlfleet.common.control.transport import TOKEN_HEADER, Transport, episode_subject, subject
from rlfleet.common.errors import NoResponders, RemoteError, RequestTimeout
from rlfleet.common.schema.batch import EPISODE_ENDS, LOSS_MASK, OPTIONAL_FIELDS, pad_right
from rlfleet.rollout.chat_turns import ChatTurns
from rlfleet.rollout.engines.base import Completion
from rlfleet.rollout.errors import DeadlinePassed, EnvFailed, EnvRefused
from rlfleet.rollout.partial_rollout import SEED_CAP, segment_params

logger = logging.getLogger(__name__)

TurnGenerate = Callable[[list[list[int]], SamplingParams], Awaitable[tuple[list[Completion], int]]]
"""One engine call under the worker's engine gate: a completion per context (n=1), and the weight
version that generated them."""
TimeLeft = Callable[[], float | None]
"""Seconds until the job's deadline (None: it has none); raises ``DeadlinePassed`` once it has passed."""

CLOSE_TIMEOUT_S = 5.0
"""The longest an EnvClose is waited for (it only frees the environment's state)."""
REFUSALS = frozenset({"missing_token", "invalid_token", "forbidden_endpoint", "unknown_endpoint"})
"""The reward servers' answers that no retry or other episode changes: the job fails with them."""
_JOB_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")


@dataclass
class Episode:
    """One sample's episode: its tokens so far and what the batch reports of it."""

    prompt: int
    sample: int
    episode_id: str
    prompt_ids: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    env_subject: str = ""
    """The episode subject of the reward worker holding it (empty until its reset is answered)."""
    last_turn: Completion | None = None
    turns: int = 0
    reward: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0
    obs_cut: int = 0
    end: str = ""
    """Why it ended (one of ``EPISODE_ENDS``); empty while it runs."""

    @property
    def context(self) -> list[int]:
        """What the model's next turn is conditioned on: the prompt and every token appended since."""
        return self.prompt_ids + self.response

    def add_turn(self, completion: Completion, version: int) -> None:
        """The model's sampled tokens: trained on (loss_mask 1), with their logprobs (0 if none came)."""
        n = len(completion.token_ids)
        self.response += completion.token_ids
        self.logprobs += completion.logprobs if completion.logprobs else [0.0] * n
        self.loss_mask += [1] * n
        self.versions += [version] * n
        self.last_turn = completion
        self.turns += 1

    def add_observation(self, token_ids: list[int]) -> None:
        """An observation's tokens: context only (loss_mask 0, logprob NaN, version -1)."""
        n = len(token_ids)
        self.response += token_ids
        self.logprobs += [math.nan] * n
        self.loss_mask += [0] * n
        self.versions += [-1] * n

    def count(self, observation: EnvObservation) -> None:
        info = observation.info
        self.tool_calls += int(info.get("tool_calls", 0))
        self.tool_errors += int(info.get("tool_errors", 0)) + int(info.get("malformed_calls", 0))


@dataclass
class Episodes:
    """A finished episode job: its episodes prompt-major (sample j of prompt i is row i*n + j)."""

    episodes: list[Episode]
    versions_used: list[int] = field(default_factory=list)
    """The weight versions its engine calls used, in order of change (the first is the job's)."""

    @property
    def sampled_tokens(self) -> int:
        return sum(sum(ep.loss_mask) for ep in self.episodes)

    def completions(self, decode: Callable[[list[list[int]]], list[str]]) -> list[Completion]:
        """Each episode as one completion (its whole response; ``decode`` gives the texts)."""
        texts = decode([ep.response for ep in self.episodes])
        return [Completion(prompt_index=ep.prompt, sample_index=ep.sample, prompt_token_ids=ep.prompt_ids,
                           token_ids=ep.response, logprobs=ep.logprobs, text=text)
                for ep, text in zip(self.episodes, texts, strict=True)]  # fmt: skip

    def versions(self) -> list[list[int]]:
        return [ep.versions for ep in self.episodes]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The batch's episode fields (``loss_mask`` and ``episode_*``; see rlfleet.common.schema.batch)."""
        eps = self.episodes
        rows: dict[str, list[float]] = {
            "episode_reward": [ep.reward for ep in eps], "episode_turns": [ep.turns for ep in eps],
            "episode_tool_calls": [ep.tool_calls for ep in eps],
            "episode_tool_errors": [ep.tool_errors for ep in eps], "episode_env_s": [ep.env_s for ep in eps],
            "episode_end": [EPISODE_ENDS.index(ep.end) for ep in eps],
            "episode_obs_cut": [ep.obs_cut for ep in eps],
        }  # fmt: skip
        out = {
            name: torch.tensor(v, dtype=getattr(torch, OPTIONAL_FIELDS[name].dtype))
            for name, v in rows.items()
        }
        out[LOSS_MASK], _ = pad_right([ep.loss_mask for ep in eps], 0)
        return out


class EnvClient:
    """An episode job's requests to the environment service: over the worker's control transport,
    or the connection to the shared reward servers that serve it (``env_url``), with the run's
    tenant ``token`` in the ``Rlfleet-Token`` header where one is given.

    Reset and step wait at most ``env_timeout_s``, and never past the job's deadline (``time_left``
    raises ``DeadlinePassed`` then: the job fails, not the episode); any other failure is an
    :class:`EnvFailed`. Every wait counts in the episode's ``env_s``.
    """

    def __init__(
        self, transport: Transport, cluster: str, spec: EpisodeSpec, time_left: TimeLeft, *, token: str = ""
    ) -> None:
        self.transport = transport
        self.cluster = cluster
        self.spec = spec
        self.time_left = time_left
        self.headers = {TOKEN_HEADER: token} if token else None  # a shared server's tenant token

    async def reset(self, ep: Episode, item: dict[str, Any], seed: int) -> EnvObservation:
        """Begin ``ep``; the reply names the reward worker that holds it from now on."""
        timeout = self._timeout()
        message = EnvReset(env=self.spec.env, episode_id=ep.episode_id, item=item, seed=seed,
                           deadline=time.time() + timeout)  # fmt: skip
        reply = await self._observation(ep, "reset", subject(self.cluster, "env", "reset"), message, timeout)
        try:
            ep.env_subject = episode_subject(self.cluster, reply.worker_id)
        except ValueError:
            why = f"the reply names no usable reward worker ({reply.worker_id!r})"
            raise EnvFailed(self.spec.env, ep.episode_id, "reset", why) from None
        return reply

    async def step(self, ep: Episode, action: str) -> EnvObservation:
        """The model's turn ``action`` (its text) to the worker holding ``ep``."""
        timeout = self._timeout()
        try:
            message = EnvStep(env=self.spec.env, episode_id=ep.episode_id, action=action,
                              deadline=time.time() + timeout)  # fmt: skip
        except ValidationError as exc:
            why = f"the turn does not fit an EnvStep: {exc.errors()[0]['msg']}"
            raise EnvFailed(self.spec.env, ep.episode_id, "step", why) from None
        return await self._observation(ep, "step", ep.env_subject, message, timeout)

    async def close(self, ep: Episode) -> None:
        """End ``ep`` on the worker holding it (a failure is logged: it only frees the state)."""
        message = EnvClose(env=self.spec.env, episode_id=ep.episode_id)
        try:
            await self._request(
                ep, "close", ep.env_subject, message, min(self.spec.env_timeout_s, CLOSE_TIMEOUT_S)
            )
        except EnvFailed as exc:
            logger.warning("%s", exc)

    def _timeout(self) -> float:
        """``env_timeout_s``, or less where the job's deadline comes first (``DeadlinePassed`` past it)."""
        left = self.time_left()
        return self.spec.env_timeout_s if left is None else max(min(self.spec.env_timeout_s, left), 1e-3)

    async def _observation(
        self, ep: Episode, step: str, to: str, message: Message, timeout: float
    ) -> EnvObservation:
        reply = await self._request(ep, step, to, message, timeout)
        if not isinstance(reply, EnvObservation) or reply.episode_id != ep.episode_id:
            what = f"episode {reply.episode_id}" if isinstance(reply, EnvObservation) else reply.kind
            raise EnvFailed(self.spec.env, ep.episode_id, step, f"the reply is about {what}")
        return reply

    async def _request(self, ep: Episode, step: str, to: str, message: Message, timeout: float) -> AnyMessage:
        t0 = time.perf_counter()
        try:
            return await self.transport.request(
                to, message, timeout=timeout, tier="reward", headers=self.headers
            )
        except (RequestTimeout, NoResponders, RemoteError) as exc:
            if isinstance(exc, RequestTimeout) and step != "close" and timeout < self.spec.env_timeout_s:
                self.time_left()  # the job's deadline cut the wait: the job fails, not this episode
                raise DeadlinePassed(
                    f"episode {ep.episode_id} ({step})", 0.0, time.perf_counter() - t0
                ) from None
            if isinstance(exc, RemoteError) and exc.code in REFUSALS:
                raise EnvRefused(self.spec.env, exc.code, exc.remote_message) from None
            raise EnvFailed(self.spec.env, ep.episode_id, step, str(exc)) from None
        finally:
            ep.env_s += time.perf_counter() - t0


def episode_ids(job_id: str, prompts: int, n: int) -> list[str]:
    """``job:prompt:sample`` for each episode, prompt-major; a job id that is no valid part of an
    episode id (characters, length) is replaced by a hash of it."""
    job = job_id if _JOB_ID.match(job_id) else "job-" + hashlib.sha256(job_id.encode()).hexdigest()[:24]
    return [f"{job}:{p}:{s}" for p in range(prompts) for s in range(n)]


def env_seed(request: GenerateRequest, prompt: int) -> int:
    """The environment seed of every sample of ``prompt``: ``sampling.seed`` (else one derived from
    the job id) plus the prompt's index."""
    base = request.sampling.seed
    if base is None:
        base = int.from_bytes(hashlib.sha256(request.job_id.encode()).digest()[:8], "big")
    return (base + prompt) % SEED_CAP


class EpisodeDriver:
    """Runs one job's episodes (see the module docstring); ``run`` returns them finished."""

    def __init__(
        self, request: GenerateRequest, generate: TurnGenerate, env: EnvClient, turns: ChatTurns
    ) -> None:
        assert request.episode is not None
        self.request, self.spec = request, request.episode
        self.generate, self.env, self.turns = generate, env, turns
        n, prompts = request.sampling.n, request.prompt_token_ids
        ids = episode_ids(request.job_id, len(prompts), n)
        self.episodes = [
            Episode(prompt=k // n, sample=k % n, episode_id=ids[k], prompt_ids=list(prompts[k // n]))
            for k in range(len(prompts) * n)
        ]
        self.calls = 0
        self.versions_used: list[int] = []
        self._closing: list[asyncio.Task[None]] = []

    async def run(self) -> Episodes:
        try:
            await _together(self._reset(ep) for ep in self.episodes)
            for _ in range(self.spec.max_turns):
                live = [ep for ep in self.episodes if not ep.end]
                if not live:
                    break
                await self._turn(live)
        finally:  # every episode an environment holds is closed, also when the job fails
            for ep in self.episodes:
                if not ep.end and ep.env_subject:
                    self._closing.append(asyncio.create_task(self.env.close(ep)))
            await asyncio.gather(*self._closing, return_exceptions=True)
        assert all(ep.end for ep in self.episodes)
        return Episodes(self.episodes, self.versions_used)

    async def _reset(self, ep: Episode) -> None:
        try:
            reply = await self.env.reset(ep, self.spec.items[ep.prompt], env_seed(self.request, ep.prompt))
        except EnvFailed as exc:
            return self._fail(ep, exc)
        ep.count(reply)
        if reply.done:
            self._end(ep, "done", reply.reward)

    async def _turn(self, live: list[Episode]) -> None:
        """One model turn of every live episode, then their steps and observations."""
        await self._model_turn(live)
        stepping = [ep for ep in live if not ep.end]
        replies = await _together(self._step(ep) for ep in stepping)
        going = [(ep, reply) for ep, reply in zip(stepping, replies, strict=True) if reply is not None]
        rendered = await asyncio.to_thread(self._render, going)
        for (ep, _), (token_ids, cut) in zip(going, rendered, strict=True):
            if len(ep.response) + len(token_ids) >= self.spec.max_episode_tokens:
                self._end(ep, "max_tokens")  # no room left for another model token
            else:
                ep.add_observation(token_ids)
                ep.obs_cut += cut

    async def _model_turn(self, live: list[Episode]) -> None:
        """One engine call per token budget (most share one): each live episode samples a turn."""
        sampling = self.request.sampling
        budgets: dict[int, list[Episode]] = {}
        for ep in live:
            left = self.spec.max_episode_tokens - len(ep.response)
            budgets.setdefault(min(sampling.max_tokens, left), []).append(ep)
        for max_tokens, group in sorted(budgets.items(), reverse=True):
            params = segment_params(sampling, self.calls, max_tokens, continuation=True)
            self.calls += 1
            completions, version = await self.generate([ep.context for ep in group], params)
            if not self.versions_used or self.versions_used[-1] != version:
                self.versions_used.append(version)
            for ep, completion in zip(group, completions, strict=True):
                ep.add_turn(completion, version)
                if completion.finish_reason == "length" and max_tokens < sampling.max_tokens:
                    self._end(ep, "max_tokens")  # the turn was cut short by the episode's cap

    async def _step(self, ep: Episode) -> EnvObservation | None:
        """Send the episode's last turn; the observation to append, or None once the episode ended."""
        assert ep.last_turn is not None
        try:
            reply = await self.env.step(ep, ep.last_turn.text)
        except EnvFailed as exc:
            return self._fail(ep, exc)
        ep.count(reply)
        if reply.done:
            return self._end(ep, "done", reply.reward)
        if ep.turns >= self.spec.max_turns:
            return self._end(ep, "max_turns")
        return reply

    def _render(self, going: list[tuple[Episode, EnvObservation]]) -> list[tuple[list[int], int]]:
        """Each observation's tokens (cut to ``max_observation_tokens``) and the tokens cut off."""
        out = []
        for ep, reply in going:
            turn = ep.last_turn
            assert turn is not None
            text, cut = self.turns.cut(reply.observation, self.spec.max_observation_tokens)
            token_ids = self.turns.observation(text, reply.role, turn.token_ids, turn.finish_reason == "stop")
            out.append((token_ids, cut))
        return out

    def _end(self, ep: Episode, end: str, reward: float = 0.0) -> None:
        ep.end, ep.reward = end, reward if end == "done" else 0.0
        if ep.env_subject and end != "done":  # a done episode the environment has dropped already
            self._closing.append(asyncio.create_task(self.env.close(ep)))

    def _fail(self, ep: Episode, exc: EnvFailed) -> None:
        logger.warning("%s; the episode ends with reward 0", exc)
        self._end(ep, "env_error")


async def _together(coros: Iterable[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Run ``coros`` concurrently and return their results; on the first failure cancel the rest
    (waiting for them) and raise it."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
