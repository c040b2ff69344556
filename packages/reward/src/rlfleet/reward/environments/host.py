"""Serving environments: the episodes a reward worker holds, and each reset, step and close.

The reward worker checks who asks (tenants, quotas: :mod:`rlfleet.reward.service`); this holds
the rest. An episode is keyed by its owner (the tenant's name; ``""`` for the admin token or an
open server), its environment and its id, so a tenant reaches only its own episodes and an id one
tenant uses never meets another's. Bounds:

- ``max_episodes`` live episodes; a reset past it first drops those idle past ``idle_s`` (as every
  reset and step does), then is refused with :class:`~rlfleet.reward.errors.EpisodesFull`
  (retryable: another replica may have room). A reset of a live id starts that episode over.
- one step at a time per episode (:class:`~rlfleet.reward.errors.EpisodeBusy`);
- each reset or step runs in a thread, at most ``max_concurrency`` at once (the rest wait in
  arrival order), within its deadline: the environment's ``step_s`` or the request's own, whichever
  comes first, which the tools get too (a sandboxed run is killed at it). Past it the reply is
  :class:`~rlfleet.reward.errors.StepDeadlinePassed` and the episode is dropped.

An episode that is done is dropped at once; a later step for it, like one for an id never reset
here, gets :class:`~rlfleet.reward.errors.UnknownEpisode`. Episodes live in this process: a
restarted worker holds none.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from rlfleet.common.control.messages import EnvObservation, EnvReset, EnvStep
from rlfleet.common.schema.reward import EnvironmentConfig
from rlfleet.reward.environments.base import Environment, Observation
from rlfleet.reward.environments.registry import ConfiguredEnvironment, build_environment
from rlfleet.reward.errors import (
    EpisodeBusy,
    EpisodesFull,
    StepDeadlinePassed,
    UnknownEnvironment,
    UnknownEpisode,
)

logger = logging.getLogger(__name__)

Key = tuple[str, str, str]
"""(owner, environment, episode id)."""
MAX_OBSERVATION_CHARS = next(
    m.max_length for m in EnvObservation.model_fields["observation"].metadata if hasattr(m, "max_length")
)
CUT_NOTE = "\n[observation cut: it was {n} characters long]"


@dataclass
class Episode:
    """One live episode: its environment, its state, when it was last used, whether a step runs."""

    env: ConfiguredEnvironment
    state: Environment
    last_used: float
    busy: bool = True


class EnvironmentHost:
    """The environments one reward worker serves, and their live episodes (see the module docstring)."""

    def __init__(
        self,
        configs: Mapping[str, EnvironmentConfig],
        *,
        worker_id: str,
        max_episodes: int = 4096,
        idle_s: float = 600.0,
        max_concurrency: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.environments = {name: build_environment(name, cfg) for name, cfg in configs.items()}
        self.worker_id = worker_id
        self.max_episodes = max_episodes
        self.idle_s = idle_s
        self._clock = clock
        self._live: OrderedDict[Key, Episode] = OrderedDict()  # least recently used first
        self._held: Counter[str] = Counter()
        self._slots = asyncio.Semaphore(max_concurrency)

    def names(self) -> list[str]:
        return sorted(self.environments)

    def get(self, name: str, visible: list[str] | None = None) -> ConfiguredEnvironment:
        """The environment ``name``; :class:`UnknownEnvironment` (listing ``visible``) if not configured."""
        found = self.environments.get(name)
        if found is None:
            raise UnknownEnvironment(name, self.names() if visible is None else visible)
        return found

    def held_by(self, owner: str) -> int:
        """Live episodes of ``owner`` (after dropping the idle ones)."""
        self._sweep()
        return self._held[owner]

    def __len__(self) -> int:
        return len(self._live)

    async def reset(self, message: EnvReset, owner: str, deadline: float | None) -> EnvObservation:
        """Start (or start over) the episode ``message`` names; its first observation."""
        env = self.get(message.env)
        key = (owner, message.env, message.episode_id)
        self._sweep()
        old = self._live.get(key)
        if old is not None:
            self._drop(key, old)
        if len(self._live) >= self.max_episodes:
            raise EpisodesFull(self.worker_id, self.max_episodes)
        episode = Episode(env, env.new(), self._clock())
        self._live[key] = episode
        self._held[owner] += 1
        return await self._run(
            key, episode, lambda _: episode.state.reset(message.item, message.seed), deadline
        )

    async def step(self, message: EnvStep, owner: str, deadline: float | None) -> EnvObservation:
        """The environment's answer to the model's turn in the episode ``message`` names."""
        key = (owner, message.env, message.episode_id)
        self._sweep()
        episode = self._live.get(key)
        if episode is None:
            raise UnknownEpisode(message.episode_id, message.env, self.worker_id)
        if episode.busy:
            raise EpisodeBusy(message.episode_id)
        episode.busy, episode.last_used = True, self._clock()
        self._live.move_to_end(key)
        return await self._run(
            key, episode, lambda by: episode.state.step(message.action, deadline=by), deadline
        )

    def close(self, owner: str, env: str, episode_id: str) -> bool:
        """Drop the episode; False if it was not held (already done, closed or dropped)."""
        key = (owner, env, episode_id)
        episode = self._live.get(key)
        if episode is None:
            return False
        self._drop(key, episode)
        return True

    async def _run(
        self, key: Key, episode: Episode, work: Callable[[float], Observation], deadline: float | None
    ) -> EnvObservation:
        """``work(deadline)`` in a thread, within the deadline; the episode is released, or dropped
        when it is done, failed or ran out of time."""
        budget = episode.env.step_s if deadline is None else min(episode.env.step_s, deadline - time.time())
        observation: Observation | None = None
        try:
            async with asyncio.timeout(budget) as scope:
                async with self._slots:
                    observation = await asyncio.to_thread(work, time.time() + budget)
        except TimeoutError:
            if not scope.expired():
                raise  # the environment's own, not the deadline
            logger.warning("episode %s of %s: past its deadline (%.1f s), dropped", key[2], key[1], budget)
            raise StepDeadlinePassed(key[2], budget) from None
        finally:
            if observation is None or observation.done:
                self._drop(key, episode)
            else:
                episode.busy, episode.last_used = False, self._clock()
        return self._reply(key[2], observation)

    def _reply(self, episode_id: str, observation: Observation) -> EnvObservation:
        text = observation.text
        if len(text) > MAX_OBSERVATION_CHARS:
            note = CUT_NOTE.format(n=len(text))
            text = text[: MAX_OBSERVATION_CHARS - len(note)] + note
        return EnvObservation(
            episode_id=episode_id, worker_id=self.worker_id, observation=text, role=observation.role,
            reward=observation.reward, done=observation.done, info=dict(observation.info),
        )  # fmt: skip

    def _drop(self, key: Key, episode: Episode) -> None:
        """Forget ``episode`` (only if ``key`` still holds it: a reset may have started it over)."""
        if self._live.get(key) is episode:
            del self._live[key]
            self._held[key[0]] -= 1

    def _sweep(self) -> None:
        """Drop the episodes idle for ``idle_s`` or more (the least recently used come first)."""
        now = self._clock()
        while self._live:
            key, episode = next(iter(self._live.items()))
            if episode.busy or now - episode.last_used < self.idle_s:
                return
            logger.info("episode %s of %s: idle for %.0f s, dropped", key[2], key[1], now - episode.last_used)
            self._drop(key, episode)
