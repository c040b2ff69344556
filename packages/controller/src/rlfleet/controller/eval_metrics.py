"""Evaluation metrics over answered prompts: length, share within a word limit, similarity, rewards, pass@k.

One :class:`EvalRow` per generated answer (a prompt answered ``samples`` times has that many
rows); :func:`summarize` turns the rows of one model into the flat summary that ``rlfleet eval``
prints and both ``rlfleet eval`` and a run's ``eval.json`` write. Every number here is computed
from the rows, so a reader of the JSON can recompute it (words are ``len(answer.split())``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

SIMILARITY = "similarity"
"""Label of the built-in similarity component (MiniLM cosine of question and answer; named apart from
the reward's ``relevance``, its word-recall term, which training metrics report as ``reward/relevance``)."""
OLD_SIMILARITY = "relevance"
"""What eval files written before issue 35 call the similarity (readers of old files take either)."""
CORRECT = "correct"
"""Label of the built-in answer check (the ``numeric`` rule against the prompt's ``answer``)."""


def count_words(text: str) -> int:
    """Words of an answer: whitespace-separated tokens, as the sample table counts them."""
    return len(text.split())


@dataclass
class EvalRow:
    """One answer to one prompt, with what was measured of it (None: not measured)."""

    index: int
    """Row of the prompt in its file."""
    prompt: str
    """The question as the user wrote it (the last user message of a chat)."""
    sample: int
    answer: str
    words: int
    tokens: int
    within_limit: bool
    prompt_tokens: int | None = None
    """Tokens of the prompt the model saw (chat template and system prompt included)."""
    similarity: float | None = None
    """MiniLM cosine of question and answer (the built-in endpoint's ``similarity``)."""
    correct: bool | None = None
    """Whether the final number equals the prompt's ``answer`` (answer-checked prompts only)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Reward spec -> this answer's total reward under it."""
    components: dict[str, dict[str, float]] = field(default_factory=dict)
    """Reward spec -> component label -> this answer's score."""
    turns: int | None = None
    """The model's turns in the answer's episode (multi-turn runs only)."""
    tool_calls: int | None = None
    """The tool calls the episode's turns made (multi-turn runs only)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> EvalRow:
        """A row as :meth:`to_json` wrote it (an older file's ``relevance`` read as ``similarity``)."""
        row = dict(row)
        if OLD_SIMILARITY in row:
            row.setdefault(SIMILARITY, row.pop(OLD_SIMILARITY))
        return cls(**row)


def summary_similarity(summary: dict[str, Any]) -> float | None:
    """The mean similarity of a summary (an older file's ``relevance``), None when not measured."""
    value = summary.get(SIMILARITY, summary.get(OLD_SIMILARITY))
    return float(value) if isinstance(value, int | float) else None


def make_row(index: int, prompt: str, sample: int, answer: str, tokens: int, limit_words: int) -> EvalRow:
    """A row with its lengths measured (scores are added later)."""
    words = count_words(answer)
    return EvalRow(index, prompt, sample, answer, words, tokens, words <= limit_words)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a prompt with ``c`` correct answers out of ``n`` (Chen et al., 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(rows: Sequence[EvalRow], limit_words: int) -> dict[str, Any]:
    """The means of one model's rows: words, tokens, share within ``limit_words``, similarity, each
    reward and component, and pass@1 / pass@n over answer-checked prompts (n: samples per prompt)."""
    summary: dict[str, Any] = {
        "prompts": len({row.index for row in rows}),
        "answers": len(rows),
        "limit_words": limit_words,
        "mean_words": _mean([row.words for row in rows]),
        "mean_tokens": _mean([row.tokens for row in rows]),
        "within_limit": _mean([float(row.within_limit) for row in rows]),
        "similarity": _mean([row.similarity for row in rows if row.similarity is not None]),
    }
    specs = list(dict.fromkeys(spec for row in rows for spec in row.rewards))
    summary["rewards"] = {
        spec: _mean([row.rewards[spec] for row in rows if spec in row.rewards]) for spec in specs
    }
    summary["components"] = {
        spec: {
            name: _mean([row.components[spec][name] for row in rows if name in row.components.get(spec, {})])
            for name in dict.fromkeys(n for row in rows for n in row.components.get(spec, {}))
        }
        for spec in specs
    }
    summary.update(_pass_at(rows))
    episodes = [row for row in rows if row.turns is not None and row.tool_calls is not None]
    if episodes:  # a multi-turn run's: how often its episodes used a tool, and how long they were
        summary["tool_use"] = _mean([float((row.tool_calls or 0) > 0) for row in episodes])
        summary["mean_turns"] = _mean([float(row.turns or 0) for row in episodes])
    return summary


def _pass_at(rows: Sequence[EvalRow]) -> dict[str, float]:
    """``pass@1`` and ``pass@n`` (the fewest samples any checked prompt has) over checked prompts."""
    per_prompt: dict[int, list[bool]] = {}
    for row in rows:
        if row.correct is not None:
            per_prompt.setdefault(row.index, []).append(row.correct)
    if not per_prompt:
        return {}
    n = min(len(checks) for checks in per_prompt.values())
    out = {}
    for k in sorted({1, n}):
        out[f"pass@{k}"] = statistics.fmean(pass_at_k(len(c), sum(c), k) for c in per_prompt.values())
    return out


def summary_line(summary: dict[str, Any]) -> str:
    """One line of the headline numbers: mean words, share within the limit, similarity, reward."""
    parts = [
        f"mean words {_fmt(summary.get('mean_words'), 1)}",
        f"within {summary.get('limit_words')} words {_fmt(summary.get('within_limit'), 2)}",
        f"similarity {_fmt(summary.get('similarity'), 3)}",
    ]
    parts += [f"reward {_fmt(value, 3)}" for value in summary.get("rewards", {}).values()]
    parts += [f"{key} {_fmt(summary[key], 3)}" for key in summary if key.startswith("pass@")]
    if "tool_use" in summary:
        parts += [f"tool use {_fmt(summary['tool_use'], 2)}", f"turns {_fmt(summary.get('mean_turns'), 2)}"]
    return ", ".join(parts)


def _fmt(value: Any, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def render_table(labels: Sequence[str], summaries: Sequence[dict[str, Any]]) -> str:
    """A plain-text table, one row per model: words, tokens, within limit, similarity, rewards, pass@k."""
    specs = list(dict.fromkeys(spec for s in summaries for spec in s.get("rewards", {})))
    passes = list(dict.fromkeys(key for s in summaries for key in s if key.startswith("pass@")))
    limit = summaries[0].get("limit_words") if summaries else "?"
    header = ["MODEL", "ANSWERS", "WORDS", "TOKENS", f"<={limit}W", "SIMILARITY"]
    header += [f"REWARD{i + 1 if len(specs) > 1 else ''}" for i in range(len(specs))] + passes
    table = [header]
    for label, s in zip(labels, summaries, strict=True):
        cells = [label, str(s["answers"]), _fmt(s["mean_words"], 1), _fmt(s["mean_tokens"], 1),
                 _fmt(s["within_limit"], 2), _fmt(s["similarity"], 3)]  # fmt: skip
        cells += [_fmt(s.get("rewards", {}).get(spec), 3) for spec in specs]
        cells += [_fmt(s.get(key), 3) for key in passes]
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    lines += [f"REWARD{i + 1 if len(specs) > 1 else ''}: {spec}" for i, spec in enumerate(specs)]
    return "\n".join(lines)
