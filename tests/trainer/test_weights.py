"""Weight buckets for publishing, and saving the policy in HF format."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlfleet.trainer.actor import Actor
from rlfleet.trainer.errors import ModelLoadError
from rlfleet.trainer.model_io import load_causal_lm
from rlfleet.trainer.weights import iter_weight_buckets, tied_aliases

pytestmark = pytest.mark.timeout(60)


def _nbytes(bucket: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in bucket.values())


def test_buckets_reassemble_the_state_dict_within_the_size_bound(tiny_model_dir: Path) -> None:
    actor = Actor(tiny_model_dir)
    state = actor.model.state_dict()
    aliases = tied_aliases(actor.model)
    assert aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    bound = 6000  # the embedding (64 x 32 float32 = 8192 bytes) is larger: it goes alone
    buckets = list(actor.iter_weight_buckets(bound))
    assert len(buckets) > 2
    for bucket in buckets:
        assert bucket and (_nbytes(bucket) <= bound or len(bucket) == 1)
    assert any(_nbytes(b) > bound for b in buckets)
    merged = {name: t for bucket in buckets for name, t in bucket.items()}
    assert sum(len(b) for b in buckets) == len(merged)  # no name twice
    assert set(merged) == set(state) - set(aliases)
    assert list(merged) == [name for name in state if name not in aliases]  # state-dict order
    for name, tensor in merged.items():
        assert tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.requires_grad
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)
    with_tied = {n for b in actor.iter_weight_buckets(bound, include_tied=True) for n in b}
    assert with_tied == set(state)


def test_buckets_are_copies_and_convert_dtype(tiny_model_dir: Path) -> None:
    actor = Actor(tiny_model_dir)
    first = next(actor.iter_weight_buckets(1 << 20))
    name = "model.embed_tokens.weight"
    before = first[name].clone()
    with torch.no_grad():
        actor.model.get_input_embeddings().weight.add_(1.0)
    torch.testing.assert_close(first[name], before, rtol=0, atol=0)
    bf16 = list(actor.iter_weight_buckets(4096, dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for b in bf16 for t in b.values())
    assert all(_nbytes(b) <= 4096 or len(b) == 1 for b in bf16)
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(actor.iter_weight_buckets(0))


def test_loading_a_loaded_bucket_into_a_fresh_model_restores_tied_weights(tiny_model_dir: Path) -> None:
    actor = Actor(tiny_model_dir)
    with torch.no_grad():
        for p in actor.model.parameters():
            p.mul_(0.5)
    receiver = load_causal_lm(tiny_model_dir)
    for bucket in actor.iter_weight_buckets(1 << 14):
        receiver.load_state_dict(bucket, strict=False)
    got = receiver.state_dict()
    for name, value in actor.model.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def test_save_hf_round_trips_with_the_tokenizer(tiny_model_dir: Path, tmp_path: Path) -> None:
    actor = Actor(tiny_model_dir)
    with torch.no_grad():
        actor.model.model.norm.weight.add_(0.25)
    out = actor.save_hf(tmp_path / "ckpt")
    assert (out / "model.safetensors").is_file()
    assert (out / "tokenizer_config.json").read_text() == (
        tiny_model_dir / "tokenizer_config.json"
    ).read_text()
    reloaded = load_causal_lm(out).state_dict()
    for name, value in actor.model.state_dict().items():
        torch.testing.assert_close(reloaded[name], value, rtol=0, atol=0, msg=name)


def test_missing_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        load_causal_lm(tmp_path / "nowhere")


def test_gpu_buckets_and_ipc_sharing_refuse_a_cpu_model_clearly(tiny_model_dir: Path) -> None:
    from rlfleet.trainer.ipc_share import share_bucket
    from rlfleet.trainer.weights import to_host

    model = load_causal_lm(tiny_model_dir)
    with pytest.raises(ValueError, match="needs a model on a CUDA device"):
        next(iter_weight_buckets(model, bucket_bytes=1 << 20, on_device=True))
    bucket = next(iter_weight_buckets(model, bucket_bytes=1 << 20))
    with pytest.raises(ValueError, match="on the CPU"):
        share_bucket(bucket)
    with pytest.raises(ValueError, match="empty bucket"):
        share_bucket({})
    assert to_host(bucket) is bucket  # already on the host


async def test_a_cpu_trainer_refuses_to_publish_by_cuda_ipc() -> None:
    from types import SimpleNamespace

    from rlfleet.common.control.messages import PublishWeights
    from rlfleet.trainer.service import TrainerWorker

    worker = SimpleNamespace(actor=SimpleNamespace(device=torch.device("cpu")))
    with pytest.raises(ValueError, match="needs the trainer on a GPU"):
        await TrainerWorker._publish(worker, PublishWeights(carriers=["cuda_ipc"]))  # type: ignore[arg-type]
