"""``rm``: a Hugging Face sequence-classification reward model as a reward component.

``rm:path=/models/my-rm`` scores each sample with ``AutoModelForSequenceClassification``: the
score is the logit of ``label`` (an index or a name from the model's ``label2id``), or the single
output of a one-label model. Samples run in batches of ``batch_size``, sorted by length, padded
and cut to ``max_length`` tokens. What the model reads is set by ``input``:

- ``pair``: ``tokenizer(prompt, response)``, a text pair (cross-encoder reward models);
- ``chat``: the tokenizer's chat template over a user turn and an assistant turn;
- ``concat``: ``prompt + response`` as one text;
- ``response``: the response alone;
- ``auto`` (default): ``chat`` when the tokenizer has a chat template, else ``pair``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from rlfleet.reward.base import ModelComponent
from rlfleet.reward.errors import RewardModelError
from rlfleet.reward.loading import DtypeName, LoadedModel, load_shared, remote_code_allowed

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

InputFormat = Literal["auto", "pair", "chat", "concat", "response"]


def _load_seq_cls(folder: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    remote = remote_code_allowed()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=remote)
    model = AutoModelForSequenceClassification.from_pretrained(
        folder, local_files_only=True, dtype=dtype, trust_remote_code=remote
    )
    if tokenizer.pad_token is None:  # decoder-only reward models often have none: pad with EOS
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad nor an EOS token to pad batches with")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    if model.config.pad_token_id is None:  # the model finds each row's last token through it
        model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device), tokenizer


class RewardModel(ModelComponent):
    """Options of the ``rm`` component."""

    path: str = Field(min_length=1, description="local directory of an AutoModelForSequenceClassification")
    label: int | str | None = Field(
        default=None, description="logit that is the score (index or label name); None: the only output"
    )
    max_length: int = Field(default=512, ge=8, description="longest input in tokens; longer ones are cut")
    batch_size: int = Field(default=16, ge=1, description="samples per forward pass")
    input: InputFormat = Field(default="auto", description="what the model reads (see the module docs)")
    device: str = Field(default="auto", description="'auto' (a GPU when there is one), 'cpu', 'cuda:1'...")
    dtype: DtypeName = Field(default="auto", description="auto: bfloat16 on a GPU, float32 on the CPU")

    def load(self) -> SeqClsScorer:
        loaded = load_shared("seq-cls", self.path, self.device, self.dtype, _load_seq_cls)
        return SeqClsScorer(self, loaded)


def label_index(config: Any, label: int | str | None, path: str) -> int:
    """The logit index the score is read from, checked against the model's labels."""
    num_labels = int(config.num_labels)
    if label is None:
        if num_labels != 1:
            names = dict(getattr(config, "id2label", {}) or {})
            raise RewardModelError(
                path, f"the model has {num_labels} outputs {names}; set label=<index or name>"
            )
        return 0
    if isinstance(label, str):
        label2id = dict(getattr(config, "label2id", {}) or {})
        if label not in label2id:
            raise RewardModelError(path, f"no label {label!r}; the model's labels are {sorted(label2id)}")
        return int(label2id[label])
    if not 0 <= label < num_labels:
        raise RewardModelError(path, f"label={label} is out of range: the model has {num_labels} outputs")
    return label


class SeqClsScorer:
    """Scores batches with a loaded sequence-classification model; a :class:`BatchRewardFn`."""

    def __init__(self, options: RewardModel, loaded: LoadedModel) -> None:
        self.options = options
        self.loaded = loaded
        self.index = label_index(loaded.model.config, options.label, options.path)
        fmt = options.input
        if fmt == "auto":
            fmt = "chat" if getattr(loaded.tokenizer, "chat_template", None) else "pair"
        self.input: InputFormat = fmt

    def _encode(self, prompts: Sequence[str], responses: Sequence[str]) -> dict[str, Any]:
        tok = self.loaded.tokenizer
        common: dict[str, Any] = dict(
            padding=True, truncation=True, max_length=self.options.max_length, return_tensors="pt"
        )
        if self.input == "pair":
            return tok(list(prompts), list(responses), **common)
        if self.input == "response":
            return tok(list(responses), **common)
        if self.input == "concat":
            return tok([p + r for p, r in zip(prompts, responses, strict=True)], **common)
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}, {"role": "assistant", "content": r}], tokenize=False
            )
            for p, r in zip(prompts, responses, strict=True)
        ]
        return tok(texts, add_special_tokens=False, **common)

    def score_batch(
        self, prompts: Sequence[str], responses: Sequence[str], metadata_list: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        """(N,) samples -> (N,) logits of the chosen label."""
        import torch

        n = len(responses)
        order = sorted(range(n), key=lambda i: len(prompts[i]) + len(responses[i]))
        scores = [0.0] * n
        size = self.options.batch_size
        with self.loaded.lock, torch.inference_mode():
            for start in range(0, n, size):
                rows = order[start : start + size]
                batch = self._encode([prompts[i] for i in rows], [responses[i] for i in rows])
                batch = {k: v.to(self.loaded.device) for k, v in batch.items()}
                logits = self.loaded.model(**batch).logits  # (B, num_labels)
                values = logits[:, self.index].float().tolist()
                for i, value in zip(rows, values, strict=True):
                    scores[i] = value
        return scores

    def __repr__(self) -> str:
        return f"SeqClsScorer({self.options.path!r}, label={self.options.label!r}, input={self.input!r})"
