"""Request deadlines scaled to the work (issue 12, point 6): the bounds of controller/request_policy.py,
and a run's requests (Fleet and RewardControl over the in-process transport, with tiers that answer
as the real ones do) carrying them instead of one fixed 900 s."""

from __future__ import annotations

import time
from collections.abc import Mapping

import pytest

from rlfleet.common.control.inproc_transport import InProcessBroker, InProcessTransport
from rlfleet.common.control.membership import WorkerRegistry
from rlfleet.common.control.messages import (
    AnyMessage,
    CheckpointLoaded,
    GenerateRequest,
    GenerateResult,
    LoadCheckpoint,
    LoadWeights,
    Message,
    PublishWeights,
    SamplingParams,
    SaveCheckpoint,
    Saved,
    ScoreRequest,
    ScoreResult,
    TrainerConfigure,
    TrainerConfigured,
    TrainStepRequest,
    TrainStepResult,
    WeightsLoaded,
    WeightsPublished,
    WorkerAnnounce,
)
from rlfleet.common.control.transport import membership_subject, subject, worker_subject
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.trainer import ModelSettings, StepSettings
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.fault_settings import FaultSettings
from rlfleet.controller.fleet import Fleet
from rlfleet.controller.request_policy import FLOOR_S, MAX_S, UNKNOWN_MODEL_BYTES, Deadlines
from rlfleet.controller.reward_control import RewardControl
from rlfleet.controller.watchdog import MAX_EXTENSIONS

CLUSTER = "unit"
MIB = 2**20


def _generate(prompts: int, prompt_len: int, n: int, max_tokens: int) -> GenerateRequest:
    sampling = SamplingParams(n=n, max_tokens=max_tokens)
    return GenerateRequest(job_id="j", prompt_token_ids=[[1] * prompt_len] * prompts, sampling=sampling)


def _result(samples: int, tokens: int, nbytes: int = 0) -> GenerateResult:
    ref = TensorRef(address="a:1", key="k", nbytes=nbytes)
    return GenerateResult(job_id="j", worker_id="r", weight_version=0, ref=ref, num_prompts=1,
                          num_samples=samples, num_tokens=tokens)  # fmt: skip


# --- the bounds --------------------------------------------------------------------------------


def test_no_work_gets_the_outage_allowance_and_the_floor() -> None:
    faults = FaultSettings()
    deadlines = Deadlines(faults=faults)
    assert deadlines.control() == pytest.approx(faults.outage_grace_s + FLOOR_S)
    tiny = deadlines.generate(_generate(prompts=1, prompt_len=8, n=2, max_tokens=8))
    assert deadlines.control() < tiny < deadlines.control() + 2  # a tiny step: seconds of work, not 900


def test_generate_scales_with_samples_and_tokens_and_is_tighter_on_a_gpu() -> None:
    deadlines = Deadlines()
    base = deadlines.control()
    small = deadlines.generate(_generate(prompts=4, prompt_len=40, n=8, max_tokens=96)) - base
    double_n = deadlines.generate(_generate(prompts=4, prompt_len=40, n=16, max_tokens=96)) - base
    double_len = deadlines.generate(_generate(prompts=4, prompt_len=40, n=8, max_tokens=192)) - base
    assert double_n == pytest.approx(2 * small)
    assert 1.9 * small < double_len < 2 * small  # prompt tokens count a tenth
    gpu = deadlines.generate(_generate(prompts=4, prompt_len=40, n=8, max_tokens=96), ["GPU-1"]) - base
    assert gpu < small / 10


def test_the_cpu_bounds_leave_room_for_two_slow_cores() -> None:
    """The SmolLM2-135M example on two loaded cores: a chunk of 32 samples x 96 tokens generates in
    about 15 s and its step trains in about 12 s; each deadline leaves ten times that."""
    deadlines = Deadlines()
    chunk = _generate(prompts=4, prompt_len=40, n=8, max_tokens=96)
    assert deadlines.generate(chunk) - deadlines.control() > 10 * 15
    batch_bytes = 32 * (40 + 96) * 40  # ids, masks, logprobs and texts of 32 samples
    train = deadlines.train_step([TensorRef(address="a:1", key="k", nbytes=batch_bytes)])
    assert train - deadlines.control() > 10 * 12
    assert deadlines.score(_result(samples=32, tokens=32 * 96)) - deadlines.control() > 10 * 1


def test_score_train_and_weights_scale_with_their_work() -> None:
    deadlines = Deadlines()
    base = deadlines.control()
    assert deadlines.score(_result(64, 6400)) - base == pytest.approx(
        2 * (deadlines.score(_result(32, 3200)) - base)
    )
    one = deadlines.train_step([TensorRef(address="a:1", key="k", nbytes=MIB)]) - base
    two = deadlines.train_step([TensorRef(address="a:1", key="k", nbytes=MIB)] * 2) - base
    assert two == pytest.approx(2 * one)
    assert deadlines.train_step([TensorRef(address="a:1", key="k", nbytes=MIB)], ["GPU-1"]) - base < one / 10
    load = LoadWeights(weight_version=1, buckets=[TensorRef(address="a:1", key="b", nbytes=160 * MIB)])
    assert deadlines.load_weights(load) - base == pytest.approx(10.0)  # 160 MiB at 16 MiB/s


def test_model_size_is_learned_from_the_last_publish() -> None:
    deadlines = Deadlines()
    unknown = deadlines.publish()
    assert unknown - deadlines.control() == pytest.approx(UNKNOWN_MODEL_BYTES / (64 * MIB))
    deadlines.published(540 * MIB)  # SmolLM2-135M in fp32
    assert deadlines.publish() < unknown
    assert deadlines.checkpoint(full=True) - deadlines.control() == pytest.approx(
        4 * (deadlines.checkpoint(full=False) - deadlines.control())
    )
    deadlines.published(0)  # a publish that did not say keeps what was learned
    assert deadlines.model_bytes == 540 * MIB


def test_override_scale_and_ceiling() -> None:
    fixed = Deadlines(override=42.0)
    assert fixed.control() == fixed.generate(_generate(1000, 100, 16, 4096)) == fixed.publish() == 42.0
    slow = Deadlines(faults=FaultSettings(deadline_scale=3.0))
    assert slow.control() == pytest.approx(3 * Deadlines().control())
    assert Deadlines().generate(_generate(4096, 100, 64, 1 << 16)) == MAX_S
    with pytest.raises(ValueError, match="request_timeout_s"):
        Deadlines(override=0.0)


def test_the_job_setting_is_scaled_unless_set() -> None:
    assert TrainerConfig().request_timeout_s is None
    assert TrainerConfig(request_timeout_s=60).request_timeout_s == 60
    with pytest.raises(ValueError):
        FaultSettings(deadline_scale=0)


# --- a run's requests carry them ---------------------------------------------------------------


class Recording(InProcessTransport):
    """The controller's transport, remembering each request's kind and deadline."""

    def __init__(self, broker: InProcessBroker) -> None:
        super().__init__(broker, name="controller")
        self.sent: list[tuple[str, float]] = []

    async def request(
        self, subject: str, message: Message, *, timeout: float, tier: str = "",
        headers: Mapping[str, str] | None = None,
    ) -> AnyMessage:  # fmt: skip
        self.sent.append((message.kind, timeout))
        return await super().request(subject, message, timeout=timeout, tier=tier, headers=headers)

    def timeout_of(self, kind: str) -> float:
        (timeout,) = {t for k, t in self.sent if k == kind}
        return timeout


BATCH = TensorRef(address="r:1", key="rollout/j", nbytes=64 * 1024)
BUCKET = TensorRef(address="t:1", key="bucket-0", nbytes=32 * MIB)


class Tiers:
    """One rollout worker, one trainer and one reward worker that answer at once."""

    def __init__(self, broker: InProcessBroker) -> None:
        self.transport = InProcessTransport(broker, name="tiers")
        self.generate_deadlines: list[float | None] = []  # each generate request's deadline, as it came
        self.score_deadlines: list[float | None] = []  # each score request's

    async def start(self) -> None:
        own = worker_subject(CLUSTER, "rollout", "rollout-0")
        await self.transport.subscribe(own, self._rollout)
        for verb in ("configure", "step", "publish", "save", "load"):
            await self.transport.subscribe(subject(CLUSTER, "trainer", verb), self._trainer)
        await self.transport.subscribe(subject(CLUSTER, "reward", "score"), self._reward)
        for tier, worker_id in (("rollout", "rollout-0"), ("trainer", "trainer-0"), ("reward", "reward-0")):
            announce = WorkerAnnounce(tier=tier, worker_id=worker_id, weight_version=0,
                                      subject=worker_subject(CLUSTER, tier, worker_id))  # fmt: skip
            await self.transport.publish(membership_subject(CLUSTER, tier), announce)

    async def _rollout(self, message: AnyMessage) -> AnyMessage:
        if isinstance(message, LoadWeights):
            assert message.job_id, "a weight load carries a job id (the worker answers a repeat once)"
            return WeightsLoaded(worker_id="rollout-0", weight_version=message.weight_version)
        assert isinstance(message, GenerateRequest)
        self.generate_deadlines.append(message.deadline)
        n = len(message.prompt_token_ids) * message.sampling.n
        return GenerateResult(job_id=message.job_id, worker_id="rollout-0", weight_version=0, ref=BATCH,
                              num_prompts=len(message.prompt_token_ids), num_samples=n,
                              num_tokens=n * message.sampling.max_tokens)  # fmt: skip

    async def _trainer(self, message: AnyMessage) -> AnyMessage:
        if isinstance(message, TrainerConfigure):
            return TrainerConfigured(worker_id="trainer-0", weight_version=0)
        if isinstance(message, TrainStepRequest):
            return TrainStepResult(step=message.step, metrics={}, weight_version=0)
        if isinstance(message, PublishWeights):
            return WeightsPublished(weight_version=1, buckets=[BUCKET], nbytes=BUCKET.nbytes, seconds=0.1)
        if isinstance(message, SaveCheckpoint):
            return Saved(path=message.path)
        assert isinstance(message, LoadCheckpoint)
        return CheckpointLoaded(path=message.path, steps=1, weight_version=1)

    async def _reward(self, message: AnyMessage) -> AnyMessage:
        assert isinstance(message, ScoreRequest)
        self.score_deadlines.append(message.deadline)
        return ScoreResult(
            job_id=message.job_id, endpoint=message.endpoint, spec_version="s-r1", scores=[0.0]
        )


@pytest.mark.timeout(30)
async def test_a_run_s_requests_carry_deadlines_scaled_to_their_work() -> None:
    broker = InProcessBroker()
    transport = Recording(broker)
    faults = FaultSettings(outage_grace_s=30.0)
    fleet = Fleet(transport, CLUSTER, faults=faults)  # what run.py builds with request_timeout_s unset
    tiers = Tiers(broker)
    await fleet.start()
    await tiers.start()
    await fleet.wait_ready({"rollout": 1, "trainer": 1, "reward": 1}, timeout=5)
    fleet.reward = RewardControl(transport, CLUSTER, fleet.registry, token="", faults=faults)
    try:
        model = ModelSettings()
        await fleet.configure_trainer(TrainerConfigure(model=model, device="cpu", critic=False))
        sampling = SamplingParams(n=4, max_tokens=32)
        results = await fleet.generate([[1, 2, 3]] * 2, sampling, weight_version=0)
        await fleet.score(results, [[{}, {}]], "default")
        await fleet.train_step(1, [r.ref for r in results], [0.0] * 8, StepSettings())
        published = await fleet.publish_weights(64.0)
        await fleet.load_weights(published)
        await fleet.save("/tmp/x", mode="full")
        await fleet.load_checkpoint("/tmp/x", 1)
    finally:
        await fleet.close()
    expected = Deadlines(faults=faults)
    request = GenerateRequest(job_id="j", prompt_token_ids=[[1, 2, 3]] * 2, sampling=sampling)
    assert transport.timeout_of("trainer.configure") == expected.control()
    assert transport.timeout_of("rollout.generate") == expected.generate(request)
    assert transport.timeout_of("reward.score") == expected.score(results[0])
    (score_deadline,) = tiers.score_deadlines  # the time the controller stops waiting, for the server
    waits = expected.score(results[0]) * (1 + MAX_EXTENSIONS)
    assert score_deadline is not None and score_deadline - waits <= time.time() <= score_deadline - waits + 30
    assert transport.timeout_of("trainer.step") == expected.train_step([BATCH])
    assert transport.timeout_of("trainer.publish") == expected.publish()  # before the size was known
    expected.published(BUCKET.nbytes)
    load = LoadWeights(weight_version=1, buckets=[BUCKET])
    assert transport.timeout_of("rollout.load_weights") == expected.load_weights(load)
    assert (
        transport.timeout_of("trainer.save")
        == transport.timeout_of("trainer.load")
        == expected.checkpoint(True)
    )
    assert max(t for _, t in transport.sent) < 900.0  # a tiny run's requests: far below the old fixed 900 s


@pytest.mark.timeout(30)
async def test_request_timeout_s_fixes_every_deadline() -> None:
    broker = InProcessBroker()
    transport = Recording(broker)
    fleet = Fleet(transport, CLUSTER, request_timeout=77.0)
    tiers = Tiers(broker)
    await fleet.start()
    await tiers.start()
    await fleet.wait_ready({"rollout": 1, "trainer": 1}, timeout=5)
    try:
        results = await fleet.generate([[1]] * 3, SamplingParams(), weight_version=0)
        await fleet.train_step(1, [r.ref for r in results], [0.0] * 3, StepSettings())
        await fleet.publish_weights(64.0)
    finally:
        await fleet.close()
    assert {t for _, t in transport.sent} == {77.0}
    registry = WorkerRegistry(transport, CLUSTER)
    assert (
        RewardControl(transport, CLUSTER, registry, token="", request_timeout=5.0).deadlines.control() == 5.0
    )


@pytest.mark.timeout(30)
async def test_a_generate_request_carries_the_time_the_controller_stops_waiting() -> None:
    """Issue 29, point 5: the worker cancels a job at its deadline, so the deadline is the longest the
    controller waits on that try: its timeout, granted again up to MAX_EXTENSIONS times to a busy worker."""
    broker = InProcessBroker()
    fleet = Fleet(Recording(broker), CLUSTER, request_timeout=77.0)
    tiers = Tiers(broker)
    await fleet.start()
    await tiers.start()
    await fleet.wait_ready({"rollout": 1}, timeout=5)
    before = time.time()
    try:
        await fleet.generate([[1]] * 3, SamplingParams(), weight_version=0)
    finally:
        await fleet.close()
    after = time.time()
    waits = 77.0 * (1 + MAX_EXTENSIONS)
    (deadline,) = tiers.generate_deadlines
    assert deadline is not None and before + waits <= deadline <= after + waits
    assert GenerateRequest(job_id="j", prompt_token_ids=[[1]]).deadline is None  # an older controller's
