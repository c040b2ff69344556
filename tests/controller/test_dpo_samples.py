"""DPO's samples.md (issue 35, point 7): pairs with their chosen and rejected log-ratios and the
margin, computed here against a reference that differs from the policy, then checked token by token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlfleet.controller.dpo_samples import sequence_logp, write_dpo_samples
from rlfleet.controller.models import resolve_model
from rlfleet.controller.preference import PreferenceDataset


@pytest.mark.timeout(240)
def test_samples_md_holds_each_pairs_log_ratios_and_margin(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    reference = resolve_model("tiny:digits", cache_dir=tmp_path / "models", seed=0)
    out = tmp_path / "run"
    shutil.copytree(resolve_model("tiny:digits", cache_dir=tmp_path / "models", seed=1), out / "final")
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"q: {i} {i + 1} ->", "chosen": f"{i}{i + 1}", "rejected": "ab"} for i in range(5)]
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    dataset = PreferenceDataset(pairs, max_prompt_length=32, max_response_length=8, seed=0)
    dataset.bind_tokenizer(reference)
    text = write_dpo_samples(out, reference, dataset, 3, beta=0.1)
    assert (out / "samples.md").read_text() == text + "\n"
    table = [line for line in text.splitlines() if line.startswith("| q: ")]
    assert len(table) == 3, text
    policy, ref = (
        AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32) for d in (out / "final", reference)
    )
    for line, item in zip(table, dataset.sample_items(3), strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        chosen, rejected = dataset.responses(item)
        prompt = list(item.token_ids or [])
        ratios = [
            sequence_logp(policy, prompt, ids) - sequence_logp(ref, prompt, ids) for ids in (chosen, rejected)
        ]
        assert cells[0] == item.prompt and cells[2] == "ab"
        assert float(cells[3]) == pytest.approx(ratios[0], abs=1e-3)
        assert float(cells[4]) == pytest.approx(ratios[1], abs=1e-3)
        assert float(cells[5]) == pytest.approx(0.1 * (ratios[0] - ratios[1]), abs=1e-3)
        assert ratios[0] != 0.0  # the policy differs from the reference: the margins mean something
    assert "mean margin:" in text


def test_sequence_logp_sums_the_response_tokens_only() -> None:
    class Uniform(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor) -> object:
            return type("Out", (), {"logits": torch.zeros(*input_ids.shape, 4)})()

    assert sequence_logp(Uniform(), [1, 2, 3], [0, 1]) == pytest.approx(
        2 * torch.log(torch.tensor(0.25)).item()
    )
