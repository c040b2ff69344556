"""Multi-turn episodes (issue 33) on a real rollout worker: the HF engine with the tiny character
model on CPU, a real nats-server, and :class:`CountingEnv`, an environment served in this test on the
subjects the reward tier's environment service listens on (``env.reset`` in a queue group, then the
worker's own subject). Each batch is checked token for token: the model's sampled turns (loss_mask 1,
the logprobs a teacher-forced forward pass gives), the observations the test expects between them
(loss_mask 0, NaN logprobs), the episode fields; the turn limit and the token cap stop episodes;
failing environments end only their episode; a job past its deadline fails as any job."""

from __future__ import annotations

import asyncio
import itertools
import math
import shutil
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from real_worker import WORKER_CLUSTER, running_worker  # (this folder's helper)
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import (
    Ack,
    AnyMessage,
    EnvClose,
    EnvObservation,
    EnvReset,
    EnvStep,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
)
from rlfleet.common.control.messages.rollout import EpisodeSpec
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import TOKEN_HEADER, episode_subject, request_headers, subject
from rlfleet.common.errors import RemoteError, RemoteUserError
from rlfleet.common.schema.batch import EPISODE_ENDS, LOSS_MASK, VERSIONS, check_rollout_tensors
from rlfleet.common.schema.rollout import GenerateLimits
from rlfleet.rollout.chat_turns import ChatTurns
from rlfleet.rollout.episodes import EnvClient, Episode
from rlfleet.rollout.errors import EnvRefused, GenerateTooLarge, InvalidPrompt
from rlfleet.rollout.service import RolloutWorker, check_products

ENV_WORKER = "env-0"
HANG_S = 3.0
ROLES = ("tool", "user")
EOS_ID = 1
CHAT_TEMPLATE = (  # a template the character tokenizer can spell: "<role> <content><eos>" per message
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


class Refused(PermissionError):
    """What a reward server answers a tenant it refuses (its ErrorReply's code)."""

    code = "forbidden_endpoint"


class CountingEnv:
    """A trivial deterministic environment. An episode lasts ``item["turns"]`` steps: every step but the
    last answers ``seen <N> chars, turn <k>.`` (N: the characters of the model's turn) as a ``tool``
    turn, then a ``user`` turn, alternately; the last says done with ``item["reward"]``. ``item["mode"]``:
    ``error`` (a step fails), ``hang`` (a step answers after HANG_S), ``ghost`` (the reset names a
    worker nobody serves), ``long`` (300-character observations), ``refuse`` (the reset is refused as
    a reward server refuses a tenant). Each reset's credential header is kept in ``tokens``."""

    def __init__(self) -> None:
        self.resets: dict[str, EnvReset] = {}
        self.actions: dict[str, list[str]] = defaultdict(list)
        self.sent: dict[str, list[EnvObservation]] = defaultdict(list)
        self.closed: list[str] = []
        self.tokens: list[str | None] = []

    async def reset(self, message: AnyMessage) -> EnvObservation:
        assert isinstance(message, EnvReset)
        self.tokens.append(request_headers().get(TOKEN_HEADER))
        if message.item.get("mode") == "refuse":
            raise Refused("tenant 'team-b' may not use environment 'counter'")
        self.resets[message.episode_id] = message
        worker = "ghost" if message.item.get("mode") == "ghost" else ENV_WORKER
        return EnvObservation(episode_id=message.episode_id, worker_id=worker)

    async def own(self, message: AnyMessage) -> EnvObservation | Ack:
        if isinstance(message, EnvClose):
            self.closed.append(message.episode_id)
            return Ack()
        assert isinstance(message, EnvStep)
        item = self.resets[message.episode_id].item
        self.actions[message.episode_id].append(message.action)
        if item.get("mode") == "error":
            raise ValueError("the calculator broke")
        if item.get("mode") == "hang":
            await asyncio.sleep(HANG_S)
        turn = len(self.actions[message.episode_id])
        if turn >= item["turns"]:
            return EnvObservation(episode_id=message.episode_id, worker_id=ENV_WORKER, reward=item["reward"],
                                  done=True, info={"tool_calls": 1})  # fmt: skip
        text = "x" * 300 if item.get("mode") == "long" else f"seen {len(message.action)} chars, turn {turn}."
        reply = EnvObservation(episode_id=message.episode_id, worker_id=ENV_WORKER, observation=text,
                               role=ROLES[(turn - 1) % 2],
                               info={"tool_calls": 1, "malformed_calls": float(turn == 1)})  # fmt: skip
        self.sent[message.episode_id].append(reply)
        return reply


@pytest.fixture
async def env(nats: EmbeddedNats) -> AsyncIterator[CountingEnv]:
    transport = await NatsTransport.connect(nats.url, name="env", tier="reward")
    served = CountingEnv()
    await transport.subscribe(subject(WORKER_CLUSTER, "env", "reset"), served.reset, queue="reward")
    await transport.subscribe(episode_subject(WORKER_CLUSTER, ENV_WORKER), served.own)
    try:
        yield served
    finally:
        await transport.close()


_jobs = itertools.count()


async def _run(
    control: NatsTransport, worker: RolloutWorker, prompts: list[str], items: list[dict[str, Any]],
    sampling: SamplingParams, **spec: Any,
) -> tuple[GenerateRequest, GenerateResult, dict[str, torch.Tensor]]:  # fmt: skip
    tokenizer = worker.engine.tokenizer
    request = GenerateRequest(
        job_id=f"episodes-{next(_jobs)}", sampling=sampling,
        prompt_token_ids=[tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts],
        episode=EpisodeSpec(env="counter", items=items, **spec),
    )  # fmt: skip
    reply = await control.request(worker.own_subject, request, timeout=60, tier="rollout")
    assert isinstance(reply, GenerateResult)
    batch = worker.store.get_local(reply.ref.key)
    check_rollout_tensors(batch)
    return request, reply, batch


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, value) of each run of equal values in ``mask``."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, mask[start]))
            start = i
    return out


def _teacher_forced(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log_softmax(logits) of each response token from one unpadded forward pass: (R,)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _check_row(
    batch: dict[str, torch.Tensor], row: int, prompt: list[int], env: CountingEnv, episode_id: str,
    model: torch.nn.Module, tokenizer: Any, expected_observation: Any,
) -> list[tuple[int, int, int]]:  # fmt: skip
    """Check one row token for token; ``expected_observation(reply, turn)`` gives an observation's tokens
    after the model turn ``turn`` (its ids). Returns the row's runs of loss_mask."""
    length = int(batch["response_mask"][row].sum())
    response = batch["response_ids"][row, :length].tolist()
    mask = batch[LOSS_MASK][row, :length].tolist()
    assert batch[LOSS_MASK][row, length:].sum() == 0
    runs = _runs(mask)
    turns = [response[a:b] for a, b, v in runs if v == 1]
    observations = [response[a:b] for a, b, v in runs if v == 0]
    assert [v for _, _, v in runs] == [1, 0] * len(observations) + [1]  # model, observation, ..., model
    assert [tokenizer.decode(t, skip_special_tokens=True) for t in turns] == env.actions[episode_id]
    for k, ids in enumerate(observations):
        assert ids == expected_observation(env.sent[episode_id][k], turns[k]), f"observation {k}"
    logprobs = batch["rollout_logprobs"][row, :length]
    sampled = torch.tensor(mask, dtype=torch.bool)
    assert torch.isnan(logprobs[~sampled]).all() and not torch.isnan(logprobs[sampled]).any()
    forced = _teacher_forced(model, prompt, response)
    torch.testing.assert_close(logprobs[sampled], forced[sampled], atol=1e-4, rtol=0)
    assert batch[VERSIONS][row, :length].tolist() == [0 if m else -1 for m in mask]
    assert int(batch["episode_turns"][row]) == len(turns)
    return runs


def _plain(reply: EnvObservation, tokenizer: Any) -> list[int]:
    return tokenizer(f"\n{reply.role}: {reply.observation}\n", add_special_tokens=False)["input_ids"]


@pytest.mark.timeout(90)
async def test_an_episode_interleaves_sampled_turns_and_observations(
    worker: RolloutWorker, env: CountingEnv, control: NatsTransport, make_checkpoint
) -> None:  # fmt: skip
    items = [{"turns": 3, "reward": 1.5}, {"turns": 2, "reward": 0.5}]
    sampling = SamplingParams(n=2, max_tokens=6, temperature=1.0, seed=11)
    request, reply, batch = await _run(control, worker, ["hello", "The quick"], items, sampling,
                                       max_turns=4, max_episode_tokens=200, env_timeout_s=10)  # fmt: skip
    tokenizer = worker.engine.tokenizer
    model = AutoModelForCausalLM.from_pretrained(make_checkpoint(seed=0)).eval()
    ids = [f"{request.job_id}:{p}:{s}" for p in range(2) for s in range(2)]
    assert sorted(env.resets) == sorted(ids)
    assert env.closed == []  # every episode ended done: the environment dropped them itself
    for row, episode_id in enumerate(ids):
        prompt, item = request.prompt_token_ids[row // 2], items[row // 2]
        assert env.resets[episode_id].item == item
        _check_row(batch, row, prompt, env, episode_id, model, tokenizer, lambda r, _: _plain(r, tokenizer))
        assert int(batch["episode_turns"][row]) == item["turns"]
    assert env.resets[ids[0]].seed == env.resets[ids[1]].seed != env.resets[ids[2]].seed  # a group: one env
    assert batch["group_index"].tolist() == [0, 0, 1, 1]
    assert batch["episode_reward"].tolist() == [1.5, 1.5, 0.5, 0.5]
    assert batch["episode_end"].tolist() == [EPISODE_ENDS.index("done")] * 4
    assert batch["episode_tool_calls"].tolist() == [3, 3, 2, 2]
    assert batch["episode_tool_errors"].tolist() == [1, 1, 1, 1]  # the first step's malformed call
    assert (batch["episode_env_s"] > 0).all() and batch["episode_obs_cut"].tolist() == [0] * 4
    assert reply.num_samples == 4 and reply.num_tokens == int(batch[LOSS_MASK].sum())
    assert reply.num_tokens < int(batch["response_mask"].sum())  # observations are not generated tokens


@pytest.mark.timeout(90)
async def test_the_turn_limit_and_the_token_cap_end_episodes(
    worker: RolloutWorker, env: CountingEnv, control: NatsTransport
) -> None:
    tokenizer = worker.engine.tokenizer
    sampling = SamplingParams(n=1, max_tokens=6, temperature=1.0, seed=5)
    endless = [{"turns": 100, "reward": 9.0}]
    request, _, batch = await _run(
        control, worker, ["hello"], endless, sampling, max_turns=2, max_episode_tokens=200
    )
    runs = _runs(batch[LOSS_MASK][0, : int(batch["response_mask"][0].sum())].tolist())
    assert [v for _, _, v in runs] == [1, 0, 1]  # the last step's observation is not appended
    assert batch["episode_turns"].tolist() == [2] and batch["episode_reward"].tolist() == [0.0]
    assert batch["episode_end"].tolist() == [EPISODE_ENDS.index("max_turns")]
    assert env.closed == [f"{request.job_id}:0:0"]
    # 300-character observations cut to 10 tokens: "\ntool: " + 10 x "x" + "\n" = 18 tokens
    long = [{"turns": 100, "reward": 9.0, "mode": "long"}]
    for cap, length, actions in ((27, 27, 1), (40, 30, 2)):
        request, _, batch = await _run(control, worker, ["hello"], long, sampling, max_turns=64,
                                       max_episode_tokens=cap, max_observation_tokens=10)  # fmt: skip
        episode_id = f"{request.job_id}:0:0"
        assert int(batch["response_mask"][0].sum()) == length <= cap
        response = batch["response_ids"][0].tolist()
        assert (
            response[6:24] == tokenizer("\ntool: " + "x" * 10 + "\n", add_special_tokens=False)["input_ids"]
        )
        # cap 27: the second turn, cut short at 3 tokens, is not sent; cap 40: the second observation
        # would leave no room for a model token
        assert len(env.actions[episode_id]) == actions
        assert batch["episode_end"].tolist() == [EPISODE_ENDS.index("max_tokens")]
        assert batch["episode_reward"].tolist() == [0.0] and batch["episode_obs_cut"].tolist() == [290]
        assert episode_id in env.closed


@pytest.mark.timeout(90)
async def test_a_failing_environment_ends_only_its_episode(
    worker: RolloutWorker, env: CountingEnv, control: NatsTransport
) -> None:
    items = [{"turns": 2, "reward": 1.0}, {"turns": 2, "mode": "error"}, {"turns": 2, "mode": "hang"},
             {"turns": 2, "mode": "ghost"}]  # fmt: skip
    sampling = SamplingParams(n=1, max_tokens=4, temperature=1.0, seed=3)
    t0 = time.monotonic()
    request, reply, batch = await _run(control, worker, ["a", "b", "c", "d"], items, sampling,
                                       max_episode_tokens=100, env_timeout_s=0.5)  # fmt: skip
    assert time.monotonic() - t0 < HANG_S  # the hanging step was not waited for
    ends = [EPISODE_ENDS[i] for i in batch["episode_end"].tolist()]
    assert ends == ["done", "env_error", "env_error", "env_error"]
    assert batch["episode_reward"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert batch["episode_turns"].tolist() == [2, 1, 1, 1]
    assert batch["episode_env_s"][2] >= 0.5  # it waited its env_timeout_s
    ids = [f"{request.job_id}:{p}:0" for p in range(4)]
    assert set(ids[1:3]) <= set(env.closed)  # not the done one (its environment dropped it), nor the ghost's
    assert ids[0] not in env.closed
    assert reply.num_samples == 4


@pytest.mark.timeout(60)
async def test_a_refused_tenant_fails_the_job_and_a_token_travels_with_each_request(
    worker: RolloutWorker, env: CountingEnv, control: NatsTransport
) -> None:
    """A refusal no other episode would escape (a token the servers do not know, an environment the
    tenant may not use) fails the job with the servers' reason instead of training on rewards of 0;
    the run's tenant token goes in the ``Rlfleet-Token`` header of every environment request."""
    sampling = SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=3)
    with pytest.raises(
        RemoteUserError, match=r"refused environment 'counter' \(forbidden_endpoint\): .*tenant 'team-b'"
    ):
        await _run(control, worker, ["a", "b"], [{"turns": 2, "reward": 1.0}, {"turns": 2, "mode": "refuse"}],
                   sampling, max_episode_tokens=50)  # fmt: skip
    spec = EpisodeSpec(
        env="counter", items=[{"turns": 1, "reward": 1.0}, {"mode": "refuse"}], max_episode_tokens=9
    )
    client = EnvClient(control, WORKER_CLUSTER, spec, lambda: None, token="team-a-token-1234")
    env.tokens.clear()
    ok = Episode(prompt=0, sample=0, episode_id="tok:0:0", prompt_ids=[5])
    assert (await client.reset(ok, spec.items[0], seed=1)).worker_id == ENV_WORKER
    with pytest.raises(EnvRefused, match="forbidden_endpoint") as refused:
        await client.reset(
            Episode(prompt=1, sample=0, episode_id="tok:1:0", prompt_ids=[5]), spec.items[1], 1
        )
    assert refused.value.refusal == "forbidden_endpoint"
    assert env.tokens == ["team-a-token-1234"] * 2
    no_token = EnvClient(control, WORKER_CLUSTER, spec, lambda: None)
    await no_token.reset(Episode(prompt=0, sample=0, episode_id="tok:2:0", prompt_ids=[5]), spec.items[0], 1)
    assert env.tokens[-1] is None


@pytest.mark.timeout(90)
async def test_a_job_past_its_deadline_fails_and_closes_its_episodes(
    worker: RolloutWorker, env: CountingEnv, control: NatsTransport
) -> None:
    tokenizer = worker.engine.tokenizer
    request = GenerateRequest(  # the worker's deadline_slack_s (5 s) leaves it about 1 s
        job_id="episodes-late", prompt_token_ids=[tokenizer("hi", add_special_tokens=False)["input_ids"]],
        sampling=SamplingParams(max_tokens=4, seed=1), deadline=time.time() - 4.0,
        episode=EpisodeSpec(env="counter", items=[{"turns": 2, "mode": "hang"}], max_episode_tokens=50),
    )  # fmt: skip
    with pytest.raises(RemoteError, match="DeadlinePassed: generate job episodes-late"):
        await control.request(worker.own_subject, request, timeout=30, tier="rollout")
    assert env.closed == ["episodes-late:0:0"]


@pytest.mark.timeout(60)
async def test_an_episode_spec_must_match_the_prompts(worker: RolloutWorker, control: NatsTransport) -> None:
    spec = EpisodeSpec(env="counter", items=[{"turns": 1}], max_episode_tokens=50)
    with pytest.raises(ValidationError, match="episode.items holds 1 items for 2 prompts"):
        GenerateRequest(job_id="j", prompt_token_ids=[[5, 6], [7]], episode=spec)
    sent = GenerateRequest.model_construct(**GenerateRequest(job_id="j", prompt_token_ids=[[5]]).__dict__)
    sent.prompt_token_ids, sent.episode = [[5, 6], [7]], spec  # as a peer that skips validation sends it
    with pytest.raises(RemoteUserError, match="episode.items holds 1 items for 2 prompts"):
        await control.request(worker.own_subject, sent, timeout=30, tier="rollout")
    two = spec.model_copy(update={"items": [{}, {}]})
    request = GenerateRequest(job_id="j", prompt_token_ids=[[5, 6], [7]], episode=two,
                              sampling=SamplingParams(n=2))  # fmt: skip
    with pytest.raises(GenerateTooLarge, match=r"4 samples x episode.max_episode_tokens=50\)"):
        check_products(request, GenerateLimits(max_new_tokens=100), context=None)
    with pytest.raises(InvalidPrompt, match="prompt 0: has 2 tokens; with episode.max_episode_tokens=50"):
        check_products(request, GenerateLimits(), context=51)


@pytest.mark.timeout(30)
def test_observation_turns_follow_the_chat_template(char_tokenizer) -> None:  # noqa: ANN001
    tokenizer = char_tokenizer()
    assert (
        ChatTurns(tokenizer).observation("x 5", "tool", [5, 6], stopped=False)
        == tokenizer("\ntool: x 5\n", add_special_tokens=False)["input_ids"]
    )  # no template: plain text
    tokenizer.chat_template = CHAT_TEMPLATE
    turns = ChatTurns(tokenizer)
    delta = tokenizer("<eos>tool x 5<eos>assistant ", add_special_tokens=False)["input_ids"]
    assert delta[0] == EOS_ID
    assert turns.observation("x 5", "tool", [5, EOS_ID], stopped=True) == delta[1:]  # its EOS closed the turn
    assert turns.observation("x 5", "tool", [5, 6], stopped=False) == delta  # cut: the template closes it
    assert turns.cut("abcdef", 4) == ("abcd", 2) and turns.cut("abc", 4) == ("abc", 0)
    tokenizer.chat_template = "{{ raise_exception('no tool turns here') }}"
    assert (
        ChatTurns(tokenizer).observation("x 5", "tool", [5], stopped=False)
        == delta[:0] + tokenizer("\ntool: x 5\n", add_special_tokens=False)["input_ids"]
    )  # a template that refuses: plain text


@pytest.mark.timeout(90)
async def test_an_episode_with_a_chat_template(
    nats: EmbeddedNats, env: CountingEnv, control: NatsTransport, make_checkpoint, tmp_path: Path
) -> None:  # fmt: skip
    path = tmp_path / "chat"
    shutil.copytree(make_checkpoint(seed=0), path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    def expected(reply: EnvObservation, turn: list[int]) -> list[int]:
        delta = tokenizer(f"<eos>{reply.role} {reply.observation}<eos>assistant ", add_special_tokens=False)
        return delta["input_ids"][1:] if turn[-1] == EOS_ID else delta["input_ids"]

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    async with running_worker(nats.url, path, worker_id="rollout-chat") as worker:
        assert worker.engine.tokenizer.chat_template == CHAT_TEMPLATE
        sampling = SamplingParams(n=2, max_tokens=5, temperature=1.0, seed=2)
        items = [{"turns": 3, "reward": 2.0}]
        request, _, batch = await _run(control, worker, ["user hi<eos>assistant "], items, sampling,
                                       max_episode_tokens=150)  # fmt: skip
        for row in range(2):
            episode_id = f"{request.job_id}:0:{row}"
            runs = _check_row(
                batch, row, request.prompt_token_ids[0], env, episode_id, model, tokenizer, expected
            )
            assert len(runs) == 5
    assert batch["episode_reward"].tolist() == [2.0, 2.0]
    assert not any(math.isnan(x) for x in batch["episode_env_s"].tolist())
