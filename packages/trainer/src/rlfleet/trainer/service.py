"""The trainer tier's worker: policy updates on rollout refs, weight publishing, checkpoints.

A train step pulls its rollout chunks straight from the rollout workers' stores, turns the
reward tier's scores into advantages, and runs one update. Publishing stages the weights as
versioned buckets for the carriers the controller asks for: in the trainer's own TensorStore
(gRPC; rollout workers pull them from there, and one that joins late catches up on the latest
version) and/or on its GPU, shared by CUDA IPC with a colocated engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

import torch
from pydantic import Field

from rlfleet.common.carriers import IpcBucket
from rlfleet.common.messages import (
    AnyMessage,
    CheckpointLoaded,
    LatestWeights,
    LoadCheckpoint,
    PublishWeights,
    SaveCheckpoint,
    Saved,
    TrainStepRequest,
    TrainStepResult,
    WeightsPublished,
)
from rlfleet.common.refs import TensorRef
from rlfleet.common.service import ServiceConfig, Worker
from rlfleet.common.subjects import subject
from rlfleet.common.tensor_store import TensorStoreClient, TensorStoreServer
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algo_config import AlgorithmSettings
from rlfleet.trainer.algorithms import ALGORITHMS, AlgorithmName
from rlfleet.trainer.checkpoint import load_checkpoint, save_checkpoint
from rlfleet.trainer.config import ActorConfig, OptimizerConfig
from rlfleet.trainer.critic import Critic
from rlfleet.trainer.distributed import DistContext, Sharding, init_distributed
from rlfleet.trainer.ipc_share import gpu_uuid, share_bucket
from rlfleet.trainer.ranks import CommandChannel, use_rank_thread
from rlfleet.trainer.updates import build_critic, merge_batch, run_update
from rlfleet.trainer.weights import to_host

logger = logging.getLogger(__name__)


class TrainerServiceConfig(ServiceConfig):
    """Settings of a trainer worker (the controller writes them from its TrainerConfig)."""

    model_path: str = Field(description="local HF model directory of the actor")
    algorithm: AlgorithmName = Field(default="grpo", description="ppo | grpo | rloo | reinforce_pp | dpo")
    algo: AlgorithmSettings = Field(
        default_factory=AlgorithmSettings, description="KL placement, PPO (GAE, critic) and DPO settings"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: CUDA when available")
    dtype: Literal["float32", "bfloat16"] = Field(default="float32", description="parameter dtype")
    mixed_precision: Literal["auto", "none", "bf16"] = Field(
        default="auto", description="bf16 autocast with fp32 master weights; auto: bf16 on GPU, none on CPU"
    )
    trainable_layers: int | None = Field(default=None, ge=1, description="train only the top N blocks")
    sharding: Sharding = Field(
        default="auto",
        description="with several ranks: auto | full | hybrid | none (rlfleet.trainer.distributed)",
    )
    gradient_checkpointing: bool = Field(default=False, description="recompute activations in backward")
    threads: int = Field(default=0, ge=0, description="torch CPU threads; 0 keeps torch's default")
    learning_rate: float = Field(default=1e-6, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    micro_batch_size: int = Field(default=8, ge=1)
    max_grad_norm: float = Field(default=1.0, gt=0)
    clip_eps: float = Field(default=0.2, gt=0)
    kl_coef: float = Field(default=0.0, ge=0)
    entropy_coef: float = Field(default=0.0)
    loss_agg: str = Field(default="token-mean")
    ppo_epochs: int = Field(default=1, ge=1)
    temperature: float = Field(default=1.0, gt=0)
    seed: int = Field(default=0)
    store_capacity_mb: float = Field(
        default=16384, gt=0, description="TensorStore capacity for weight buckets"
    )


def actor_config(cfg: TrainerServiceConfig, device: str) -> ActorConfig:
    """The actor's settings from the worker's (``device``: this rank's, e.g. ``cuda:1``)."""
    on_gpu = device.startswith("cuda")
    return ActorConfig(
        model_path=cfg.model_path, dtype=cfg.dtype, device=device, temperature=cfg.temperature, seed=cfg.seed,
        use_reference=ALGORITHMS[cfg.algorithm].uses_reference(cfg.kl_coef),
        trainable_layers=cfg.trainable_layers, sharding=cfg.sharding,
        gradient_checkpointing=cfg.gradient_checkpointing,
        mixed_precision=(("bf16" if on_gpu else "none") if cfg.mixed_precision == "auto"
                         else cfg.mixed_precision),
        optim=OptimizerConfig(lr=cfg.learning_rate, weight_decay=cfg.weight_decay),
    )  # fmt: skip


def build_models(cfg: TrainerServiceConfig) -> tuple[DistContext, Actor, Critic | None]:
    """Join the trainer ranks (torchrun environment; one process without it), build actor and critic.

    Every rank calls it, in the same order of collectives.
    """
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ctx = init_distributed(cfg.device, cfg.sharding)
    device = str(ctx.device)
    actor = Actor(actor_config(cfg, device), ctx)
    return ctx, actor, build_critic(cfg, device, ctx)


class TrainerWorker(Worker[TrainerServiceConfig]):
    """Serves ``trainer.step``, ``trainer.publish``, ``trainer.save`` and ``trainer.load``."""

    tier = "trainer"

    async def setup(self) -> None:
        cfg = self.config
        use_rank_thread(asyncio.get_running_loop(), cfg.device)
        self.dist, self.actor, self.critic = await asyncio.to_thread(build_models, cfg)
        self.channel = CommandChannel(self.dist)  # to trainer ranks 1..W-1 (see ranks.py)
        self.weight_version = 0
        self.store = TensorStoreServer(capacity_bytes=int(cfg.store_capacity_mb * 2**20), ttl_s=7 * 24 * 3600)
        self.data_address = await self.store.start()
        self._clients: dict[str, TensorStoreClient] = {}
        self._published: list[TensorRef] = []
        self._shared: list[IpcBucket] = []  # the current version by CUDA IPC, when it was asked for
        self._shared_buffers: list[dict[str, torch.Tensor]] = []  # kept alive for the receivers
        self._lock = asyncio.Lock()
        for verb, handler in (
            ("step", self._on_step),
            ("publish", self._on_publish),
            ("save", self._on_save),
            ("load", self._on_load),
            ("latest", self._on_latest),
        ):
            await self.transport.subscribe(subject(cfg.cluster, "trainer", verb), handler, queue="trainer",
                                           max_concurrency=1)  # fmt: skip

    def announce_fields(self) -> dict[str, object]:
        device = self.actor.device
        gpus = [gpu_uuid(device)] if device.type == "cuda" else []  # rank 0's: where IPC buckets live
        return {"data_address": self.data_address, "model_id": self.config.model_path, "gpu_uuids": gpus}

    async def _on_step(self, message: AnyMessage) -> AnyMessage:
        if not isinstance(message, TrainStepRequest):
            raise ValueError(f"trainer.step takes train-step requests, got {message.kind!r}")
        return await self.step(message)

    async def _on_publish(self, message: AnyMessage) -> AnyMessage:
        if not isinstance(message, PublishWeights):
            raise ValueError(f"trainer.publish takes publish requests, got {message.kind!r}")
        return await self.publish(message)

    async def _on_save(self, message: AnyMessage) -> AnyMessage:
        if not isinstance(message, SaveCheckpoint):
            raise ValueError(f"trainer.save takes save requests, got {message.kind!r}")
        async with self._lock:
            command = {"op": "save", "path": message.path, "mode": message.mode}
            await asyncio.to_thread(self.channel.send, command)
            actor, critic = self.actor, self.critic
            path = await asyncio.to_thread(save_checkpoint, message.path, actor, critic, message.mode)
        return Saved(path=str(path))

    async def _on_load(self, message: AnyMessage) -> AnyMessage:
        if not isinstance(message, LoadCheckpoint):
            raise ValueError(f"trainer.load takes load requests, got {message.kind!r}")
        async with self._lock:
            await asyncio.to_thread(self.channel.send, {"op": "load", "path": message.path})
            steps = await asyncio.to_thread(load_checkpoint, message.path, self.actor, self.critic)
            self.weight_version = message.weight_version
        return CheckpointLoaded(path=message.path, steps=steps, weight_version=self.weight_version)

    async def _on_latest(self, message: AnyMessage) -> AnyMessage:
        """The current version's buckets, for a rollout worker that joins late (no lock: the pair
        ``_published``/``weight_version`` is swapped without an await in between)."""
        if not isinstance(message, LatestWeights):
            raise ValueError(f"trainer.latest takes latest-weights requests, got {message.kind!r}")
        refs, shared = list(self._published), list(self._shared)
        return WeightsPublished(weight_version=self.weight_version, buckets=refs, ipc_buckets=shared,
                                nbytes=sum(r.nbytes for r in refs) or sum(b.nbytes for b in shared),
                                seconds=0.0)  # fmt: skip

    async def _fetch(self, ref: TensorRef) -> dict[str, torch.Tensor]:
        client = self._clients.get(ref.address)
        if client is None:
            client = self._clients[ref.address] = TensorStoreClient(ref.address)
        return await client.fetch(ref)

    async def step(self, request: TrainStepRequest) -> TrainStepResult:
        """One policy update on the referenced rollouts and their scores."""
        async with self._lock:
            self.busy += 1
            try:
                command = {"op": "step", "request": request.model_dump(mode="json")}
                await asyncio.to_thread(self.channel.send, command)  # the other ranks fetch for themselves
                chunks = await asyncio.gather(*(self._fetch(ref) for ref in request.rollouts))
                batch = merge_batch(request.algorithm, chunks)
                metrics = await asyncio.to_thread(self._update, batch, request)
            finally:
                self.busy -= 1
        return TrainStepResult(step=request.step, metrics=metrics, weight_version=self.weight_version)

    def _update(self, batch: dict[str, torch.Tensor], request: TrainStepRequest) -> dict[str, float]:
        """One update of ``request.algorithm``; see :func:`rlfleet.trainer.updates.run_update`."""
        return run_update(self.actor, self.critic, self.config, batch, request)

    async def publish(self, request: PublishWeights) -> WeightsPublished:
        """Stage the current weights as a new version, bucket by bucket, for the carriers asked for.

        ``grpc``: buckets in this worker's TensorStore. ``cuda_ipc``: buckets kept on this GPU and
        shared by IPC handle (:mod:`rlfleet.trainer.ipc_share`) until the next publish.
        """
        if "cuda_ipc" in request.carriers and self.actor.device.type != "cuda":
            raise ValueError(
                "the cuda_ipc weight carrier needs the trainer on a GPU; this trainer runs on CPU"
            )
        async with self._lock:
            t0 = time.perf_counter()
            version = request.weight_version if request.weight_version >= 0 else self.weight_version + 1
            bucket_bytes = max(1, int(request.bucket_mb * 2**20))
            for old in self._published:
                self.store.delete(old.key)
            self._shared, self._shared_buffers = [], []  # the previous version's GPU buffers go
            command = {"op": "publish", "bucket_bytes": bucket_bytes, "dtype": request.dtype}
            await asyncio.to_thread(self.channel.send, command)  # every rank takes part in the gathers
            refs, shared = await asyncio.to_thread(
                self._stage, version, bucket_bytes, set(request.carriers), request.dtype
            )  # fmt: skip
            self._published, self._shared = refs, shared
            self.weight_version = version
            seconds = time.perf_counter() - t0
        nbytes = sum(ref.nbytes for ref in refs) or sum(b.nbytes for b in shared)
        logger.info(
            "staged weight version %d for %s: %d buckets, %.1f MB in %.3fs",
            version,
            "+".join(sorted(request.carriers)),
            max(len(refs), len(shared)),
            nbytes / 2**20,
            seconds,
        )
        return WeightsPublished(weight_version=version, buckets=refs, ipc_buckets=shared, nbytes=nbytes,
                                seconds=seconds)  # fmt: skip

    def _stage(
        self, version: int, bucket_bytes: int, carriers: set[str], dtype: str
    ) -> tuple[list[TensorRef], list[IpcBucket]]:
        refs: list[TensorRef] = []
        shared: list[IpcBucket] = []
        publish_dtype = getattr(torch, dtype) if dtype else None
        if "cuda_ipc" in carriers:
            buckets = self.actor.iter_weight_buckets(bucket_bytes, dtype=publish_dtype, on_device=True)
            for i, bucket in enumerate(buckets):
                shared.append(share_bucket(bucket))
                self._shared_buffers.append(bucket)
                if "grpc" in carriers:
                    refs.append(self.store.put_local(f"weights/v{version}/{i}", to_host(bucket)))
            return refs, shared
        pinned = self.actor.device.type == "cuda"  # page-locked: device-to-host copies at full speed
        buckets = self.actor.iter_weight_buckets(bucket_bytes, dtype=publish_dtype, pin_memory=pinned)
        for i, bucket in enumerate(buckets):
            refs.append(self.store.put_local(f"weights/v{version}/{i}", bucket))
        return refs, shared

    async def teardown(self) -> None:
        await self._stop_followers()
        for client in self._clients.values():
            await client.close()
        await self.store.stop()

    async def _stop_followers(self) -> None:
        """Tell ranks 1..W-1 to exit; they may be gone already (stopped by the launcher)."""
        if not self.dist.distributed:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self.channel.send, {"op": "stop"}), timeout=10)
        except (RuntimeError, TimeoutError) as exc:
            logger.warning("could not tell the other trainer ranks to stop: %s", exc)
