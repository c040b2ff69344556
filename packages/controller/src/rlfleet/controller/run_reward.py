"""``RunReward``: the reward a run scores with, as it changes (moved out of reward_control.py).

:func:`attach_reward` connects a run to its reward tier and puts the run's reward in force there.
A run's reward is a spec its reward worker serves (text or dict, a ``CompositeReward`` /
``RewardScaler`` described as one) or a Python callable the controller calls itself
(:mod:`rlfleet.controller.python_scorer`). ``set_reward_fn`` / ``update_reward_model`` switch it
between steps; a checkpoint keeps what can be kept of it (a spec, a swapped reward model, a
scaler's statistics; of a Python reward only its name, since code is never saved) and a resumed
run re-applies it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rlfleet.common.control.messages import RewardSpecSet, RewardStats
from rlfleet.common.schema.connection import mask_url
from rlfleet.common.schema.reward import Spec
from rlfleet.controller.checkpoints import reward_to_restore
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.errors import RewardFnNotPortable, TierNotReady
from rlfleet.controller.own_store import OwnStore
from rlfleet.controller.ports import FleetClient
from rlfleet.controller.python_reward import PythonReward
from rlfleet.controller.reward_control import SHARED_SERVER_RUNS_NO_CODE, RewardControl, describe_reward_fn

logger = logging.getLogger(__name__)


def is_python_description(spec: Any) -> bool:
    """Whether a recorded reward is a Python reward's name (:attr:`PythonReward.description`)."""
    return isinstance(spec, str) and spec.startswith("<python function ")


class RunReward:
    """The reward a run scores with, as it changes: the spec in force and the one it started with,
    hot swaps, statistics, and what a checkpoint keeps of it. Each call takes the run's
    :class:`RewardControl` (the reward tier it is connected to).

    ``reward``: a spec (str or dict), anything :func:`describe_reward_fn` takes, or None (offline).
    ``shared``: the run scores on a shared server (``reward.url``), so a callable is refused here,
    before anything starts."""

    def __init__(self, reward: Any, endpoint: str, *, shared: bool = False) -> None:
        self.endpoint = endpoint
        self.python: PythonReward | None = None
        """The Python reward in force (its name is :attr:`spec`), or None while a spec is."""
        self.pending: dict[str, Any] | None = None  # a described scaler, sent once the tier is up
        spec = reward
        if reward is not None and not isinstance(reward, str | Mapping):
            wire = describe_reward_fn(reward)
            if "python" in wire:
                if shared:
                    raise RewardFnNotPortable(reward, SHARED_SERVER_RUNS_NO_CODE)
                self.python = wire["python"]
                spec = self.python.description
            else:
                spec = wire["spec"]
                self.pending = wire if len(wire) > 1 else None
        self.spec = spec
        self.initial_spec = spec  # spec follows set_reward_fn; a resume compares the two
        self.model: dict[str, Any] | None = None  # the last update_reward_model(dir) on top of spec

    @classmethod
    def of(cls, reward: Any, config: TrainerConfig) -> RunReward:
        """The reward of a run with ``config`` (its endpoint; a callable refused with ``reward.url``)."""
        return cls(reward, config.reward.endpoint, shared=bool(config.reward.url))

    @property
    def worker_spec(self) -> str | dict[str, Any] | None:
        """The spec the run's own reward worker starts with (None: a Python reward needs none)."""
        return None if self.python is not None else self.spec

    async def attach(self, control: RewardControl) -> None:
        """Put the run's reward in force on the tier just attached (a Python reward, a scaler)."""
        if self.python is not None:
            control.use_python(self.python, self.endpoint)
        elif self.pending is not None:
            await self.switch(control, self.pending)
            self.pending = None

    async def switch(self, control: RewardControl, wire: Mapping[str, Any]) -> RewardSpecSet:
        """Send ``wire`` (from :func:`describe_reward_fn` or ``model_swap``) to every reward worker,
        or put a Python reward in force."""
        if wire.get("model_path") is not None and self.python is not None:
            raise RewardFnNotPortable(wire["model_path"], f"the reward in force is {self.spec}, not a spec "
                                      "with a reward model to swap; set_reward_fn a spec first")  # fmt: skip
        done = await control.set_reward(wire, self.endpoint)
        if "python" in wire:
            self.python, self.model = wire["python"], None
            self.spec = self.python.description
        elif "spec" in wire:
            self.spec, self.model, self.python = wire["spec"], None, None  # a new spec replaces any model
        if wire.get("model_path") is not None:
            self.model = {"model_path": wire["model_path"], "component": wire.get("component")}
        return done

    async def stats(self, control: RewardControl) -> RewardStats:
        """This run's view of its reward endpoint (version, counts, scaler state)."""
        return await control.stats(self.endpoint)

    async def checkpoint_state(self, control: RewardControl) -> dict[str, Any]:
        """What a checkpoint keeps: the spec in force, the starting one, the reward model swapped
        in on top of it (``update_reward_model(dir)``), and the endpoint's ``RewardScaler`` options
        and running statistics when one is set. A Python reward is kept by name only."""
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
        reward of its own (neither the checkpoint's starting one nor the one in force) keeps it, and
        so does one whose checkpoint was taken under a Python reward (code is not saved: call
        ``set_reward_fn`` with it again)."""
        restore = reward_to_restore(state, self.spec)
        scaler = state.get("reward_scaler")
        in_force = state.get("reward_spec")
        model = state.get("reward_model")
        if is_python_description(restore):
            logger.warning("the checkpoint was taken while %s was the reward, which a checkpoint cannot "
                           "hold; this run goes on with %s", restore, self.spec)  # fmt: skip
            return
        if restore is None and ((scaler is None and model is None) or self.spec != in_force):
            return
        logger.info("re-applying the checkpoint's reward %r%s%s", in_force,
                    " with its scaler" if scaler else "",
                    f", reward model {model['model_path']}" if model else "")  # fmt: skip
        await self.switch(control, {"spec": in_force, **(scaler or {})})
        if model is not None:  # on top of the spec; scaler None keeps the statistics just restored
            swap = {"model_path": model["model_path"], "component": model.get("component")}
            await self.switch(control, swap)


async def attach_reward(
    fleet: FleetClient, config: TrainerConfig, url: str, reward: RunReward, store: OwnStore,
    start_worker: Callable[[Spec], Awaitable[None]] | None = None,
) -> RewardControl:  # fmt: skip
    """Give ``fleet`` its reward tier (the run's own, on ``url``, or ``reward.url``'s); wait for a
    shared one.

    ``store`` (the run's own) feeds a Python reward; ``start_worker`` starts the run's own reward
    worker when a run that began with a Python reward switches to a spec (None: the run starts no
    workers); ``reward`` is put in force (:meth:`RunReward.attach`)."""
    control = await RewardControl.connect(config, fleet.transport, fleet.cluster, fleet.registry, url)
    fleet.reward = control
    if control.remote:
        try:
            await control.wait_ready(config.startup_timeout_s)
        except TimeoutError as exc:
            detail = f"the shared reward server at {mask_url(config.reward.url or '')} did not answer: {exc}"
            raise TierNotReady(config.startup_timeout_s, [], detail) from None
    control.store = store
    if not control.remote:
        control.start_worker = start_worker
    await reward.attach(control)
    return control
