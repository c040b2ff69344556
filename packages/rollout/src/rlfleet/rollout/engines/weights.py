"""Load named tensors into a live ``torch.nn.Module`` in place, validating every name, shape and dtype.

Used by the HF engine to take a weight bucket from the trainer: each tensor is copied into the
existing parameter's storage (``param.data.copy_``), so everything that holds a reference to a
parameter (tied embeddings, CUDA graphs, compiled code) keeps seeing the live values. A bucket
is validated as a whole before anything is copied, so a bad bucket leaves the model untouched;
and each tensor about to be overwritten is kept (a copy on the CPU) until the whole bucket is in,
so a copy that fails partway puts every overwritten tensor back: the model holds the old weights
or the new ones, never a mix. The price is a CPU copy of the bucket's targets while it loads.

A weight delta (delta sync) goes straight into the live tensors the same way
(:func:`write_delta_in_place`): checked whole first, and only the elements it overwrites are kept.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from rlfleet.common.tensors.weight_sync import DeltaPlan, check_delta, overwritten, write_delta
from rlfleet.rollout.engines.base import WeightsInput
from rlfleet.rollout.errors import UnknownWeight, WeightDtypeMismatch, WeightShapeMismatch

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TiedPair:
    """Two state_dict names that must hold the same values (e.g. input embedding and LM head)."""

    first: str
    second: str


def load_targets(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every loadable tensor of ``module`` by state_dict name: parameters and persistent buffers.

    Tied parameters appear under each of their names (both point to one ``Parameter``).
    """
    return dict(module.state_dict(keep_vars=True))


def _items(weights: WeightsInput) -> list[tuple[str, torch.Tensor]]:
    if isinstance(weights, Mapping):
        return list(weights.items())
    return list(weights)


def validate(targets: Mapping[str, torch.Tensor], items: list[tuple[str, torch.Tensor]]) -> None:
    """Raise :class:`UnknownWeight`, :class:`WeightShapeMismatch` or :class:`WeightDtypeMismatch`."""
    unknown = [name for name, _ in items if name not in targets]
    if unknown:
        known = list(targets)
        suggestions = {n: difflib.get_close_matches(n, known, n=1, cutoff=0.6) for n in unknown}
        raise UnknownWeight(unknown, suggestions, known[:3])
    for name, tensor in items:
        target = targets[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise WeightShapeMismatch(name, tuple(target.shape), tuple(tensor.shape))
        if tensor.is_complex() or tensor.is_floating_point() != target.is_floating_point():
            raise WeightDtypeMismatch(name, str(target.dtype), str(tensor.dtype))


def copy_weights(
    targets: Mapping[str, torch.Tensor], weights: WeightsInput, tied: tuple[TiedPair, ...] = ()
) -> list[str]:
    """Copy ``weights`` into ``targets`` in place (casting dtype and device); return the names loaded.

    For each :class:`TiedPair` whose tensors do not share storage, a tensor that arrived under one
    name only is copied into the other as well. All or nothing: when a copy raises, every tensor
    overwritten so far is restored before the error goes on.
    """
    items = _items(weights)
    validate(targets, items)
    loaded: set[str] = set()
    kept: dict[str, torch.Tensor] = {}  # the old values of what this call overwrote, on the CPU
    with torch.no_grad():
        try:
            for name, tensor in items:
                _keep(kept, name, targets[name])
                targets[name].data.copy_(tensor)
                loaded.add(name)
            for pair in tied:
                source, dest = _tie_direction(pair, loaded)
                if source and targets[source].data_ptr() != targets[dest].data_ptr():
                    _keep(kept, dest, targets[dest])
                    targets[dest].data.copy_(targets[source].data)
        except BaseException:
            for name, old in kept.items():
                targets[name].data.copy_(old)
            logger.warning("a weight copy failed partway: %d overwritten tensor(s) restored", len(kept))
            raise
    logger.debug("loaded %d tensors in place", len(items))
    return [name for name, _ in items]


def write_delta_in_place(
    targets: Mapping[str, torch.Tensor],
    deltas: Iterable[Mapping[str, torch.Tensor]],
    tied: tuple[TiedPair, ...] = (),
    written: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
) -> list[str]:
    """Write a weight delta on the version ``targets`` hold into them in place, bucket by bucket as
    ``deltas`` yields them (a bucket may still be on its way while the one before is written);
    return the names changed. All or nothing over every bucket: each is checked whole before it is
    written (``BatchContractError`` for a part that does not fit), the elements each overwrites are
    kept, and when a check, a write or ``deltas`` itself raises, everything written is put back. A
    tied pair that does not share storage gets the changed tensor copied into its other name.
    ``written``: called after each bucket with the weights it wrote, as now held (a receiver hashes
    them while the next bucket comes; after a failure what it was given is void)."""
    undone: list[DeltaPlan] = []
    names: list[str] = []
    try:
        for delta in deltas:
            plan = check_delta(targets, delta)
            undo = overwritten(targets, plan)
            changed = set(plan.names)
            copies = [(source, dest) for source, dest in (_tie_direction(pair, changed) for pair in tied)
                      if source and targets[source].data_ptr() != targets[dest].data_ptr()]  # fmt: skip
            undo.whole.update({dest: targets[dest].detach().to("cpu", copy=True) for _, dest in copies})
            undone.append(undo)
            write_delta(targets, plan)
            with torch.no_grad():
                for source, dest in copies:
                    targets[dest].data.copy_(targets[source].data)
            names += plan.names
            if written is not None:
                written([(name, targets[name]) for name in [*plan.names, *(dest for _, dest in copies)]])
    except BaseException:
        for undo in reversed(undone):
            write_delta(targets, undo)
        if undone:
            logger.warning("a weight delta failed partway: the %d bucket(s) written put back", len(undone))
        raise
    return names


def _keep(kept: dict[str, torch.Tensor], name: str, target: torch.Tensor) -> None:
    """Remember ``target``'s value before its first overwrite (a name sent twice keeps the oldest)."""
    if name not in kept:
        kept[name] = target.detach().to("cpu", copy=True)


def _tie_direction(pair: TiedPair, loaded: set[str]) -> tuple[str, str]:
    if pair.first in loaded and pair.second not in loaded:
        return pair.first, pair.second
    if pair.second in loaded and pair.first not in loaded:
        return pair.second, pair.first
    return "", ""
