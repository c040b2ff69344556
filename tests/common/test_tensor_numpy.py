"""The tensor plane without torch: numpy arrays decoded, stored and sent on the same wire format.

rlfleet-common installs without its ``torch`` extra for the reward server. There the codec decodes
into numpy arrays; these tests check that a numpy decode holds exactly the bytes, shape and dtype
of the torch decode for every dtype numpy has, that bf16 and fp8 are refused by name, that the
assembler's hostile-input checks hold on the numpy path too, that numpy arrays sent (or stored)
arrive as the same torch tensors, that texts pack and unpack as numpy arrays, and (in a process
where ``import torch`` fails) that the tensor plane serves and fetches with numpy alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from rlfleet.common.errors import (
    BatchContractError,
    ChecksumMismatch,
    MalformedChunk,
    MessageTooLarge,
    ShapeMismatch,
    StreamTruncated,
    UnknownDtype,
)
from rlfleet.common.schema.batch import pack_texts, unpack_texts
from rlfleet.common.tensors.codec import (
    DTYPES,
    NUMPY_DTYPES,
    Chunk,
    assemble_tensors,
    bytes_to_array,
    bytes_to_tensor,
    dtype_name,
    split_tensors,
    tensor_buffer,
)
from rlfleet.common.tensors.local import LocalTensorStore
from rlfleet.common.tensors.server import TensorStoreServer
from rlfleet.common.tensors.store import TensorStoreClient

torch = pytest.importorskip("torch")  # the comparisons with torch's decode; the last test runs without it

pytestmark = pytest.mark.timeout(120)

SHAPES = [(), (0,), (7,), (3, 5), (2, 0, 4), (4, 3, 2)]
NOT_IN_NUMPY = sorted(set(DTYPES) - set(NUMPY_DTYPES))


def _random_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Arbitrary bit patterns of safetensors dtype ``name`` (NaNs, infinities, denormals); bools 0/1."""
    dtype = DTYPES[name]
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    numel = int(np.prod(shape)) if shape else 1
    return (
        torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
        .view(dtype)
        .reshape(shape)
    )


def test_numpy_has_every_dtype_but_bf16_and_fp8() -> None:
    assert NOT_IN_NUMPY == ["BF16", "F8_E4M3", "F8_E5M2"]
    for name, dtype in NUMPY_DTYPES.items():
        assert dtype_name(dtype) == name
        assert dtype.itemsize == DTYPES[name].itemsize


@pytest.mark.parametrize("name", sorted(NUMPY_DTYPES))
def test_the_numpy_decode_of_every_dtype_equals_the_torch_decode_byte_for_byte(name: str) -> None:
    tensors = {f"t{i}": _random_tensor(name, shape, seed=i) for i, shape in enumerate(SHAPES)}
    chunks = list(split_tensors("k", tensors, chunk_bytes=16))  # several chunks per tensor
    as_torch = assemble_tensors(chunks, arrays="torch")
    as_numpy = assemble_tensors(chunks, arrays="numpy")
    assert list(as_numpy) == list(as_torch) == list(tensors)
    for key, tensor in as_torch.items():
        array = as_numpy[key]
        assert isinstance(array, np.ndarray) and isinstance(tensor, torch.Tensor)
        assert array.shape == tuple(tensor.shape) and array.dtype == NUMPY_DTYPES[name]
        assert array.tobytes() == bytes(tensor_buffer(tensor)) == bytes(tensor_buffer(tensors[key]))
        raw = bytes(tensor_buffer(tensor))
        assert bytes_to_array(raw, name, array.shape).tobytes() == bytes(
            tensor_buffer(bytes_to_tensor(raw, name, array.shape))
        )


@pytest.mark.parametrize("name", sorted(NUMPY_DTYPES))
def test_numpy_arrays_sent_arrive_as_the_torch_tensors_of_their_bytes(name: str) -> None:
    arrays = {
        "a": _random_tensor(name, (3, 4), seed=1).numpy(),
        "s": _random_tensor(name, (), seed=2).numpy(),
    }
    arrays["t"] = arrays["a"].T  # not contiguous: sent row-major, as torch sends a transposed tensor
    got = assemble_tensors(split_tensors("k", arrays, chunk_bytes=8), arrays="torch")
    for key, array in arrays.items():
        assert got[key].dtype == DTYPES[name] and tuple(got[key].shape) == array.shape
        assert bytes(tensor_buffer(got[key])) == np.ascontiguousarray(array).tobytes()


@pytest.mark.parametrize("name", NOT_IN_NUMPY)
def test_bf16_and_fp8_are_refused_by_name_on_the_numpy_path(name: str) -> None:
    chunks = list(split_tensors("k", {"w": _random_tensor(name, (4,), seed=0)}))
    with pytest.raises(UnknownDtype, match=f"{name}.*needs torch") as info:
        assemble_tensors(chunks, arrays="numpy")
    assert info.value.name == "w"
    with pytest.raises(UnknownDtype, match=name):
        bytes_to_array(b"\x00" * 8, name, (4,))


def test_numpy_dtypes_outside_safetensors_are_refused() -> None:
    for array in (np.zeros(2, dtype=np.complex64), np.zeros(2, dtype=">f4"), np.array(["a"])):
        with pytest.raises(UnknownDtype):
            list(split_tensors("k", {"x": array}))
    with pytest.raises(TypeError, match="list"):
        LocalTensorStore(capacity_bytes=1 << 20, ttl_s=60).put("k", {"x": [1, 2]})


def _stream(**arrays: np.ndarray) -> list[Chunk]:
    return list(split_tensors("k", arrays, chunk_bytes=8))


def test_hostile_streams_are_refused_on_the_numpy_path_as_on_the_torch_path() -> None:
    chunks = _stream(a=np.arange(4, dtype=np.float32), b=np.arange(4, dtype=np.int64))
    damaged = bytearray(chunks[0].data)
    damaged[0] ^= 1
    cases: dict[type[Exception], list[Chunk]] = {
        ShapeMismatch: [
            dataclasses.replace(c, total_bytes=c.total_bytes + 4) if c.name == "a" else c for c in chunks
        ],
        ChecksumMismatch: [dataclasses.replace(chunks[0], data=bytes(damaged)), *chunks[1:]],
        StreamTruncated: chunks[:-1],
        MalformedChunk: [dataclasses.replace(chunks[0], shape=(-4,)), *chunks[1:]],
        UnknownDtype: [dataclasses.replace(c, dtype="F7") if c.name == "a" else c for c in chunks],
    }
    for error, stream in cases.items():
        for arrays in ("numpy", "torch"):
            with pytest.raises(error):
                assemble_tensors(stream, arrays=arrays)
    with pytest.raises(MessageTooLarge, match="tensor stream"):
        assemble_tensors(chunks, max_total_bytes=47, arrays="numpy")  # 16 + 32 bytes announced
    with pytest.raises(MessageTooLarge):
        assemble_tensors(chunks, max_chunk_bytes=4, arrays="numpy")
    with pytest.raises(ShapeMismatch):
        bytes_to_array(b"\x00" * 7, "F32", (2,))


def test_texts_pack_and_unpack_as_numpy_arrays() -> None:
    texts = ["hé", "", "日本", "plain"]
    data, offsets = pack_texts(texts, arrays="numpy")
    assert isinstance(data, np.ndarray) and data.dtype == np.uint8 and offsets.dtype == np.int64
    assert unpack_texts(data, offsets) == texts
    as_torch = pack_texts(texts)
    assert data.tobytes() == bytes(tensor_buffer(as_torch[0])) and offsets.tolist() == as_torch[1].tolist()
    assert unpack_texts(*pack_texts([], arrays="numpy")) == []
    with pytest.raises(BatchContractError, match="uint8"):
        unpack_texts(data.astype(np.int16), offsets)
    with pytest.raises(BatchContractError, match="integer offsets"):
        unpack_texts(data, offsets.astype(np.float64))
    with pytest.raises(BatchContractError, match="do not fit"):
        unpack_texts(data, np.array([0, 3, 1, len(data)]))
    with pytest.raises(BatchContractError, match="utf-8"):
        unpack_texts(data, np.array([0, 2, len(data)]))  # cuts "é" (bytes 1-2) in half


def test_a_store_serves_numpy_arrays_beside_torch_tensors_over_grpc() -> None:
    async def scenario() -> tuple[dict, dict, int]:
        server = TensorStoreServer(capacity_bytes=1 << 20)
        await server.start()
        try:
            data, offsets = pack_texts(["a", "bc"], arrays="numpy")
            ref = server.put_local(
                "mixed", {"text": data, "offsets": offsets, "w": torch.ones(3, dtype=torch.bfloat16)}
            )
            async with TensorStoreClient(server.address) as client:
                as_torch = await client.fetch(ref)
                as_numpy = await client.get(
                    ref.key, ["text", "offsets"], capability=ref.capability, arrays="numpy"
                )
            return as_torch, as_numpy, server.used_bytes
        finally:
            await server.stop()

    as_torch, as_numpy, used = asyncio.run(scenario())
    assert used == 3 + 3 * 8 + 3 * 2
    assert isinstance(as_torch["w"], torch.Tensor) and as_torch["w"].dtype == torch.bfloat16
    assert unpack_texts(as_torch["text"], as_torch["offsets"]) == ["a", "bc"]
    assert all(isinstance(v, np.ndarray) for v in as_numpy.values())
    assert unpack_texts(as_numpy["text"], as_numpy["offsets"]) == ["a", "bc"]


WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None  # as where rlfleet-common is installed without its torch extra
import asyncio
import numpy as np
import rlfleet.common
from rlfleet.common.errors import UnknownDtype
from rlfleet.common.schema.batch import pack_texts, unpack_texts
from rlfleet.common.tensors import codec
from rlfleet.common.tensors.store import TensorStoreClient, TensorStoreServer

assert not codec.HAVE_TORCH and codec.DEFAULT_ARRAYS == "numpy" and codec.DTYPES == {}
try:
    codec.ChunkAssembler(arrays="torch")
    raise SystemExit("arrays='torch' accepted without torch")
except ValueError as exc:
    assert "rlfleet-common[torch]" in str(exc)


async def main():
    server = TensorStoreServer(capacity_bytes=1 << 30)
    await server.start()
    try:
        data, offsets = pack_texts(["hé", "", "日本"])
        big = np.arange(5 << 20, dtype=np.int64).reshape(1024, -1)  # 40 MiB: lands on huge pages
        async with TensorStoreClient(server.address, secret=server.secret) as client:
            ref = await client.put("batch", {"text": data, "offsets": offsets, "big": big})
            got = await client.fetch(ref)
            bf16 = codec.Chunk("k", "w", "BF16", (2,), 0, 4, codec.checksum(b"\\0" * 4), b"\\0" * 4)
            try:
                codec.assemble_tensors([bf16, codec.Chunk("k", end_of_stream=True, tensor_count=1)])
                raise SystemExit("bf16 decoded without torch")
            except UnknownDtype as exc:
                assert "BF16" in str(exc) and "needs torch" in str(exc), exc
    finally:
        await server.stop()
    assert all(isinstance(v, np.ndarray) for v in got.values())
    assert unpack_texts(got["text"], got["offsets"]) == ["hé", "", "日本"]
    assert got["big"].shape == big.shape and (got["big"] == big).all()
    print("ok")


asyncio.run(main())
"""


def test_the_tensor_plane_serves_and_fetches_numpy_arrays_where_torch_cannot_be_imported() -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCH], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == "ok"
