"""Regenerate tiny_prefs.jsonl: preference pairs for the tiny DPO example "prefer digit answers".

Each row is a short prompt of digits followed by an arrow (``q: 4 7 1 ->``), a chosen answer made
of digits (the prompt's digits) and a rejected answer of random lowercase letters of the same
length, so a tiny random-init model can learn the preference in a few DPO steps. The output is
deterministic in ``--seed``.

    uv run python examples/data/make_tiny_prefs.py            # rewrites the file next to this script
    uv run python examples/data/make_tiny_prefs.py --out x.jsonl --count 50 --seed 1
"""

from __future__ import annotations

import argparse
import random
import string
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from make_tiny_digits import digit_prompts, write_jsonl  # noqa: E402  (the script next to this one)

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output JSONL file")
    parser.add_argument("--count", type=int, default=256, help="number of pairs")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args()
    write_jsonl(make_pairs(args.count, args.seed), args.out)
    print(f"wrote {args.count} pairs to {args.out}")


if __name__ == "__main__":
    main()
