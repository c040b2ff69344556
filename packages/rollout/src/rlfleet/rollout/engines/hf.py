"""The HF transformers engine: batched ``generate`` on CPU or one GPU, weights replaced in place.

It is the fallback and test engine behind the :class:`~rlfleet.rollout.engines.base.Engine`
protocol (vLLM is the throughput engine). Each call expands prompts into ``n`` rows, sorts rows
by prompt length when they span several batches (less padding), runs ``model.generate`` on
left-padded batches of at most ``max_batch_size`` rows with the KV cache on, and returns the
completions prompt-major.

Semantics (matching vLLM where it has them):

- stop: the model's EOS ids (from the tokenizer and the model's generation config) plus
  ``params.stop_token_ids``; the stop token is kept as the last token and ``finish_reason`` is
  ``"stop"``; otherwise ``"length"`` after exactly ``max_tokens`` tokens.
- logprobs: ``log_softmax(raw_logits / temperature)`` of each sampled token (temperature 1 for
  greedy), independent of top-p / top-k truncation: what the trainer recomputes. They are recorded
  by :class:`LogprobRecorder`, a logits processor placed ahead of HF's temperature / top-k / top-p
  warpers (``generate`` appends user processors before the warpers), so it sees the raw float32
  logits of each step. It keeps only the current step's ``log_softmax(logits / temperature)``
  (B, V) and gathers the chosen token's entry on the next step, so memory stays O(B * V) instead
  of the O(B * T * V) that ``output_logits=True`` holds.
- context: a prompt that with ``max_tokens`` does not fit the model's ``max_position_embeddings``
  is refused (:class:`~rlfleet.rollout.errors.InvalidPrompt`) before anything runs, as in vLLM.
- deadline: a call given one stops between decode steps once it has passed (:class:`DeadlineStop`)
  and raises :class:`~rlfleet.rollout.errors.DeadlinePassed`.
- seeding: ``params.seed`` if set, else a seed drawn from the engine's own generator (seeded
  with ``seed`` at construction), so a fresh engine replays the same calls identically. The
  global RNG is forked, so the caller's RNG state is untouched.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from rlfleet.common.control.messages import SamplingParams
from rlfleet.common.errors import BatchContractError, ConfigError
from rlfleet.common.schema.batch import pad_left
from rlfleet.common.schema.carriers import IpcBucket
from rlfleet.common.schema.trainer import LoraSettings
from rlfleet.rollout.engines.base import Completion, WeightsInput
from rlfleet.rollout.engines.checkpoint import load_tokenizer
from rlfleet.rollout.engines.cuda_ipc import device_uuid, load_and_release, meta_items
from rlfleet.rollout.engines.lora_adapter import merged, parse_adapter, scale
from rlfleet.rollout.engines.weights import (
    TiedPair,
    copy_weights,
    load_targets,
    validate,
    write_delta_in_place,
)
from rlfleet.rollout.errors import DeadlinePassed, EngineClosed, InvalidPrompt, IpcUnavailable

logger = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

_Row = tuple[list[int], list[float], bool]  # generated tokens, their logprobs, stopped on a stop id


class HFEngine:
    """Generation with a ``transformers`` causal LM loaded from ``model_path`` (an HF checkpoint dir)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        seed: int = 0,
        max_batch_size: int = 64,
        model_id: str | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        if dtype not in DTYPES:
            raise ConfigError("dtype", dtype, f"expected one of {', '.join(DTYPES)}")
        if max_batch_size < 1:
            raise ConfigError("max_batch_size", max_batch_size, "must be at least 1")
        self.model_id = model_id or str(model_path)
        self.max_batch_size = max_batch_size
        self._device = torch.device(device)
        self._tokenizer = load_tokenizer(model_path, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code
        )
        self._model: Any = model.to(self._device).eval()
        self._eos_ids = _eos_ids(self._model, self._tokenizer)
        self._pad_id = _pad_id(self._model, self._tokenizer)
        self._model.generation_config = neutral_generation_config(
            self._tokenizer.bos_token_id, self._eos_ids, self._pad_id
        )
        self._vocab_size = int(self._model.get_input_embeddings().weight.shape[0])
        text_config = self._model.config.get_text_config()
        self.max_model_len: int | None = getattr(text_config, "max_position_embeddings", None)
        """The model's positions: the longest prompt + ``max_tokens`` a request may use."""
        self._targets = load_targets(self._model)
        self._tied = tuple(
            p for p in _tied_pairs(self._model) if p.first in self._targets and p.second in self._targets
        )
        self._rng = torch.Generator().manual_seed(seed)
        self._weight_version = 0
        self._adapter_base: dict[str, torch.Tensor] = {}  # LoRA: the base weights of the adapted layers
        self._lock = threading.Lock()
        logger.info("HF engine %s on %s (%s), eos %s", self.model_id, self._device, dtype, self._eos_ids)

    # --- protocol -----------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer, left padding, pad token = EOS when it had none."""
        return self._tokenizer

    @property
    def weight_version(self) -> int:
        """Version of the loaded weights: 0 after loading from disk."""
        return self._weight_version

    @property
    def model(self) -> torch.nn.Module:
        """The live HF model (for in-process hand-over and tests); raises once closed."""
        self._check_open()
        return self._model

    @property
    def pad_token_id(self) -> int:
        """The id used to pad prompts and finished rows."""
        return self._pad_id

    def set_weight_version(self, version: int) -> None:
        """Record that the weights now loaded are ``version`` (>= 0)."""
        if version < 0:
            raise ValueError(f"weight version must be >= 0, got {version}")
        self._weight_version = version

    def generate(
        self, prompt_token_ids: list[list[int]], params: SamplingParams, *, deadline: float | None = None
    ) -> list[Completion]:
        """``len(prompt_token_ids) * params.n`` completions, prompt-major (see the module docstring).

        Past ``deadline`` (``time.monotonic()`` seconds) the call stops between decode steps and
        raises :class:`DeadlinePassed`; nothing of it is returned.
        """
        self._check_open()
        self._validate_prompts(prompt_token_ids, params.max_tokens)
        cancel = DeadlineStop(deadline, f"generation on {self.model_id}") if deadline is not None else None
        rows = [(p, s) for p in range(len(prompt_token_ids)) for s in range(params.n)]
        order = list(range(len(rows)))
        if len(rows) > self.max_batch_size:  # group similar lengths; stable, so samples stay together
            order.sort(key=lambda r: -len(prompt_token_ids[rows[r][0]]))
        seed = params.seed if params.seed is not None else self._draw_seed()
        outputs: list[_Row | None] = [None] * len(rows)
        with self._lock, torch.inference_mode(), seeded(seed, self._device):
            for start in range(0, len(order), self.max_batch_size):
                chunk = order[start : start + self.max_batch_size]
                if cancel is not None:
                    cancel.check()
                batch = self._generate_batch([prompt_token_ids[rows[r][0]] for r in chunk], params, cancel)
                for r, out in zip(chunk, batch, strict=True):
                    outputs[r] = out
        done = [o for o in outputs if o is not None]
        assert len(done) == len(rows)
        texts = self._tokenizer.batch_decode([o[0] for o in done], skip_special_tokens=True)
        return [
            Completion(
                prompt_index=p,
                sample_index=s,
                prompt_token_ids=list(prompt_token_ids[p]),
                token_ids=tokens,
                logprobs=logprobs,
                text=text,
                finish_reason="stop" if stopped else "length",
            )
            for (p, s), (tokens, logprobs, stopped), text in zip(rows, done, texts, strict=True)
        ]

    def load_weights(self, weights: WeightsInput, version: int | None = None) -> None:
        """Copy a bucket of ``(hf_name, tensor)`` into the live parameters in place.

        The bucket is validated as a whole first (names, shapes, float vs non-float dtypes; float
        casts and device moves are done by the copy), and a copy that fails partway restores what
        it overwrote (:func:`~rlfleet.rollout.engines.weights.copy_weights`): the engine keeps the
        version it reports. For tied embeddings, a tensor sent under one of the tied names updates
        both. ``version``, if given, is set after the copy.
        """
        self._check_open()
        with self._lock:
            names = copy_weights(self._targets, weights, self._tied)
            self._adapter_base = {}  # whole weights: the base of any adapter to come, none applied now
        if version is not None:
            self.set_weight_version(version)
        logger.debug("loaded %d weights into %s", len(names), self.model_id)

    def load_delta(
        self,
        deltas: Iterable[Mapping[str, torch.Tensor]],
        names: Sequence[str],
        version: int | None = None,
        written: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Write a weight delta on the version served straight into the live parameters, bucket by
        bucket as ``deltas`` yields them (:class:`~rlfleet.rollout.engines.base.DeltaEngine`): each
        checked whole before it is written, the elements they overwrite kept until all are in
        (:func:`~rlfleet.rollout.engines.weights.write_delta_in_place`, which gives ``written``
        each bucket's weights once written). Returns the version's weights ``names`` as now served."""
        self._check_open()
        unknown = [name for name in names if name not in self._targets]
        if unknown:
            raise BatchContractError(unknown[0], f"not a weight of {self.model_id}")
        with self._lock:
            if self._adapter_base:
                raise BatchContractError("delta", "a LoRA adapter is applied: a delta needs whole weights")
            write_delta_in_place(self._targets, deltas, self._tied, written)
        if version is not None:
            self.set_weight_version(version)
        return [(name, self._targets[name]) for name in names]

    def load_adapter(self, weights: WeightsInput, settings: LoraSettings, version: int | None = None) -> None:
        """Apply a published LoRA adapter (PEFT's names; see :mod:`.lora_adapter`) in place of the one
        served: each adapted layer becomes its base weight plus ``(alpha / rank) B A``, a layer the
        new adapter leaves out goes back to its base. The adapter is checked whole first and the
        copy is all or nothing (the engine keeps the version it reports on any error)."""
        self._check_open()
        items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
        with self._lock:
            shapes = {name: tuple(t.shape) for name, t in self._targets.items()}
            layers = parse_adapter(items, settings, shapes)
            base = dict(self._adapter_base)
            for layer in layers:
                if layer.name not in base:
                    base[layer.name] = self._targets[layer.name].detach().clone()
            factor = scale(settings)
            new = {layer.name: merged(base[layer.name], layer, factor) for layer in layers}
            new.update({n: t for n, t in base.items() if n not in new})  # no longer adapted: the base
            copy_weights(self._targets, list(new.items()), self._tied)
            self._adapter_base = base
        if version is not None:
            self.set_weight_version(version)
        logger.debug("applied a LoRA adapter on %d layers to %s", len(layers), self.model_id)

    def load_ipc(self, buckets: Sequence[IpcBucket], version: int | None = None) -> None:
        """Load a publish shared by CUDA IPC from this engine's GPU: map, validate, copy on the device."""
        self._check_open()
        if self._device.type != "cuda":
            raise IpcUnavailable("the HF engine runs on CPU; CUDA IPC buckets need it on the trainer's GPU")
        validate(self._targets, meta_items(buckets))
        with self._lock:
            load_and_release(
                buckets, self._device, lambda items: copy_weights(self._targets, items, self._tied)
            )
        if version is not None:
            self.set_weight_version(version)

    @property
    def gpu_uuids(self) -> list[str]:
        """The GPU this engine runs on, or ``[]`` on CPU."""
        return [device_uuid(self._device)] if self._device.type == "cuda" else []

    def close(self) -> None:
        """Free the model (and the CUDA cache); later calls raise :class:`EngineClosed`."""
        with self._lock:
            self._model = None
            self._targets = {}
        gc.collect()
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    # --- internals ----------------------------------------------------------------------------

    def _draw_seed(self) -> int:
        """A call seed from the engine's own generator: reproducible per engine seed and call order."""
        return int(torch.randint(0, 2**62, (1,), generator=self._rng))

    def _check_open(self) -> None:
        if self._model is None:
            raise EngineClosed(self.model_id)

    def _validate_prompts(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> None:
        cap = self.max_model_len
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise InvalidPrompt(i, "is empty")
            bad = [t for t in prompt if not 0 <= t < self._vocab_size]
            if bad:
                raise InvalidPrompt(i, f"token ids {bad[:5]} outside the vocabulary [0, {self._vocab_size})")
            if cap is not None and len(prompt) + max_tokens > cap:
                raise InvalidPrompt(i, prompt_len=len(prompt), max_tokens=max_tokens, cap=cap)

    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, cancel: DeadlineStop | None = None
    ) -> list[_Row]:
        """One ``model.generate`` call on left-padded ``prompts`` (B rows); ``cancel`` ends it between
        decode steps once its deadline has passed."""
        input_ids, attention_mask = pad_left(prompts, self._pad_id)
        width = input_ids.shape[1]
        stop_ids = sorted(set(self._eos_ids) | set(params.stop_token_ids))
        recorder = LogprobRecorder(params.temperature) if params.logprobs else None
        out = self._model.generate(
            input_ids=input_ids.to(self._device),
            attention_mask=attention_mask.to(self._device),
            generation_config=generation_config(params, stop_ids, self._pad_id),
            logits_processor=LogitsProcessorList([recorder] if recorder else []),
            stopping_criteria=StoppingCriteriaList([cancel] if cancel else []),
        )
        generated = out.sequences[:, width:]  # (B, T)
        lengths, stopped = cut_at_stop(generated, stop_ids, params.max_tokens)
        tokens = generated.tolist()
        logprobs = recorder.finish(generated).tolist() if recorder else [[] for _ in prompts]
        return [
            (row[:n], lp[:n], stop)
            for row, lp, n, stop in zip(tokens, logprobs, lengths, stopped, strict=True)
        ]


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """EOS ids from the tokenizer and the checkpoint's generation config (which may list several)."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, model.generation_config.eos_token_id, model.config.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    return sorted(ids)


def _pad_id(model: Any, tokenizer: Any) -> int:
    for candidate in (
        tokenizer.pad_token_id,
        model.generation_config.pad_token_id,
        model.config.pad_token_id,
    ):
        if isinstance(candidate, int):
            return candidate
    raise ConfigError("tokenizer.pad_token", None, "the checkpoint has neither a pad nor an EOS token")


def _tied_pairs(model: Any) -> tuple[TiedPair, ...]:
    """The (input embedding, LM head) pair when the config ties them, by state_dict name."""
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return ()
    out_emb = model.get_output_embeddings()
    in_emb = model.get_input_embeddings()
    if out_emb is None or in_emb is None:
        return ()
    by_module = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    first = by_module.get(id(in_emb))
    second = by_module.get(id(out_emb))
    if first is None or second is None:
        return ()
    return (TiedPair(f"{first}.weight", f"{second}.weight"),)


# --- sampling: generation config, exact logprobs, seeding, stop detection -------------------------


class LogprobRecorder(LogitsProcessor):
    """Records ``log_softmax(raw_logits / temperature)`` of every sampled token; passes scores through.

    ``temperature == 0`` (greedy) records the plain ``log_softmax(raw_logits)``.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature if temperature > 0 else 1.0
        self._steps: list[torch.Tensor] = []
        self._previous: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """input_ids (B, L): prompt plus tokens so far; scores (B, V): this step's raw logits."""
        if self._previous is not None:
            self._steps.append(self._previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """Logprobs (B, T) of ``generated`` (B, T), the tokens ``generate`` returned after the prompt.

        ``generate`` may run one step more than it returns (deferred stop checks on GPU); only the
        first T steps are kept.
        """
        steps = generated.shape[1]
        if len(self._steps) < steps:
            assert self._previous is not None and len(self._steps) == steps - 1
            self._steps.append(self._previous.gather(-1, generated[:, -1:]).squeeze(-1))
        self._previous = None
        if steps == 0:
            return torch.zeros((generated.shape[0], 0), dtype=torch.float32, device=generated.device)
        return torch.stack(self._steps[:steps], dim=1)


class DeadlineStop(StoppingCriteria):
    """Cancels a ``generate`` call between decode steps: raises :class:`DeadlinePassed` once
    ``deadline`` (``time.monotonic()`` seconds) has passed. Raising (rather than reporting every row
    done) leaves no truncated rows that could pass for finished ones."""

    def __init__(self, deadline: float, what: str) -> None:
        self.deadline = deadline
        self.what = what
        self.started = time.monotonic()

    def check(self) -> None:
        now = time.monotonic()
        if now >= self.deadline:
            raise DeadlinePassed(self.what, now - self.deadline, now - self.started)

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        """input_ids (B, L): no row is done on this criterion's account; it raises instead."""
        self.check()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


def neutral_generation_config(bos: int | None, eos: Sequence[int], pad: int) -> GenerationConfig:
    """A model-level config with no sampling defaults, so a checkpoint's generation_config.json
    (repetition penalties, top_k=20, suppressed tokens...) never leaks into RL sampling."""
    return GenerationConfig(bos_token_id=bos, eos_token_id=list(eos) or None, pad_token_id=pad)


def generation_config(params: SamplingParams, stop_ids: Sequence[int], pad: int) -> GenerationConfig:
    """The per-call HF config for ``params``: every sampling knob set explicitly.

    Greedy at ``temperature == 0``; ``top_k <= 0`` disables top-k (HF's 0), as -1 does in vLLM.
    """
    common = {
        "max_new_tokens": params.max_tokens,
        "min_new_tokens": 0,
        "repetition_penalty": 1.0,
        "num_beams": 1,
        "eos_token_id": list(stop_ids) or None,
        "pad_token_id": pad,
        "use_cache": True,
        "return_dict_in_generate": True,
        "output_scores": False,
        "output_logits": False,
    }
    if params.temperature == 0:  # warpers are not applied without do_sample: leave them unset
        return GenerationConfig(do_sample=False, **common)
    return GenerationConfig(
        do_sample=True,
        temperature=params.temperature,
        top_k=params.top_k if params.top_k > 0 else 0,
        top_p=params.top_p,
        **common,
    )


def cut_at_stop(
    generated: torch.Tensor, stop_ids: Sequence[int], max_tokens: int
) -> tuple[list[int], list[bool]]:
    """Per row of ``generated`` (B, T): how many tokens to keep, and whether it stopped on a stop id.

    A row keeps everything up to and including its first stop token; a row without one keeps
    all ``T`` tokens, which is ``max_tokens`` (HF only ends early once every row has stopped).
    """
    rows, steps = generated.shape
    if not stop_ids or steps == 0:
        return [steps] * rows, [False] * rows
    is_stop = torch.isin(generated, torch.tensor(list(stop_ids), device=generated.device))
    stopped = is_stop.any(dim=1)
    first = is_stop.to(torch.int8).argmax(dim=1)
    lengths = torch.where(stopped, first + 1, torch.full_like(first, steps))
    stopped_list = stopped.tolist()
    if not all(stopped_list) and steps != max_tokens:
        raise RuntimeError(f"generate returned {steps} tokens for a row that did not stop (max {max_tokens})")
    return lengths.tolist(), stopped_list


@contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Run the block with the global RNG (CPU, and ``device`` if CUDA) seeded, restoring it after.

    HF ``generate`` samples with ``torch.multinomial`` on the global generator, so forking and
    seeding it is the only way to make a call reproducible without touching the caller's RNG.
    """
    cuda = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else None
    with torch.random.fork_rng(devices=[index] if cuda else []):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield
