"""The controller's handle on the reward tier: the run's own reward worker or a shared reward server.

By default a run starts its own reward worker on its own NATS server and cluster. With
``reward_url`` set, the run starts none: it scores on a shared server (``rlfleet-reward serve``)
at that NATS URL and ``reward_cluster``, connecting a second transport when the URL is not the
run's own, and sends ``reward_token`` with every request, in the ``Rlfleet-Token`` header. That
connection meets outages as the run's own does (``faults``): while it is down nobody on it is
declared dead, a score whose reply may be lost is sent again when it is back, and one still down
after ``faults.outage_grace_s`` fails the score with a named
:class:`~rlfleet.common.errors.NatsServerError`.

::

    fleet.score ──► RewardControl.score ──(ScoreRequest, token header)──► reward.score queue group
    set_reward_fn / update_reward_model ──(SetRewardSpec)──► every reward worker's own subject

:class:`RunReward` is the run's reward as it changes (hot swaps, what a checkpoint keeps of it).

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
from rlfleet.common.control.transport import TOKEN_HEADER, Transport, subject
from rlfleet.common.schema.connection import mask_url
from rlfleet.controller.checkpoints import reward_to_restore
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.deadlines import Deadlines
from rlfleet.controller.errors import RewardFnNotPortable, TierNotReady
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.retry import with_retries

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

    @classmethod
    async def connect(
        cls, config: TrainerConfig, transport: Transport, cluster: str, registry: WorkerRegistry, url: str
    ) -> RewardControl:
        """The reward tier for ``config``: the run's own (``transport``/``cluster``) or ``reward_url``'s."""
        token = config.reward_token.get_secret_value() or os.environ.get(TOKEN_ENV, "")
        timeout = config.request_timeout_s
        if config.reward_url is None:
            faults = config.faults
            return cls(transport, cluster, registry, token=token, request_timeout=timeout, faults=faults)
        reward_cluster = config.reward_cluster or "default"
        owned: list[Any] = []
        if config.reward_url != url:
            from rlfleet.common.control.nats_transport import NatsTransport

            auth = config.reward_nats_auth.resolved(prefix="RLFLEET_REWARD_NATS_")
            transport = await NatsTransport.connect(config.reward_url, name="rlfleet-controller-reward",
                                                    tier="controller", auth=auth,
                                                    outage_grace_s=config.faults.outage_grace_s)  # fmt: skip
            owned.append(transport)
        if transport is not registry.transport or reward_cluster != cluster:
            registry = WorkerRegistry(transport, reward_cluster, dead_after=config.faults.dead_after_s)
            await registry.start()
            owned.insert(0, registry)
        control = cls(transport, reward_cluster, registry, token=token, request_timeout=timeout, owned=owned,
                      remote=True, faults=config.faults)  # fmt: skip
        where = mask_url(config.reward_url)
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
            self._raw.extend(reply.raw_scores)
        return scored

    async def _score_one(self, verb: str, request: ScoreRequest, timeout: float) -> Any:
        """One chunk's score request with the run's retry budget (same job id on every try): a
        quota refusal waits its ``retry_after``, a replica that died or drained goes to another."""
        return await with_retries(
            f"score {request.job_id} on endpoint {request.endpoint!r}",
            lambda: self.transport.request(
                verb, request, timeout=timeout, tier="reward", headers=self.headers
            ),
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
            *(self.transport.request(s, message, timeout=self.deadlines.reward_swap(), tier="reward",
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
        reply = await self.transport.request(self._subjects()[0], message, timeout=self.deadlines.control(),
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
            detail = f"the shared reward server at {mask_url(config.reward_url or '')} did not answer: {exc}"
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


class RunReward:
    """The reward a run scores with, as it changes: the spec in force and the one it started with,
    hot swaps, statistics, and what a checkpoint keeps of it. Each call takes the run's
    :class:`RewardControl` (the reward tier it is connected to)."""

    def __init__(self, spec: str | dict[str, Any] | None, endpoint: str) -> None:
        self.spec = spec
        self.initial_spec = spec  # spec follows set_reward_fn; a resume compares the two
        self.endpoint = endpoint
        self.model: dict[str, Any] | None = None  # the last update_reward_model(dir) on top of spec

    async def switch(self, control: RewardControl, wire: Mapping[str, Any]) -> RewardSpecSet:
        """Send ``wire`` (from :func:`describe_reward_fn` or :func:`model_swap`) to every reward worker."""
        done = await control.set_reward(wire, self.endpoint)
        if "spec" in wire:
            self.spec, self.model = wire["spec"], None  # a new spec replaces any swapped model
        if wire.get("model_path") is not None:
            self.model = {"model_path": wire["model_path"], "component": wire.get("component")}
        return done

    async def stats(self, control: RewardControl) -> RewardStats:
        """This run's view of its reward endpoint (version, counts, scaler state)."""
        return await control.stats(self.endpoint)

    async def checkpoint_state(self, control: RewardControl) -> dict[str, Any]:
        """What a checkpoint keeps: the spec in force, the starting one, the reward model swapped
        in on top of it (``update_reward_model(dir)``), and the endpoint's ``RewardScaler`` options
        and running statistics when one is set."""
        stats = (await self.stats(control)).endpoints.get(self.endpoint)
        scaler = None
        if stats is not None and stats.scaler is not None:
            scaler = {"scaler": stats.scaler, "scaler_state": stats.scaler_state}
        return {"reward_spec": self.spec, "initial_reward_spec": self.initial_spec,
                "reward_model": self.model, "reward_scaler": scaler}  # fmt: skip

    async def restore(self, control: RewardControl, state: dict[str, Any]) -> None:
        """Re-apply the checkpoint's reward where the resumed run should continue with it: a spec
        switched mid-run (:func:`~rlfleet.controller.checkpoints.reward_to_restore`), a reward model
        swapped in, and a ``RewardScaler``'s options and running statistics. A run resumed with a
        reward of its own (neither the checkpoint's starting one nor the one in force) keeps it."""
        restore = reward_to_restore(state, self.spec)
        scaler = state.get("reward_scaler")
        in_force = state.get("reward_spec")
        model = state.get("reward_model")
        if restore is None and ((scaler is None and model is None) or self.spec != in_force):
            return
        logger.info("re-applying the checkpoint's reward %r%s%s", in_force,
                    " with its scaler" if scaler else "",
                    f", reward model {model['model_path']}" if model else "")  # fmt: skip
        await self.switch(control, {"spec": in_force, **(scaler or {})})
        if model is not None:  # on top of the spec; scaler None keeps the statistics just restored
            swap = {"model_path": model["model_path"], "component": model.get("component")}
            await self.switch(control, swap)
