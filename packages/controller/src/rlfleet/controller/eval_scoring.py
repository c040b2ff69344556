"""Score evaluation answers on a reward tier: the built-in similarity and answer check, and reward specs.

The controller never imports the reward package; what it measures with a model (similarity: the
MiniLM cosine of question and answer) or with a rule (the ``numeric`` answer check) it asks of a
reward worker, through the same endpoints and score requests a run uses. The answers are put in the
controller's own TensorStore as a rollout batch (:func:`~rlfleet.controller.routing.text_batch`, as
a rollout fn's answers are), and each endpoint scores that batch:

- :func:`builtin_spec`: ``similarity`` against the question (metadata ``rlfleet_question``, added
  here), labelled ``similarity`` (not ``relevance``: that is the reward's word-recall term), and,
  when every prompt has an ``answer``, ``numeric`` labelled ``correct``;
- any reward spec (``--reward``): its total and each component.

:class:`EvalRewardTier` starts a reward worker of its own for ``rlfleet eval`` (a private
nats-server and one ``rlfleet-reward`` process, as an embedded run starts them); a training run
scores on its own reward worker, which serves the built-in endpoint beside the run's reward.
"""

from __future__ import annotations

import asyncio
import gc
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.common.control.messages import GenerateResult, ScoreResult
from rlfleet.common.schema.reward import Spec
from rlfleet.common.schema.worker import TensorPlaneSettings
from rlfleet.controller.dataset import PromptItem
from rlfleet.controller.eval_metrics import CORRECT, SIMILARITY
from rlfleet.controller.launcher import EmbeddedFleet, WorkerSpec
from rlfleet.controller.own_store import OwnStore
from rlfleet.controller.routing import text_batch

if TYPE_CHECKING:
    from rlfleet.common.control.transport import Transport
    from rlfleet.controller.fleet import Fleet
    from rlfleet.controller.reward_control import RewardControl

QUESTION_KEY = "rlfleet_question"
"""Metadata key holding the question text, for the similarity component."""
ANSWER_KEY = "answer"
"""Metadata key of a prompt's reference answer: such prompts are answer-checked (pass@k)."""
BUILTIN_ENDPOINT = "rlfleet-eval"
"""The endpoint scoring the built-in metrics (on the eval's own reward worker, or a run's)."""
CHUNK_PROMPTS = 64
"""Prompts per score request."""


def builtin_spec(check_answers: bool) -> dict[str, Any]:
    """Similarity (MiniLM cosine of question and answer), and the numeric answer check if asked."""
    components: list[dict[str, Any]] = [
        {"name": "similarity", "args": {"key": QUESTION_KEY}, "label": SIMILARITY, "weight": 1.0}
    ]
    if check_answers:
        components.append({"name": "numeric", "args": {"key": ANSWER_KEY}, "label": CORRECT, "weight": 0.0})
    return {"components": components}


def checks_answers(items: Sequence[PromptItem]) -> bool:
    """Whether every prompt carries a reference ``answer`` (then pass@k is measured)."""
    return bool(items) and all(ANSWER_KEY in item.metadata for item in items)


async def score_answers(
    control: RewardControl, store: OwnStore, endpoint: str, items: Sequence[PromptItem],
    questions: Sequence[str], answers: Sequence[Sequence[str]], tokenizer: Any,
) -> ScoreResult:  # fmt: skip
    """Score ``answers[i]`` (the samples of ``items[i]``) on ``endpoint`` of ``control`` (a reward
    tier); one result, item-major order."""
    server = await store.get()
    results: list[GenerateResult] = []
    metadata: list[list[dict[str, Any]]] = []
    longest = max(
        (len(tokenizer(a, add_special_tokens=False)["input_ids"]) for s in answers for a in s), default=0
    )
    for start in range(0, len(items), CHUNK_PROMPTS):
        part = list(items[start : start + CHUNK_PROMPTS])
        texts = [list(s) for s in answers[start : start + CHUNK_PROMPTS]]
        tensors, tokens = await asyncio.to_thread(text_batch, part, texts, tokenizer, longest + 1)
        job = f"eval-{uuid.uuid4().hex[:12]}"
        ref = server.put_local(f"eval/controller/{job}", tensors)
        results.append(GenerateResult(job_id=job, worker_id="controller", weight_version=0, ref=ref,
                                      num_prompts=len(part), num_samples=sum(map(len, texts)),
                                      num_tokens=tokens, seconds=0.0))  # fmt: skip
        metadata.append(
            [{**it.metadata, QUESTION_KEY: q} for it, q in zip(part, questions[start:], strict=False)]
        )
    try:
        job_ids = [r.job_id for r in results]
        scored = await control.score(results, metadata, endpoint, job_ids)
    finally:
        await store.release(results)
    merged = ScoreResult(job_id=scored[0].job_id, endpoint=endpoint, spec_version=scored[0].spec_version,
                         scores=[s for r in scored for s in r.scores])  # fmt: skip
    for name in scored[0].components:
        merged.components[name] = [v for r in scored for v in r.components.get(name, [])]
    return merged


class EvalRewardTier:
    """A private nats-server and one reward worker serving ``endpoints``, for ``rlfleet eval``.

    ``async with EvalRewardTier(endpoints) as tier:`` then ``await tier.score(...)``; everything it
    started is stopped on the way out. A worker that refuses its endpoints (a bad spec) raises
    :class:`~rlfleet.controller.errors.TierRefused` (a user error) while the tier starts.
    """

    def __init__(self, endpoints: dict[str, Spec], *, startup_timeout_s: float = 180.0) -> None:
        self.endpoints = endpoints
        self.startup_timeout_s = startup_timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="rlfleet-eval-")
        self.launcher = EmbeddedFleet(Path(self._tmp.name))
        self.store = OwnStore(TensorPlaneSettings(), listen_all=False)
        self.transport: Transport | None = None
        self.fleet: Fleet | None = None

    async def __aenter__(self) -> EvalRewardTier:
        try:
            await self._start()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _start(self) -> None:
        from rlfleet.common.control.nats_transport import NatsTransport
        from rlfleet.controller.fleet import Fleet
        from rlfleet.controller.reward_control import RewardControl

        cluster = f"eval-{uuid.uuid4().hex[:8]}"
        url = self.launcher.start_nats(cluster)
        state = Path(self._tmp.name) / "reward-state"
        config = {"cluster": cluster, "endpoints": self.endpoints, "state_dir": str(state)}
        self.launcher.spawn(WorkerSpec("reward", "reward-eval", config))
        auth = self.launcher.connection("controller")
        self.transport = await NatsTransport.connect(
            url, name="rlfleet-eval", tier="controller", auth=auth, env={}
        )
        fleet = self.fleet = Fleet(self.transport, cluster)
        await fleet.start()
        fleet.reward = RewardControl(self.transport, cluster, fleet.registry, token="")
        await self._wait_ready(fleet)

    async def _wait_ready(self, fleet: Fleet) -> None:
        """Wait for the worker to announce, checking it did not exit (a refused spec) meanwhile."""
        from rlfleet.controller.errors import TierNotReady

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout_s
        while loop.time() < deadline:
            self.launcher.check()  # raises when the worker exited (code 2: it refused its endpoints)
            try:
                await fleet.registry.wait_for("reward", 1, 0.5)
                return
            except TimeoutError:
                continue
        missing = [w.describe() for w in self.launcher.workers]
        raise TierNotReady(self.startup_timeout_s, missing, "the eval's reward worker did not announce")

    async def score(
        self, endpoint: str, items: Sequence[PromptItem], questions: Sequence[str],
        answers: Sequence[Sequence[str]], tokenizer: Any,
    ) -> ScoreResult:  # fmt: skip
        assert self.fleet is not None and self.fleet.reward is not None, (
            "async with EvalRewardTier(...) first"
        )
        return await score_answers(
            self.fleet.reward, self.store, endpoint, items, questions, answers, tokenizer
        )

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.store.stop()
            if self.fleet is not None:
                await self.fleet.close()
            if self.transport is not None:
                await self.transport.close()
        finally:
            self.launcher.stop()
            self._tmp.cleanup()
            gc.collect()  # a stopped gRPC server collected later, on a closed loop, would complain
