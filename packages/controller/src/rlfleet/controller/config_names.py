"""The names users bring: TRL's, verl's and OpenRLHF's keys for rlfleet's settings, and settings that
the chosen algorithm does not read.

Both checks run on a job's or a ``TrainerConfig``'s input before its fields are validated
(``TrainerConfig.tidy``), so the first mistake is said in one line that names its fix:

- an unknown key that another framework uses (:func:`check_known`, :data:`FOREIGN`) gets rlfleet's
  place for it (``num_generations`` -> ``group_size``, verl's ``actor_rollout_ref.rollout.n``
  too); any other unknown key gets the loader's did-you-mean, which the CLI shows alone
  (:func:`short_reason`), or a pointer to ``rlfleet config --fields`` when nothing is close;
- a setting that only other algorithms read (:data:`ONLY_FOR`), set to something other than its
  default, is refused with the setting that does that job under the chosen algorithm
  (:func:`check_in_effect`: ``beta=0.04`` under grpo -> ``kl_coef``).

Both raise a pydantic ``ValidationError`` located at the offending key, which the config loader turns
into ``config field 'batch.num_generations' = 8: ...`` (exit 2 on the command line).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, get_args

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from rlfleet.common.schema.config import SettingsModel, section_class, union_members

FIELDS_HINT = "rlfleet config --fields lists every key"

TRL, VERL, OPENRLHF = "TRL's", "verl's", "OpenRLHF's"

FOREIGN: dict[str, tuple[str, str, str]] = {
    # TRL (GRPOConfig, DPOConfig, PPOConfig, TrainingArguments, ScriptArguments)
    "num_generations": ("batch.group_size", TRL, ""),
    "report_to": ("loggers", TRL, "a list of console, jsonl, tensorboard, wandb"),
    "max_completion_length": ("max_response_length", TRL, ""),
    "num_train_epochs": ("num_epochs", TRL, ""),
    "per_device_train_batch_size": ("update.micro_batch_size", TRL, "sequences per forward/backward pass; "
                                    "batch.train_batch_size counts prompts per optimizer update"),
    "gradient_accumulation_steps": ("batch.train_batch_size", TRL, "prompts per optimizer update"),
    "model_name_or_path": ("model", TRL, ""),
    "dataset_name": ("data.path", TRL, "a file or 'hf:NAME?split=train'"),
    "epsilon": ("update.clip_eps", TRL, ""),
    "epsilon_high": ("update.clip_eps_high", TRL, ""),
    "cliprange": ("update.clip_eps", TRL, ""),
    "cliprange_value": ("algorithm.value_clip", TRL, ""),
    "num_iterations": ("update.ppo_epochs", TRL, ""),
    "num_ppo_epochs": ("update.ppo_epochs", TRL, ""),
    "loss_type": ("update.loss_agg", TRL, "DPO's loss_type is algorithm.dpo_loss"),
    "mask_truncated_completions": ("update.mask_truncated", TRL, ""),
    "response_length": ("max_response_length", TRL, ""),
    "logging_steps": ("log_every", TRL, ""),
    "save_steps": ("save_every", TRL, ""),
    "eval_steps": ("eval.every", TRL, ""),
    "resume_from_checkpoint": ("resume_from", TRL, ""),
    "bf16": ("model.mixed_precision", TRL, "bf16, or auto"),
    "use_vllm": ("rollout.engine", TRL, "rollout.engine=vllm"),
    "vllm_gpu_memory_utilization": ("rollout.engine.gpu_memory_utilization", TRL, "with rollout.engine=vllm"),
    "top_p": ("rollout.top_p", TRL, ""),
    "top_k": ("rollout.top_k", TRL, ""),
    # OpenRLHF (train_ppo_ray's flags)
    "init_kl_coef": ("update.kl_coef", OPENRLHF, ""),
    "n_samples_per_prompt": ("batch.group_size", OPENRLHF, ""),
    "micro_train_batch_size": ("update.micro_batch_size", OPENRLHF, ""),
    "micro_rollout_batch_size": ("rollout.max_batch_size", OPENRLHF, ""),
    "actor_learning_rate": ("update.learning_rate", OPENRLHF, ""),
    "prompt_max_len": ("max_prompt_length", OPENRLHF, ""),
    "generate_max_len": ("max_response_length", OPENRLHF, ""),
    "max_epochs": ("update.ppo_epochs", OPENRLHF, "num_epochs counts passes over the prompts"),
    "num_episodes": ("num_epochs", OPENRLHF, ""),
    "pretrain": ("model", OPENRLHF, ""),
    "reward_pretrain": ("reward", OPENRLHF, "a reward model is the spec 'rm:path=DIR'"),
    "critic_pretrain": ("critic_model_name", OPENRLHF, ""),
    "prompt_data": ("data.path", OPENRLHF, ""),
    "input_key": ("data.prompt_key", OPENRLHF, ""),
    "advantage_estimator": ("algorithm", OPENRLHF, "gae is ppo, group_norm is grpo; rloo, reinforce_pp"),
    "eps_clip": ("update.clip_eps", OPENRLHF, ""),
    "lambd": ("algorithm.lam", OPENRLHF, ""),
    "l2": ("update.weight_decay", OPENRLHF, ""),
    "entropy_loss_coef": ("update.entropy_coef", OPENRLHF, ""),
    "use_kl_loss": ("algorithm.kl_mode", OPENRLHF, "algorithm.kl_mode=loss"),
    "use_kl_estimator_k3": ("algorithm.kl_estimator", OPENRLHF, "algorithm.kl_estimator=k3"),
    "ckpt_path": ("output_dir", OPENRLHF, ""),
    "save_path": ("output_dir", OPENRLHF, ""),
    "load_checkpoint": ("resume_from", OPENRLHF, "resume_from=auto"),
    "use_tensorboard": ("loggers", OPENRLHF, ""),
    "use_wandb": ("loggers", OPENRLHF, "add wandb to loggers"),
    "vllm_num_engines": ("rollout.workers", OPENRLHF, ""),
    "vllm_tensor_parallel_size": ("rollout.engine.tensor_parallel_size", OPENRLHF, "with engine=vllm"),
    "colocate_all_models": ("rollout.engine.colocate", OPENRLHF, "with rollout.engine=vllm"),
    "vllm_enable_sleep": ("rollout.engine.sleep_level", OPENRLHF, "with rollout.engine=vllm"),
    "dynamic_filtering": ("dynamic_sampling.enabled", OPENRLHF, ""),
    "zero_stage": ("model.sharding", OPENRLHF, ""),
    "actor_num_gpus_per_node": ("num_train_workers", OPENRLHF, ""),
    "lora_rank": ("model.lora.rank", OPENRLHF, ""),
    "lora_alpha": ("model.lora.alpha", OPENRLHF, ""),
    # verl (its Hydra keys, written as dotted overrides or nested sections)
    "data.train_batch_size": ("batch.rollout_batch_size", VERL, "prompts per step"),
    "data.max_prompt_length": ("max_prompt_length", VERL, ""),
    "data.max_response_length": ("max_response_length", VERL, ""),
    "data.train_files": ("data.path", VERL, ""),
    "data.val_files": ("eval.data", VERL, ""),
    "actor_rollout_ref.model.path": ("model", VERL, ""),
    "actor_rollout_ref.model.enable_gradient_checkpointing": ("model.gradient_checkpointing", VERL, ""),
    "actor_rollout_ref.model.lora_rank": ("model.lora.rank", VERL, ""),
    "actor_rollout_ref.actor.optim.lr": ("update.learning_rate", VERL, ""),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("batch.train_batch_size", VERL, ""),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": ("update.micro_batch_size", VERL, ""),
    "actor_rollout_ref.actor.ppo_epochs": ("update.ppo_epochs", VERL, ""),
    "actor_rollout_ref.actor.use_kl_loss": ("algorithm.kl_mode", VERL, "algorithm.kl_mode=loss"),
    "actor_rollout_ref.actor.kl_loss_coef": ("update.kl_coef", VERL, ""),
    "actor_rollout_ref.actor.kl_loss_type": ("algorithm.kl_estimator", VERL, "k1, k2 or k3"),
    "actor_rollout_ref.actor.entropy_coeff": ("update.entropy_coef", VERL, ""),
    "actor_rollout_ref.actor.clip_ratio": ("update.clip_eps", VERL, ""),
    "actor_rollout_ref.actor.clip_ratio_high": ("update.clip_eps_high", VERL, ""),
    "actor_rollout_ref.actor.loss_agg_mode": ("update.loss_agg", VERL, ""),
    "actor_rollout_ref.actor.grad_clip": ("update.max_grad_norm", VERL, ""),
    "actor_rollout_ref.rollout.n": ("batch.group_size", VERL, ""),
    "actor_rollout_ref.rollout.name": ("rollout.engine", VERL, "rollout.engine=vllm"),
    "actor_rollout_ref.rollout.temperature": ("update.temperature", VERL, ""),
    "actor_rollout_ref.rollout.top_p": ("rollout.top_p", VERL, ""),
    "actor_rollout_ref.rollout.gpu_memory_utilization": ("rollout.engine.gpu_memory_utilization", VERL,
                                                         "with rollout.engine=vllm"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": ("rollout.engine.tensor_parallel_size", VERL,
                                                             "with rollout.engine=vllm"),
    "algorithm.adv_estimator": ("algorithm.name", VERL, "gae is ppo; grpo, rloo, reinforce_plus_plus is "
                                "reinforce_pp"),
    "algorithm.use_kl_in_reward": ("algorithm.kl_mode", VERL, "algorithm.kl_mode=reward"),
    "algorithm.kl_ctrl.kl_coef": ("update.kl_coef", VERL, ""),
    "algorithm.kl_ctrl.type": ("kl.type", VERL, "fixed, adaptive or scheduled"),
    "algorithm.kl_ctrl.target_kl": ("kl.target", VERL, "with kl.type=adaptive"),
    "algorithm.kl_ctrl.horizon": ("kl.horizon", VERL, "with kl.type=adaptive"),
    "algorithm.kl_penalty": ("algorithm.kl_estimator", VERL, ""),
    "critic.optim.lr": ("algorithm.critic_learning_rate", VERL, ""),
    "critic.model.path": ("critic_model_name", VERL, ""),
    "reward_model.model.path": ("reward", VERL, "a reward model is the spec 'rm:path=DIR'"),
    "custom_reward_function.path": ("reward", VERL, "a Python reward is the spec 'module:function'"),
    "trainer.total_epochs": ("num_epochs", VERL, ""),
    "trainer.total_training_steps": ("max_steps", VERL, ""),
    "trainer.save_freq": ("save_every", VERL, ""),
    "trainer.test_freq": ("eval.every", VERL, ""),
    "trainer.logger": ("loggers", VERL, ""),
    "trainer.default_local_dir": ("output_dir", VERL, ""),
    "trainer.resume_mode": ("resume_from", VERL, "resume_from=auto"),
    "trainer.n_gpus_per_node": ("num_train_workers", VERL, "trainer ranks; rollout.workers: rollout's"),
}  # fmt: skip
"""A key of another framework (dotted for verl's nested ones) -> ``(rlfleet's place, whose name it is,
a note on how the value is written here, or '')``. ``tests/controller/test_config_names.py`` checks
that every place exists."""

SHORT_SECTIONS = ("update", "batch")
"""Sections whose settings may be written at the top (``group_size``, ``kl_coef``): suggested so."""


def shown(place: str) -> str:
    """How a suggestion writes ``place``: a setting of ``update`` or ``batch`` by its short form."""
    section, _, name = place.partition(".")
    return name if section in SHORT_SECTIONS and name and "." not in name else place


# --- unknown keys ---------------------------------------------------------------------------------


def check_known(cls: type[SettingsModel], data: Mapping[str, Any]) -> None:
    """Raise a ValidationError at the first key of ``data`` (nested sections included) that ``cls``
    does not know and that is another framework's name (:data:`FOREIGN`), with rlfleet's; any
    other unknown key is left to validation (pydantic's ``extra_forbidden``, whose did-you-mean the
    CLI shortens: :func:`short_reason`).

    A key is known when it is a field of its section or a flat key of the previous release
    (``SettingsModel.legacy``); a tagged section takes the keys of any of its variants (which variant
    takes which is its own check's to say); a section with a ``spec`` field reads keys it does not
    know as a spec (``reward: {components: ...}``) and is not looked into.
    """
    for loc, value in _unknown(cls, data, ()):
        reason = foreign_reason(loc)
        if reason is not None:
            raise _error(cls, loc, value, reason)


def _unknown(cls: type[SettingsModel], data: Mapping[str, Any], loc: tuple[str, ...]) -> Iterator[tuple]:
    """``(loc, value)`` of each leaf under a key of ``data`` that ``cls`` does not know."""
    if "spec" in cls.model_fields:
        return
    legacy = cls.legacy()
    for key, value in data.items():
        if not isinstance(key, str):
            continue
        if key in cls.model_fields:
            if isinstance(value, Mapping):
                for member in _sections(cls, key, value):
                    yield from _unknown(member, value, (*loc, key))
        elif key not in legacy:
            yield from _leaves((*loc, key), value)


def _sections(cls: type[SettingsModel], field: str, value: Mapping[str, Any]) -> list[type[SettingsModel]]:
    """The class a section's data is checked against: its own, or, for a tagged section whose keys
    no variant takes, the variant its tag names."""
    annotation = cls.model_fields[field].annotation
    section = section_class(annotation)
    if section is not None:
        return [section]
    members = union_members(annotation)
    known = {name for member in members for name in (*member.model_fields, *member.legacy())}
    if not members or set(value) <= known:
        return []
    for member in members:
        tag = member.SHORT_FORM
        if tag and value.get(tag) in get_args(member.model_fields[tag].annotation):
            return [member]
    return [members[0]]


def _leaves(loc: tuple[str, ...], value: Any) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Each leaf under ``loc`` (``actor_rollout_ref: {rollout: {n: 8}}`` -> ``...rollout.n``, 8)."""
    if isinstance(value, Mapping) and value:
        for key, inner in value.items():
            yield from _leaves((*loc, str(key)), inner)
    else:
        yield loc, value


def foreign_reason(loc: tuple[str, ...]) -> str | None:
    """``unknown field; did you mean 'group_size'? (num_generations is TRL's name)`` when the key at
    ``loc`` (dotted, or its tail, or its own name) is another framework's; else None."""
    tails = [".".join(loc[i:]) for i in range(len(loc))]
    for name in (*tails, loc[-1].lstrip("-")):
        if name in FOREIGN:
            place, whose, note = FOREIGN[name]
            return f"unknown field; did you mean {shown(place)!r}? ({name} is {whose} name{_note(note)})"
    return None


_KNOWN_LIST = re.compile(r" known fields: .*?(?= \(and \d+ more problem|$)")


def short_reason(reason: str) -> str:
    """A config error's reason without the list of every known field the loader appends to an
    unknown field's: the did-you-mean alone, or a pointer to ``rlfleet config --fields``."""
    if _KNOWN_LIST.search(reason) is None:
        return reason
    trimmed = _KNOWN_LIST.sub("", reason, count=1)
    if "did you mean" in trimmed:
        return trimmed
    return trimmed.replace("unknown field", f"unknown field ({FIELDS_HINT})", 1)


def _note(note: str) -> str:
    return f"; {note}" if note else ""


def _error(cls: type[BaseModel], loc: tuple[str, ...], value: Any, reason: str) -> ValidationError:
    message = reason.replace("{", "{{").replace("}", "}}")  # a template: braces are placeholders
    detail = InitErrorDetails(type=PydanticCustomError("config_name", message), loc=loc, input=value)
    return ValidationError.from_exception_data(cls.__name__, [detail])


# --- settings the chosen algorithm does not read ---------------------------------------------------


@dataclass(frozen=True)
class OnlyFor:
    """A setting only ``algorithms`` read; under any other, ``instead`` says what does its job."""

    path: tuple[str, ...]
    algorithms: frozenset[str]
    instead: str
    jobs_only: bool = False
    """Checked in a job file only: a library ``TrainerConfig`` is handed to a trainer class that may
    still change its algorithm (DPOTrainer makes it dpo, keeping the rest)."""
    off: tuple[Any, ...] = ()
    """Values that turn the setting off, accepted under any algorithm (``kl_coef: 0``)."""


ONLY_FOR: tuple[OnlyFor, ...] = (
    OnlyFor(("algorithm", "beta"), frozenset({"dpo"}),
            "it is DPO's inverse temperature; the KL weight of {algorithm} is kl_coef (update.kl_coef)"),
    OnlyFor(("algorithm", "dpo_loss"), frozenset({"dpo"}),
            "it is DPO's loss; the loss of {algorithm} is update.policy_loss"),
    OnlyFor(("algorithm", "label_smoothing"), frozenset({"dpo"}),
            "it is conservative DPO's; {algorithm} trains on rewards, not labels"),
    OnlyFor(("algorithm", "lam"), frozenset({"ppo"}),
            "it is PPO's GAE lambda; {algorithm} has no critic (its advantages: algorithm.name)"),
    OnlyFor(("algorithm", "whiten_advantages"), frozenset({"ppo"}),
            "it is PPO's; {algorithm} normalises its advantages by its own rule (algorithm.name)"),
    OnlyFor(("algorithm", "value_clip"), frozenset({"ppo"}),
            "it clips PPO's critic; the policy's clip of {algorithm} is update.clip_eps"),
    OnlyFor(("algorithm", "critic_learning_rate"), frozenset({"ppo"}),
            "{algorithm} trains no critic; its policy's rate is learning_rate"),
    OnlyFor(("critic_model_name",), frozenset({"ppo"}), "{algorithm} trains no critic (algorithm=ppo does)"),
    OnlyFor(("algorithm", "gamma"), frozenset({"ppo", "reinforce_pp"}),
            "it discounts returns in ppo and reinforce_pp; {algorithm} scores whole responses"),
    OnlyFor(("update", "kl_coef"), frozenset({"ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp"}),
            "{algorithm}'s KL weight is algorithm.beta", jobs_only=True, off=(0, 0.0)),
)  # fmt: skip
"""Settings that only some algorithms read (the trainer's algorithms and losses use them so)."""


def check_in_effect(cls: type[SettingsModel], data: Mapping[str, Any], algorithm: str, *, job: bool) -> None:
    """Raise a ValidationError at the first setting of ``data`` (the config's input, nested) that
    ``algorithm`` does not read and that is set to other than its default, naming what does its
    job; ``job``: the input is a job file's (its algorithm is final)."""
    for rule in ONLY_FOR:
        if algorithm in rule.algorithms or (rule.jobs_only and not job):
            continue
        given, value = _given(data, rule.path)
        if given and value != _default(cls, rule.path) and value not in rule.off:
            reason = f"has no effect under {algorithm}: {rule.instead.format(algorithm=algorithm)}"
            raise _error(cls, rule.path, value, reason)


def _given(data: Any, path: tuple[str, ...]) -> tuple[bool, Any]:
    """Whether the input sets ``path`` (a key of a mapping, a set field of a model), and its value."""
    for part in path:
        if isinstance(data, Mapping) and part in data:
            data = data[part]
        elif isinstance(data, BaseModel) and part in data.model_fields_set:
            data = getattr(data, part)
        else:
            return False, None
    return True, data


def _default(cls: type[BaseModel], path: tuple[str, ...]) -> Any:
    owner: Any = cls
    for part in path[:-1]:
        owner = section_class(owner.model_fields[part].annotation)
    return owner.model_fields[path[-1]].get_default(call_default_factory=True)


def given_algorithm(data: Mapping[str, Any]) -> str | None:
    """The algorithm named in a config's input (``algorithm: ppo``, ``{name: ppo}`` or a model whose
    name was set), or None when it names none."""
    algorithm = data.get("algorithm")
    if isinstance(algorithm, str):
        return algorithm
    given, name = _given({"algorithm": algorithm}, ("algorithm", "name"))
    return name if given and isinstance(name, str) else None
