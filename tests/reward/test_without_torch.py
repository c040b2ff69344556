"""The reward server scores without torch (issue 35, point 6): rlfleet-common's tensor plane reads
the batch as numpy arrays where torch is not installed.

A child process in which ``import torch`` (and ``import transformers``) fails, as in a venv of
``pip install rlfleet-reward``, starts a real TensorStore gRPC server holding a batch's packed
texts, group indices and ``episode_reward`` as numpy arrays, and a real :class:`RewardWorker` (on an
in-process transport) that fetches them over gRPC and scores them: rule rewards for a tenant (the
sizes checked from the store's declaration and the offsets before the texts are fetched), the
``episode`` rule for the admin token, and a batch whose texts are not uint8 refused by name. In
``scripts/isolated_tests.py``'s reward venv torch is really absent and this runs the same way.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

CHILD = """
import sys
for name in ("torch", "transformers"):
    sys.modules[name] = None  # as where they are not installed: any import of them fails
import asyncio, json
import numpy as np
from rlfleet.common.control.inproc_transport import InProcessBroker, InProcessTransport
from rlfleet.common.control.messages import ScoreRequest
from rlfleet.common.control.transport import TOKEN_HEADER, subject
from rlfleet.common.errors import RemoteError
from rlfleet.common.schema.batch import pack_texts
from rlfleet.common.schema.config import load_config
from rlfleet.common.tensors.store import TensorStoreServer
from rlfleet.reward.service import RewardWorker, RewardWorkerConfig

CONFIG = {
    "fleet": {"cluster": "t"}, "worker_id": "reward-0", "quota_store": "process",
    "endpoints": {"digits": "charset:allowed=0123456789 + concise:max_words=1", "ep": "episode"},
    "tenants": [{"name": "team", "token": "team-token-0123", "endpoints": ["digits"], "max_batch": 8,
                 "limits": {"sample_bytes": 4096}}],
    "admin": {"token": "admin-token-0123"},
}


async def main():
    store = TensorStoreServer()
    await store.start()
    broker = InProcessBroker()
    server = InProcessTransport(broker, tier="reward", name="server")
    client = InProcessTransport(broker, tier="controller", name="client")
    worker = RewardWorker(load_config(RewardWorkerConfig, data=CONFIG), server)
    await worker.start()
    out = {}
    try:
        tensors = {"group_index": np.array([0, 0, 1], dtype=np.int64),
                   "episode_reward": np.array([0.5, 1.0, 0.25], dtype=np.float32)}
        tensors["prompt_text"], tensors["prompt_text_offsets"] = pack_texts(["n?", "n?", "m?"])
        tensors["response_text"], tensors["response_text_offsets"] = pack_texts(["42", "x y", "日本"])
        ref = store.put_local("batch", tensors)

        async def ask(job, endpoint, token, batch_ref):
            request = ScoreRequest(job_id=job, endpoint=endpoint, rollout=batch_ref)
            try:
                reply = await client.request(subject("t", "reward", "score"), request, timeout=30,
                                             headers={TOKEN_HEADER: token})
            except RemoteError as exc:
                return {"code": exc.code, "error": str(exc)}
            return {"scores": reply.scores, "components": reply.components}

        out["tenant"] = await ask("j1", "digits", "team-token-0123", ref)
        out["episode"] = await ask("j2", "ep", "admin-token-0123", ref)
        bad = dict(tensors, response_text=tensors["response_text"].astype(np.int16))
        out["bad"] = await ask("j3", "digits", "team-token-0123", store.put_local("bad", bad))
    finally:
        await worker.stop("test over")
        await client.close()
        await server.close()
        await store.stop()
    out["torch_blocked"] = sys.modules["torch"] is None
    print(json.dumps(out))


asyncio.run(main())
"""


def test_a_reward_worker_scores_a_batch_fetched_from_a_tensor_store_without_torch() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["torch_blocked"]
    tenant = out["tenant"]
    assert tenant["components"]["charset"] == [1.0, 0.0, 0.0], tenant  # '42' digits only; 'x y', '日本' not
    assert tenant["components"]["concise"][0] > tenant["components"]["concise"][1], tenant
    assert out["episode"]["components"]["episode"] == pytest.approx([0.5, 1.0, 0.25]), out["episode"]
    assert out["bad"]["code"] == "bad_request" and "uint8" in out["bad"]["error"], out["bad"]
