"""The ``cuda_ipc`` weight carrier on a GPU: a trainer-side publish loaded in place by vLLM and HF engines.

GPU-only (``gpu`` marker; skipped without CUDA). The producer must be another process: CUDA will
not map an IPC handle in the process that made it. For vLLM that is the engine core, which runs
in its own process; for the HF engine the test starts a producer process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfleet.common.control.messages import SamplingParams
from rlfleet.common.schema.carriers import IpcBucket
from rlfleet.rollout.engines import HFEngine
from rlfleet.rollout.engines.cuda_ipc import device_uuid
from rlfleet.rollout.errors import IpcUnavailable
from rlfleet.trainer.ipc_share import share_bucket
from rlfleet.trainer.weights import iter_weight_buckets

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[30, 11, 8, 15], [5, 40, 6], [50, 60, 44, 9, 13, 21]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PRODUCER = """
import sys, torch
from transformers import AutoModelForCausalLM
from rlfleet.trainer.ipc_share import share_bucket
from rlfleet.trainer.weights import iter_weight_buckets
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).cuda()
buckets = list(iter_weight_buckets(model, bucket_bytes=20_000, on_device=True))
torch.cuda.synchronize()
for b in buckets:
    print(share_bucket(b).model_dump_json(), flush=True)
print("END", flush=True)
sys.stdin.read()  # keep the buffers until the test is done with them
"""


def _expected(path: Path) -> list[list[int]]:
    return [c.token_ids for c in HFEngine(path, device="cuda").generate(PROMPTS, GREEDY)]


@pytest.mark.timeout(600)
def test_vllm_loads_a_publish_by_cuda_ipc(make_vllm_checkpoint) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from rlfleet.rollout.engines.vllm import VLLMEngine

    engine = VLLMEngine(make_vllm_checkpoint(seed=0), device="cuda", enforce_eager=True, max_model_len=128,
                        gpu_memory_utilization=0.3)  # fmt: skip
    try:
        assert engine.gpu_uuids == [device_uuid(0)]
        target = make_vllm_checkpoint(seed=1)
        model = AutoModelForCausalLM.from_pretrained(target).cuda()
        buckets = list(iter_weight_buckets(model, bucket_bytes=20_000, on_device=True))
        shared = [share_bucket(b) for b in buckets]
        assert len(shared) > 1 and all(b.gpu_uuid == device_uuid(0) for b in shared)
        engine.load_ipc(shared, version=1)  # the engine core (another process) maps the buffers
        assert engine.weight_version == 1
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == _expected(target)
        with pytest.raises(IpcUnavailable, match="another|GPU"):
            engine.load_ipc([shared[0].model_copy(update={"gpu_uuid": "GPU-00000000-elsewhere"})])
    finally:
        engine.close()


@pytest.mark.timeout(300)
def test_hf_engine_loads_a_publish_from_another_process(make_vllm_checkpoint) -> None:
    engine = HFEngine(make_vllm_checkpoint(seed=0), device="cuda")  # (a fixture this folder loads)
    target = make_vllm_checkpoint(seed=1)
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER, str(target)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert producer.stdout is not None
        shared = []
        for line in producer.stdout:
            if line.strip() == "END":
                break
            shared.append(IpcBucket.model_validate_json(line))
        assert shared, "the producer shared nothing"
        engine.load_ipc(shared, version=3)
        assert engine.weight_version == 3
        expected = HFEngine(target).generate(PROMPTS, GREEDY)
        assert [c.token_ids for c in engine.generate(PROMPTS, GREEDY)] == [c.token_ids for c in expected]
    finally:
        producer.communicate(input="", timeout=60)
