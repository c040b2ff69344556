"""Regenerate the SmolLM2 calculator task (issue 33): calc_problems.jsonl and calc_problems_heldout.jsonl.

Products of a two-digit and a two-digit number and sums of two three-digit numbers: arithmetic
SmolLM2-135M gets wrong in its head and right with the ``calculator`` environment's tool
(``examples/smollm2_calculator.yaml``). Each prompt is a chat: one worked example (a question, the
call ``calculator: 23 * 41``, the tool's ``943``, the answer ``943``) and then the question, e.g.
``{"prompt": [..., {"role": "user", "content": "What is 47 * 86?"}], "answer": 4042}``. With the
example SmolLM2 calls the calculator on about one problem in six before training (without it,
almost never). The held-out file has other problems than the training file (no pair is in both).
Deterministic.

    uv run python examples/data/make_calc_problems.py      # rewrites both files next to this script
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from jsonl_writer import write_jsonl  # noqa: E402  (the module next to this one)

HERE = Path(__file__).parent
EXAMPLE = [
    {"role": "user", "content": "What is 23 * 41?"},
    {"role": "assistant", "content": "calculator: 23 * 41"},
    {"role": "tool", "content": "943"},
    {"role": "assistant", "content": "943"},
]
"""The worked example every prompt starts with (its numbers are in neither file)."""


def problems(count: int, seed: int, taken: set[str]) -> list[dict[str, object]]:
    """``count`` distinct problems not in ``taken`` (added to it): half products, half sums."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    while len(rows) < count:
        if len(rows) % 2 == 0:
            a, b, op = rng.randint(12, 99), rng.randint(12, 99), "*"
        else:
            a, b, op = rng.randint(101, 999), rng.randint(101, 999), "+"
        expr = f"{a} {op} {b}"
        if expr in taken or expr == "23 * 41":
            continue
        taken.add(expr)
        question = {"role": "user", "content": f"What is {expr}?"}
        rows.append({"prompt": [*EXAMPLE, question], "answer": a * b if op == "*" else a + b})
    return rows


def main() -> int:
    taken: set[str] = set()
    write_jsonl(problems(256, 0, taken), HERE / "calc_problems.jsonl")
    write_jsonl(problems(64, 1, taken), HERE / "calc_problems_heldout.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
