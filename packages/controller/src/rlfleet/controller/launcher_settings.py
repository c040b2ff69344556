"""Which launcher starts a run's tiers, and where: the job's ``launcher`` settings (issue 13).

``launcher: embedded`` (the default) starts every tier as a local process; ``launcher: ray``
places them on a Ray cluster (:mod:`rlfleet.controller.ray_launcher`): ``ray_address`` empty
starts a local Ray for the run (``ray_num_cpus`` logical CPUs), ``auto`` joins the cluster of
this node, ``ray://host:10001`` a remote one. ``ray_resources`` reserves per tier what each of its
workers needs on its node: ``{rollout: {num_gpus: 1, resources: {rollout_node: 1}}}`` (unset:
one CPU each, and on CUDA one GPU per trainer rank and ``tensor_parallel_size`` per rollout
worker). ``ray_max_restarts``: Ray restarts a rollout worker's actor that died that many times (the
worker rejoins at the current weights). ``rollout_scale: {3: {default: 2}}`` grows or shrinks
rollout pools as the run goes on (before step 3, ``default`` gets 2 workers). Both launchers start
the run's nats-server themselves, so either needs ``nats_url`` unset; a run that joins a fleet by
``nats_url`` starts nothing.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlfleet.common.schema.config import ConfigModel


class LauncherSettings(ConfigModel):
    """The job's launcher: embedded local processes, or Ray-placed ones."""

    launcher: Literal["embedded", "ray"] = Field(
        default="embedded", description="who starts the tiers when nats_url is unset: embedded (local "
        "processes) or ray (placed on a Ray cluster)",
    )  # fmt: skip
    ray_address: str = Field(
        default="", description="launcher=ray: empty = a local Ray for this run, 'auto' = this node's "
        "cluster, 'ray://host:port' = a remote one",
    )  # fmt: skip
    ray_num_cpus: int | None = Field(
        default=None, ge=1, description="launcher=ray, local Ray: its logical CPUs (None: this machine's)"
    )
    ray_resources: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="launcher=ray: per tier {num_cpus, num_gpus, resources} each worker reserves",
    )

    ray_max_restarts: int = Field(
        default=3, ge=0, description="launcher=ray: times Ray restarts a rollout worker's actor that died "
        "(its worker starts again and rejoins at the current weights); past it, faults.restart_budget",
    )  # fmt: skip

    rollout_scale: dict[int, dict[str, int]] = Field(
        default_factory=dict,
        description="rollout pool sizes from a step on: {step: {pool: workers}} (pool 'default' without "
        "rollout_pools); before that step the run scales each pool to its size (trainer.scale_rollout); "
        "num_rollout_workers / rollout_pools set the size it starts with",
    )

    gpus: list[int | str] | int | None = Field(
        default=None, description="embedded launcher: the GPU ids (as CUDA_VISIBLE_DEVICES names them) or "
        "count its workers are placed on, disjoint per role (controller/gpu_assignment.py); None: "
        "CUDA_VISIBLE_DEVICES, else every GPU torch sees; [] or 0: hide GPUs from every worker",
    )  # fmt: skip

    @model_validator(mode="after")
    def _gpus_need_embedded(self) -> LauncherSettings:
        if self.launcher == "ray" and self.gpus is not None:
            raise ValueError("gpus: only used with launcher=embedded (Ray places GPUs: ray_resources)")
        return self

    @model_validator(mode="after")
    def _ray_fields_need_ray(self) -> LauncherSettings:
        if self.launcher != "ray":  # set to a non-default value (a dumped config repeats the defaults)
            fields = type(self).model_fields
            given = [n for n in ("ray_address", "ray_num_cpus", "ray_resources", "ray_max_restarts")
                     if getattr(self, n) != fields[n].get_default(call_default_factory=True)]  # fmt: skip
            if given:
                raise ValueError(f"{', '.join(given)}: only used with launcher=ray (here: {self.launcher})")
        for step, sizes in self.rollout_scale.items():
            if step < 1 or any(n < 0 for n in sizes.values()):
                raise ValueError(f"rollout_scale {step}: {sizes}: steps count from 1 and sizes from 0")
        return self


def build_launcher(config: Any, run_dir: Any) -> Any:
    """The fleet that starts ``config``'s tiers under ``run_dir``: an ``EmbeddedFleet`` or a ``RayFleet``."""
    budget = config.faults.restart_budget
    if config.launcher == "ray":
        from rlfleet.controller.ray_launcher import RayFleet, placement_for

        return RayFleet(run_dir, address=config.ray_address, num_cpus=config.ray_num_cpus,
                        placement=placement_for(config), restart_budget=budget,
                        max_restarts=config.ray_max_restarts)  # fmt: skip
    from rlfleet.controller.gpu_assignment import assignment_for
    from rlfleet.controller.launcher import EmbeddedFleet

    return EmbeddedFleet(run_dir, restart_budget=budget, gpus=assignment_for(config))
