"""The controller's handle on the reward tier: the run's own reward worker or a shared reward server.

By default a run starts its own reward worker on its own NATS server and cluster. With
``reward.url`` set, the run starts none: it scores on a shared server (``rlfleet-reward serve``)
at that NATS URL and ``reward.cluster``, connecting a second transport when the URL is not the
run's own, and sends ``reward.token`` with every request, in the ``Rlfleet-Token`` header. That
connection meets outages as the run's own does (``faults``): while it is down nobody on it is
declared dead, a score whose reply may be lost is sent again when it is back, and one still down
after ``faults.outage_grace_s`` fails the score with a named
:class:`~rlfleet.common.errors.NatsServerError`.

::

    fleet.score ──► RewardControl.score ──(ScoreRequest, token header)──► reward.score queue group
                                        └── a Python reward in force: PythonScorer, in this process
    set_reward_fn / update_reward_model ──(SetRewardSpec)──► every reward worker's own subject

:class:`~rlfleet.controller.run_reward.RunReward` is the run's reward as it changes (hot swaps,
what a checkpoint keeps of it).

Reward functions travel as specs, never as code (:func:`describe_reward_fn`); a Python callable
does not travel at all: the run's own reward tier scores with it in the controller
(:mod:`rlfleet.controller.python_scorer`), and a shared server is never sent one. Every score carries
the version of the endpoint that produced it; :meth:`RewardControl.step_metrics` turns the
versions a step saw into metrics (``reward/spec_revision``, ``reward/spec_version_changed``) and
logs the step where the version changed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from rlfleet.common.control.membership import WorkerRegistry
from rlfleet.common.control.messages import (
    GenerateResult,
    RewardSpecSet,
    RewardStats,
    RewardStatsRequest,
    ScoreRequest,
    ScoreResult,
    SetRewardSpec,
)
from rlfleet.common.control.transport import (
    REWARD_NATS_ENV_PREFIX,
    TOKEN_ENV,
    TOKEN_HEADER,
    Transport,
    subject,
)
from rlfleet.common.schema.connection import mask_url
from rlfleet.common.schema.reward import Spec
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.errors import RewardFnNotPortable
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.own_store import OwnStore
from rlfleet.controller.python_reward import PythonReward
from rlfleet.controller.python_scorer import PythonScorer
from rlfleet.controller.request_policy import POOL_POLL_S, Deadlines, give_up_at, with_retries

logger = logging.getLogger(__name__)

WIRE_KEYS = frozenset({"spec", "scaler", "scaler_state"})
SHARED_SERVER_RUNS_NO_CODE = (
    "the run scores on a shared reward server (reward.url), which never runs code sent to it; name a "
    "reward the server serves (a spec, or a 'package.module:function' its allowed_modules permit), or "
    "drop reward.url to score with this function in the controller"
)


def describe_reward_fn(fn: Any) -> dict[str, Any]:
    """What ``set_reward_fn(fn)`` sends: ``{"spec": ..., "scaler": ..., "scaler_state": ...}``, or
    ``{"python": PythonReward}`` for a callable scored in this process (sent nowhere).

    - a str is a spec (``"numeric + 0.1*concise"``); ``"package.module:function"`` names a function
      the reward worker imports (from the run's working directory, the job file's folder and
      ``python_path`` too: :mod:`rlfleet.controller.user_code`);
    - a dict is a spec's dict form, or already ``{"spec", "scaler", "scaler_state"}``;
    - an object with ``__rlfleet_reward__`` (a ``CompositeReward``, a ``RewardScaler``), or a bound
      method of one (``scaler.compute_reward``), describes itself, scaler statistics included; a
      bound method whose object cannot (a ``RewardScaler`` of a plain callable) is a Python reward;
    - any other callable (function, lambda, closure, ``functools.partial``, callable object) is a
      Python reward: the run's own reward tier calls it in the controller, as TRL does; the
      signatures it may have are :mod:`rlfleet.controller.python_reward`'s.

    Anything else raises :class:`RewardFnNotPortable`.
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
                if candidate is fn:
                    raise RewardFnNotPortable(fn, str(exc)) from exc
                return {"python": PythonReward(fn)}  # e.g. compute_reward of a plain callable's scaler
    if callable(fn):
        return {"python": PythonReward(fn)}
    raise RewardFnNotPortable(fn, f"a {type(fn).__name__} is neither a spec nor a function")


def revision_of(version: str) -> int:
    """The revision at the end of a reward version (``3f1c0a9b2e4d-r7`` -> 7; -1 if there is none)."""
    _, sep, tail = version.rpartition("-r")
    return int(tail) if sep and tail.isdigit() else -1


class RewardControl:
    """Scores, hot swaps and statistics on the reward tier a run uses."""

    def __init__(
        self, transport: Transport, cluster: str, registry: WorkerRegistry, *, token: str,
        request_timeout: float | None = None, owned: Sequence[Any] = (), remote: bool = False,
        faults: FaultSettings | None = None,
    ) -> None:  # fmt: skip
        self.faults = faults or FaultSettings()  # score retries: QuotaExceeded, a replica gone mid-request
        self.transport = transport
        self.cluster = cluster
        self.registry = registry
        self.token = token
        self.deadlines = Deadlines(request_timeout, self.faults)  # from each request's work (None: scaled)
        self._owned = list(owned)  # a second transport / registry this object opened, closed with it
        self._last_version = ""
        self._step_versions: list[str] = []
        self._raw: list[float] = []
        self.remote = remote
        self.python: PythonScorer | None = None  # the Python reward in force, scored in this process
        self.store: OwnStore | None = None  # where it reads texts: the run's own store (attach_reward)
        self.start_worker: Callable[[Spec], Awaitable[None]] | None = None  # the run's own reward worker
        self._revision = -1  # the highest reward revision seen; a Python reward takes the next

    @classmethod
    async def connect(
        cls, config: TrainerConfig, transport: Transport, cluster: str, registry: WorkerRegistry, url: str
    ) -> RewardControl:
        """The reward tier for ``config``: the run's own (``transport``/``cluster``) or ``reward.url``'s."""
        reward = config.reward
        token = reward.token.get_secret_value() or os.environ.get(TOKEN_ENV, "")
        timeout = config.request_timeout_s
        if reward.url is None:
            faults = config.faults
            return cls(transport, cluster, registry, token=token, request_timeout=timeout, faults=faults)
        reward_cluster = reward.cluster or "default"
        owned: list[Any] = []
        if reward.url != url:
            from rlfleet.common.control.nats_transport import NatsTransport

            auth = reward.nats_auth.resolved(prefix=REWARD_NATS_ENV_PREFIX)
            transport = await NatsTransport.connect(reward.url, name="rlfleet-controller-reward",
                                                    tier="controller", auth=auth,
                                                    outage_grace_s=config.faults.outage_grace_s)  # fmt: skip
            owned.append(transport)
        if transport is not registry.transport or reward_cluster != cluster:
            registry = WorkerRegistry(transport, reward_cluster, dead_after=config.faults.dead_after_s)
            await registry.start()
            owned.insert(0, registry)
        control = cls(transport, reward_cluster, registry, token=token, request_timeout=timeout, owned=owned,
                      remote=True, faults=config.faults)  # fmt: skip
        where = mask_url(reward.url)
        logger.info("scoring on the reward server at %s (cluster %s)", where, reward_cluster)
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
        if self.python is not None:
            replies: Sequence[Any] = await self.python.score(results, metadata, job_ids)
        else:
            verb = subject(self.cluster, "reward", "score")
            requests = [
                ScoreRequest(job_id=job, endpoint=endpoint, rollout=r.ref, metadata=list(meta))
                for r, meta, job in zip(results, metadata, job_ids, strict=True)
            ]
            timeouts = [self.deadlines.score(r) for r in results]
            scoring = (self._score_one(verb, req, t) for req, t in zip(requests, timeouts, strict=True))
            replies = await asyncio.gather(*scoring)
        scored: list[ScoreResult] = []
        for reply in replies:
            assert isinstance(reply, ScoreResult), reply
            scored.append(reply)
            self._step_versions.append(reply.spec_version)
            self._revision = max(self._revision, revision_of(reply.spec_version))
            self._raw.extend(reply.raw_scores)
        return scored

    async def _score_one(self, verb: str, request: ScoreRequest, timeout: float) -> Any:
        """One chunk's score request with the run's retry budget (same job id on every try): a
        quota refusal waits its ``retry_after``, a replica that died or drained goes to another."""
        return await with_retries(
            f"score {request.job_id} on endpoint {request.endpoint!r}",
            lambda: self.transport.request(  # each try carries its own deadline: the server stops past it
                verb,
                request.model_copy(update={"deadline": give_up_at(timeout)}),
                timeout=timeout,
                tier="reward",
                headers=self.headers,
            ),  # fmt: skip
            self.faults,
        )

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
            metrics["reward/raw_mean"] = math.fsum(raw) / len(raw)  # exact: the order chunks came in is not
        return metrics

    # --- hot swap and statistics -------------------------------------------------------------

    def _subjects(self) -> list[str]:
        subjects = [w.subject for w in self.registry.workers("reward")]
        if not subjects:
            raise ConnectionError(f"no reward worker is known on cluster {self.cluster!r}")
        return subjects

    async def set_reward(self, wire: Mapping[str, Any], endpoint: str) -> RewardSpecSet:
        """Send a hot swap to every reward worker; returns the last reply (all switch to one version).

        ``{"python": PythonReward}`` is not sent: scores come from this process from now on
        (:meth:`use_python`). A run without a reward worker yet (it began with a Python reward)
        starts its own first (:attr:`start_worker`)."""
        if "python" in wire:
            return self.use_python(wire["python"], endpoint)
        if self.start_worker is not None and "spec" in wire and not self.registry.workers("reward"):
            await self.start_worker(wire["spec"])
        message = SetRewardSpec(endpoint=endpoint, **dict(wire))
        replies = await asyncio.gather(
            *(self.transport.request(s, message, timeout=self.deadlines.reward_swap(), tier="reward",
                                     headers=self.headers)
              for s in self._subjects())
        )  # fmt: skip
        for reply in replies:
            assert isinstance(reply, RewardSpecSet), reply
        last = replies[-1]
        assert isinstance(last, RewardSpecSet)
        self._revision = max(self._revision, revision_of(last.spec_version))
        if "spec" in wire:
            self.python = None  # the workers' spec is in force again
        logger.info("reward endpoint %s now at version %s (%s)", endpoint, last.spec_version, last.spec)
        return last

    def use_python(self, reward: PythonReward, endpoint: str) -> RewardSpecSet:
        """Score with ``reward`` in this process from the next score on (its version: the next
        revision); refused on a shared reward server, which never runs code sent to it."""
        if self.remote:
            raise RewardFnNotPortable(reward.fn, SHARED_SERVER_RUNS_NO_CODE)
        previous = self.python.version if self.python is not None else self._last_version
        self._revision += 1
        version = f"{reward.description}-r{self._revision}"
        self.python = PythonScorer(reward, endpoint, version, self.store, self.deadlines)
        logger.info("reward endpoint %s now at version %s (scored in the controller)", endpoint, version)
        return RewardSpecSet(endpoint=endpoint, spec_version=version, spec=reward.description,
                             previous_version=previous)  # fmt: skip

    async def stats(self, endpoint: str = "") -> RewardStats:
        """Statistics of this run's token on one reward worker (of the Python reward in force, here)."""
        if self.python is not None:
            name = endpoint or self.python.endpoint
            return RewardStats(worker_id="controller", endpoints={name: self.python.stats()})
        message = RewardStatsRequest(endpoint=endpoint)

        async def ask() -> Any:
            subjects = await self._subjects_when_back()
            return await self.transport.request(subjects[0], message, timeout=self.deadlines.control(),
                                                tier="reward", headers=self.headers)  # fmt: skip

        reply = await with_retries(f"reward statistics of endpoint {endpoint!r}", ask, self.faults)
        assert isinstance(reply, RewardStats), reply
        return reply

    async def _subjects_when_back(self) -> list[str]:
        """The reward workers' subjects; while the tier has none (its only worker being restarted,
        as at a checkpoint right after a crash), waited for up to ``faults.empty_pool_wait_s``."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.faults.empty_pool_wait_s
        while not self.registry.workers("reward") and loop.time() < give_up:
            await asyncio.sleep(POOL_POLL_S)
        return self._subjects()


def model_swap(new_rm: Any, component: str | None) -> dict[str, Any]:
    """What ``update_reward_model(new_rm)`` sends: a model directory keeps the spec, anything else replaces
    it."""
    if isinstance(new_rm, str | os.PathLike) and os.path.isdir(new_rm):
        return {"model_path": os.path.abspath(new_rm), "component": component}
    if component is not None:
        raise RewardFnNotPortable(new_rm, "component= only applies when new_rm is a model directory")
    return describe_reward_fn(new_rm)
