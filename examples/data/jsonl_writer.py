"""The writer the ``make_*.py`` data scripts share: rows to JSONL, and their common command line.

Every script here is deterministic in ``--seed`` and writes one JSON object per line with keys in
a fixed order, so rerunning a script with its defaults gives the committed file byte for byte.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

Rows = Sequence[Mapping[str, Any]]


def write_jsonl(rows: Rows, out: Path) -> None:
    """One JSON object per line, keys in a fixed order, so reruns give identical bytes."""
    out.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def script_parser(doc: str, default_out: Path, default_count: int, noun: str) -> argparse.ArgumentParser:
    """``--out``, ``--count`` and ``--seed`` of a data script whose docstring is ``doc``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out, help="output JSONL file")
    parser.add_argument("--count", type=int, default=default_count, help=f"number of {noun}")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    return parser


def run_script(
    doc: str, default_out: Path, default_count: int, noun: str, make: Callable[[int, int], Rows]
) -> None:
    """A data script's ``main``: parse the command line, write ``make(count, seed)`` to ``--out``."""
    args = script_parser(doc, default_out, default_count, noun).parse_args()
    write_jsonl(make(args.count, args.seed), args.out)
    print(f"wrote {args.count} {noun} to {args.out}")
