"""What the controller asks the trainer to publish: the carriers its rollout workers need and the dtype."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from rlfleet.common.control.inproc_transport import InProcessTransport
from rlfleet.controller import TrainerConfig
from rlfleet.controller.fleet import Fleet

GPU_A, GPU_B = "2703ff26-bf43-215b-c5ec-62563bbd3bb0", "9a1c0de4-0000-4000-8000-000000000001"


def _worker(gpus: list[str]) -> SimpleNamespace:
    return SimpleNamespace(announce=SimpleNamespace(gpu_uuids=gpus), weight_version=0)


def _fleet(trainer: list[str], rollout: list[list[str]]) -> Fleet:
    fleet = Fleet(InProcessTransport(), "c")
    tiers = {"trainer": [_worker(trainer)], "rollout": [_worker(g) for g in rollout]}
    fleet.registry = SimpleNamespace(workers=lambda tier, pool=None: tiers[tier])  # type: ignore[assignment]
    return fleet


def test_the_fleet_asks_for_each_carrier_its_workers_need() -> None:
    assert _fleet([GPU_A], [[GPU_A]]).weight_carriers("auto") == ["cuda_ipc"]  # colocated: no gRPC staging
    assert _fleet([GPU_A], [[GPU_A], [GPU_B], []]).weight_carriers("auto") == ["cuda_ipc", "grpc"]
    assert _fleet([], [[]]).weight_carriers("auto") == ["grpc"]  # CPU
    assert _fleet([GPU_A], [[GPU_A]]).weight_carriers("grpc") == ["grpc"]
    assert _fleet([GPU_A], []).weight_carriers("auto") == [
        "grpc"
    ]  # no worker yet: a late joiner can catch up
    with pytest.raises(ValueError, match="not the trainer's GPU"):
        _fleet([GPU_A], [[GPU_A], [GPU_B]]).weight_carriers("cuda_ipc")


def test_weights_are_published_in_the_engines_reduced_dtype_only_when_all_agree() -> None:
    assert TrainerConfig().publish_dtype() == ""  # float32 engines take what the trainer holds
    assert TrainerConfig(rollout={"dtype": "bfloat16"}).publish_dtype() == "bfloat16"
    pools = {"a": {"workers": 1}, "b": {"workers": 1, "dtype": "float32"}}
    mixed = TrainerConfig(rollout={"dtype": "bfloat16", "pools": pools})
    assert mixed.publish_dtype() == ""
    same = TrainerConfig(rollout={"dtype": "float16", "pools": {"a": {"workers": 1, "dtype": "float16"}}})
    assert same.publish_dtype() == "float16"


def test_weight_carrier_is_checked_at_load_time() -> None:
    assert TrainerConfig().weight_carrier == "auto"
    with pytest.raises(ValidationError, match="weight_carrier"):
        TrainerConfig(weight_carrier="nccl")
