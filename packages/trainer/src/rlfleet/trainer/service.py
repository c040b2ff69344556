"""The trainer worker: rank 0's service, the commands it sends the other ranks, and one train step.

Rank 0 runs the :class:`TrainerWorker` and alone talks to NATS; ranks 1..W-1 run a
:class:`~rlfleet.trainer.follower.Follower`. Both start alike (:mod:`rlfleet.trainer.ranks`).
Rank 0 sends each command to the others (:mod:`rlfleet.trainer.commands`); every rank then does
its own part (a step: fetch the rollout chunks from the rollout workers' stores, merge and check
them), all ranks agree on how that went, and only then come the collectives, in one order::

    rank 0:  NATS request ──> send({"op": "step", ...}) ──> fetch, check ──> agree ──> update
    rank r:                   receive() ──────────────────> fetch, check ──> agree ──> update

When a rank's own part failed, every rank skips the command and rank 0 answers with that rank's
error; no rank exits for it. A rank that dies is reported within ``rank_silence_s``
(:mod:`rlfleet.trainer.rank_liveness`).

One train step (:func:`run_step`), as every rank runs it once the batch is merged::

    settings.update.learning_rate, weight_decay ──> the optimizers (critic: algorithm.critic_learning_rate)
    TRAINER_ALGORITHMS[settings.algorithm.name].plan(actor, critic, batch, scores, settings)
        ──> Plan: advantages and no-grad forwards done, the algorithm's losses  (algorithms/<name>.py)
    train_loop(plan) ──> metrics (+ time, throughput and the settings used)      (loop.py)

    on a GPU, the peak memory of each phase (plan, update) and of the publish before the step
    (:mod:`rlfleet.trainer.memory_phases`): memory/<phase>_peak_{allocated,reserved}_gib

Rank 0's service: ``trainer.configure`` compares the run's fixed settings (ModelSettings, device,
critic, model fingerprint) with the worker's and refuses the run, naming each field that differs
(:mod:`rlfleet.trainer.admission`). ``trainer.step`` runs one update with the settings the request
carries. Publishing stages the weights as versioned buckets for the carriers the controller asks
for: in the trainer's own TensorStore (gRPC; rollout workers pull them from there, and one that
joins late catches up on the latest version) and/or on its GPU, shared by CUDA IPC with a
colocated engine.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch
from torch import Tensor

from rlfleet.common.control.messages import (
    AnyMessage,
    CheckpointLoaded,
    LatestWeights,
    LoadCheckpoint,
    PublishWeights,
    SaveCheckpoint,
    Saved,
    TrainerConfigure,
    TrainerConfigured,
    TrainStepRequest,
    TrainStepResult,
    WeightsPublished,
)
from rlfleet.common.control.transport import subject
from rlfleet.common.control.worker import Worker
from rlfleet.common.errors import BatchContractError
from rlfleet.common.schema.algorithms import ALGORITHMS
from rlfleet.common.schema.batch import (
    VERSIONS,
    check_token_ids,
    merge_preferences,
    merge_rollouts,
    select_groups,
)
from rlfleet.common.schema.carriers import IpcBucket
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.trainer import LoraSettings, StepSettings, TrainerWorkerConfig, model_fingerprint
from rlfleet.common.tensors.store import ClientPool, TensorStoreServer, worker_store
from rlfleet.common.tensors.weight_sync import fingerprint as weights_fingerprint
from rlfleet.common.tensors.weight_sync import weight_delta
from rlfleet.trainer import checkpoint as ckpt
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.admission import conflicts
from rlfleet.trainer.algorithms import TRAINER_ALGORITHMS, overlong
from rlfleet.trainer.algorithms.grpo import group_stats
from rlfleet.trainer.commands import CommandChannel, agree
from rlfleet.trainer.critic import Critic
from rlfleet.trainer.errors import CarrierUnavailable, SettingsConflict, UnexpectedMessage
from rlfleet.trainer.idempotency import ReplyCache
from rlfleet.trainer.ipc_share import gpu_uuid, share_bucket
from rlfleet.trainer.loop import batch_sizes, train_loop
from rlfleet.trainer.memory_phases import CudaMemory, PhasePeaks
from rlfleet.trainer.rank_liveness import RankWatch
from rlfleet.trainer.ranks import build_models, use_rank_thread
from rlfleet.trainer.step_profile import DIR_ENV, maybe_profiled
from rlfleet.trainer.weights import put_version

logger = logging.getLogger(__name__)


async def fetch_batch(rank: Any, request: TrainStepRequest) -> dict[str, Tensor]:
    """A step's own part on every ``rank`` (its ``stores``, ``actor``, ``critic``): the batch, fetched
    from the rollout stores, merged and checked."""
    chunks = await asyncio.gather(*(rank.stores.fetch(ref) for ref in request.rollouts))
    if request.groups is not None:  # dynamic sampling: the groups the step keeps of each chunk
        if not ALGORITHMS[request.settings.algorithm.name].online:
            raise BatchContractError("groups", "only rollout chunks have groups to keep")
        if len(request.groups) != len(chunks):
            raise BatchContractError("groups", f"one list a rollout chunk: {len(request.groups)} lists for "
                                     f"{len(chunks)} chunks")  # fmt: skip
        chunks = [select_groups(chunk, kept) for chunk, kept in zip(chunks, request.groups, strict=True)]
    batch = merge_batch(request.settings.algorithm.name, chunks)
    check_step(rank.actor, rank.critic, batch, request.settings)
    return batch


# --- one train step, on every rank ----------------------------------------------------------------


def merge_batch(algorithm: str, chunks: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """One training batch from the fetched chunks: preference pairs for DPO, rollouts otherwise."""
    if ALGORITHMS[algorithm].online:
        return merge_rollouts(chunks)
    return merge_preferences(chunks)


def group_signal_metrics(batch: Mapping[str, Tensor], scores: Tensor) -> dict[str, float]:
    """How much of the batch carries no learning signal: groups whose rewards are all equal (their
    group-relative advantages are 0), the share of the batch's response tokens spent on them, and
    the response tokens of the others (``groups/signal_tokens``: with dynamic sampling the
    controller sets them against every token the step generated)."""
    groups = batch["group_index"].to(scores.device)
    if not groups.numel():
        return {}
    _, std, count = group_stats(scores.float(), groups)
    flat = std <= 1e-6  # per sample: its group's rewards are all equal
    tokens = batch["response_mask"].sum(dim=-1).float().to(scores.device)
    wasted = tokens[flat].sum() / tokens.sum().clamp(min=1.0)
    total, flat_groups = (1 / count).sum(), (flat / count).sum()  # each sample counts 1/its group's size
    return {"groups/total": float(total.item()), "groups/flat": float(flat_groups.item()),
            "groups/wasted_token_frac": float(wasted.item()),
            "groups/signal_tokens": float(tokens[~flat].sum().item())}  # fmt: skip


def stop_token_ids(actor: Actor) -> torch.Tensor:
    """The model's EOS ids (its config's and its generation config's): a response ending in one stopped."""
    ids: set[int] = set()
    for config in (actor.model.config, getattr(actor.model, "generation_config", None)):
        eos = getattr(config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    return torch.tensor(sorted(ids), dtype=torch.int64)


def token_version_metrics(batch: Mapping[str, Tensor], trained_at: int) -> dict[str, float]:
    """The staleness of the batch's tokens against the version it trains (``response_versions``,
    :mod:`~rlfleet.common.schema.batch`), and the share of samples whose tokens came from more than
    one version (partial rollouts); nothing when no token's version is known."""
    versions = batch.get(VERSIONS)
    if versions is None:
        return {}
    known = (versions >= 0) & (batch["response_mask"] > 0)
    if not bool(known.any()):
        return {}
    staleness = (trained_at - versions).clamp(min=0).float()
    big = torch.iinfo(torch.int64)
    newest = torch.where(known, versions, torch.full_like(versions, big.min)).amax(dim=-1)
    oldest = torch.where(known, versions, torch.full_like(versions, big.max)).amin(dim=-1)
    rows = known.any(dim=-1)
    mixed = (newest != oldest) & rows
    return {
        "rollout/token_staleness_max": float(staleness[known].max().item()),
        "rollout/token_staleness_mean": float(staleness[known].mean().item()),
        "rollout/mixed_version_frac": float(mixed.sum().item() / max(int(rows.sum().item()), 1)),
    }


def episode_metrics(batch: Mapping[str, Tensor]) -> dict[str, float]:
    """A multi-turn batch's episodes (:mod:`~rlfleet.common.schema.batch`): turns, tool calls and
    their failures per episode, seconds waiting on the environment, and the share of response tokens
    the losses leave out (observations); nothing for a single-turn batch."""
    turns = batch.get("episode_turns")
    if turns is None or not turns.numel():
        return {}
    out = {"episode/turns_mean": float(turns.float().mean().item())}
    calls, errors = batch.get("episode_tool_calls"), batch.get("episode_tool_errors")
    if calls is not None:
        out["episode/tool_calls_mean"] = float(calls.float().mean().item())
        out["episode/tool_use_frac"] = float((calls > 0).float().mean().item())
    if errors is not None:  # failed tool calls and malformed ones (a guess that is no number...)
        out["episode/tool_errors_mean"] = float(errors.float().mean().item())
    env_s = batch.get("episode_env_s")
    if env_s is not None:
        out["episode/env_s_mean"] = float(env_s.float().mean().item())
    loss_mask = batch.get("loss_mask")
    if loss_mask is not None:
        tokens = float(batch["response_mask"].sum().item())
        out["episode/masked_token_frac"] = 1.0 - float(loss_mask.sum().item()) / max(tokens, 1.0)
    return out


def check_step(actor: Actor, critic: Critic | None, batch: Mapping[str, Tensor], settings: StepSettings,
               ) -> None:  # fmt: skip
    """What a step refuses before its first collective (see :func:`run_step`'s ``Raises``)."""
    name = settings.algorithm.name
    if ALGORITHMS[name].needs_critic and critic is None:
        raise SettingsConflict(
            "this trainer", [("critic", f"{name} trains one", "holds none (start it with "
                              f"step.algorithm.name={name} so that it loads one)")],
        )  # fmt: skip
    check_token_ids(batch, actor.model.get_input_embeddings().num_embeddings)


def run_step(
    actor: Actor,
    critic: Critic | None,
    batch: Mapping[str, Tensor],
    scores: Sequence[float],
    settings: StepSettings,
) -> dict[str, float]:
    """One train step of ``settings.algorithm.name`` on ``batch`` (and the rollouts' ``scores``); its metrics.

    Raises:
        SettingsConflict: the algorithm trains a critic and this trainer holds none.
        BatchContractError: the batch breaks its contract (a token id outside the vocabulary too), or
            the scores do not match it.
    """
    algorithm = TRAINER_ALGORITHMS[settings.algorithm.name]
    check_step(actor, critic, batch, settings)  # before any collective
    t0 = time.perf_counter()
    update = settings.update
    actor.set_rates(update.learning_rate, update.weight_decay)
    if critic is not None:
        critic.set_rates(settings.algorithm.critic_learning_rate or update.learning_rate, update.weight_decay)
    peaks = memory_peaks(actor.device)
    rewards, shaped = torch.tensor(scores, dtype=torch.float32), {}
    if (update.overlong_buffer or update.mask_truncated) and ALGORITHMS[settings.algorithm.name].online:
        batch, rewards, shaped = overlong.shape(batch, rewards, update, stop_token_ids(actor))
    with _phase(peaks, "plan"):  # the no-grad forwards (old, reference logprobs; values), advantages
        plan = algorithm.plan(actor, critic, batch, rewards, settings)
    planned = time.perf_counter()
    with _phase(peaks, "update"):  # forward, backward and optimizer steps: the algorithm's losses
        metrics = train_loop(plan)
    seconds = time.perf_counter() - t0
    tokens = float(sum(batch[key].sum().item() for key in batch if key.endswith("_mask")))
    metrics.update(shaped)
    if ALGORITHMS[settings.algorithm.name].uses_groups:
        metrics.update(group_signal_metrics(batch, rewards))
    if shaped:  # the length of what was generated, filtered samples included (the losses' mask is not)
        metrics["response_length"] = float(batch["response_mask"].sum(dim=-1).float().mean().item())
    metrics["time/update_s"] = seconds
    metrics["time/plan_s"] = planned - t0  # of which the plan; the rest is the update loop
    metrics["throughput/train_tok_s"] = tokens / max(seconds, 1e-9)
    metrics["settings/clip_eps"] = update.clip_eps
    metrics["settings/micro_batch_size"] = float(batch_sizes(settings, plan.num_items)[1])
    if peaks is not None:
        metrics.update(peaks.step_metrics())
    return metrics


def memory_peaks(device: torch.device) -> PhasePeaks | None:
    """The peak memory of a step's phases on a CUDA ``device``; None on CPU, where a step measures
    nothing and calls nothing in :mod:`~rlfleet.trainer.memory_phases` (not a file of its step)."""
    return PhasePeaks(CudaMemory(device)) if device.type == "cuda" else None


def _phase(peaks: PhasePeaks | None, name: str) -> AbstractContextManager[None]:
    """``peaks.phase(name)``; nothing without ``peaks``."""
    return nullcontext() if peaks is None else peaks.phase(name)


def sync_parts(
    store: TensorStoreServer, version: int, refs: list[TensorRef], base: list[TensorRef],
    device: torch.device | None = None,
    on_device: tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]] | None = None,
) -> tuple[str, list[TensorRef]]:  # fmt: skip
    """What a publish stages beside a version's host buckets ``refs`` in ``store``: their
    fingerprint ("" with none) and, when ``base`` (the version before, still in the store) is given,
    the delta buckets (delta sync): the change from ``base``, bucket by bucket, compared on the
    trainer's ``device`` when it is a GPU (:func:`~rlfleet.common.tensors.weight_sync.weight_delta`).
    ``on_device``: the version before's buckets and this version's (those of ``refs``, bucket for
    bucket) kept on that GPU, compared there without a copy up. The fingerprint hashes the host
    buckets on a thread while the delta is found."""
    if not refs:
        return "", []
    buckets = [store.get_local(ref.key) for ref in refs]
    items = [item for bucket in buckets for item in bucket.items()]
    if not base:
        return weights_fingerprint(items), []
    gpu = device if device is not None and device.type == "cuda" else None
    if on_device is not None and len(on_device[1]) == len(buckets):  # compared where they are
        old = {name: t for bucket in on_device[0] for name, t in bucket.items()}
        buckets = on_device[1]
    else:
        old = {name: t for ref in base for name, t in store.get_local(ref.key).items()}
    deltas = []
    with ThreadPoolExecutor(1, thread_name_prefix="fingerprint") as pool:
        fingerprint = pool.submit(weights_fingerprint, items)
        for i, bucket in enumerate(buckets):
            delta = weight_delta(old, bucket, device=gpu)
            if delta:
                deltas.append(store.put_local(f"weights/v{version}/delta{i}", delta))
        return fingerprint.result(), deltas


# --- rank 0: the NATS service ---------------------------------------------------------------------

M = TypeVar("M")
T = TypeVar("T")


class TrainerWorker(Worker[TrainerWorkerConfig]):
    """Serves ``trainer.configure``, ``step``, ``publish``, ``save``, ``load`` and ``latest``."""

    tier = "trainer"

    async def setup(self) -> None:
        cfg = self.config
        use_rank_thread(asyncio.get_running_loop(), cfg.placement.device)
        self.dist, self.actor, self.critic = await asyncio.to_thread(build_models, cfg)
        self.channel = CommandChannel(self.dist)  # to trainer ranks 1..W-1 (see the module docstring)
        self._doing = ""  # the command in progress (under the lock), for a dead rank's report
        self.watch = None if not self.dist.distributed else RankWatch(
            self.dist, cfg.rank_silence_s, lambda: self._doing if self._lock.locked() else "").start(
            asyncio.get_running_loop())  # fmt: skip
        self.fingerprint = model_fingerprint(cfg.model_path)
        self.weight_version = 0
        capacity = int(cfg.weights_store_mb * 2**20)
        plane = cfg.tensor_plane
        week = 7 * 24 * 3600.0
        self.store: TensorStoreServer = await worker_store(plane, capacity_bytes=capacity, ttl_s=week)
        self.data_address = self.store.address
        self.stores = ClientPool(plane)  # the rollout workers' stores this rank fetches from
        self._published: list[TensorRef] = []
        self._published_adapter: LoraSettings | None = None  # the version published is a LoRA adapter
        self._deltas: list[TensorRef] = []  # the current version's delta from the one before (delta sync)
        self.version_fingerprint = ""  # of the current version's host buckets (weight_sync.fingerprint)
        self._shared: list[IpcBucket] = []  # the current version by CUDA IPC, when it was asked for
        self._shared_buffers: list[dict[str, torch.Tensor]] = []  # kept alive for the receivers
        self._device_version: list[dict[str, torch.Tensor]] = []  # delta sync on a GPU: the version there
        self._delta_sync = False  # a publish asked for a delta: keep each version on the GPU for the next
        self._publish_peaks: dict[str, float] = {}  # the last publish's, for the next step's metrics
        self._lock = asyncio.Lock()
        self.replies = ReplyCache()  # a retried step or publish (same job_id) gets its first reply
        handlers: list[tuple[str, type, Callable[..., Awaitable[AnyMessage]]]] = [
            ("configure", TrainerConfigure, self.configure),
            ("step", TrainStepRequest, self.step),
            ("publish", PublishWeights, self.publish),
            ("save", SaveCheckpoint, self.save),
            ("load", LoadCheckpoint, self.load),
            ("latest", LatestWeights, self.latest),
        ]
        for verb, kind, method in handlers:
            handler = _expecting(verb, kind, method)
            await self.subscribe(subject(cfg.fleet.cluster, "trainer", verb), handler, queue="trainer",
                                 max_concurrency=1)  # fmt: skip

    def announce_fields(self) -> dict[str, object]:
        device = self.actor.device
        gpus = [gpu_uuid(device)] if device.type == "cuda" else []  # rank 0's: where IPC buckets live
        return {"data_address": self.data_address, "model_id": self.config.model_path, "gpu_uuids": gpus}

    async def configure(self, request: TrainerConfigure) -> TrainerConfigured:
        """Accept the run's fixed settings when they are this worker's; else refuse, naming each field."""
        found = conflicts(request, self.config, device=self.actor.device.type, fingerprint=self.fingerprint,
                          holds_critic=self.critic is not None)  # fmt: skip
        if found:
            raise SettingsConflict(self.worker_id, found)
        return TrainerConfigured(worker_id=self.worker_id, weight_version=self.weight_version,
                                 incarnation=self.incarnation)  # fmt: skip

    def step_settings(self, request: TrainStepRequest) -> StepSettings:
        """The request's settings; the worker's own when the request carries none."""
        return request.settings if "settings" in request.model_fields_set else StepSettings.of(self.config)

    async def step(self, request: TrainStepRequest) -> TrainStepResult:
        """One update on the rollouts and scores with the step's settings; a repeated job id: its reply."""
        return await self.replies.once(request, request.job_id, lambda: self._step(request))

    async def _step(self, request: TrainStepRequest) -> TrainStepResult:
        request = request.model_copy(update={"settings": self.step_settings(request)})
        async with self._lock:
            self.busy += 1
            try:  # the other ranks fetch for themselves, and train with the same settings
                command = {"op": "step", "request": request.model_dump(mode="json")}
                what = f"fetch and check the batch of step {request.step}"
                fetched = time.perf_counter()
                batch = await self._agreed(command, what, lambda: fetch_batch(self, request))
                fetched = time.perf_counter() - fetched
                metrics = await self._ranks(asyncio.to_thread(self._update, batch, request))
                metrics["time/fetch_s"] = fetched
                metrics.update(token_version_metrics(batch, self.weight_version))
                metrics.update(episode_metrics(batch))
                metrics.update(self._publish_peaks)  # a publish answers no metrics: see memory_phases
                self._publish_peaks = {}
                self.trained_step = request.step  # heartbeats carry it: `rlfleet status` shows the run's step
            finally:
                self.busy -= 1
        return TrainStepResult(step=request.step, metrics=metrics, weight_version=self.weight_version,
                               incarnation=self.incarnation)  # fmt: skip

    def _update(self, batch: dict[str, torch.Tensor], request: TrainStepRequest) -> dict[str, float]:
        """One update with ``request.settings``; see :func:`run_step` (profiled when asked:
        :mod:`~rlfleet.trainer.step_profile`)."""
        if os.environ.get(DIR_ENV):  # else the step runs no line of step_profile.py
            with maybe_profiled(request.step, 0, self.actor.device):
                return run_step(self.actor, self.critic, batch, request.scores, request.settings)
        return run_step(self.actor, self.critic, batch, request.scores, request.settings)

    async def _agreed(self, command: dict[str, Any], what: str, part: Callable[[], Any]) -> Any:
        """Send ``command`` to ranks 1..W-1, do this rank's own ``part`` (no collective; awaited if
        it returns an awaitable), agree on how it went (:func:`~rlfleet.trainer.commands.agree`)."""
        if self.watch is not None:
            self._doing = f"{command['op']} ({what})"
            await self._ranks(asyncio.to_thread(self.channel.send, command))
        value, error = None, None
        try:  # a failure: raised on every rank (the failing rank's), before any collective
            value = part()
            value = await value if inspect.isawaitable(value) else value
        except BaseException as exc:  # a cancelled part too: the other ranks wait for this rank's word
            error = exc
        if self.watch is not None:
            await self.watch.guard(asyncio.to_thread(agree, self.channel, what, error), own=error)
        elif error is not None:
            raise error
        return value

    async def _ranks(self, work: Awaitable[T]) -> T:
        """``work`` (collectives of every rank), or ``TrainerRankDied`` when a rank dies first."""
        return await (work if self.watch is None else self.watch.guard(work))

    async def save(self, request: SaveCheckpoint) -> Saved:
        """Save an HF export (``hf``) or the full training state (``full``); every rank takes part.

        The path must lie inside ``checkpoint_root`` (:func:`~rlfleet.trainer.checkpoint.confine`).
        """
        target = ckpt.confine(self.config.checkpoint_root, request.path)  # refused before any rank acts
        async with self._lock:
            command = {"op": "save", "path": str(target), "mode": request.mode}
            what = f"save checkpoint {str(target)!r}"
            await self._agreed(command, what, lambda: ckpt.check_writable(target, request.mode))
            work = asyncio.to_thread(ckpt.save_checkpoint, target, self.actor, self.critic, request.mode)
            path = await self._ranks(work)
        return Saved(path=str(path), incarnation=self.incarnation)

    async def load(self, request: LoadCheckpoint) -> CheckpointLoaded:
        """Restore a full checkpoint on every rank; the weights are then ``request.weight_version``."""
        source = ckpt.confine(self.config.checkpoint_root, request.path)
        ckpt.check_contained(self.config.checkpoint_root, source)  # no file of it links out of the root
        async with self._lock:
            what = f"load checkpoint {str(source)!r}"
            await self._agreed({"op": "load", "path": str(source)}, what,
                               lambda: ckpt.check_loadable(source, self.critic))  # fmt: skip
            work = asyncio.to_thread(ckpt.load_checkpoint, source, self.actor, self.critic)
            steps = await self._ranks(work)
            self.weight_version = request.weight_version
        return CheckpointLoaded(path=request.path, steps=steps, weight_version=self.weight_version,
                                incarnation=self.incarnation)  # fmt: skip

    async def latest(self, request: LatestWeights) -> WeightsPublished:
        """The current version's buckets, for a rollout worker that joins late (no lock: the pair
        ``_published``/``weight_version`` is swapped without an await in between)."""
        refs, shared = list(self._published), list(self._shared)
        return WeightsPublished(weight_version=self.weight_version, buckets=refs, ipc_buckets=shared,
                                nbytes=sum(r.nbytes for r in refs) or sum(b.nbytes for b in shared),
                                seconds=0.0, incarnation=self.incarnation,
                                fingerprint=self.version_fingerprint,
                                adapter=self._published_adapter)  # fmt: skip

    async def publish(self, request: PublishWeights) -> WeightsPublished:
        """Stage the current weights as a new version, bucket by bucket, for the carriers asked for.

        ``grpc``: buckets in this worker's TensorStore. ``cuda_ipc``: buckets kept on this GPU and
        shared by IPC handle (:mod:`rlfleet.trainer.ipc_share`) until the next publish. A repeat of
        a ``job_id`` gets the first reply (no second version).
        """
        return await self.replies.once(request, request.job_id, lambda: self._publish(request))

    async def _publish(self, request: PublishWeights) -> WeightsPublished:
        lora = self.actor.settings.lora if request.adapter and self.actor.peft is not None else None
        carriers = {"grpc"} if lora is not None else set(request.carriers)  # an adapter is small: gRPC
        if "cuda_ipc" in carriers and self.actor.device.type != "cuda":
            raise CarrierUnavailable("cuda_ipc", "needs the trainer on a GPU; this trainer runs on CPU")
        async with self._lock:
            t0 = time.perf_counter()
            version = request.weight_version if request.weight_version >= 0 else self.weight_version + 1
            bucket_bytes = max(1, int(request.bucket_mb * 2**20))
            before, before_version = self._published, self.weight_version  # kept until the delta is made
            if version == before_version:  # the same version again (a restore): its keys are taken
                for old in before:
                    self.store.delete(old.key)
                before = []
            for old in self._deltas:
                self.store.delete(old.key)
            self._deltas = []
            self._shared, self._shared_buffers = [], []  # the previous version's GPU buffers go
            command = {"op": "publish", "bucket_bytes": bucket_bytes, "dtype": request.dtype,
                       "adapter": lora is not None}  # fmt: skip
            await self._agreed(command, f"publish weight version {version}", lambda: None)
            delta = request.delta and lora is None and self._published_adapter is None  # an adapter: whole
            self._delta_sync = self._delta_sync or delta  # kept on through the anchors (whole versions)
            on_gpu = self.actor.device.type == "cuda"
            keep = self._delta_sync and lora is None and on_gpu and "grpc" in carriers  # a delta goes by gRPC
            adapter = lora is not None
            refs, shared, kept = await self._ranks(asyncio.to_thread(
                self._stage, version, bucket_bytes, carriers, request.dtype, adapter, keep))  # fmt: skip
            base = before if delta and refs and before else []
            pairs = (self._device_version, kept) if base and self._device_version and kept else None
            fingerprint, deltas = await asyncio.to_thread(sync_parts, self.store, version, refs, base,
                                                          self.actor.device, pairs)  # fmt: skip
            for old in before:  # only now: a publish that failed leaves the current version servable
                self.store.delete(old.key)
            self._published, self._shared, self._deltas = refs, shared, deltas
            self._device_version = kept
            self._published_adapter = lora
            self.weight_version = version
            self.version_fingerprint = fingerprint
            seconds = time.perf_counter() - t0
        nbytes = sum(ref.nbytes for ref in refs) or sum(b.nbytes for b in shared)
        delta_nbytes = sum(ref.nbytes for ref in deltas)
        logger.info("staged weight version %d for %s: %d buckets, %.1f MB%s%s in %.3fs", version,
                    "+".join(sorted(carriers)), max(len(refs), len(shared)), nbytes / 2**20,
                    " (the LoRA adapter)" if lora is not None else "",
                    f" (a delta of {delta_nbytes / 2**20:.2f} MB)" if deltas else "", seconds)  # fmt: skip
        return WeightsPublished(weight_version=version, buckets=refs, ipc_buckets=shared, nbytes=nbytes,
                                seconds=seconds, incarnation=self.incarnation, fingerprint=fingerprint,
                                delta_buckets=deltas, delta_from=before_version if deltas else -1,
                                delta_nbytes=delta_nbytes, adapter=lora)  # fmt: skip

    def _stage(
        self, version: int, bucket_bytes: int, carriers: set[str], dtype: str, adapter: bool = False,
        keep: bool = False,
    ) -> tuple[list[TensorRef], list[IpcBucket], list[dict[str, torch.Tensor]]]:  # fmt: skip
        """The new version's buckets (:meth:`_stage_buckets`; ``adapter``: a LoRA actor's adapter
        alone); on a GPU their staging's peak memory is kept for the next step's metrics."""
        self._publish_peaks = {}
        peaks = memory_peaks(self.actor.device)
        with _phase(peaks, "publish"):
            staged = self._stage_buckets(version, bucket_bytes, carriers, dtype, adapter, keep)
        self._publish_peaks = {} if peaks is None else peaks.metrics
        return staged

    def _stage_buckets(
        self, version: int, bucket_bytes: int, carriers: set[str], dtype: str, adapter: bool, keep: bool
    ) -> tuple[list[TensorRef], list[IpcBucket], list[dict[str, torch.Tensor]]]:
        """The store's buckets, the IPC buckets and, with ``keep`` (delta sync on a GPU), the version's
        buckets on the GPU, which the next publish compares with there (one bf16 copy of the weights
        on the card while delta sync is on; :func:`sync_parts`)."""
        publish_dtype = getattr(torch, dtype) if dtype else None
        if adapter:
            buckets = self.actor.iter_weight_buckets(bucket_bytes, dtype=publish_dtype, adapter=True)
            return put_version(self.store, version, buckets), [], []
        if "cuda_ipc" in carriers or keep:  # every bucket stays on the GPU: shared, or kept for a delta
            on_gpu = list(self.actor.iter_weight_buckets(bucket_bytes, dtype=publish_dtype, on_device=True))
            shared: list[IpcBucket] = []
            if "cuda_ipc" in carriers:
                shared = [share_bucket(bucket) for bucket in on_gpu]
                self._shared_buffers = on_gpu
            refs = put_version(self.store, version, on_gpu) if "grpc" in carriers else []
            return refs, shared, on_gpu if keep else []
        pinned = self.actor.device.type == "cuda"  # page-locked: device-to-host copies at full speed
        buckets = self.actor.iter_weight_buckets(bucket_bytes, dtype=publish_dtype, pin_memory=pinned)
        return put_version(self.store, version, buckets), [], []

    async def teardown(self) -> None:
        if self.watch is not None:
            self.watch.stop()  # the followers' silence is expected from now on
        await self._stop_followers()
        await self.stores.close()
        await self.store.stop()

    async def _stop_followers(self) -> None:
        """Tell ranks 1..W-1 to exit; they may be gone already (stopped by the launcher)."""
        if not self.dist.distributed:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self.channel.send, {"op": "stop"}), timeout=10)
        except (RuntimeError, TimeoutError) as exc:
            logger.warning("could not tell the other trainer ranks to stop: %s", exc)


def _expecting(
    verb: str, kind: type[M], method: Callable[[M], Awaitable[AnyMessage]]
) -> Callable[[AnyMessage], Awaitable[AnyMessage]]:
    """The handler of ``trainer.<verb>``: ``method`` for messages of ``kind``, a refusal for others."""

    async def handle(message: AnyMessage) -> AnyMessage:
        if not isinstance(message, kind):
            raise UnexpectedMessage(f"trainer.{verb}", kind.__name__, message.kind)
        return await method(message)

    return handle
