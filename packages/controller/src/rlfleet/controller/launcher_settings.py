"""Which launcher starts a run's tiers, and where: the job's ``launcher`` settings (issue 13).

``launcher: embedded`` (the default) starts every tier as a local process; ``launcher: ray``
places them on a Ray cluster (:mod:`rlfleet.controller.ray_launcher`): ``ray_address`` empty
starts a local Ray for the run (``ray_num_cpus`` logical CPUs; unset: the machine's, or what the
job reserves when that is more), ``auto`` joins the cluster of
this node, ``ray://host:10001`` a remote one. ``ray_resources`` reserves per tier what each of its
workers needs on its node: ``{rollout: {num_gpus: 1, resources: {rollout_node: 1}}}`` (unset:
one CPU each, and on CUDA one GPU per trainer rank and ``tensor_parallel_size`` per rollout
worker). ``ray_max_restarts``: Ray restarts a rollout worker's actor that died that many times (the
worker rejoins at the current weights). ``rollout_scale: {3: {default: 2}}`` grows or shrinks
rollout pools as the run goes on (before step 3, ``default`` gets 2 workers). These are settings
only: the run builds the launcher they name (:func:`rlfleet.controller.run.build_launcher`).

NATS: without ``nats_url`` either launcher starts the run's own nats-server, with a generated
login per role. With ``nats_url``, the embedded launcher starts nothing (the run joins a fleet
started elsewhere), while ``launcher: ray`` still places every tier but connects them all to that
server, its URL handed to every worker as given (it must be routable from every Ray node). The
controller logs in with ``nats_auth``; each worker with its tier's entry of ``nats_worker_auth``
(:func:`worker_logins`): ``{trainer: {user, password}, rollout: ..., reward: ...}``, any
``NatsConnection`` fields (``creds_file`` too), inline or in a YAML/TOML file named instead of the
mapping. A server the controller logs in to takes logins, so each tier the run starts needs one
(each role may use only its own subjects: ``rlfleet.common.control.nats_roles``); an open server
needs none. The logins reach the workers in their environment, never a file or a log.
"""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.algorithms import ALGORITHMS
from rlfleet.common.schema.config import ConfigModel, read_config_file
from rlfleet.common.schema.connection import NatsConnection, mask_url, server_urls

TLS_FIELDS = ("tls", "tls_ca_file", "tls_cert_file", "tls_key_file")
"""The fields of ``nats_auth`` a worker's login takes over where it leaves them unset."""


class LauncherSettings(ConfigModel):
    """The job's launcher: embedded local processes, or Ray-placed ones."""

    launcher: Literal["embedded", "ray"] = Field(
        default="embedded", description="who starts the tiers: embedded (local processes; none when "
        "nats_url is set) or ray (placed on a Ray cluster, on nats_url's server when set)",
    )  # fmt: skip
    ray_address: str = Field(
        default="", description="launcher=ray: empty = a local Ray for this run, 'auto' = this node's "
        "cluster, 'ray://host:port' = a remote one",
    )  # fmt: skip
    ray_num_cpus: int | None = Field(
        default=None, ge=1, description="launcher=ray, local Ray: its logical CPUs (None: this machine's, or "
        "as many as the job's workers reserve when that is more); a job that reserves more is refused",
    )  # fmt: skip
    ray_resources: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="launcher=ray: per tier {num_cpus, num_gpus, resources} each worker reserves",
    )

    ray_max_restarts: int = Field(
        default=3, ge=0, description="launcher=ray: times Ray restarts a rollout worker's actor that died "
        "(its worker starts again and rejoins at the current weights); past it, faults.restart_budget",
    )  # fmt: skip

    nats_worker_auth: dict[Literal["trainer", "rollout", "reward"], NatsConnection] = Field(
        default_factory=dict,
        description="launcher=ray with nats_url: each worker tier's login on that server ({trainer: {user, "
        "password}, rollout: {...}, reward: {...}}, or the path of a YAML/TOML file holding it); TLS "
        "fields a login leaves unset come from nats_auth; needed for every tier the run starts when "
        "the controller logs in (nats_auth), none for an open server",
    )

    @field_validator("nats_worker_auth", mode="before")
    @classmethod
    def _logins_from_file(cls, value: Any) -> Any:
        return read_config_file(value) if isinstance(value, str) else value

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


def worker_logins(config: Any, controller: NatsConnection) -> dict[str, NatsConnection]:
    """Each worker tier's login on the outside server of a ``launcher: ray`` run (``nats_url``): its
    ``nats_worker_auth`` entry, with the TLS fields it leaves unset taken from ``controller`` (the
    controller's own connection). Raises :class:`ConfigError` for logins without launcher=ray and
    nats_url, for a URL carrying a login (every worker gets the URL) and, when ``controller`` logs
    in (so the server takes logins), for each tier the run starts without one."""
    logins: dict[str, NatsConnection] = dict(config.nats_worker_auth)
    if config.launcher != "ray" or config.nats_url is None:
        if logins:
            raise ConfigError("nats_worker_auth", sorted(logins), "only used with launcher=ray and nats_url "
                              "(the workers' logins on that server)")  # fmt: skip
        return {}
    if any("@" in urlsplit(url).netloc for url in server_urls(config.nats_url)):
        raise ConfigError("nats_url", mask_url(config.nats_url), "launcher=ray hands this URL to every "
                          "worker: give the controller's login in nats_auth and the workers' in "
                          "nats_worker_auth, not in the URL")  # fmt: skip
    tiers = ["trainer", "rollout", "reward"] if ALGORITHMS[config.algorithm].online else ["trainer"]
    tiers = [tier for tier in tiers if tier != "reward" or not config.reward_url]  # or a shared server
    missing = [tier for tier in tiers if tier not in logins or not logins[tier].has_credentials]
    if controller.has_credentials and missing:
        raise ConfigError("nats_worker_auth", sorted(logins), f"the server at nats_url takes logins (the "
                          f"controller has one) but none is given for {', '.join(missing)}: set "
                          "nats_worker_auth.<tier> (user and password, or creds_file...) for each tier the "
                          "run starts, a user with that role's permissions")  # fmt: skip
    tls = {name: getattr(controller, name) for name in TLS_FIELDS if getattr(controller, name)}
    given = {tier: login.model_dump(exclude_defaults=True) for tier, login in logins.items()}
    return {tier: NatsConnection.model_validate({**tls, **given.get(tier, {})}) for tier in tiers}
