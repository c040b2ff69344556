"""Rule rewards on the response's form: length, keywords, regex format, character set.

Each rule is a :class:`~rlfleet.reward.base.Rule`: build it with its options, then call it as
``rule(prompt, response, **metadata) -> float``. Rules that check answers against a reference
live in :mod:`rlfleet.reward.answers`, the prompt-overlap rule in :mod:`rlfleet.reward.relevance`.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from rlfleet.reward.base import Rule, word_count

logger = logging.getLogger(__name__)


class Concise(Rule):
    """1.0 for a response of at most ``max_words`` words, decaying beyond; 0.0 for an empty one.

    With ``n`` words and ``m = max_words``:

    - ``decay="linear"`` (default): ``1`` if ``n <= m``, ``(2m - n) / m`` up to ``2m`` words, ``0`` after;
    - ``decay="inverse"``: ``1`` if ``n <= m``, else ``m / n`` (never reaches 0).

    Pair it with ``relevance`` so that short off-topic answers do not win.
    """

    max_words: int = Field(default=50, gt=0, description="longest response that still scores 1.0, in words")
    decay: Literal["linear", "inverse"] = Field(default="linear", description="how the score falls beyond")

    def __call__(self, prompt: str, response: str, /, **metadata: Any) -> float:
        n = word_count(response)
        if n == 0:
            return 0.0
        if n <= self.max_words:
            return 1.0
        if self.decay == "inverse":
            return self.max_words / n
        return max(0.0, (2 * self.max_words - n) / self.max_words)


class LengthPenalty(Rule):
    """0.0 inside ``[min_words, max_words]``, negative outside, down to ``-scale``.

    Above: ``-scale * min(1, (n - max_words) / max_words)``. Below (when ``min_words > 0``):
    ``-scale * (min_words - n) / min_words``. Meant as a weighted add-on to a correctness reward.
    """

    max_words: int = Field(gt=0, description="longest response without penalty, in words")
    min_words: int = Field(default=0, ge=0, description="shortest response without penalty, in words")
    scale: float = Field(default=1.0, gt=0, allow_inf_nan=False, description="largest penalty")

    @model_validator(mode="after")
    def _ordered(self) -> LengthPenalty:
        if self.min_words > self.max_words:
            raise ValueError(f"min_words ({self.min_words}) must not exceed max_words ({self.max_words})")
        return self

    def __call__(self, prompt: str, response: str, /, **metadata: Any) -> float:
        n = word_count(response)
        if n > self.max_words:
            return -self.scale * min(1.0, (n - self.max_words) / self.max_words)
        if n < self.min_words:
            return -self.scale * (self.min_words - n) / self.min_words
        return 0.0


class Keyword(Rule):
    """Presence of keywords in the response.

    ``mode="any"``: 1.0 if at least one keyword occurs; ``"all"``: 1.0 if every one does;
    ``"fraction"``: the fraction that occur. ``keywords`` is a list, or one string split on ``|``
    (``keyword:keywords=paris|france``). ``whole_word`` matches on word boundaries only.
    """

    keywords: tuple[str, ...] = Field(min_length=1, description="keywords to look for, or 'a|b|c'")
    mode: Literal["any", "all", "fraction"] = Field(default="any", description="how presences combine")
    case_sensitive: bool = Field(default=False, description="match case exactly")
    whole_word: bool = Field(default=False, description="match whole words only")
    _patterns: list[re.Pattern[str]] = PrivateAttr(default_factory=list)

    @field_validator("keywords", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        """Accept ``"a|b|c"`` (the string form of a spec) as well as a list."""
        if isinstance(value, str):
            return [part.strip() for part in value.split("|")]
        return value

    @field_validator("keywords")
    @classmethod
    def _no_empty(cls, keywords: tuple[str, ...]) -> tuple[str, ...]:
        if any(not k for k in keywords):
            raise ValueError("keywords must not be empty strings")
        return keywords

    def model_post_init(self, context: Any, /) -> None:
        flags = 0 if self.case_sensitive else re.IGNORECASE
        for k in self.keywords:
            body = re.escape(k)
            self._patterns.append(re.compile(rf"(?<!\w){body}(?!\w)" if self.whole_word else body, flags))

    def __call__(self, prompt: str, response: str, /, **metadata: Any) -> float:
        found = sum(1 for p in self._patterns if p.search(response))
        if self.mode == "any":
            return 1.0 if found else 0.0
        if self.mode == "all":
            return 1.0 if found == len(self._patterns) else 0.0
        return found / len(self._patterns)


REGEX_MAX_MEM = 8 << 20
"""Bytes RE2 may use for one compiled pattern (a bigger one is a spec error, not a slow server)."""


def compile_re2(
    pattern: str, *, ignore_case: bool = False, multiline: bool = False, dotall: bool = False
) -> Any:
    """``pattern`` compiled by RE2 (matching is linear in the text); ValueError if RE2 cannot compile it.

    RE2 has no backreferences or lookaround (``\\1``, ``(?=...)``, ``(?<!...)``): those patterns
    are refused with RE2's reason, so a spec from a tenant can never make matching take
    exponential time.
    """
    import re2

    flags = "".join(f for f, on in (("i", ignore_case), ("m", multiline), ("s", dotall)) if on)
    options = re2.Options()
    options.log_errors = False
    options.max_mem = REGEX_MAX_MEM
    try:
        return re2.compile(f"(?{flags}){pattern}" if flags else pattern, options)
    except re2.error as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise ValueError(f"not a valid regular expression for RE2 ({reason}); RE2 matches in linear "
                         "time and has no backreferences or lookaround") from None  # fmt: skip


class Regex(Rule):
    """1.0 if the response matches ``pattern``, else 0.0.

    ``full=True`` requires the whole (stripped, when ``strip``) response to match; otherwise the
    pattern may match anywhere (search). Patterns are RE2's syntax (Python's without
    backreferences and lookaround); matching takes time linear in the response's length.
    """

    pattern: str = Field(description="an RE2 regular expression (no backreferences or lookaround)")
    full: bool = Field(default=False, description="the whole response must match (fullmatch)")
    ignore_case: bool = Field(default=False, description="case-insensitive, (?i)")
    multiline: bool = Field(default=False, description="^ and $ match at line ends, (?m)")
    dotall: bool = Field(default=False, description=". matches a newline too, (?s)")
    strip: bool = Field(default=True, description="strip surrounding whitespace before matching")
    _compiled: Any = PrivateAttr(default=None)

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        compile_re2(pattern)
        return pattern

    def model_post_init(self, context: Any, /) -> None:
        self._compiled = compile_re2(
            self.pattern, ignore_case=self.ignore_case, multiline=self.multiline, dotall=self.dotall
        )

    def __call__(self, prompt: str, response: str, /, **metadata: Any) -> float:
        assert self._compiled is not None  # set in model_post_init
        text = response.strip() if self.strip else response
        match = self._compiled.fullmatch(text) if self.full else self._compiled.search(text)
        return 1.0 if match else 0.0


class Charset(Rule):
    """Fraction of the response's non-whitespace characters that belong to ``allowed``.

    ``allowed`` is a literal set of characters (``"0123456789"``; no ranges). A response with no
    non-whitespace character scores 0.0.
    """

    allowed: str = Field(min_length=1, description="the allowed characters, listed one by one")
    case_sensitive: bool = Field(default=True, description="when false, 'A' counts as 'a'")
    _set: frozenset[str] = PrivateAttr(default=frozenset())

    def model_post_init(self, context: Any, /) -> None:
        chars = self.allowed if self.case_sensitive else self.allowed.casefold()
        self._set = frozenset(chars)

    def __call__(self, prompt: str, response: str, /, **metadata: Any) -> float:
        chars = [c for c in response if not c.isspace()]
        if not chars:
            return 0.0
        if not self.case_sensitive:
            chars = [c.casefold() for c in chars]
        return sum(1 for c in chars if c in self._set) / len(chars)


EPISODE_REWARD = "episode_reward"
"""The per-sample field of a multi-turn batch that :class:`Episode` scores (the reward worker puts it
into each sample's metadata from the batch)."""


class Episode(Rule):
    """The reward the environment gave the sample's episode (multi-turn runs, issue 33: a job with
    ``environment.env``): the batch's ``episode_reward``, 0 for an episode cut at its limits. A
    batch without episodes has none, and is refused by name."""

    def __call__(self, prompt: str, response: str, /, **metadata: Any) -> float:
        value = metadata.get(EPISODE_REWARD)
        if value is None:
            raise ValueError("the sample is not an episode (no episode_reward): the episode rule scores the "
                             "batches of multi-turn runs (a job with environment.env)")  # fmt: skip
        return float(value)
