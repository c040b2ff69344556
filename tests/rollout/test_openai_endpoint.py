"""The rollout worker's OpenAI-compatible endpoint for agents (issue 33, point 4), on a real worker:
the HF engine with the tiny character model on CPU, a real nats-server, the endpoint opened by an
``AgentOpen`` as the controller sends it and called over HTTP (aiohttp's client).

Hostile requests are refused with OpenAI-style JSON errors naming the problem (a wrong or missing
key, malformed JSON, an oversized body, bad messages, ``n`` and ``max_tokens`` out of bounds, a
context over the session's cap), and the worker keeps serving. Two turns of one session are token in,
token out: the second request is conditioned on the first's prompt, its sampled tokens and only the
new message's tokens, and the collected batch holds exactly those tokens (loss_mask 1 on the sampled
ones, with the logprobs the replies gave). A request that rewrites the history starts a new segment;
the batch row is the last one. A session with no request becomes a masked filler row.
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from real_worker import running_worker  # (this folder's helper)
from transformers import AutoTokenizer

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import (
    AgentCollect,
    AgentOpen,
    AgentOpened,
    GenerateResult,
    SamplingParams,
)
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.schema.batch import LOSS_MASK, VERSIONS, check_rollout_tensors
from rlfleet.rollout.openai_endpoint import MAX_BODY_BYTES
from rlfleet.rollout.service import RolloutWorker

TOKEN = "test-token-" + "x" * 24
CHAT_TEMPLATE = (  # "<role> <content><eos>" per message: a template the character tokenizer can spell
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
_jobs = itertools.count()


@pytest.fixture
async def opened(
    nats: EmbeddedNats, control: NatsTransport, make_checkpoint, tmp_path: Path
) -> AsyncIterator[tuple[RolloutWorker, str]]:  # fmt: skip
    path = tmp_path / "chat"
    shutil.copytree(make_checkpoint(seed=0), path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    async with running_worker(nats.url, path, worker_id="rollout-agents") as worker:
        message = AgentOpen(token=TOKEN, sampling=SamplingParams(max_tokens=6, temperature=1.0),
                            max_sessions=4, max_session_tokens=120)  # fmt: skip
        reply = await control.request(worker.own_subject, message, timeout=30, tier="rollout")
        assert isinstance(reply, AgentOpened) and reply.url.endswith("/v1")
        again = await control.request(worker.own_subject, message, timeout=30, tier="rollout")
        assert isinstance(again, AgentOpened) and again.url == reply.url  # one endpoint per worker
        yield worker, reply.url


async def _post(url: str, body: Any, *, session: str | None = "s-0", key: str | None = TOKEN,
                raw: bytes | None = None) -> tuple[int, dict[str, Any]]:  # fmt: skip
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    if session is not None:
        headers["X-Session-Id"] = session
    async with aiohttp.ClientSession() as http:
        kwargs: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        async with http.post(f"{url}/chat/completions", headers=headers, **kwargs) as response:
            return response.status, await response.json(content_type=None)


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


async def _collect(
    control: NatsTransport, worker: RolloutWorker, prompts: list[list[int]], sessions: list[str],
    failed: list[bool] | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    failed = failed or [False] * len(sessions)
    message = AgentCollect(job_id=f"agents-{next(_jobs)}", prompt_token_ids=prompts, sessions=sessions,
                           rewards=[float(k + 1) for k in range(len(sessions))], failed=failed)  # fmt: skip
    reply = await control.request(worker.own_subject, message, timeout=30, tier="rollout")
    assert isinstance(reply, GenerateResult) and reply.num_samples == len(sessions)
    batch = worker.store.get_local(reply.ref.key)
    check_rollout_tensors(batch)
    return batch


@pytest.mark.timeout(60)
async def test_hostile_requests_are_refused_with_errors_that_name_the_problem(opened) -> None:  # noqa: ANN001
    worker, url = opened
    ok = {"messages": [_user("hi")]}
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"body": ok, "key": None}, 401, "API key"),
        ({"body": ok, "key": "wrong-" + "y" * 30}, 401, "API key"),
        ({"body": ok, "raw": b"{not json"}, 400, "not valid JSON"),
        ({"body": ok, "raw": b"[1, 2]"}, 400, "JSON object"),
        ({"body": ok, "raw": b"{" + b" " * (MAX_BODY_BYTES + 10) + b"}"}, 413, "bytes"),
        ({"body": ok, "session": None}, 400, "X-Session-Id"),
        ({"body": ok, "session": "bad session/id"}, 400, "X-Session-Id"),
        ({"body": {"messages": []}}, 400, "'messages'"),
        ({"body": {"messages": "hi"}}, 400, "'messages'"),
        ({"body": {"messages": [{"role": "wizard", "content": "x"}]}}, 400, "messages[0].role"),
        ({"body": {"messages": [_user("a"), {"role": "user", "content": 3}]}}, 400, "messages[1].content"),
        ({"body": {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}}, 400, "type 'text'"),
        ({"body": {**ok, "n": 2}}, 400, "'n' must be 1"),
        ({"body": {**ok, "max_tokens": 7}}, 400, "'max_tokens' must be an integer in 1..6"),
        ({"body": {**ok, "max_completion_tokens": 0}}, 400, "'max_completion_tokens'"),
        ({"body": {**ok, "stream": True}}, 400, "'stream'"),
        ({"body": {"messages": [_user("z" * 200)]}}, 400, "max_session_tokens=120"),
    ]
    for kwargs, status, words in cases:
        code, body = await _post(url, **kwargs)
        assert code == status, (kwargs.get("session"), body)
        assert words in body["error"]["message"], body
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/models", headers={"Authorization": f"Bearer {TOKEN}"}) as response:
            assert response.status == 200 and (await response.json())["data"][0]["object"] == "model"
        async with http.get(f"{url}/models") as response:
            assert response.status == 401
    code, body = await _post(url, ok)  # still serving
    assert code == 200 and body["choices"][0]["message"]["role"] == "assistant"
    sessions = [f"many-{k}" for k in range(4)]  # max_sessions=4, one ("s-0") is open
    codes = [(await _post(url, ok, session=s))[0] for s in sessions]
    assert codes == [200, 200, 200, 429]


@pytest.mark.timeout(60)
async def test_two_turns_are_token_in_token_out_and_the_batch_holds_the_recorded_tokens(
    opened, control: NatsTransport
) -> None:  # fmt: skip
    worker, url = opened
    tokenizer = worker.engine.tokenizer

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    code, first = await _post(url, {"messages": [_user("hi")], "logprobs": True}, session="two")
    assert code == 200, first
    prompt = ids("user hi<eos>assistant ")
    assert first["prompt_token_ids"] == prompt
    turn1 = first["choices"][0]["token_ids"]
    reply = first["choices"][0]["message"]["content"]
    messages = [_user("hi"), {"role": "assistant", "content": reply}, _user("more")]
    code, second = await _post(url, {"messages": messages, "logprobs": True}, session="two")
    assert code == 200, second
    delta = ids("<eos>user more<eos>assistant ")
    if turn1[-1] == tokenizer.eos_token_id:  # the model closed its turn: its <eos> is the template's
        delta = delta[1:]
    assert second["prompt_token_ids"] == prompt + turn1 + delta  # never a re-tokenised transcript
    turn2 = second["choices"][0]["token_ids"]

    batch = await _collect(control, worker, [prompt], ["two"])
    n = len(turn1) + len(delta) + len(turn2)
    assert batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist() == prompt
    assert batch["response_ids"][0, :n].tolist() == turn1 + delta + turn2
    assert batch[LOSS_MASK][0, :n].tolist() == [1] * len(turn1) + [0] * len(delta) + [1] * len(turn2)
    logprobs = [t["logprob"] for r in (first, second) for t in r["choices"][0]["logprobs"]["content"]]
    sampled = batch["rollout_logprobs"][0, :n][batch[LOSS_MASK][0, :n].bool()]
    assert sampled.tolist() == pytest.approx(logprobs, abs=0)
    assert batch[VERSIONS][0, :n].tolist() == [0] * len(turn1) + [-1] * len(delta) + [0] * len(turn2)
    assert batch["episode_reward"].tolist() == [1.0] and batch["episode_turns"].tolist() == [2]
    code, again = await _post(url, {"messages": messages}, session="two")  # collected: dropped
    assert code == 200 and again["prompt_token_ids"] == ids(
        "user hi<eos>assistant " + reply + "<eos>user more<eos>assistant "
    )


@pytest.mark.timeout(60)
async def test_a_rewritten_history_starts_a_new_segment_and_an_empty_session_is_a_masked_row(
    opened, control: NatsTransport
) -> None:  # fmt: skip
    worker, url = opened
    tokenizer = worker.engine.tokenizer
    code, first = await _post(url, {"messages": [_user("hi")]}, session="rw")
    assert code == 200
    rewritten = [_user("hi"), {"role": "assistant", "content": "not what you said"}, _user("more")]
    code, second = await _post(url, {"messages": rewritten}, session="rw")
    assert code == 200
    text = "user hi<eos>assistant not what you said<eos>user more<eos>assistant "
    fresh = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert second["prompt_token_ids"] == fresh  # rendered anew: a new segment
    turn2 = second["choices"][0]["token_ids"]
    prompt = tokenizer("user hi<eos>assistant ", add_special_tokens=False)["input_ids"]
    batch = await _collect(control, worker, [prompt], ["rw", "never-called"], failed=[False, True])
    assert batch["prompt_ids"][0][batch["prompt_mask"][0].bool()].tolist() == fresh  # the last segment
    assert batch["response_ids"][0, : len(turn2)].tolist() == turn2
    assert batch["episode_turns"].tolist() == [1, 0]
    assert batch["episode_reward"].tolist() == [1.0, 0.0]  # the failed agent's reward is 0
    assert batch["prompt_ids"][1][batch["prompt_mask"][1].bool()].tolist() == prompt
    assert batch[LOSS_MASK][1].sum().item() == 0 and batch["response_mask"][1].sum().item() == 1
