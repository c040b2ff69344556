"""The README's "As a library" snippet runs as written, with a local tiny model directory.

The code block is read from README.md itself; only the model name becomes ``MODEL_DIR`` (the issue's
form of the snippet). It runs in a scratch folder holding ``examples/data/questions.jsonl`` (the
first 16 questions of the shipped file: one step of 16 prompts), so its relative paths, and the
default ``output_dir``, land there.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _library_snippet() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## As a library", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None, "README.md lost its library snippet"
    snippet, count = re.subn(r'actor_model_name="[^"]*"', "actor_model_name=MODEL_DIR", code.group(1))
    assert count == 1, snippet
    return snippet


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_readme_library_snippet_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, procs
) -> None:
    data = tmp_path / "examples" / "data" / "questions.jsonl"
    data.parent.mkdir(parents=True)
    questions = (REPO / "examples" / "data" / "questions.jsonl").read_text().splitlines()[:16]
    data.write_text("\n".join(questions) + "\n")
    monkeypatch.chdir(tmp_path)

    namespace: dict[str, object] = {"MODEL_DIR": str(tiny_model_dir)}
    exec(compile(_library_snippet(), "README.md", "exec"), namespace)

    trainer = namespace["trainer"]
    assert trainer.global_step == 1  # type: ignore[attr-defined]
    out = tmp_path / "outputs" / "run"
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert math.isfinite(row["kl"]) and row["kl_coef"] == 0.05, "kl_coef=0.05 trains against a reference"
    assert 0.0 <= row["reward/mean"] <= 1.0
    assert (out / "final" / "config.json").is_file()
    assert (out / "samples.md").is_file()
    assert procs.survivors(procs.launched(out)) == []
