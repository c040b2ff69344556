"""Rollout side of the weight carriers on CPU: the carrier a worker takes, refusals, late join, vLLM range."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rlfleet.common.control.messages import LoadWeights, WeightsPublished
from rlfleet.common.schema.carriers import IpcBucket
from rlfleet.common.schema.refs import TensorRef
from rlfleet.rollout import catch_up as catch_up_module
from rlfleet.rollout.catch_up import catch_up
from rlfleet.rollout.engines import HFEngine
from rlfleet.rollout.engines.cuda_ipc import open_bucket
from rlfleet.rollout.engines.vllm.runtime import check_vllm_version
from rlfleet.rollout.errors import IpcUnavailable, NoUsableCarrier, UnsupportedVLLM
from rlfleet.rollout.service import RolloutWorker

GPU_A, GPU_B = "2703ff26-bf43-215b-c5ec-62563bbd3bb0", "9a1c0de4-0000-4000-8000-000000000001"
REF = TensorRef(address="127.0.0.1:1", key="weights/v2/0", nbytes=10)


def _ipc(gpu: str) -> IpcBucket:
    tensors = [{"name": "model.norm.weight", "dtype": "float32", "shape": [4], "offset": 0}]
    return IpcBucket(gpu_uuid=gpu, handle="QUFB", storage_bytes=64, storage_offset=0, tensors=tensors)


def _carrier(worker_gpus: list[str], message: LoadWeights) -> str:
    return RolloutWorker.carrier(SimpleNamespace(gpu_uuids=worker_gpus, worker_id="rollout-0"), message)  # type: ignore[arg-type]


def test_a_worker_takes_ipc_only_for_buckets_on_its_own_gpu() -> None:
    both = LoadWeights(weight_version=2, buckets=[REF], ipc_buckets=[_ipc(GPU_A)])
    assert _carrier([GPU_A], both) == "cuda_ipc"
    assert _carrier([GPU_B], both) == "grpc"  # another GPU: the tensor plane
    assert _carrier([], both) == "grpc"  # a CPU worker
    assert _carrier([GPU_A, GPU_B], both) == "grpc"  # tensor-parallel: not by IPC
    assert _carrier([GPU_A], LoadWeights(weight_version=2, buckets=[REF])) == "grpc"


def test_ipc_only_for_another_gpu_is_refused_by_name() -> None:
    only_ipc = LoadWeights(weight_version=2, buckets=[], ipc_buckets=[_ipc(GPU_A)])
    with pytest.raises(
        NoUsableCarrier, match=f"rollout-0 cannot load weight version 2.*GPU {GPU_A}.*the CPU"
    ):
        _carrier([], only_ipc)


async def test_a_late_worker_that_cannot_use_the_ipc_publish_joins_at_its_own_version(monkeypatch) -> None:
    published = WeightsPublished(
        weight_version=5, buckets=[], ipc_buckets=[_ipc(GPU_A)], nbytes=16, seconds=0.0
    )

    async def latest(*args: object, **kwargs: object) -> WeightsPublished:
        return published

    async def load(message: LoadWeights) -> None:
        assert message.ipc_buckets == published.ipc_buckets  # the IPC buckets are passed on
        raise NoUsableCarrier("rollout-0", 5, "it came only by CUDA IPC")

    monkeypatch.setattr(catch_up_module, "latest_weights", latest)
    assert await catch_up(None, "c", "rollout-0", 0, load) == 0  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
def test_opening_an_ipc_bucket_without_cuda_is_a_clear_error(tiny_checkpoint) -> None:
    with pytest.raises(IpcUnavailable, match="need a CUDA device"):
        open_bucket(_ipc(GPU_A), 0)
    engine = HFEngine(tiny_checkpoint)
    assert engine.gpu_uuids == []
    with pytest.raises(IpcUnavailable, match="runs on CPU"):
        engine.load_ipc([_ipc(GPU_A)])


@pytest.mark.parametrize(
    "version", ["0.26.0", "0.26.0+cu130", "0.29.2", "0.32.0", "0.32.1.dev3+g1234", "0.26rc1"]
)
def test_supported_vllm_releases_pass(version: str) -> None:
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.25.1", "0.33.0", "1.0.0", "nightly"])
def test_other_vllm_releases_are_refused_with_the_range(version: str, monkeypatch) -> None:
    monkeypatch.delenv("RLFLEET_VLLM_ANY_VERSION", raising=False)
    with pytest.raises(UnsupportedVLLM, match=r">=0.26,<0.33"):
        check_vllm_version(version)
    monkeypatch.setenv("RLFLEET_VLLM_ANY_VERSION", "1")
    check_vllm_version(version)  # the user's own risk
