"""Regenerate tiny_digits.jsonl: prompts for the tiny CI task "answer with digits only".

Each prompt is a short list of random digits followed by an arrow, e.g. ``q: 4 7 1 ->``; the
reward (``charset:allowed=0123456789``) pays a completion for being digits only, so a tiny
random-init model can learn the task in a few steps. The output is deterministic in ``--seed``.

    uv run python examples/data/make_tiny_digits.py            # rewrites the file next to this script
    uv run python examples/data/make_tiny_digits.py --out x.jsonl --count 50 --seed 1
"""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from jsonl_writer import run_script, write_jsonl  # noqa: E402, F401  (the module next to this one)

DEFAULT_OUT = Path(__file__).with_name("tiny_digits.jsonl")
PREFIXES = ("q:", "digits:", "n:", "in:")


def digit_prompts(rng: random.Random) -> Iterator[tuple[str, str]]:
    """Endless distinct ``("q: 4 7 1 ->", "471")`` pairs of 1-5 digits, drawn from ``rng``."""
    seen: set[str] = set()
    while True:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 5)))
        prompt = f"{rng.choice(PREFIXES)} {' '.join(digits)} ->"
        if prompt not in seen:
            seen.add(prompt)
            yield prompt, digits


def make_prompts(count: int = 200, seed: int = 0) -> list[dict[str, str]]:
    """``count`` distinct rows ``{"prompt": "q: 4 7 1 ->", "digits": "471"}`` drawn from ``seed``."""
    prompts = digit_prompts(random.Random(seed))
    return [{"prompt": prompt, "digits": digits} for prompt, digits in itertools.islice(prompts, count)]


def main() -> None:
    run_script(__doc__, DEFAULT_OUT, 200, "prompts", make_prompts)


if __name__ == "__main__":
    main()
