"""A reward server's endpoints: each a versioned reward plus an optional scaler, hot-swappable.

An endpoint (``team-a/helpful``) serves one :class:`EndpointVersion` at a time: a built
:class:`CompositeReward`, the :class:`RewardScaler` applied to its totals, and a revision that
goes up by one on every swap. A version is immutable; a request takes the endpoint's current
version when it starts and finishes on it, whatever happens meanwhile. A swap builds the new
reward in a worker thread (models load there) while the old version keeps serving, then replaces
it with one assignment; swaps of one endpoint run one at a time, so revisions only go up. If the
build fails, the old version stays and the error goes back to whoever asked.

With a ``state_dir``, each endpoint's current spec, revision, scaler and scaler statistics are
written there (:mod:`rlfleet.reward.endpoint_state`: before a swap takes effect, after each batch
a normalizing scaler counted (:meth:`Endpoints.counted`), and by :meth:`Endpoints.save`) and read
back when the server starts, so a restart keeps hot-swapped
rewards, endpoints created at run time and their statistics, and revisions keep going up. A swap
whose state cannot be written does not take effect (its error goes back to whoever asked).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.common.control.messages import EndpointStats
from rlfleet.common.schema.reward import EndpointConfig, ScalerConfig, Spec
from rlfleet.reward.composite import CompositeReward
from rlfleet.reward.endpoint_state import StateDir, state_of
from rlfleet.reward.errors import RewardSpecError, RewardStateError, UnknownEndpoint
from rlfleet.reward.registry import build_reward
from rlfleet.reward.scaler import RewardScaler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EndpointVersion:
    """What an endpoint serves between two swaps."""

    name: str
    reward: CompositeReward
    scaler: RewardScaler | None
    revision: int

    @property
    def version(self) -> str:
        """``<spec hash>-r<revision>``: changes on every swap."""
        return self.reward.version

    def scale(self, totals: list[float]) -> list[float]:
        """The totals after this version's scaler (as they are without one)."""
        return self.scaler(totals) if self.scaler is not None else list(totals)


def revision_of(version: str) -> int:
    """The revision number at the end of a version string (``3f1c0a9b2e4d-r7`` -> 7)."""
    head, sep, tail = version.rpartition("-r")
    if not sep or not tail.isdigit():
        raise ValueError(f"{version!r} is not a reward version '<hash>-r<revision>'")
    return int(tail)


@dataclass
class _Counters:
    requests: int = 0
    samples: int = 0
    errors: int = 0
    raw_sum: float = 0.0


def _with_model_path(reward: CompositeReward, model_path: str, component: str | None) -> dict[str, Any]:
    """The dict form of ``reward``'s spec with the ``rm`` component's ``path`` replaced."""
    spec = reward.spec.model_dump(mode="json", exclude={"revision"})
    targets = [
        i for i, (c, comp) in enumerate(zip(reward.components, spec["components"], strict=True))
        if comp["name"] == "rm" and (component is None or c.label == component)
    ]  # fmt: skip
    if len(targets) != 1:
        labels = [
            c.label for c, s in zip(reward.components, spec["components"], strict=True) if s["name"] == "rm"
        ]
        reason = (
            f"no rm component{f' labelled {component!r}' if component else ''} (rm components: {labels}); "
            "send a whole spec instead"
            if not targets
            else f"several rm components {labels}: name one with component=<label>"
        )
        raise RewardSpecError(str(reward.spec), reason)
    spec["components"][targets[0]]["args"]["path"] = model_path
    return spec


class Endpoints:
    """The live endpoints of one reward worker, their swaps, statistics and saved state."""

    def __init__(self, state_dir: str | Path | None = None) -> None:
        self.state_dir = Path(state_dir) if state_dir else None
        self._saved = StateDir(self.state_dir) if self.state_dir else None
        self._live: dict[str, EndpointVersion] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._counters: dict[str, _Counters] = {}

    def names(self) -> list[str]:
        return sorted(self._live)

    def __contains__(self, name: str) -> bool:
        return name in self._live

    def get(self, name: str, visible: list[str] | None = None) -> EndpointVersion:
        """The version ``name`` serves now; :class:`UnknownEndpoint` (listing ``visible``) if none."""
        found = self._live.get(name)
        if found is None:
            raise UnknownEndpoint(name, self.names() if visible is None else visible)
        return found

    async def start(self, configs: Mapping[str, EndpointConfig]) -> None:
        """Build every endpoint from ``configs``, or from its saved state when there is one, and every
        endpoint the ``state_dir`` holds that the config lacks (created at run time).

        Raises :class:`RewardStateError` for a state file that is bad or whose spec no longer builds.
        """
        saved_names = self._saved.names() if self._saved is not None else []
        for name in [*configs, *(n for n in saved_names if n not in configs)]:
            saved = self._saved.read(name) if self._saved is not None else None
            if saved is None:
                await self._install(name, configs[name].spec, configs[name].scaler, None, 0)
                continue
            assert self._saved is not None
            try:
                state = saved.scaler_state.model_dump() if saved.scaler_state is not None else None
                await self._install(name, saved.spec, saved.scaler, state, saved.revision)
            except ValueError as exc:  # every spec and scaler error is one
                file = self._saved.file_of(name)
                raise RewardStateError(file, f"its spec no longer builds ({exc})") from exc
            origin = "the config's" if name in configs else "created at run time"
            logger.info("endpoint %s (%s) restored from %s at revision %d", name, origin,
                        self._saved.file_of(name), saved.revision)  # fmt: skip

    async def _install(
        self,
        name: str,
        spec: Spec,
        scaler: ScalerConfig | None,
        state: Mapping[str, Any] | None,
        revision: int,
    ) -> EndpointVersion:
        reward = await asyncio.to_thread(build_reward, spec, revision=revision)
        live = RewardScaler.from_config(scaler) if scaler is not None else None
        if live is not None and state is not None:
            live.load_state_dict(state)
        version = EndpointVersion(name, reward, live, revision)
        self._live[name] = version
        self._counters.setdefault(name, _Counters())
        logger.info("endpoint %s: %s (version %s)", name, reward.spec, version.version)
        return version

    async def swap(
        self,
        name: str,
        *,
        spec: Spec | None = None,
        model_path: str | None = None,
        component: str | None = None,
        scaler: Mapping[str, Any] | None = None,
        scaler_state: Mapping[str, Any] | None = None,
    ) -> tuple[EndpointVersion | None, EndpointVersion, float]:
        """Build the endpoint's next version and switch to it: ``(old, new, seconds spent building)``.

        ``spec`` replaces the reward, ``model_path`` only the path of its ``rm`` component; with
        neither, the reward stays (a scaler change). ``scaler`` None keeps the current scaler object
        (statistics and all); ``{}`` removes scaling. ``scaler_state`` sets the statistics, of a new
        scaler object: the old version serves, statistics untouched, until the switch, and keeps
        serving whole when the swap fails anywhere before it (a build, a check, the state write).
        """
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            old = self._live.get(name)
            if old is None and spec is None:
                raise UnknownEndpoint(name, self.names())
            if spec is None:
                assert old is not None
                spec = (
                    _with_model_path(old.reward, model_path, component)
                    if model_path is not None
                    else old.reward.spec.model_dump(mode="json", exclude={"revision"})
                )
            start = time.perf_counter()
            revision = old.revision + 1 if old is not None else 0
            reward = await asyncio.to_thread(build_reward, spec, revision=revision)
            live = self._next_scaler(old, scaler, scaler_state)
            new = EndpointVersion(name, reward, live, revision)
            # saved first: a version that a restart would not bring back is never served
            await asyncio.to_thread(self._write, new)
            self._live[name] = new  # the switch: requests that start from now on get the new version
            self._counters.setdefault(name, _Counters())
            seconds = time.perf_counter() - start
        old_version = old.version if old is not None else "none"
        logger.info("endpoint %s swapped %s -> %s (%s) in %.2fs", name, old_version, new.version, reward.spec,
                    seconds)  # fmt: skip
        return old, new, seconds

    @staticmethod
    def _next_scaler(
        old: EndpointVersion | None, scaler: Mapping[str, Any] | None, state: Mapping[str, Any] | None
    ) -> RewardScaler | None:
        if scaler is None:
            live = old.scaler if old is not None else None
        else:
            live = RewardScaler.from_config(ScalerConfig(**scaler)) if scaler else None
        if state is not None:
            if live is None:
                raise ValueError(
                    "scaler_state given for an endpoint without a scaler; send scaler options too"
                )
            if old is not None and live is old.scaler:  # the old version serves until the switch: not its
                live = RewardScaler.from_config(live.config)  # statistics, a new scaler takes the state
            live.load_state_dict(state)
        return live

    # --- statistics -------------------------------------------------------------------------

    def record(self, name: str, raw: list[float]) -> None:
        counters = self._counters.setdefault(name, _Counters())
        counters.requests += 1
        counters.samples += len(raw)
        counters.raw_sum += math.fsum(raw)

    def record_error(self, name: str) -> None:
        self._counters.setdefault(name, _Counters()).errors += 1

    def stats(self, name: str) -> EndpointStats:
        live = self.get(name)
        c = self._counters.get(name, _Counters())
        return EndpointStats(
            spec=str(live.reward.spec), spec_version=live.version, requests=c.requests, samples=c.samples,
            errors=c.errors, raw_mean=c.raw_sum / c.samples if c.samples else 0.0,
            scaler=live.scaler.config.model_dump(mode="json") if live.scaler else None,
            scaler_state=live.scaler.state_dict() if live.scaler else None,
        )  # fmt: skip

    # --- saved state ------------------------------------------------------------------------

    def _write(self, version: EndpointVersion) -> None:
        if self._saved is not None:
            spec = version.reward.spec.model_dump(mode="json", exclude={"revision"})
            self._saved.write(version.name, state_of(version.name, spec, version.revision, version.scaler))

    def counted(self, version: EndpointVersion) -> None:
        """After ``version``'s scaler folded a batch into its running statistics: save them before the
        batch is answered (with a state_dir), so a server killed after answering comes back with the
        statistics its answers were scaled with, not those of the last periodic save. A scaler that
        does not normalize keeps no statistics and costs no write."""
        if self._saved is None or version.scaler is None or not version.scaler.config.normalize:
            return
        try:
            self._write(version)
        except OSError as exc:  # the batch is still answered; the next save may succeed
            logger.error(
                "endpoint %s: scaler statistics not saved in %s: %s", version.name, self.state_dir, exc
            )

    def save_one(self, name: str) -> None:
        """Write endpoint ``name``'s spec, revision and scaler state (atomically), with a state_dir."""
        live = self._live.get(name)
        if live is not None:
            self._write(live)

    def save(self) -> None:
        """Write every endpoint's state (with a state_dir); a failure is logged, the others still written."""
        for name in list(self._live):
            try:
                self.save_one(name)
            except OSError as exc:
                logger.error("endpoint %s: state not saved in %s: %s", name, self.state_dir, exc)
