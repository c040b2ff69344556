"""The trainer tier's settings, in three groups by when they may change.

- :class:`ModelSettings`: how the trainer holds the model (device, precision, sharding, trained
  layers). Fixed for a run: a trainer worker whose own differ refuses to join it, naming each field.
- :class:`UpdateSettings` and :class:`AlgorithmSettings`: how a step updates the policy. The
  controller sends them with every step (:class:`StepSettings` inside ``TrainStepRequest``) and
  the trainer applies them, learning rate and weight decay included; a worker's own values are
  only its defaults for requests that carry none.

The controller's ``TrainerConfig`` holds the same classes as its sections (``model``, ``update``,
``algorithm``, ``batch``), so a job file's ``update.learning_rate`` (short: ``learning_rate``) is
this module's field, defined once; a trainer worker's config holds ``model`` and ``step``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.algorithms import ALGORITHMS, AlgorithmName, KLMode, PolicyLossName
from rlfleet.common.schema.config import ConfigModel, Legacy, SettingsModel
from rlfleet.common.schema.worker import ModelLoading, ModelWorkerConfig

KLEstimator = Literal["k1", "k2", "k3"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
OffPolicyCorrection = Literal["none", "token_tis", "seq_mis", "decoupled"]
"""How a step reweights tokens the engine sampled with other weights (the trainer's
``algorithms/off_policy.py``)."""
Precision = Literal["auto", "none", "bf16"]
Sharding = Literal["auto", "full", "hybrid", "none"]


CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""CPU features (as ``/proc/cpuinfo`` names them) that compute bf16 matrix products natively."""


def cpu_has_native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU computes bf16 natively (AVX512-BF16 or AMX). Without either,
    bf16 matrix products are emulated and several times slower than fp32 (measured here on an
    AVX2-only CPU: about 8x); unknown (no ``/proc/cpuinfo``) counts as no."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return bool(CPU_BF16_FLAGS & set(line.partition(":")[2].split()))
    return False


CPU_BF16_ENV = "RLFLEET_CPU_BF16"
"""``1`` or ``0`` overrides :func:`cpu_has_native_bf16` for ``mixed_precision: auto`` on a CPU (for
one numeric path across a fleet of mixed CPUs, or fp32 tests on any host); unset or empty: read
the CPU's flags."""


def cpu_bf16_override() -> bool | None:
    """The ``RLFLEET_CPU_BF16`` setting: True, False, or None when unset; any other value raises
    :class:`~rlfleet.common.errors.ConfigError` (it is only read for ``mixed_precision: auto``)."""
    value = os.environ.get(CPU_BF16_ENV, "").strip()
    if not value:
        return None
    if value not in ("0", "1"):
        reason = f"{CPU_BF16_ENV} must be 0 or 1 (or unset to read the CPU's flags), got {value!r}"
        raise ConfigError("mixed_precision", "auto", reason)
    return value == "1"


def resolve_precision(setting: Precision, device: str) -> Literal["none", "bf16"]:
    """``auto`` is bf16 autocast on a GPU, and on a CPU with native bf16 (:func:`cpu_has_native_bf16`,
    or ``RLFLEET_CPU_BF16`` where set), else none (fp32); the others are themselves."""
    if setting != "auto":
        return setting
    if str(device).startswith("cuda"):
        return "bf16"
    forced = cpu_bf16_override()
    native = cpu_has_native_bf16() if forced is None else forced
    return "bf16" if native else "none"


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""PEFT's usual targets on a Llama/Qwen-style model: every linear layer of attention and the MLP."""


class LoraSettings(ConfigModel):
    """LoRA adapters on the actor (``model.lora``), in PEFT's conventions: each targeted linear layer
    ``W`` computes ``W x + (alpha / rank) B A x`` with ``A`` (rank x in) and ``B`` (out x rank,
    zero at the start), and only ``A`` and ``B`` train. The reference model is the base with the
    adapters switched off (no second copy of the weights)."""

    rank: int = Field(default=16, ge=1, le=4096, description="the adapters' rank r")
    alpha: float = Field(
        default=32.0, gt=0.0, allow_inf_nan=False, description="scaling numerator: updates are alpha / rank"
    )
    dropout: float = Field(
        default=0.0, ge=0.0, lt=1.0, allow_inf_nan=False,
        description="dropout on the adapters' input (0: none, so that a step's first ratio is exactly 1)",
    )  # fmt: skip
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS), min_length=1, max_length=64,
        description="names (last component) of the linear layers that get adapters",
    )  # fmt: skip


class ModelSettings(ModelLoading):
    """How the trainer holds the model; fixed for a run (see the module docstring)."""

    param_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="trainer parameter dtype (float32 master weights by default)"
    )
    mixed_precision: Precision = Field(
        default="auto",
        description="trainer bf16 autocast with fp32 master weights; auto: bf16 on a GPU and on a CPU with "
        "AVX512-BF16 or AMX, none (fp32) on other CPUs, where bf16 is emulated and several times slower "
        "(RLFLEET_CPU_BF16=0 or 1 overrides the CPU check)",
    )
    trainable_layers: int | None = Field(
        default=None,
        ge=1,
        description="train only the top N transformer blocks (+ final norm), embeddings frozen; "
        "cheap on CPU. None trains every parameter",
    )
    sharding: Sharding = Field(
        default="auto",
        description="how the trainer ranks share the model: full (FSDP), hybrid (shard within a node, "
        "replicate across nodes), none (replicate), auto (full on one node, hybrid on several)",
    )
    gradient_checkpointing: bool = Field(default=False, description="recompute activations in backward")
    share_prompts: bool = Field(
        default=True,
        description="rows of a micro-batch with the same prompt (a GRPO group) run as one packed sequence: "
        "the prompt once, then each response seeing only it and itself, no padding; the same logits and "
        "gradients for fewer positions. One trainer process only (not under FSDP ranks), not with compile",
    )
    compile: bool = Field(
        default=False,
        description="torch.compile the policy's and reference's decoder blocks and the logprob reduction "
        "(about 2x faster updates on a GPU; the first steps, and new sequence shapes, compile)",
    )
    lora: LoraSettings | None = Field(
        default=None,
        description="train LoRA adapters on the actor instead of every weight ({rank, alpha, dropout, "
        "target_modules}); the reference is the base with the adapters off. None: full training",
    )

    def conflicts(self, other: ModelSettings) -> dict[str, tuple[object, object]]:
        """``{field: (mine, theirs)}`` for every field that differs from ``other``'s."""
        return {
            name: (getattr(self, name), getattr(other, name))
            for name in ModelSettings.model_fields
            if getattr(self, name) != getattr(other, name)
        }


class UpdateSettings(SettingsModel):
    """How one step updates the policy: optimizer, loss and batching."""

    learning_rate: float = Field(allow_inf_nan=False, default=1e-6, gt=0.0, description="AdamW learning rate")
    weight_decay: float = Field(allow_inf_nan=False, default=0.0, ge=0.0, description="AdamW weight decay")
    micro_batch_size: int = Field(default=8, ge=1, description="sequences per forward/backward pass")
    max_grad_norm: float = Field(
        allow_inf_nan=False, default=1.0, gt=0.0, description="gradient clipping norm"
    )
    ppo_epochs: int = Field(default=1, ge=1, description="passes over each rollout batch")
    clip_eps: float = Field(
        allow_inf_nan=False, default=0.2, gt=0.0, description="ratio clip range (below 1; above too unless "
        "clip_eps_high is set)",
    )  # fmt: skip
    clip_eps_high: float | None = Field(
        allow_inf_nan=False, default=None, gt=0.0,
        description="ratio clip range above 1 (DAPO's clip-higher, e.g. 0.28); None: clip_eps",
    )  # fmt: skip
    overlong_buffer: int = Field(
        default=0, ge=0,
        description="DAPO's soft overlong penalty: over the last this many tokens before the response cap "
        "a sample's reward falls linearly, by overlong_penalty at the cap; 0 = off",
    )  # fmt: skip
    overlong_penalty: float = Field(
        allow_inf_nan=False, default=1.0, ge=0.0, description="the soft overlong penalty at the response cap"
    )
    mask_truncated: bool = Field(
        default=False, description="samples cut at the response cap (no stop token) give no loss (DAPO's "
        "overlong filtering); they still count in their group's advantages",
    )  # fmt: skip
    response_cap: int | None = Field(
        default=None, ge=1, description="the responses' length cap in tokens, for the two above: the "
        "controller sends its max_response_length with every step",
    )  # fmt: skip
    policy_loss: PolicyLossName = Field(
        default="ppo_clip", description="ppo_clip (PPO's clipped surrogate) | gspo (sequence-level ratio) "
        "| cispo (clipped importance weights, every token's gradient kept)",
    )  # fmt: skip
    kl_coef: float = Field(
        allow_inf_nan=False,
        default=0.05,
        ge=0.0,
        description="KL-to-reference coefficient (the KL controller's start value)",
    )
    entropy_coef: float = Field(allow_inf_nan=False, default=0.0, description="entropy bonus weight")
    loss_agg: LossAgg = Field(default="token-mean", description="how per-token losses are averaged")
    temperature: float = Field(
        allow_inf_nan=False, default=1.0, gt=0.0, description="sampling temperature (logprobs use it too)"
    )
    off_policy_correction: OffPolicyCorrection = Field(
        default="none",
        description="importance weights pi_old / mu of the engine's samples: none | token_tis (truncated at "
        "is_cap) | seq_mis (sequences whose ratio leaves [is_band_low, is_band_high] dropped) | decoupled "
        "(tokens over is_cap masked)",
    )
    is_cap: float = Field(
        allow_inf_nan=False, default=2.0, gt=1.0, description="token_tis: weight cap; decoupled: mask cap"
    )
    is_band_low: float = Field(
        allow_inf_nan=False, default=0.5, gt=0.0, lt=1.0, description="seq_mis: lowest sequence ratio kept"
    )
    is_band_high: float = Field(
        allow_inf_nan=False, default=2.0, gt=1.0, description="seq_mis: highest sequence ratio kept"
    )

    @property
    def clip_range(self) -> tuple[float, float]:
        """``(low, high)``: a policy loss clips its ratio to ``[1 - low, 1 + high]``."""
        return self.clip_eps, self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


class AlgorithmSettings(SettingsModel):
    """Which algorithm runs, and its settings beyond the policy loss shared by all (``algorithm: grpo``
    is short for ``algorithm: {name: grpo}``)."""

    SHORT_FORM: ClassVar[str | None] = "name"

    name: AlgorithmName = Field(
        default="grpo", description="ppo | grpo | dr_grpo | rloo | reinforce_pp | dpo"
    )
    kl_mode: KLMode | None = Field(
        default=None,
        description="KL in the loss or in the reward; None: the algorithm's default "
        "(reward for ppo, rloo, reinforce_pp; loss for grpo)",
    )
    kl_estimator: KLEstimator | None = Field(
        default=None, description="per-token KL estimator; None: k1 in the reward, k3 in the loss"
    )
    gamma: float = Field(
        allow_inf_nan=False, default=1.0, ge=0.0, le=1.0, description="discount (PPO GAE, REINFORCE++)"
    )
    lam: float = Field(allow_inf_nan=False, default=0.95, ge=0.0, le=1.0, description="PPO GAE lambda")
    whiten_advantages: bool = Field(default=True, description="PPO: whiten GAE advantages over the batch")
    value_clip: float | None = Field(
        allow_inf_nan=False, default=0.2, gt=0.0, description="PPO critic value clip; None: off"
    )
    critic_learning_rate: float | None = Field(
        allow_inf_nan=False,
        default=None,
        gt=0.0,
        description="critic AdamW learning rate; None: learning_rate",
    )
    beta: float = Field(
        allow_inf_nan=False,
        default=0.1,
        gt=0.0,
        description="DPO: inverse temperature of the implicit reward",
    )
    dpo_loss: Literal["sigmoid", "ipo"] = Field(default="sigmoid", description="DPO loss type")
    label_smoothing: float = Field(
        allow_inf_nan=False,
        default=0.0,
        ge=0.0,
        lt=0.5,
        description="conservative DPO: probability a label is flipped",
    )

    def resolved_kl_mode(self) -> KLMode:
        """Where the KL term goes: the configured mode or the algorithm's default."""
        if self.kl_mode is not None:
            return self.kl_mode
        return ALGORITHMS[self.name].default_kl_mode or "loss"

    def resolved_kl_estimator(self) -> KLEstimator:
        """The configured estimator, else k1 for a KL in the reward and k3 for one in the loss."""
        if self.kl_estimator is not None:
            return self.kl_estimator
        return "k1" if self.resolved_kl_mode() == "reward" else "k3"


class BatchSettings(SettingsModel):
    """How many prompts a step takes and how they are split into optimizer updates."""

    rollout_batch_size: int = Field(default=16, ge=1, description="prompts per step")
    train_batch_size: int = Field(
        default=16, ge=1, description="prompts per optimizer update; rollout_batch_size must be a multiple"
    )
    group_size: int = Field(default=4, ge=1, description="samples per prompt (grpo and rloo need >= 2)")

    @model_validator(mode="after")
    def _check_batches(self) -> BatchSettings:
        if self.rollout_batch_size % self.train_batch_size:
            raise ValueError(
                f"rollout_batch_size ({self.rollout_batch_size}) must be a multiple of train_batch_size "
                f"({self.train_batch_size}); set train_batch_size to a divisor of it"
            )
        return self

    @property
    def num_updates(self) -> int:
        """Optimizer steps per step's batch (each over ``train_batch_size`` prompts)."""
        return self.rollout_batch_size // self.train_batch_size


STEP_SECTIONS = {"update": UpdateSettings, "algorithm": AlgorithmSettings, "batch": BatchSettings}
"""The sections of the step settings, each a :class:`SettingsModel` (nested by the step settings)."""

_STEP_KEYS = {key: name for name, cls in STEP_SECTIONS.items() for key in cls.model_fields if key != "name"}


class StepSettings(SettingsModel):
    """Everything one train step needs besides its data, as the controller sends it with each step:
    the ``update``, ``algorithm`` and ``batch`` sections.

    On the wire it travels in the flat form of the previous release (:meth:`wire_form`, written by
    ``SETTINGS_SET``: every setting a top-level key, ``algorithm`` the name), which a trainer of
    either release reads; unknown fields (a newer controller's) are ignored, as in every message.
    The step settings nest and flatten themselves (:meth:`_sections`, :meth:`wire_form`) rather than
    through :mod:`rlfleet.common.schema.config`'s general loader: every step reads them, and a step
    passes through no file it does not need (``tests/integration/test_step_files.py``). Their
    ``FLAT_SECTIONS`` and ``RENAMED`` say the same to that loader, for a worker config that holds them
    (``TrainerWorkerConfig.step``).
    """

    model_config = ConfigDict(extra="ignore", validate_assignment=True)
    FLAT_SECTIONS: ClassVar[frozenset[str]] = frozenset(STEP_SECTIONS)
    RENAMED: ClassVar[tuple[Legacy, ...]] = (Legacy("algorithm", ("algorithm", "name")),)

    update: UpdateSettings = Field(default_factory=UpdateSettings, description="optimizer and loss")
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings, description="the algorithm")
    batch: BatchSettings = Field(default_factory=BatchSettings, description="prompts per step and update")

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, data: Any) -> Any:
        """The flat form into the sections (a setting given both ways: the flat one wins, as in every
        config); ``algorithm: grpo`` is ``algorithm: {name: grpo}``; anything else as it is."""
        if not isinstance(data, dict):
            return data
        out = dict(data)
        if isinstance(out.get("algorithm"), str):
            out["algorithm"] = {"name": out["algorithm"]}
        for key in [k for k in out if k in _STEP_KEYS]:
            section = _STEP_KEYS[key]
            held = out.get(section)
            if isinstance(held, BaseModel):
                held = held.model_dump(exclude_unset=True)
            if held is not None and not isinstance(held, dict):
                continue  # not a section: validation names it
            out[section] = {**(held or {}), key: out.pop(key)}
        return out

    def wire_form(self) -> dict[str, Any]:
        """The flat form without defaults (what ``trainer.step`` carries): each section's settings
        that differ from their defaults at the top, the algorithm's name as ``algorithm``."""
        flat: dict[str, Any] = {}
        for name in STEP_SECTIONS:
            values = getattr(self, name).model_dump(mode="json", exclude_defaults=True)
            if "name" in values:
                flat[name] = values.pop("name")
            flat.update(values)
        return flat

    @classmethod
    def of(cls, settings: object, **update: object) -> StepSettings:
        """The step settings of ``settings`` (a config holding ``update``, ``algorithm`` and ``batch``
        sections, or a trainer worker's config holding ``step``), with ``update``'s values over its
        update section (the KL controller's ``kl_coef``)."""
        base = getattr(settings, "step", settings)
        names = ("update", "algorithm", "batch")
        step = cls(**{name: getattr(base, name).model_copy(deep=True) for name in names})
        if update:
            step.update = UpdateSettings.model_validate({**step.update.model_dump(), **update})
        return step


class TrainerWorkerConfig(ModelWorkerConfig):
    """A trainer worker's config (``rlfleet-trainer serve --config``): its model, how it holds it
    (``model``), and the step settings it uses for requests that carry none (``step``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    FLAT_SECTIONS: ClassVar[frozenset[str]] = ModelWorkerConfig.FLAT_SECTIONS | {"model", "step"}

    model: ModelSettings = Field(default_factory=ModelSettings, description="how it holds the model")
    step: StepSettings = Field(default_factory=StepSettings, description="its default step settings")
    critic_model_path: str | None = Field(
        default=None, description="PPO critic backbone (local HF dir); None: the actor's checkpoint"
    )
    threads: int = Field(default=0, ge=0, description="torch CPU threads; 0 keeps torch's default")
    weights_store_mb: float = Field(
        default=16384, gt=0, description="TensorStore capacity for published weight buckets (MiB)"
    )
    checkpoint_root: str = Field(
        default="checkpoints",
        description="the only directory trainer.save/load use: a request's path must lie inside it "
        "(relative: against the worker's working directory)",
    )
    rank_silence_s: float = Field(
        default=20.0, ge=3.0, le=600.0,
        description="with several ranks: rank 0 reports a rank whose heartbeat (every 2 s, in the ranks' "
        "rendezvous store) is silent this long as TrainerRankDied and exits, so the ranks restart together",
    )  # fmt: skip


def model_fingerprint(model_dir: str | Path) -> str:
    """A short hash of a model directory's ``config.json`` (same architecture and shapes, same hash).

    The controller and a trainer compare it to know they hold the same model even at different
    paths; "" when the file is missing or unreadable.
    """
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
