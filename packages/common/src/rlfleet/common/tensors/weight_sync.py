"""What a weight sync moves and how both ends check it: the fingerprint of a weight version, and
the delta from one version to the next.

**Fingerprint.** :func:`fingerprint` hashes every tensor of a version with xxHash3-128 (its name,
dtype and shape, and its bytes in pieces of :data:`PIECE_BYTES`, each piece's digest then hashed in
name order): the trainer hashes what it publishes, each rollout worker what it loaded, and the
controller compares the two (a mismatch is refused by name). Equal fingerprints mean bit-identical
weights, whichever way they travelled (whole, or as a delta applied to the version before). The
pieces hash on threads (xxhash lets go of the GIL), so a 0.5B model's gigabyte takes a few
hundredths of a second on a many-core host; a :class:`Fingerprinter` takes tensors one at a time
(a receiver hashes each delta bucket's weights while the next is pulled). The scheme is named in the
value (``xxh3_128p:``); the controller compares only fingerprints of one scheme.

**Delta.** At reinforcement-learning learning rates most weights are bit-identical from one version
to the next in the dtype they are published in (bf16 above all). :func:`weight_delta` compares a
bucket of the new version with the same bucket of the version before, by bits: per tensor it keeps
the flat indices (int32 or int64) and new values of the elements that changed, or the whole tensor
under its own name where more than half of it changed (then the indices would cost more). A
bucket's changed elements travel packed (wire 2.10): ``@idx`` and ``@val`` hold each weight's run
of indices and values one after another, ``@names`` the weights' names (UTF-8, one a line) and
``@counts`` each run's length, so a delta of hundreds of weights is four tensors on the wire, not
two a weight (the per-message cost of the gRPC stream made a 0.5B model's delta pull at half the
rate of a whole version). Values of another dtype than the most common one's travel per weight
(``name@idx``, ``name@val``: the form before 2.10, still read). :func:`delta_parts` reads either
form. :func:`apply_delta` writes a delta into the receiver's own copy of the
version before, in place; the result is the new version, bit for bit (its fingerprint says so). An
engine that holds its weights by these names takes the delta straight into them, all or nothing:
:func:`check_delta` checks it whole first, :func:`overwritten` keeps what it will overwrite (the
changed elements only) and :func:`write_delta` writes either.

The comparison runs on host tensors through numpy, a chunk of :data:`CHUNK` elements at a time (the
mask stays in cache): about five times faster than torch's ``nonzero`` over a whole tensor on the
host, where a sync spends most of its time finding what changed. A trainer on a GPU may compare on
it instead (``weight_delta(..., device=)``). The writes go through torch's indexing, on the host
or a device (on the host torch spreads a scattered write over its threads; the gathers of
:func:`overwritten` go one tensor a task on threads).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from itertools import accumulate
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash
from torch import Tensor

from rlfleet.common.errors import BatchContractError

INDEX, VALUES = "@idx", "@val"
"""Keys of a delta's packed indices and values, and suffixes of one weight's pair in the form before
wire 2.10 (weight names never hold ``@``)."""
NAMES, COUNTS = "@names", "@counts"
"""Keys of the packed runs' names (UTF-8 bytes, one name a line) and lengths (int64)."""
PACKED = (INDEX, VALUES, NAMES, COUNTS)
PACKED_SINCE = "2.10"
"""The wire version whose readers take a packed delta (a worker of an older one is sent whole versions)."""
DENSE_FRACTION = 0.5
"""Above this share of changed elements a tensor travels whole."""
CHUNK = 1 << 20
"""Elements compared at a time on the host."""


PIECE_BYTES = 16 << 20
"""Bytes of a tensor hashed as one piece by :func:`fingerprint` (part of the scheme: fixed)."""
COPIES_BYTES = 256 << 20
"""Host copies (of tensors off the host) that :func:`fingerprint` keeps waiting for their hash."""
SCHEME = "xxh3_128p"
""":func:`fingerprint`'s scheme, the prefix of its value (``xxh3_128`` hashed each tensor's bytes
in one stream, before wire 2.9's pieces)."""


def fingerprint(items: Iterable[tuple[str, Tensor]]) -> str:
    """``xxh3_128p:<hex>``: xxHash3-128 over each tensor's name, dtype and shape line and the
    xxHash3-128 digests of its bytes in pieces of :data:`PIECE_BYTES`, in name order (one
    :class:`Fingerprinter` fed every item)."""
    with Fingerprinter() as hashes:
        for name, tensor in items:
            hashes.add(name, tensor)
        return hashes.value()


class Fingerprinter:
    """:func:`fingerprint` built up a tensor at a time: :meth:`add` hands a tensor's pieces to
    threads and returns (a receiver hashes each delta bucket's weights as soon as they are written,
    while the next bucket is pulled and written), :meth:`value` waits for them. A name added again
    counts as last added. Tensors off the host (or not contiguous) are copied to it as they are
    added, at most :data:`COPIES_BYTES` of copies waiting for their hash at once. Use it as a
    context manager (its threads end on exit)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="fingerprint")
        self._parts: dict[str, tuple[bytes, list[Future[bytes]]]] = {}
        self._copies: deque[tuple[int, list[Future[bytes]]]] = deque()
        self._waiting = 0
        self._lock = threading.Lock()

    def __enter__(self) -> Fingerprinter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def add(self, name: str, tensor: Tensor) -> None:
        """Start hashing ``tensor`` under ``name`` (its bytes as they are now: write no more into it)."""
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        line = f"{name}|{str(flat.dtype).removeprefix('torch.')}|{tuple(tensor.shape)}\n".encode()
        data = flat.view(torch.uint8).numpy()
        pieces = [
            self._pool.submit(_piece_digest, data, start)
            for start in range(0, max(data.size, 1), PIECE_BYTES)
        ]
        with self._lock:
            self._parts[name] = (line, pieces)
            if flat.data_ptr() != tensor.data_ptr() or tensor.device.type != "cpu":  # a copy
                self._copies.append((data.nbytes, pieces))
                self._waiting += data.nbytes
            while self._waiting > COPIES_BYTES:  # the oldest copies hashed (and freed) first
                nbytes, hashed = self._copies.popleft()
                wait(hashed)
                self._waiting -= nbytes

    def add_all(self, items: Iterable[tuple[str, Tensor]]) -> None:
        for name, tensor in items:
            self.add(name, tensor)

    def value(self, items: Iterable[tuple[str, Tensor]] | None = None) -> str:
        """The fingerprint of what was added; with ``items``, of exactly those names (any not added
        yet hashed now, any added but not among them left out)."""
        if items is not None:
            wanted = dict(items)
            for name in wanted.keys() - self._parts.keys():
                self.add(name, wanted[name])
        names = sorted(self._parts if items is None else wanted)
        digest = xxhash.xxh3_128()
        for name in names:
            line, pieces = self._parts[name]
            digest.update(line)
            for piece in pieces:
                digest.update(piece.result())
        return f"{SCHEME}:{digest.hexdigest()}"


def _piece_digest(data: np.ndarray, start: int) -> bytes:
    return xxhash.xxh3_128_digest(data[start : start + PIECE_BYTES].data)


def verifiable(a: str, b: str) -> bool:
    """Whether two fingerprints compare: both made, by one scheme."""
    return bool(a and b) and a.partition(":")[0] == b.partition(":")[0]


_WIDTHS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(tensor: Tensor) -> Tensor:
    """The tensor's elements as integers of their width (equal bits compare equal, NaNs included)."""
    return tensor.contiguous().reshape(-1).view(_WIDTHS[tensor.element_size()])


def _changed(tensor: Tensor, before: Tensor, index_dtype: torch.dtype, pool: ThreadPoolExecutor) -> Tensor:
    """The flat indices (``index_dtype``) where host tensors ``tensor`` and ``before`` differ in their
    bits, chunk by chunk on ``pool``'s threads (numpy lets go of the GIL while it compares)."""
    new, old = _bits(tensor).numpy(), _bits(before).numpy()
    kind = np.int32 if index_dtype == torch.int32 else np.int64

    def chunk(start: int) -> np.ndarray:
        hit = np.flatnonzero(new[start : start + CHUNK] != old[start : start + CHUNK])
        return (hit + start).astype(kind, copy=False)

    starts = range(0, new.size, CHUNK)
    parts = [chunk(0)] if len(starts) == 1 else list(pool.map(chunk, starts))
    return torch.from_numpy(np.concatenate(parts) if parts else np.empty(0, kind))


def _delta_on(
    device: torch.device, tensor: Tensor, before: Tensor, index_dtype: torch.dtype
) -> Tensor | tuple[Tensor, Tensor] | None:
    """:func:`_tensor_delta` by torch on ``device``: the pair copied there unless it lives there
    already (a trainer's buckets kept on its GPU), the indices and values gathered there (and left
    there: :func:`_packed` brings a bucket's down at once), a whole tensor on the host."""
    here = tensor.to(device, non_blocking=True)
    changed = (_bits(here) != _bits(before.to(device, non_blocking=True))).nonzero().reshape(-1)
    if not changed.numel():
        return None
    if changed.numel() > DENSE_FRACTION * tensor.numel():
        return tensor.cpu()
    values = here.reshape(-1).index_select(0, changed)
    return changed.to(index_dtype), values


def weight_delta(
    old: Mapping[str, Tensor], new: Mapping[str, Tensor], *, device: torch.device | str | None = None
) -> dict[str, Tensor]:
    """The delta from ``old`` to ``new`` (tensors of the same names, shapes and dtypes: one bucket of
    two versions); a tensor unchanged bit for bit is left out, the changed elements of the others
    packed (see the module).

    ``device``: compare there with torch, each pair copied up unless it is there already, and the
    changes brought back (a trainer on a GPU keeps both versions' buckets there: the host's hash and
    comparison of a 0.5B model took 0.57 s on an H200 machine, the GPU's with both copied up
    0.34-0.61 s on an H100 machine, with both kept there 0.16 s, the hash included); without it,
    host tensors on the host through numpy and others on their own device. Both give the same delta,
    on the host."""
    where = torch.device(device) if device is not None else None
    if where is not None and (at_once := _bucket_delta(old, new, where)) is not None:
        return at_once
    whole: dict[str, Tensor] = {}
    sparse: list[tuple[str, Tensor, Tensor]] = []
    with ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="weight-delta") as pool:
        for name, tensor in new.items():
            part = _tensor_delta(name, tensor, old, pool, where)
            if isinstance(part, Tensor):
                whole[name] = part
            elif part is not None:
                sparse.append((name, *part))
    return {**whole, **_packed(sparse)}


def _bucket_delta(
    old: Mapping[str, Tensor], new: Mapping[str, Tensor], device: torch.device
) -> dict[str, Tensor] | None:
    """:func:`weight_delta` of a bucket whose weights are all comparable and of one dtype, found on
    ``device`` for the whole bucket at once: one search for the changed elements and one count of
    them a weight, so the host waits on the device twice a bucket instead of once a weight (a 0.5B
    model has some 290); None for a bucket it does not fit (the weights are then compared one by one)."""
    items = list(new.items())
    dtype = items[0][1].dtype if items else None
    if dtype is None or dtype.itemsize not in _WIDTHS:
        return None
    for name, tensor in items:
        before = old.get(name)
        if tensor.dtype != dtype or before is None or before.dtype != dtype or before.shape != tensor.shape:
            return None
    sizes = [tensor.numel() for _, tensor in items]
    if max(sizes) >= 2**31:
        return None
    bits = torch.cat([_bits(tensor.to(device, non_blocking=True)) for _, tensor in items])
    before = torch.cat([_bits(old[name].to(device, non_blocking=True)) for name, _ in items])
    changed = (bits != before).nonzero().reshape(-1)
    if not changed.numel():
        return {}
    ends = torch.tensor(list(accumulate(sizes)), device=device)
    weight = torch.searchsorted(ends, changed, right=True)  # the weight each changed element is in
    counts = torch.bincount(weight, minlength=len(items)).tolist()
    dense = [count > DENSE_FRACTION * size for count, size in zip(counts, sizes, strict=True)]
    if any(dense):  # those travel whole: their elements leave the runs
        keep = ~torch.tensor(dense, device=device)[weight]
        changed, weight = changed[keep], weight[keep]
    starts = ends - torch.tensor(sizes, device=device)
    index, values = (changed - starts[weight]).to(torch.int32), bits[changed].view(dtype)
    runs = [(name, count) for (name, _), count, whole in zip(items, counts, dense, strict=True)
            if count and not whole]  # fmt: skip
    lengths = [count for _, count in runs]
    sparse = [(name, i, v) for (name, _), i, v in
              zip(runs, index.split(lengths), values.split(lengths), strict=True)]  # fmt: skip
    whole = {name: tensor.cpu() for (name, tensor), is_whole in zip(items, dense, strict=True) if is_whole}
    return {**whole, **_packed(sparse)}


def _packed(sparse: list[tuple[str, Tensor, Tensor]]) -> dict[str, Tensor]:
    """The sparse weights' ``(name, indices, values)`` as the packed tensors, those whose values have
    another dtype than the most common one as their own pairs (the form before wire 2.10); on the
    host (runs found on a device are joined there and come down in one copy each)."""
    if not sparse:
        return {}
    dtype = Counter(values.dtype for _, _, values in sparse).most_common(1)[0][0]
    runs = [part for part in sparse if part[2].dtype == dtype]
    index_dtype = torch.int64 if any(index.dtype == torch.int64 for _, index, _ in runs) else torch.int32
    names = "\n".join(name for name, _, _ in runs).encode()
    return {
        **{key: t.cpu() for name, index, values in sparse if values.dtype != dtype
           for key, t in ((name + INDEX, index), (name + VALUES, values))},
        INDEX: torch.cat([index.to(index_dtype) for _, index, _ in runs]).cpu(),
        VALUES: torch.cat([values for _, _, values in runs]).cpu(),
        NAMES: torch.frombuffer(bytearray(names), dtype=torch.uint8),
        COUNTS: torch.tensor([index.numel() for _, index, _ in runs], dtype=torch.int64),
    }  # fmt: skip


def _tensor_delta(
    name: str,
    tensor: Tensor,
    old: Mapping[str, Tensor],
    pool: ThreadPoolExecutor,
    device: torch.device | None,
) -> Tensor | tuple[Tensor, Tensor] | None:
    """One weight's part of :func:`weight_delta`: nothing, the whole tensor, or its changed elements'
    flat indices and values."""
    before = old.get(name)
    comparable = before is not None and before.shape == tensor.shape and before.dtype == tensor.dtype
    if not comparable or tensor.element_size() not in _WIDTHS:
        return tensor  # nothing to compare with: whole
    assert before is not None
    index_dtype = torch.int32 if tensor.numel() < 2**31 else torch.int64
    if device is None and tensor.device.type != "cpu":  # off the host: compared where it is
        device = tensor.device
    if device is not None:
        return _delta_on(device, tensor, before, index_dtype)
    changed = _changed(tensor, before, index_dtype, pool)
    if not changed.numel():
        return None
    if changed.numel() > DENSE_FRACTION * tensor.numel():
        return tensor
    return changed, _gather(tensor, changed)


class DeltaPlan(NamedTuple):
    """A delta checked against what it will be written into (:func:`check_delta`): the weights that
    travel whole, and per sparse weight its flat indices and new values."""

    whole: dict[str, Tensor]
    sparse: dict[str, tuple[Tensor, Tensor]]

    @property
    def names(self) -> list[str]:
        return [*self.whole, *self.sparse]


def apply_delta(held: MutableMapping[str, Tensor], delta: Mapping[str, Tensor]) -> list[str]:
    """Write ``delta`` into ``held`` (the receiver's copy of the version before, changed in place);
    returns the names changed. A delta that does not fit ``held`` (an unknown name, an index out of
    range, a count, dtype or shape that differs) raises :class:`BatchContractError` before anything
    is written."""
    plan = check_delta(held, delta)
    write_delta(held, plan)
    return plan.names


def delta_parts(delta: Mapping[str, Tensor]) -> DeltaPlan:
    """``delta``'s weights by name, from either form (see the module): those that travel whole, and
    per sparse weight its indices and values (views of the packed tensors). Its structure is checked
    (:class:`BatchContractError` naming the part): the packed tensors all four or none, names
    UTF-8, unique and without ``@``, one int64 count a name, as many indices and values as the
    counts add up to, each pair's two tensors together, no weight twice."""
    whole: dict[str, Tensor] = {}
    sparse = _runs(delta) if any(key in delta for key in PACKED) else {}
    for key, tensor in delta.items():
        if key in PACKED or key.endswith(VALUES):
            continue
        name = key.removesuffix(INDEX)
        if name in sparse or name in whole:
            raise BatchContractError(name, "in the delta twice")
        if key.endswith(INDEX):
            values = delta.get(name + VALUES)
            if values is None:
                raise BatchContractError(key, f"no {name + VALUES} beside it")
            sparse[name] = (tensor, values)
        else:
            whole[key] = tensor
    orphans = [
        k for k in delta if k.endswith(VALUES) and k != VALUES and k[: -len(VALUES)] + INDEX not in delta
    ]
    if orphans:
        raise BatchContractError(orphans[0], "values without their indices")
    return DeltaPlan(whole, sparse)


def _runs(delta: Mapping[str, Tensor]) -> dict[str, tuple[Tensor, Tensor]]:
    """The packed tensors of ``delta`` read back into each weight's indices and values (views)."""
    missing = [key for key in PACKED if key not in delta]
    if missing:
        raise BatchContractError(missing[0], f"a packed delta needs all of {', '.join(PACKED)}")
    index, values, names_bytes, counts = (delta[key] for key in PACKED)
    if names_bytes.dtype != torch.uint8 or names_bytes.dim() != 1:
        raise BatchContractError(NAMES, "expected 1-dim uint8: UTF-8 names, one a line")
    try:
        names = bytes(names_bytes.cpu().numpy()).decode("utf-8").split("\n")
    except UnicodeDecodeError as exc:
        raise BatchContractError(NAMES, f"not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    if any(not name or "@" in name for name in names) or len(set(names)) != len(names):
        raise BatchContractError(NAMES, "an empty, repeated or '@' name")
    if counts.dtype != torch.int64 or counts.dim() != 1 or counts.numel() != len(names):
        raise BatchContractError(COUNTS, f"expected {len(names)} int64 counts, one a name")
    lengths = counts.tolist()
    if min(lengths) < 0:
        raise BatchContractError(COUNTS, "a negative count")
    total = sum(lengths)
    for key, tensor in ((INDEX, index), (VALUES, values)):
        if tensor.dim() != 1 or tensor.numel() != total:
            raise BatchContractError(key, f"expected 1-dim, {total} elements (the counts' sum)")
    starts = [0, *accumulate(lengths)]
    return {name: (index.narrow(0, start, n), values.narrow(0, start, n))
            for name, start, n in zip(names, starts, lengths, strict=False)}  # fmt: skip


def check_delta(held: Mapping[str, Tensor], delta: Mapping[str, Tensor]) -> DeltaPlan:
    """``delta`` checked whole against ``held``: :class:`BatchContractError` for a part that does not
    fit (its structure, :func:`delta_parts`; an unknown name, an index out of range, a count, dtype
    or shape that differs)."""
    whole, sparse = delta_parts(delta)
    for name, tensor in whole.items():
        target = held.get(name)
        if target is None or target.shape != tensor.shape or target.dtype != tensor.dtype:
            raise BatchContractError(name, "does not match the weights held (name, shape or dtype)")
    for name, (index, values) in sparse.items():
        target = held.get(name)
        if target is None:
            raise BatchContractError(name, "a delta for a weight not held")
        if index.dtype not in (torch.int32, torch.int64) or index.dim() != 1:
            raise BatchContractError(name + INDEX, "expected 1-dim int32 or int64 indices")
        if values.dtype != target.dtype or values.shape != index.shape:
            raise BatchContractError(name + VALUES, f"expected {index.numel()} {target.dtype} values")
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= target.numel()):
            raise BatchContractError(name + INDEX, f"an index outside 0..{target.numel() - 1}")
    return DeltaPlan(whole, sparse)


def overwritten(held: Mapping[str, Tensor], plan: DeltaPlan) -> DeltaPlan:
    """What writing ``plan`` into ``held`` overwrites, as a plan that writes it back: the whole
    weights' old values (on the host) and the sparse weights' old elements at the same indices."""
    whole = {name: held[name].detach().to("cpu", copy=True) for name in plan.whole}
    gathered = _on_threads(lambda name: _gather(held[name].detach(), plan.sparse[name][0]), plan.sparse)
    sparse = {name: (plan.sparse[name][0], old) for name, old in zip(plan.sparse, gathered, strict=True)}
    return DeltaPlan(whole, sparse)


def _on_threads(work: Callable[[str], Any], names: Iterable[str]) -> list[Any]:
    """``work`` on each name, a tensor a task, on torch's thread count (torch gathers scattered
    elements on one thread; a many-core host has the memory bandwidth for several)."""
    with ThreadPoolExecutor(max(1, torch.get_num_threads()), thread_name_prefix="delta-write") as pool:
        return list(pool.map(work, names))


def _gather(tensor: Tensor, index: Tensor) -> Tensor:
    """``tensor``'s elements at the flat ``index``, a new contiguous tensor of its dtype and device."""
    return tensor.reshape(-1).index_select(0, index.to(tensor.device))


def write_delta(held: Mapping[str, Tensor], plan: DeltaPlan) -> None:
    """Write a checked ``plan`` into ``held`` in place (tensors on the host or a device) by torch's
    indexing (on the host, torch spreads each scattered write over its threads). A write that raises
    leaves the ones before it written (:func:`overwritten` is how a caller puts them back)."""
    for name, tensor in plan.whole.items():
        held[name].detach().copy_(tensor)
    for name, (index, values) in plan.sparse.items():
        target = held[name].detach()
        where, new = index.to(target.device), values.to(target.device)
        if target.is_contiguous():
            target.view(-1)[where] = new
        else:  # no flat view of it: written flat, then copied back
            flat = target.reshape(-1).clone()
            flat[where] = new
            target.copy_(flat.view(target.shape))
