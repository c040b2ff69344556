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
  greedy), independent of top-p / top-k truncation: what the trainer recomputes.
- seeding: ``params.seed`` if set, else a seed drawn from the engine's own generator (seeded
  with ``seed`` at construction), so a fresh engine replays the same calls identically. The
  global RNG is forked, so the caller's RNG state is untouched.
"""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

from rlfleet.common.carriers import IpcBucket
from rlfleet.common.errors import ConfigError
from rlfleet.common.messages import SamplingParams
from rlfleet.rollout.engines.base import Completion, WeightsInput
from rlfleet.rollout.engines.cuda_ipc import device_uuid, load_and_release, meta_items
from rlfleet.rollout.engines.hf_sampling import (
    LogprobRecorder,
    cut_at_stop,
    generation_config,
    neutral_generation_config,
    seeded,
)
from rlfleet.rollout.engines.tensors import pad_left
from rlfleet.rollout.engines.weights import TiedPair, copy_weights, load_targets, validate
from rlfleet.rollout.errors import EngineClosed, InvalidPrompt, IpcUnavailable

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
    ) -> None:
        if dtype not in DTYPES:
            raise ConfigError("dtype", dtype, f"expected one of {', '.join(DTYPES)}")
        if max_batch_size < 1:
            raise ConfigError("max_batch_size", max_batch_size, "must be at least 1")
        self.model_id = model_id or str(model_path)
        self.max_batch_size = max_batch_size
        self._device = torch.device(device)
        self._tokenizer = _load_tokenizer(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype])
        self._model: Any = model.to(self._device).eval()
        self._eos_ids = _eos_ids(self._model, self._tokenizer)
        self._pad_id = _pad_id(self._model, self._tokenizer)
        self._model.generation_config = neutral_generation_config(
            self._tokenizer.bos_token_id, self._eos_ids, self._pad_id
        )
        self._vocab_size = int(self._model.get_input_embeddings().weight.shape[0])
        self._targets = load_targets(self._model)
        self._tied = tuple(
            p for p in _tied_pairs(self._model) if p.first in self._targets and p.second in self._targets
        )
        self._rng = torch.Generator().manual_seed(seed)
        self._weight_version = 0
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

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        """``len(prompt_token_ids) * params.n`` completions, prompt-major (see the module docstring)."""
        self._check_open()
        self._validate_prompts(prompt_token_ids)
        rows = [(p, s) for p in range(len(prompt_token_ids)) for s in range(params.n)]
        order = list(range(len(rows)))
        if len(rows) > self.max_batch_size:  # group similar lengths; stable, so samples stay together
            order.sort(key=lambda r: -len(prompt_token_ids[rows[r][0]]))
        seed = params.seed if params.seed is not None else self._draw_seed()
        outputs: list[_Row | None] = [None] * len(rows)
        with self._lock, torch.inference_mode(), seeded(seed, self._device):
            for start in range(0, len(order), self.max_batch_size):
                chunk = order[start : start + self.max_batch_size]
                batch = self._generate_batch([prompt_token_ids[rows[r][0]] for r in chunk], params)
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
        casts and device moves are done by the copy). For tied embeddings, a tensor sent under
        one of the tied names updates both. ``version``, if given, is set after the copy.
        """
        self._check_open()
        with self._lock:
            names = copy_weights(self._targets, weights, self._tied)
        if version is not None:
            self.set_weight_version(version)
        logger.debug("loaded %d weights into %s", len(names), self.model_id)

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

    def _validate_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise InvalidPrompt(i, "is empty")
            bad = [t for t in prompt if not 0 <= t < self._vocab_size]
            if bad:
                raise InvalidPrompt(i, f"token ids {bad[:5]} outside the vocabulary [0, {self._vocab_size})")

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[_Row]:
        """One ``model.generate`` call on left-padded ``prompts`` (B rows)."""
        input_ids, attention_mask = pad_left(prompts, self._pad_id)
        width = input_ids.shape[1]
        stop_ids = sorted(set(self._eos_ids) | set(params.stop_token_ids))
        recorder = LogprobRecorder(params.temperature) if params.logprobs else None
        out = self._model.generate(
            input_ids=input_ids.to(self._device),
            attention_mask=attention_mask.to(self._device),
            generation_config=generation_config(params, stop_ids, self._pad_id),
            logits_processor=LogitsProcessorList([recorder] if recorder else []),
        )
        generated = out.sequences[:, width:]  # (B, T)
        lengths, stopped = cut_at_stop(generated, stop_ids, params.max_tokens)
        tokens = generated.tolist()
        logprobs = recorder.finish(generated).tolist() if recorder else [[] for _ in prompts]
        return [
            (row[:n], lp[:n], stop)
            for row, lp, n, stop in zip(tokens, logprobs, lengths, stopped, strict=True)
        ]


def _load_tokenizer(model_path: str | Path) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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
