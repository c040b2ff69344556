"""Prompt datasets for RL: read a JSONL/CSV/Parquet file (or an ``hf:`` dataset, or rows in memory: a
list of dicts, a ``datasets.Dataset``), render and tokenize prompts, serve seeded batches.

The user builds a ``PromptDataset`` before the model is known; the trainer then binds the actor's
tokenizer (``bind_tokenizer``), which renders each prompt (chat template when the tokenizer has
one), tokenizes it on ``num_workers`` threads and applies the overlong policy::

    file rows ──read──> rows (prompt + metadata) ──bind_tokenizer──> PromptItems (text, token ids)
                                                                        │ seeded shuffle per epoch
                                                          batches(batch_size, epoch) / next_batch()

The position (epoch, items consumed in that epoch) is kept as batches are handed out, so
``state_dict()`` taken after a step resumes right after that step's batch.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rlfleet.controller.dataset_files import (
    Message,
    Prompt,
    is_in_memory,
    memory_label,
    read_memory_records,
    read_records,
)
from rlfleet.controller.errors import DatasetError
from rlfleet.controller.hf_datasets import is_hf_source, read_hf_records
from rlfleet.controller.run_tokenizer import load_run_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

Overlong = Literal["filter", "truncate", "error"]
OVERLONG_POLICIES: tuple[str, ...] = ("filter", "truncate", "error")


@dataclass(frozen=True, slots=True)
class PromptItem:
    """One prompt ready for rollout.

    ``token_ids`` (T,) are what the model must see (chat template and special tokens included);
    ``text`` is their string form (re-decoded after a truncation). Until a tokenizer is bound,
    ``text`` is the raw prompt (system prompt first, if any) and ``token_ids`` is ``None``.
    """

    index: int
    """Row number in the source file (0-based); stable across shuffles and shards."""
    text: str
    token_ids: list[int] | None
    metadata: dict[str, Any] = field(default_factory=dict)
    """The row's other columns (e.g. ``answer``), for the reward tier."""
    prompt: Prompt = ""
    """The prompt as stored: a string or a list of ``{"role", "content"}`` messages."""
    truncated: bool = False


@dataclass(frozen=True, slots=True)
class _Row:
    index: int
    prompt: Prompt
    metadata: dict[str, Any]


DataSource = str | os.PathLike[str] | Sequence[Mapping[str, Any]] | Any
"""Where prompts come from: a file path, an ``hf:`` source, a list of dicts or a ``datasets.Dataset``."""


class PromptDataset:
    """Prompts from one file (or rows in memory), rendered for one tokenizer, served in seeded epochs.

    ``data_path`` is a path, an ``hf:`` source, a list (or tuple) of dicts or a ``datasets.Dataset``
    (rows in memory are copied when read: changing the list later changes nothing). ``len()`` counts
    prompts after the overlong filter once a tokenizer is bound (all rows before).
    """

    def __init__(
        self,
        data_path: DataSource,
        max_prompt_length: int = 512,
        num_workers: int = 1,
        prompt_key: str = "prompt",
        seed: int = 0,
        tokenizer: PreTrainedTokenizerBase | str | os.PathLike[str] | None = None,
        shuffle: bool = True,
        overlong: Overlong = "filter",
        metadata_keys: Sequence[str] | None = None,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
    ) -> None:
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length must be >= 1, got {max_prompt_length}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0 (0 or 1 tokenize inline), got {num_workers}")
        if overlong not in OVERLONG_POLICIES:
            raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")
        self._memory = data_path if is_in_memory(data_path) else None  # rows in memory: read once, below
        self.data_path = Path(memory_label(data_path) if self._memory is not None else data_path)
        self.max_prompt_length = max_prompt_length
        self.num_workers = num_workers
        self.prompt_key = prompt_key
        self.seed = seed
        self.shuffle = shuffle
        self.overlong: Overlong = overlong
        self.metadata_keys = tuple(metadata_keys) if metadata_keys is not None else None
        self.apply_chat_template = apply_chat_template
        self.system_prompt = system_prompt
        self._rows = self._load_rows()
        self._memory = None  # the rows are copied: the caller's object is not held
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._items: list[PromptItem] | None = self._raw_items()
        self._epoch = 0
        self._index = 0
        self._order_cache: tuple[int, list[int]] | None = None
        if tokenizer is not None:
            self.bind_tokenizer(tokenizer)

    # --- reading ------------------------------------------------------------------------------

    def _load_rows(self) -> list[_Row]:
        source = str(self.data_path)  # hf: paths go through Hugging Face datasets (hf_datasets.py)
        if self._memory is not None:
            records = read_memory_records(self._memory, self.prompt_key)
        elif is_hf_source(source):
            records = read_hf_records(source, self.prompt_key)
        else:
            records = read_records(self.data_path, self.prompt_key)
        if not records:
            raise DatasetError(self.data_path, "holds no rows")
        rows = []
        for index, (prompt, record) in enumerate(records):
            rows.append(_Row(index, prompt, self._metadata(index, record)))
        logger.info("dataset %s: read %d prompts", self.data_path, len(rows))
        return rows

    def _metadata(self, index: int, record: dict[str, Any]) -> dict[str, Any]:
        if self.metadata_keys is None:
            return {k: v for k, v in record.items() if k != self.prompt_key}
        missing = [k for k in self.metadata_keys if k not in record]
        if missing:
            raise DatasetError(self.data_path, f"row {index} lacks metadata column(s) {missing}")
        return {k: record[k] for k in self.metadata_keys}

    def _raw_items(self) -> list[PromptItem] | None:
        """Untokenized items, possible only while every prompt is a plain string."""
        if any(not isinstance(row.prompt, str) for row in self._rows):
            return None
        return [
            PromptItem(row.index, self._with_system(row.prompt), None, row.metadata, row.prompt)
            for row in self._rows
        ]

    def _with_system(self, text: str) -> str:
        # No chat template to place it in: the system prompt simply goes first.
        return f"{self.system_prompt}\n{text}" if self.system_prompt else text

    # --- tokenizing ---------------------------------------------------------------------------

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The bound tokenizer, if any."""
        return self._tokenizer

    def bind_tokenizer(self, tokenizer: PreTrainedTokenizerBase | str | os.PathLike[str]) -> None:
        """Render and tokenize every prompt for ``tokenizer`` (or a model dir to load it from).

        Applies the overlong policy; ``len()`` may shrink. Binding again re-renders from the rows.
        """
        if isinstance(tokenizer, str | os.PathLike):  # as a run loads it (its code not trusted)
            tokenizer = load_run_tokenizer(tokenizer)
        use_template = self.apply_chat_template and bool(getattr(tokenizer, "chat_template", None))
        chunks = _split(self._rows, max(1, self.num_workers) * 4)
        if self.num_workers <= 1:
            parts = [self._encode(tokenizer, chunk, use_template) for chunk in chunks]
        else:
            with ThreadPoolExecutor(self.num_workers, thread_name_prefix="rlfleet-tokenize") as pool:
                parts = list(pool.map(lambda c: self._encode(tokenizer, c, use_template), chunks))
        items = [item for part in parts for item in part]
        self._items = self._limit_length(tokenizer, items)
        self._tokenizer = tokenizer
        self._order_cache = None

    def _encode(
        self, tokenizer: PreTrainedTokenizerBase, rows: list[_Row], use_template: bool
    ) -> list[PromptItem]:
        """Render and tokenize one chunk of rows; runs on a worker thread."""
        texts = [self._render(tokenizer, row, use_template) for row in rows]
        if not texts:
            return []
        # A chat template writes its own special tokens; a raw prompt gets the tokenizer's (e.g. BOS).
        ids = tokenizer(texts, add_special_tokens=not use_template)["input_ids"]
        return [
            PromptItem(row.index, text, list(tok), row.metadata, row.prompt)
            for row, text, tok in zip(rows, texts, ids, strict=True)
        ]

    def _render(self, tokenizer: PreTrainedTokenizerBase, row: _Row, use_template: bool) -> str:
        if use_template:
            messages: list[Message] = (
                [{"role": "user", "content": row.prompt}] if isinstance(row.prompt, str) else list(row.prompt)
            )
            if self.system_prompt and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            assert isinstance(text, str)
            return text
        if not isinstance(row.prompt, str):
            why = "apply_chat_template is off" if not self.apply_chat_template else "it has no chat template"
            raise DatasetError(
                self.data_path,
                f"row {row.index}: a chat-message prompt needs a chat template ({why})",
            )
        return self._with_system(row.prompt)

    def _limit_length(self, tokenizer: PreTrainedTokenizerBase, items: list[PromptItem]) -> list[PromptItem]:
        limit = self.max_prompt_length
        over = [item for item in items if item.token_ids is not None and len(item.token_ids) > limit]
        logger.info(
            "dataset %s: %d prompts, %d longer than %d tokens (overlong=%s)",
            self.data_path, len(items), len(over), limit, self.overlong,
        )  # fmt: skip
        if not over:
            return items
        if self.overlong == "error":
            first = over[0]
            raise DatasetError(
                self.data_path,
                f"{len(over)} prompts are longer than max_prompt_length={limit} tokens (first: row "
                f"{first.index}, {len(first.token_ids or [])} tokens); raise max_prompt_length or set "
                "overlong='filter' or 'truncate'",
            )
        if self.overlong == "filter":
            kept = [item for item in items if item.token_ids is not None and len(item.token_ids) <= limit]
            logger.warning("dataset %s: filtered out %d overlong prompts", self.data_path, len(over))
            if not kept:
                reason = f"every prompt is longer than max_prompt_length={limit} tokens"
                raise DatasetError(self.data_path, reason)
            return kept
        logger.warning("dataset %s: left-truncated %d overlong prompts", self.data_path, len(over))
        return [self._truncate(tokenizer, item) for item in items]

    def _truncate(self, tokenizer: PreTrainedTokenizerBase, item: PromptItem) -> PromptItem:
        """Keep the last ``max_prompt_length`` tokens: the end of a prompt is where the question is."""
        if item.token_ids is None or len(item.token_ids) <= self.max_prompt_length:
            return item
        ids = item.token_ids[-self.max_prompt_length :]
        return replace(item, token_ids=ids, text=tokenizer.decode(ids), truncated=True)

    # --- size and sharding --------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._items) if self._items is not None else len(self._rows)

    def __getitem__(self, position: int) -> PromptItem:
        return self._require_items()[position]

    def __repr__(self) -> str:
        bound = type(self._tokenizer).__name__ if self._tokenizer is not None else "no tokenizer"
        return f"PromptDataset({str(self.data_path)!r}, {len(self)} prompts, {bound}, epoch={self._epoch})"

    def sample_items(self, n: int) -> list[PromptItem]:
        """``n`` prompts (all if fewer) picked by the seed alone: the same set every run and epoch."""
        items = self._require_items()
        picked = random.Random(f"rlfleet-samples:{self.seed}").sample(range(len(items)), min(n, len(items)))
        return [items[i] for i in sorted(picked)]

    def _require_items(self) -> list[PromptItem]:
        if self._items is None:
            raise DatasetError(
                self.data_path,
                "prompts are chat messages: bind a tokenizer with a chat template first (bind_tokenizer)",
            )
        return self._items

    def shard(self, rank: int, world_size: int) -> PromptDataset:
        """Every ``world_size``-th prompt from ``rank``: shards are disjoint and together cover the dataset.

        The shard keeps the tokenizer, seed and settings, and starts at epoch 0, index 0.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        part = copy.copy(self)
        if self._items is not None:
            part._items = self._items[rank::world_size]
            kept = {item.index for item in part._items}
            part._rows = [row for row in self._rows if row.index in kept]
        else:
            part._rows = self._rows[rank::world_size]
        part._epoch, part._index, part._order_cache = 0, 0, None
        return part

    # --- iteration ----------------------------------------------------------------------------

    def steps_per_epoch(self, batch_size: int, drop_last: bool = True) -> int:
        """Number of batches one epoch yields (the last partial batch counts only if not ``drop_last``)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        full, rest = divmod(len(self), batch_size)
        return full + (1 if rest and not drop_last else 0)

    def batches(
        self, batch_size: int, epoch: int | None = None, *, drop_last: bool = True
    ) -> Iterator[list[PromptItem]]:
        """The batches of ``epoch`` (default: the current one) in its seeded order.

        Starts at the saved position when it lies in ``epoch``, else at the epoch's start. Each
        batch moves the position past itself before it is handed out.
        """
        items = self._check_batchable(batch_size, drop_last)
        epoch = self._epoch if epoch is None else epoch
        start = self._index if epoch == self._epoch else 0
        return self._iter_epoch(items, batch_size, epoch, start, drop_last)

    def _iter_epoch(
        self, items: list[PromptItem], batch_size: int, epoch: int, start: int, drop_last: bool
    ) -> Iterator[list[PromptItem]]:
        order = self._order(epoch)
        for offset in range(start, len(order), batch_size):
            chunk = order[offset : offset + batch_size]
            if drop_last and len(chunk) < batch_size:
                return
            self._advance(epoch, offset + len(chunk), batch_size, drop_last)
            yield [items[i] for i in chunk]

    def next_batch(self, batch_size: int, *, drop_last: bool = True) -> list[PromptItem]:
        """The batch at the current position; rolls over into the next epoch when this one is done."""
        items = self._check_batchable(batch_size, drop_last)
        epoch, start = self._epoch, self._index
        if self._epoch_done(start, batch_size, drop_last):
            epoch, start = epoch + 1, 0
        chunk = self._order(epoch)[start : start + batch_size]
        self._advance(epoch, start + len(chunk), batch_size, drop_last)
        return [items[i] for i in chunk]

    @property
    def epoch(self) -> int:
        """Epoch of the next batch to hand out."""
        return self._epoch

    def state_dict(self) -> dict[str, int]:
        """Resumable position: the epoch and how many of its prompts were handed out."""
        return {"epoch": self._epoch, "index": self._index, "seed": self.seed, "num_prompts": len(self)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position saved by ``state_dict`` (on a dataset with the same prompts and seed)."""
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= len(self):
            raise DatasetError(
                self.data_path, f"bad position epoch={epoch}, index={index} for {len(self)} prompts"
            )
        for key, ours in (("seed", self.seed), ("num_prompts", len(self))):
            if key in state and int(state[key]) != ours:
                raise DatasetError(
                    self.data_path, f"saved position is for {key}={state[key]}, this dataset has {key}={ours}"
                )
        self._epoch, self._index = epoch, index

    def _check_batchable(self, batch_size: int, drop_last: bool) -> list[PromptItem]:
        items = self._require_items()
        if self.steps_per_epoch(batch_size, drop_last) == 0:
            raise DatasetError(self.data_path, f"{len(items)} prompts are fewer than batch_size={batch_size}")
        return items

    def _epoch_done(self, offset: int, batch_size: int, drop_last: bool) -> bool:
        left = len(self) - offset
        return left <= 0 or (drop_last and left < batch_size)

    def _advance(self, epoch: int, offset: int, batch_size: int, drop_last: bool) -> None:
        if self._epoch_done(offset, batch_size, drop_last):
            self._epoch, self._index = epoch + 1, 0
        else:
            self._epoch, self._index = epoch, offset

    def _order(self, epoch: int) -> list[int]:
        """Item positions in the order of ``epoch``: a permutation seeded by (seed, epoch)."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        order = list(range(len(self)))
        if self.shuffle:
            random.Random(f"rlfleet-prompts:{self.seed}:{epoch}").shuffle(order)
        self._order_cache = (epoch, order)
        return order


def _split(rows: list[_Row], parts: int) -> list[list[_Row]]:
    """Cut ``rows`` into at most ``parts`` contiguous chunks of near-equal size."""
    size = max(1, -(-len(rows) // parts))
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def prompt_dataset(data: PromptDataset | DataSource, max_prompt_length: int, seed: int) -> PromptDataset:
    """``data`` as a :class:`PromptDataset`: one as it is, else one over it (a path, an ``hf:`` source,
    a list of dicts, a ``datasets.Dataset``) with the run's ``max_prompt_length`` and ``seed``."""
    if isinstance(data, PromptDataset):
        return data
    if isinstance(data, str | os.PathLike) or is_in_memory(data):
        return PromptDataset(data, max_prompt_length=max_prompt_length, seed=seed)
    raise TypeError(
        f"a dataset is a PromptDataset, a file path, an 'hf:' source, a list of dicts or a datasets.Dataset; "
        f"got a {type(data).__name__}"
    )


def chat_prompts(items: Iterable[PromptItem], tokenizer: PreTrainedTokenizerBase) -> dict[str, list[Message]]:
    """The chat prompts of ``items`` (a prompt stored as messages) by their text as a rollout worker
    decodes their tokens (``skip_special_tokens=True``), which is how a reward sees a prompt: what
    lets a TRL-form reward function get the messages back (:mod:`rlfleet.controller.python_reward`)."""
    chats = [item for item in items if not isinstance(item.prompt, str) and item.token_ids]
    if not chats:
        return {}
    texts = tokenizer.batch_decode([item.token_ids for item in chats], skip_special_tokens=True)
    return {text: [dict(m) for m in item.prompt] for text, item in zip(texts, chats, strict=True) if text}


def held_out_file(data: DataSource, output_dir: str | os.PathLike[str], prompt_key: str = "prompt") -> str:
    """Where a run's held-out prompts are read from (``eval.data`` is a file): a path as it is; rows in
    memory (a list of dicts, a ``datasets.Dataset``) written to ``output_dir/eval_data.jsonl`` first,
    checked as a dataset's rows are (a bad row fails here, before anything starts)."""
    if not is_in_memory(data):
        return os.fspath(data)
    records = read_memory_records(data, prompt_key)
    if not records:
        raise DatasetError(memory_label(data), "holds no rows")
    path = Path(output_dir) / "eval_data.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        text = "".join(json.dumps(record) + "\n" for _, record in records)
    except TypeError as exc:
        raise DatasetError(memory_label(data), f"a held-out row is not JSON data ({exc})") from None
    path.write_text(text, encoding="utf-8")
    return str(path)
