"""A character-level tokenizer built on the fly, for tiny test and CI models.

Every printable ASCII character (letters, digits, punctuation, space) and the newline is one
token; ``<pad>``, ``<bos>``, ``<eos>`` and ``<unk>`` are special tokens. Encoding adds ``<bos>``
in front, decoding glues characters back together. The vocabulary is fixed, so the same text
always maps to the same ids: tiny models saved in one run load in another.
"""

from __future__ import annotations

import logging
import string
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK)
CHARACTERS: str = string.ascii_letters + string.digits + string.punctuation + " \n"


def char_vocab() -> dict[str, int]:
    """Token -> id: specials first (``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3), then characters."""
    return {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}


def build_char_tokenizer(
    chat_template: str | None = None, model_max_length: int = 256
) -> PreTrainedTokenizerFast:
    """Build the character tokenizer, wrapped for transformers (``save_pretrained`` / ``AutoTokenizer``).

    ``chat_template`` is a Jinja string (none by default: tiny models are plain completion
    models); tests pass one to exercise chat prompts.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocab()
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # One piece per character, whitespace included; WordLevel then maps each piece to its id.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        chat_template=chat_template,
        model_max_length=model_max_length,
    )
