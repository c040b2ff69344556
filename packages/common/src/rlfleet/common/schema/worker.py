"""Settings every worker process takes (and the controller's own fleet address).

:class:`FleetAddress` says which fleet to join: the controller's config and every worker's share
it. :class:`Placement` says where a process computes and how its randomness is seeded: the job's
``device`` and ``seed`` reach each worker the launcher starts. :class:`ServiceConfig` is the base of
every tier's worker config (those three sections and its own settings); :class:`ModelWorkerConfig`
adds the model a trainer or rollout worker holds.
:class:`TensorPlaneSettings` says where a worker's TensorStore listens, the address it advertises
in its refs, and the TLS files of the tensor plane. :class:`ModelLoading` says how every tier loads
Hugging Face models (the trainer's model settings and every worker's config include it).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from rlfleet.common.schema.config import ConfigModel
from rlfleet.common.schema.connection import NatsConnection, mask_url

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
Device = Literal["auto", "cpu", "cuda"]


class FleetAddress(ConfigModel):
    """Which fleet: the NATS server and the cluster name (the second token of every subject)."""

    nats_url: str | None = Field(
        default=None,
        description="NATS server of the fleet; None: the controller starts an embedded one "
        f"(a worker started alone then joins {DEFAULT_NATS_URL})",
    )
    cluster: str = Field(
        default="", description="cluster name; empty: a fresh run-<id> (controller), 'default' (worker)"
    )
    nats_auth: NatsConnection = Field(
        default_factory=NatsConnection,
        description="NATS credentials and TLS (unset fields: RLFLEET_NATS_*; an embedded run makes its own)",
    )

    def __repr_args__(self) -> Any:
        """``repr()`` (and so tracebacks and log lines that show a config) hides the user info of
        every NATS URL (``reward_url`` too, where a subclass has one); secrets are SecretStr already."""
        for name, value in super().__repr_args__():
            yield name, mask_url(value) if name.endswith("_url") and isinstance(value, str) else value


class Placement(ConfigModel):
    """Where a process computes and how its randomness is seeded."""

    device: Device = Field(default="auto", description="cpu, cuda, or auto (CUDA when available)")
    seed: int = Field(default=42, description="seed for data order, sampling, init and shuffling")


class TensorPlaneSettings(ConfigModel):
    """Where a worker's TensorStore listens and what it advertises; TLS on the tensor plane."""

    bind_host: str = Field(
        default="127.0.0.1", description="interface the worker's TensorStore listens on (0.0.0.0: all)"
    )
    advertise_host: str = Field(
        default="",
        description="host name or IP other tiers reach the store by, put in every ref it hands out; "
        "empty: bind_host (this machine's hostname when bind_host is a wildcard)",
    )
    tensor_tls_cert: str = Field(default="", description="PEM certificate the TensorStore serves TLS with")
    tensor_tls_key: str = Field(default="", description="PEM private key of tensor_tls_cert")
    tensor_tls_ca: str = Field(
        default="", description="PEM CA this worker trusts for other tiers' TensorStores; empty: plain TCP"
    )
    tensor_tls_client_ca: str = Field(
        default="",
        description="PEM CA that must sign the certificate of every client of this worker's TensorStore "
        "(mutual TLS; clients present tensor_tls_cert); empty: clients need none",
    )


class ModelLoading(ConfigModel):
    """How a tier loads Hugging Face models: what ``from_pretrained`` may run."""

    trust_remote_code: bool = Field(
        default=False,
        description="let transformers (and vLLM) run the Python modeling/tokenizer code a model folder "
        "ships (config.json auto_map); only for models you trust. Reaches every tier's loaders",
    )


class ServiceConfig(ConfigModel):
    """Settings every worker process takes, in sections (``fleet``, ``placement``, ``tensor_plane``)
    plus its own; an unset NATS URL or cluster is the default one. The flat form of the previous
    release (``nats_url``, ``device``, ``bind_host`` at the top) loads too: a previous controller
    writes it, and a controller writes it for workers of the previous release."""

    FLAT_SECTIONS: ClassVar[frozenset[str]] = frozenset({"fleet", "placement", "tensor_plane"})

    fleet: FleetAddress = Field(
        default_factory=FleetAddress, validate_default=True, description="the fleet this worker joins"
    )
    placement: Placement = Field(default_factory=Placement, description="where it computes; its seed")
    tensor_plane: TensorPlaneSettings = Field(
        default_factory=TensorPlaneSettings, description="its TensorStore's address and TLS"
    )

    @field_validator("fleet")
    @classmethod
    def _defaults(cls, fleet: FleetAddress) -> FleetAddress:
        """A worker started alone joins the default server and cluster (a copy: the caller's stays)."""
        defaults = {"nats_url": fleet.nats_url or DEFAULT_NATS_URL, "cluster": fleet.cluster or "default"}
        return fleet.model_copy(update=defaults)

    worker_id: str = Field(default="", description="unique worker id; empty: <tier>-<host>-<pid>")
    pool: str = Field(default="default", description="pool this worker serves (rollout routing)")
    heartbeat_s: float = Field(default=2.0, gt=0, description="seconds between heartbeats")
    drain_s: float = Field(
        default=30.0, ge=0, le=3600,
        description="on SIGTERM or Shutdown, seconds the requests in progress get to finish before the "
        "worker leaves (new ones are refused as retryable from the start)",
    )  # fmt: skip
    log_level: str = Field(default="INFO", description="logging level")
    log_json: bool = Field(default=False, description="log one JSON object per line")
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="serve Prometheus /metrics and /healthz over HTTP on this port (0: any free one); "
        "None: no metrics server",
    )  # fmt: skip
    metrics_host: str = Field(
        default="", description="interface of the metrics server; empty: tensor_plane.bind_host"
    )


class ModelWorkerConfig(ServiceConfig):
    """A worker that holds a model (trainer, rollout)."""

    model_path: str = Field(description="local HF model directory")
