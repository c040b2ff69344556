"""Weight sync over the gRPC host path: the whole version against its delta (issue 32), in one run.

    uv run --extra cpu python benchmarks/weight_sync.py                   # a 0.5B-shaped model, on CPU
    python3 benchmarks/weight_sync.py --device cuda --out $OUT/ws.json    # the trainer on a GPU
    uv run --extra cpu python benchmarks/weight_sync.py --smoke           # the tiny preset, 2 versions

A Qwen2.5-0.5B-shaped model (random init, 494M parameters; float32 master weights, as a trainer
holds them) takes ``--versions`` optimizer steps (AdamW at ``--lr`` on random gradients: every
weight moves by about the learning rate, as in an RL update). After each, one sync as the fleet
does it, with the real parts: the trainer walks its weights in bf16 buckets
(``iter_weight_buckets``) into its TensorStore (a real gRPC server on localhost), hashes them and
diffs them against the version before (the trainer's own ``sync_parts``; a trainer on a GPU keeps
each version's buckets there and compares them there); a receiver (a bf16 model on the host, as
the HF engine holds it) pulls over gRPC (``ClientPool.fetch_all``, as a rollout worker pulls)
either every bucket (``full``: copied into the model in place, the HF engine's ``copy_weights``)
or only the delta, taken one of two ways: ``delta``, straight into the model's own weights, each
bucket as it arrives while the next is pulled (the HF engine's ``load_delta`` as the rollout worker
calls it: ``ClientPool.fetch_into`` and ``write_delta_in_place``, which keeps only the elements it
overwrites), or
``delta_host_copy``, written into a host copy of the version before (``write_delta_in_place``, as
the rollout worker writes its copy) and the whole version then copied into the model (the way of an
engine that loads whole versions only: vLLM).
Each hashes what it then holds; both ends' fingerprints must agree.

Reported per side (median over the versions after the first): bytes moved, trainer seconds
(stage; for a delta, plus the diff), receiver seconds (pull, apply, load, hash; ``pull_s`` and
``apply_s``, for ``delta`` ``pull_and_apply_s``, and ``hash_s`` beside them) and their sum; the
share of bf16 weights that changed. ``--breakdown`` adds, per delta side, the seconds spent in each
function of the sync (``Parts``: the trainer's diff and fingerprint, the receiver's check, gather,
write and hash). Target (issue 32): delta sync of the 0.5B model over the host path under 0.3 s.
The JSON names the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import smoke  # noqa: E402  (this folder's helper modules)
from colocated_sync import QWEN25_05B, TINY  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "weight_sync_cpu.json"
SIDES = ("full", "delta", "delta_host_copy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen2.5-0.5b", choices=["qwen2.5-0.5b", "tiny"])
    p.add_argument("--device", default="cpu", help="where the trainer's model lives (cpu, cuda)")
    p.add_argument("--versions", type=int, default=4, help="optimizer steps, one sync after each")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of the steps")
    p.add_argument("--bucket-mb", type=float, default=64.0, help="a publish's bucket size (the default's)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--breakdown", action="store_true", help="also time each part of both ends (see Parts)")
    p.add_argument("--smoke", action="store_true", help=smoke.HELP)
    return smoke.parse(p, argv, {"preset": "tiny", "versions": 2, "bucket_mb": 1.0})


def build_model(preset: str, device: str) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    shape = QWEN25_05B if preset == "qwen2.5-0.5b" else TINY
    config = Qwen2Config(**shape, tie_word_embeddings=True, torch_dtype="float32")
    return Qwen2ForCausalLM(config).to(device)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One optimizer step on random gradients of the size a real step's have."""
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class Parts:
    """``--breakdown``: seconds spent in each named function of the sync's own modules, summed over
    calls and threads (the trainer's fingerprint runs beside its diff, the receiver's check, gather
    of what it overwrites, write and hash submission one bucket after another on its thread, so a
    part's seconds say where the time goes, not what adds up to the total). Each function is
    wrapped in the module that calls it, for the run; :meth:`take` returns the sums since the last."""

    WRAPPED = (
        ("rlfleet.trainer.service", ("weights_fingerprint", "weight_delta")),
        ("rlfleet.common.tensors.weight_sync", ("_packed", "_delta_on")),
        ("rlfleet.rollout.engines.weights", ("check_delta", "overwritten", "write_delta")),
    )

    def __init__(self) -> None:
        import importlib
        import threading

        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        for module_name, names in self.WRAPPED:
            module = importlib.import_module(module_name)
            for name in names:
                setattr(module, name, self.timed(name, getattr(module, name)))

    def timed(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

        return timed

    def take(self) -> dict[str, float]:
        with self._lock:
            taken, self.seconds = self.seconds, {}
        return {f"{name}_s": round(v, 4) for name, v in sorted(taken.items())}


async def sync_round(
    model: torch.nn.Module, receiver: torch.nn.Module, store: Any, clients: Any, state: dict[str, Any],
    version: int, bucket_bytes: int, parts: Parts | None = None,
) -> dict[str, dict[str, float]]:  # fmt: skip
    """Stage ``version`` in the store, then sync the receiver both ways; each side's figures."""
    from rlfleet.common.tensors.weight_sync import Fingerprinter, fingerprint
    from rlfleet.rollout.engines.weights import copy_weights, load_targets, write_delta_in_place
    from rlfleet.trainer.service import sync_parts
    from rlfleet.trainer.weights import iter_weight_buckets, put_version

    t0 = time.perf_counter()
    on_gpu = model.device.type == "cuda"  # the trainer's staging: on a GPU the buckets stay there too
    walk = iter_weight_buckets(model, bucket_bytes, dtype=torch.bfloat16, on_device=on_gpu)
    kept = list(walk) if on_gpu else []
    refs = put_version(store, version, kept if on_gpu else walk)
    staged = time.perf_counter()
    published, _ = sync_parts(store, version, refs, [])  # the whole version's publish: its fingerprint
    hashed = time.perf_counter()
    deltas: list[Any] = []
    changed = total = 0
    if parts:
        parts.take()  # the whole version's publish left out
    if state.get("refs"):  # delta sync's publish: the fingerprint and the delta from the version before
        pairs = (state["kept"], kept) if kept and state.get("kept") else None
        again, deltas = sync_parts(store, version, refs, state["refs"], model.device, pairs)
    state["kept"] = kept
    diffed = time.perf_counter()
    trainer_parts = parts.take() if parts else {}
    if deltas:
        assert again == published
        for ref in deltas:
            delta = store.get_local(ref.key)
            changed += sum(delta[k].numel() for k in delta if k.endswith("@idx") or "@" not in k)
        total = sum(t.numel() for ref in refs for t in store.get_local(ref.key).values())
    for ref in state.get("refs", []):
        store.delete(ref.key)
    for ref in state.get("deltas", []):
        store.delete(ref.key)
    state["refs"], state["deltas"] = refs, deltas
    targets = load_targets(receiver)
    names = [name for ref in refs for name in store.get_local(ref.key)]
    sides: dict[str, dict[str, float]] = {}

    async def receive(refs: list[Any], load: Any, held: Any, as_they_come: bool = False) -> dict[str, float]:
        """Pull ``refs`` and ``load`` them (an iterable of buckets), then hash what ``held()`` gives:
        the receiver's seconds. ``as_they_come``: each bucket loaded as it arrives, while the next is
        pulled (``ClientPool.fetch_into``, as the rollout worker loads a delta into its engine), so
        the pull and the load are one figure, and ``load`` hands each bucket's weights once written
        to the hash (its second argument), whose ``hash_s`` is then what is left of it at the end."""
        if parts:
            parts.take()
        t1 = time.perf_counter()
        if as_they_come:  # and each bucket's weights hashed once written, as the rollout worker does
            with Fingerprinter() as hashes:
                hash_add = parts.timed("hash_add", hashes.add_all) if parts else hashes.add_all
                consume = parts.timed("consume", lambda buckets: load(buckets, hash_add)) if parts else (
                    lambda buckets: load(buckets, hash_add))  # fmt: skip
                await clients.fetch_into(refs, consume)
                applied = time.perf_counter()
                got = hashes.value(held())
            split = {"pull_and_apply_s": applied - t1, **(parts.take() if parts else {})}
        else:
            buckets = await clients.fetch_all(refs)
            pulled = time.perf_counter()
            load(buckets)
            applied = time.perf_counter()
            split = {"pull_s": pulled - t1, "apply_s": applied - pulled}
            got = fingerprint(held())
        t2 = time.perf_counter()
        assert got == published, "the receiver does not hold the published weights bit for bit"
        return {**split, "hash_s": t2 - applied, "receiver_s": t2 - t1}

    if deltas:  # the receiver's model holds the version before: the delta first, each way
        trainer_s = staged - t0 + diffed - hashed  # stage, then hash and diff as a delta publish does
        common = {"bytes": float(sum(r.nbytes for r in deltas)), "trainer_s": trainer_s,
                  "stage_s": staged - t0, "hash_and_diff_s": diffed - hashed,
                  "changed_frac": changed / max(total, 1),
                  **{"trainer_" + k: v for k, v in trainer_parts.items()}}  # fmt: skip
        engine = await receive(deltas, lambda got, written: write_delta_in_place(targets, got, (), written),
                               lambda: [(n, targets[n]) for n in names], as_they_come=True)  # fmt: skip
        base = state["held"]

        def through_copy(buckets: list[dict[str, torch.Tensor]]) -> None:
            write_delta_in_place(base, buckets)  # as the rollout worker writes its host copy
            copy_weights(targets, list(base.items()))

        copied = await receive(deltas, through_copy, lambda: base.items())
        for name, measured in (("delta", engine), ("delta_host_copy", copied)):
            sides[name] = {**common, **measured, "total_s": trainer_s + measured["receiver_s"]}
    full = await receive(refs, lambda buckets: copy_weights(targets, [i for b in buckets for i in b.items()]),
                         lambda: [(n, targets[n]) for n in names])  # fmt: skip
    sides["full"] = {"bytes": float(sum(r.nbytes for r in refs)), "stage_s": staged - t0,
                     "trainer_s": hashed - t0, **full,
                     "total_s": hashed - t0 + full["receiver_s"]}  # fmt: skip
    state["held"] = {n: targets[n].detach().clone() for n in names}  # the host copy for the next delta
    return sides


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from rlfleet.common.schema.worker import TensorPlaneSettings
    from rlfleet.common.tensors.store import ClientPool, worker_store

    model = build_model(args.preset, args.device)
    receiver = build_model(args.preset, "cpu").to(torch.bfloat16)  # the engine's copy, bf16 on the host
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    plane = TensorPlaneSettings()
    store = await worker_store(plane, capacity_bytes=16 * 2**30, ttl_s=3600.0)
    clients = ClientPool(plane)
    state: dict[str, Any] = {}
    parts = Parts() if args.breakdown else None
    rounds = []
    try:
        for version in range(1, args.versions + 1):
            step(model, optimizer)
            sides = await sync_round(model, receiver, store, clients, state, version,
                                     int(args.bucket_mb * 2**20), parts)  # fmt: skip
            print(f"version {version}: " + "; ".join(
                f"{name} {s['bytes'] / 2**20:.1f} MB in {s['total_s']:.3f} s ("
                + ", ".join(f"{k} {v:.3f}" for k, v in s.items() if k.endswith("_s") and k != "total_s") + ")"
                for name, s in sides.items()), flush=True)  # fmt: skip
            rounds.append(sides)
    finally:
        await clients.close()
        await store.stop()
    params = sum(p.numel() for p in model.parameters())
    report: dict[str, Any] = {"preset": args.preset, "parameters": params, "lr": args.lr,
                              "bucket_mb": args.bucket_mb, "versions": args.versions,
                              "rounds": rounds}  # fmt: skip
    timed = [r for r in rounds if "delta" in r] or rounds
    for name in SIDES:
        values = [r[name] for r in timed if name in r]
        if values:
            report[name] = {k: statistics.median(v[k] for v in values) for k in values[0]}
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from async_pipeline import machine

    report = asyncio.run(run(args))
    report["machine"] = machine(args.device)
    report["command"] = " ".join(["python", *sys.argv])
    print("| side | MB moved | trainer s | receiver s | total s |")
    print("| --- | --- | --- | --- | --- |")
    for name in SIDES:
        if name in report:
            s = report[name]
            print(
                f"| {name} | {s['bytes'] / 2**20:.1f} | {s['trainer_s']:.3f} | {s['receiver_s']:.3f} | "
                f"{s['total_s']:.3f} |"
            )
    if "delta" in report:
        print(f"changed bf16 weights: {report['delta']['changed_frac']:.2%}; target: delta total under 0.3 s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
