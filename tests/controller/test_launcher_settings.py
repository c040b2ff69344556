"""The job's launcher section, a tagged union: Ray's settings only with ``type: ray``, and Ray's
placements (an outside NATS for a Ray run: test_nats_worker_auth.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlfleet.controller import TrainerConfig
from rlfleet.controller.launcher_settings import EmbeddedLauncher, RayLauncher
from rlfleet.controller.ray_launcher import RayPlacement, placement_for

pytestmark = pytest.mark.timeout(30)


def test_ray_settings_need_launcher_ray_but_a_dumped_config_loads_again() -> None:
    with pytest.raises(ValidationError, match="launcher.address: only used with launcher=ray"):
        TrainerConfig(launcher={"address": "auto"})
    with pytest.raises(ValidationError, match="launcher.address: only used with launcher=ray"):
        TrainerConfig(launcher={"type": "embedded", "address": "auto"})
    with (
        pytest.warns(FutureWarning, match="ray_address -> launcher.address"),
        pytest.raises(ValidationError, match="launcher.address: only used with launcher=ray"),
    ):
        TrainerConfig(ray_address="auto")  # the previous release's flat key, without launcher: ray
    config = TrainerConfig()
    again = TrainerConfig.model_validate(config.model_dump())  # defaults repeated
    assert again.launcher == EmbeddedLauncher(type="embedded") and again == config
    ray = TrainerConfig(launcher={"type": "ray", "num_cpus": 2, "resources": {"rollout": {"num_gpus": 1}}})
    assert TrainerConfig.model_validate(ray.model_dump()) == ray
    assert isinstance(ray.launcher, RayLauncher) and ray.launcher.num_cpus == 2


def test_placement_defaults_and_overrides() -> None:
    cpu = placement_for(TrainerConfig(launcher="ray", device="cpu"))
    assert cpu.of("trainer").options() == {"num_cpus": 1.0, "num_gpus": 0.0}
    launcher = {"type": "ray", "resources": {"rollout": {"resources": {"big": 1}}}}
    cuda = TrainerConfig(launcher=launcher, device="cuda")
    placed = placement_for(cuda)
    assert placed.of("trainer").num_gpus == 1.0 and placed.of("rollout").bundle() == {
        "CPU": 1.0,
        "big": 1.0,
        "GPU": 1.0,
    }
    engine = {"type": "vllm", "tensor_parallel_size": 2}
    sharded = placement_for(TrainerConfig(launcher="ray", device="cuda", rollout={"engine": engine}))
    assert (sharded.of("trainer").num_gpus, sharded.of("rollout").num_gpus) == (1.0, 2.0)
    colocated = {"type": "vllm", "tensor_parallel_size": 2, "colocate": True}
    shared = placement_for(TrainerConfig(launcher="ray", device="cuda", rollout={"engine": colocated}))
    assert (shared.of("trainer").num_gpus, shared.of("rollout").num_gpus) == (0.5, 0.5)
    with pytest.raises(Exception, match="allowed keys are num_cpus, num_gpus and resources"):
        RayPlacement.from_settings({"rollout": {"gpus": 1}}, gpus={})
    with pytest.raises(Exception, match="tiers are trainer, rollout, reward"):
        RayPlacement.from_settings({"critic": {}}, gpus={})
