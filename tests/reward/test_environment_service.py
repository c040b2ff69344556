"""Environments served by reward workers over a real nats-server (issue 33): the episode protocol a
rollout worker drives, the tenants' refusals and the scaling of resets over a queue group.

A reset goes to ``rlfleet.<cluster>.env.reset`` (queue group "env"); the worker that takes it names
itself in its ``EnvObservation.worker_id``, and the episode's steps and close go to that worker's own
subject. Each test uses a cluster of its own on the session's nats-server.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import Ack, EnvClose, EnvObservation, EnvReset, EnvStep, Message
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import TOKEN_HEADER, episode_subject, subject, worker_subject
from rlfleet.common.errors import NoResponders, RemoteError, RequestTimeout
from rlfleet.common.schema.config import load_config
from rlfleet.reward.service import RewardWorker, RewardWorkerConfig

pytestmark = pytest.mark.timeout(60)

TOKEN_A, TOKEN_B, ADMIN = "token-of-team-a", "token-of-team-b", "the-admin-token"
EPISODES = itertools.count()
SHARED: dict[str, Any] = {
    "endpoints": {"b/short": "concise:max_words=2"},
    "environments": {
        "calc": {
            "environment": "calculator:max_turns=4,tools=calculator|python",
            "sandbox": {"cpu_s": 2, "wall_s": 5},
        },
        "guess": "guess_number:high=10",
    },
    "tenants": [
        {"name": "team-a", "token": TOKEN_A, "endpoints": ["calc", "guess"]},
        {"name": "team-b", "token": TOKEN_B, "endpoints": ["b/short"]},
    ],
    "admin": {"token": ADMIN},
}


class Fleet:
    """Reward workers on one cluster of the nats-server, and a client that drives episodes as a rollout
    worker would."""

    def __init__(
        self, nats: EmbeddedNats, cluster: str, client: NatsTransport, stack: AsyncExitStack
    ) -> None:
        self.nats, self.cluster, self.client, self.stack = nats, cluster, client, stack

    async def worker(self, worker_id: str, config: dict[str, Any]) -> RewardWorker:
        data = {"fleet": {"cluster": self.cluster, "nats_url": self.nats.url}, "worker_id": worker_id,
                "quota_store": "process", **config}  # fmt: skip
        transport = await NatsTransport.connect(self.nats.url, name=worker_id, tier="reward")
        worker = RewardWorker(load_config(RewardWorkerConfig, data=data), transport)
        await worker.start()
        self.stack.push_async_callback(transport.close)
        self.stack.push_async_callback(worker.stop, "test over")
        return worker

    async def send(self, target: str, message: Message, token: str | None) -> Any:
        headers = {TOKEN_HEADER: token} if token else None
        return await self.client.request(target, message, timeout=20, tier="reward", headers=headers)

    async def reset(
        self, env: str, item: dict[str, Any], token: str | None = TOKEN_A, **kw: Any
    ) -> EnvObservation:
        message = EnvReset(env=env, episode_id=f"ep-{next(EPISODES)}", item=item, **kw)
        reply = await self.send(subject(self.cluster, "env", "reset"), message, token)
        assert isinstance(reply, EnvObservation) and reply.episode_id == message.episode_id
        return reply

    async def step(
        self, env: str, at: EnvObservation, action: str, token: str | None = TOKEN_A
    ) -> EnvObservation:
        own = episode_subject(self.cluster, at.worker_id)  # where a rollout worker sends its steps
        reply = await self.send(own, EnvStep(env=env, episode_id=at.episode_id, action=action), token)
        assert isinstance(reply, EnvObservation) and reply.worker_id == at.worker_id
        return reply

    async def refused(self, target: str, message: Message, token: str | None, code: str) -> str:
        with pytest.raises(RemoteError) as info:
            await self.send(target, message, token)
        assert info.value.code == code, info.value
        return info.value.remote_message


@asynccontextmanager
async def fleet_on(nats: EmbeddedNats) -> AsyncIterator[Fleet]:
    async with AsyncExitStack() as stack:
        client = await NatsTransport.connect(nats.url, name="rollout-test", tier="rollout")
        stack.push_async_callback(client.close)
        yield Fleet(nats, f"env-{uuid.uuid4().hex[:8]}", client, stack)


@pytest.fixture
async def fleet(nats_server: EmbeddedNats) -> AsyncIterator[Fleet]:
    async with fleet_on(nats_server) as made:
        yield made


def call(tool: str, argument: str, value: str) -> str:
    return f'<tool_call>{{"name": "{tool}", "arguments": {{"{argument}": "{value}"}}}}</tool_call>'


async def test_a_calculator_episode_over_nats_ends_with_the_right_reward(fleet: Fleet) -> None:
    await fleet.worker("reward-env-0", SHARED)
    first = await fleet.reset("calc", {"prompt": "What is 17 * 23 + 4?", "answer": 395})
    assert first.worker_id == "reward-env-0" and not first.done and first.observation == ""
    tool = await fleet.step("calc", first, "Let me compute. " + call("calculator", "expression", "17 * 23"))
    assert (tool.observation, tool.role, tool.done) == ("391", "tool", False)
    assert tool.info == {"tool_calls": 1.0, "tool_errors": 0.0, "malformed_calls": 0.0}
    code = await fleet.step("calc", first, call("python", "code", "print(391 + 4)"))  # in the sandbox
    assert code.observation == "395" and code.info["tool_calls"] == 1.0
    final = await fleet.step("calc", first, "The answer is 395.")
    assert final.done and final.reward == 1.0
    # done: the worker no longer holds it
    own = episode_subject(fleet.cluster, first.worker_id)
    again = EnvStep(env="calc", episode_id=first.episode_id, action="395")
    text = await fleet.refused(own, again, TOKEN_A, "bad_request")
    assert f"holds no episode {first.episode_id!r} of environment 'calc'" in text


async def test_a_guess_number_episode_runs_to_its_turn_limit(fleet: Fleet) -> None:
    await fleet.worker("reward-env-0", SHARED)
    first = await fleet.reset("guess", {"secret": 7})
    answers = [await fleet.step("guess", first, str(g)) for g in (5, 9)]
    assert [(a.observation, a.role) for a in answers] == [("higher", "user"), ("lower", "user")]
    assert (await fleet.step("guess", first, "7")).reward == pytest.approx(0.8)


async def test_a_tenant_with_a_token_for_another_endpoint_is_refused(fleet: Fleet) -> None:
    await fleet.worker("reward-env-0", SHARED)
    resets = subject(fleet.cluster, "env", "reset")
    message = EnvReset(env="calc", episode_id="intruder", item={"answer": 1})
    text = await fleet.refused(resets, message, TOKEN_B, "forbidden_endpoint")
    assert "tenant 'team-b' may not use environment 'calc'; its endpoints are ['b/short']" in text
    await fleet.refused(resets, message, None, "missing_token")
    await fleet.refused(resets, message, "token-of-nobody", "invalid_token")
    # nor may it step another tenant's episode, even knowing its id and worker
    mine = await fleet.reset("calc", {"answer": 1})
    step = EnvStep(env="calc", episode_id=mine.episode_id, action="1")
    own = worker_subject(fleet.cluster, "reward", mine.worker_id)
    await fleet.refused(own, step, TOKEN_B, "forbidden_endpoint")
    assert (await fleet.step("calc", mine, "1")).reward == 1.0  # its owner still can


async def test_an_environment_the_operator_did_not_configure_is_refused_by_name(fleet: Fleet) -> None:
    await fleet.worker("reward-env-0", SHARED)
    resets = subject(fleet.cluster, "env", "reset")
    message = EnvReset(env="shell", episode_id="e", item={"cmd": "rm -rf /"})
    text = await fleet.refused(resets, message, ADMIN, "unknown_endpoint")
    assert "environment 'shell' is not run here" in text and "['calc', 'guess']" in text
    text = await fleet.refused(resets, message, TOKEN_A, "forbidden_endpoint")  # a tenant: not among its own
    assert "may not use environment 'shell'" in text


async def test_a_step_for_an_unknown_episode_is_refused(fleet: Fleet) -> None:
    worker = await fleet.worker("reward-env-0", SHARED)
    step = EnvStep(env="calc", episode_id="never-reset", action="1")
    text = await fleet.refused(worker.own_subject, step, TOKEN_A, "bad_request")
    assert "reward worker reward-env-0 holds no episode 'never-reset' of environment 'calc'" in text
    close = EnvClose(env="calc", episode_id="never-reset")  # a close too: it changes nothing it was not given
    text = await fleet.refused(worker.own_subject, close, TOKEN_A, "bad_request")
    assert "holds no episode 'never-reset'" in text


async def test_bad_items_are_refused_and_close_drops_an_episode(fleet: Fleet) -> None:
    worker = await fleet.worker("reward-env-0", SHARED)
    resets = subject(fleet.cluster, "env", "reset")
    text = await fleet.refused(resets, EnvReset(env="calc", episode_id="x", item={}), TOKEN_A, "bad_request")
    assert "the calculator environment needs item['answer']" in text
    first = await fleet.reset("guess", {"secret": 3})
    closed = await fleet.send(worker.own_subject, EnvClose(env="guess", episode_id=first.episode_id), TOKEN_A)
    assert isinstance(closed, Ack) and "closed" in closed.detail and len(worker.environments) == 0


async def test_a_tenant_holds_at_most_its_share_of_episodes(fleet: Fleet) -> None:
    await fleet.worker("reward-env-0", {**SHARED, "max_episodes": 4})  # two tenants: two each
    await fleet.reset("calc", {"answer": 1})
    await fleet.reset("calc", {"answer": 1})
    resets = subject(fleet.cluster, "env", "reset")
    text = await fleet.refused(resets, EnvReset(env="calc", episode_id="third", item={"answer": 1}), TOKEN_A,
                               "quota_exceeded")  # fmt: skip
    assert "holds 2 live episodes in this replica" in text


async def test_resets_spread_over_replicas_and_steps_reach_the_one_holding_the_episode(fleet: Fleet) -> None:
    open_server = {"environments": {"calc": "calculator"}}
    await fleet.worker("reward-env-0", open_server)
    await fleet.worker("reward-env-1", open_server)
    firsts = [await fleet.reset("calc", {"answer": i}, token=None) for i in range(16)]
    assert {f.worker_id for f in firsts} == {"reward-env-0", "reward-env-1"}
    for i, first in enumerate(firsts):
        final = await fleet.step("calc", first, f"calculator: {i} * 1", token=None)
        assert final.observation == str(i)
        assert (await fleet.step("calc", first, str(i), token=None)).reward == 1.0


async def test_a_worker_without_environments_does_not_take_resets(fleet: Fleet) -> None:
    await fleet.worker("reward-plain", {})
    message = EnvReset(env="calc", episode_id="e", item={"answer": 1})
    with pytest.raises((NoResponders, RequestTimeout)):
        await fleet.client.request(subject(fleet.cluster, "env", "reset"), message, timeout=2, tier="reward")
