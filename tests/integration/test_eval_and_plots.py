"""``rlfleet eval``, ``rlfleet plot`` and a tiny GRPO run's held-out eval, through the console script.

One tiny GRPO run (examples/tiny_grpo.yaml, 4 steps, a checkpoint every 2, a held-out eval every 2
answering up to eval.max_tokens=20 new tokens while training responses stop at 12) is shared by the
tests of this module: its eval files and plots, ``rlfleet eval`` on it and on ``tiny:digits``, and
``rlfleet plot`` on it and overlaid with a second run. Every number checked is recomputed from the
answers the JSON holds. Bad input exits with code 2 and one line naming it.

The run's console is a new user's (issue 35, point 2): ``kl_coef: 0`` (KL off) and
``faults.stall_report_s=1``, so that its held-out evaluations (and every other request, each
longer than a second but within the deadline its work was given) would print any stall warning.
It must name the workers it starts and each evaluation as it begins, say ``KL: off``, and hold no
stall warning, third-party progress bar or traceback; ``rlfleet eval`` scoring a reward spec beside
the built-in similarity ends without gRPC's "Event loop is closed" traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_grpo.yaml"
REWARD = "charset:allowed=0123456789"
"""The example's reward spec: eval.jsonl names the run's reward by it."""
RESPONSE_TOKENS, EVAL_TOKENS = 12, 20
"""The example's max_response_length, and the run's eval.max_tokens (held-out answers only)."""
PNG = b"\x89PNG\r\n\x1a\n"
BARS = re.compile(r"Loading (weights|checkpoint shards)|it/s\]")
"""What a transformers / hub / datasets tqdm bar leaves in captured output."""


def _heldout(path: Path, count: int = 8) -> Path:
    """Held-out digit prompts with a numeric ``answer`` (so pass@k is measured)."""
    rows = [json.loads(line) for line in (REPO / "examples/data/tiny_digits.jsonl").read_text().splitlines()]
    path.write_text(
        "".join(json.dumps({"prompt": r["prompt"], "answer": r["digits"]}) + "\n" for r in rows[-count:])
    )
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, rlfleet_cache: Path, venv_script) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("eval-run")
    held = _heldout(root / "held.jsonl")
    out = root / "run"
    inherited = {k: v for k, v in os.environ.items() if "PROGRESS_BARS" not in k}  # bars as a user has them
    env = {**inherited, "RLFLEET_CACHE": str(rlfleet_cache), "PYTHONUNBUFFERED": "1"}
    command = [
        venv_script("rlfleet"),
        "train",
        str(EXAMPLE),
        "max_steps=4",
        "save_every=2",
        "eval.every=2",
        f"eval.data={held}",
        f"eval.max_tokens={EVAL_TOKENS}",
        f"max_response_length={RESPONSE_TOKENS}",
        f"output_dir={out}",
        "log_every=1",
        "faults.stall_report_s=1",
    ]
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stderr[-3000:]
    return {"out": out, "held": held, "stdout": run.stdout, "stderr": run.stderr, "env": env}


def _rlfleet(
    venv_script, env: dict[str, str], *args: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [venv_script("rlfleet"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def _digit_share(text: str) -> float:
    """What ``charset:allowed=0123456789`` gives: the share of non-space characters that are digits."""
    chars = [c for c in text if not c.isspace()]
    return sum(c in "0123456789" for c in chars) / len(chars) if chars else 0.0


def _check_summary(summary: dict[str, Any], rows: list[dict[str, Any]], limit: int) -> None:
    words = [len(row["answer"].split()) for row in rows]
    assert [row["words"] for row in rows] == words
    assert summary["mean_words"] == pytest.approx(statistics.fmean(words))
    assert summary["within_limit"] == pytest.approx(statistics.fmean(w <= limit for w in words))
    assert summary["similarity"] == pytest.approx(statistics.fmean(row["similarity"] for row in rows))
    assert all(-1.0 <= row["similarity"] <= 1.0 for row in rows)
    assert summary["pass@1"] == pytest.approx(statistics.fmean(float(row["correct"]) for row in rows))


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_run_evaluates_held_out_prompts_and_draws_plots(tiny_run: dict[str, Any]) -> None:
    out = tiny_run["out"]
    records = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert [r["label"] for r in records] == ["before", "step-2", "step-4", "after"]
    assert [r["step"] for r in records] == [0, 2, 4, 4]
    for record in records:
        assert len(record["rows"]) == 8
        _check_summary(record["summary"], record["rows"], 50)
        charset = [_digit_share(r["answer"]) for r in record["rows"]]
        assert record["summary"]["rewards"] == {REWARD: pytest.approx(statistics.fmean(charset))}
        assert all(r["tokens"] <= EVAL_TOKENS and r["prompt_tokens"] > 0 for r in record["rows"])
    # held-out answers run past the training responses' length (the random-init model rarely stops)
    assert max(r["tokens"] for r in records[0]["rows"]) > RESPONSE_TOKENS
    saved = json.loads((out / "eval.json").read_text())
    assert saved["before"] == records[0]["summary"] and saved["after"] == records[-1]["summary"]
    assert "held-out eval before" in tiny_run["stdout"] and "- after:" in tiny_run["stdout"]
    samples = (out / "samples.md").read_text()
    held_prompts = {json.loads(line)["prompt"] for line in tiny_run["held"].read_text().splitlines()}
    table_prompts = [
        line.split("|")[1].strip() for line in samples.splitlines() if line.startswith("| ") and "->" in line
    ]
    assert len(table_prompts) == 3 and set(table_prompts) <= held_prompts
    for name in ("reward", "response_length", "entropy", "step_time", "eval", "reward_components",
                 "policy_drift", "step_phases", "loss"):  # fmt: skip
        data = (out / "plots" / f"{name}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, name
    assert not (out / "plots" / "kl.png").exists(), "KL is off: no plot may say KL"


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_the_console_of_a_tiny_run(tiny_run: dict[str, Any]) -> None:
    stdout, stderr = tiny_run["stdout"], tiny_run["stderr"]
    lines = stdout.splitlines()
    starting = [line for line in lines if line.startswith("starting ")]
    assert starting == ["starting 3 workers: trainer-0, reward-0, rollout-0"], stdout[:2000]
    assert any(re.fullmatch(r"fleet ready after \d+ s", line) for line in lines), stdout[:2000]
    evaluating = [line for line in lines if line.startswith("evaluating ")]
    assert evaluating == [
        f"evaluating 8 held-out prompts ({label}, step {step}, up to {EVAL_TOKENS} new tokens each)"
        for label, step in (("before", 0), ("step-2", 2), ("step-4", 4))
    ], stdout
    # the workers' line first, then each evaluation's line before its result
    assert lines.index(starting[0]) < lines.index(evaluating[0])
    assert lines.index(evaluating[0]) < next(
        i for i, line in enumerate(lines) if line.startswith("held-out eval before")
    )
    progress = [line for line in lines if line.startswith("[PROGRESS]")]
    assert len(progress) == 4 and all("| KL: off |" in line for line in progress), progress
    both = stdout + stderr
    # a heartbeating worker within its request's deadline is no stall (the reward worker's beats can
    # pause for seconds while it loads its similarity model: that silence is still reported)
    stalls = [line for line in both.splitlines() if "stall:" in line and "alive and heartbeating" in line]
    assert not stalls, stalls
    assert not BARS.search(both), BARS.search(both)
    assert "Traceback" not in both


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_rlfleet_eval_ends_without_a_traceback_or_bars(tiny_run: dict[str, Any], venv_script) -> None:
    final = tiny_run["out"] / "final"
    done = _rlfleet(venv_script, tiny_run["env"], "eval", str(final), "tiny:digits", "--data",
                    str(tiny_run["held"]), "--max-new-tokens", "8", "--reward", REWARD)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Event loop is closed" not in done.stderr, done.stderr[-3000:]
    assert not BARS.search(done.stderr), done.stderr[-2000:]
    header = done.stdout.splitlines()[0].split()
    assert header[5] == "SIMILARITY" and "RELEVANCE" not in header, done.stdout


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_rlfleet_eval_on_a_tiny_model_and_a_run_dir(
    tiny_run: dict[str, Any], venv_script, tmp_path: Path
) -> None:
    out, result = tiny_run["out"], tmp_path / "results.json"
    run = _rlfleet(
        venv_script,
        tiny_run["env"],
        "eval",
        "tiny:digits",
        str(out),
        "--data",
        str(tiny_run["held"]),
        "--reward",
        REWARD,
        "--max-new-tokens",
        str(EVAL_TOKENS),
        "--limit-words",
        "1",
        "--out",
        str(result),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    data = json.loads(result.read_text())
    labels = [m["model"] for m in data["models"]]
    assert labels == ["tiny:digits", f"{out}/checkpoint-2", f"{out}/checkpoint-4", f"{out}/final"]
    table = run.stdout.splitlines()
    assert table[0].split()[:6] == ["MODEL", "ANSWERS", "WORDS", "TOKENS", "<=1W", "SIMILARITY"]
    for model in data["models"]:
        rows, summary = model["rows"], model["summary"]
        assert len(rows) == 8 and all(r["tokens"] <= EVAL_TOKENS for r in rows)
        _check_summary(summary, rows, 1)
        line = next(line for line in table if line.split()[0] == model["model"])
        assert (
            line.split()[2] == f"{summary['mean_words']:.1f}"
            and line.split()[5] == f"{summary['similarity']:.3f}"
        )
    # the trained model answers like the run's own final eval did (greedy, same prompts and weights)
    final = {r["index"]: r["answer"] for r in data["models"][-1]["rows"]}
    after = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])["rows"]
    assert sum(final[r["index"]] == r["answer"] for r in after) >= 6


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_rlfleet_eval_sampled_gives_pass_at_k(tiny_run: dict[str, Any], venv_script, tmp_path: Path) -> None:
    result = tmp_path / "sampled.json"
    run = _rlfleet(
        venv_script,
        tiny_run["env"],
        "eval",
        str(tiny_run["out"] / "final"),
        "--data",
        str(tiny_run["held"]),
        "--temperature",
        "1.0",
        "--samples",
        "3",
        "--max-new-tokens",
        "8",
        "--max-prompts",
        "4",
        "--out",
        str(result),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    model = json.loads(result.read_text())["models"][0]
    assert len(model["rows"]) == 12 and sorted({r["sample"] for r in model["rows"]}) == [0, 1, 2]
    _check_summary(model["summary"], model["rows"], 50)
    assert "pass@3" in model["summary"] and model["summary"]["pass@3"] >= model["summary"]["pass@1"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rlfleet_plot_redraws_and_overlays_runs(
    tiny_run: dict[str, Any], venv_script, tmp_path: Path
) -> None:
    single = tmp_path / "single"
    run = _rlfleet(venv_script, tiny_run["env"], "plot", str(tiny_run["out"]), "--out", str(single))
    assert run.returncode == 0, run.stderr[-2000:]
    assert {Path(line).name for line in run.stdout.split()} >= {"reward.png", "eval.png", "step_time.png"}
    other = tmp_path / "other"
    shutil.copytree(tiny_run["out"], other, ignore=shutil.ignore_patterns("checkpoint-*", "final", "fleet"))
    rows = [json.loads(line) for line in (other / "metrics.jsonl").read_text().splitlines()]
    (other / "metrics.jsonl").write_text(
        "".join(json.dumps({**r, "reward/mean": 1 - r["reward/mean"]}) + "\n" for r in rows)
    )
    overlay = tmp_path / "overlay"
    run = _rlfleet(
        venv_script, tiny_run["env"], "plot", str(tiny_run["out"]), str(other), "--out", str(overlay)
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for name in ("reward.png", "eval.png"):
        one, both = (single / name).read_bytes(), (overlay / name).read_bytes()
        assert one.startswith(PNG) and both.startswith(PNG) and len(both) > 5000 and one != both


@pytest.mark.timeout(240)
def test_bad_input_exits_2_naming_it(tmp_path: Path, venv_script, cli_env) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "in: 1 ->"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    not_model = tmp_path / "notamodel"
    not_model.mkdir()
    bad_run = tmp_path / "badrun"
    bad_run.mkdir()
    (bad_run / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.1}\n{oops\n')
    cases = [
        (["eval", "tiny:x", "--data", str(tmp_path / "missing.jsonl")], "no such file"),
        (["eval", str(not_model), "--data", str(prompts)], "has no config.json"),
        (["eval", "tiny:x", "--data", str(empty)], "holds no rows"),
        (["eval", "tiny:x", "--data", str(prompts), "--samples", "2"], "--temperature"),
        (["plot", str(bad_run)], "metrics.jsonl:2"),
        (["plot", str(tmp_path / "nowhere")], "no such directory"),
    ]
    for args, reason in cases:
        run = _rlfleet(venv_script, cli_env, *args, timeout=120)
        assert run.returncode == 2, (args, run.stderr[-2000:])
        assert reason in run.stderr and "Traceback" not in run.stderr, (args, run.stderr[-2000:])
