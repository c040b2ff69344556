"""The vLLM engine's main-process helpers, without vLLM: checkpoint facts, staging, tied names, payloads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from weight_buckets import weight_buckets  # (this folder's helper module)

from rlfleet.rollout.engines.checkpoint import read_checkpoint
from rlfleet.rollout.engines.vllm.weights import (
    WeightStager,
    decode_bucket,
    encode_bucket,
    group_of,
    resolve_tied,
)

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def test_group_of_is_the_block_or_the_module() -> None:
    assert group_of("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert group_of("model.layers.12.mlp.up_proj.bias") == "model.layers.12"
    assert group_of("model.norm.weight") == "model.norm"
    assert group_of(EMBED) == "model.embed_tokens"
    assert group_of(HEAD) == "lm_head"
    assert group_of("scale") == "scale"


@pytest.mark.timeout(60)
def test_read_checkpoint_facts(make_vllm_checkpoint) -> None:
    tied = read_checkpoint(make_vllm_checkpoint(seed=0, tie=True))
    assert tied.tied and tied.embed_name == EMBED and HEAD not in tied.weights
    assert (tied.eos_ids, tied.pad_id, tied.vocab_size, tied.max_positions) == ((1,), 0, 71, 256)
    assert tied.weights["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)  # one KV head of 32
    assert all(t.device.type == "meta" for t in tied.weights.values())
    untied = read_checkpoint(make_vllm_checkpoint(seed=0, tie=False))
    assert not untied.tied and untied.weights[HEAD].shape == (71, 64)
    assert tied.tokenizer.padding_side == "left"


@pytest.mark.timeout(60)
def test_stager_releases_whole_blocks_from_trainer_buckets(make_vllm_checkpoint) -> None:
    model = AutoModelForCausalLM.from_pretrained(make_vllm_checkpoint(seed=1, tie=True))
    names = [n for n in model.state_dict() if n != HEAD]
    stager = WeightStager(names)
    released: list[str] = []
    buckets = list(weight_buckets(model, 20_000))  # small: boundaries fall inside blocks
    assert len(buckets) > 4
    for bucket in buckets:
        ready, groups = stager.add(bucket.items())
        for group in groups:  # a released group is complete: every one of its names is in `ready`
            assert {n for n in names if group_of(n) == group} <= {n for n, _ in ready}
        released += [n for n, _ in ready]
    assert sorted(released) == sorted(names) and stager.pending == []
    assert stager.groups == {"model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"}


def test_stager_reports_and_drops_incomplete_blocks() -> None:
    names = ["model.layers.0.q.weight", "model.layers.0.k.weight", "model.norm.weight"]
    stager = WeightStager(names)
    ready, groups = stager.add(
        [("model.layers.0.q.weight", torch.zeros(2)), ("model.norm.weight", torch.ones(2))]
    )
    assert [n for n, _ in ready] == ["model.norm.weight"] and groups == {"model.norm"}
    assert stager.pending == ["model.layers.0.k.weight"]
    assert stager.clear() == ["model.layers.0.k.weight"]
    assert stager.pending == []
    ready, _ = stager.add([("model.layers.0.k.weight", torch.zeros(2))])
    assert ready == []  # the q tensor staged before clear() is gone


def test_stager_keeps_the_latest_tensor_of_a_name() -> None:
    stager = WeightStager(["model.layers.0.a", "model.layers.0.b"])
    stager.add([("model.layers.0.a", torch.zeros(1))])
    stager.add([("model.layers.0.a", torch.ones(1))])
    ready, _ = stager.add([("model.layers.0.b", torch.zeros(1))])
    assert dict(ready)["model.layers.0.a"].item() == 1.0


def test_resolve_tied_sends_the_head_as_the_embedding_once() -> None:
    head, embed, other = torch.ones(2), torch.zeros(2), torch.full((2,), 3.0)
    assert [n for n, _ in resolve_tied([(HEAD, head), ("x", other)], EMBED, HEAD)] == [EMBED, "x"]
    both = resolve_tied([(EMBED, embed), (HEAD, head)], EMBED, HEAD)
    assert len(both) == 1 and both[0][0] == EMBED and both[0][1] is embed


def test_bucket_payload_round_trips_exactly() -> None:
    items = [
        ("a", torch.randn(3, 4)),
        ("b", torch.arange(5)),
        ("c", torch.randn(2, 2).to(torch.bfloat16).t()),
    ]
    payload = encode_bucket(items)
    assert isinstance(payload, bytes)
    back = dict(decode_bucket(payload))  # safetensors lays tensors out by its own order
    assert sorted(back) == ["a", "b", "c"]
    for name, want in items:
        assert back[name].dtype == want.dtype and torch.equal(back[name], want)
    assert decode_bucket(items) == items  # in-process calls hand the pairs over as they are


@pytest.mark.timeout(60)
def test_read_checkpoint_needs_safetensors(tmp_path: Path, make_vllm_checkpoint) -> None:
    from rlfleet.common.errors import ConfigError

    source = make_vllm_checkpoint()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    with pytest.raises(ConfigError, match=r"no \*\.safetensors"):
        read_checkpoint(tmp_path)
