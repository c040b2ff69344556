"""The job's launcher settings: Ray's settings only with launcher=ray, and Ray's placements
(an outside NATS for a Ray run: test_nats_worker_auth.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlfleet.controller import TrainerConfig
from rlfleet.controller.ray_launcher import RayPlacement, placement_for

pytestmark = pytest.mark.timeout(30)


def test_ray_settings_need_launcher_ray_but_a_dumped_config_loads_again() -> None:
    with pytest.raises(ValidationError, match="ray_address: only used with launcher=ray"):
        TrainerConfig(ray_address="auto")
    config = TrainerConfig()
    assert TrainerConfig.model_validate(config.model_dump()).launcher == "embedded"  # defaults repeated
    ray = TrainerConfig(launcher="ray", ray_num_cpus=2, ray_resources={"rollout": {"num_gpus": 1}})
    assert TrainerConfig.model_validate(ray.model_dump()) == ray


def test_placement_defaults_and_overrides() -> None:
    cpu = placement_for(TrainerConfig(launcher="ray", device="cpu"))
    assert cpu.of("trainer").options() == {"num_cpus": 1.0, "num_gpus": 0.0}
    cuda = TrainerConfig(launcher="ray", device="cuda", ray_resources={"rollout": {"resources": {"big": 1}}})
    placed = placement_for(cuda)
    assert placed.of("trainer").num_gpus == 1.0 and placed.of("rollout").bundle() == {
        "CPU": 1.0,
        "big": 1.0,
        "GPU": 1.0,
    }
    with pytest.raises(Exception, match="allowed keys are num_cpus, num_gpus and resources"):
        RayPlacement.from_settings({"rollout": {"gpus": 1}}, gpus={})
    with pytest.raises(Exception, match="tiers are trainer, rollout, reward"):
        RayPlacement.from_settings({"critic": {}}, gpus={})
