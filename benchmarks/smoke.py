"""``--smoke``: each benchmark's smallest case, so that CI runs them all and none of them rots.

Every script with a ``main`` takes ``--smoke`` (``scripts/bench_smoke.py`` runs them all that way
and ``tests/repo/test_bench_smoke.py`` checks that none lacks it). A smoke run goes through the
script's real code path end to end with the smallest settings, on CPU, in seconds; its figures
mean nothing. It never writes to ``benchmarks/results/``: without ``--out`` its JSON goes to a
fresh folder under the temporary directory.
"""

from __future__ import annotations

import argparse
import secrets
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HELP = "the smallest case, seconds on CPU, to check that the script still runs (JSON to a temp file)"
"""The help of every script's ``--smoke`` (``add_argument("--smoke", action="store_true", help=HELP)``)."""


def parse(
    p: argparse.ArgumentParser, argv: Sequence[str] | None, settings: dict[str, Any]
) -> argparse.Namespace:
    """Parse ``argv``; with ``--smoke``, ``settings`` (by argument dest) become the defaults, so flags
    given still win, and ``--out``, when not given, goes to a new folder under the temporary directory
    (same file name)."""
    args = p.parse_args(argv)
    if not args.smoke:
        return args
    unknown = set(settings) - set(vars(args))
    if unknown:
        raise ValueError(f"smoke settings {sorted(unknown)} name no argument of {p.prog}")
    # a fresh folder's name; the scripts create it when they write (a run that writes nothing leaves none)
    folder = Path(tempfile.gettempdir()) / f"rlfleet-smoke-{secrets.token_hex(6)}"
    out = folder / Path(p.get_default("out")).name
    p.set_defaults(**settings, out=out)
    args = p.parse_args(argv)
    shown = ", ".join(f"{k}={v}" for k, v in settings.items())
    print(f"smoke run ({shown}); results to {args.out}", flush=True)
    return args
