"""Regenerate tiny_prefs.jsonl: preference pairs for the tiny DPO example "prefer digit answers".

Each row is a short prompt of digits followed by an arrow (``q: 4 7 1 ->``), a chosen answer made
of digits (the prompt's digits) and a rejected answer of random lowercase letters of the same
length, so a tiny random-init model can learn the preference in a few DPO steps. The output is
deterministic in ``--seed``.

    uv run python examples/data/make_tiny_prefs.py            # rewrites the file next to this script
    uv run python examples/data/make_tiny_prefs.py --out x.jsonl --count 50 --seed 1
"""

from __future__ import annotations

import random
import string
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from jsonl_writer import run_script, write_jsonl  # noqa: E402, F401  (modules next to this one)
from make_tiny_digits import digit_prompts  # noqa: E402

DEFAULT_OUT = Path(__file__).with_name("tiny_prefs.jsonl")


def make_pairs(count: int = 256, seed: int = 0) -> list[dict[str, str]]:
    """``count`` rows ``{"prompt": "q: 4 7 1 ->", "chosen": "471", "rejected": "kqe"}`` from ``seed``."""
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    for prompt, digits in digit_prompts(rng):  # the rejected letters are drawn between prompts
        if len(rows) == count:
            break
        letters = "".join(rng.choice(string.ascii_lowercase) for _ in digits)
        rows.append({"prompt": prompt, "chosen": digits, "rejected": letters})
    return rows


def main() -> None:
    run_script(__doc__, DEFAULT_OUT, 256, "pairs", make_pairs)


if __name__ == "__main__":
    main()
