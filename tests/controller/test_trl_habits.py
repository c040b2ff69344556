"""What a TRL user does, working as they expect (issue 35, point 5): chat-shaped completions for chat
prompts, a list of reward functions with weights, a learning-rate schedule with warm-up, datasets in
memory, and callbacks on step end, evaluation and save. The run's step loop runs against an
in-memory fleet (``fake_fleet``); the reward functions against the real tensor plane."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.common.control.messages import GenerateResult
from rlfleet.common.schema.batch import pack_texts
from rlfleet.common.schema.config import load_config
from rlfleet.common.schema.worker import TensorPlaneSettings
from rlfleet.controller import GRPOTrainer, PromptDataset, TrainerConfig
from rlfleet.controller.callbacks import Callbacks, TrainerCallback, eval_metrics
from rlfleet.controller.config import JobConfig
from rlfleet.controller.dataset import chat_prompts, prompt_dataset
from rlfleet.controller.errors import DatasetError
from rlfleet.controller.lr_schedule import LearningRates, LRSchedule
from rlfleet.controller.models import resolve_model
from rlfleet.controller.online import reward_metrics
from rlfleet.controller.own_store import OwnStore
from rlfleet.controller.python_reward import PythonReward, PythonRewards, reward_of, run_weights
from rlfleet.controller.python_scorer import PythonScorer
from rlfleet.controller.request_policy import Deadlines

pytestmark = pytest.mark.timeout(60)

CHAT_ROWS = [
    {"prompt": [{"role": "system", "content": "answer in digits"}, {"role": "user", "content": "2+2?"}],
     "answer": "4"},
    {"prompt": [{"role": "user", "content": "3+4?"}], "answer": "7"},
]  # fmt: skip
DIGIT_ROWS = [{"prompt": f"q: {i} {i + 1} ->", "answer": str(i)} for i in range(8)]


# --- 1. chat-shaped completions ---------------------------------------------------------------------


def decoded_chunk(tokenizer: Any, dataset: PromptDataset) -> tuple[list[str], list[int]]:
    """Each prompt's text as a rollout worker writes it (decoded, no special tokens), two samples each."""
    texts = tokenizer.batch_decode(
        [dataset[i].token_ids for i in range(len(dataset))], skip_special_tokens=True
    )
    groups = [g for g in range(len(texts)) for _ in range(2)]
    return [texts[g] for g in groups], groups


async def score_chunk(reward: PythonReward, prompts: list[str], responses: list[str], groups: list[int],
                      metadata: list[dict[str, Any]]) -> Any:  # fmt: skip
    """``reward`` over one chunk in the run's own store, as the controller scores it."""
    store = OwnStore(TensorPlaneSettings(), listen_all=False)
    try:
        tensors: dict[str, torch.Tensor] = {"group_index": torch.tensor(groups, dtype=torch.int64)}
        tensors["prompt_text"], tensors["prompt_text_offsets"] = pack_texts(prompts)
        tensors["response_text"], tensors["response_text_offsets"] = pack_texts(responses)
        ref = (await store.get()).put_local("rollout/test/chunk", tensors)
        result = GenerateResult(job_id="g", worker_id="rollout-0", weight_version=0, ref=ref,
                                num_prompts=len(metadata), num_samples=len(responses))  # fmt: skip
        scorer = PythonScorer(reward, "default", "v-r0", store, Deadlines(30.0))
        return (await scorer.score([result], [metadata], ["s-1"]))[0]
    finally:
        await store.stop()


def test_a_trl_reward_gets_messages_for_chat_prompts_and_the_other_forms_keep_texts(
    chat_tokenizer: Any,
) -> None:
    dataset = PromptDataset(CHAT_ROWS, 64, tokenizer=chat_tokenizer)
    chats = chat_prompts([dataset[i] for i in range(len(dataset))], chat_tokenizer)
    prompts, groups = decoded_chunk(chat_tokenizer, dataset)
    responses = ["4", "five", "7", "seven"]
    seen: dict[str, Any] = {}

    def trl_reward(
        prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any
    ) -> list[float]:
        seen.update(prompts=prompts, completions=completions, answer=answer)
        return [float(c[0]["content"] == a) for c, a in zip(completions, answer, strict=True)]

    texts: list[tuple[str, str]] = []
    reward = PythonReward(trl_reward)
    reward.chats = chats
    reply = asyncio.run(
        score_chunk(reward, prompts, responses, groups, [{"answer": r["answer"]} for r in CHAT_ROWS])
    )
    assert reply.scores == [1.0, 0.0, 1.0, 0.0]
    assert seen["completions"] == [[{"role": "assistant", "content": r}] for r in responses]
    assert seen["prompts"] == [CHAT_ROWS[g]["prompt"] for g in groups], "TRL's prompts are the row's messages"
    assert seen["answer"] == ["4", "4", "7", "7"]

    per_sample = PythonReward(lambda prompt, response: texts.append((prompt, response)) or 0.0)
    per_sample.chats = chats
    asyncio.run(score_chunk(per_sample, prompts, responses, groups, [{}, {}]))
    assert texts == list(zip(prompts, responses, strict=True)), "rlfleet's own forms keep the texts"


def test_text_prompts_stay_strings_for_a_trl_reward(char_tokenizer: Any) -> None:
    dataset = PromptDataset(DIGIT_ROWS[:2], 64, tokenizer=char_tokenizer)
    assert chat_prompts([dataset[0], dataset[1]], char_tokenizer) == {}
    got: list[Any] = []
    reward = PythonReward(
        lambda prompts, completions, **kw: got.extend(completions) or [0.0] * len(completions)
    )
    reward(["q: 0 1 ->"], ["01"], [{}])
    assert got == ["01"]


# --- 2. a list of reward functions with weights ------------------------------------------------------


def has_digit(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


def length(prompt: str, response: str) -> float:
    return float(len(response))


def test_reward_functions_sum_with_their_weights_and_each_is_a_component() -> None:
    prompts, responses = ["p", "p", "q"], ["a1", "bbb", ""]
    reward = reward_of([has_digit, length], [1.0, 0.5])
    assert isinstance(reward, PythonRewards) and reward.names == ["has_digit", "length"]
    totals, components = reward.scored(prompts, responses, [{}, {}, {}])
    assert components == {"has_digit": [1.0, 0.0, 0.0], "length": [2.0, 3.0, 0.0]}
    assert totals == [2.0, 1.5, 0.0]
    reply = asyncio.run(score_chunk(reward, prompts, responses, [0, 0, 1], [{}, {}]))
    assert reply.scores == totals and reply.components == components
    metrics = reward_metrics(reply.scores, [reply])
    assert metrics["reward/has_digit"] == pytest.approx(1 / 3) and metrics["reward/length"] == pytest.approx(
        5 / 3
    )
    assert metrics["reward/mean"] == pytest.approx(3.5 / 3), "the total is the weighted sum"
    assert reward.description.startswith("<python function ") and "0.5*" in reward.description


def test_component_names_never_shadow_the_step_metrics_and_repeats_are_numbered() -> None:
    def mean(completions: list[str], **kw: Any) -> list[float]:
        return [0.0] * len(completions)

    reward = PythonRewards([mean, has_digit, has_digit, lambda text: 1.0])
    assert reward.names == ["mean_fn", "has_digit", "has_digit_2", "lambda"]


def test_reward_lists_and_weights_are_checked() -> None:
    assert reward_of(["charset:allowed=0123456789", "concise"], [1.0, -0.5]) == (
        "1.0*charset:allowed=0123456789 + -0.5*concise"
    )
    assert reward_of("concise") == "concise"
    with pytest.raises(ValueError, match="not a mix"):
        reward_of([has_digit, "concise"])
    with pytest.raises(ValueError, match="one weight each"):
        reward_of([has_digit, length], [1.0])
    with pytest.raises(ValueError, match="need a list of rewards"):
        reward_of(has_digit, [1.0])
    with pytest.raises(ValueError, match="one component"):
        reward_of(["concise + numeric"])
    with pytest.raises(ValueError, match="differs from the config"):
        run_weights([1.0, 2.0], [1.0, 0.5])
    assert run_weights(None, [1.0, 0.5]) == [1.0, 0.5] == run_weights([1, 0.5], [1.0, 0.5])


def test_the_job_file_takes_a_reward_list_and_its_weights(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(
        "model: tiny:digits\ndata: {path: prompts.jsonl}\n"
        "reward: {spec: ['mymod:fn', concise], weights: [1.0, 0.5]}\n"
        "lr_schedule: {type: cosine, warmup_ratio: 0.1}\n"
    )
    config = load_config(JobConfig, job)
    assert config.reward.spec == ["mymod:fn", "concise"] and config.reward.weights == [1.0, 0.5]
    assert config.trainer_config().reward.weights == [1.0, 0.5]
    assert config.lr_schedule.type == "cosine" and config.lr_schedule.warmup_ratio == 0.1


# --- 3. the learning-rate schedule -------------------------------------------------------------------


def test_schedules_warm_up_then_decay_and_never_reach_zero() -> None:
    rates = [LRSchedule(type="cosine", warmup_steps=2).factor(s, 6) for s in range(6)]
    assert rates[:2] == [0.5, 1.0]
    assert rates[2:] == pytest.approx([0.5 * (1 + math.cos(math.pi * p / 4)) for p in range(4)])
    linear = [LRSchedule(type="linear", min_lr_ratio=0.1).factor(s, 4) for s in range(5)]
    assert linear == pytest.approx([1.0, 0.775, 0.55, 0.325, 0.325]), "past the total: the last step's"
    assert min(linear) > 0.1
    assert [LRSchedule(warmup_ratio=0.25).factor(s, 8) for s in range(3)] == [0.5, 1.0, 1.0]
    assert LRSchedule(type="cosine").factor(3, 0) == 1.0, "no total known: no decay"
    with pytest.raises(ValueError, match="not both"):
        LRSchedule(warmup_steps=2, warmup_ratio=0.1)
    assert TrainerConfig(lr_schedule="linear").lr_schedule.type == "linear"  # type: ignore[arg-type]


# --- 4. datasets in memory ---------------------------------------------------------------------------


def test_a_list_of_dicts_and_a_datasets_dataset_are_datasets(char_tokenizer: Any) -> None:
    import datasets

    rows = [dict(row) for row in DIGIT_ROWS]
    from_list = PromptDataset(rows, 64, tokenizer=char_tokenizer, seed=3)
    rows[0]["prompt"] = "changed later"  # the rows were copied when read
    from_hf = PromptDataset(datasets.Dataset.from_list(DIGIT_ROWS), 64, tokenizer=char_tokenizer, seed=3)
    assert [from_list[i].text for i in range(8)] == [from_hf[i].text for i in range(8)]
    assert from_list[0].text == "q: 0 1 ->" and from_list[0].metadata == {"answer": "0"}
    assert [i.index for i in from_list.next_batch(4)] == [i.index for i in from_hf.next_batch(4)]
    assert "<list of 8 rows>" in repr(from_list) and "<Dataset of 8 rows>" in repr(from_hf)
    assert prompt_dataset(DIGIT_ROWS, 16, 0).max_prompt_length == 16
    with pytest.raises(DatasetError, match=r"<list of 1 rows>: row 0 has no 'prompt' column"):
        PromptDataset([{"question": "x"}])
    with pytest.raises(DatasetError, match="row 1 is a str"):
        PromptDataset([{"prompt": "x"}, "y"])
    with pytest.raises(DatasetError, match="has no 'prompt' column"):
        PromptDataset(datasets.Dataset.from_list([{"question": "x"}]))
    with pytest.raises(TypeError, match="a list of dicts or a datasets.Dataset"):
        prompt_dataset(42, 16, 0)


# --- 5. callbacks ------------------------------------------------------------------------------------


def test_a_callback_that_raises_is_logged_and_the_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    got: list[Any] = []

    class Broken(TrainerCallback):
        def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
            raise RuntimeError("boom")

    class Keeper:  # any object with a hook will do
        def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
            metrics["mine"] = 1.0  # its own copy
            got.append((step, metrics))

    callbacks = Callbacks([Broken, Keeper()])
    metrics = {"loss": 0.5}
    with caplog.at_level(logging.ERROR, logger="rlfleet.controller.callbacks"):
        callbacks.step_end(3, metrics)
    assert got == [(3, {"loss": 0.5, "mine": 1.0})] and metrics == {"loss": 0.5}
    assert "Broken.on_step_end raised at step 3" in caplog.text and "RuntimeError: boom" in caplog.text
    with pytest.raises(TypeError, match="at least one of the methods"):
        callbacks.add(object())
    assert eval_metrics({"prompts": 4, "mean_words": 2.5, "rewards": {"concise": 0.3}, "pass@1": None}) == {
        "eval/prompts": 4.0, "eval/mean_words": 2.5, "eval/rewards/concise": 0.3,
    }  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_model("tiny:digits", cache_dir=tmp_path_factory.mktemp("models"))


def test_grpo_steps_carry_the_scheduled_rate_and_tell_the_callbacks(
    model_dir: Path, tmp_path: Path, fake_fleet: Any, attach_fleet: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    events: list[tuple[str, int, Any]] = []

    class Recorder(TrainerCallback):
        def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
            events.append(("step", step, metrics["kl_coef"]))

        def on_save(self, step: int, path: Path) -> None:
            events.append(("save", step, path.name))

    config = TrainerConfig(rollout_batch_size=4, train_batch_size=4, group_size=2, learning_rate=1e-3,
                           lr_schedule={"type": "linear", "warmup_steps": 2}, output_dir=str(tmp_path),
                           loggers=["jsonl"], sample_table_size=0, save_every=2,
                           reward={"weights": [1.0, 0.5]})  # fmt: skip
    trainer = GRPOTrainer(str(model_dir), [has_digit, length], DIGIT_ROWS, config, callbacks=[Recorder()])
    assert isinstance(trainer.fleet_run.reward.python, PythonRewards)  # type: ignore[union-attr]
    fleet = attach_fleet(trainer, fake_fleet())
    monkeypatch.setattr(trainer.fleet_run, "save_checkpoint", lambda path: path)  # the fake saves nothing
    try:
        assert [r.step for r in trainer.steps(num_epochs=2, max_steps=4)] == [1, 2, 3, 4]
    finally:
        trainer.close()
    sent = [r.settings.update.learning_rate for r in fleet.train_requests]
    expected = [1e-3 * LRSchedule(type="linear", warmup_steps=2).factor(s, 4) for s in range(4)]
    assert sent == pytest.approx(expected) and sent == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4])
    assert LearningRates(config).at(3) == pytest.approx(1e-3), "a rate needs the run's length: set by steps()"
    assert events == [("step", 1, 0.05), ("step", 2, 0.05), ("save", 2, "checkpoint-2"), ("step", 3, 0.05),
                      ("step", 4, 0.05), ("save", 4, "checkpoint-4")]  # fmt: skip


def test_held_out_rows_in_memory_become_the_runs_eval_data_and_its_evaluations_reach_the_callbacks(
    model_dir: Path, tmp_path: Path
) -> None:
    told: list[tuple[int, dict[str, float]]] = []

    class Evaluated(TrainerCallback):
        def on_evaluate(self, step: int, metrics: dict[str, float]) -> None:
            told.append((step, metrics))

    config = TrainerConfig(rollout_batch_size=4, train_batch_size=4, group_size=2, output_dir=str(tmp_path),
                           loggers=["jsonl"], sample_table_size=2)  # fmt: skip
    trainer = GRPOTrainer(str(model_dir), has_digit, DIGIT_ROWS, config, eval_dataset=DIGIT_ROWS[:3])
    trainer.add_callback(Evaluated)
    try:
        written = Path(trainer.config.eval.data or "")
        assert written == tmp_path / "eval_data.jsonl" and len(written.read_text().splitlines()) == 3
        assert trainer.fleet_run.evals is not None and len(trainer.fleet_run.evals.table.items) == 3
        # what RunEval records after an evaluation, told to the callbacks once
        trainer.fleet_run.evals.records.append({"step": 0, "summary": {"prompts": 3, "rewards": {"r": 0.5}}})
        trainer._tell_evaluations()
        trainer._tell_evaluations()
        assert told == [(0, {"eval/prompts": 3.0, "eval/rewards/r": 0.5})]
    finally:
        trainer.close()
    with pytest.raises(ValueError, match="set one"):
        GRPOTrainer(str(model_dir), has_digit, DIGIT_ROWS, TrainerConfig(eval={"data": "x.jsonl"}),
                    eval_dataset=DIGIT_ROWS)  # fmt: skip
