"""tensor_codec: safetensors-layout bytes, the chunk stream, and every error the assembler raises."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlfleet.common.errors import (
    ChecksumMismatch,
    MalformedChunk,
    MessageTooLarge,
    ShapeMismatch,
    StoreFull,
    StreamTruncated,
    TensorError,
    UnknownDtype,
)
from rlfleet.common.tensors.codec import (
    DTYPES,
    Chunk,
    ChunkAssembler,
    assemble_tensors,
    bytes_to_tensor,
    checksum,
    dtype_name,
    split_tensors,
    tensor_buffer,
    tensor_checksum,
    tensor_to_bytes,
)

EXPECTED_NAMES = {"BF16", "F16", "F32", "F64", "I8", "I16", "I32", "I64", "U8", "BOOL", "F8_E4M3", "F8_E5M2"}


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs and infinities included) of ``dtype``; bools are 0/1."""
    gen = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    return tensor_to_bytes(t)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)


def test_dtype_table_covers_safetensors_names() -> None:
    assert EXPECTED_NAMES <= set(DTYPES)
    for name, dtype in DTYPES.items():
        assert dtype_name(dtype) == name
    assert {"U16", "U32", "U64"} <= set(DTYPES)  # torch >= 2.3 has them


def test_import_of_the_package_does_not_import_torch() -> None:
    code = "import sys, rlfleet.common; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(3, 5), (), (0,), (2, 0, 3), (7,)])
def test_every_dtype_round_trips_bit_exactly(name: str, shape: tuple[int, ...]) -> None:
    tensor = _random_tensor(DTYPES[name], shape, seed=len(name))
    raw = tensor_to_bytes(tensor)
    assert len(raw) == tensor.numel() * tensor.element_size()
    back = bytes_to_tensor(raw, name, shape)
    assert _same(back, tensor)
    streamed = assemble_tensors(split_tensors("k", {"t": tensor}, chunk_bytes=7))
    assert _same(streamed["t"], tensor)


def test_layout_is_safetensors_little_endian() -> None:
    assert tensor_to_bytes(torch.tensor([1, 256], dtype=torch.int16)) == b"\x01\x00\x00\x01"
    assert tensor_to_bytes(torch.tensor([1.0], dtype=torch.bfloat16)) == b"\x80\x3f"
    assert tensor_to_bytes(torch.tensor([True, False])) == b"\x01\x00"


def test_non_contiguous_tensors_are_sent_in_row_major_order() -> None:
    base = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    view = base.t()
    assert tensor_to_bytes(view) == tensor_to_bytes(view.contiguous())
    out = assemble_tensors(split_tensors("k", {"v": view}, chunk_bytes=5))
    assert torch.equal(out["v"], view)


def test_tensor_buffer_is_zero_copy_for_contiguous_tensors() -> None:
    tensor = torch.zeros(4, dtype=torch.float32)
    buf = tensor_buffer(tensor)
    tensor[0] = 1.0
    assert bytes(buf[:4]) == tensor_to_bytes(torch.tensor([1.0]))


def test_checksum_is_zlib_crc32() -> None:
    data = bytes(range(256)) * 1000
    assert checksum(data) == zlib.crc32(data)
    assert checksum(data[1000:], checksum(data[:1000])) == zlib.crc32(data)
    tensor = _random_tensor(torch.bfloat16, (33, 7))
    assert tensor_checksum(tensor) == zlib.crc32(tensor_to_bytes(tensor))


def test_split_produces_ordered_chunks_and_an_end_marker() -> None:
    tensors = {
        "a": torch.zeros(10, dtype=torch.uint8),
        "empty": torch.zeros(0),
        "b": torch.ones(3, dtype=torch.int16),
    }
    chunks = list(split_tensors("key", tensors, chunk_bytes=4))
    assert [(c.name, c.offset, len(c.data)) for c in chunks[:-1]] == [
        ("a", 0, 4),
        ("a", 4, 4),
        ("a", 8, 2),
        ("empty", 0, 0),
        ("b", 0, 4),
        ("b", 4, 2),
    ]
    assert [c.crc32 is not None for c in chunks[:-1]] == [False, False, True, True, False, True]
    assert chunks[-1] == Chunk(key="key", end_of_stream=True, tensor_count=3)
    assert all(c.key == "key" for c in chunks)
    out = assemble_tensors(chunks, "key")
    assert list(out) == ["a", "empty", "b"]


def test_unknown_dtypes_are_refused_on_both_sides() -> None:
    with pytest.raises(UnknownDtype, match="complex64"):
        list(split_tensors("k", {"c": torch.zeros(2, dtype=torch.complex64)}))
    with pytest.raises(UnknownDtype, match="F7"):
        bytes_to_tensor(b"", "F7", (0,))
    chunks = list(split_tensors("k", {"t": torch.zeros(2)}))
    chunks[0] = dataclasses.replace(chunks[0], dtype="F7")
    with pytest.raises(UnknownDtype) as info:
        assemble_tensors(chunks)
    assert info.value.name == "t"


def _stream(**tensors: torch.Tensor) -> list[Chunk]:
    return list(split_tensors("k", tensors, chunk_bytes=8))


def test_checksum_mismatch_on_damaged_bytes_or_wrong_crc() -> None:
    chunks = _stream(t=torch.arange(10, dtype=torch.float32))
    damaged = bytearray(chunks[1].data)
    damaged[0] ^= 0x01
    bad_data = [*chunks[:1], dataclasses.replace(chunks[1], data=bytes(damaged)), *chunks[2:]]
    with pytest.raises(ChecksumMismatch) as info:
        assemble_tensors(bad_data)
    assert info.value.name == "t"
    last = len(chunks) - 2
    bad_crc = list(chunks)
    bad_crc[last] = dataclasses.replace(chunks[last], crc32=(chunks[last].crc32 or 0) ^ 1)
    with pytest.raises(ChecksumMismatch):
        assemble_tensors(bad_crc)


def test_shape_mismatch_when_bytes_do_not_fit_shape() -> None:
    with pytest.raises(ShapeMismatch) as info:
        bytes_to_tensor(b"\x00" * 7, "F32", (2,))
    assert (info.value.nbytes, info.value.expected) == (7, 8)
    chunks = _stream(t=torch.zeros(4))
    wrong_total = [dataclasses.replace(c, total_bytes=c.total_bytes + 4) if c.name else c for c in chunks]
    with pytest.raises(ShapeMismatch):
        assemble_tensors(wrong_total)
    over = list(chunks)
    over[1] = dataclasses.replace(chunks[1], data=bytes(chunks[1].data) + b"\x00")
    with pytest.raises(ShapeMismatch):
        assemble_tensors(over)


def test_stream_truncated_cases() -> None:
    chunks = _stream(a=torch.zeros(4), b=torch.zeros(4))
    with pytest.raises(StreamTruncated, match="no end-of-stream marker"):
        assemble_tensors(chunks[:-1])
    with pytest.raises(StreamTruncated, match="'a' at 8 of 16"):
        assemble_tensors(chunks[:1])
    with pytest.raises(StreamTruncated, match="tensor 'b' began"):
        assemble_tensors([chunks[0], *chunks[2:]])
    with pytest.raises(StreamTruncated, match="starts at byte 8, not 0"):
        assemble_tensors(chunks[1:])
    three = _stream(c=torch.zeros(6))
    with pytest.raises(StreamTruncated, match="chunk at byte 16, expected 8"):
        assemble_tensors([three[0], *three[2:]])
    with pytest.raises(StreamTruncated, match="end marker came"):
        assemble_tensors([chunks[0], chunks[-1]])
    with pytest.raises(StreamTruncated, match="counts 3 tensors, 2 came"):
        assemble_tensors([*chunks[:-1], dataclasses.replace(chunks[-1], tensor_count=3)])


def test_message_too_large_for_chunks_and_streams() -> None:
    chunks = list(split_tensors("k", {"t": torch.zeros(64, dtype=torch.uint8)}, chunk_bytes=32))
    with pytest.raises(MessageTooLarge) as info:
        assemble_tensors(chunks, max_chunk_bytes=16)
    assert (info.value.size, info.value.limit) == (32, 16)
    with pytest.raises(MessageTooLarge, match="tensor stream"):
        assemble_tensors(chunks, max_total_bytes=63)
    assert assemble_tensors(chunks, max_chunk_bytes=32, max_total_bytes=64)["t"].numel() == 64


def test_malformed_streams() -> None:
    chunks = _stream(a=torch.zeros(2), b=torch.zeros(2))
    mid = list(split_tensors("k", {"x": torch.zeros(4)}, chunk_bytes=8))
    mid[1] = dataclasses.replace(mid[1], shape=(2, 2))
    cases = {
        "key changed": [chunks[0], dataclasses.replace(chunks[1], key="other"), *chunks[2:]],
        "sent twice": [*chunks[:2], *chunks[:2], *chunks[2:]],
        "after the end-of-stream": [*chunks, chunks[0]],
        "carries no crc32": [chunks[0], dataclasses.replace(chunks[1], crc32=None), *chunks[2:]],
        "negative dimension": [dataclasses.replace(chunks[0], shape=(-2,)), *chunks[1:]],
        "without a name": [dataclasses.replace(chunks[0], name=""), *chunks[1:]],
        "changed mid-tensor": mid,
        "counts 1 tensors, 2 came": [*chunks[:-1], dataclasses.replace(chunks[-1], tensor_count=1)],
    }
    for match, stream in cases.items():
        with pytest.raises(MalformedChunk, match=match):
            assemble_tensors(stream)


def test_reserve_is_called_before_each_allocation_and_can_refuse() -> None:
    seen: list[int] = []

    def reserve(nbytes: int) -> None:
        if sum(seen) + nbytes > 20:
            raise StoreFull(nbytes, sum(seen), 20)
        seen.append(nbytes)

    assembler = ChunkAssembler(reserve=reserve)
    chunks = _stream(a=torch.zeros(4), b=torch.zeros(4))
    with pytest.raises(StoreFull):
        for chunk in chunks:
            assembler.feed(chunk)
    assert seen == [16]


# --- properties: arbitrary input raises only the documented errors --------------------------

DOCUMENTED = (TensorError, MessageTooLarge)

_chunks = st.builds(
    Chunk,
    key=st.sampled_from(["k", "other", ""]),
    name=st.sampled_from(["a", "b", ""]),
    dtype=st.sampled_from([*DTYPES, "F7", ""]),
    shape=st.lists(st.integers(-3, 1 << 20), max_size=3).map(tuple),
    offset=st.integers(0, 64),
    total_bytes=st.integers(0, 1 << 22),
    crc32=st.none() | st.integers(0, (1 << 32) - 1),
    data=st.binary(max_size=48),
    end_of_stream=st.booleans(),
    tensor_count=st.integers(0, 3),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_chunks, max_size=8))
def test_arbitrary_chunk_fields_raise_only_documented_errors(chunks: list[Chunk]) -> None:
    assembler = ChunkAssembler(max_chunk_bytes=32, max_total_bytes=1 << 16)
    try:
        for chunk in chunks:
            assembler.feed(chunk)
        out = assembler.finish()
    except DOCUMENTED:
        return
    for tensor in out.values():
        assert tensor.numel() * tensor.element_size() <= 1 << 16


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(sorted(DTYPES)), min_size=1, max_size=3),
    st.integers(1, 40),
    st.data(),
)
def test_damaged_valid_streams_raise_only_documented_errors(
    dtypes: list[str], chunk_bytes: int, data
) -> None:
    tensors = {f"t{i}": _random_tensor(DTYPES[d], (i + 3,), seed=i) for i, d in enumerate(dtypes)}
    chunks = list(split_tensors("k", tensors, chunk_bytes=chunk_bytes))
    index = data.draw(st.integers(0, len(chunks) - 1))
    field = data.draw(st.sampled_from(["drop", "data", "offset", "crc32", "total_bytes", "name", "swap"]))
    victim = chunks[index]
    if field == "drop":
        del chunks[index]
    elif field == "data":
        chunks[index] = dataclasses.replace(victim, data=data.draw(st.binary(max_size=48)))
    elif field == "offset":
        chunks[index] = dataclasses.replace(victim, offset=data.draw(st.integers(0, 200)))
    elif field == "crc32":
        chunks[index] = dataclasses.replace(
            victim, crc32=data.draw(st.none() | st.integers(0, (1 << 32) - 1))
        )
    elif field == "total_bytes":
        chunks[index] = dataclasses.replace(victim, total_bytes=data.draw(st.integers(0, 200)))
    elif field == "name":
        chunks[index] = dataclasses.replace(victim, name=data.draw(st.sampled_from(["t0", "t1", "zz", ""])))
    else:
        other = data.draw(st.integers(0, len(chunks) - 1))
        chunks[index], chunks[other] = chunks[other], chunks[index]
    try:
        out = assemble_tensors(chunks)
    except DOCUMENTED:
        return
    # A damage that still decodes must leave every tensor's bytes intact: a reorder of whole
    # tensors (swapped single-chunk tensors) or a renamed single-chunk tensor (names are not
    # covered by the checksum) are the only changes that can go unnoticed.
    assert len(out) == len(tensors)
    by_name = all(name in tensors and _same(t, tensors[name]) for name, t in out.items())
    by_position = all(_same(g, w) for g, w in zip(out.values(), tensors.values(), strict=True))
    assert by_name or by_position
