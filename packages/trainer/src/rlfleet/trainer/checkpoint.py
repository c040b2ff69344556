"""Full training checkpoints of a trainer: save everything a run needs to continue exactly.

Layout of ``<dir>`` (every rank calls :func:`save_training_state` / :func:`load_training_state`)::

    <dir>/actor/            model + optimizer, torch.distributed.checkpoint (sharded under FSDP)
    <dir>/critic/           the critic's model + optimizer (PPO only), same format
    <dir>/state.json        LR schedulers, optimizer-step counters (rank 0 writes)
    <dir>/rng-<rank>.json   python ``random`` state of each rank
    <dir>/rng-<rank>.safetensors   torch CPU / CUDA RNG states and the actor's shuffle generator

The model and optimizer go through ``get_state_dict`` / ``set_state_dict``, so the same code
serves one process and FSDP2 ranks. Schedulers and RNG states are JSON and safetensors.

All or nothing, both ways. ``state.json`` marks a training state complete: a save removes the old
one before it writes anything and writes the new one last (atomically), so a save that fails
partway, even over an older checkpoint in the same directory, leaves a directory that no load
accepts. A load reads every part (model and optimizer into buffers of their own, schedulers, RNG
states) before it changes anything, so a damaged part raises and leaves the live model, optimizer,
schedulers and RNGs as they were. The price of a load: one more copy of the model and optimizer
state while it reads (on the CPU; under FSDP, each rank's shards on its device).

Paths from the wire (``trainer.save`` / ``trainer.load``) go through :func:`confine` first: only
directories strictly inside the worker's ``checkpoint_root`` are used, never through a ``..`` or a
symlink that leads out, and before a load every file of the checkpoint is checked to resolve
inside the root too. Nothing is unpickled from elsewhere: RNG states are safetensors, schedulers
JSON; the one pickle left is DCP's ``.metadata`` (torch writes it with pickle), read only from a
checkpoint inside the root (see the package README's trust boundary).
"""

from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from rlfleet.common.atomic_files import write_atomic
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.errors import CheckpointError, CheckpointPathRefused
from rlfleet.trainer.loop import Trainable

logger = logging.getLogger(__name__)

STATE_FILE = "state.json"


def confine(root: str | Path, wire_path: str) -> Path:
    """``wire_path`` (from a request) as an absolute path strictly inside ``root``, or a refusal.

    A relative path is taken under ``root``. Refused: an empty path, a ``..`` component, a path that
    is (or resolves, through symlinks, to) ``root`` itself or anywhere outside it.

    Raises:
        CheckpointPathRefused: naming the path, the root and why.
    """
    base = Path(root).resolve()
    if not wire_path or "\x00" in wire_path:
        raise CheckpointPathRefused(wire_path, base, "an empty path or one with a NUL byte")
    raw = Path(wire_path)
    if ".." in raw.parts:
        raise CheckpointPathRefused(wire_path, base, "'..' is not allowed in a checkpoint path")
    candidate = raw if raw.is_absolute() else base / raw
    if not _inside(candidate.absolute(), base):
        raise CheckpointPathRefused(wire_path, base, "it lies outside the checkpoint root")
    try:
        resolved = candidate.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise CheckpointPathRefused(wire_path, base, f"it cannot be resolved ({exc})") from exc
    if not _inside(resolved, base):
        raise CheckpointPathRefused(wire_path, base, f"it resolves through a symlink to {str(resolved)!r}")
    return resolved


def check_contained(root: str | Path, directory: Path) -> None:
    """Refuse a checkpoint ``directory`` holding a symlink that resolves outside ``root`` (before a load)."""
    base = Path(root).resolve()
    for top, dirs, files in os.walk(directory, followlinks=False):
        for name in [*dirs, *files]:
            entry = Path(top) / name
            if entry.is_symlink() and not _inside(entry.resolve(), base):
                raise CheckpointPathRefused(str(directory), base, f"{str(entry)!r} links outside the root")


def _inside(path: Path, base: Path) -> bool:
    return path != base and path.is_relative_to(base)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _save_part(part: Trainable, path: Path) -> None:
    """Model and optimizer of ``part`` as a DCP checkpoint in ``path`` (collective under FSDP)."""
    model_state, optim_state = get_state_dict(part.model, part.optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.save(state, checkpoint_id=str(path), no_dist=not _distributed())


PartState = tuple[dict[str, Any], dict[str, Any]]
"""A part's model and optimizer state dicts, as ``get_state_dict`` makes them."""


def _read_part(part: Trainable, path: Path) -> PartState:
    """Read ``path`` (written by :func:`_save_part`) into buffers shaped like ``part``'s state; the
    live model and optimizer are not touched (a DCP load into their own tensors would change them
    tensor by tensor, and a damaged file found halfway would leave a mix)."""
    if not path.is_dir():
        raise CheckpointError(path, "holds no model/optimizer checkpoint")
    model_state, optim_state = get_state_dict(part.model, part.optimizer)
    state = tree_map_only(torch.Tensor, _buffer_like, {"model": model_state, "optim": optim_state})
    dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
    return state["model"], state["optim"]


def _buffer_like(tensor: torch.Tensor) -> torch.Tensor:
    """An empty tensor to read ``tensor``'s saved value into: a shard in place under FSDP, else on the CPU."""
    return torch.empty_like(tensor) if isinstance(tensor, DTensor) else torch.empty_like(tensor, device="cpu")


def _schedule_state(part: Trainable) -> dict[str, Any]:
    """The scheduler's plain fields (its lambdas are code, rebuilt with the model) and the step count."""
    sched = {k: v for k, v in part.scheduler.state_dict().items() if k != "lr_lambdas"}
    return {"scheduler": sched, "steps": part.steps}


def _read_schedule(part: Trainable, state: Any, root: Path, name: str) -> tuple[dict[str, Any], int]:
    """The scheduler state and step count of ``state.json``'s entry ``name``, checked before use."""
    try:
        sched = dict(state[name]["scheduler"])
        steps = int(state[name]["steps"])
    except (KeyError, TypeError, ValueError) as exc:
        reason = f"{STATE_FILE} has no readable schedule for the {name} ({exc!r})"
        raise CheckpointError(root, reason) from exc
    sched["lr_lambdas"] = [None] * len(part.optimizer.param_groups)
    return sched, steps


def _save_rng(path: Path, rank: int, generator: torch.Generator | None) -> None:
    version, internal, gauss = random.getstate()
    (path / f"rng-{rank}.json").write_text(json.dumps({"version": version, "state": list(internal),
                                                       "gauss": gauss}))  # fmt: skip
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = state
    if generator is not None:
        tensors["generator"] = generator.get_state()
    save_file(tensors, str(path / f"rng-{rank}.safetensors"))


RngState = tuple[tuple[Any, ...], dict[str, torch.Tensor]]


def _read_rng(path: Path, rank: int) -> RngState:
    """Rank ``rank``'s saved RNG states: python's (checked on a scratch generator) and torch's tensors."""
    files = path / f"rng-{rank}.json", path / f"rng-{rank}.safetensors"
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise CheckpointError(path, f"lacks the RNG state of rank {rank} ({missing})")
    try:
        py = json.loads(files[0].read_text())
        python_state = (py["version"], tuple(py["state"]), py["gauss"])
        random.Random().setstate(python_state)
        tensors = load_file(str(files[1]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(path, f"holds an unreadable RNG state of rank {rank} ({exc!r})") from exc
    if "torch_cpu" not in tensors:
        raise CheckpointError(path, f"lacks the torch CPU RNG state of rank {rank}")
    return python_state, tensors


def _apply_rng(state: RngState, generator: torch.Generator | None) -> None:
    python_state, tensors = state
    random.setstate(python_state)
    torch.set_rng_state(tensors["torch_cpu"])
    if torch.cuda.is_available():
        names = [f"torch_cuda_{i}" for i in range(torch.cuda.device_count())]
        cuda = [tensors[name] for name in names if name in tensors]
        if len(cuda) == len(names):
            torch.cuda.set_rng_state_all(cuda)
    if generator is not None and "generator" in tensors:
        generator.set_state(tensors["generator"])


def save_training_state(
    path: str | Path, actor: Trainable, critic: Trainable | None = None, *,
    generator: torch.Generator | None = None,
) -> Path:  # fmt: skip
    """Write the training state of ``actor`` (and ``critic``) under ``path``; every rank calls it.

    ``generator``: the actor's mini-batch shuffle generator (saved per rank with the RNG states).
    """
    root = Path(path)
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        (root / STATE_FILE).unlink(missing_ok=True)  # an older save here is no longer whole from now on
    _barrier()
    _save_part(actor, root / "actor")
    state: dict[str, Any] = {"actor": _schedule_state(actor)}
    if critic is not None:
        _save_part(critic, root / "critic")
        state["critic"] = _schedule_state(critic)
    _save_rng(root, rank, generator)
    _barrier()  # every rank's parts are written before the state file says they are
    if rank == 0:
        write_atomic(root / STATE_FILE, json.dumps(state, indent=1))
    _barrier()
    logger.info("training state saved to %s (actor step %d)", root, actor.steps)
    return root


def load_training_state(
    path: str | Path, actor: Trainable, critic: Trainable | None = None, *,
    generator: torch.Generator | None = None,
) -> int:  # fmt: skip
    """Restore what :func:`save_training_state` wrote; every rank calls it. Returns the actor's step.

    Everything is read first; only then is anything applied (see the module docstring), so a
    :class:`CheckpointError` (or DCP's error for a damaged part) leaves the training state as it was.
    """
    root = Path(path)
    state_file = root / STATE_FILE
    if not state_file.exists():
        raise CheckpointError(root, f"has no {STATE_FILE}: not a training checkpoint")
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(root, f"has no readable {STATE_FILE} ({exc})") from exc
    if not isinstance(state, dict) or (critic is None) != ("critic" not in state):
        raise CheckpointError(root, "critic presence differs from this run's algorithm")
    parts = [("actor", actor)] + ([("critic", critic)] if critic is not None else [])
    read = [
        (part, _read_part(part, root / name), _read_schedule(part, state, root, name)) for name, part in parts
    ]
    rng = _read_rng(root, _rank())
    for part, (model_state, optim_state), (sched, steps) in read:  # from here on nothing is read
        set_state_dict(part.model, part.optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        part.scheduler.load_state_dict(sched)
        part.steps = steps
    _apply_rng(rng, generator)
    _barrier()
    logger.info("training state loaded from %s (actor step %d)", root, actor.steps)
    return actor.steps


def save_checkpoint(
    path: str | Path, actor: Actor, critic: Trainable | None, mode: Literal["hf", "full"] = "hf"
) -> Path:
    """What ``trainer.save`` does on every rank: an HF export in ``path`` (``hf``), or in ``path/hf``
    with the training state in ``path/trainer`` (``full``)."""
    if mode == "hf":
        return actor.save_hf(path)
    root = Path(path)
    actor.save_hf(root / "hf")
    save_training_state(root / "trainer", actor, critic, generator=actor.generator)
    return root


def check_writable(path: str | Path, mode: Literal["hf", "full"] = "hf") -> None:
    """Before a save's first collective, on every rank: the directory this rank writes into exists
    (made when missing) and is writable (rank 0 writes the HF export; with ``full`` every rank writes
    its shards and RNG state). Raises :class:`CheckpointError` naming the rank."""
    if mode == "hf" and _rank() != 0:
        return
    root = Path(path) / "trainer" if mode == "full" else Path(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(root, f"cannot be made on trainer rank {_rank()}: {exc}") from exc
    if not os.access(root, os.W_OK | os.X_OK):
        raise CheckpointError(root, f"is not writable on trainer rank {_rank()}")


def check_loadable(path: str | Path, critic: Trainable | None) -> None:
    """Before a load's first collective, on every rank: ``path/trainer`` holds what
    :func:`load_checkpoint` reads on this rank (the state file, the model parts, this rank's RNG
    state), so a damaged checkpoint is refused by every rank alike. Raises :class:`CheckpointError`."""
    root = Path(path) / "trainer"
    state_file = root / STATE_FILE
    if not state_file.exists():
        raise CheckpointError(root, f"has no {STATE_FILE}: not a training checkpoint (rank {_rank()})")
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(root, f"has no readable {STATE_FILE} on trainer rank {_rank()}: {exc}") from exc
    if not isinstance(state, dict) or (critic is None) != ("critic" not in state):
        raise CheckpointError(root, "critic presence differs from this run's algorithm")
    parts = ["actor"] + (["critic"] if critic is not None else [])
    missing = [part for part in parts if not (root / part).is_dir()]
    rank = _rank()
    rng = (f"rng-{rank}.json", f"rng-{rank}.safetensors")
    missing += [name for name in rng if not (root / name).is_file()]
    if missing:
        raise CheckpointError(root, f"lacks {', '.join(missing)} (read by trainer rank {rank})")


def load_checkpoint(path: str | Path, actor: Actor, critic: Trainable | None) -> int:
    """What ``trainer.load`` does on every rank: restore ``path/trainer``; returns the actor's step."""
    return load_training_state(Path(path) / "trainer", actor, critic, generator=actor.generator)
