"""``rlfleet eval`` with the run's Hugging Face conventions, through the console script: a model
folder that ships its own code (``--trust-remote-code``), a chat template of the user's
(``--chat-template FILE``) and the test split of a folder of split files read through ``datasets``
(``--split test``). Without ``--trust-remote-code`` the same folder is refused, exit code 2."""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = (
    "{% for m in messages %}Q: {{ m['content'] }}{% endfor %}{% if add_generation_prompt %} A:{% endif %}"
)
TRAIN, TEST = ["in: 1 ->", "in: 22 ->", "in: 333 ->"], ["in: 4444 ->", "in: 55 ->"]


def _borrowed_fixture():  # noqa: ANN202 - a pytest fixture function
    """``remote_model`` of test_trust_remote_code.py (tiny:digits whose classes live in the folder)."""
    spec = importlib.util.spec_from_file_location(
        "rlfleet_tests_trust_remote_code", Path(__file__).with_name("test_trust_remote_code.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.remote_model


remote_model = _borrowed_fixture()


def _eval(venv_script, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([venv_script("rlfleet"), "eval", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_eval_with_remote_code_a_chat_template_and_a_split(
    remote_model: Path, tmp_path: Path, venv_script, cli_env: dict[str, str]
) -> None:
    splits = tmp_path / "splits"
    splits.mkdir()
    for name, prompts in (("train", TRAIN), ("test", TEST)):
        (splits / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    template = tmp_path / "qa.jinja"
    template.write_text(TEMPLATE)
    common = [
        "--data",
        str(splits),
        "--split",
        "test",
        "--chat-template",
        str(template),
        "--max-new-tokens",
        "4",
    ]
    refused = _eval(venv_script, cli_env, str(remote_model), *common)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "--trust-remote-code" in refused.stderr and "Traceback" not in refused.stderr
    out = tmp_path / "result.json"
    run = _eval(venv_script, cli_env, str(remote_model), *common, "--trust-remote-code", "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["data"] == f"hf:{splits}?split=test"
    assert result["settings"]["chat_template"] == str(template) and result["settings"]["trust_remote_code"]
    rows = result["models"][0]["rows"]
    assert [row["prompt"] for row in rows] == TEST
    # the template's text around each prompt, one token per character of the tiny tokenizer (no BOS:
    # a template writes its own special tokens); the model's own rendering would be BOS + the prompt
    rendered = [f"Q: {p} A:" for p in TEST]
    assert [row["prompt_tokens"] for row in rows] == [len(text) for text in rendered]
    assert all(0 <= row["tokens"] <= 4 for row in rows)
