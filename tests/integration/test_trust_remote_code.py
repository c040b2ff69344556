"""``model.trust_remote_code``: a tiny model folder whose config.json and tokenizer_config.json point
(``auto_map``) to Python files in the folder loads in every tier with the setting on, and is
refused with a one-line reason naming the setting without it: the controller's tokenizer, the
HF rollout engine, the trainer's actor and critic, a reward model, and a whole ``rlfleet train``."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from rlfleet.common.control.messages import SamplingParams
from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.reward import RewardWorkerConfig
from rlfleet.common.schema.rollout import HFEngineSettings, RolloutWorkerConfig, VLLMEngineSettings
from rlfleet.common.schema.trainer import ModelSettings, TrainerWorkerConfig
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.run_tokenizer import load_run_tokenizer
from rlfleet.controller.worker_configs import worker_specs

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_grpo.yaml"
CONFIG_PY = """from transformers import LlamaConfig


class RemoteTinyConfig(LlamaConfig):
    model_type = "rlfleet_remote_tiny"
"""
MODELING_PY = """from transformers import LlamaForCausalLM, LlamaForSequenceClassification, LlamaModel

from .configuration_remote import RemoteTinyConfig


class RemoteTinyModel(LlamaModel):
    config_class = RemoteTinyConfig


class RemoteTinyForCausalLM(LlamaForCausalLM):
    config_class = RemoteTinyConfig


class RemoteTinyForSequenceClassification(LlamaForSequenceClassification):
    config_class = RemoteTinyConfig
"""
TOKENIZER_PY = """from transformers import PreTrainedTokenizerFast


class RemoteTinyTokenizer(PreTrainedTokenizerFast):
    pass
"""
AUTO_MAP = {
    "AutoConfig": "configuration_remote.RemoteTinyConfig",
    "AutoModel": "modeling_remote.RemoteTinyModel",
    "AutoModelForCausalLM": "modeling_remote.RemoteTinyForCausalLM",
    "AutoModelForSequenceClassification": "modeling_remote.RemoteTinyForSequenceClassification",
}


def _edit_json(path: Path, **changes: object) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, indent=2))


@pytest.fixture
def remote_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """``tiny:digits`` as a model of its own type whose classes live in the folder's .py files."""
    folder = shutil.copytree(tiny_model_dir, tmp_path / "remote-tiny")
    for name, text in (
        ("configuration", CONFIG_PY),
        ("modeling", MODELING_PY),
        ("tokenization", TOKENIZER_PY),
    ):
        (folder / f"{name}_remote.py").write_text(text)
    _edit_json(folder / "config.json", model_type="rlfleet_remote_tiny", auto_map=AUTO_MAP,
               architectures=["RemoteTinyForCausalLM"])  # fmt: skip
    _edit_json(folder / "tokenizer_config.json", tokenizer_class="RemoteTinyTokenizer",
               auto_map={"AutoTokenizer": [None, "tokenization_remote.RemoteTinyTokenizer"]})  # fmt: skip
    return folder


def test_the_setting_reaches_every_worker_config(tmp_path: Path) -> None:
    from rlfleet.rollout.service import engine_kwargs

    for trusted in (False, True):
        config = (
            TrainerConfig(model={"trust_remote_code": trusted}, output_dir=str(tmp_path))
            if trusted
            else TrainerConfig()
        )
        specs = worker_specs(config, tmp_path, "c", online=True, reward_spec="concise")
        configs = {spec.tier: spec.config for spec in specs}
        assert set(configs) == {"trainer", "rollout", "reward"}
        assert isinstance(configs["trainer"], TrainerWorkerConfig) and isinstance(
            configs["rollout"], RolloutWorkerConfig
        )
        reward = RewardWorkerConfig.model_validate(configs["reward"])
        rollout = configs["rollout"]
        assert [configs["trainer"].model.trust_remote_code, rollout.loading.trust_remote_code,
                reward.loading.trust_remote_code] == [trusted] * 3  # fmt: skip
        for engine in (HFEngineSettings(type="hf"), VLLMEngineSettings(type="vllm")):
            settings = rollout.rollout.model_copy(update={"engine": engine})
            kwargs = engine_kwargs(rollout.model_copy(update={"rollout": settings}), "cpu")
            assert kwargs["trust_remote_code"] is trusted, engine


@pytest.mark.timeout(120)
def test_controller_tokenizer(remote_model: Path) -> None:
    with pytest.raises(ConfigError, match="ships its own Python code .* set trust_remote_code: true"):
        load_run_tokenizer(remote_model)
    assert type(load_run_tokenizer(remote_model, trust_remote_code=True)).__name__ == "RemoteTinyTokenizer"


@pytest.mark.timeout(120)
def test_hf_rollout_engine(remote_model: Path) -> None:
    from rlfleet.common.remote_code import refused_remote_code
    from rlfleet.rollout.engines.hf import HFEngine

    with pytest.raises(ValueError) as refused:
        HFEngine(remote_model)
    assert refused_remote_code(refused.value)
    engine = HFEngine(remote_model, trust_remote_code=True, seed=1)
    assert type(engine._model).__name__ == "RemoteTinyForCausalLM"
    done = engine.generate([[1, 20, 21]], SamplingParams(n=2, max_tokens=4))
    assert len(done) == 2 and all(1 <= len(c.token_ids) <= 4 for c in done)


@pytest.mark.timeout(120)
def test_trainer_actor_and_critic(remote_model: Path) -> None:
    from rlfleet.trainer.actor import Actor
    from rlfleet.trainer.critic import Critic
    from rlfleet.trainer.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="set trust_remote_code: true"):
        Actor(remote_model, ModelSettings())
    with pytest.raises(ModelLoadError, match="set trust_remote_code: true"):
        Critic(remote_model, ModelSettings())
    trusted = ModelSettings(trust_remote_code=True)
    actor = Actor(remote_model, trusted)
    assert type(actor.model).__name__ == "RemoteTinyForCausalLM"
    assert type(actor.reference()).__name__ == "RemoteTinyForCausalLM"
    assert type(Critic(remote_model, trusted).model.backbone).__name__ == "RemoteTinyModel"


@pytest.mark.timeout(120)
def test_reward_model(remote_model: Path) -> None:
    from rlfleet.reward import build_reward
    from rlfleet.reward.errors import RewardModelError
    from rlfleet.reward.loading import allow_remote_code

    spec = f"rm:path={remote_model},device=cpu,input=pair,label=1"
    with pytest.raises(RewardModelError, match="set trust_remote_code: true"):
        build_reward(spec)
    allow_remote_code(True)
    try:
        scores = build_reward(spec).score(["1+1?", "2+2?"], ["2", "4"]).total
    finally:
        allow_remote_code(False)
    assert len(scores) == 2 and all(isinstance(s, float) for s in scores)


def _train(venv_script, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess[str]:
    command = [venv_script("rlfleet"), "train", str(EXAMPLE), *overrides]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=360)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_rlfleet_train_runs_a_remote_code_model_only_when_trusted(
    remote_model: Path, venv_script, cli_env, tmp_path: Path, procs
) -> None:
    refused = _train(venv_script, cli_env, f"model.name={remote_model}", f"output_dir={tmp_path / 'no'}")
    assert refused.returncode == 2, refused.stderr[-3000:]
    reason = refused.stderr.strip().splitlines()[-1]  # after transformers' own warnings
    assert reason.startswith("rlfleet: ") and reason.endswith("true if you trust that code"), reason

    out = tmp_path / "yes"
    run = _train(venv_script, cli_env, f"model.name={remote_model}", "model.trust_remote_code=true",
                 "max_steps=2", f"output_dir={out}", "log_every=1")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert sum(line.startswith("[PROGRESS]") for line in run.stdout.splitlines()) == 2, run.stdout
    saved = json.loads((out / "final" / "config.json").read_text())
    assert saved["model_type"] == "rlfleet_remote_tiny"
    assert procs.survivors(procs.launched(out)) == []
