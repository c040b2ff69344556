"""Bring your own agent (issue 33, point 4), through real processes: a tiny GRPO run (library use: a
private nats-server, a trainer, a reward worker and a rollout worker) whose rollouts are episodes of
an agent written with the ``openai`` client. The agent talks to the rollout worker's OpenAI-compatible
endpoint in two turns (a question, then a follow-up extending the conversation) and returns a reward;
the run scores with the ``episode`` rule (the agent's reward) and trains.

Checked: every row of every step's batch, as the trainer fetches it from the rollout worker, holds
exactly the tokens the endpoint answered the agent (its second turn's prompt is the first turn's
prompt, sampled tokens and only the follow-up's tokens; loss_mask 1 exactly on the sampled ones); in
float32 the trainer's logprobs of those tokens equal the engine's (``rollout_logprob_diff``); a failing
agent costs its sample reward 0, never the run; the step metrics carry the agents' rewards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "tiny_digits.jsonl"
BATCH, GROUP, STEPS = 2, 4, 2


def _agent(seen: dict[str, list[dict[str, Any]]]) -> Any:
    def agent(base_url: str, api_key: str, session_id: str, item: dict[str, Any]) -> float:
        from openai import OpenAI

        if session_id.endswith(":1:3"):
            raise RuntimeError("this agent fails on purpose")
        client = OpenAI(base_url=base_url, api_key=api_key, default_headers={"X-Session-Id": session_id},
                        max_retries=0)  # fmt: skip
        messages: list[dict[str, Any]] = [{"role": "user", "content": str(item["prompt"])}]
        replies = []
        for follow_up in ("more", None):
            out = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)  # type: ignore[arg-type]
            replies.append(out.model_dump())
            text = out.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})
        seen[session_id] = replies
        return float(sum(ch.isdigit() for ch in messages[-1]["content"]))

    return agent


@pytest.mark.timeout(300)
def test_an_openai_client_agent_trains_on_exactly_the_recorded_tokens(tmp_path: Path, tiny_model_dir: Path,
                                                                       procs: Any) -> None:  # fmt: skip
    from rlfleet.controller import GRPOTrainer, TrainerConfig

    config = TrainerConfig(
        rollout_batch_size=BATCH, train_batch_size=BATCH, micro_batch_size=64, group_size=GROUP,
        max_prompt_length=32, max_response_length=4, learning_rate=0.003, kl_coef=0.0, seed=0,
        output_dir=str(tmp_path), loggers=["jsonl"], sample_table_size=0, device="cpu",
        model={"mixed_precision": "none"},
    )  # fmt: skip
    trainer = GRPOTrainer(str(tiny_model_dir), "episode", str(DATA), config)
    seen: dict[str, list[dict[str, Any]]] = {}
    trainer.set_agent(_agent(seen))
    agent = trainer.online_step.router.agent
    assert agent is not None
    batches: list[dict[str, Any]] = []
    try:
        trainer.start()
        generate = agent.generate

        async def recorded(*args: Any, **kwargs: Any) -> Any:
            results = await generate(*args, **kwargs)
            for result in results:  # the batch as the trainer will fetch it
                batches.append(await _fetch(trainer, result.ref))
            return results

        agent.generate = recorded  # type: ignore[method-assign]
        for _ in trainer.steps(num_epochs=1, max_steps=STEPS):
            pass
        pids = trainer.process_ids
    finally:
        trainer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert all(row["rollout_logprob_diff"] < 1e-5 for row in rows), [r["rollout_logprob_diff"] for r in rows]
    assert agent.failed == STEPS  # the one failing session per step; the run went on
    assert len(batches) == STEPS
    checked = 0
    for step, batch in enumerate(batches):
        for row in range(BATCH * GROUP):
            session = f"agent-{agent.tag}-{step + 1}:{row // GROUP}:{row % GROUP}"
            if session.endswith(":1:3"):
                assert batch["loss_mask"][row].sum().item() == 0 and batch["episode_reward"][row].item() == 0
                continue
            first, second = seen[session]
            turn1, turn2 = first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]
            prompt = first["prompt_token_ids"]
            assert (
                second["prompt_token_ids"][: len(prompt) + len(turn1)] == prompt + turn1
            )  # token in, token out
            delta = second["prompt_token_ids"][len(prompt) + len(turn1) :]
            n = len(turn1) + len(delta) + len(turn2)
            assert batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist() == prompt
            assert (
                batch["response_ids"][row][batch["response_mask"][row].bool()].tolist()
                == turn1 + delta + turn2
            )
            assert batch["loss_mask"][row, :n].tolist() == [1] * len(turn1) + [0] * len(delta) + [1] * len(
                turn2
            )
            reward = float(sum(ch.isdigit() for ch in second["choices"][0]["message"]["content"]))
            assert batch["episode_reward"][row].item() == reward
            checked += 1
    assert checked == STEPS * (BATCH * GROUP - 1)
    assert procs.survivors(pids) == []


async def _fetch(trainer: Any, ref: Any) -> dict[str, Any]:
    """The batch ``ref`` names, fetched over gRPC with the ref's capability (as the trainer does)."""
    from rlfleet.common.tensors.store import ClientPool

    clients = ClientPool(trainer.config.tensor_plane)
    try:
        return await clients.fetch(ref)
    finally:
        await clients.close()
