"""Hugging Face Hub model ids, offline: a model placed in a temporary Hugging Face cache (the real
``models--org--name/snapshots/<commit>`` layout, checked by ``huggingface_hub.scan_cache_dir``)
resolves to its snapshot, trains by its id through ``rlfleet train`` and scores as a reward model
named by its id; an id the cache lacks is a one-line error (exit 2) while ``HF_HUB_OFFLINE`` is set."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from rlfleet.controller.errors import ModelNotFound
from rlfleet.controller.models import resolve_model

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_grpo.yaml"
REPO_ID = "rlfleet-test/tiny-digits"


@pytest.fixture
def offline_cache(hf_cache, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """``tiny:digits`` in a temporary Hugging Face cache as ``REPO_ID``; this process offline on it."""
    snapshot = hf_cache.place(tiny_model_dir, REPO_ID)
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache.root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_cache, snapshot


@pytest.mark.timeout(60)
def test_a_cached_hub_id_resolves_to_its_snapshot(offline_cache) -> None:
    from huggingface_hub import scan_cache_dir

    cache, snapshot = offline_cache
    scanned = {repo.repo_id: repo for repo in scan_cache_dir(cache.root).repos}
    assert set(scanned) == {REPO_ID}, "the test cache has the layout huggingface_hub reads"
    assert {rev.commit_hash for rev in scanned[REPO_ID].revisions} == {snapshot.name}

    assert resolve_model(REPO_ID) == snapshot
    assert resolve_model(f"{REPO_ID}@main") == snapshot
    assert resolve_model(f"{REPO_ID}@{snapshot.name}") == snapshot
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(snapshot).config.hidden_size == 64


@pytest.mark.timeout(60)
def test_an_uncached_hub_id_offline_says_so(offline_cache) -> None:
    cache, _ = offline_cache
    for spec in ("rlfleet-test/absent", f"{REPO_ID}@no-such-branch"):
        with pytest.raises(ModelNotFound) as raised:
            resolve_model(spec)
        message = str(raised.value)
        assert "not in the local Hugging Face cache" in message and "HF_HUB_OFFLINE is set" in message
        assert str(cache.root) in message
    with pytest.raises(ModelNotFound, match="no such directory"):
        resolve_model("./not/a/dir")  # a path, never looked up as a Hub id


@pytest.mark.timeout(120)
def test_a_reward_model_named_by_hub_id_loads_from_the_cache(offline_cache) -> None:
    from rlfleet.reward import build_reward
    from rlfleet.reward.errors import RewardModelError

    reward = build_reward(f"rm:path={REPO_ID},device=cpu,input=pair,label=1")  # the tiny LM + a score head
    scores = reward.score(["1+1?", "2+2?"], ["2", "4"]).total
    assert len(scores) == 2 and all(isinstance(score, float) for score in scores)
    with pytest.raises(
        RewardModelError, match="not in the local Hugging Face cache .* HF_HUB_OFFLINE is set"
    ):
        build_reward("rm:path=rlfleet-test/absent-rm,device=cpu")


def _train(venv_script, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess[str]:
    command = [venv_script("rlfleet"), "train", str(EXAMPLE), *overrides]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=360)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_rlfleet_train_takes_a_hub_id_from_the_offline_cache(
    offline_cache, venv_script, cli_env, tmp_path: Path, procs
) -> None:
    cache, snapshot = offline_cache
    env = {**cli_env, "HF_HUB_CACHE": str(cache.root), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "run"
    run = _train(venv_script, env, f"model={REPO_ID}", "max_steps=3", f"output_dir={out}", "log_every=1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert sum(line.startswith("[PROGRESS]") for line in run.stdout.splitlines()) == 3, run.stdout
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert Path(saved["model_path"]) == snapshot
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["weight_version"] for row in rows] == [1, 2, 3]
    assert (out / "final" / "config.json").is_file()
    assert procs.survivors(procs.launched(out)) == []


@pytest.mark.timeout(120)
def test_rlfleet_train_with_an_uncached_hub_id_exits_2(offline_cache, venv_script, cli_env, tmp_path) -> None:
    cache, _ = offline_cache
    env = {**cli_env, "HF_HUB_CACHE": str(cache.root), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "run"
    run = _train(venv_script, env, "model=rlfleet-test/absent", f"output_dir={out}")
    assert run.returncode == 2, run.stderr[-3000:]
    reason = run.stderr.strip()
    assert len(reason.splitlines()) == 1, reason
    assert "'rlfleet-test/absent'" in reason and "not in the local Hugging Face cache" in reason, reason
    assert "HF_HUB_OFFLINE is set" in reason, reason
    assert not (out / "fleet").exists(), "nothing may be spawned for a missing model"
