"""The built-in environments (reset, step, done, reward), their specs, and the host's episode bounds.

In-process and fast; the served path over NATS is tests/reward/test_environment_service.py's.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from rlfleet.common.control.messages import EnvReset, EnvStep
from rlfleet.common.schema.reward import EnvironmentConfig, RewardWorkerConfig
from rlfleet.reward.environments import (
    ENVIRONMENTS,
    EnvironmentHost,
    build_environment,
    parse_environment_spec,
    tools_prompt,
)
from rlfleet.reward.environments.base import TURN_LIMIT_NOTE, Environment
from rlfleet.reward.environments.calculator import Calculator
from rlfleet.reward.environments.guess_number import GuessNumber
from rlfleet.reward.errors import (
    BadEnvironmentItem,
    EnvironmentSpecError,
    EpisodeBusy,
    EpisodesFull,
    StepDeadlinePassed,
    UnknownEnvironment,
    UnknownEpisode,
)

pytestmark = pytest.mark.timeout(30)


def call(expression: str) -> str:
    return f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'


def episode(spec: str, item: dict[str, Any], seed: int = 0) -> Environment:
    env = build_environment("e", EnvironmentConfig(environment=spec)).new()
    first = env.reset(item, seed)
    assert first.text == "" and not first.done
    return env


# --- calculator -----------------------------------------------------------------------------------


def test_calculator_episode_tool_calls_then_a_right_answer() -> None:
    env = episode("calculator", {"prompt": "What is 17 * 23 + 4?", "answer": 395})
    first = env.step("I'll compute it.\n" + call("17 * 23"))
    assert (first.text, first.role, first.done, first.reward) == ("391", "tool", False, 0.0)
    assert first.info == {"tool_calls": 1, "tool_errors": 0, "malformed_calls": 0}
    second = env.step("calculator: 391 + 4")
    assert second.text == "395" and not second.done
    final = env.step("So the answer is 395.")
    assert final.done and final.reward == 1.0 and final.role == "user" and final.text == ""


@pytest.mark.parametrize(
    ("answer", "text", "reward"),
    [(395, "The answer is 394.", 0.0), (395, "no number at all", 0.0), ("#### 2.5", "It is 2.5000001", 1.0),
     (0.1, "0.100002", 0.0), (1234, "It is 1,234.", 1.0), (-3, "x = -3", 1.0)],
)  # fmt: skip
def test_calculator_final_answer_is_its_last_number_within_tolerance(
    answer: Any, text: str, reward: float
) -> None:
    env = episode("calculator:tolerance=1e-6", {"answer": answer})
    final = env.step(text)
    assert final.done and final.reward == pytest.approx(reward)


def test_calculator_ends_at_max_turns_with_reward_zero() -> None:
    env = episode("calculator:max_turns=2", {"answer": 4})
    assert not env.step(call("2+2")).done
    last = env.step(call("2+2"))
    assert last.done and last.reward == 0.0 and last.text == f"4\n\n{TURN_LIMIT_NOTE}"
    env = episode("calculator:max_turns=1", {"answer": 4})
    answered = env.step("4")  # an answer on the last turn is still graded
    assert answered.done and answered.reward == 1.0


def test_calculator_malformed_calls_are_observations_not_answers() -> None:
    env = episode("calculator", {"answer": 4})
    bad = env.step('<tool_call>{"name": "calculator", "arguments": </tool_call>')
    assert not bad.done and bad.role == "tool" and bad.text.startswith("tool call error: ")
    assert bad.info["malformed_calls"] == 1
    failing = env.step(call("1/0"))
    assert failing.text == "tool error: calculator: division by zero" and failing.info["tool_errors"] == 1


def test_calculator_without_tools_reads_tool_calls_as_text() -> None:
    env = episode("calculator:tools=''", {"answer": 4})
    assert env.step(call("2+2")).done  # no tools: the turn is an answer (its last number, 2)


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        ({"question": "?"}, "needs item['answer']"),
        ({"answer": True}, "is a bool"),
        ({"answer": "many"}, "no number"),
    ],
)
def test_calculator_items_without_a_numeric_answer_are_refused(item: dict[str, Any], reason: str) -> None:
    env = build_environment("calc", EnvironmentConfig(environment="calculator")).new()
    with pytest.raises(BadEnvironmentItem) as info:
        env.reset(item, 0)
    assert str(info.value).startswith("environment 'calculator' cannot start an episode: ") and reason in str(
        info.value
    )


# --- guess_number ---------------------------------------------------------------------------------


def test_guess_number_answers_higher_lower_correct_with_a_discounted_reward() -> None:
    env = episode("guess_number", {"secret": 37})
    assert [(o.text, o.role, o.done) for o in (env.step("50"), env.step("I guess 25"))] == [
        ("lower", "user", False),
        ("higher", "user", False),
    ]
    final = env.step("Is it 37?")
    assert final.text == "correct" and final.done and final.reward == pytest.approx(0.8)
    assert episode("guess_number", {"secret": 5}).step("5").reward == 1.0


def test_guess_number_reward_is_floored_and_zero_at_max_turns() -> None:
    env = episode("guess_number:max_turns=9,discount=0.2,floor=0.3", {"secret": 9})
    for guess in range(1, 8):
        assert env.step(str(guess)).text == "higher"
    assert env.step("9").reward == pytest.approx(0.3)  # 1 - 0.2 * 7 < 0.3
    env = episode("guess_number:max_turns=2", {"secret": 9})
    env.step("1")
    last = env.step("2")
    assert last.done and last.reward == 0.0 and last.text == "higher"


def test_guess_number_a_turn_without_an_integer_is_malformed() -> None:
    env = episode("guess_number", {"secret": 9})
    for text in ("no idea", "maybe 4.5"):
        obs = env.step(text)
        assert not obs.done and obs.info["malformed_calls"] == 1 and "integer from 1 to 100" in obs.text


def test_guess_number_secret_from_the_seed_is_reproducible() -> None:
    def secret(seed: int) -> int:
        env = episode("guess_number:low=1,high=1000", {}, seed=seed)
        low, high = 1, 1000
        while True:  # binary search by the environment's answers
            guess = (low + high) // 2
            text = env.step(str(guess)).text
            if text == "correct":
                return guess
            low, high = (guess + 1, high) if text == "higher" else (low, guess - 1)

    assert secret(7) == secret(7)
    assert len({secret(s) for s in range(6)}) > 1


@pytest.mark.parametrize("secret", [0, 101, "50", True, 3.0])
def test_guess_number_refuses_a_bad_secret(secret: Any) -> None:
    env = build_environment("g", EnvironmentConfig(environment="guess_number")).new()
    with pytest.raises(BadEnvironmentItem, match=r"item\['secret'\]"):
        env.reset({"secret": secret}, 0)


# --- specs ----------------------------------------------------------------------------------------


def test_specs_in_text_and_dict_form() -> None:
    kind, args = parse_environment_spec("e", "calculator:max_turns=6,tools=calculator|python")
    assert kind is Calculator and args == {"max_turns": 6, "tools": "calculator|python"}
    kind, args = parse_environment_spec("e", {"name": "guess_number", "args": {"high": 10}})
    assert kind is GuessNumber and args == {"high": 10}
    built = build_environment(
        "calc", EnvironmentConfig(environment="calculator:tools=calculator|python", step_s=5)
    )
    assert sorted(built.tools) == ["calculator", "python"] and built.step_s == 5
    assert set(ENVIRONMENTS) == {"calculator", "guess_number"}


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("poker", "unknown environment 'poker'; built-in environments are ['calculator', 'guess_number']"),
        ("calculator:turns=3", "calculator takes no option 'turns'"),
        ("calculator:max_turns=0", "option max_turns: Input should be greater than or equal to 1"),
        ("calculator:tools=calculator|shell", "unknown tools ['shell']"),
        ("guess_number:low=5,high=5", "low (5) must be below high (5)"),
        ("calculator:max_turns", "is not key=value"),
        ({"name": "calculator", "code": "import os"}, "the dict form is"),
    ],
)
def test_bad_specs_are_refused_when_built(spec: Any, reason: str) -> None:
    with pytest.raises(EnvironmentSpecError) as info:
        build_environment("mine", EnvironmentConfig(environment=spec))
    assert "environment 'mine'" in str(info.value) and reason in str(info.value), info.value


def test_worker_config_takes_environments_and_tenants_may_name_them() -> None:
    cfg = RewardWorkerConfig.model_validate({
        "environments": {"calc": "calculator:max_turns=6",
                         "guess": {"environment": "guess_number", "step_s": 5}},
        "tenants": [{"name": "a", "token": "token-of-a-1", "endpoints": ["calc"]}],
    })  # fmt: skip
    assert cfg.environments["calc"].environment == "calculator:max_turns=6"
    assert cfg.environments["guess"].step_s == 5 and cfg.max_episodes == 4096
    with pytest.raises(ValueError, match=r"names endpoints \['poker'\] that are neither in endpoints"):
        RewardWorkerConfig.model_validate(
            {"tenants": [{"name": "a", "token": "token-of-a-1", "endpoints": ["poker"]}]}
        )


def test_the_tools_prompt_describes_both_forms() -> None:
    tools = build_environment("c", EnvironmentConfig(environment="calculator")).tools
    text = tools_prompt(tools)
    assert '"name": "calculator"' in text and "<tool_call>" in text and "calculator: <expression>" in text


# --- the host: episodes and their bounds ---------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def host(clock: Clock | None = None, **kw: Any) -> EnvironmentHost:
    configs = {
        "calc": EnvironmentConfig(environment="calculator"),
        "guess": EnvironmentConfig(environment="guess_number"),
    }
    return EnvironmentHost(configs, worker_id="reward-t", clock=clock or time.monotonic, **kw)


def reset(env: str, episode_id: str, item: dict[str, Any] | None = None) -> EnvReset:
    return EnvReset(env=env, episode_id=episode_id, item={"answer": 4, "secret": 4} if item is None else item)


async def test_host_plays_an_episode_and_drops_it_when_done() -> None:
    h = host()
    first = await h.reset(reset("calc", "ep-1"), "", None)
    assert first.worker_id == "reward-t" and first.episode_id == "ep-1" and len(h) == 1
    tool = await h.step(EnvStep(env="calc", episode_id="ep-1", action=call("2+2")), "", None)
    assert tool.observation == "4" and tool.role == "tool" and tool.info["tool_calls"] == 1.0
    final = await h.step(EnvStep(env="calc", episode_id="ep-1", action="4"), "", None)
    assert final.done and final.reward == 1.0 and len(h) == 0
    with pytest.raises(UnknownEpisode, match="holds no episode 'ep-1' of environment 'calc'"):
        await h.step(EnvStep(env="calc", episode_id="ep-1", action="4"), "", None)


async def test_episodes_are_their_owners_own() -> None:
    h = host()
    await h.reset(reset("calc", "same-id"), "team-a", None)
    await h.reset(reset("calc", "same-id", {"answer": 5}), "team-b", None)  # no clash with team-a's
    with pytest.raises(UnknownEpisode):
        await h.step(EnvStep(env="calc", episode_id="same-id", action="4"), "team-c", None)
    with pytest.raises(UnknownEpisode):  # same id, other environment
        await h.step(EnvStep(env="guess", episode_id="same-id", action="4"), "team-a", None)
    assert (await h.step(EnvStep(env="calc", episode_id="same-id", action="4"), "team-a", None)).reward == 1.0
    assert (await h.step(EnvStep(env="calc", episode_id="same-id", action="4"), "team-b", None)).reward == 0.0
    assert not h.close("team-a", "calc", "same-id")  # already done


async def test_unknown_environments_are_refused_by_name() -> None:
    with pytest.raises(
        UnknownEnvironment, match="environment 'poker' is not run here.*\\['calc', 'guess'\\]"
    ):
        await host().reset(reset("poker", "ep"), "", None)


async def test_max_episodes_drops_idle_ones_first_then_refuses() -> None:
    clock = Clock()
    h = host(clock, max_episodes=2, idle_s=10)
    await h.reset(reset("calc", "a"), "", None)
    clock.now = 5
    await h.reset(reset("calc", "b"), "", None)
    with pytest.raises(EpisodesFull, match="holds 2 live episodes"):
        await h.reset(reset("calc", "c"), "", None)
    clock.now = 11  # "a" idle for 11 s: dropped; "b" for 6 s: kept
    await h.reset(reset("calc", "c"), "", None)
    with pytest.raises(UnknownEpisode):
        await h.step(EnvStep(env="calc", episode_id="a", action="4"), "", None)
    assert (await h.step(EnvStep(env="calc", episode_id="b", action="4"), "", None)).reward == 1.0
    assert h.held_by("") == 1


async def test_a_reset_of_a_live_id_starts_it_over_and_close_drops_it() -> None:
    h = host()
    await h.reset(reset("guess", "g", {"secret": 10}), "", None)
    await h.step(EnvStep(env="guess", episode_id="g", action="3"), "", None)
    await h.reset(reset("guess", "g", {"secret": 3}), "", None)
    assert len(h) == 1
    again = await h.step(EnvStep(env="guess", episode_id="g", action="3"), "", None)
    assert again.reward == 1.0  # turn 1 of the new episode: no discount
    await h.reset(reset("guess", "g"), "", None)
    assert h.close("", "guess", "g") and len(h) == 0 and not h.close("", "guess", "g")


async def test_one_step_at_a_time_and_a_step_past_its_deadline_drops_the_episode() -> None:
    configs = {"slow": EnvironmentConfig(environment="calculator", step_s=0.3)}
    h = EnvironmentHost(configs, worker_id="reward-t")
    await h.reset(EnvReset(env="slow", episode_id="s", item={"answer": 1}), "", None)
    env = h._live[("", "slow", "s")].state

    def stuck(action: str, *, deadline: float | None = None) -> Any:
        time.sleep(0.6)
        raise AssertionError("its reply is never used")

    object.__setattr__(env, "step", stuck)  # an environment that outlives its deadline
    first = asyncio.create_task(h.step(EnvStep(env="slow", episode_id="s", action="1"), "", None))
    await asyncio.sleep(0.05)
    with pytest.raises(EpisodeBusy):
        await h.step(EnvStep(env="slow", episode_id="s", action="1"), "", None)
    with pytest.raises(StepDeadlinePassed, match="did not finish within its deadline"):
        await first
    with pytest.raises(UnknownEpisode):
        await h.step(EnvStep(env="slow", episode_id="s", action="1"), "", None)
    await asyncio.sleep(0.4)  # the stuck thread ends


async def test_a_long_observation_is_cut_to_fit_the_message() -> None:
    h = host()
    await h.reset(reset("calc", "x"), "", None)
    env = h._live[("", "calc", "x")].state
    from rlfleet.reward.environments.base import Observation

    object.__setattr__(env, "step", lambda action, deadline=None: Observation("y" * 200_000, "tool"))
    reply = await h.step(EnvStep(env="calc", episode_id="x", action="?"), "", None)
    assert len(reply.observation) == 1 << 17 and reply.observation.endswith("it was 200000 characters long]")
