"""The controller's handle on the reward tier: the run's own reward worker or a shared reward server.

By default a run starts its own reward worker on its own NATS server and cluster. With
``reward_url`` set, the run starts none: it scores on a shared server (``rlfleet-reward serve``)
at that NATS URL and ``reward_cluster``, connecting a second transport when the URL is not the
run's own, and sends ``reward_token`` with every request, in the ``Rlfleet-Token`` header.

::

    fleet.score ──► RewardControl.score ──(ScoreRequest, token header)──► reward.score queue group
    set_reward_fn / update_reward_model ──(SetRewardSpec)──► every reward worker's own subject

Reward functions travel as specs, never as code (:func:`describe_reward_fn`). Every score carries
the version of the endpoint that produced it; :meth:`RewardControl.step_metrics` turns the
versions a step saw into metrics (``reward/spec_revision``, ``reward/spec_version_changed``) and
logs the step where the version changed.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rlfleet.common.membership import WorkerRegistry
from rlfleet.common.messages import (
    GenerateResult,
    RewardSpecSet,
    RewardStats,
    RewardStatsRequest,
    ScoreRequest,
    ScoreResult,
    SetRewardSpec,
)
from rlfleet.common.subjects import subject
from rlfleet.common.transport import TOKEN_HEADER, Transport
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.errors import RewardFnNotPortable, TierNotReady

logger = logging.getLogger(__name__)

TOKEN_ENV = "RLFLEET_REWARD_TOKEN"
WIRE_KEYS = frozenset({"spec", "scaler", "scaler_state"})


def importable_name(fn: Any) -> str:
    """``package.module:function`` of a top-level function that importing gives back, or an error."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname:
        raise RewardFnNotPortable(fn, "it has no __module__ / __qualname__")
    if module == "__main__":
        raise RewardFnNotPortable(fn, "it is defined in __main__, which a reward worker cannot import")
    if not qualname.isidentifier():
        raise RewardFnNotPortable(fn, f"{qualname!r} is not a top-level function of {module}")
    try:
        found = getattr(importlib.import_module(module), qualname, None)
    except ImportError as exc:
        raise RewardFnNotPortable(fn, f"its module {module!r} does not import: {exc}") from exc
    if found is not fn:
        raise RewardFnNotPortable(fn, f"{module}:{qualname} does not name this function")
    return f"{module}:{qualname}"


def describe_reward_fn(fn: Any) -> dict[str, Any]:
    """What ``set_reward_fn(fn)`` sends: ``{"spec": ..., "scaler": ..., "scaler_state": ...}``.

    - a str is a spec (``"numeric + 0.1*concise"``, ``"mypkg.rewards:score"``);
    - a dict is a spec's dict form, or already ``{"spec", "scaler", "scaler_state"}``;
    - an object with ``__rlfleet_reward__`` (a ``CompositeReward``, a ``RewardScaler``), or a bound
      method of one (``scaler.compute_reward``), describes itself, scaler statistics included;
    - a top-level function of an importable module (``fn(prompt, response, **metadata) -> float``)
      is sent by name; the reward worker imports it, so it must be installed there too.

    Anything else (a lambda, a closure, a function of ``__main__``) raises :class:`RewardFnNotPortable`.
    """
    if isinstance(fn, str):
        if not fn.strip():
            raise RewardFnNotPortable(fn, "the spec is empty")
        return {"spec": fn}
    if isinstance(fn, Mapping):
        if "spec" in fn:
            extra = set(fn) - WIRE_KEYS
            if extra:
                raise RewardFnNotPortable(fn, f"unknown keys {sorted(extra)} (allowed: {sorted(WIRE_KEYS)})")
            return dict(fn)
        return {"spec": dict(fn)}
    for candidate in (fn, getattr(fn, "__self__", None)):
        describe = getattr(candidate, "__rlfleet_reward__", None)
        if callable(describe):
            try:
                return dict(describe())
            except ValueError as exc:  # the reward package's NotPortable
                raise RewardFnNotPortable(fn, str(exc)) from exc
    if callable(fn):
        return {"spec": importable_name(fn)}
    raise RewardFnNotPortable(fn, f"a {type(fn).__name__} is neither a spec nor a function")


def revision_of(version: str) -> int:
    """The revision at the end of a reward version (``3f1c0a9b2e4d-r7`` -> 7; -1 if there is none)."""
    _, sep, tail = version.rpartition("-r")
    return int(tail) if sep and tail.isdigit() else -1


class RewardControl:
    """Scores, hot swaps and statistics on the reward tier a run uses."""

    def __init__(
        self, transport: Transport, cluster: str, registry: WorkerRegistry, *, token: str,
        request_timeout: float, owned: Sequence[Any] = (), remote: bool = False,
    ) -> None:  # fmt: skip
        self.transport = transport
        self.cluster = cluster
        self.registry = registry
        self.token = token
        self.request_timeout = request_timeout
        self._owned = list(owned)  # a second transport / registry this object opened, closed with it
        self._last_version = ""
        self._step_versions: list[str] = []
        self._raw: list[float] = []
        self.remote = remote

    @classmethod
    async def connect(
        cls, config: TrainerConfig, transport: Transport, cluster: str, registry: WorkerRegistry, url: str
    ) -> RewardControl:
        """The reward tier for ``config``: the run's own (``transport``/``cluster``) or ``reward_url``'s."""
        token = config.reward_token.get_secret_value() or os.environ.get(TOKEN_ENV, "")
        timeout = config.request_timeout_s
        if config.reward_url is None:
            return cls(transport, cluster, registry, token=token, request_timeout=timeout)
        reward_cluster = config.reward_cluster or "default"
        owned: list[Any] = []
        if config.reward_url != url:
            from rlfleet.common.nats_transport import NatsTransport

            transport = await NatsTransport.connect(config.reward_url, name="rlfleet-controller-reward",
                                                    tier="controller")  # fmt: skip
            owned.append(transport)
        if transport is not registry.transport or reward_cluster != cluster:
            registry = WorkerRegistry(transport, reward_cluster)
            await registry.start()
            owned.insert(0, registry)
        control = cls(transport, reward_cluster, registry, token=token, request_timeout=timeout, owned=owned,
                      remote=True)  # fmt: skip
        logger.info("scoring on the reward server at %s (cluster %s)", config.reward_url, reward_cluster)
        return control

    async def wait_ready(self, timeout: float) -> None:
        """Wait for at least one reward worker (``TimeoutError`` naming the cluster otherwise)."""
        await self.registry.wait_for("reward", 1, timeout)

    async def close(self) -> None:
        """Close what :meth:`connect` opened (a shared server's registry and transport)."""
        for thing in self._owned:
            if isinstance(thing, WorkerRegistry):
                await thing.stop()
            else:
                await thing.close()
        self._owned.clear()

    @property
    def headers(self) -> dict[str, str]:
        """The credential header every request carries (none without a token)."""
        return {TOKEN_HEADER: self.token} if self.token else {}

    # --- scoring ----------------------------------------------------------------------------

    async def score(
        self, results: Sequence[GenerateResult], metadata: Sequence[Sequence[dict[str, Any]]], endpoint: str,
        job_ids: Sequence[str],
    ) -> list[ScoreResult]:  # fmt: skip
        """Score each rollout chunk; ``metadata[i]`` is chunk i's per-prompt metadata."""
        verb = subject(self.cluster, "reward", "score")
        requests = [
            ScoreRequest(job_id=job, endpoint=endpoint, rollout=r.ref, metadata=list(meta))
            for r, meta, job in zip(results, metadata, job_ids, strict=True)
        ]
        replies = await asyncio.gather(
            *(
                self.transport.request(
                    verb, req, timeout=self.request_timeout, tier="reward", headers=self.headers
                )  # fmt: skip
                for req in requests
            )
        )
        scored: list[ScoreResult] = []
        for reply in replies:
            assert isinstance(reply, ScoreResult), reply
            scored.append(reply)
            self._step_versions.append(reply.spec_version)
            self._raw.extend(reply.raw_scores)
        return scored

    def step_metrics(self, step: int) -> dict[str, float]:
        """Metrics of the reward versions the scores since the last call came from."""
        versions, self._step_versions = list(dict.fromkeys(self._step_versions)), []
        raw, self._raw = self._raw, []
        if not versions:
            return {}
        latest = max(versions, key=revision_of)
        changed = latest != self._last_version and bool(self._last_version)
        if changed:
            logger.info("step %d: reward version %s -> %s", step, self._last_version, latest)
        self._last_version = latest
        metrics = {
            "reward/spec_revision": float(revision_of(latest)),
            "reward/spec_version_changed": 1.0 if changed else 0.0,
            "reward/spec_versions_in_step": float(len(versions)),
        }
        if raw:
            metrics["reward/raw_mean"] = sum(raw) / len(raw)
        return metrics

    # --- hot swap and statistics -------------------------------------------------------------

    def _subjects(self) -> list[str]:
        subjects = [w.subject for w in self.registry.workers("reward")]
        if not subjects:
            raise ConnectionError(f"no reward worker is known on cluster {self.cluster!r}")
        return subjects

    async def set_reward(self, wire: Mapping[str, Any], endpoint: str) -> RewardSpecSet:
        """Send a hot swap to every reward worker; returns the last reply (all switch to one version)."""
        message = SetRewardSpec(endpoint=endpoint, **dict(wire))
        replies = await asyncio.gather(
            *(self.transport.request(s, message, timeout=self.request_timeout, tier="reward",
                                     headers=self.headers)
              for s in self._subjects())
        )  # fmt: skip
        for reply in replies:
            assert isinstance(reply, RewardSpecSet), reply
        last = replies[-1]
        assert isinstance(last, RewardSpecSet)
        logger.info("reward endpoint %s now at version %s (%s)", endpoint, last.spec_version, last.spec)
        return last

    async def stats(self, endpoint: str = "") -> RewardStats:
        """Statistics of this run's token on one reward worker."""
        message = RewardStatsRequest(endpoint=endpoint)
        reply = await self.transport.request(self._subjects()[0], message, timeout=self.request_timeout,
                                             tier="reward", headers=self.headers)  # fmt: skip
        assert isinstance(reply, RewardStats), reply
        return reply


async def attach_reward(fleet: Any, config: TrainerConfig, url: str) -> RewardControl:
    """Give ``fleet`` (a :class:`~rlfleet.controller.fleet.Fleet`) its reward tier; wait for a shared one."""
    control = await RewardControl.connect(config, fleet.transport, fleet.cluster, fleet.registry, url)
    fleet.reward = control
    if control.remote:
        try:
            await control.wait_ready(config.startup_timeout_s)
        except TimeoutError as exc:
            detail = f"the shared reward server at {config.reward_url} did not answer: {exc}"
            raise TierNotReady(config.startup_timeout_s, [], detail) from None
    return control


def model_swap(new_rm: Any, component: str | None) -> dict[str, Any]:
    """What ``update_reward_model(new_rm)`` sends: a model directory keeps the spec, anything else replaces
    it."""
    if isinstance(new_rm, str | os.PathLike) and os.path.isdir(new_rm):
        return {"model_path": os.path.abspath(new_rm), "component": component}
    if component is not None:
        raise RewardFnNotPortable(new_rm, "component= only applies when new_rm is a model directory")
    return describe_reward_fn(new_rm)


class RewardControls:
    """The trainers' reward methods between steps (mixed into :class:`~rlfleet.controller.runner.FleetRunner`,
    which supplies ``fleet``, ``run``, ``config`` and the event loop)."""

    fleet: Any
    config: TrainerConfig
    reward_spec: Any
    _loop: asyncio.AbstractEventLoop | None

    def run(self, coro: Any) -> Any:  # supplied by FleetRunner
        raise NotImplementedError

    def set_reward_fn(self, fn: Any) -> str:
        """Switch the reward for the next steps (progressive rewards); returns the new reward version.

        ``fn``: a spec (str or dict), a ``package.module:function`` name or an importable top-level
        function, or a ``CompositeReward`` / ``RewardScaler`` built from a spec (or its
        ``compute_reward``); see :func:`rlfleet.controller.reward_control.describe_reward_fn`. Works
        with the run's own reward worker and with a shared server (``reward_url``).
        """
        wire = describe_reward_fn(fn)
        done = self.run(self.fleet.reward.set_reward(wire, self.config.reward_endpoint))
        self.reward_spec = wire["spec"]
        return done.spec_version

    def update_reward_model(self, new_rm: Any, *, component: str | None = None, wait: bool = True) -> Any:
        """Hot-swap the reward model: the reward tier loads it in the background, the old one keeps
        serving until the switch, and scores name the version that made them (``reward/spec_revision``).

        ``new_rm``: a reward model directory (the endpoint's ``rm`` component, or the one labelled
        ``component``, is pointed at it; the rest of the spec stays) or anything :meth:`set_reward_fn`
        takes. ``wait=True`` returns the new version once switched; ``wait=False`` returns at once with
        an ``asyncio.Task`` that completes while later steps run.
        """
        wire = model_swap(new_rm, component)
        swap = self.fleet.reward.set_reward(wire, self.config.reward_endpoint)
        if wait:
            return self.run(swap).spec_version
        assert self._loop is not None
        return self._loop.create_task(swap, name="reward-model-swap")

    def reward_stats(self) -> Any:
        """This run's view of its reward endpoint (``RewardStats``: version, counts, scaler state)."""
        return self.run(self.fleet.reward.stats(self.config.reward_endpoint))
