"""TRL habits through a real tiny run (issue 35, point 5): chat prompts from a list of dicts, two reward
functions with weights (the TRL-form one gets messages), a warm-up and cosine schedule whose rate the
trainer reports as ``lr`` each step, callbacks (one that raises), and a resume from a checkpoint that
continues the schedule where it stood.

Tiny GRPO on CPU (HF engine, seed 0) through real processes: three steps with ``save_every=2``, then a
fresh run resumed from ``checkpoint-2`` for the third step again; held-out rows in memory
(``eval_dataset``) evaluated before the first step and after the last.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
ROWS = [{"prompt": [{"role": "user", "content": f"{i} {i + 1} ->"}], "answer": str(i)} for i in range(8)]
STEPS = 3
BASE_LR = 0.003


def run(model_dir: Path, out: Path, seen: list[Any], events: list[Any], resume: str | None = None) -> Any:
    from rlfleet.controller import GRPOTrainer, TrainerConfig
    from rlfleet.controller.callbacks import TrainerCallback

    def digits(prompts: list[Any], completions: list[Any], answer: list[str], **kw: Any) -> list[float]:
        seen.append((prompts, completions, answer))
        return [sum(ch.isdigit() for ch in c[0]["content"]) / 8 for c in completions]

    def length(text: str) -> float:
        return float(len(text))

    class Recorder(TrainerCallback):
        def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
            events.append(("step", step))

        def on_save(self, step: int, path: Path) -> None:
            events.append(("save", step, path.name))

        def on_evaluate(self, step: int, metrics: dict[str, float]) -> None:
            events.append(("eval", step, metrics["eval/prompts"]))

    class Broken(TrainerCallback):
        def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
            raise RuntimeError("a callback's bug")

    config = TrainerConfig(
        rollout_batch_size=4, train_batch_size=4, micro_batch_size=64, group_size=2, max_prompt_length=48,
        max_response_length=6, learning_rate=BASE_LR, kl_coef=0.0, seed=0, output_dir=str(out),
        loggers=["jsonl"], sample_table_size=0, save_every=2, device="cpu", chat_template=CHAT_TEMPLATE,
        lr_schedule={"type": "cosine", "warmup_steps": 1}, resume_from=resume, eval={"max_tokens": 6},
    )  # fmt: skip
    trainer = GRPOTrainer(str(model_dir), [digits, length], ROWS, config, reward_weights=[1.0, 0.5],
                          callbacks=[Broken(), Recorder()], eval_dataset=ROWS[:2])  # fmt: skip
    return trainer.train(num_epochs=2, max_steps=STEPS)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_chat_rewards_with_weights_a_schedule_and_callbacks_in_a_real_run(
    tmp_path: Path, tiny_model_dir: Path, procs: Any
) -> None:
    from rlfleet.controller.lr_schedule import LRSchedule

    seen: list[Any] = []
    events: list[Any] = []
    results = run(tiny_model_dir, tmp_path / "run", seen, events)
    assert [r.step for r in results] == [1, 2, 3], "a callback that raises stops nothing"
    rows = {r["prompt"][0]["content"]: r for r in ROWS}
    for prompts, completions, answers in seen:
        assert all(p in [r["prompt"] for r in ROWS] for p in prompts), "chat prompts arrive as messages"
        assert all(c[0]["role"] == "assistant" and isinstance(c[0]["content"], str) for c in completions)
        assert answers == [rows[p[0]["content"]]["answer"] for p in prompts]
    for result in results:
        m = result.metrics
        assert m["reward/mean"] == pytest.approx(m["reward/digits"] + 0.5 * m["reward/length"], rel=1e-6)
    last = [len(c[0]["content"]) for c in [call for call in seen if len(call[1]) == 8][-1][1]]  # not eval's
    assert results[-1].metrics["reward/length"] == pytest.approx(statistics.fmean(last))
    schedule = [BASE_LR * LRSchedule(type="cosine", warmup_steps=1).factor(s, STEPS) for s in range(STEPS)]
    assert [r.metrics["lr"] for r in results] == pytest.approx(schedule, rel=1e-6)
    assert schedule[1] > schedule[2] > 0, "cosine decays after the warm-up"
    assert events == [("step", 1), ("eval", 0, 2.0), ("step", 2), ("save", 2, "checkpoint-2"), ("step", 3),
                      ("save", 3, "final"), ("eval", 3, 2.0)]  # fmt: skip

    resumed = run(tiny_model_dir, tmp_path / "run", [], [], resume=str(tmp_path / "run" / "checkpoint-2"))
    assert [r.step for r in resumed] == [3]
    assert resumed[0].metrics["lr"] == pytest.approx(schedule[2], rel=1e-6), (
        "the schedule goes on where it was"
    )
    assert procs.survivors(procs.launched(tmp_path / "run")) == []
