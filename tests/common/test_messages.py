"""Control messages: round trips, protocol version checks, size limit, robustness of decode."""

from __future__ import annotations

import json
import typing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from rlfleet.common.control import messages as m
from rlfleet.common.errors import MessageDecodeError, MessageTooLarge, ProtocolMismatch
from rlfleet.common.schema.refs import TensorRef

REF = TensorRef(address="127.0.0.1:5000", key="batch-1", nbytes=64)

EXAMPLES: list[m.Message] = [
    m.WorkerAnnounce(tier="rollout", worker_id="r1", subject="rlfleet.c.rollout.worker.r1", capacity=2),
    m.Heartbeat(tier="reward", worker_id="w1", weight_version=3, busy=1),
    m.WorkerLeave(tier="trainer", worker_id="t0", reason="drain"),
    m.Ping(),
    m.GenerateRequest(
        job_id="j1",
        prompt_token_ids=[[1, 2, 3], [4]],
        sampling=m.SamplingParams(n=4, seed=7),
        metadata={"a": 1},
    ),
    m.GenerateResult(
        job_id="j1", worker_id="r1", weight_version=2, ref=REF, num_prompts=2, num_samples=8, num_tokens=100
    ),
    m.LoadWeights(weight_version=5, buckets=[REF, REF], dtype="bfloat16"),
    m.WeightsLoaded(worker_id="r1", weight_version=5, seconds=0.5),
    m.ScoreRequest(
        job_id="j1", endpoint="team-a/helpful", rollout=REF, metadata=[{"answer": "4"}], token="t"
    ),
    m.ScoreResult(
        job_id="j1", endpoint="e", spec_version="v1", scores=[0.5, 1.0], components={"len": [0.1, 0.2]}
    ),
    m.SetRewardSpec(endpoint="e", spec={"exact_match": 1.0}),
    m.RewardSpecSet(endpoint="e", spec_version="v2"),
    m.SetRewardSpec(endpoint="e", model_path="/models/rm-v2", scaler={"temperature": 0.7}, token="t"),
    m.RewardStatsRequest(token="t", endpoint="e"),
    m.RewardStats(
        worker_id="w1", tenant="team-a", endpoints={"e": m.EndpointStats(spec="concise", spec_version="v2")}
    ),
    m.TrainStepRequest(
        step=3, rollouts=[REF], scores=[1.0], settings={"learning_rate": 1e-5, "algorithm": "ppo"}
    ),
    m.TrainerConfigure(model={"sharding": "full"}, device="cuda", critic=True, model_fingerprint="ab12"),
    m.TrainerConfigured(worker_id="trainer-0", weight_version=3),
    m.TrainStepResult(step=3, metrics={"loss": 0.25}, weight_version=4),
    m.PublishWeights(weight_version=4, bucket_mb=32.0),
    m.WeightsPublished(weight_version=4, buckets=[REF], nbytes=1024, seconds=0.1, loaded_by=["r1"]),
    m.LatestWeights(worker_id="r1"),
    m.SaveCheckpoint(path="/tmp/ckpt"),
    m.Saved(path="/tmp/ckpt"),
    m.SaveCheckpoint(path="/tmp/ckpt", mode="full"),
    m.LoadCheckpoint(path="/tmp/ckpt", weight_version=3),
    m.CheckpointLoaded(path="/tmp/ckpt", steps=3, weight_version=3),
    m.EnvReset(env="calc", episode_id="run-1:0:3", item={"prompt": "2+2?", "answer": "4"}, seed=3),
    m.EnvStep(env="calc", episode_id="run-1:0:3", action='<tool_call>{"name": "calculator"}</tool_call>'),
    m.EnvObservation(episode_id="run-1:0:3", worker_id="reward-0", observation="4", info={"tool_calls": 1.0}),
    m.EnvClose(env="calc", episode_id="run-1:0:3"),
    m.AgentOpen(token="t" * 32, sampling=m.SamplingParams(max_tokens=16), max_sessions=8),
    m.AgentOpened(worker_id="rollout-0", url="http://127.0.0.1:4000/v1"),
    m.AgentCollect(
        job_id="agent-1",
        prompt_token_ids=[[1, 2]],
        sessions=["s:0:0", "s:0:1"],
        rewards=[1.0, 0.0],
        failed=[False, True],
    ),
    m.Ack(detail="ok"),
    m.Shutdown(reason="done"),
    m.ErrorReply(tier="reward", code="bad_message", message="no", retryable=True),
]


def _union() -> set[type]:
    return set(typing.get_args(typing.get_args(m.AnyMessage)[0]))


def test_examples_cover_every_message_kind() -> None:
    assert {type(e) for e in EXAMPLES} == _union()


def test_every_message_of_every_family_is_in_the_union() -> None:
    """A message a family module defines but the union misses could be sent and never decoded."""
    families = [m.base, m.membership, m.rollout, m.reward, m.trainer, m.environment, m.agent]
    defined = {c for f in families for c in vars(f).values()
               if isinstance(c, type) and issubclass(c, m.Message) and c is not m.Message}  # fmt: skip
    assert defined == _union()


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda e: e.kind)
def test_every_message_round_trips(message: m.Message) -> None:
    decoded = m.decode(m.encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_decode_accepts_str_and_bytes() -> None:
    text = m.encode(m.Ack(detail="x")).decode()
    assert m.decode(text) == m.decode(text.encode()) == m.Ack(detail="x")


def test_other_major_version_is_refused_naming_both() -> None:
    raw = json.loads(m.encode(m.Ack()))
    raw["protocol"] = "3.0"
    with pytest.raises(ProtocolMismatch) as info:
        m.decode(json.dumps(raw))
    assert info.value.ours == m.PROTOCOL and info.value.theirs == "3.0"
    assert m.PROTOCOL in str(info.value) and "3.0" in str(info.value)


def test_minor_skew_and_unknown_fields_are_accepted() -> None:
    raw = json.loads(m.encode(m.Heartbeat(tier="rollout", worker_id="r1")))
    raw["protocol"] = "2.99"
    raw["added_in_a_later_minor"] = {"x": 1}
    decoded = m.decode(json.dumps(raw))
    assert isinstance(decoded, m.Heartbeat) and decoded.protocol == "2.99"


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"kind": "ack"}', "protocol"),
        (b'{"protocol": "2.0", "kind": "no.such.kind"}', "kind"),
        (b'{"protocol": "2.0", "kind": "rollout.generate"}', "job_id"),
    ],
)
def test_bad_bytes_raise_decode_error(data: bytes, fragment: str) -> None:
    with pytest.raises(MessageDecodeError, match=fragment):
        m.decode(data)


def test_oversized_message_is_refused() -> None:
    big = m.GenerateRequest(job_id="big", prompt_token_ids=[list(range(200_000))])
    with pytest.raises(MessageTooLarge) as info:
        m.encode(big)
    assert info.value.size > info.value.limit == m.MAX_MESSAGE_BYTES
    assert "tensor plane" in str(info.value)


def test_encode_limit_is_adjustable() -> None:
    with pytest.raises(MessageTooLarge):
        m.encode(m.Ack(detail="x" * 100), limit=50)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_decode_of_arbitrary_bytes_raises_only_protocol_errors(data: bytes) -> None:
    try:
        result = m.decode(data)
    except (MessageDecodeError, ProtocolMismatch):
        return
    assert isinstance(result, BaseModel)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_kinds = st.sampled_from(sorted(k.model_fields["kind"].default for k in map(type, EXAMPLES)))


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.text(max_size=10), _json, max_size=6),
    st.one_of(st.none(), _kinds),
    st.one_of(st.none(), st.sampled_from(["1.0", "1.7", "0.1", "2.0", "", "x"]), _json),
)
def test_decode_of_arbitrary_objects_raises_only_protocol_errors(
    fields: dict[str, object], kind: str | None, protocol: object
) -> None:
    raw = dict(fields)
    if kind is not None:
        raw["kind"] = kind
    if protocol is not None:
        raw["protocol"] = protocol
    try:
        result = m.decode(json.dumps(raw))
    except (MessageDecodeError, ProtocolMismatch):
        return
    assert result.kind == raw["kind"]
