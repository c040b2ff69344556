"""Fuzz the control plane: 10,000 malformed or hostile messages on every subject the workers serve.

A trainer, a reward and a rollout worker (tiny models, CPU) run on a real nats-server, each on its
own NATS connection, as the worker tests run them. For every subject they subscribed to, a seeded
generator sends 10,000 messages that are no acceptable request there: empty bodies, bytes that are
not UTF-8, text that is not JSON, huge integers, ``NaN``/``Infinity``, deep nesting, lists near
1 MiB, lone surrogates, unknown kinds, known kinds with fields of the wrong type, other MAJOR
protocols, replies sent as requests; plus hand-written requests that decode but ask for harm (paths
outside the checkpoint root, token ids outside the vocabulary, references to stores that do not
exist). Every one must get an :class:`ErrorReply` with a code of ``WIRE_CODES`` (never a timeout)
and none ``internal`` (a worker that crashed on input); afterwards each worker still answers a
valid request.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.control.messages import (
    MAX_MESSAGE_BYTES,
    MESSAGES,
    ErrorReply,
    GenerateResult,
    LatestWeights,
    WeightsPublished,
    decode,
)
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject
from rlfleet.common.errors import WIRE_CODES, MessageDecodeError
from rlfleet.common.schema.reward import RewardWorkerConfig
from rlfleet.common.schema.rollout import RolloutSettings, RolloutWorkerConfig
from rlfleet.common.schema.trainer import StepSettings, TrainerWorkerConfig, UpdateSettings
from rlfleet.reward.service import RewardWorker
from rlfleet.rollout.service import RolloutWorker
from rlfleet.trainer.service import TrainerWorker

PER_SUBJECT = 10_000
CONCURRENCY = 64
REPLY_TIMEOUT = 20.0


def _kinds() -> dict[str, type]:
    """Every message kind -> its class (from the one union)."""
    import typing

    union = typing.get_args(typing.get_args(MESSAGES._type)[0])  # Annotated[Union[...], Field]
    return {cls.model_fields["kind"].default: cls for cls in union}


BY_KIND = _kinds()
REQUEST_KINDS = {
    "worker.ping", "rollout.generate", "rollout.load_weights",
    "reward.score", "reward.set_spec", "reward.stats",
    "trainer.configure", "trainer.step", "trainer.publish", "trainer.latest", "trainer.save", "trainer.load",
    "shutdown",
}  # fmt: skip
"""Kinds some subject accepts: a random message of these that decodes is not sent (it could be valid)."""

HUGE_INT = "9" * 5000  # over Python's 4300-digit limit for int() of a str
DEEP = "[" * 3000 + "]" * 3000
BIG_LIST = "[" + ",".join(["0"] * 400_000) + "]"  # ~800 KB, under nats-server's 1 MiB max_payload
HOSTILE_LITERALS = [
    HUGE_INT, "-" + HUGE_INT, "1e999", "-1e999", "NaN", "Infinity", "-Infinity", DEEP, BIG_LIST,
    '"\\ud800"', '"\\udfff tail"', "null", "true", "[]", "{}", '""', '"x"', "-1", "0",
    str(2**63), str(-(2**64)),
    "3.5", '{"kind": "shutdown"}', '[[[[[[[[[[1]]]]]]]]]]', '"' + "a" * 200_000 + '"',
]  # fmt: skip
BIG = {HUGE_INT, "-" + HUGE_INT, DEEP, BIG_LIST, HOSTILE_LITERALS[-1]}


def _raw(obj: dict[str, Any], literals: dict[str, str]) -> bytes:
    """``obj`` as JSON with each placeholder string replaced by its raw literal (invalid JSON included)."""
    text = json.dumps(obj)
    for placeholder, literal in literals.items():
        text = text.replace(json.dumps(placeholder), literal)
    return text.encode()


def _literal(rng: random.Random) -> str:
    # big payloads are a few percent of the stream: they are the slow ones
    pool = HOSTILE_LITERALS if rng.random() < 0.05 else [x for x in HOSTILE_LITERALS if x not in BIG]
    return rng.choice(pool)


def _hostile_object(rng: random.Random) -> bytes:
    kind = rng.choice([*BY_KIND, "trainer.drop_tables", "", "Shutdown", "reward.score ", "x" * 300])
    cls = BY_KIND.get(kind)
    fields = list(cls.model_fields) if cls is not None else ["path", "job_id", "n"]
    obj: dict[str, Any] = {"protocol": rng.choice(["2.0", "2.9", "2", "2.0.0"]), "kind": kind}
    literals: dict[str, str] = {}
    for i, name in enumerate(rng.sample(fields, k=min(len(fields), rng.randint(1, 4)))):
        if name in ("kind", "protocol") and rng.random() < 0.7:
            continue
        placeholder = f"@@{i}@@"
        obj[name] = placeholder
        literals[placeholder] = _literal(rng)
    if rng.random() < 0.1:
        obj["protocol"] = rng.choice(["1.0", "3.0", "", None, 2, ["2.0"], "9" * 50])
    return _raw(obj, literals)


def _malformed(rng: random.Random) -> bytes:
    """One message that no subject can accept (checked against ``decode`` by the caller)."""
    choice = rng.random()
    if choice < 0.05:
        return b""
    if choice < 0.12:
        return bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64))) + b"\xff\xc3("
    if choice < 0.18:
        return rng.choice([b"{", b"{'kind': 'ping'}", b"kind=ping", b"\x00" * 16, b'{"protocol": "2.0",}'])
    if choice < 0.25:
        return _literal(rng).encode()
    return _hostile_object(rng)


def _acceptable(data: bytes) -> bool:
    """Whether ``data`` decodes to a request kind (then it is not sent: it might be a valid request)."""
    try:
        message = decode(data)
    except (MessageDecodeError, ValueError):
        return False
    return message.kind in REQUEST_KINDS


def _undecodable(data: bytes) -> bool:
    try:
        decode(data)
    except (MessageDecodeError, ValueError):
        return True
    return False


def malformed_stream(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    out: list[bytes] = []
    while len(out) < count:
        data = _malformed(rng)
        if len(data) < MAX_MESSAGE_BYTES - 4096 and not _acceptable(data):  # nats-server takes it
            out.append(data)
    return out


def hostile_requests(root: Path, store: str) -> list[bytes]:
    """Requests that decode but must be refused (each sent to every subject, with the stream)."""
    ref = {"address": store, "key": "rollout/nothing", "nbytes": 0}
    messages: list[dict[str, Any]] = [
        {"kind": "trainer.save", "path": "/etc/rlfleet-fuzz", "mode": "full"},
        {"kind": "trainer.save", "path": str(root / ".." / "escape")},
        {"kind": "trainer.load", "path": "/", "weight_version": 1},
        {"kind": "trainer.load", "path": "missing-checkpoint"},
        {"kind": "trainer.step", "step": 1, "rollouts": [ref], "scores": [1.0]},
        {"kind": "trainer.step", "step": 1, "rollouts": [], "scores": []},
        {"kind": "rollout.generate", "job_id": "j", "prompt_token_ids": [[10**12, -5]]},
        {"kind": "rollout.generate", "job_id": "j", "prompt_token_ids": [[]]},
        {"kind": "rollout.generate", "job_id": "j", "prompt_token_ids": [[1]], "weight_version": 10**15},
        {"kind": "rollout.load_weights", "weight_version": 99, "buckets": [ref]},
        {"kind": "reward.score", "job_id": "j", "rollout": ref},
        {"kind": "reward.score", "job_id": "j", "endpoint": "nope", "rollout": ref},
        # (an open reward server, as here, takes any set_spec by design: who may send it is the NATS
        # permissions' and the attack suite's business, not this fuzz's)
    ]
    return [json.dumps({"protocol": "2.0", **m}).encode() for m in messages]


class Fleet:
    def __init__(self, client: NatsTransport, servers: dict[str, NatsTransport], cluster: str, root: Path):
        self.client, self.servers, self.cluster, self.root = client, servers, cluster, root

    def subjects(self) -> list[str]:
        """Every subject a worker subscribed to (its tier's verbs and its own subject)."""
        return sorted({handle.subject for server in self.servers.values() for handle in server._subs})


@pytest.fixture
async def fleet(nats_server: EmbeddedNats, tiny_model_dir: Path, tmp_path: Path) -> AsyncIterator[Fleet]:
    cluster = f"fz{uuid.uuid4().hex[:8]}"
    common = {"fleet": {"nats_url": nats_server.url, "cluster": cluster}}
    root = tmp_path / "checkpoints"
    root.mkdir()
    cpu = {"device": "cpu"}
    trainer_cfg = TrainerWorkerConfig(**common, worker_id="trainer-0", model_path=str(tiny_model_dir),
                                      placement=cpu, step=StepSettings(update=UpdateSettings(kl_coef=0.0)),
                                      weights_store_mb=64, threads=1, checkpoint_root=str(root))  # fmt: skip
    rollout_cfg = RolloutWorkerConfig(**common, worker_id="rollout-0", model_path=str(tiny_model_dir),
                                      placement=cpu, rollout=RolloutSettings(engine="hf"),
                                      results_store_mb=64)  # fmt: skip
    reward_cfg = RewardWorkerConfig(
        **common, worker_id="reward-0", endpoints={"default": "charset:allowed=0123456789"}
    )
    servers: dict[str, NatsTransport] = {}
    workers: list[Any] = []
    client = await NatsTransport.connect(nats_server.url, name="fuzzer", tier="controller")
    try:
        for tier, cls, cfg in [("trainer", TrainerWorker, trainer_cfg), ("reward", RewardWorker, reward_cfg),
                               ("rollout", RolloutWorker, rollout_cfg)]:  # fmt: skip
            servers[tier] = await NatsTransport.connect(nats_server.url, name=tier, tier=tier)
            worker = cls(cfg, servers[tier])
            await worker.start()
            workers.append(worker)
        yield Fleet(client, servers, cluster, root)
    finally:
        for worker in reversed(workers):
            await worker.stop("fuzz over")
        for server in servers.values():
            await server.close()
        await client.close()


async def _send_all(fleet: Fleet, target: str, payloads: list[bytes], codes: Counter[str]) -> list[str]:
    """Send every payload to ``target`` (bounded concurrency); the problems found, if any."""
    slots = asyncio.Semaphore(CONCURRENCY)
    problems: list[str] = []

    async def one(data: bytes) -> None:
        async with slots:
            try:
                reply = await fleet.client.client.request(target, data, timeout=REPLY_TIMEOUT)
            except Exception as exc:  # noqa: BLE001 - a timeout or a dropped reply is what we look for
                problems.append(f"{target} <- {data[:80]!r}: {exc.__class__.__name__} {exc}")
                return
        answer = decode(reply.data)
        if not isinstance(answer, ErrorReply) or answer.code not in WIRE_CODES or answer.code == "internal":
            problems.append(f"{target} <- {data[:80]!r}: {answer!r}"[:400])
            return
        codes[answer.code] += 1

    await asyncio.gather(*(one(data) for data in payloads))
    return problems


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_every_subject_answers_hostile_messages_with_errors(fleet: Fleet, tmp_path: Path) -> None:
    subjects = fleet.subjects()
    assert len(subjects) >= 9, subjects  # trainer's six verbs, reward.score, rollout.generate, own subjects
    store = "127.0.0.1:1"  # nobody listens there
    hostile = hostile_requests(fleet.root, store)
    codes: Counter[str] = Counter()
    for i, target in enumerate(subjects):
        payloads = malformed_stream(seed=i, count=PER_SUBJECT - len(hostile)) + hostile
        if target.endswith(".controller.ping"):  # a broadcast: a message that decodes gets no reply there
            payloads = [p for p in malformed_stream(seed=i, count=2 * PER_SUBJECT) if _undecodable(p)]
            payloads = payloads[:PER_SUBJECT]
        problems = await _send_all(fleet, target, payloads, codes)
        assert not problems, f"{len(problems)} bad answers, first: " + "\n".join(problems[:5])
    assert codes["bad_message"] > 0 and codes["protocol_mismatch"] > 0, codes
    assert not (tmp_path / "escape").exists() and not Path("/etc/rlfleet-fuzz").exists()
    # every worker still serves a valid request
    latest = await fleet.client.request(
        subject(fleet.cluster, "trainer", "latest"), LatestWeights(), timeout=30
    )
    assert isinstance(latest, WeightsPublished)
    from rlfleet.common.control.messages import GenerateRequest, RewardStatsRequest

    generated = await fleet.client.request(
        subject(fleet.cluster, "rollout", "generate"),
        GenerateRequest(job_id="ok", prompt_token_ids=[[1, 2]]),
        timeout=60,
    )  # fmt: skip
    assert isinstance(generated, GenerateResult)
    stats = await fleet.client.request(
        next(s for s in subjects if s.endswith("reward.worker.reward-0")), RewardStatsRequest(), timeout=30
    )
    assert not isinstance(stats, ErrorReply)


def test_decode_refuses_what_json_loads_lets_through() -> None:
    """Bytes that Python's json reads but are no message become MessageDecodeError (so a reply goes back)."""
    base = '{"protocol": "2.0", "kind": "trainer.save", "path": %s}'
    for literal in [HUGE_INT, "NaN", "Infinity", "1e999", '"a\\ud800"', DEEP]:
        with pytest.raises(MessageDecodeError):
            decode((base % literal).encode())
    assert decode((base % '"a\\ud83d\\ude00"').encode()).path == "a\U0001f600"  # a real pair is fine
    for data in [b"", b"\xff\xfe\xfd", b"[" * 100_000]:
        with pytest.raises(MessageDecodeError):
            decode(data)


def test_the_stream_is_deterministic_and_never_acceptable() -> None:
    first, again = malformed_stream(seed=3, count=500), malformed_stream(seed=3, count=500)
    assert first == again and not any(_acceptable(d) for d in first)
    assert max(len(d) for d in malformed_stream(seed=0, count=2000)) < 1 << 20
