"""Regenerate arith_words.jsonl and arith_words_test.jsonl: GSM8K-style arithmetic word problems.

Each row is a short word problem with an integer answer, e.g. ``{"prompt": "Mia has 12 apples.
She buys 7 more. How many apples does Mia have now?", "answer": 19, "solution": "12 + 7 = 19\\n####
19"}``. The ``numeric`` reward reads ``answer`` (its default ``key``) from each row's metadata and
pays 1.0 when the response's final number (after ``####``, else the last number) equals it. The
problems are one- and two-step sums, differences, products and exact quotients; every answer is
a non-negative integer. Train and held-out rows come from one stream of distinct problems, so no
held-out problem is in the train file. The output is deterministic in ``--seed``.

    uv run python examples/data/make_arith_words.py       # rewrites both files next to this script
    uv run python examples/data/make_arith_words.py --count 50 --test-count 10 --seed 1 --out a.jsonl
"""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from jsonl_writer import script_parser, write_jsonl  # noqa: E402  (the module next to this one)

DEFAULT_OUT = Path(__file__).with_name("arith_words.jsonl")
DEFAULT_TEST_OUT = Path(__file__).with_name("arith_words_test.jsonl")
NAMES = (("Mia", "She"), ("Leo", "He"), ("Ava", "She"), ("Sam", "He"), ("Zoe", "She"), ("Omar", "He"))
ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards")
INSTRUCTION = "End with #### and the answer."

Problem = tuple[str, int, str]  # question, answer, worked solution


def _gain(rng: random.Random, name: str, she: str, item: str) -> Problem:
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    question = f"{name} has {a} {item}. {she} buys {b} more. How many {item} does {name} have now?"
    return question, a + b, f"{a} + {b} = {a + b}"


def _loss(rng: random.Random, name: str, she: str, item: str) -> Problem:
    a = rng.randint(10, 90)
    b = rng.randint(1, a - 1)
    question = f"{name} had {a} {item} and gave {b} of them to a friend. How many {item} are left?"
    return question, a - b, f"{a} - {b} = {a - b}"


def _product(rng: random.Random, name: str, she: str, item: str) -> Problem:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    question = f"{name} buys {a} bags with {b} {item} in each bag. How many {item} is that in total?"
    return question, a * b, f"{a} * {b} = {a * b}"


def _quotient(rng: random.Random, name: str, she: str, item: str) -> Problem:
    each, people = rng.randint(2, 15), rng.randint(2, 9)
    total = each * people
    question = (
        f"{name} shares {total} {item} equally among {people} friends. How many {item} does each friend get?"
    )
    return question, each, f"{total} / {people} = {each}"


def _two_step(rng: random.Random, name: str, she: str, item: str) -> Problem:
    a, packs, per = rng.randint(0, 30), rng.randint(2, 6), rng.randint(2, 10)
    have = a + packs * per
    b = rng.randint(1, have)
    question = (
        f"{name} has {a} {item}. {she} buys {packs} packs of {per} {item} and then gives away {b}. "
        f"How many {item} does {name} have now?"
    )
    solution = f"{a} + {packs} * {per} = {have}\n{have} - {b} = {have - b}"
    return question, have - b, solution


KINDS: tuple[Callable[[random.Random, str, str, str], Problem], ...] = (
    _gain, _loss, _product, _quotient, _two_step,
)  # fmt: skip


def word_problems(rng: random.Random) -> Iterator[dict[str, object]]:
    """Endless distinct rows ``{"prompt", "answer", "solution"}`` drawn from ``rng``."""
    seen: set[str] = set()
    while True:
        name, she = rng.choice(NAMES)
        question, answer, solution = rng.choice(KINDS)(rng, name, she, rng.choice(ITEMS))
        if question not in seen:
            seen.add(question)
            prompt = f"{question} {INSTRUCTION}"
            yield {"prompt": prompt, "answer": answer, "solution": f"{solution}\n#### {answer}"}


def make_splits(count: int = 300, test_count: int = 60, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """``count`` train rows and ``test_count`` held-out rows, all distinct, drawn from ``seed``."""
    rows = list(itertools.islice(word_problems(random.Random(seed)), count + test_count))
    return rows[:count], rows[count:]


def main() -> None:
    parser = script_parser(__doc__, DEFAULT_OUT, 300, "train problems")
    parser.add_argument("--test-out", type=Path, default=DEFAULT_TEST_OUT, help="held-out JSONL file")
    parser.add_argument("--test-count", type=int, default=60, help="number of held-out problems")
    args = parser.parse_args()
    train, test = make_splits(args.count, args.test_count, args.seed)
    write_jsonl(train, args.out)
    write_jsonl(test, args.test_out)
    print(f"wrote {len(train)} problems to {args.out} and {len(test)} to {args.test_out}")


if __name__ == "__main__":
    main()
