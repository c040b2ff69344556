"""The trainer tier's worker: policy updates on rollout refs, weight publishing, checkpoints.

A train step pulls its rollout chunks straight from the rollout workers' stores, turns the
reward tier's scores into advantages, and runs one update. Publishing stages the weights in the
trainer's own TensorStore as versioned buckets; rollout workers pull them from there, so a
worker that joins late can catch up on the latest version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal

import torch
from pydantic import Field

from rlfleet.common.messages import (
    AnyMessage,
    PublishWeights,
    Saved,
    SaveCheckpoint,
    TrainStepRequest,
    TrainStepResult,
    WeightsPublished,
)
from rlfleet.common.refs import TensorRef
from rlfleet.common.service import ServiceConfig, Worker
from rlfleet.common.subjects import subject
from rlfleet.common.tensor_store import TensorStoreClient, TensorStoreServer
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms import ADVANTAGES
from rlfleet.trainer.batching import merge_rollouts
from rlfleet.trainer.config import ActorConfig, OptimizerConfig
from rlfleet.trainer.errors import InvalidBatch

logger = logging.getLogger(__name__)


class TrainerServiceConfig(ServiceConfig):
    """Settings of a trainer worker (the controller writes them from its TrainerConfig)."""

    model_path: str = Field(description="local HF model directory of the actor")
    algorithm: Literal["grpo"] = Field(default="grpo", description="advantage estimator and loss")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: CUDA when available")
    dtype: Literal["float32", "bfloat16"] = Field(default="float32", description="parameter dtype")
    mixed_precision: Literal["auto", "none", "bf16"] = Field(
        default="auto", description="bf16 autocast with fp32 master weights; auto: bf16 on GPU, none on CPU"
    )
    trainable_layers: int | None = Field(default=None, ge=1, description="train only the top N blocks")
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
    store_capacity_mb: float = Field(default=16384, gt=0, description="TensorStore capacity for weight buckets")


class TrainerWorker(Worker[TrainerServiceConfig]):
    """Serves ``trainer.step``, ``trainer.publish`` and ``trainer.save``."""

    tier = "trainer"

    async def setup(self) -> None:
        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        actor_cfg = ActorConfig(
            model_path=cfg.model_path, dtype=cfg.dtype, device=device, temperature=cfg.temperature, seed=cfg.seed,
            use_reference=cfg.kl_coef > 0, trainable_layers=cfg.trainable_layers,
            mixed_precision=(("bf16" if device == "cuda" else "none") if cfg.mixed_precision == "auto"
                             else cfg.mixed_precision),
            optim=OptimizerConfig(lr=cfg.learning_rate, weight_decay=cfg.weight_decay),
        )  # fmt: skip
        self.actor = await asyncio.to_thread(Actor, actor_cfg)
        self.weight_version = 0
        self.store = TensorStoreServer(capacity_bytes=int(cfg.store_capacity_mb * 2**20), ttl_s=7 * 24 * 3600)
        self.data_address = await self.store.start()
        self._clients: dict[str, TensorStoreClient] = {}
        self._published: list[TensorRef] = []
        self._lock = asyncio.Lock()
        for verb, handler in (("step", self._on_step), ("publish", self._on_publish), ("save", self._on_save)):
            await self.transport.subscribe(subject(cfg.cluster, "trainer", verb), handler, queue="trainer",
                                           max_concurrency=1)  # fmt: skip

    def announce_fields(self) -> dict[str, object]:
        return {"data_address": self.data_address, "model_id": self.config.model_path}

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
            path = await asyncio.to_thread(self.actor.save_hf, message.path)
        return Saved(path=str(path))

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
                chunks = await asyncio.gather(*(self._fetch(ref) for ref in request.rollouts))
                batch = merge_rollouts(chunks)
                metrics = await asyncio.to_thread(self._update, batch, request)
            finally:
                self.busy -= 1
        return TrainStepResult(step=request.step, metrics=metrics, weight_version=self.weight_version)

    def _update(self, batch: dict[str, torch.Tensor], request: TrainStepRequest) -> dict[str, float]:
        cfg = self.config
        n = batch["response_ids"].shape[0]
        if len(request.scores) != n:
            raise InvalidBatch("scores", f"{len(request.scores)} scores for {n} samples")
        hyper: dict[str, Any] = {**request.hyperparams}
        rewards = torch.tensor(request.scores, dtype=torch.float32)
        advantages = ADVANTAGES[request.algorithm](rewards, batch["group_index"])
        num_updates = max(1, int(hyper.get("num_updates", 1)))
        t0 = time.perf_counter()
        metrics = self.actor.update(
            batch, advantages, micro_batch_size=cfg.micro_batch_size,
            kl_coef=float(hyper.get("kl_coef", cfg.kl_coef)), clip_eps=float(hyper.get("clip_eps", cfg.clip_eps)),
            entropy_coef=float(hyper.get("entropy_coef", cfg.entropy_coef)), loss_agg=cfg.loss_agg,
            max_grad_norm=cfg.max_grad_norm, ppo_epochs=cfg.ppo_epochs,
            mini_batch_size=None if num_updates == 1 else -(-n // num_updates),
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        tokens = float((batch["prompt_mask"].sum() + batch["response_mask"].sum()).item())
        metrics["advantage/abs_mean"] = float(advantages.abs().mean().item())
        metrics["time/update_s"] = seconds
        metrics["throughput/train_tok_s"] = tokens / max(seconds, 1e-9)
        return metrics

    async def publish(self, request: PublishWeights) -> WeightsPublished:
        """Stage the current weights as a new version, bucket by bucket, in this worker's store."""
        async with self._lock:
            t0 = time.perf_counter()
            version = request.weight_version if request.weight_version >= 0 else self.weight_version + 1
            bucket_bytes = max(1, int(request.bucket_mb * 2**20))
            for old in self._published:
                self.store.delete(old.key)
            refs = await asyncio.to_thread(self._stage, version, bucket_bytes)
            self._published = refs
            self.weight_version = version
            seconds = time.perf_counter() - t0
        nbytes = sum(ref.nbytes for ref in refs)
        logger.info("staged weight version %d: %d buckets, %.1f MB in %.2fs", version, len(refs), nbytes / 2**20,
                    seconds)  # fmt: skip
        return WeightsPublished(weight_version=version, buckets=refs, nbytes=nbytes, seconds=seconds)

    def _stage(self, version: int, bucket_bytes: int) -> list[TensorRef]:
        refs = []
        for i, bucket in enumerate(self.actor.iter_weight_buckets(bucket_bytes)):
            refs.append(self.store.put_local(f"weights/v{version}/{i}", bucket))
        return refs

    async def teardown(self) -> None:
        for client in self._clients.values():
            await client.close()
        await self.store.stop()
