"""Typed configuration of a training run: :class:`TrainerConfig` and the CLI's :class:`JobConfig`.

``TrainerConfig`` is what a library user passes to ``GRPOTrainer(config=...)``. Every setting a
worker uses is declared once, in the schema of ``rlfleet.common`` (the trainer's model, update,
algorithm and batch settings, the fleet address and placement, the rollout engine settings), and
``TrainerConfig`` inherits those classes, so they stay flat top-level keys
(``TrainerConfig(learning_rate=1e-5, beta=0.1)``, ``kl_coef=0.1`` on the command line). Only the
controller's own settings (worker counts, lengths, outputs, reward tier, KL controller, pools) are
declared here. A job file for ``rlfleet train`` is a ``TrainerConfig`` plus what the library user
passes as arguments (model, reward, data, epochs), so every field is reachable as ``a.b=value``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    SecretStr,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.algorithms import ALGORITHMS
from rlfleet.common.schema.carriers import CarrierSetting
from rlfleet.common.schema.config import ConfigModel
from rlfleet.common.schema.connection import NatsConnection, Secret, mask_url
from rlfleet.common.schema.rollout import RolloutSettings
from rlfleet.common.schema.trainer import AlgorithmSettings, BatchSettings, ModelSettings, UpdateSettings
from rlfleet.common.schema.worker import FleetAddress, Placement, TensorPlaneSettings
from rlfleet.controller.eval_settings import EvalSettings
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.launcher_settings import LauncherSettings, worker_logins

POOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
RESERVED_ROUTES = ("any", "text")
"""Route names of :meth:`~rlfleet.controller.online.OnlineTrainer.set_rollout_fn` that no pool may
take: ``any`` (every pool serves) and ``text`` (the rollout fn wrote the response itself)."""


KLControlKind = Literal["fixed", "adaptive", "scheduled"]
KLSchedule = Literal["linear", "cosine"]


class KLControlFields(ConfigModel):
    """The KL coefficient controller's settings; it starts at ``kl_coef`` (a field of the step settings).

    The controllers themselves run the online step program (:mod:`rlfleet.controller.online`).
    """

    kl_ctrl: KLControlKind = Field(
        default="fixed", description="KL coefficient controller; it starts at kl_coef"
    )
    kl_target: float | None = Field(default=None, gt=0.0, description="adaptive: the KL to steer towards")
    kl_horizon: int = Field(
        default=10000, ge=1, description="adaptive: how fast it reacts, in samples (Ziegler et al.)"
    )
    kl_end_coef: float = Field(default=0.0, ge=0.0, description="scheduled: the final coefficient")
    kl_total_steps: int | None = Field(
        default=None, ge=1, description="scheduled: samples over which kl_coef moves to kl_end_coef"
    )
    kl_schedule: KLSchedule = Field(default="linear", description="scheduled: the curve")


def check_kl_fields(fields: KLControlFields, coef: float) -> None:
    """Raise ValueError, saying what to set, when the controller cannot start at ``coef`` with ``fields``."""
    if fields.kl_ctrl == "adaptive" and (fields.kl_target is None or coef <= 0.0):
        raise ValueError(
            "kl_ctrl 'adaptive' needs kl_target > 0 and kl_coef > 0 (a multiplicative controller started "
            "at 0 stays at 0); set kl_target and kl_coef"
        )
    if fields.kl_ctrl == "scheduled" and fields.kl_total_steps is None:
        raise ValueError("kl_ctrl 'scheduled' needs kl_total_steps (in samples); set kl_total_steps")


class RolloutConfig(RolloutSettings):
    """The rollout tier: its engine settings (sent to every rollout worker) and how the controller samples."""

    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling")
    top_k: int = Field(default=-1, description="top-k sampling; -1 disables")


class RolloutPoolConfig(ConfigModel):
    """One named rollout pool: its size, and the engine settings where it differs from ``rollout``.

    Written flat, as ``{workers: 2, engine: vllm, max_batch_size: 32}``: every key but ``workers``
    must be a :class:`~rlfleet.common.schema.rollout.RolloutSettings` field and goes to ``overrides``.
    """

    workers: int = Field(default=1, ge=1, description="rollout worker processes in this pool")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="rollout engine settings of this pool (any RolloutSettings field)"
    )

    @model_validator(mode="before")
    @classmethod
    def _gather_overrides(cls, data: Any) -> Any:
        if isinstance(data, dict) and "overrides" not in data:
            rest = {key: value for key, value in data.items() if key != "workers"}
            data = {"workers": data.get("workers", 1), "overrides": rest}
        return data

    @field_validator("overrides")
    @classmethod
    def _check_overrides(cls, overrides: dict[str, Any]) -> dict[str, Any]:
        known = RolloutSettings.model_fields
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise ValueError(
                f"unknown rollout setting(s) {unknown}; a pool takes workers and any of: {', '.join(known)}"
            )
        try:
            checked = RolloutSettings.model_validate(overrides)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"{where} = {first.get('input')!r}: {first['msg']}") from None
        return {name: getattr(checked, name) for name in overrides}

    @model_serializer(mode="wrap")
    def _flat(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        return {"workers": data["workers"], **data["overrides"]}

    def settings(self, base: RolloutSettings) -> RolloutSettings:
        """This pool's engine settings: ``base``'s (the run's ``rollout`` section) with its overrides."""
        shared = base.model_dump(include=set(RolloutSettings.model_fields))
        return RolloutSettings.model_validate({**shared, **self.overrides})


class TrainerConfig(
    FleetAddress, Placement, TensorPlaneSettings, ModelSettings, KLControlFields, UpdateSettings,
    BatchSettings, AlgorithmSettings, LauncherSettings, EvalSettings,
):  # fmt: skip
    """Hyperparameters and run settings shared by the GRPO/PPO/DPO trainers.

    Inherited, each declared once: the algorithm and its settings (``AlgorithmSettings``), batch
    sizes (``BatchSettings``), optimizer and loss settings (``UpdateSettings``), the KL
    controller (``KLControlFields``), how the trainer holds the model (``ModelSettings``), device
    and seed (``Placement``), the fleet to join (``FleetAddress``), where every TensorStore of the run
    listens and its TLS files (``TensorPlaneSettings``), who starts the tiers (``LauncherSettings``),
    the held-out evaluation (``EvalSettings``).
    The rest are the controller's own.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    num_rollout_workers: int = Field(default=1, ge=1, description="rollout worker processes")
    num_train_workers: int = Field(
        default=1, ge=1, description="trainer ranks (processes, one GPU each) sharing the model by FSDP2"
    )
    max_prompt_length: int = Field(default=512, ge=1, description="longest prompt in tokens")
    max_response_length: int = Field(default=128, ge=1, description="longest response in tokens")
    critic_model_name: str | None = Field(
        default=None, description="PPO critic backbone (like model); None: initialised from the actor"
    )
    chat_template: str | None = Field(
        default=None,
        description="chat template the controller renders prompts with, in place of the model's: a Jinja "
        "string or the path of a .jinja file; None: the model's own",
    )
    output_dir: str = Field(default="outputs/run", description="metrics, logs and checkpoints go here")
    log_every: int = Field(default=1, ge=1, description="steps between [PROGRESS] lines")
    save_every: int = Field(
        default=0, ge=0,
        description="steps between full checkpoints (output_dir/checkpoint-<step>); 0: final HF model only",
    )  # fmt: skip
    resume_from: str | None = Field(
        default=None,
        description="continue a run from a checkpoint-<step> directory, or 'auto': the latest one in "
        "output_dir (a fresh start when there is none)",
    )
    loggers: list[Literal["console", "jsonl", "tensorboard", "wandb"]] = Field(
        default_factory=lambda: ["console", "jsonl", "tensorboard"], description="metric sinks"
    )
    weight_bucket_mb: float = Field(default=64.0, gt=0.0, description="weight publish bucket size")
    weight_carrier: CarrierSetting = Field(
        default="auto",
        description="how published weights reach rollout workers: auto = CUDA IPC for a worker on the "
        "trainer's GPU (colocated), gRPC for the others; grpc = always the tensor plane; "
        "cuda_ipc = demand IPC",
    )
    reward_endpoint: str = Field(default="default", description="reward endpoint that scores rollouts")
    reward_url: str | None = Field(
        default=None,
        description="NATS URL of a shared reward server (rlfleet-reward serve); None: the run's own reward "
        "worker. The server fetches rollout texts from the rollout workers' stores: they must be reachable",
    )
    reward_cluster: str = Field(
        default="", description="cluster name of the shared reward server; empty: 'default' with reward_url"
    )
    reward_token: Secret = Field(
        default=SecretStr(""), description="tenant token for the reward server; empty: $RLFLEET_REWARD_TOKEN"
    )
    reward_nats_auth: NatsConnection = Field(
        default_factory=NatsConnection,
        description="NATS credentials and TLS for reward_url when it is not the run's own server "
        "(unset fields from RLFLEET_REWARD_NATS_*)",
    )
    python_path: list[str] = Field(
        default_factory=list,
        description="folders holding the run's own Python modules (a reward or rollout_fn "
        "'module:function'): on the import path of the controller and of every worker the run starts, "
        "after the working directory, which always is; rlfleet train adds the job file's folder",
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="rollout tier settings")
    rollout_pools: dict[str, RolloutPoolConfig] = Field(
        default_factory=dict,
        description="named rollout pools (e.g. {small: {workers: 1, engine: hf}, fleet: {workers: 2}}) that "
        "a rollout fn routes prompts to (set_rollout_fn); empty: one pool 'default' of num_rollout_workers",
    )
    startup_timeout_s: float = Field(default=180.0, gt=0, description="wait for workers to announce")
    request_timeout_s: float | None = Field(
        default=None, gt=0,
        description="one deadline for every tier request; None: each request's deadline is scaled to "
        "its work (prompts x tokens, samples, batch and model bytes; controller/request_policy.py, "
        "faults.deadline_scale)",
    )  # fmt: skip
    sample_table_size: int = Field(default=4, ge=0, description="prompts shown in the before/after table")
    faults: FaultSettings = Field(
        default_factory=FaultSettings, description="retries, restarts, the stall watchdog (issue 12)"
    )

    @model_validator(mode="after")
    def _check_worker_logins(self) -> TrainerConfig:
        try:
            worker_logins(self, self.nats_auth)  # again when the run starts, with RLFLEET_NATS_* read
        except ConfigError as exc:  # said as this model's other checks say it
            raise ValueError(f"{exc.path}: {exc.reason}") from None
        return self

    @model_validator(mode="after")
    def _check_lengths(self) -> TrainerConfig:
        answers = {"max_response_length": self.max_response_length}
        if self.eval_data is not None:  # held-out answers run to eval_max_tokens on the same pools
            answers["eval_max_tokens"] = self.eval_max_tokens
        for name, (_, settings) in self.pools().items():
            where = f"rollout_pools.{name}.max_cache_len" if self.rollout_pools else "rollout.max_cache_len"
            for field, tokens in answers.items():
                if self.max_prompt_length + tokens > settings.max_cache_len:
                    raise ValueError(
                        f"max_prompt_length ({self.max_prompt_length}) + {field} ({tokens}) exceeds {where} "
                        f"({settings.max_cache_len}); raise it or lower max_prompt_length or {field} "
                        "(longer requests are refused)"
                    )
        return self

    @model_validator(mode="after")
    def _check_pools(self) -> TrainerConfig:
        for name in self.rollout_pools:
            if not POOL_NAME.match(name):
                raise ValueError(f"rollout pool name {name!r}: use 1-64 letters, digits, '_' or '-'")
            if name in RESERVED_ROUTES:
                raise ValueError(
                    f"rollout pool name {name!r} is reserved (routes {RESERVED_ROUTES} are built in)"
                )
        total = sum(pool.workers for pool in self.rollout_pools.values())
        if total and "num_rollout_workers" in self.model_fields_set and self.num_rollout_workers != total:
            raise ValueError(
                f"num_rollout_workers ({self.num_rollout_workers}) differs from the workers of rollout_pools "
                f"({total}); set one of them"
            )
        return self

    @model_validator(mode="after")
    def _check_algorithm(self) -> TrainerConfig:
        if ALGORITHMS[self.algorithm].uses_groups and self.group_size < 2:
            raise ValueError(
                f"group_size must be greater than or equal to 2 for {self.algorithm} (its advantages compare "
                f"the samples of one prompt); got {self.group_size}"
            )
        check_kl_fields(self, self.kl_coef)
        return self

    def pools(self) -> dict[str, tuple[int, RolloutSettings]]:
        """Each rollout pool's worker count and engine settings, in config order (no pools:
        ``{'default': (num_rollout_workers, rollout's settings)}``)."""
        if not self.rollout_pools:
            base = self.rollout.model_dump(include=set(RolloutSettings.model_fields))
            return {"default": (self.num_rollout_workers, RolloutSettings.model_validate(base))}
        return {
            name: (pool.workers, pool.settings(self.rollout)) for name, pool in self.rollout_pools.items()
        }

    def pool_sizes(self) -> dict[str, int]:
        """Rollout workers per pool, in config order (no pools: ``{'default': num_rollout_workers}``)."""
        return {name: workers for name, (workers, _) in self.pools().items()}

    def publish_dtype(self) -> str:
        """The dtype weights are published in: the engines' when every pool runs one reduced dtype
        (they would cast to it on load anyway: half the bytes to move), else the trainer's own ("")."""
        dtypes = {settings.dtype for _, settings in self.pools().values()}
        only = dtypes.pop() if len(dtypes) == 1 else ""
        return only if only in ("bfloat16", "float16") else ""

    def masked_dump(self) -> dict[str, Any]:
        """The config as JSON data with every credential masked (passwords, tokens and the user info
        of NATS URLs): what a run writes to ``config.yaml`` and its metric sinks."""
        data = self.model_dump(mode="json")
        for key in ("nats_url", "reward_url"):
            if data.get(key):
                data[key] = mask_url(data[key])
        return data

    def model_settings(self) -> ModelSettings:
        """How the trainer must hold the model for this run (fixed for the run)."""
        return ModelSettings.model_validate(self.model_dump(include=set(ModelSettings.model_fields)))


class DataConfig(ConfigModel):
    """Where prompts come from (their length limit is the run's ``max_prompt_length``)."""

    path: str = Field(
        description="JSONL, CSV or Parquet file of prompts, or a Hugging Face datasets source "
        "'hf:NAME?split=...&subset=...' (a Hub dataset, a save_to_disk folder, a data file or folder; needs "
        "rlfleet-controller[datasets]; see rlfleet.controller.hf_datasets)"
    )
    prompt_key: str = Field(default="prompt", description="column holding the prompt (text or chat messages)")
    chosen_key: str = Field(default="chosen", description="DPO: column holding the preferred response")
    rejected_key: str = Field(default="rejected", description="DPO: column holding the dispreferred response")
    overlong: Literal["filter", "truncate", "error"] = Field(default="filter", description="overlong prompts")
    system_prompt: str | None = Field(default=None, description="system message for chat templates")
    num_workers: int = Field(default=1, ge=1, description="tokenizer threads")


class JobConfig(TrainerConfig):
    """A whole run for ``rlfleet train``: the trainer's settings plus model, reward and data."""

    model: str = Field(
        description="actor model: a local HF dir, a Hugging Face Hub id 'org/name' or 'org/name@revision' "
        "(local cache first; HF_HUB_OFFLINE respected), 'smollm2', or 'tiny:<name>'"
    )
    reward: str | dict[str, Any] | None = Field(
        default=None, description="reward spec for the reward tier (e.g. 'rm:path=/m'); dpo takes none"
    )
    data: DataConfig = Field(description="prompt dataset")
    num_epochs: int = Field(default=1, ge=1, description="passes over the dataset")
    max_steps: int | None = Field(default=None, ge=1, description="stop after this many steps")
    description: str = Field(default="", description="free text shown at start")
    rollout_fn: str | None = Field(
        default=None,
        description="'package.module:function' routing each prompt to a rollout pool or answering it "
        "(GRPOTrainer.set_rollout_fn); the module must be importable from where rlfleet runs",
    )

    @model_validator(mode="after")
    def _online_needs_reward(self) -> JobConfig:
        online = ALGORITHMS[self.algorithm].online
        if self.reward is None and online:
            raise ValueError(f"algorithm {self.algorithm} scores rollouts: set reward (a reward spec)")
        if self.rollout_fn and not online:
            raise ValueError(f"rollout_fn routes rollouts; algorithm {self.algorithm} generates none")
        return self

    def trainer_config(self) -> TrainerConfig:
        """The TrainerConfig part of this job."""
        fields = [name for name in TrainerConfig.model_fields if name in self.model_fields_set]
        return TrainerConfig(**{name: getattr(self, name) for name in fields})
