"""Which launcher starts a run's tiers, and where: the job's ``launcher`` section (issue 13), a tagged union.

``launcher: {type: embedded}`` (the default; ``launcher: embedded`` for short) starts every tier as a
local process, on ``gpus``. ``launcher: {type: ray, ...}`` places them on a Ray cluster
(:mod:`rlfleet.controller.ray_launcher`): ``address`` empty starts a local Ray for the run
(``num_cpus`` logical CPUs; unset: the machine's, or what the job reserves when that is more),
``auto`` joins the cluster of this node, ``ray://host:10001`` a remote one. ``resources`` reserves
per tier what each of its workers needs on its node: ``{rollout: {num_gpus: 1, resources:
{rollout_node: 1}}}`` (unset: one CPU each, and on CUDA one GPU per trainer rank and
``tensor_parallel_size`` per rollout worker). ``max_restarts``: Ray restarts a rollout worker's
actor that died that many times (the worker rejoins at the current weights). These are settings
only: the run builds the launcher they name (:func:`rlfleet.controller.run.build_launcher`). The
previous release's flat keys (``launcher: ray`` beside ``ray_address``, ``ray_num_cpus``,
``ray_resources``, ``ray_max_restarts``, ``nats_worker_auth``, ``gpus``) load with a warning.

NATS: without ``nats_url`` either launcher starts the run's own nats-server, with a generated
login per role. With ``nats_url``, the embedded launcher starts nothing (the run joins a fleet
started elsewhere), while the Ray launcher still places every tier but connects them all to that
server, its URL handed to every worker as given (it must be routable from every Ray node). The
controller logs in with ``fleet.nats_auth``; each worker with its tier's entry of the Ray
launcher's ``worker_auth`` (:func:`worker_logins`): ``{trainer: {user, password}, rollout: ...,
reward: ...}``, any ``NatsConnection`` fields (``creds_file`` too), inline or in a YAML/TOML file
named instead of the mapping. A server the controller logs in to takes logins, so each tier the
run starts needs one (each role may use only its own subjects: ``rlfleet.common.control.nats_roles``);
an open server needs none. The logins reach the workers in their environment, never a file or a log.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.algorithms import ALGORITHMS
from rlfleet.common.schema.config import ConfigModel, read_config_file
from rlfleet.common.schema.connection import NatsConnection, mask_url, server_urls

TLS_FIELDS = ("tls", "tls_ca_file", "tls_cert_file", "tls_key_file")
"""The fields of ``fleet.nats_auth`` a worker's login takes over where it leaves them unset."""
Tier = Literal["trainer", "rollout", "reward"]


class EmbeddedLauncher(ConfigModel):
    """Every tier a local process (none when ``nats_url`` is set: the run joins that fleet)."""

    SHORT_FORM: ClassVar[str | None] = "type"

    type: Literal["embedded"] = Field(description="embedded")
    gpus: list[int | str] | int | None = Field(
        default=None, description="the GPU ids (as CUDA_VISIBLE_DEVICES names them) or count its workers are "
        "placed on, disjoint per role (controller/gpu_assignment.py); None: CUDA_VISIBLE_DEVICES, else every "
        "GPU torch sees; [] or 0: hide GPUs from every worker",
    )  # fmt: skip


class RayLauncher(ConfigModel):
    """Every tier placed on a Ray cluster (on ``nats_url``'s server when set)."""

    SHORT_FORM: ClassVar[str | None] = "type"

    type: Literal["ray"] = Field(description="ray")
    address: str = Field(
        default="", description="empty = a local Ray for this run, 'auto' = this node's cluster, "
        "'ray://host:port' = a remote one",
    )  # fmt: skip
    num_cpus: int | None = Field(
        default=None, ge=1, description="a local Ray's logical CPUs (None: this machine's, or as many as the "
        "job's workers reserve when that is more); a job that reserves more is refused",
    )  # fmt: skip
    resources: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per tier {num_cpus, num_gpus, resources} each worker reserves"
    )
    max_restarts: int = Field(
        default=3, ge=0, description="times Ray restarts a rollout worker's actor that died (its worker "
        "starts again and rejoins at the current weights); past it, faults.restart_budget",
    )  # fmt: skip
    worker_auth: dict[Tier, NatsConnection] = Field(
        default_factory=dict,
        description="with nats_url: each worker tier's login on that server ({trainer: {user, password}, "
        "rollout: {...}, reward: {...}}, or the path of a YAML/TOML file holding it); TLS fields a login "
        "leaves unset come from fleet.nats_auth; needed for every tier the run starts when the controller "
        "logs in, none for an open server",
    )

    @field_validator("worker_auth", mode="before")
    @classmethod
    def _logins_from_file(cls, value: Any) -> Any:
        return read_config_file(value) if isinstance(value, str) else value


LauncherSettings = Annotated[EmbeddedLauncher | RayLauncher, Field(discriminator="type")]
"""The job's ``launcher`` section."""


def worker_logins(config: Any, controller: NatsConnection) -> dict[str, NatsConnection]:
    """Each worker tier's login on the outside server of a Ray-launched run with ``nats_url``: its
    ``launcher.worker_auth`` entry, with the TLS fields it leaves unset taken from ``controller`` (the
    controller's own connection). Raises :class:`ConfigError` for a URL carrying a login (every
    worker gets the URL) and, when ``controller`` logs in (so the server takes logins), for each tier
    the run starts without one."""
    launcher, nats_url = config.launcher, config.fleet.nats_url
    ray = isinstance(launcher, RayLauncher)
    logins: dict[str, NatsConnection] = dict(launcher.worker_auth) if ray else {}
    if not ray or nats_url is None:
        if logins:
            raise ConfigError("launcher.worker_auth", sorted(logins), "only used with nats_url (the "
                              "workers' logins on that server)")  # fmt: skip
        return {}
    if any("@" in urlsplit(url).netloc for url in server_urls(nats_url)):
        raise ConfigError("fleet.nats_url", mask_url(nats_url), "the Ray launcher hands this URL to every "
                          "worker: give the controller's login in fleet.nats_auth and the workers' in "
                          "launcher.worker_auth, not in the URL")  # fmt: skip
    tiers = ["trainer", "rollout", "reward"] if ALGORITHMS[config.algorithm.name].online else ["trainer"]
    tiers = [tier for tier in tiers if tier != "reward" or not config.reward.url]  # or a shared server
    missing = [tier for tier in tiers if tier not in logins or not logins[tier].has_credentials]
    if controller.has_credentials and missing:
        raise ConfigError("launcher.worker_auth", sorted(logins), f"the server at nats_url takes logins (the "
                          f"controller has one) but none is given for {', '.join(missing)}: set "
                          "launcher.worker_auth.<tier> (user and password, or creds_file...) for each tier "
                          "the run starts, a user with that role's permissions")  # fmt: skip
    tls = {name: getattr(controller, name) for name in TLS_FIELDS if getattr(controller, name)}
    given = {tier: login.model_dump(exclude_defaults=True) for tier, login in logins.items()}
    return {tier: NatsConnection.model_validate({**tls, **given.get(tier, {})}) for tier in tiers}
