"""The rollout tier's worker: generate jobs in, rollout refs out; weights pulled in place.

Results stay in the worker's own TensorStore; the reply carries only a :class:`TensorRef`, so the
reward and trainer tiers stream them straight from here, until this worker (the store's owner,
the only one who may delete) loads a newer weight version or ``store_ttl_s`` passes. Weights
arrive by the carrier that suits this worker (:mod:`rlfleet.common.schema.carriers`): CUDA IPC
from a trainer on the same GPU, else the trainer's TensorStore over gRPC. A generate request
pinned to a weight version this worker does not hold is refused as retryable, never served on
stale weights; one over the worker's ``limits`` (its samples, new tokens or prompt tokens in all, or
a prompt that with ``max_tokens`` does not fit the model's context) is refused before any work, and
one whose ``deadline`` passes is refused, or cancelled while it runs, freeing the worker. A
generate or weight load whose ``job_id`` the worker has seen (the controller's retry, or the
transport's resend after a NATS outage) is answered with the first reply, not run again
(:class:`~rlfleet.common.control.reply_cache.ReplyCache`).

Completions are packed (:func:`to_rollout_tensors`) into the rollout-batch tensor contract shared
by rollout, reward and trainer; N = number of completions (prompt-major, as ``Engine.generate``
returns them):

- ``prompt_ids`` (N, P) int64, left-padded with ``pad_token_id``; ``prompt_mask`` (N, P) int64
- ``response_ids`` (N, R) int64, right-padded; ``response_mask`` (N, R) int64 (a generated stop
  token counts as real); ``rollout_logprobs`` (N, R) float32, 0 at padding
- ``group_index`` (N,) int64: the prompt each sample answers
- ``prompt_text`` / ``response_text`` uint8 (total utf-8 bytes,) with ``*_offsets`` (N+1,) int64

A request with an ``episode`` runs each sample as a multi-turn episode against an environment
(:mod:`~rlfleet.rollout.episodes`); its batch adds ``loss_mask`` and the ``episode_*`` fields of the
contract (:mod:`rlfleet.common.schema.batch`), and its ``num_tokens`` counts the sampled tokens only.

Texts are packed with :func:`rlfleet.common.schema.batch.pack_texts` (read back with ``unpack_texts``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from rlfleet.common.control.messages import (
    AgentCollect,
    AgentOpen,
    AgentOpened,
    AnyMessage,
    GenerateRequest,
    GenerateResult,
    LoadWeights,
    SamplingParams,
    WeightsLoaded,
)
from rlfleet.common.control.reply_cache import ReplyCache
from rlfleet.common.control.transport import REWARD_NATS_ENV_PREFIX, TOKEN_ENV, Transport, subject
from rlfleet.common.control.worker import Worker
from rlfleet.common.errors import ConfigError, WrongMessageKind
from rlfleet.common.remote_code import refused_remote_code, remote_code_reason
from rlfleet.common.schema.batch import pack_texts, pad_left, pad_right
from rlfleet.common.schema.connection import NatsConnection, mask_url
from rlfleet.common.schema.rollout import GenerateLimits, RolloutWorkerConfig
from rlfleet.common.tensors.store import ClientPool, TensorStoreServer, worker_store
from rlfleet.common.tensors.weight_sync import Fingerprinter
from rlfleet.common.tensors.weight_sync import fingerprint as weights_fingerprint
from rlfleet.rollout.catch_up import catch_up
from rlfleet.rollout.chat_turns import ChatTurns
from rlfleet.rollout.engines.base import Completion, DeltaEngine
from rlfleet.rollout.engines.registry import make_engine, resolve_engine_name
from rlfleet.rollout.engines.weights import write_delta_in_place
from rlfleet.rollout.episodes import EnvClient, EpisodeDriver, Episodes
from rlfleet.rollout.errors import (
    DeadlinePassed,
    DeltaBaseMissing,
    GenerateTooLarge,
    InvalidPrompt,
    NoUsableCarrier,
    StaleWeights,
)
from rlfleet.rollout.openai_endpoint import OpenAIEndpoint
from rlfleet.rollout.partial_rollout import Segmented, generate_in_segments

logger = logging.getLogger(__name__)


def to_rollout_tensors(
    completions: Sequence[Completion],
    pad_token_id: int,
    tokenizer: Any | None = None,
    versions: Sequence[Sequence[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """Pack completions (prompt-major) into the rollout-batch tensor dict (see the module docstring).

    ``tokenizer`` decodes the prompts for ``prompt_text`` (``skip_special_tokens=True``, like the
    responses); without one, every prompt text is empty. ``response_text`` is each
    ``Completion.text``. Completions without logprobs get 0 over their whole response. ``versions``
    (one weight version per token of each completion) become ``response_versions``, -1 at padding.
    """
    if not completions:
        raise ValueError("to_rollout_tensors needs at least one completion")
    for c in completions:
        if c.logprobs and len(c.logprobs) != len(c.token_ids):
            raise ValueError(
                f"completion (prompt {c.prompt_index}, sample {c.sample_index}) has {len(c.token_ids)} "
                f"tokens but {len(c.logprobs)} logprobs"
            )
    prompt_ids, prompt_mask = pad_left([c.prompt_token_ids for c in completions], pad_token_id)
    response_ids, response_mask = pad_right([c.token_ids for c in completions], pad_token_id)
    logprob_rows = [c.logprobs if c.logprobs else [0.0] * len(c.token_ids) for c in completions]
    logprobs, _ = pad_right(logprob_rows, 0.0, "float32")
    if tokenizer is not None:
        prompts = tokenizer.batch_decode([c.prompt_token_ids for c in completions], skip_special_tokens=True)
    else:
        prompts = [""] * len(completions)
    if versions is not None:
        if len(versions) != len(completions) or any(
            len(v) != len(c.token_ids) for v, c in zip(versions, completions, strict=True)
        ):
            raise ValueError("versions needs one weight version per token of every completion")
    prompt_text, prompt_offsets = pack_texts(prompts)
    response_text, response_offsets = pack_texts([c.text for c in completions])
    out = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
        "rollout_logprobs": logprobs,
        "group_index": torch.tensor([c.prompt_index for c in completions], dtype=torch.int64),
        "prompt_text": prompt_text,
        "prompt_text_offsets": prompt_offsets,
        "response_text": response_text,
        "response_text_offsets": response_offsets,
    }
    if versions is not None:
        out["response_versions"], _ = pad_right([list(v) for v in versions], -1, width=response_ids.shape[1])
    return out


def check_products(request: GenerateRequest, limits: GenerateLimits, context: int | None) -> None:
    """Refuse, before any work, a request whose fields are each in bounds but whose products are not.

    Raises :class:`GenerateTooLarge` for samples (prompts x n), new tokens (samples x max_tokens) or
    prompt tokens (the prompts' total length x n) over ``limits``, and :class:`InvalidPrompt` for a
    prompt that with ``max_tokens`` does not fit ``context`` (the served model's; None: unknown). An
    episode's response is bounded by ``max_episode_tokens`` instead of ``max_tokens``.
    """
    prompts, n, max_tokens = request.prompt_token_ids, request.sampling.n, request.sampling.max_tokens
    budget = "max_tokens"
    if request.episode is not None:
        budget, max_tokens = "episode.max_episode_tokens", request.episode.max_episode_tokens
    samples, length = len(prompts) * n, sum(map(len, prompts))
    over = [
        ("samples", f"{len(prompts)} prompts x n={n}", samples, limits.max_samples, "max_samples"),
        ("new tokens", f"{samples} samples x {budget}={max_tokens}", samples * max_tokens,
         limits.max_new_tokens, "max_new_tokens"),
        ("prompt tokens", f"{len(prompts)} prompts of {length} tokens in all x n={n}", length * n,
         limits.max_prompt_tokens, "max_prompt_tokens"),
    ]  # fmt: skip
    for product, formula, value, limit, setting in over:
        if value > limit:
            raise GenerateTooLarge(product, formula, value, limit, setting)
    if context is None:
        return
    for i, prompt in enumerate(prompts):
        if len(prompt) + max_tokens <= context:
            continue
        if request.episode is None:
            raise InvalidPrompt(i, prompt_len=len(prompt), max_tokens=max_tokens, cap=context)
        raise InvalidPrompt(i, f"has {len(prompt)} tokens; with {budget}={max_tokens} its episode needs "
                            f"{len(prompt) + max_tokens} > the context cap of {context} tokens; shorten "
                            "prompts or lower max_episode_tokens")  # fmt: skip


def _identity(request: GenerateRequest) -> GenerateRequest:
    """What makes a repeated job id the same job: the request less its deadline, which each try of
    one job (the controller's retry, a resend after an outage) may carry anew."""
    return request.model_copy(update={"deadline": None})


def engine_kwargs(cfg: RolloutWorkerConfig, device: str) -> dict[str, Any]:
    """Constructor arguments of the worker's engine (``rollout.engine.type``, ``auto`` resolved) on
    ``device``: the vLLM engine takes its section's settings under their own names."""
    settings = cfg.rollout
    kwargs: dict[str, Any] = {"dtype": settings.dtype, "device": device, "seed": cfg.placement.seed,
                              "max_batch_size": settings.max_batch_size,
                              "trust_remote_code": cfg.loading.trust_remote_code}  # fmt: skip
    vllm = settings.vllm()
    if vllm is not None and resolve_engine_name(vllm.type) == "vllm":
        kwargs.update(vllm.model_dump(exclude={"type"}))
        if vllm.enforce_eager is None:  # compilation pays off on a GPU only
            kwargs["enforce_eager"] = device == "cpu"
    return kwargs


class RolloutWorker(Worker[RolloutWorkerConfig]):
    """Serves ``rollout.generate`` (queue group and own subject) and ``rollout.load_weights``."""

    tier = "rollout"

    async def setup(self) -> None:
        cfg = self.config
        device = cfg.placement.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        name = resolve_engine_name(cfg.rollout.engine.type)
        try:
            self.engine: Any = await asyncio.to_thread(
                make_engine, name, cfg.model_path, **engine_kwargs(cfg, device)
            )  # fmt: skip
        except ValueError as exc:
            if refused_remote_code(exc):
                reason = remote_code_reason(cfg.model_path)
                raise ConfigError("loading.trust_remote_code", False, reason) from None
            raise
        self.weight_version = self.engine.weight_version
        self.gpu_uuids: list[str] = list(getattr(self.engine, "gpu_uuids", []))
        capacity = int(cfg.results_store_mb * 2**20)
        self.store: TensorStoreServer = await worker_store(
            cfg.tensor_plane, capacity_bytes=capacity, ttl_s=cfg.store_ttl_s
        )
        self.data_address = self.store.address
        self._batches: list[tuple[int, str]] = []  # (weight version, key) of the batches in the store
        # the version the next delta applies to (hold): a host copy of it, or (a DeltaEngine) the
        # engine's own weights under these names
        self._held: dict[str, torch.Tensor] | None = None
        self._held_names: list[str] | None = None
        self._held_version = -1
        self._stores = ClientPool(cfg.tensor_plane)  # one client per trainer store the weights come from
        self._gpu = asyncio.Lock()  # one engine call at a time: generation and weight loads never overlap
        self.replies = ReplyCache()  # a repeated generate or load (same job_id) gets its first reply
        self._turns: ChatTurns | None = None  # renders episodes' observations (made at the first episode)
        self.agents: OpenAIEndpoint | None = None  # the agents' endpoint (started at the first AgentOpen)
        self._env_transport: Transport | None = None  # a shared reward server's NATS (env_url), if another
        self._env_token = os.environ.get(TOKEN_ENV, "")  # the run's tenant token there (the launcher's)
        if cfg.env_url and cfg.env_url != cfg.fleet.nats_url:
            from rlfleet.common.control.nats_transport import NatsTransport

            auth = NatsConnection().resolved(prefix=REWARD_NATS_ENV_PREFIX)
            self._env_transport = await NatsTransport.connect(
                cfg.env_url, name=f"{self.worker_id}-env", tier="rollout", auth=auth
            )
            logger.info("environments on the reward servers at %s", mask_url(cfg.env_url))
        # late join: hold the trainer's current version before the first announce (never serve stale)
        cluster = cfg.fleet.cluster
        self.weight_version = await catch_up(self.transport, cluster, self.worker_id, self.weight_version,
                                             self.load_weights, timeout=cfg.catch_up_timeout_s)  # fmt: skip
        await self.subscribe(subject(cluster, "rollout", "generate"), self._on_generate,
                             queue=f"rollout-{cfg.pool}", max_concurrency=cfg.capacity)  # fmt: skip

    def announce_fields(self) -> dict[str, object]:
        return {"data_address": self.data_address, "capacity": self.config.capacity,
                "model_id": self.config.model_path, "gpu_uuids": self.gpu_uuids}  # fmt: skip

    async def handle_own(self, message: AnyMessage) -> AnyMessage | None:
        if isinstance(message, GenerateRequest):
            return await self.replies.once(_identity(message), message.job_id, lambda: self.generate(message))
        if isinstance(message, LoadWeights):
            return await self.replies.once(message, message.job_id, lambda: self.load_weights(message))
        if isinstance(message, AgentOpen):
            return await self.open_agents(message)
        if isinstance(message, AgentCollect):
            return await self.replies.once(message, message.job_id, lambda: self.collect_agents(message))
        return await super().handle_own(message)

    async def _on_generate(self, message: AnyMessage) -> AnyMessage:
        if not isinstance(message, GenerateRequest):
            raise WrongMessageKind("rollout.generate", message.kind)
        return await self.replies.once(_identity(message), message.job_id, lambda: self.generate(message))

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Generate the job into this worker's store; its reply says where the batch lives.

        Refused before any work when its deadline has passed (:class:`DeadlinePassed`), when its
        products are over this worker's ``limits`` or a prompt does not fit the model's context
        (:func:`check_products`), or when it asks for weights this worker does not hold. A job whose
        deadline passes while it waits for the engine or while it generates is cancelled (the engine
        stops, the worker takes the next job) and answered with :class:`DeadlinePassed`.
        """
        self._stop_at(request)
        check_products(request, self.config.limits, getattr(self.engine, "max_model_len", None))
        if request.weight_version > self.weight_version:  # newer weights serve a job (a pipelined run)
            raise StaleWeights(self.worker_id, self.weight_version, request.weight_version)
        segment = self.config.rollout.partial_rollout_tokens
        self.busy += 1
        try:
            t0 = time.perf_counter()
            extra: dict[str, torch.Tensor] = {}
            sampled: int | None = None  # an episode's observation tokens were not generated
            if request.episode is not None:  # loads may come between turns
                episodes = await self._run_episodes(request)
                completions, versions = episodes.completions(self._decode), episodes.versions()
                version = episodes.versions_used[0] if episodes.versions_used else self.weight_version
                extra, sampled = episodes.tensors(), episodes.sampled_tokens
            elif segment and request.sampling.max_tokens > segment:  # loads may come between segments
                job = await self._generate_segments(request, segment)
                completions, versions, version = job.completions, job.versions, job.versions_used[0]
            else:
                async with self._gpu:  # loads wait for the engine: the job's weights stay these
                    stop_at = self._stop_at(request)  # it may have passed while the job waited
                    version = self.weight_version
                    completions = await asyncio.to_thread(self.engine.generate, request.prompt_token_ids,
                                                          request.sampling, deadline=stop_at)  # fmt: skip
                versions = [[version] * len(c.token_ids) for c in completions]
            seconds = time.perf_counter() - t0
            tensors = to_rollout_tensors(
                completions, self.engine.pad_token_id, self.engine.tokenizer, versions
            )
            tensors.update(extra)
        except DeadlinePassed as exc:  # the engine stopped: name the job, the worker is free
            logger.warning("generate job %s cancelled: %s", request.job_id, exc)
            raise DeadlinePassed(self._job_name(request), exc.late_s, exc.ran_s) from None
        finally:
            self.busy -= 1
        ref = self.store.put_local(f"rollout/{request.job_id}", tensors)
        self._batches.append((version, ref.key))
        generated = sampled if sampled is not None else sum(len(c.token_ids) for c in completions)
        self.metrics.tokens.inc(generated)  # rlfleet_tokens_total: its rate is the worker's tokens/s
        return GenerateResult(
            job_id=request.job_id, worker_id=self.worker_id, weight_version=version, ref=ref,
            num_prompts=len(request.prompt_token_ids), num_samples=len(completions),
            num_tokens=generated, seconds=seconds,
        )  # fmt: skip

    async def _run_episodes(self, request: GenerateRequest) -> Episodes:
        """The job's episodes (:mod:`~rlfleet.rollout.episodes`): each engine call under the engine gate
        with the job's deadline, the environment over this worker's transport."""
        assert request.episode is not None

        async def one_call(contexts: list[list[int]], params: SamplingParams) -> tuple[list[Completion], int]:
            async with self._gpu:
                stop_at = self._stop_at(request)
                version = self.weight_version
                completions = await asyncio.to_thread(
                    self.engine.generate, contexts, params, deadline=stop_at
                )
            return completions, version

        def time_left() -> float | None:
            stop_at = self._stop_at(request)
            return None if stop_at is None else stop_at - time.monotonic()

        if self._turns is None:
            self._turns = ChatTurns(self.engine.tokenizer)
        cfg = self.config
        cluster = cfg.env_cluster or ("default" if cfg.env_url else cfg.fleet.cluster)
        transport = self._env_transport or self.transport
        env = EnvClient(transport, cluster, request.episode, time_left, token=self._env_token)
        episodes = await EpisodeDriver(request, one_call, env, self._turns).run()
        ends = Counter(ep.end for ep in episodes.episodes)
        logger.info("episode job %s: %d episodes, %s", request.job_id, len(episodes.episodes),
                    ", ".join(f"{n} {end}" for end, n in sorted(ends.items())))  # fmt: skip
        return episodes

    async def open_agents(self, message: AgentOpen) -> AgentOpened:
        """Serve the OpenAI-compatible endpoint for the run's agents
        (:mod:`~rlfleet.rollout.openai_endpoint`), on the tensor plane's bind host; its requests
        generate under the engine gate."""
        if self.agents is None:
            max_len = getattr(self.engine, "max_model_len", None)
            self.agents = OpenAIEndpoint(self.worker_id, self.config.model_path, self.engine.tokenizer,
                                         self._agent_generate, max_len)  # fmt: skip
        plane = self.config.tensor_plane
        url = await self.agents.open(message, plane.bind_host, plane.advertise_host)
        return AgentOpened(worker_id=self.worker_id, url=url)

    async def _agent_generate(
        self, context: list[int], params: SamplingParams, timeout_s: float
    ) -> tuple[Completion, int]:
        """One agent request's completion, and the weight version that sampled it."""
        self.busy += 1
        try:
            async with self._gpu:
                version = self.weight_version
                [completion] = await asyncio.to_thread(self.engine.generate, [context], params,
                                                       deadline=time.monotonic() + timeout_s)  # fmt: skip
        finally:
            self.busy -= 1
        self.metrics.tokens.inc(len(completion.token_ids))
        return completion, version

    async def collect_agents(self, message: AgentCollect) -> GenerateResult:
        """The batch of a chunk's agent sessions (loss_mask and ``episode_*`` fields as episodes have),
        in this worker's store; the sessions are dropped."""
        t0 = time.perf_counter()
        if self.agents is None:
            raise WrongMessageKind("an opened agent endpoint (rollout.agent_open first)", message.kind)
        pad = self.engine.pad_token_id
        episodes, counts = self.agents.collect(message, pad)
        completions, versions = episodes.completions(self._decode), episodes.versions()
        tensors = to_rollout_tensors(completions, pad, self.engine.tokenizer, versions)
        tensors.update(episodes.tensors())
        version = episodes.versions_used[0] if episodes.versions_used else self.weight_version
        ref = self.store.put_local(f"rollout/{message.job_id}", tensors)
        self._batches.append((version, ref.key))
        logger.info("agent job %s: %s", message.job_id, ", ".join(f"{v} {k}" for k, v in counts.items()))
        return GenerateResult(
            job_id=message.job_id, worker_id=self.worker_id, weight_version=version, ref=ref,
            num_prompts=len(message.prompt_token_ids), num_samples=len(completions),
            num_tokens=episodes.sampled_tokens, seconds=time.perf_counter() - t0,
        )  # fmt: skip

    def _decode(self, token_ids: list[list[int]]) -> list[str]:
        return self.engine.tokenizer.batch_decode(token_ids, skip_special_tokens=True)

    async def _generate_segments(self, request: GenerateRequest, segment: int) -> Segmented:
        """The job in segments of ``segment`` new tokens, the engine let go between them
        (:mod:`~rlfleet.rollout.partial_rollout`); each segment checks the job's deadline."""

        async def one_call(prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
            stop_at = self._stop_at(request)
            return await asyncio.to_thread(self.engine.generate, prompts, params, deadline=stop_at)

        job = await generate_in_segments(request.prompt_token_ids, request.sampling, segment, self._gpu,
                                         lambda: self.weight_version, one_call, self._decode)  # fmt: skip
        if job.loads_between:
            logger.info("generate job %s went on across %d weight load(s): versions %s", request.job_id,
                        job.loads_between, job.versions_used)  # fmt: skip
        return job

    def _job_name(self, request: GenerateRequest) -> str:
        return f"generate job {request.job_id} on rollout worker {self.worker_id}"

    def _stop_at(self, request: GenerateRequest) -> float | None:
        """The request's deadline, plus ``limits.deadline_slack_s``, on this worker's ``time.monotonic()``
        clock (None: it has none); raises :class:`DeadlinePassed` once it has passed."""
        if request.deadline is None:
            return None
        left = request.deadline + self.config.limits.deadline_slack_s - time.time()
        if left <= 0:
            raise DeadlinePassed(self._job_name(request), -left)
        return time.monotonic() + left

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

        CUDA IPC (the trainer shares this GPU): the engine maps the trainer's buffers. gRPC: every
        bucket the message names is pulled from the trainer's store first, then the whole version
        goes to the engine in one call, which validates all of it before it changes anything. All
        or nothing: a fetch or a check that fails leaves the engine on the version it reports (the
        error goes back to the sender); so does a copy that fails partway in the HF engine, which
        restores what it overwrote, while the vLLM engine refuses to generate until a full load
        succeeds. The price: the version's buckets are held in host memory while they load.

        Delta sync (``delta_from``): a worker asked to ``hold`` keeps its last gRPC load for the next
        delta (only the delta crosses the network). An engine that holds its weights under the
        trainer's names (:class:`~rlfleet.rollout.engines.base.DeltaEngine`: the HF engine) takes
        the delta straight into them and needs no copy; otherwise (vLLM) the worker keeps a host
        copy, writes the delta into it and loads the whole version from it. A delta on any other
        version raises :class:`DeltaBaseMissing` (the controller then sends the whole version).
        Every gRPC load answers the fingerprint of the weights loaded
        (:mod:`rlfleet.common.tensors.weight_sync`): after a delta in the engine, of the engine's
        own tensors.

        A LoRA adapter (``adapter``, over gRPC) replaces the adapter the engine serves on its base
        (``Engine.load_adapter``); its fingerprint is the adapter's.
        """
        t0 = time.perf_counter()
        carrier = self.carrier(message)
        version = message.weight_version
        fingerprint = ""
        async with self._gpu:
            if message.adapter is not None:  # a LoRA adapter, applied to the base the engine holds
                items = await self._fetch_version(message)
                self._forget_held()
                await asyncio.to_thread(self.engine.load_adapter, items, message.adapter, version)
                fingerprint = await asyncio.to_thread(weights_fingerprint, items)
            elif carrier == "cuda_ipc":
                self._forget_held()
                await asyncio.to_thread(self.engine.load_ipc, message.ipc_buckets, version)
            else:
                fingerprint = await self._load_grpc(message)
            self.weight_version = version
            keep = message.keep_from_version
            self._release_older_batches(min(keep, version) if keep >= 0 else version)
        seconds = time.perf_counter() - t0
        logger.info("loaded weight version %d by %s in %.3fs", message.weight_version, carrier, seconds)
        return WeightsLoaded(worker_id=self.worker_id, weight_version=message.weight_version, seconds=seconds,
                             carrier=carrier, fingerprint=fingerprint,
                             delta=carrier == "grpc" and message.delta_from >= 0)  # fmt: skip

    def _forget_held(self) -> None:
        self._held, self._held_names = None, None

    async def _load_grpc(self, message: LoadWeights) -> str:
        """Load the version ``message`` names by gRPC, whole or as a delta (in the engine when it
        takes one, else through the host copy), held for the next delta when ``message.hold`` says
        so; the fingerprint of the version as now loaded (of a delta in the engine, each bucket's
        weights hashed as soon as they are written, while the next is pulled)."""
        version, engine = message.weight_version, self.engine
        in_engine = isinstance(engine, DeltaEngine)
        if message.delta_from >= 0 and isinstance(engine, DeltaEngine):
            names = self._held_names
            served = engine.weight_version  # the engine's weights are the base: it serves that version
            if names is None or not message.delta_from == self._held_version == served:
                raise DeltaBaseMissing(self.worker_id, self._held_version if names is not None else None,
                                       message.delta_from)  # fmt: skip
            # each bucket written as it comes, while the next is pulled; all or nothing: on an error
            # (a pull's too) the engine still serves the version held, the base kept
            with Fingerprinter() as hashes:
                items = await self._stores.fetch_into(
                    message.delta_buckets,
                    lambda deltas: engine.load_delta(deltas, names, version, hashes.add_all),
                )
                fingerprint = await asyncio.to_thread(hashes.value, items)
        else:
            items = await self._fetch_version(message)  # a delta that does not fit: refused, copy intact
            try:
                await asyncio.to_thread(self.engine.load_weights, items, version)
            except BaseException:
                self._forget_held()  # a delta written into the copy, or the engine's state unknown
                raise
            fingerprint = await asyncio.to_thread(weights_fingerprint, items)
        self._held_version = version  # held for the next delta only when asked: any older copy dropped
        self._held = dict(items) if message.hold and not in_engine else None
        self._held_names = [name for name, _ in items] if message.hold and in_engine else None
        return fingerprint

    async def _fetch_version(self, message: LoadWeights) -> list[tuple[str, torch.Tensor]]:
        """The whole version ``message`` names, as ``(name, tensor)``: its buckets, or (a delta on the
        version this worker holds a copy of) that copy with the delta buckets written into it."""
        if message.delta_from < 0:
            return [
                item for bucket in await self._stores.fetch_all(message.buckets) for item in bucket.items()
            ]
        held = self._held
        if held is None or self._held_version != message.delta_from:
            raise DeltaBaseMissing(self.worker_id, self._held_version if held is not None else None,
                                   message.delta_from)  # fmt: skip
        deltas = await self._stores.fetch_all(message.delta_buckets)
        # each bucket checked whole before it is written, all put back on a refusal: the copy intact
        await asyncio.to_thread(write_delta_in_place, held, deltas)
        self._held = None  # written into: the new version's, held again once the engine has it
        return list(held.items())

    def _release_older_batches(self, keep_from: int) -> None:
        """Drop the batches generated before version ``keep_from`` (the version now loaded, or older
        in a pipelined run, whose batches generated ahead are trained after this load): the trainer
        has trained on them (a step publishes only after it trains). Only the owner deletes; the TTL
        is the backstop."""
        kept = []
        for version, key in self._batches:
            if version < keep_from:
                self.store.delete(key)
            else:
                kept.append((version, key))
        self._batches = kept

    async def teardown(self) -> None:
        if self.agents is not None:
            await self.agents.close()
        if self._env_transport is not None:
            await self._env_transport.close()
        await self._stores.close()
        await self.store.stop()
        self.engine.close()
