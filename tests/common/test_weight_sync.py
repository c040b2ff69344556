"""A weight version's fingerprint and the delta between two versions (issue 32, points 3 and 4):
a delta applied to the version before gives the new version bit for bit, its changed elements travel
packed (and the per-weight form before wire 2.10 is still read), and a delta that does not fit what
the receiver holds, or whose packing is malformed, is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from rlfleet.common.errors import BatchContractError
from rlfleet.common.tensors import weight_sync
from rlfleet.common.tensors.weight_sync import (
    COUNTS,
    INDEX,
    NAMES,
    VALUES,
    apply_delta,
    delta_parts,
    fingerprint,
    weight_delta,
)


def _version(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "b.bias": torch.randn(32, generator=g),
        "c.step": torch.tensor(7, dtype=torch.int64),
    }


def _step(weights: dict[str, torch.Tensor], share: float) -> dict[str, torch.Tensor]:
    """The next version: about ``share`` of ``a.weight``'s elements nudged, ``b.bias`` all moved."""
    new = {k: v.clone() for k, v in weights.items()}
    flat = new["a.weight"].view(-1)
    picked = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(1))[
        : int(share * flat.numel())
    ]
    flat[picked] += 0.5
    new["b.bias"] += 1e-3
    return new


def test_a_delta_applied_to_the_version_before_is_the_new_version_bit_for_bit() -> None:
    old = _version(0)
    new = _step(old, 0.02)
    delta = weight_delta(old, new)
    assert set(delta) == {INDEX, VALUES, NAMES, COUNTS, "b.bias"}  # c.step unchanged: left out
    whole, sparse = delta_parts(delta)
    assert set(whole) == {"b.bias"} and set(sparse) == {"a.weight"}
    index, values = sparse["a.weight"]
    assert index.dtype == torch.int32 and values.dtype == torch.bfloat16
    changed = int((new["a.weight"].view(torch.int16) != old["a.weight"].view(torch.int16)).sum())
    assert index.numel() == changed and 0 < changed < 0.05 * old["a.weight"].numel()
    held = {k: v.clone() for k, v in old.items()}
    assert sorted(apply_delta(held, delta)) == ["a.weight", "b.bias"]
    for name in new:
        assert torch.equal(held[name].reshape(-1).view(torch.uint8), new[name].reshape(-1).view(torch.uint8))
    assert fingerprint(held.items()) == fingerprint(new.items()) != fingerprint(old.items())


def test_the_fingerprint_sees_names_dtypes_shapes_and_bits() -> None:
    w = _version(0)
    base = fingerprint(w.items())
    assert fingerprint(reversed(list(w.items()))) == base  # order-free: name order
    assert fingerprint({**w, "b.bias": w["b.bias"].to(torch.float64)}.items()) != base
    assert fingerprint({**w, "a.weight": w["a.weight"].reshape(32, 64)}.items()) != base
    assert fingerprint({("z" + k): v for k, v in w.items()}.items()) != base
    flipped = w["b.bias"].clone()
    flipped.view(torch.int32)[3] ^= 1  # one bit
    assert fingerprint({**w, "b.bias": flipped}.items()) != base
    assert base.startswith("xxh3_128p:")


def test_the_fingerprint_hashes_a_tensor_in_pieces_on_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _version(0)
    base = fingerprint(w.items())
    monkeypatch.setattr(weight_sync, "PIECE_BYTES", 100)  # a.weight's 4096 bytes: 41 pieces
    pieces = fingerprint(w.items())
    assert pieces != base  # the piece size is part of the scheme
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert fingerprint(w.items()) == pieces  # however many threads hash them
    finally:
        torch.set_num_threads(threads)
    for element in (0, 49, 50, 2047):  # the first, either side of a piece's edge, the last
        flipped = w["a.weight"].clone()
        flipped.view(-1).view(torch.int16)[element] ^= 1
        assert fingerprint({**w, "a.weight": flipped}.items()) != pieces, element
    monkeypatch.setattr(weight_sync, "COPIES_BYTES", 1)  # every copy hashed before the next is made
    transposed = w["a.weight"].t().contiguous().t()  # not contiguous: hashed from a copy, same bytes
    assert not transposed.is_contiguous()
    assert fingerprint({**w, "a.weight": transposed}.items()) == pieces
    assert weight_sync.verifiable(base, "xxh3_128p:00")
    assert not weight_sync.verifiable(base, "xxh3_128:00") and not weight_sync.verifiable(base, "")


def test_a_fingerprint_built_a_tensor_at_a_time_is_the_whole_ones() -> None:
    """A :class:`Fingerprinter` fed in any order, a name fed again counting as last fed, gives
    :func:`fingerprint`'s value; ``value(items)`` covers exactly those names (one never fed hashed
    then, one fed but not among them left out)."""
    w = _version(0)
    with weight_sync.Fingerprinter() as hashes:
        hashes.add("b.bias", torch.zeros(3))  # replaced below
        hashes.add("z.extra", torch.ones(2))  # not among the items: left out
        hashes.add_all([("b.bias", w["b.bias"]), ("a.weight", w["a.weight"])])
        assert hashes.value(w.items()) == fingerprint(w.items())  # c.step hashed at the end
        assert hashes.value() == fingerprint([*w.items(), ("z.extra", torch.ones(2))])


def test_a_delta_written_and_its_overwritten_values_written_back_restore_the_version_before() -> None:
    old = _version(0)
    new = _step(old, 0.05)
    held = {k: v.clone() for k, v in old.items()}
    plan = weight_sync.check_delta(held, weight_delta(old, new))
    undo = weight_sync.overwritten(held, plan)
    assert set(undo.sparse) == {"a.weight"} and set(undo.whole) == {"b.bias"}  # elements kept, not copies
    assert undo.sparse["a.weight"][1].numel() == plan.sparse["a.weight"][1].numel()
    weight_sync.write_delta(held, plan)
    assert fingerprint(held.items()) == fingerprint(new.items())
    weight_sync.write_delta(held, undo)
    assert fingerprint(held.items()) == fingerprint(old.items())


def test_a_mostly_changed_tensor_travels_whole() -> None:
    old = _version(0)
    new = _step(old, 0.9)
    delta = weight_delta(old, new)
    assert "a.weight" in delta and "a.weight" not in delta_parts(delta).sparse


def test_a_delta_that_does_not_fit_is_refused_before_anything_is_written() -> None:
    old = _version(0)
    delta = weight_delta(old, _step(old, 0.02))
    index, values = delta_parts(delta).sparse["a.weight"]
    legacy = {"b.bias": delta["b.bias"], "a.weight" + INDEX: index, "a.weight" + VALUES: values}
    names = delta[NAMES]
    bad = [
        ({**delta, INDEX: delta[INDEX] + 10_000}, "'a.weight@idx': an index outside 0..2047"),
        ({**delta, VALUES: delta[VALUES].float()}, "'a.weight@val': expected .* values"),
        ({**delta, VALUES: delta[VALUES][:-1]}, "'@val': expected 1-dim, .* elements"),
        ({**delta, COUNTS: delta[COUNTS] + 1}, "'@idx': expected 1-dim, .* elements"),
        ({**delta, COUNTS: -delta[COUNTS]}, "a negative count"),
        ({**delta, COUNTS: delta[COUNTS].int()}, "expected 1 int64 counts"),
        ({k: v for k, v in delta.items() if k != NAMES}, "a packed delta needs all of"),
        ({**delta, NAMES: torch.tensor([0xFF, 0xFE], dtype=torch.uint8)}, "not UTF-8"),
        ({**delta, NAMES: names.int()}, "expected 1-dim uint8"),
        ({**delta, NAMES: torch.tensor(list(b"a.weight\na.weight"), dtype=torch.uint8),
          COUNTS: torch.tensor([1, index.numel() - 1])}, "an empty, repeated or '@' name"),
        ({**delta, "a.weight": old["a.weight"]}, "'a.weight': in the delta twice"),
        ({**delta, **{k: v for k, v in legacy.items() if k != "b.bias"}}, "'a.weight': in the delta twice"),
        ({**delta, "a.weight" + VALUES: values}, "values without their indices"),
        ({**legacy, "a.weight" + INDEX: index + 10_000}, "an index outside 0..2047"),
        ({**legacy, "a.weight" + VALUES: values[:-1]}, "expected .* values"),
        ({k: v for k, v in legacy.items() if k != "a.weight" + VALUES}, "no a.weight@val beside it"),
        ({**legacy, "x" + VALUES: torch.zeros(1)}, "values without their indices"),
        ({**legacy, "nope" + INDEX: torch.zeros(1, dtype=torch.int32), "nope" + VALUES: torch.zeros(1)},
         "a delta for a weight not held"),
        ({**delta, "b.bias": torch.zeros(3)}, "does not match the weights held"),
    ]  # fmt: skip
    for broken, match in bad:
        held = {k: v.clone() for k, v in old.items()}
        with pytest.raises(BatchContractError, match=match):
            apply_delta(held, broken)
        assert all(torch.equal(held[k], old[k]) for k in old), "nothing written"


def test_the_form_before_packing_is_still_read_and_odd_dtypes_travel_per_weight() -> None:
    """A delta in the per-weight form (a trainer before wire 2.10) writes the same version; a bucket
    whose sparse weights have two dtypes packs the most common one and sends the other per weight."""
    old = _version(0)
    new = _step(old, 0.02)
    index, values = delta_parts(weight_delta(old, new)).sparse["a.weight"]
    held = {k: v.clone() for k, v in old.items()}
    apply_delta(held, {"b.bias": new["b.bias"], "a.weight" + INDEX: index, "a.weight" + VALUES: values})
    assert fingerprint(held.items()) == fingerprint(new.items())
    g = torch.Generator().manual_seed(5)
    mixed_old = {"x": torch.randn(100, generator=g).to(torch.bfloat16), "y": torch.randn(90, generator=g),
                 "z": torch.randn(80, generator=g).to(torch.bfloat16)}  # fmt: skip
    mixed_new = {k: v.clone() for k, v in mixed_old.items()}
    for name in mixed_new:
        mixed_new[name][[3, 7]] += 1.0
    delta = weight_delta(mixed_old, mixed_new)
    assert bytes(delta[NAMES].numpy()).decode().split("\n") == ["x", "z"]
    assert delta[COUNTS].tolist() == [2, 2] and {"y" + INDEX, "y" + VALUES} <= set(delta)
    apply_delta(mixed_old, delta)
    assert fingerprint(mixed_old.items()) == fingerprint(mixed_new.items())


def test_the_host_delta_finds_every_change_across_its_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host path compares a chunk at a time on several threads: changes on the chunks' edges,
    in every dtype width, come out in order and equal torch's own comparison; a non-contiguous copy
    held by the receiver is written through torch's path."""
    from rlfleet.common.tensors import weight_sync

    monkeypatch.setattr(weight_sync, "CHUNK", 64)
    g = torch.Generator().manual_seed(3)
    old = {
        "bf16": torch.randn(64 * 5 + 7, generator=g).to(torch.bfloat16),
        "fp32": torch.randn(40, 9, generator=g),
        "int8": torch.randint(-9, 9, (200,), generator=g, dtype=torch.int8),
        "flag": torch.zeros(130, dtype=torch.bool),
    }
    new = {k: v.clone() for k, v in old.items()}
    edges = [0, 63, 64, 127, 128, 64 * 5 + 6]
    new["bf16"][edges] += 1.0
    new["fp32"].view(-1)[[5, 64, 359]] -= 1.0
    new["int8"][[63, 64, 199]] += 1
    new["flag"][[64, 129]] = True
    delta = weight_delta(old, new)
    sparse = delta_parts(delta).sparse
    for name in old:
        want = (weight_sync._bits(new[name]) != weight_sync._bits(old[name])).nonzero().reshape(-1)
        index, values = sparse[name]
        assert torch.equal(index.long(), want) and index.dtype == torch.int32, name
        assert torch.equal(values, new[name].reshape(-1)[want])
    held = {k: v.clone() for k, v in old.items()}
    held["fp32"] = old["fp32"].t().contiguous().t()  # the same values, not contiguous
    assert not held["fp32"].is_contiguous()
    apply_delta(held, delta)
    assert fingerprint(held.items()) == fingerprint(new.items())


def test_a_bucket_of_one_dtype_compared_at_once_on_a_device_equals_the_hosts() -> None:
    """A bucket whose weights share a dtype (a trainer's bf16 buckets) is compared whole on the device
    (one search, one count a weight): its delta is the host's key for key and bit for bit, with a
    weight mostly changed travelling whole, unchanged ones left out and the runs in the bucket's
    order; a bucket of mixed dtypes or one with a weight the version before lacks falls back."""
    g = torch.Generator().manual_seed(7)
    shapes = {"e.weight": (64, 16), "same": (5,), "q.weight": (16, 16), "mostly": (40,), "k.bias": (16,)}
    old = {name: torch.randn(*shape, generator=g).to(torch.bfloat16) for name, shape in shapes.items()}
    new = {k: v.clone() for k, v in old.items()}
    for name, share in (("e.weight", 0.03), ("q.weight", 0.1), ("mostly", 0.8), ("k.bias", 0.2)):
        flat = new[name].view(-1)
        hit = torch.randperm(flat.numel(), generator=g)[: max(1, int(share * flat.numel()))]
        flat[hit] = (flat[hit].float() + 1).to(torch.bfloat16)
    host, at_once = weight_delta(old, new), weight_sync._bucket_delta(old, new, torch.device("cpu"))
    assert at_once is not None and list(host) == list(at_once) and "mostly" in at_once
    for key in host:
        assert host[key].dtype == at_once[key].dtype and torch.equal(host[key], at_once[key]), key
    assert bytes(at_once[NAMES].tolist()).decode().split("\n") == ["e.weight", "q.weight", "k.bias"]
    assert weight_sync._bucket_delta(old, old, torch.device("cpu")) == {}
    assert weight_sync._bucket_delta(_version(0), _step(_version(0), 0.1), torch.device("cpu")) is None
    assert weight_sync._bucket_delta({}, new, torch.device("cpu")) is None


def test_a_delta_compared_by_torch_on_a_device_equals_the_hosts() -> None:
    """``device=`` (a trainer on a GPU compares there) gives the host's delta, key for key and bit for
    bit; here on the CPU device, which takes the same torch path as a GPU's."""
    old = _version(0)
    new = _step(old, 0.02)
    host, by_torch = weight_delta(old, new), weight_delta(old, new, device="cpu")
    assert host.keys() == by_torch.keys() and host
    for key in host:
        assert host[key].dtype == by_torch[key].dtype and torch.equal(host[key], by_torch[key]), key
        assert by_torch[key].device.type == "cpu"
    held = {k: v.clone() for k, v in old.items()}
    apply_delta(held, by_torch)
    assert fingerprint(held.items()) == fingerprint(new.items())
