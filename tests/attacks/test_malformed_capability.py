"""A malformed capability is a bad message at the wire, not a worker's internal error (issue 29).

A capability is the hex HMAC-SHA256 of a key (64 characters, :mod:`rlfleet.common.tensors.guard`) or
nothing. Before this check any string up to 128 characters was accepted and went on into the
worker's gRPC calls (an outside test found one that ended in an internal error with a traceback).
Now :func:`decode` refuses the message with :class:`MessageDecodeError` (wire code
``bad_message``), naming the field, and a real store still opens the key with a well-formed one.
"""

from __future__ import annotations

import json

import pytest
import torch

from rlfleet.common.control.messages import ScoreRequest, decode, encode
from rlfleet.common.errors import MessageDecodeError
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.tensors.server import TensorStoreServer
from rlfleet.common.tensors.store import TensorStoreClient

pytestmark = pytest.mark.timeout(60)

GOOD = "0" * 64


@pytest.mark.parametrize("capability", ["x\ny", "é" * 64, "Z" * 64, "0" * 63, "0" * 65, "0" * 128])
def test_a_malformed_capability_is_a_bad_message(capability: str) -> None:
    message = ScoreRequest(job_id="j", rollout=TensorRef(address="127.0.0.1:1", key="k", capability=GOOD))
    data = json.loads(encode(message))
    data["rollout"]["capability"] = capability
    with pytest.raises(MessageDecodeError, match="capability"):
        decode(json.dumps(data).encode())


def test_a_well_formed_capability_or_none_decodes() -> None:
    for capability in (GOOD, "a" * 64, ""):
        ref = TensorRef(address="127.0.0.1:1", key="k", capability=capability)
        assert decode(encode(ScoreRequest(job_id="j", rollout=ref))).rollout.capability == capability


async def test_a_real_store_opens_a_key_with_its_capability() -> None:
    server = TensorStoreServer()
    await server.start()
    try:
        ref = server.put_local("k", {"x": torch.arange(3)})
        assert len(ref.capability) == 64
        wire = decode(encode(ScoreRequest(job_id="j", rollout=ref))).rollout  # as a reader gets it
        async with TensorStoreClient(server.address) as reader:
            assert torch.equal((await reader.fetch(wire))["x"], torch.arange(3))
    finally:
        await server.stop()
