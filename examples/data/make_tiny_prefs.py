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
import json
import random
import string
from pathlib import Path

DEFAULT_OUT = Path(__file__).with_name("tiny_prefs.jsonl")
PREFIXES = ("q:", "digits:", "n:", "in:")


def make_pairs(count: int = 256, seed: int = 0) -> list[dict[str, str]]:
    """``count`` rows ``{"prompt": "q: 4 7 1 ->", "chosen": "471", "rejected": "kqe"}`` from ``seed``."""
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(rows) < count:
        digits = "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 5)))
        prompt = f"{rng.choice(PREFIXES)} {' '.join(digits)} ->"
        if prompt in seen:
            continue
        seen.add(prompt)
        letters = "".join(rng.choice(string.ascii_lowercase) for _ in digits)
        rows.append({"prompt": prompt, "chosen": digits, "rejected": letters})
    return rows


def write_jsonl(rows: list[dict[str, str]], out: Path) -> None:
    """One JSON object per line, keys in a fixed order, so reruns give identical bytes."""
    out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


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
