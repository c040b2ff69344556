"""HFEngine.load_weights and the in-place loader: buckets, versions, tied embeddings, validation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfleet.common.control.messages import SamplingParams
from rlfleet.rollout.engines import HFEngine
from rlfleet.rollout.engines.weights import TiedPair, copy_weights, load_targets
from rlfleet.rollout.errors import UnknownWeight, WeightDtypeMismatch, WeightShapeMismatch

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
PROMPTS = [[30, 11, 8, 15], [5, 40, 6], [50, 60, 44, 9, 13, 21]]
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _state(path: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path).state_dict()


@pytest.mark.timeout(60)
def test_bucketed_load_makes_output_equal_the_other_model(make_checkpoint) -> None:
    engine = HFEngine(make_checkpoint(seed=0))
    target = HFEngine(make_checkpoint(seed=1)).generate(PROMPTS, GREEDY)
    before = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in before] != [c.token_ids for c in target]
    assert engine.weight_version == 0

    state = _state(make_checkpoint(seed=1))
    names = list(state)
    # one bucket at a time, in each accepted form: a generator of pairs, a mapping, a list of pairs
    engine.load_weights((n, state[n]) for n in names[:5])
    engine.load_weights({n: state[n] for n in names[5:12]})
    engine.load_weights([(n, state[n]) for n in names[12:]])
    assert engine.weight_version == 0
    engine.set_weight_version(3)
    assert engine.weight_version == 3

    after = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in after] == [c.token_ids for c in target]
    for a, t in zip(after, target, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(t.logprobs), atol=1e-5, rtol=0)


@pytest.mark.timeout(60)
def test_version_argument_and_bad_versions(tiny_checkpoint: Path) -> None:
    engine = HFEngine(tiny_checkpoint)
    engine.load_weights({"model.norm.weight": torch.ones(32)}, version=4)
    assert engine.weight_version == 4
    with pytest.raises(ValueError, match=">= 0"):
        engine.set_weight_version(-1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sent", [EMBED, HEAD])
def test_tied_embeddings_update_together(tiny_checkpoint: Path, sent: str) -> None:
    engine = HFEngine(tiny_checkpoint)
    model = engine.model
    assert model.config.tie_word_embeddings
    new = torch.randn_like(model.lm_head.weight)
    engine.load_weights({sent: new})
    assert torch.equal(model.lm_head.weight, new)
    assert torch.equal(model.model.embed_tokens.weight, new)


@pytest.mark.timeout(30)
def test_tied_pair_without_shared_storage_is_copied_both_ways() -> None:
    module = torch.nn.ModuleDict({"emb": torch.nn.Embedding(6, 4), "head": torch.nn.Linear(4, 6, bias=False)})
    targets = load_targets(module)
    tied = (TiedPair("emb.weight", "head.weight"),)
    for sent, other in (("emb.weight", module["head"].weight), ("head.weight", module["emb"].weight)):
        new = torch.randn(6, 4)
        copy_weights(targets, {sent: new}, tied)
        assert torch.equal(other, new)


@pytest.mark.timeout(60)
def test_untied_model_keeps_head_and_embedding_apart(make_checkpoint) -> None:
    engine = HFEngine(make_checkpoint(seed=2, tie=False))
    head_before = engine.model.lm_head.weight.clone()
    engine.load_weights({EMBED: torch.zeros_like(head_before)})
    assert torch.equal(engine.model.lm_head.weight, head_before)
    assert not engine.model.model.embed_tokens.weight.any()


@pytest.mark.timeout(60)
def test_unknown_name_is_refused_and_nothing_is_copied(tiny_checkpoint: Path) -> None:
    engine = HFEngine(tiny_checkpoint)
    norm_before = engine.model.model.norm.weight.clone()
    bucket = {
        "model.norm.weight": torch.zeros(32),
        "module.model.layers.0.mlp.up_proj.weight": torch.zeros(64, 32),
    }
    with pytest.raises(UnknownWeight) as info:
        engine.load_weights(bucket)
    message = str(info.value)
    assert "'module.model.layers.0.mlp.up_proj.weight'" in message
    assert "did you mean 'model.layers.0.mlp.up_proj.weight'" in message
    assert EMBED in message  # examples of real names
    assert isinstance(info.value, KeyError)
    assert torch.equal(engine.model.model.norm.weight, norm_before)


@pytest.mark.timeout(60)
def test_shape_and_dtype_are_validated_and_float_casts_allowed(tiny_checkpoint: Path) -> None:
    engine = HFEngine(tiny_checkpoint)
    with pytest.raises(WeightShapeMismatch, match=r"shape \[31\] does not match the model's \[32\]"):
        engine.load_weights({"model.norm.weight": torch.ones(31)})
    with pytest.raises(WeightDtypeMismatch, match="torch.int64"):
        engine.load_weights({"model.norm.weight": torch.ones(32, dtype=torch.int64)})
    value = torch.full((32,), 1.5, dtype=torch.bfloat16)
    engine.load_weights([("model.norm.weight", value)])
    assert engine.model.model.norm.weight.dtype == torch.float32
    assert torch.equal(engine.model.model.norm.weight, torch.full((32,), 1.5))
