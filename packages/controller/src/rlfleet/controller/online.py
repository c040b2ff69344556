"""Online RL (GRPO, RLOO, REINFORCE++, PPO): the step program, its KL controllers, and its trainer handle.

One step, as the controller runs it (the controller moves refs, never tensors)::

    prompts ──► fleet.generate ─┬─► chunk 0 ref ──► fleet.score ──► scores ─┐  each chunk is scored as
                 (every pool)   ├─► chunk 1 ref ──► fleet.score ──► scores ─┤  soon as it arrives, while
                                └─► ...                                     │  the others still generate
        every chunk's ref, in prompt order ──► fleet.train_step ◄───────────┘ ──► metrics
    rollout workers ◄── fleet.load_weights ◄── fleet.publish_weights (version + 1)

Generation and scoring overlap: a chunk is handed to the reward tier as soon as its rollout worker
returns it (:class:`~rlfleet.controller.lost_chunks.StepChunks`, told by ``fleet.generate``'s
``on_chunk``), so the reward tier works while generation goes on, and a GRPO group (one prompt's
samples, always in one chunk) is scored as soon as its chunk is. What the trainer receives does not
depend on it: the chunks are placed in prompt order once all are generated, so the same seed gives
the same batch, scores and update as scoring after generation did (a reward endpoint with a
normalizing scaler is the exception: its running statistics take the chunks in the order the reward
tier scores them, which no step fixed before either, its chunks being scored at once). The step's
times: ``time/generate_s`` is generation's wall time; ``time/score_s`` the scoring left after the
last chunk arrived (the tail the step waits for, regenerated chunks included);
``time/score_overlap_s`` the part of generation during which at least one chunk was being scored.

Rollout and training overlap with ``max_staleness: k`` (:mod:`rlfleet.controller.rollout_ahead`):
the step begins the rollouts (generation and scoring, as above) of the run's next ``k`` batches
before it trains its own, which was begun by an earlier step; ``time/rollout_wait_s`` is what the
trainer waited for it, ``time/generate_s`` its generation's wall time (begun a step or more
before), and ``rollout/staleness_*`` how many versions older than the trained weights its samples'
weights were. ``k = 0`` is the synchronous step: its own rollout, then train, then publish.

With ``dynamic_sampling.enabled`` (:mod:`rlfleet.controller.dynamic_sampling`) a step whose
scored batch holds fewer groups with a learning signal than ``rollout_batch_size`` takes the run's
next batch too (from the stream when pipelined), up to ``max_batches`` in all, and trains on the
first ``rollout_batch_size`` groups with a signal; the trainer gets each chunk's kept groups.

``fleet.train_step`` carries the step's settings (``StepSettings``: the algorithm, its settings,
the KL controller's current coefficient); the algorithms differ only in what the trainer does
with them (advantages, critic, where the KL goes). After the step the KL controller is fed the KL
the trainer measured. :class:`OnlineStep` receives the ports it uses: the run's state, its own
store, its KL controller, and (each step) the fleet client.

The KL-to-reference term enters either the reward (``kl_mode: reward``: ``r_t -= coef * kl_t``, PPO
as in OpenRLHF/verl) or the loss (``kl_mode: loss``: ``+ coef * kl``, GRPO). Its coefficient comes
from a controller, built from the config's ``kl`` section (a tagged union:
:class:`~rlfleet.controller.config.FixedKL`, :class:`~rlfleet.controller.config.AdaptiveKL`,
:class:`~rlfleet.controller.config.ScheduledKL`) and the start value ``update.kl_coef``
(:func:`build_kl_controller`; the registry :data:`KL_CONTROLLERS` is keyed by the section's ``type``):

- :class:`FixedKLController`: a constant;
- :class:`AdaptiveKLController`: Ziegler et al. (2019), moves the coefficient so the measured KL
  approaches ``target``: ``err = clip(kl / target - 1, -0.2, 0.2)``,
  ``coef *= 1 + err * n_steps / horizon``;
- :class:`ScheduledKLController`: linear or cosine from ``start`` to ``end`` over ``total_steps``.

Every controller has ``.value`` (settable between steps, as ``trainer.kl_coef = x``),
``.update(current_kl, n_steps)`` once per step, and ``state_dict()`` / ``load_state_dict()`` that
round-trip exactly (plain Python numbers, JSON-safe) for resume. ``n_steps`` is whatever unit the
caller counts in (verl and OpenRLHF pass the number of samples of the step); ``horizon`` and
``total_steps`` are in that same unit. The run holds the controller
(:class:`~rlfleet.controller.ports.KLController`); every step sends the trainer its current value
and :func:`advance_kl_controller` feeds it the KL the trainer measured.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlfleet.common.control.messages import (
    GenerateResult,
    RewardStats,
    SamplingParams,
    ScoreResult,
    WeightsLoaded,
    WeightsPublished,
)
from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.trainer import StepSettings
from rlfleet.common.tensors.weight_sync import verifiable
from rlfleet.controller.agent_rollout import AgentFn, AgentRollout
from rlfleet.controller.config import (
    AdaptiveKL,
    FixedKL,
    KLControl,
    KLSchedule,
    ScheduledKL,
    TrainerConfig,
    check_kl_start,
)
from rlfleet.controller.dataset import PromptDataset, PromptItem, chat_prompts, prompt_dataset
from rlfleet.controller.dynamic_sampling import GroupChoice, choose_groups, count_signal, wasted_token_frac
from rlfleet.controller.fleet import publish
from rlfleet.controller.lost_chunks import StepChunks
from rlfleet.controller.lr_schedule import LearningRates
from rlfleet.controller.own_store import OwnStore
from rlfleet.controller.ports import FleetClient, KLController, RunState
from rlfleet.controller.python_reward import reward_of
from rlfleet.controller.reward_control import RewardControl, describe_reward_fn, model_swap
from rlfleet.controller.rollout_ahead import Rollout, RolloutAhead
from rlfleet.controller.routing import RolloutFn, RolloutRouter, RoutedRollout, RouteSummary, chunk_metadata
from rlfleet.controller.run import FleetRun
from rlfleet.controller.run_reward import RunReward
from rlfleet.controller.trainer_base import TrainerBase
from rlfleet.controller.user_code import import_user_function

logger = logging.getLogger(__name__)


# --- the step program -----------------------------------------------------------------------------


class OnlineStep:
    """The step program of online RL: at ``state``'s step and weights, with the coefficient of
    ``kl_controller``; ``router`` sends each prompt to its rollout pool, ``store`` (the controller's
    own) releases what the step consumed."""

    def __init__(
        self, state: RunState, store: OwnStore, kl_controller: KLController, router: RolloutRouter,
        rates: LearningRates | None = None,
    ) -> None:  # fmt: skip
        self.state = state
        self.store = store
        self.kl_controller = kl_controller
        self.router = router
        self.rates = rates or LearningRates(state.config)  # each step's learning rate (lr_schedule)
        self.last_routes: dict[str, RouteSummary] = {}
        self.last_rollout: RoutedRollout | None = None  # the last step's prompts and the chunks it trained on
        self.ahead = RolloutAhead()  # batches generating while this one trains (max_staleness)
        self.extra_batches = 0  # the run's next batches the last step used (dynamic sampling)

    def sampling(self, offset: int = 0) -> SamplingParams:
        """How a step samples: ``group_size`` samples a prompt, seeded by the step (``offset``: the
        step that many ahead, whose batch a pipelined run generates now)."""
        cfg = self.state.config
        return SamplingParams(n=cfg.batch.group_size, temperature=cfg.update.temperature,
                              top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                              max_tokens=cfg.max_response_length,
                              seed=cfg.placement.seed + self.state.global_step + offset)  # fmt: skip

    async def rollout(self, batch: list[PromptItem], fleet: FleetClient, offset: int = 0) -> Rollout:
        """Generate ``batch`` (the batch ``offset`` steps ahead) at the weights the workers hold now,
        each chunk scored as it arrives, and score what is left: the step's :class:`Rollout`."""
        state, cfg = self.state, self.state.config
        chunks = StepChunks(fleet, [], [], cfg.reward.endpoint)  # scores each chunk as it arrives
        t0 = time.perf_counter()
        try:
            routed = await self.router.generate(fleet, batch, self.sampling(offset), state.weight_version,
                                                on_chunk=chunks.arrived)  # fmt: skip
            t1 = time.perf_counter()  # a chunk lost with its worker is generated again (lost_chunks.py)
            chunks.place(routed.results, chunk_metadata(routed.items, routed.results))
            await chunks.score()
        except BaseException:
            await chunks.abandon()
            raise
        return Rollout(routed, chunks, t0, t1, time.perf_counter(), chunks.overlap(t0, t1), offset)

    @property
    def spare_batches(self) -> int:
        """The run's next batches a step may generate besides its own (dynamic sampling's budget)."""
        sampling = self.state.config.dynamic_sampling
        return sampling.max_batches - 1 if sampling.enabled else 0

    async def _begin_ahead(
        self, upcoming: Sequence[list[PromptItem]], used: int, window: int, fleet: FleetClient
    ) -> None:
        """Keep the ``window`` batches after the ``used`` first of ``upcoming`` in flight (each seeded
        by its place in ``upcoming``)."""
        ahead = list(upcoming[used : used + window])
        await self.ahead.extend(ahead, lambda offset: self.rollout(ahead[offset - 1], fleet, used + offset))

    async def _more(
        self, first: Rollout, upcoming: Sequence[list[PromptItem]], window: int, fleet: FleetClient
    ) -> list[Rollout]:
        """Dynamic sampling: the next batches of ``upcoming`` (in flight already when the run is
        pipelined), taken one at a time while the step has fewer groups with a signal than its
        batch size and budget is left."""
        cfg = self.state.config
        more: list[Rollout] = []
        while len(more) < self.spare_batches and self.extra_batches < len(upcoming):
            done = [first, *more]
            results = [r for rollout in done for r in rollout.chunks.results]
            scored = [s for rollout in done for s in rollout.chunks.scored if s is not None]
            if count_signal(results, scored, cfg.dynamic_sampling.min_std) >= cfg.batch.rollout_batch_size:
                break
            taken = upcoming[self.extra_batches]
            self.extra_batches += 1
            task = await self.ahead.take(taken)
            if task is None:
                task = asyncio.ensure_future(self.rollout(taken, fleet, self.extra_batches))
            await self._begin_ahead(upcoming, self.extra_batches, window, fleet)
            more.append(await task)
        return more

    async def step(
        self, batch: list[PromptItem], fleet: FleetClient, upcoming: Sequence[list[PromptItem]] = ()
    ) -> dict[str, float]:
        """One step on ``batch``; with ``max_staleness: k``, the first ``k`` of ``upcoming`` (the
        run's next batches) are begun too, to generate while this one trains (rollout_ahead.py); with
        dynamic sampling, ``upcoming`` holds ``spare_batches`` more, and the step takes those it
        needs from its front (dynamic_sampling.py), keeping ``k`` in flight after them."""
        state, cfg = self.state, self.state.config
        t0 = time.perf_counter()
        self.extra_batches = 0
        window = max(0, min(cfg.max_staleness, len(upcoming) - self.spare_batches))
        task = await self.ahead.take(batch)
        if task is None:
            task = asyncio.ensure_future(self.rollout(batch, fleet))
        await self._begin_ahead(upcoming, 0, window, fleet)
        rollout = await task
        rollouts = [rollout]
        if cfg.dynamic_sampling.enabled:
            rollouts += await self._more(rollout, upcoming, window, fleet)
        routed, chunks = rollout.routed, rollout.chunks
        own = len(chunks.results)
        for extra in rollouts[1:]:
            chunks.extend(extra.chunks)
            routed.items = [*routed.items, *extra.routed.items]
        self.last_routes = routed.routes  # the step's own batch's
        t2 = time.perf_counter()  # the trainer waited for its batch until now
        shaping = cfg.update.overlong_buffer or cfg.update.mask_truncated  # trainer/algorithms/overlong.py
        cap = {"response_cap": cfg.max_response_length} if shaping else {}  # else an older trainer's default
        settings = StepSettings.of(cfg, kl_coef=self.kl_controller.value,
                                   learning_rate=self.rates.at(state.global_step), **cap)  # fmt: skip
        trained_at = state.weight_version
        chosen: list[GroupChoice] = []

        def choose(scored: Sequence[ScoreResult]) -> list[list[int]]:
            sampling = cfg.dynamic_sampling
            chosen[:] = [choose_groups(chunks.results, scored, cfg.batch.rollout_batch_size,
                                       sampling.min_std, own)]  # fmt: skip
            return chosen[0].groups

        stepped = await chunks.train(state.global_step + 1, settings,
                                     choose if cfg.dynamic_sampling.enabled else None)  # fmt: skip
        results = routed.results = chunks.results  # what was generated: every prompt once
        scored = [s for s in chunks.scored if s is not None]
        scores = [s for result in scored for s in result.scores]
        self.last_rollout = routed
        t3 = time.perf_counter()
        published, loaded = await publish(fleet, state)
        t4 = time.perf_counter()
        await self.store.release(results)
        chunks.forget()
        metrics = dict(stepped.metrics)
        metrics.update(reward_metrics(scores, scored))
        metrics.update(routed.metrics())
        metrics.update({"rollout/prompts": float(sum(r.num_prompts for r in results)),
                        "rollout/samples": float(len(scores)),
                        "rollout/chunks_regenerated": float(chunks.regenerated)})  # fmt: skip
        metrics.update(publish_metrics(published, loaded))
        metrics.update(staleness_metrics(results, trained_at, cfg.max_staleness, len(self.ahead)))
        if chosen:
            metrics.update(chosen[0].metrics(len(rollouts)))
            if "groups/signal_tokens" in metrics:  # a trainer of wire 2.7 or later counts them
                signal = metrics["groups/signal_tokens"]
                metrics["groups/wasted_token_frac"] = wasted_token_frac(signal, results)
        gen_s = sum(r.generated - r.started for r in rollouts)
        generated = sum(r.num_tokens for r in results if r.worker_id != "controller")  # not fn-written
        metrics.update({
            "kl_coef": float(settings.update.kl_coef),  # this step's; the controller moves on below
            "time/generate_s": gen_s, "time/score_s": rollout.scored - rollout.generated,
            "time/rollout_wait_s": t2 - t0, "time/train_s": t3 - t2,
            "time/score_overlap_s": rollout.overlap, "time/publish_s": t4 - t3, "time/step_s": t4 - t0,
            "throughput/gen_tok_s": generated / max(gen_s, 1e-9),
        })  # fmt: skip
        advance_kl_controller(self.kl_controller, metrics, len(scores))
        return metrics


def staleness_metrics(
    results: Sequence[GenerateResult], trained_at: int, bound: int, in_flight: int
) -> dict[str, float]:
    """How old the weights a step's samples were generated with are, against those it trained at
    (``trained_at``): per sample, ``trained_at - version``; ``rollout/staleness_over_bound`` counts
    samples past ``max_staleness`` (``bound``; never, by construction: a test holds it to zero)."""
    versions = [r.weight_version for r in results for _ in range(r.num_samples)]
    stale = [trained_at - v for v in versions] or [0]
    over = sum(s > bound for s in stale)
    if over:
        logger.error("%d samples were generated %d versions before the weights they trained at "
                     "(max_staleness %d)", over, max(stale), bound)  # fmt: skip
    return {
        "train/weight_version": float(trained_at),
        "rollout/weight_version_oldest": float(min(versions, default=trained_at)),
        "rollout/staleness_mean": statistics.fmean(stale), "rollout/staleness_max": float(max(stale)),
        "rollout/staleness_min": float(min(stale)), "rollout/staleness_over_bound": float(over),
        "rollout/batches_ahead": float(in_flight),
    }  # fmt: skip


def reward_metrics(scores: list[float], scored: list[ScoreResult]) -> dict[str, float]:
    """Mean, spread and range of a step's scores, and the mean of each reward component."""
    metrics = {
        "reward/mean": statistics.fmean(scores),
        "reward/std": statistics.pstdev(scores) if len(scores) > 1 else 0.0,
        "reward/max": max(scores),
        "reward/min": min(scores),
    }
    names = {name for result in scored for name in result.components}
    for name in sorted(names):
        values = [v for result in scored for v in result.components.get(name, [])]
        if values:
            metrics[f"reward/{name}"] = statistics.fmean(values)
    return metrics


def publish_metrics(published: WeightsPublished, loaded: list[WeightsLoaded]) -> dict[str, float]:
    """What a step's weight publish moved, how fast, and the version every rollout worker holds; how
    many workers took it as a delta, and how many were verified (their fingerprint matched)."""
    mb = published.nbytes / 2**20
    return {
        "weight_version": float(published.weight_version),
        "rollout/weight_version_min": float(min(r.weight_version for r in loaded)),
        "rollout/load_s_max": max(r.seconds for r in loaded),
        "publish/ipc_workers": float(sum(r.carrier == "cuda_ipc" for r in loaded)),
        "publish/mb": mb,
        "publish/trainer_s": published.seconds,
        "publish/mb_s": mb / max(published.seconds, 1e-9),
        "publish/delta_mb": published.delta_nbytes / 2**20,  # 0: no delta staged (delta sync off, an anchor)
        "publish/delta_workers": float(sum(r.delta for r in loaded)),
        "publish/verified_workers": float(
            sum(verifiable(r.fingerprint, published.fingerprint) for r in loaded)
        ),
        "publish/adapter": float(published.adapter is not None),  # 1: a LoRA run's adapter alone
    }


# --- KL coefficient controllers -------------------------------------------------------------------

ADAPTIVE_ERROR_CLIP = 0.2
"""Bound on the proportional error of the adaptive controller (Ziegler et al.)."""


def _check_kind(state: dict[str, Any], kind: str, keys: tuple[str, ...]) -> None:
    """Raise ConfigError when a saved state is of another controller kind or lacks a key (a saved
    ``kind`` is the ``kl.type`` that built it: ``fixed``, ``adaptive`` or ``scheduled``)."""
    saved = state.get("kind")
    if saved != kind:
        raise ConfigError(
            "kl.type", kind, f"the checkpoint holds a {saved!r} KL controller but the config builds {kind!r}"
        )
    missing = [k for k in keys if k not in state]
    if missing:
        raise ConfigError("kl.type", sorted(state), f"saved {kind} controller state lacks {missing}")


class FixedKLController:
    """A constant coefficient; ``update`` does nothing."""

    kind = "fixed"

    def __init__(self, coef: float) -> None:
        self.value = float(coef)

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind, ("value",))
        self.value = float(state["value"])

    @classmethod
    def from_settings(cls, settings: KLControl, coef: float) -> FixedKLController:
        assert isinstance(settings, FixedKL)
        return cls(coef)


class AdaptiveKLController:
    """Ziegler et al.'s proportional controller towards a target KL."""

    kind = "adaptive"

    def __init__(self, init_coef: float, target: float, horizon: int) -> None:
        if target <= 0.0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0; got {target} and {horizon}")
        self.value = float(init_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        """``coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon``."""
        error = min(max(float(current_kl) / self.target - 1.0, -ADAPTIVE_ERROR_CLIP), ADAPTIVE_ERROR_CLIP)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind, ("value", "target", "horizon"))
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])

    @classmethod
    def from_settings(cls, settings: KLControl, coef: float) -> AdaptiveKLController:
        assert isinstance(settings, AdaptiveKL)
        return cls(coef, settings.target, settings.horizon)


class ScheduledKLController:
    """A coefficient that follows a linear or cosine schedule from ``start`` to ``end``.

    Setting ``value`` by hand pins it: the schedule stops and the set value holds (and is saved)
    from then on.
    """

    kind = "scheduled"

    def __init__(self, start: float, end: float, total_steps: int, schedule: KLSchedule = "linear") -> None:
        if total_steps <= 0:
            raise ValueError(f"scheduled KL needs total_steps > 0; got {total_steps}")
        if schedule not in ("linear", "cosine"):
            raise ValueError(f"schedule must be 'linear' or 'cosine'; got {schedule!r}")
        self.start, self.end = float(start), float(end)
        self.total_steps = int(total_steps)
        self.schedule: KLSchedule = schedule
        self.step = 0
        self.pinned: float | None = None

    @property
    def value(self) -> float:
        """The coefficient at the current step (or the pinned value)."""
        if self.pinned is not None:
            return self.pinned
        frac = min(self.step / self.total_steps, 1.0)
        if self.schedule == "linear":
            return self.start + (self.end - self.start) * frac
        return self.end + (self.start - self.end) * 0.5 * (1.0 + math.cos(math.pi * frac))

    @value.setter
    def value(self, coef: float) -> None:
        self.pinned = float(coef)

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        """Advance the schedule by ``n_steps``; the measured KL is not used."""
        self.step += int(n_steps)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "start": self.start,
            "end": self.end,
            "total_steps": self.total_steps,
            "schedule": self.schedule,
            "step": self.step,
            "pinned": self.pinned,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(state, self.kind, ("start", "end", "total_steps", "schedule", "step", "pinned"))
        self.start, self.end = float(state["start"]), float(state["end"])
        self.total_steps = int(state["total_steps"])
        self.schedule = state["schedule"]
        self.step = int(state["step"])
        self.pinned = None if state["pinned"] is None else float(state["pinned"])

    @classmethod
    def from_settings(cls, settings: KLControl, coef: float) -> ScheduledKLController:
        assert isinstance(settings, ScheduledKL)
        return cls(coef, settings.end_coef, settings.total_steps, settings.schedule)


AnyKLController = FixedKLController | AdaptiveKLController | ScheduledKLController

KL_CONTROLLERS: dict[str, type[AnyKLController]] = {
    "fixed": FixedKLController,
    "adaptive": AdaptiveKLController,
    "scheduled": ScheduledKLController,
}
"""The ``kl`` section's ``type`` -> its controller's class (``from_settings(kl, coef)`` builds one);
the same names are the ``kind`` of a controller's saved state."""


def build_kl_controller(kl: KLControl, coef: float) -> AnyKLController:
    """The controller the ``kl`` section names, starting at ``coef`` (the config's ``update.kl_coef``)."""
    check_kl_start(kl, coef)
    return KL_CONTROLLERS[kl.type].from_settings(kl, coef)


def advance_kl_controller(controller: KLController, metrics: dict[str, float], num_samples: int) -> None:
    """Feed a step's measured KL (``metrics["kl"]``) to the controller, counting ``num_samples``.

    A step that measured no KL (no reference model) leaves an adaptive controller where it is;
    a scheduled one advances all the same.
    """
    kl = metrics.get("kl")
    if kl is not None and not math.isfinite(kl):  # a skipped update's NaN KL must not poison the coefficient
        kl = None
    if kl is None and controller.kind == "adaptive":
        return
    controller.update(float(kl or 0.0), n_steps=num_samples)


# --- the trainer handle: GRPOTrainer's and PPOTrainer's base --------------------------------------


class OnlineTrainer(TrainerBase):
    """Base of ``GRPOTrainer`` and ``PPOTrainer``: a run with rollout and reward tiers, its reward
    switched between steps and its prompts routed to rollout pools."""

    def __init__(
        self, actor_model_name: str, reward: Any, dataset: PromptDataset | str | Path,
        config: TrainerConfig, critic_model_name: str | None = None,
    ) -> None:  # fmt: skip
        dataset = prompt_dataset(dataset, config.max_prompt_length, config.placement.seed)  # or in memory
        kl_controller = build_kl_controller(config.kl, config.update.kl_coef)
        fleet_run = FleetRun(
            actor_model_name, dataset, config, kl_controller=kl_controller, reward=reward,
            critic_model_name=critic_model_name,
        )  # fmt: skip
        router = RolloutRouter(fleet_run.tokenizer, config.max_response_length, fleet_run.store.get,
                               list(config.rollout.pools))  # fmt: skip
        router.episode = config.environment if config.environment.enabled else None
        router.max_turn_tokens = config.max_response_length
        if config.agent.enabled:
            router.agent = AgentRollout(import_user_function(config.agent.function, "agent.function",
                                                             config.python_path), config.agent)  # fmt: skip
        rates = LearningRates(config)
        self.online_step = OnlineStep(fleet_run.state, fleet_run.store, fleet_run.kl_controller, router,
                                      rates)  # fmt: skip
        super().__init__(fleet_run, self.online_step, rates)
        eval_items = fleet_run.evals.table.items if fleet_run.evals is not None else []
        self.chats = chat_prompts([*fleet_run.dataset, *eval_items], fleet_run.tokenizer)
        """The run's chat prompts by their decoded text: TRL-form rewards get them as messages."""
        if fleet_run.reward is not None and fleet_run.reward.python is not None:
            fleet_run.reward.python.chats = self.chats

    @property
    def last_routes(self) -> dict[str, RouteSummary]:
        """Where the last step's prompts went: route (pool, ``any`` or ``text``) -> rows and workers."""
        return self.online_step.last_routes

    @property
    def reward_spec(self) -> str | dict[str, Any] | None:
        """The reward spec in force (``set_reward_fn`` switches it; a Python reward: its name)."""
        assert self.fleet_run.reward is not None
        return self.fleet_run.reward.spec

    def set_agent(self, agent: AgentFn | None) -> None:
        """Run every rollout of the next steps as an episode of ``agent(base_url, api_key, session_id,
        item) -> reward`` (sync or async) against the rollout workers' OpenAI-compatible endpoint,
        with the ``agent`` section's limits (:mod:`rlfleet.controller.agent_rollout`); the trainer
        trains on exactly the tokens the endpoint recorded. ``None``: the rollout workers generate."""
        settings = self.fleet_run.state.config.agent
        self.online_step.router.agent = AgentRollout(agent, settings) if agent is not None else None

    def set_rollout_fn(self, fn: RolloutFn | None) -> None:
        """Route each prompt of the next steps: ``fn(item)`` sees a :class:`PromptItem` and returns the
        name of the rollout pool that serves it (``TrainerConfig.rollout.pools``, or a joined worker's
        ``--pool``), ``None`` for any pool, or the response text itself (one ``str`` for every sample,
        or a list of ``group_size``). ``None`` instead of a fn restores the default: every pool serves
        every prompt. See :mod:`rlfleet.controller.routing`.
        """
        if fn is not None and not callable(fn):
            raise TypeError(
                f"set_rollout_fn takes a function of a PromptItem (or None), got {type(fn).__name__}"
            )
        self.online_step.router.fn = fn

    def scale_rollout(self, pool: str, n: int) -> list[str]:
        """Make rollout pool ``pool`` ``n`` workers between steps (see rollout_scaling.py)."""
        return self.fleet_run.scale_rollout(pool, n)

    def set_reward_fn(self, fn: Any) -> str:
        """Switch the reward for the next steps (progressive rewards); returns the new reward version.

        ``fn``: a spec (str or dict), a ``package.module:function`` name, a ``CompositeReward`` /
        ``RewardScaler`` built from a spec (or its ``compute_reward``): served by the reward workers;
        any Python callable (``lambda text: ...``, ``fn(prompt, response, **metadata)``, TRL's batched
        form): called by the controller itself (python_reward.py), never on a shared server (reward.url);
        a list of them (weight 1 each), as TRL's reward_funcs."""
        wire = describe_reward_fn(reward_of(fn))
        if "python" in wire:
            wire["python"].chats = self.chats
        return self._switch(wire)

    def update_reward_model(self, new_rm: Any, *, component: str | None = None, wait: bool = True) -> Any:
        """Hot-swap the reward model: the reward tier loads it in the background, the old one keeps
        serving until the switch, and scores name the version that made them (``reward/spec_revision``).

        ``new_rm``: a reward model directory (the endpoint's ``rm`` component, or the one labelled
        ``component``, is pointed at it; the rest of the spec stays) or anything :meth:`set_reward_fn`
        takes. ``wait=True`` returns the new version once switched; ``wait=False`` returns at once with
        an ``asyncio.Task`` (of the ``RewardSpecSet`` reply) that completes while later steps run.
        """
        wire = model_swap(new_rm, component)
        if wait:
            return self._switch(wire)
        reward, control = self._reward()
        return self.fleet_run.loop.create_task(reward.switch(control, wire), name="reward-model-swap")

    def _switch(self, wire: dict[str, Any]) -> str:
        reward, control = self._reward()
        return self.run(reward.switch(control, wire)).spec_version

    def reward_stats(self) -> RewardStats:
        """This run's view of its reward endpoint (``RewardStats``: version, counts, scaler state)."""
        reward, control = self._reward()
        return self.run(reward.stats(control))

    def _reward(self) -> tuple[RunReward, RewardControl]:
        """The run's reward and the reward tier it is in force on."""
        reward, control = self.fleet_run.reward, self.fleet.reward
        assert reward is not None and control is not None, (
            "an online run attaches its reward tier when it starts"
        )
        return reward, control
