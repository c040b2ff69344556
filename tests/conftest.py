"""Fixtures shared by every test package: a real nats-server on a free port, a temporary Hugging
Face hub cache."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlfleet.common.control.embedded_nats import EmbeddedNats
from rlfleet.common.schema.trainer import CPU_BF16_ENV

# ``mixed_precision: auto`` would train in bf16 on a CPU with AVX512-BF16 or AMX and in fp32 on
# others; the suite pins fp32 so that it checks the same numbers on every CI host (its exactness
# tests compare micro-batched, sharded and resumed updates bit for bit or at fp32 tolerances).
# Every process a test starts inherits it. ``RLFLEET_CPU_BF16=1 pytest ...`` runs the bf16 path.
os.environ.setdefault(CPU_BF16_ENV, "0")


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    """A nats-server (JetStream on) for the whole session; stops exactly its own pid afterwards."""
    with EmbeddedNats() as server:
        yield server


class HFCache:
    """A Hugging Face hub cache in a temporary folder, in the layout ``huggingface_hub`` writes:
    ``models--org--name/{blobs/<digest>, snapshots/<commit>/<file> -> blob, refs/main}``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def place(self, folder: Path, repo_id: str, *, refs: tuple[str, ...] = ("main",)) -> Path:
        """Copy the model in ``folder`` into the cache as ``repo_id``, its commit under each of ``refs``;
        returns its snapshot folder."""
        repo = self.root / f"models--{repo_id.replace('/', '--')}"
        commit = hashlib.sha1(f"{repo_id}:{sorted(p.name for p in folder.iterdir())}".encode()).hexdigest()
        snapshot = repo / "snapshots" / commit
        for file in sorted(p for p in folder.rglob("*") if p.is_file()):
            data = file.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = snapshot / file.relative_to(folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        for ref in refs:
            (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
            (repo / "refs" / ref).write_text(commit)
        return snapshot


@pytest.fixture
def hf_cache(tmp_path: Path) -> HFCache:
    """An empty Hugging Face hub cache in a temporary folder (``place`` puts models in it)."""
    root = tmp_path / "hf-hub-cache"
    root.mkdir()
    return HFCache(root)
