"""DPO's ``samples.md``: a few preference pairs with their log-ratio margins, at the end of a run.

A DPO run generates nothing, so its samples are its pairs: for ``sample_table_size`` pairs (picked by
the seed alone, as the online table picks its prompts) the chosen and the rejected response with
their log-ratios against the reference, ``log pi(y|x) - log ref(y|x)`` summed over the response's
tokens, and the margin the DPO loss sees, ``beta * (chosen log-ratio - rejected log-ratio)``
(positive: the policy prefers the chosen answer more than the reference did). The controller
computes them in-process with transformers on CPU (as ``rlfleet eval`` generates), from the run's
``final`` model and the reference (the model it started from); models larger than
:data:`MAX_SCORED_BYTES` are skipped with a line saying so.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlfleet.controller.dataset import PromptDataset, PromptItem
from rlfleet.controller.preference import PreferenceDataset
from rlfleet.controller.samples import question_text

MAX_SCORED_BYTES = 4 * 2**30
"""Largest model (weights on disk) whose pairs the controller scores on its CPU, twice (policy, reference)."""


@dataclass(frozen=True)
class PairRow:
    """One pair with its log-ratios (policy vs reference, summed over the response tokens)."""

    prompt: str
    chosen: str
    rejected: str
    chosen_logratio: float
    rejected_logratio: float
    margin: float
    """``beta * (chosen_logratio - rejected_logratio)``."""


def sequence_logp(model: Any, prompt_ids: list[int], response_ids: list[int]) -> float:
    """``log p(response | prompt)`` under ``model``: the sum of the response tokens' log-probs."""
    import torch

    ids = torch.tensor([prompt_ids + response_ids])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, :-1].float()
    logps = torch.log_softmax(logits, dim=-1)
    targets = ids[0, 1:]
    picked = logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return float(picked[len(prompt_ids) - 1 :].sum())


def pair_rows(
    policy: Any,
    reference: Any,
    dataset: PreferenceDataset,
    items: list[PromptItem],
    beta: float,
    tokenizer: Any,
) -> list[PairRow]:
    """The rows of ``items`` (pairs of ``dataset``, bound to ``tokenizer``) under two loaded models."""
    rows = []
    for item in items:
        prompt = list(item.token_ids or [])
        chosen, rejected = dataset.responses(item)
        ratios = [
            sequence_logp(policy, prompt, ids) - sequence_logp(reference, prompt, ids)
            for ids in (chosen, rejected)
        ]
        texts = [tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in (chosen, rejected)]
        rows.append(
            PairRow(
                question_text(item), texts[0], texts[1], ratios[0], ratios[1], beta * (ratios[0] - ratios[1])
            )
        )
    return rows


def render(rows: list[PairRow], beta: float) -> str:
    """The Markdown of ``samples.md``: one line per pair, then the mean margin and the share preferred."""
    lines = [
        "## Preference pairs after training: log-ratios against the reference",
        "",
        "log-ratio: log pi(y|x) - log ref(y|x) over the response; "
        f"margin: beta ({beta:g}) x (chosen - rejected)",
        "",
        "| prompt | chosen | rejected | chosen log-ratio | rejected log-ratio | margin |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        numbers = f"{row.chosen_logratio:+.3f} | {row.rejected_logratio:+.3f} | {row.margin:+.3f}"
        lines.append(f"| {_cell(row.prompt, 80)} | {_cell(row.chosen)} | {_cell(row.rejected)} | {numbers} |")
    if rows:
        mean = sum(row.margin for row in rows) / len(rows)
        preferred = sum(row.margin > 0 for row in rows)
        lines += ["", f"mean margin: {mean:+.3f}; chosen preferred (margin > 0): {preferred} of {len(rows)}"]
    return "\n".join(lines)


def _cell(text: str, width: int = 160) -> str:
    flat = " ".join(text.split()).replace("|", "\\|")
    return textwrap.shorten(flat, width=width, placeholder=" …") if flat else "(empty)"


def _weights_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors")) + sum(
        p.stat().st_size for p in model_dir.glob("*.bin")
    )


def write_dpo_samples(
    output_dir: Path, reference_dir: Path, dataset: PromptDataset, count: int, beta: float
) -> str:
    """``output_dir/samples.md`` for ``count`` pairs of ``dataset`` (the run's, tokenizer bound),
    the policy read from ``output_dir/final``; the text written (or why nothing was)."""
    import torch
    from transformers import AutoModelForCausalLM

    assert isinstance(dataset, PreferenceDataset), "an offline (DPO) run trains on preference pairs"
    policy_dir = output_dir / "final"
    largest = max(_weights_bytes(policy_dir), _weights_bytes(reference_dir))
    if largest > MAX_SCORED_BYTES:
        size = f"{largest / 2**30:.1f} GiB"
        return f"samples.md not written: the model ({size}) is too large to score on the controller's CPU"
    items = dataset.sample_items(count)
    models = [
        AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        for d in (policy_dir, reference_dir)
    ]
    text = render(pair_rows(*models, dataset, items, beta, dataset.tokenizer), beta)
    (output_dir / "samples.md").write_text(text + "\n", encoding="utf-8")
    return text
