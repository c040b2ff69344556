"""The ``relevance`` rule: overlap of the response with the prompt's content words.

Content words are the lowercased word tokens of a text minus a small built-in English stopword
list (function words and the instruction verbs prompts are full of: "explain", "describe"...) and
minus one-letter tokens; with ``stem`` a crude suffix stripper (:func:`stem`) maps "cats"/"cat",
"boxes"/"box", "running"/"run" together. It is meant to sit beside ``concise`` so that a one-line answer that
ignores the question does not collect the conciseness reward.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Literal

from pydantic import Field

from rlfleet.reward.base import Rule

logger = logging.getLogger(__name__)

STOPWORDS: frozenset[str] = frozenset(
    """
    a about above after again against all also am an and any are as at be because been before being
    below between both but by can could did do does doing done down during each either else etc few
    for from further get got had has have having he her here hers herself him himself his how however
    i if in into is it its itself just let me more most much must my myself no nor not now of off on
    once only or other our ours ourselves out over own per please same shall she should so some such
    than that the their theirs them themselves then there these they this those through to too under
    until up upon us very via was we were what when where which while who whom whose why will with
    would yes yet you your yours yourself yourselves
    answer answers briefly brief describe explain give list question short shortly show tell write
    """.split()
)
"""Function words and common instruction words; never counted as content."""

_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")
_PLURAL_ES = ("sses", "xes", "zes", "ches", "shes")
_KEEP_S = ("ss", "us", "is")


def _undouble(base: str) -> str:
    """'runn' -> 'run', 'stopp' -> 'stop' (but 'fall', 'miss' stay)."""
    if len(base) >= 4 and base[-1] == base[-2] and base[-1] not in "aeiouls":
        return base[:-1]
    return base


def stem(word: str) -> str:
    """Strip one common English suffix (plural s/es/ies, ing, ed, ly), keeping three letters or more.

    Crude on purpose ("hoping" -> "hop"); enough to match a prompt's "boxes" with an answer's "box".
    """
    if len(word) <= 3:
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(_PLURAL_ES):
        return word[:-2]
    if word.endswith("s"):
        return word if word.endswith(_KEEP_S) else word[:-1]
    for suffix in ("ing", "ed"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return _undouble(word[: -len(suffix)])
    if word.endswith("ly") and len(word) >= 6:
        return word[:-2]
    return word


def content_words(text: str, *, use_stem: bool = True) -> set[str]:
    """The set of content words of ``text``: casefolded, stopwords and one-letter words removed."""
    words: set[str] = set()
    for token in _WORD.findall(text.casefold()):
        token = token.removesuffix("'s")
        if token in STOPWORDS or (len(token) < 2 and not token.isdigit()):
            continue
        words.add(stem(token) if use_stem else token)
    return words


class Relevance(Rule):
    """Overlap of the response's content words with the prompt's, in [0, 1].

    - ``mode="recall"`` (default): the fraction of the prompt's content words found in the response;
    - ``mode="f1"``: the harmonic mean of that recall and the precision (the fraction of the
      response's content words that come from the prompt), which also penalizes padding.

    A response without content words scores 0.0. A prompt without content words gives nothing to
    be relevant to: any response with content words scores 1.0.
    """

    mode: Literal["recall", "f1"] = Field(default="recall", description="recall or soft F1 overlap")
    stem: bool = Field(default=True, description="strip common suffixes before comparing words")

    def __call__(self, prompt: str, response: str, /, **metadata: Any) -> float:
        got = content_words(response, use_stem=self.stem)
        if not got:
            return 0.0
        wanted = content_words(prompt, use_stem=self.stem)
        if not wanted:
            return 1.0
        common = len(wanted & got)
        recall = common / len(wanted)
        if self.mode == "recall" or common == 0:
            return recall
        precision = common / len(got)
        return 2 * precision * recall / (precision + recall)
