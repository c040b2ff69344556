"""The weight-carrier schema: the carrier of each link; IPC bucket descriptions checked as hostile input."""

from __future__ import annotations

import base64

import pytest
from pydantic import ValidationError

from rlfleet.common.control.messages import (
    MAX_MESSAGE_BYTES,
    LoadWeights,
    PublishWeights,
    WorkerAnnounce,
    decode,
    encode,
)
from rlfleet.common.schema.carriers import IpcBucket, carrier_for

GPU_A, GPU_B = "2703ff26-bf43-215b-c5ec-62563bbd3bb0", "9a1c0de4-0000-4000-8000-000000000001"


def _bucket(**overrides: object) -> dict[str, object]:
    bucket: dict[str, object] = {
        "gpu_uuid": GPU_A,
        "handle": base64.b64encode(bytes(range(64))).decode(),
        "storage_bytes": 4096,
        "storage_offset": 0,
        "ref_counter": "/torch_1234_567890_0",
        "tensors": [
            {"name": "model.norm.weight", "dtype": "bfloat16", "shape": [64], "offset": 0},
            {"name": "model.embed_tokens.weight", "dtype": "float32", "shape": [8, 64], "offset": 128},
        ],
    }
    bucket.update(overrides)
    return bucket


@pytest.mark.parametrize(
    ("setting", "trainer", "worker", "tp", "expected"),
    [
        ("auto", [GPU_A], [GPU_A], 1, "cuda_ipc"),  # colocated
        ("auto", [GPU_A], [GPU_B], 1, "grpc"),  # another GPU
        ("auto", [GPU_A], [], 1, "grpc"),  # a CPU worker
        ("auto", [], [GPU_A], 1, "grpc"),  # a CPU trainer
        ("auto", [GPU_A], [GPU_A, GPU_B], 2, "grpc"),  # a tensor-parallel engine
        ("grpc", [GPU_A], [GPU_A], 1, "grpc"),
        ("cuda_ipc", [GPU_A], [GPU_A], 1, "cuda_ipc"),
    ],
)
def test_each_link_gets_its_carrier(
    setting: str, trainer: list[str], worker: list[str], tp: int, expected: str
) -> None:
    assert carrier_for(setting, trainer, worker, tp) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("trainer", "worker", "why"),
    [
        ([], [GPU_A], "trainer announced no GPU"),
        ([GPU_A], [], "runs on CPU"),
        ([GPU_A], [GPU_B], "not the trainer"),
    ],
)
def test_demanding_ipc_where_it_cannot_reach_says_why(
    trainer: list[str], worker: list[str], why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        carrier_for("cuda_ipc", trainer, worker)


def test_an_ipc_bucket_round_trips_on_the_wire() -> None:
    bucket = IpcBucket.model_validate(_bucket())
    message = LoadWeights(weight_version=3, buckets=[], ipc_buckets=[bucket])
    back = decode(encode(message))
    assert isinstance(back, LoadWeights) and back.ipc_buckets == [bucket]
    assert bucket.nbytes == 64 * 2 + 8 * 64 * 4


def test_a_publish_of_a_large_model_fits_in_one_message() -> None:
    """A 1,000-tensor model (a 70B has about that many) in 16 buckets stays under NATS's 1 MiB."""
    tensors = [{"name": f"model.layers.{i // 10}.mlp.proj_{i % 10}.weight", "dtype": "bfloat16",
                "shape": [8192, 8192], "offset": (i % 63) * 2**27} for i in range(1008)]  # fmt: skip
    buckets = [
        IpcBucket.model_validate(_bucket(storage_bytes=2**33, tensors=tensors[k::16])) for k in range(16)
    ]
    assert len(encode(LoadWeights(weight_version=1, buckets=[], ipc_buckets=buckets))) < MAX_MESSAGE_BYTES


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"handle": "not base64 at all!"}, "handle must be base64"),
        ({"handle": "QUFB" * 400}, "handle must be base64"),  # over about 1 KB
        ({"event_handle": "%%%"}, "event_handle must be base64"),
        ({"ref_counter": "/etc/passwd"}, "not a torch shared-memory counter"),
        ({"ref_counter": "../../torch_1"}, "not a torch shared-memory counter"),
        ({"storage_bytes": 100}, "ends past the buffer"),
        ({"storage_bytes": 0}, "greater than 0"),
        ({"storage_offset": -1}, "greater than or equal to 0"),
        ({"tensors": []}, "at least 1 item"),
        ({"tensors": [{"name": "w", "dtype": "bfloat16", "shape": [4], "offset": 1}]}, "not aligned"),
        ({"tensors": [{"name": "w", "dtype": "bfloat16", "shape": [-4], "offset": 0}]}, "negative dimension"),
        ({"tensors": [{"name": "w", "dtype": "int64", "shape": [4], "offset": 0}]}, "dtype"),
        ({"tensors": [{"name": "w", "dtype": "float32", "shape": [4], "offset": 0, "extra": 1}]}, "extra"),
        ({"tensors": [{"name": "w", "dtype": "float32", "shape": [4], "offset": 0}] * 2}, "appears twice"),
        ({"surprise": True}, "Extra inputs"),
    ],
)
def test_malformed_ipc_buckets_are_refused_with_the_reason(change: dict[str, object], complaint: str) -> None:
    with pytest.raises(ValidationError, match=complaint):
        IpcBucket.model_validate(_bucket(**change))


def test_publish_requests_name_carriers_and_dtype_strictly() -> None:
    assert PublishWeights().carriers == ["grpc"] and PublishWeights().dtype == ""
    with pytest.raises(ValidationError):
        PublishWeights(carriers=["nccl"])
    with pytest.raises(ValidationError):
        PublishWeights(carriers=[])
    with pytest.raises(ValidationError):
        PublishWeights(dtype="int8")
    announce = WorkerAnnounce(tier="rollout", worker_id="r0", gpu_uuids=[GPU_A])
    assert decode(encode(announce)).gpu_uuids == [GPU_A]
