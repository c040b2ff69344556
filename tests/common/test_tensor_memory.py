"""Memory for tensor streams: huge-page buffers for big received tensors (``codec.empty_bytes``) and
the once-per-process malloc tuning (``malloc.keep_stream_buffers``)."""

from __future__ import annotations

import gc
import platform
import sys

import pytest
import torch

from rlfleet.common.tensors.codec import HUGE_ALLOC_BYTES, empty_bytes
from rlfleet.common.tensors.malloc import keep_stream_buffers


def test_big_buffers_are_aligned_writable_and_outlive_their_mapping_handle() -> None:
    buf = empty_bytes(HUGE_ALLOC_BYTES + 123)
    assert buf.dtype == torch.uint8 and buf.shape == (HUGE_ALLOC_BYTES + 123,)
    if sys.platform == "linux":
        assert buf.data_ptr() % (2 << 20) == 0
    gc.collect()
    buf.fill_(7)
    view = buf[:HUGE_ALLOC_BYTES].view(torch.float32).reshape(1024, -1)
    assert int(buf[-1]) == 7 and view.shape[0] == 1024
    assert bytes(memoryview(buf.numpy())[:2]) == b"\x07\x07"


def test_small_buffers_and_opt_out_use_plain_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    assert empty_bytes(0).shape == (0,)
    assert empty_bytes(1000).untyped_storage().nbytes() == 1000
    monkeypatch.setenv("RLFLEET_MALLOC_TUNING", "0")
    assert empty_bytes(HUGE_ALLOC_BYTES).untyped_storage().nbytes() == HUGE_ALLOC_BYTES


def test_malloc_tuning_is_applied_once() -> None:
    first = keep_stream_buffers()
    assert keep_stream_buffers() is first
    if platform.libc_ver()[0] == "glibc":
        assert first is True
