"""The rollout tier's worker: generate jobs in, rollout refs out; weights pulled in place.

Results stay in the worker's own TensorStore; the reply carries only a :class:`TensorRef`, so the
reward and trainer tiers stream them straight from here. Weights arrive by the carrier that
suits this worker (:mod:`rlfleet.common.carriers`): CUDA IPC from a trainer on the same GPU,
else the trainer's TensorStore over gRPC. A generate request pinned to a weight
version this worker does not hold is refused as retryable, never served on stale weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal

import torch
from pydantic import Field

from rlfleet.common.messages import AnyMessage, GenerateRequest, GenerateResult, LoadWeights, WeightsLoaded
from rlfleet.common.service import ServiceConfig, Worker
from rlfleet.common.subjects import subject
from rlfleet.common.tensor_store import TensorStoreClient, TensorStoreServer
from rlfleet.rollout.catch_up import catch_up
from rlfleet.rollout.engines.registry import make_engine, resolve_engine_name
from rlfleet.rollout.engines.tensors import to_rollout_tensors
from rlfleet.rollout.errors import NoUsableCarrier, StaleWeights

logger = logging.getLogger(__name__)


class RolloutServiceConfig(ServiceConfig):
    """Settings of a rollout worker."""

    model_path: str = Field(description="local HF model directory to serve")
    engine: Literal["hf", "vllm", "auto"] = Field(default="hf", description="generation engine")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="engine dtype")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="auto: CUDA when available")
    max_batch_size: int = Field(default=64, ge=1, description="sequences generated together")
    seed: int = Field(default=0, description="sampling seed")
    capacity: int = Field(default=1, ge=1, description="generate jobs taken at once")
    store_capacity_mb: float = Field(default=4096, gt=0, description="TensorStore capacity for results")
    store_ttl_s: float = Field(default=1800, gt=0, description="results not fetched by then are dropped")
    tensor_parallel_size: int = Field(default=1, ge=1, description="vLLM: GPUs one engine shards over")
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1, description="vLLM: GPU memory share")
    enforce_eager: bool | None = Field(
        default=None, description="vLLM: no torch.compile / CUDA graphs; None = eager on CPU only"
    )
    cache_policy: Literal["lru", "none"] = Field(
        default="lru", description="vLLM KV cache: lru = prefix caching (LRU eviction), none = off"
    )
    max_cache_len: int = Field(
        default=2048, ge=2, description="vLLM: longest prompt + response; longer requests are refused"
    )
    colocate: bool = Field(default=False, description="vLLM: sleep between rollouts (GPU shared)")
    sleep_level: Literal[1, 2] = Field(default=1, description="vLLM sleep level when colocated")
    catch_up_timeout_s: float = Field(
        default=10.0, gt=0, description="late join: wait this long for the trainer's latest weights"
    )


def engine_kwargs(cfg: RolloutServiceConfig, engine: str, device: str) -> dict[str, Any]:
    """Constructor arguments of ``engine`` (a resolved engine name) from the worker's config."""
    kwargs: dict[str, Any] = {"dtype": cfg.dtype, "device": device, "seed": cfg.seed,
                              "max_batch_size": cfg.max_batch_size}  # fmt: skip
    if engine == "vllm":
        eager = cfg.enforce_eager if cfg.enforce_eager is not None else device == "cpu"
        kwargs.update(
            tensor_parallel_size=cfg.tensor_parallel_size, gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=eager, enable_prefix_caching=cfg.cache_policy == "lru",
            max_model_len=cfg.max_cache_len, colocate=cfg.colocate, sleep_level=cfg.sleep_level,
        )  # fmt: skip
    return kwargs


class RolloutWorker(Worker[RolloutServiceConfig]):
    """Serves ``rollout.generate`` (queue group and own subject) and ``rollout.load_weights``."""

    tier = "rollout"

    async def setup(self) -> None:
        cfg = self.config
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        name = resolve_engine_name(cfg.engine)
        self.engine: Any = await asyncio.to_thread(
            make_engine, name, cfg.model_path, **engine_kwargs(cfg, name, device)
        )  # fmt: skip
        self.weight_version = self.engine.weight_version
        self.gpu_uuids: list[str] = list(getattr(self.engine, "gpu_uuids", []))
        self.store = TensorStoreServer(capacity_bytes=int(cfg.store_capacity_mb * 2**20),
                                       ttl_s=cfg.store_ttl_s)  # fmt: skip
        self.data_address = await self.store.start()
        self._clients: dict[str, TensorStoreClient] = {}
        self._gpu = asyncio.Lock()  # one engine call at a time: generation and weight loads never overlap
        # late join: hold the trainer's current version before the first announce (never serve stale)
        self.weight_version = await catch_up(self.transport, cfg.cluster, self.worker_id, self.weight_version,
                                             self.load_weights, timeout=cfg.catch_up_timeout_s)  # fmt: skip
        await self.transport.subscribe(subject(cfg.cluster, "rollout", "generate"), self._on_generate,
                                       queue=f"rollout-{cfg.pool}", max_concurrency=cfg.capacity)  # fmt: skip

    def announce_fields(self) -> dict[str, object]:
        return {"data_address": self.data_address, "capacity": self.config.capacity,
                "model_id": self.config.model_path, "gpu_uuids": self.gpu_uuids}  # fmt: skip

    async def handle_own(self, message: AnyMessage) -> AnyMessage | None:
        if isinstance(message, GenerateRequest):
            return await self.generate(message)
        if isinstance(message, LoadWeights):
            return await self.load_weights(message)
        return await super().handle_own(message)

    async def _on_generate(self, message: AnyMessage) -> AnyMessage:
        if not isinstance(message, GenerateRequest):
            raise ValueError(f"rollout.generate takes generate requests, got {message.kind!r}")
        return await self.generate(message)

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if request.weight_version >= 0 and request.weight_version != self.weight_version:
            raise StaleWeights(self.worker_id, self.weight_version, request.weight_version)
        async with self._gpu:
            self.busy += 1
            try:
                t0 = time.perf_counter()
                completions = await asyncio.to_thread(self.engine.generate, request.prompt_token_ids,
                                                      request.sampling)  # fmt: skip
                seconds = time.perf_counter() - t0
                tensors = to_rollout_tensors(completions, self.engine.pad_token_id, self.engine.tokenizer)
            finally:
                self.busy -= 1
        ref = self.store.put_local(f"rollout/{request.job_id}", tensors)
        return GenerateResult(
            job_id=request.job_id, worker_id=self.worker_id, weight_version=self.weight_version, ref=ref,
            num_prompts=len(request.prompt_token_ids), num_samples=len(completions),
            num_tokens=sum(len(c.token_ids) for c in completions), seconds=seconds,
        )  # fmt: skip

    def carrier(self, message: LoadWeights) -> str:
        """``cuda_ipc`` when the message's IPC buckets live on this engine's GPU, else ``grpc``.

        Raises :class:`NoUsableCarrier` when neither can serve this worker.
        """
        if message.ipc_buckets and len(self.gpu_uuids) == 1:
            if all(b.gpu_uuid == self.gpu_uuids[0] for b in message.ipc_buckets):
                return "cuda_ipc"
        if message.buckets or not message.ipc_buckets:
            return "grpc"
        where = sorted({b.gpu_uuid for b in message.ipc_buckets})
        mine = ", ".join(self.gpu_uuids) or "the CPU"
        raise NoUsableCarrier(
            self.worker_id,
            message.weight_version,
            f"it came only by CUDA IPC from GPU {', '.join(where)}, this worker runs on {mine}",
        )

    async def load_weights(self, message: LoadWeights) -> WeightsLoaded:
        """Load the version in place by the best carrier for this worker, then switch version.

        CUDA IPC (the trainer shares this GPU): the engine maps the trainer's buffers. gRPC: each
        bucket is pulled from the trainer's store and loaded as it arrives.
        """
        t0 = time.perf_counter()
        carrier = self.carrier(message)
        async with self._gpu:
            if carrier == "cuda_ipc":
                await asyncio.to_thread(self.engine.load_ipc, message.ipc_buckets)
            for ref in message.buckets if carrier == "grpc" else ():
                client = self._clients.get(ref.address)
                if client is None:
                    client = self._clients[ref.address] = TensorStoreClient(ref.address)
                bucket = await client.fetch(ref)
                await asyncio.to_thread(self.engine.load_weights, bucket)
            self.engine.set_weight_version(message.weight_version)
            self.weight_version = message.weight_version
        seconds = time.perf_counter() - t0
        logger.info("loaded weight version %d by %s in %.3fs", message.weight_version, carrier, seconds)
        return WeightsLoaded(worker_id=self.worker_id, weight_version=message.weight_version, seconds=seconds,
                             carrier=carrier)  # fmt: skip

    async def teardown(self) -> None:
        for client in self._clients.values():
            await client.close()
        await self.store.stop()
        self.engine.close()
