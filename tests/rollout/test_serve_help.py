"""``rlfleet-rollout serve --help`` shows ``--model`` (issue 35, point 4): the shared worker options,
then the rollout tier's own, in the console script's output (a subprocess)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


def test_serve_help_shows_the_model_option_after_the_shared_ones() -> None:
    script = str(Path(sys.executable).with_name("rlfleet-rollout"))
    shown = subprocess.run([script, "serve", "--help"], capture_output=True, text=True, timeout=50)
    assert shown.returncode == 0, shown.stderr
    assert "--config CONFIG" in shown.stdout and "--nats NATS_URL" in shown.stdout
    assert "--model PATH" in shown.stdout and "model_path=PATH" in shown.stdout
    assert shown.stdout.index("--nats NATS_URL") < shown.stdout.index("--model PATH")
