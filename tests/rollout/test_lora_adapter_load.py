"""A published LoRA adapter in the engines (issue 32, point 2): the HF engine applies it, so that
its logprobs become those of the base plus the adapter; a second adapter replaces the first (a layer
it leaves out goes back to its base); a bad adapter is refused naming the tensor and changes
nothing; a real rollout worker loads one over gRPC and answers its fingerprint, and a worker that
joins late gets the base plus the current adapter. The vLLM CPU build serves an adapter without a
restart (tests/rollout/test_vllm_lora_adapter.py).

The adapters and the models expected to serve them come from lora_adapters.py (this folder).
"""

from __future__ import annotations

import pytest
import torch
from lora_adapters import (
    RANK,
    SETTINGS,
    adapted_model,
    make_adapter,
    teacher_forced,
)  # (this folder's helper)
from real_worker import WORKER_CLUSTER as CLUSTER  # (this folder's helper)
from real_worker import running_worker
from transformers import AutoModelForCausalLM

from rlfleet.common.control.messages import (
    AnyMessage,
    LatestWeights,
    LoadWeights,
    SamplingParams,
    WeightsLoaded,
    WeightsPublished,
)
from rlfleet.common.control.nats_transport import NatsTransport
from rlfleet.common.control.transport import subject
from rlfleet.common.errors import RemoteError
from rlfleet.common.tensors.server import TensorStoreServer
from rlfleet.common.tensors.weight_sync import fingerprint
from rlfleet.rollout.engines.hf import HFEngine
from rlfleet.rollout.errors import BadAdapter
from rlfleet.rollout.service import RolloutWorker

pytestmark = pytest.mark.timeout(120)


def engine_logprobs(engine: HFEngine, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    (done,) = engine.generate([prompt], SamplingParams(n=1, max_tokens=8, temperature=1.0, seed=3))
    return done.token_ids, torch.tensor(done.logprobs)


PROMPT = [2, 10, 11, 12, 13, 14]


def test_the_hf_engine_serves_the_base_plus_the_adapter_and_a_new_adapter_replaces_it(
    make_checkpoint,  # noqa: ANN001
) -> None:
    path = make_checkpoint(seed=0)
    engine = HFEngine(path)
    base = AutoModelForCausalLM.from_pretrained(path).eval()
    first = make_adapter(path, SETTINGS.target_modules, seed=1)
    engine.load_adapter(first, SETTINGS, version=1)
    assert engine.weight_version == 1
    tokens, got = engine_logprobs(engine, PROMPT)
    want = teacher_forced(adapted_model(path, first), PROMPT, tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # the adapter's logprobs ...
    assert (got - teacher_forced(base, PROMPT, tokens)).abs().max() > 1e-2  # ... not the base's

    second_settings = SETTINGS.model_copy(update={"target_modules": ["q_proj"]})
    second = make_adapter(path, ["q_proj"], seed=2)
    engine.load_adapter(second, second_settings, version=2)
    held, expected = engine.model.state_dict(), adapted_model(path, second).state_dict()
    for name, tensor in expected.items():  # v_proj and down_proj back to the base, q_proj the new adapter's
        torch.testing.assert_close(held[name], tensor, atol=1e-6, rtol=0, msg=name)
    tokens, got = engine_logprobs(engine, PROMPT)
    torch.testing.assert_close(got, teacher_forced(adapted_model(path, second), PROMPT, tokens), atol=1e-5,
                               rtol=1e-5)  # fmt: skip


def _broken(adapter: dict[str, torch.Tensor], how: str) -> dict[str, torch.Tensor]:
    bad = dict(adapter)
    name = next(n for n in bad if n.endswith("lora_A.weight"))
    if how == "unknown layer":
        bad[name.replace("q_proj", "nope_proj")] = bad.pop(name)
        bad.pop(name.replace("lora_A", "lora_B"))
    elif how == "not an adapter name":
        bad["model.layers.0.self_attn.q_proj.weight"] = bad.pop(name)
    elif how == "wrong shape":
        bad[name] = torch.zeros(RANK, 3)
    elif how == "other rank":
        bad[name] = torch.zeros(RANK + 1, bad[name].shape[1])
    elif how == "non-finite":
        bad[name] = bad[name].clone()
        bad[name][0, 0] = float("nan")
    elif how == "missing half":
        bad.pop(name.replace("lora_A", "lora_B"))
    elif how == "integer":
        bad[name] = bad[name].to(torch.int64)
    return bad


@pytest.mark.parametrize(
    "how",
    [
        "unknown layer",
        "not an adapter name",
        "wrong shape",
        "other rank",
        "non-finite",
        "missing half",
        "integer",
    ],
)
def test_a_bad_adapter_is_refused_naming_the_tensor_and_changes_nothing(
    make_checkpoint,  # noqa: ANN001
    how: str,
) -> None:
    path = make_checkpoint(seed=0)
    engine = HFEngine(path)
    good = make_adapter(path, SETTINGS.target_modules, seed=1)
    engine.load_adapter(good, SETTINGS, version=1)
    before = {n: t.clone() for n, t in engine.model.state_dict().items()}
    with pytest.raises(BadAdapter, match="LoRA adapter refused") as caught:
        engine.load_adapter(_broken(good, how), SETTINGS, version=2)
    assert caught.value.tensor or how == "missing half"
    assert engine.weight_version == 1
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{how}: {name} changed"


async def _load(control: NatsTransport, worker: RolloutWorker, message: LoadWeights) -> WeightsLoaded:
    reply = await control.request(worker.own_subject, message, timeout=30, tier="rollout")
    assert isinstance(reply, WeightsLoaded), reply
    return reply


async def test_a_worker_loads_an_adapter_over_grpc_and_a_late_worker_gets_base_plus_adapter(
    worker: RolloutWorker,
    store: TensorStoreServer,
    control: NatsTransport,
    nats,
    make_checkpoint,  # noqa: ANN001
) -> None:
    path = make_checkpoint(seed=0)
    adapter = make_adapter(path, SETTINGS.target_modules, seed=1)
    names = sorted(adapter)
    refs = [store.put_local("weights/v1/0", {n: adapter[n] for n in names[: len(names) // 2]}),
            store.put_local("weights/v1/1", {n: adapter[n] for n in names[len(names) // 2 :]})]  # fmt: skip
    published_fp = fingerprint((n, t) for ref in refs for n, t in store.get_local(ref.key).items())
    loaded = await _load(control, worker, LoadWeights(weight_version=1, buckets=refs, adapter=SETTINGS,
                                                      job_id="adapter-1"))  # fmt: skip
    assert loaded.weight_version == 1 and loaded.fingerprint == published_fp
    expected = adapted_model(path, adapter).state_dict()
    for name, tensor in worker.engine.model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=name)

    # an adapter that does not fit the model is refused with the worker's version unchanged
    wrong = store.put_local("weights/v2/0", make_adapter(path, ["q_proj"], seed=5, rank=RANK + 2))
    with pytest.raises(RemoteError, match="LoRA adapter refused"):
        await _load(control, worker, LoadWeights(weight_version=2, buckets=[wrong], adapter=SETTINGS,
                                                 job_id="adapter-2"))  # fmt: skip
    assert worker.weight_version == 1

    # a late worker: the trainer (a stand-in answering trainer.latest) holds version 1, the adapter
    nbytes = sum(r.nbytes for r in refs)
    published = WeightsPublished(weight_version=1, buckets=refs, nbytes=nbytes, seconds=0.0,
                                 fingerprint=published_fp, adapter=SETTINGS)  # fmt: skip

    async def latest(message: AnyMessage) -> AnyMessage:
        assert isinstance(message, LatestWeights)
        return published

    await control.subscribe(subject(CLUSTER, "trainer", "latest"), latest)
    async with running_worker(nats.url, path, "rollout-late", catch_up_timeout_s=5) as late:
        assert late.weight_version == 1
        for name, tensor in late.engine.model.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0, msg=name)
