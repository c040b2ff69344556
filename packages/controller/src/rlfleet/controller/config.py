"""Typed configuration of a training run: :class:`TrainerConfig` and the CLI's :class:`JobConfig`.

``TrainerConfig`` is what a library user passes to ``GRPOTrainer(config=...)``. It nests by owner:
each tier's settings are a section holding the schema class of ``rlfleet.common`` as it is
(``model``: how the trainer holds the model; ``algorithm``, ``update``, ``batch``: what each step
sends; ``rollout``: the rollout tier's engine, sampling and pools; ``placement``, ``fleet``,
``tensor_plane``), and the controller's own concerns are sections of their own (``kl``, ``reward``,
``eval``, ``faults``, ``launcher``) beside a few run-wide settings at the top (``output_dir``,
lengths, logging, checkpoints). Where a concept has variants a ``type`` tag picks one
(``rollout.engine``, ``launcher``, ``kl``); a plain string is the tag (``launcher: ray``).

The common case stays short: ``learning_rate``, ``kl_coef``, the batch sizes, ``device``, ``seed``
and ``nats_url`` may be written at the top (``learning_rate=1e-5`` on the command line, or
``TrainerConfig(learning_rate=1e-5)``), documented short forms of ``update.learning_rate`` and
the rest. The previous release's flat form (every setting at the top: ``eval_data``,
``mixed_precision``, ``ray_address``, ``kl_ctrl``...) loads for one release, with a
``FutureWarning`` naming each key's new place (:mod:`rlfleet.common.schema.config`).

A job file for ``rlfleet train`` is a ``TrainerConfig`` plus what the library user passes as
arguments (``model`` with its ``name``, ``reward`` with its ``spec``, ``data``, epochs), so every
setting is reachable as ``a.b=value``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

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
from rlfleet.common.schema.config import ConfigModel, Legacy, merge
from rlfleet.common.schema.connection import NatsConnection, Secret, mask_url
from rlfleet.common.schema.rollout import RolloutSettings
from rlfleet.common.schema.trainer import AlgorithmSettings, BatchSettings, ModelSettings, UpdateSettings
from rlfleet.common.schema.worker import FleetAddress, Placement, TensorPlaneSettings
from rlfleet.controller.agent_settings import AgentSettings
from rlfleet.controller.config_names import check_in_effect, check_known, given_algorithm
from rlfleet.controller.dynamic_sampling_settings import DynamicSamplingSettings
from rlfleet.controller.environment_settings import EnvironmentSettings
from rlfleet.controller.eval_settings import EvalSettings
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.launcher_settings import (
    EmbeddedLauncher,
    LauncherSettings,
    RayLauncher,
    worker_logins,
)
from rlfleet.controller.lr_schedule import LRSchedule
from rlfleet.controller.saved_config import drop_records
from rlfleet.controller.weight_sync_settings import WeightSyncSettings

POOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
RESERVED_ROUTES = ("any", "text")
"""Route names of :meth:`~rlfleet.controller.online.OnlineTrainer.set_rollout_fn` that no pool may
take: ``any`` (every pool serves) and ``text`` (the rollout fn wrote the response itself)."""


KLSchedule = Literal["linear", "cosine"]


class FixedKL(ConfigModel):
    """``kl: {type: fixed}``: the coefficient stays at ``kl_coef``."""

    SHORT_FORM: ClassVar[str | None] = "type"

    type: Literal["fixed"] = Field(description="fixed")


class AdaptiveKL(ConfigModel):
    """``kl: {type: adaptive, target, horizon}``: steer the measured KL towards ``target`` (Ziegler
    et al.); it starts at ``kl_coef``, which must be above 0 (a multiplicative controller started at 0
    stays at 0)."""

    SHORT_FORM: ClassVar[str | None] = "type"

    type: Literal["adaptive"] = Field(description="adaptive")
    target: float = Field(gt=0.0, description="the KL to steer towards")
    horizon: int = Field(default=10000, ge=1, description="how fast it reacts, in samples")


class ScheduledKL(ConfigModel):
    """``kl: {type: scheduled, end_coef, total_steps, schedule}``: from ``kl_coef`` to ``end_coef``."""

    SHORT_FORM: ClassVar[str | None] = "type"

    type: Literal["scheduled"] = Field(description="scheduled")
    end_coef: float = Field(default=0.0, ge=0.0, description="the final coefficient")
    total_steps: int = Field(ge=1, description="samples over which kl_coef moves to end_coef")
    schedule: KLSchedule = Field(default="linear", description="the curve")


KLControl = Annotated[FixedKL | AdaptiveKL | ScheduledKL, Field(discriminator="type")]
"""The KL coefficient's controller (the run's ``kl`` section); it starts at ``update.kl_coef``."""
KLControlKind = Literal["fixed", "adaptive", "scheduled"]


def check_kl_start(kl: FixedKL | AdaptiveKL | ScheduledKL, coef: float) -> None:
    """Raise ValueError, saying what to set, when the controller cannot start at ``coef``."""
    if isinstance(kl, AdaptiveKL) and coef <= 0.0:
        raise ValueError(
            "kl type 'adaptive' needs kl_coef > 0 (a multiplicative controller started at 0 stays at 0); "
            "set kl_coef"
        )


class RolloutPoolConfig(ConfigModel):
    """One named rollout pool: its size, and the engine settings where it differs from ``rollout``.

    Written as ``{workers: 2, engine: vllm, max_batch_size: 32}``: every key but ``workers`` is a
    :class:`~rlfleet.common.schema.rollout.RolloutSettings` setting (its flat form too) and goes to
    ``overrides``, laid over the ``rollout`` section's.
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
        nested = RolloutSettings.tidy(_nest_rollout(overrides))
        known = RolloutSettings.model_fields
        unknown = sorted(set(nested) - set(known))
        if unknown:
            raise ValueError(
                f"unknown rollout setting(s) {unknown}; a pool takes workers and any of: {', '.join(known)}"
            )
        try:
            RolloutSettings.model_validate(nested)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise ValueError(f"{where} = {first.get('input')!r}: {first['msg']}") from None
        return nested

    @model_serializer(mode="wrap")
    def _flat(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        return {"workers": data["workers"], **data["overrides"]}

    def settings(self, base: RolloutSettings) -> RolloutSettings:
        """This pool's engine settings: ``base``'s (the run's ``rollout`` section) with its overrides (a
        pool naming another engine type takes that engine's defaults)."""
        shared = base.model_dump(include=set(RolloutSettings.model_fields))
        overrides = dict(self.overrides)
        engine = overrides.get("engine")
        if (
            isinstance(engine, dict)
            and engine.get("type", shared["engine"]["type"]) != shared["engine"]["type"]
        ):
            shared.pop("engine")
        return RolloutSettings.model_validate(merge(shared, overrides))


def _nest_rollout(data: dict[str, Any]) -> dict[str, Any]:
    """Rollout settings written flat (``engine: vllm`` beside ``colocate: true``) in their sections."""
    from rlfleet.common.schema.config import nest_legacy

    nested = nest_legacy(RolloutSettings, data)
    if isinstance(nested.get("engine"), str):
        nested["engine"] = {"type": nested["engine"]}
    return nested


class RolloutConfig(RolloutSettings):
    """The rollout tier: its engine settings (sent to every rollout worker as they are), how the
    controller samples, and its workers (one pool of ``workers``, or named ``pools``; ``scale``)."""

    WARN_LEGACY: ClassVar[bool] = True
    PLACE: ClassVar[str] = "rollout"

    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="nucleus sampling")
    top_k: int = Field(default=-1, description="top-k sampling; -1 disables")
    workers: int = Field(default=1, ge=1, description="rollout worker processes (one pool, 'default')")
    pools: dict[str, RolloutPoolConfig] = Field(
        default_factory=dict,
        description="named rollout pools (e.g. {small: {workers: 1, engine: hf}, fleet: {workers: 2}}) that "
        "a rollout fn routes prompts to (set_rollout_fn); empty: one pool 'default' of rollout.workers",
    )
    scale: dict[int, dict[str, int]] = Field(
        default_factory=dict,
        description="rollout pool sizes from a step on: {step: {pool: workers}} (pool 'default' without "
        "pools); before that step the run scales each pool to its size (trainer.scale_rollout); "
        "workers / pools set the size it starts with",
    )

    @classmethod
    def tidy(cls, data: dict[str, Any]) -> dict[str, Any]:
        """With ``pools`` and no ``workers``, ``workers`` is their total (so a dumped config, which
        writes both, loads back)."""
        data = super().tidy(data)
        pools = data.get("pools")
        if isinstance(pools, dict) and pools and "workers" not in data:
            sizes = [pool.get("workers", 1) if isinstance(pool, dict) else getattr(pool, "workers", 1)
                     for pool in pools.values()]  # fmt: skip
            if all(isinstance(n, int) for n in sizes):  # else the pools' own validation says what is wrong
                data = {**data, "workers": sum(sizes)}
        return data

    def settings(self) -> RolloutSettings:
        """The engine settings every rollout worker of the default pool gets (the section as it is)."""
        return RolloutSettings.model_validate(self.model_dump(include=set(RolloutSettings.model_fields)))

    @model_validator(mode="after")
    def _check_pools_and_scale(self) -> RolloutConfig:
        for name in self.pools:
            if not POOL_NAME.match(name):
                raise ValueError(f"rollout pool name {name!r}: use 1-64 letters, digits, '_' or '-'")
            if name in RESERVED_ROUTES:
                raise ValueError(
                    f"rollout pool name {name!r} is reserved (routes {RESERVED_ROUTES} are built in)"
                )
        total = sum(pool.workers for pool in self.pools.values())
        if total and "workers" in self.model_fields_set and self.workers != total:
            raise ValueError(
                f"rollout.workers ({self.workers}) differs from the workers of rollout.pools ({total}); "
                "set one of them"
            )
        for step, sizes in self.scale.items():
            if step < 1 or any(n < 0 for n in sizes.values()):
                raise ValueError(f"rollout.scale {step}: {sizes}: steps count from 1 and sizes from 0")
        return self


class RewardSettings(ConfigModel):
    """The run's reward tier: its own reward worker's endpoint, or a shared reward server."""

    endpoint: str = Field(default="default", description="reward endpoint that scores rollouts")
    weights: list[float] | None = Field(
        default=None, min_length=1,
        description="with a list of rewards (TRL's reward_weights): the weight of each, the total their "
        "weighted sum; None: 1 each",
    )  # fmt: skip
    url: str | None = Field(
        default=None,
        description="NATS URL of a shared reward server (rlfleet-reward serve); None: the run's own reward "
        "worker. The server fetches rollout texts from the rollout workers' stores: they must be reachable",
    )
    cluster: str = Field(default="", description="cluster name of the shared reward server; empty: 'default'")
    token: Secret = Field(
        default=SecretStr(""), description="tenant token for the reward server; empty: $RLFLEET_REWARD_TOKEN"
    )
    nats_auth: NatsConnection = Field(
        default_factory=NatsConnection,
        description="NATS credentials and TLS for reward.url when it is not the run's own server "
        "(unset fields from RLFLEET_REWARD_NATS_*)",
    )

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():
            yield name, mask_url(value) if name == "url" and isinstance(value, str) else value


class TrainerConfig(ConfigModel):
    """Hyperparameters and run settings shared by the GRPO/PPO/DPO trainers, in sections by owner.

    The sections hold the tiers' own settings classes (``model``, ``algorithm``, ``update``,
    ``batch``, ``rollout``, ``placement``, ``fleet``, ``tensor_plane``) and the controller's (``kl``,
    ``reward``, ``eval``, ``faults``, ``launcher``); the top holds what belongs to the run as a whole.
    ``learning_rate``, ``kl_coef``, the batch sizes, ``device``, ``seed`` and ``nats_url`` are short
    forms at the top; the previous release's flat keys load with a warning (module docstring).
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    FLAT_SECTIONS: ClassVar[frozenset[str]] = frozenset({
        "placement", "fleet", "tensor_plane", "model", "algorithm", "update", "batch", "kl", "reward",
        "eval", "launcher",
    })  # fmt: skip
    RENAMED: ClassVar[tuple[Legacy, ...]] = (
        Legacy("algorithm", ("algorithm", "name")), Legacy("launcher", ("launcher", "type")),
        Legacy("kl_ctrl", ("kl", "type")), Legacy("kl_target", ("kl", "target")),
        Legacy("kl_horizon", ("kl", "horizon")), Legacy("kl_end_coef", ("kl", "end_coef")),
        Legacy("kl_total_steps", ("kl", "total_steps")), Legacy("kl_schedule", ("kl", "schedule")),
        Legacy("reward_endpoint", ("reward", "endpoint")), Legacy("reward_url", ("reward", "url")),
        Legacy("reward_cluster", ("reward", "cluster")), Legacy("reward_token", ("reward", "token")),
        Legacy("reward_nats_auth", ("reward", "nats_auth")),
        Legacy("eval_data", ("eval", "data")), Legacy("eval_every", ("eval", "every")),
        Legacy("eval_limit_words", ("eval", "limit_words")),
        Legacy("eval_max_tokens", ("eval", "max_tokens")),
        Legacy("ray_address", ("launcher", "address")), Legacy("ray_num_cpus", ("launcher", "num_cpus")),
        Legacy("ray_resources", ("launcher", "resources")),
        Legacy("ray_max_restarts", ("launcher", "max_restarts")),
        Legacy("nats_worker_auth", ("launcher", "worker_auth")),
        Legacy("num_rollout_workers", ("rollout", "workers")), Legacy("rollout_pools", ("rollout", "pools")),
        Legacy("rollout_scale", ("rollout", "scale")),
    )  # fmt: skip
    SHORT: ClassVar[frozenset[str]] = frozenset(
        {*UpdateSettings.model_fields, *BatchSettings.model_fields, "device", "seed", "nats_url"}
    )
    WARN_LEGACY: ClassVar[bool] = True
    DEFAULT_TAGS: ClassVar[dict[str, str]] = {"launcher": "embedded", "kl": "fixed"}
    FINAL_ALGORITHM: ClassVar[str | None] = None
    """The algorithm when the input names none, for the check of settings it does not read; None: the
    trainer class decides (PPOTrainer, DPOTrainer), so only a named algorithm is checked."""

    # --- the run as a whole ----------------------------------------------------------------------
    num_train_workers: int = Field(
        default=1, ge=1, description="trainer ranks (processes, one GPU each) sharing the model by FSDP2"
    )
    max_prompt_length: int = Field(default=512, ge=1, description="longest prompt in tokens")
    max_response_length: int = Field(default=128, ge=1, description="longest response in tokens")
    max_staleness: int = Field(
        default=0, ge=0, le=16,
        description="rollout and training in parallel: the fleet generates up to this many batches ahead "
        "of the one the trainer trains, each from weights at most this many versions older than those it "
        "is trained at; 0: synchronous (generate, score, train, sync, in turn)",
    )  # fmt: skip
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
    sample_table_size: int = Field(default=4, ge=0, description="prompts shown in the before/after table")
    weight_bucket_mb: float = Field(default=64.0, gt=0.0, description="weight publish bucket size")
    weight_sync: WeightSyncSettings = Field(
        default_factory=WeightSyncSettings,
        description="delta sync of published weights ({delta, anchor_every}); every load is verified",
    )
    weight_carrier: CarrierSetting = Field(
        default="auto",
        description="how published weights reach rollout workers: auto = CUDA IPC for a worker on the "
        "trainer's GPU (colocated), gRPC for the others; grpc = always the tensor plane; "
        "cuda_ipc = demand IPC",
    )
    python_path: list[str] = Field(
        default_factory=list,
        description="folders holding the run's own Python modules (a reward or rollout_fn "
        "'module:function'): on the import path of the controller and of every worker the run starts, "
        "after the working directory, which always is; rlfleet train adds the job file's folder",
    )
    startup_timeout_s: float = Field(default=180.0, gt=0, description="wait for workers to announce")
    request_timeout_s: float | None = Field(
        default=None, gt=0,
        description="one deadline for every tier request; None: each request's deadline is scaled to "
        "its work (prompts x tokens, samples, batch and model bytes; controller/request_policy.py, "
        "faults.deadline_scale)",
    )  # fmt: skip

    # --- the tiers' settings, as they are ------------------------------------------------------------
    model: ModelSettings = Field(default_factory=ModelSettings, description="how the trainer holds the model")
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings, description="the algorithm")
    update: UpdateSettings = Field(default_factory=UpdateSettings, description="optimizer and loss")
    batch: BatchSettings = Field(default_factory=BatchSettings, description="prompts per step and update")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="the rollout tier")
    placement: Placement = Field(default_factory=Placement, description="device and seed")
    fleet: FleetAddress = Field(default_factory=FleetAddress, description="the fleet (NATS) the run uses")
    tensor_plane: TensorPlaneSettings = Field(
        default_factory=TensorPlaneSettings, description="every TensorStore's address and TLS"
    )

    # --- the controller's own sections -------------------------------------------------------------
    kl: KLControl = Field(
        default_factory=lambda: FixedKL(type="fixed"), description="the KL coefficient's controller"
    )
    lr_schedule: LRSchedule = Field(
        default_factory=LRSchedule,
        description="how learning_rate moves over the run ({type: constant | linear | cosine, warmup_steps "
        "or warmup_ratio, min_lr_ratio}); each step's rate is logged as lr",
    )
    reward: RewardSettings = Field(default_factory=RewardSettings, description="the reward tier")
    eval: EvalSettings = Field(default_factory=EvalSettings, description="held-out evaluation")
    environment: EnvironmentSettings = Field(
        default_factory=EnvironmentSettings,
        description="multi-turn episodes against an environment of the reward tier ({env, serve, max_turns, "
        "max_observation_tokens, timeout_s}); no env: single-turn rollouts",
    )  # fmt: skip
    agent: AgentSettings = Field(
        default_factory=AgentSettings,
        description="bring your own agent: each rollout an episode of the user's agent against a rollout "
        "worker's OpenAI-compatible endpoint ({function, agent_timeout_s, max_parallel, max_session_tokens, "
        "session_idle_s}); no function: the rollout workers generate",
    )  # fmt: skip
    dynamic_sampling: DynamicSamplingSettings = Field(
        default_factory=DynamicSamplingSettings,
        description="drop groups whose rewards are all equal and sample more prompts in their place (DAPO)",
    )
    faults: FaultSettings = Field(
        default_factory=FaultSettings, description="retries, restarts, the stall watchdog (issue 12)"
    )
    launcher: LauncherSettings = Field(
        default_factory=lambda: EmbeddedLauncher(type="embedded"),
        description="who starts the tiers: {type: embedded, gpus} (local processes; none when nats_url is "
        "set) or {type: ray, address, num_cpus, resources, max_restarts, worker_auth}",
    )

    @classmethod
    def tidy(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A ``kl`` or ``launcher`` section without a type is the default one (fixed, embedded); the
        embedded launcher takes only ``gpus``, and a Ray setting beside it (the flat form's
        ``ray_address`` without ``launcher: ray``) is named. Before anything, an unknown key and a
        setting the algorithm does not read are named with their fix (config_names.py)."""
        check_known(cls, data)
        algorithm = given_algorithm(data) or cls.FINAL_ALGORITHM
        if algorithm in ALGORITHMS:
            check_in_effect(cls, data, algorithm, job=cls.FINAL_ALGORITHM is not None)
        for name, tag in cls.DEFAULT_TAGS.items():
            if isinstance(data.get(name), dict) and "type" not in data[name]:
                data = {**data, name: {"type": tag, **data[name]}}
        launcher = data.get("launcher")
        if isinstance(launcher, dict) and launcher.get("type") == "embedded":
            ray_only = sorted(set(launcher) - {"type", "gpus"})
            if ray_only:
                raise ValueError(f"launcher.{', launcher.'.join(ray_only)}: only used with launcher=ray")
        return data

    @model_validator(mode="after")
    def _check_worker_logins(self) -> TrainerConfig:
        try:
            worker_logins(self, self.fleet.nats_auth)  # again when the run starts, with RLFLEET_NATS_* read
        except ConfigError as exc:  # said as this model's other checks say it
            raise ValueError(f"{exc.path}: {exc.reason}") from None
        if (
            isinstance(self.launcher, RayLauncher)
            and self.launcher.worker_auth
            and self.fleet.nats_url is None
        ):
            raise ValueError(
                "launcher.worker_auth: only used with nats_url (the workers' logins on that server)"
            )
        return self

    @model_validator(mode="after")
    def _check_lengths(self) -> TrainerConfig:
        answers = {"max_response_length": self.max_response_length}
        if self.eval.data is not None:  # held-out answers run to eval.max_tokens on the same pools
            answers["eval.max_tokens"] = self.eval.max_tokens
        for name, (_, settings) in self.pools().items():
            cap = settings.context_cap
            if cap is None:  # the HF engine has no context cap
                continue
            where = (
                f"rollout.pools.{name}.engine.max_model_len"
                if self.rollout.pools
                else "rollout.engine.max_model_len"
            )
            for field, tokens in answers.items():
                if self.max_prompt_length + tokens > cap:
                    raise ValueError(
                        f"max_prompt_length ({self.max_prompt_length}) + {field} ({tokens}) exceeds {where} "
                        f"({cap}); raise it or lower max_prompt_length or {field} (longer requests are "
                        "refused)"
                    )
        return self

    @model_validator(mode="after")
    def _check_algorithm(self) -> TrainerConfig:
        name = self.algorithm.name
        if ALGORITHMS[name].uses_groups and self.batch.group_size < 2:
            raise ValueError(
                f"group_size must be greater than or equal to 2 for {name} (its advantages compare "
                f"the samples of one prompt); got {self.batch.group_size}"
            )
        check_kl_start(self.kl, self.update.kl_coef)
        if self.dynamic_sampling.enabled and not ALGORITHMS[name].uses_groups:
            raise ValueError(
                f"dynamic_sampling: {name} does not compare the samples of a prompt, so a group of equal "
                "rewards still carries its signal (it is for grpo, rloo and the like)"
            )
        if self.max_staleness and not ALGORITHMS[name].online:
            raise ValueError(
                f"max_staleness: {name} generates nothing to pipeline (it is for online algorithms)"
            )
        return self

    def pools(self) -> dict[str, tuple[int, RolloutSettings]]:
        """Each rollout pool's worker count and engine settings, in config order (no pools:
        ``{'default': (rollout.workers, rollout's settings)}``)."""
        if not self.rollout.pools:
            return {"default": (self.rollout.workers, self.rollout.settings())}
        base = self.rollout.settings()
        return {name: (pool.workers, pool.settings(base)) for name, pool in self.rollout.pools.items()}

    def pool_sizes(self) -> dict[str, int]:
        """Rollout workers per pool, in config order (no pools: ``{'default': rollout.workers}``)."""
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
        if data["fleet"].get("nats_url"):
            data["fleet"]["nats_url"] = mask_url(data["fleet"]["nats_url"])
        if data["reward"].get("url"):
            data["reward"]["url"] = mask_url(data["reward"]["url"])
        return data


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


class JobModel(ModelSettings):
    """The job's ``model``: which model (``name``; ``model: smollm2`` for short) and how the trainer
    holds it (the trainer's ``ModelSettings``)."""

    SHORT_FORM: ClassVar[str | None] = "name"

    name: str = Field(
        description="actor model: a local HF dir, a Hugging Face Hub id 'org/name' or 'org/name@revision' "
        "(local cache first; HF_HUB_OFFLINE respected), 'smollm2', or 'tiny:<name>'"
    )

    def settings(self) -> ModelSettings:
        """How the trainer holds the model (this section without its name)."""
        return ModelSettings.model_validate(self.model_dump(exclude={"name"}, exclude_unset=True))


class JobReward(RewardSettings):
    """The job's ``reward``: the spec the reward tier scores with (``reward: 'concise'`` for short; a
    spec in its dict form too) and where (the run's :class:`RewardSettings`)."""

    SHORT_FORM: ClassVar[str | None] = "spec"

    spec: str | dict[str, Any] | list[str] | None = Field(
        default=None,
        description="reward spec for the reward tier (e.g. 'rm:path=/m'), or a list of them, each weighted "
        "by reward.weights (e.g. ['mymod:fn', 'concise']); dpo takes none",
    )

    @model_validator(mode="before")
    @classmethod
    def _a_dict_spec(cls, data: Any) -> Any:
        """``reward: {components: [...]}`` is a spec in its dict form, not this section."""
        if isinstance(data, dict) and not set(data) <= set(cls.model_fields):
            return {"spec": data}
        return data

    def settings(self) -> RewardSettings:
        """Where the rewards come from (this section without its spec)."""
        return RewardSettings.model_validate(self.model_dump(exclude={"spec"}, exclude_unset=True))


class JobConfig(TrainerConfig):
    """A whole run for ``rlfleet train``: the trainer's settings plus the model's name, the reward's
    spec and the data."""

    RENAMED: ClassVar[tuple[Legacy, ...]] = (
        *TrainerConfig.RENAMED,
        Legacy("model", ("model", "name")),
        Legacy("reward", ("reward", "spec")),
    )
    FINAL_ALGORITHM: ClassVar[str | None] = "grpo"  # a job's algorithm is final: grpo unless named

    model: JobModel = Field(description="the actor model (name) and how the trainer holds it")
    reward: JobReward = Field(default_factory=JobReward, description="the reward spec and where it is scored")
    data: DataConfig = Field(description="prompt dataset")
    num_epochs: int = Field(default=1, ge=1, description="passes over the dataset")
    max_steps: int | None = Field(default=None, ge=1, description="stop after this many steps")
    description: str = Field(default="", description="free text shown at start")
    rollout_fn: str | None = Field(
        default=None,
        description="'package.module:function' routing each prompt to a rollout pool or answering it "
        "(GRPOTrainer.set_rollout_fn); the module must be importable from where rlfleet runs",
    )

    @classmethod
    def tidy(cls, data: dict[str, Any]) -> dict[str, Any]:
        """A run's saved ``config.yaml`` loads as the job it ran: its records of where the model and the
        data resolved (``model_path``, ``dataset``) are dropped (saved_config.py)."""
        return super().tidy(drop_records(data))

    @model_validator(mode="after")
    def _online_needs_reward(self) -> JobConfig:
        name = self.algorithm.name
        online = ALGORITHMS[name].online
        if self.reward.spec is None and online:
            raise ValueError(f"algorithm {name} scores rollouts: set reward (a reward spec)")
        if self.rollout_fn and not online:
            raise ValueError(f"rollout_fn routes rollouts; algorithm {name} generates none")
        return self

    def trainer_config(self) -> TrainerConfig:
        """The TrainerConfig part of this job (the model's settings without its name, the reward's
        without its spec)."""
        fields = [name for name in TrainerConfig.model_fields if name in self.model_fields_set]
        values: dict[str, Any] = {name: getattr(self, name) for name in fields}
        values["model"] = self.model.settings()
        if "reward" in values:
            values["reward"] = self.reward.settings()
        return TrainerConfig(**values)
