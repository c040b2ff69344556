"""Rules that check a response against a reference answer in the sample's metadata.

:func:`extract_number` reads the final numeric answer of a text the GSM8K way: the number after
the last ``####`` marker, and failing that the last number in the text. Thousands separators
(``1,234``), decimals (``42.0``), signs (``-3``, ``−3``) and currency or percent signs around the
number are handled; a sentence's final period is not taken for a decimal point.
"""

from __future__ import annotations

import logging
import math
import re
import string
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from rlfleet.reward.base import Rule
from rlfleet.reward.errors import RewardInputError

logger = logging.getLogger(__name__)

GSM8K_MARKER = "####"

# A number not glued to a preceding digit or dot: optional sign, either comma-grouped thousands
# (exactly three digits per group) or plain digits, then an optional decimal part.
_NUMBER = re.compile(r"(?<![\d.])([-+\u2212]?)((?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?!\d)")


def _to_float(sign: str, digits: str) -> float:
    value = float(digits.replace(",", ""))
    return -value if sign in ("-", "\u2212") else value


def extract_number(text: str, *, marker: str = GSM8K_MARKER, strict: bool = False) -> float | None:
    """The final numeric answer in ``text``, or None when there is none.

    The first number after the last ``marker`` wins; without a marker (or with no number after
    it), the last number anywhere in the text, unless ``strict``, which then gives None.
    """
    _, found, tail = text.rpartition(marker) if marker else ("", "", text)
    if found:
        match = _NUMBER.search(tail)
        if match:
            return _to_float(*match.groups())
    if strict:
        return None
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return _to_float(*matches[-1])


def reference_number(
    metadata: Mapping[str, Any], key: str, *, who: str = "the numeric reward", where: str = "metadata"
) -> float:
    """The reference answer under ``metadata[key]`` as a number (int, float or a text holding one);
    :class:`RewardInputError` naming ``who`` needs it and ``where`` it was looked for otherwise."""
    if key not in metadata:
        raise RewardInputError(f"{who} needs {where}[{key!r}] (have: {sorted(metadata)})")
    value = metadata[key]
    if isinstance(value, bool):
        raise RewardInputError(f"{where}[{key!r}] = {value!r} is a bool, not a number")
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        number = extract_number(value)
        if number is not None:
            return number
    raise RewardInputError(f"{where}[{key!r}] = {value!r} holds no number")


class Numeric(Rule):
    """1.0 if the response's final number equals ``metadata[key]``, else 0.0.

    The response's number is :func:`extract_number` (``#### 42``, else the last number);
    ``strict`` refuses the fallback. The reference may be a number or a text (a full GSM8K
    solution ending in ``#### 72`` works). Numbers are equal within ``tolerance`` (absolute).
    A missing or non-numeric reference raises :class:`RewardInputError`.
    """

    key: str = Field(default="answer", min_length=1, description="metadata field holding the reference")
    tolerance: float = Field(default=1e-6, ge=0, allow_inf_nan=False, description="absolute tolerance")
    strict: bool = Field(default=False, description="only accept a number after the '####' marker")
    marker: str = Field(default=GSM8K_MARKER, min_length=1, description="the final-answer marker")

    def __call__(self, prompt: str, response: str, /, **metadata: Any) -> float:
        expected = reference_number(metadata, self.key)
        got = extract_number(response, marker=self.marker, strict=self.strict)
        if got is None:
            return 0.0
        return 1.0 if math.isclose(got, expected, rel_tol=0.0, abs_tol=self.tolerance) else 0.0


_TRAILING = string.punctuation + " \t\n\r"


def normalize_answer(text: str, *, case_sensitive: bool) -> str:
    """Collapse whitespace, strip surrounding punctuation and (unless case-sensitive) fold case."""
    text = " ".join(text.split()).strip(_TRAILING)
    return text if case_sensitive else text.casefold()


class ExactMatch(Rule):
    """1.0 if the response equals ``metadata[key]`` after :func:`normalize_answer`, else 0.0."""

    key: str = Field(default="answer", min_length=1, description="metadata field holding the reference")
    case_sensitive: bool = Field(default=False, description="compare case exactly")

    def __call__(self, prompt: str, response: str, /, **metadata: Any) -> float:
        if self.key not in metadata:
            raise RewardInputError(f"the exact_match reward needs metadata[{self.key!r}]")
        expected = normalize_answer(str(metadata[self.key]), case_sensitive=self.case_sensitive)
        got = normalize_answer(response, case_sensitive=self.case_sensitive)
        return 1.0 if got == expected else 0.0
