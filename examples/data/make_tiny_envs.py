"""Regenerate the tiny multi-turn tasks (issue 33): tiny_calc.jsonl and tiny_guess.jsonl.

``tiny_calc.jsonl``: sums and differences of one-digit numbers whose result is one digit, e.g.
``{"prompt": "calc: 3 + 4 =", "answer": 7}``, for the ``calculator`` environment (the model may call
the calculator, its final turn is the answer). ``tiny_guess.jsonl``: ``{"prompt": "guess 1-9:",
"secret": 6}`` rows for ``guess_number:low=1,high=9`` (each turn's number is a guess, answered
"higher", "lower" or "correct"). Deterministic in ``--seed``.

    uv run python examples/data/make_tiny_envs.py          # rewrites both files next to this script
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from jsonl_writer import write_jsonl  # noqa: E402  (the module next to this one)

HERE = Path(__file__).parent
PREFIXES = ("guess 1-9:", "secret 1-9?", "pick 1-9:", "number 1-9:")


def calc_rows(count: int = 200, seed: int = 0) -> list[dict[str, object]]:
    """``count`` rows of ``a + b`` or ``a - b`` (one digit each, the result one digit), repeats allowed."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    while len(rows) < count:
        a, b, op = rng.randint(0, 9), rng.randint(0, 9), rng.choice("+-")
        value = a + b if op == "+" else a - b
        if 0 <= value <= 9:
            rows.append({"prompt": f"calc: {a} {op} {b} =", "answer": value})
    return rows


def guess_rows(count: int = 200, seed: int = 0) -> list[dict[str, object]]:
    """``count`` rows with a secret from 1 to 9 and one of a few prompt wordings."""
    rng = random.Random(seed)
    return [{"prompt": rng.choice(PREFIXES), "secret": rng.randint(1, 9)} for _ in range(count)]


def main() -> int:
    write_jsonl(calc_rows(), HERE / "tiny_calc.jsonl")
    write_jsonl(guess_rows(), HERE / "tiny_guess.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
