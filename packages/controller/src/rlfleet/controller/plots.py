"""PNG plots of a run's metrics (work in progress)."""

from __future__ import annotations

import argparse


def add_plot_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """``rlfleet plot`` (not yet wired)."""
