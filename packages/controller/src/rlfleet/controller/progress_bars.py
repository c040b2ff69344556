"""Third-party progress bars off: rlfleet's console is its own lines and its own step bar.

transformers ("Loading weights", "Loading checkpoint shards"), the Hugging Face Hub (downloads) and
``datasets`` ("Map", "Generating train split") each draw tqdm bars on the terminal of the process
that loads; in a run they would cut through the ``[PROGRESS]`` lines. :func:`hide_third_party_bars`
turns them off in the controller and, through the environment the launchers pass on, in every
process rlfleet starts (whose output goes to their log files, where a bar is only noise).

A user who wants them sets ``HF_HUB_DISABLE_PROGRESS_BARS=0`` (and ``HF_DATASETS_DISABLE_PROGRESS_BARS=0``)
before starting rlfleet: a value already set is kept.
"""

from __future__ import annotations

import os
import sys

BAR_VARIABLES = ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS")
"""The variables huggingface_hub (and transformers, which follows it) and datasets read."""


def _asked_for(variable: str) -> bool:
    """Whether the user set ``variable`` to a false value (bars wanted)."""
    return os.environ.get(variable, "").strip().lower() in ("0", "false", "no", "off")


def hide_third_party_bars() -> None:
    """Hide the progress bars of transformers, huggingface_hub and datasets in this process and the
    processes it starts, unless the user's environment asks for them (see the module docstring)."""
    for variable in BAR_VARIABLES:
        os.environ.setdefault(variable, "1")  # read at import by these libraries, here and in children
    # a library imported before the variable was set is told directly (none is imported here for it)
    if not _asked_for("HF_HUB_DISABLE_PROGRESS_BARS"):
        if "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        if "transformers" in sys.modules:
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
    if not _asked_for("HF_DATASETS_DISABLE_PROGRESS_BARS") and "datasets" in sys.modules:
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
