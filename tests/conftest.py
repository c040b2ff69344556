"""Fixtures shared by every test package (a real nats-server on a free port, a temporary Hugging Face
hub cache) and which tests marked ``slow`` a run takes.

``slow`` marks the long end-to-end runs whose path a faster test already walks; a plain ``pytest``
leaves them out (its summary counts them as deselected), so that the README's test command stays
within CI's time. ``--slow`` takes them all; ``--slow-share K/N`` takes the K-th of N equal shares of
them (by node id, sorted; K from 0), which CI runs after the suite, a share picked by the commit, so
that every slow test runs in CI every N commits. An explicit ``-m`` expression decides alone
(``-m slow``, ``-m "not slow"``)."""

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


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rlfleet")
    group.addoption("--slow", action="store_true", help="also run the tests marked slow")
    group.addoption(
        "--slow-share", metavar="K/N", default=None,
        help="of the tests marked slow, run only the K-th of N equal shares (K from 0)",
    )  # fmt: skip


def share_of(spec: str) -> tuple[int, int]:
    """``"K/N"`` as (K, N), with 0 <= K < N; a clear error otherwise."""
    k, sep, n = spec.partition("/")
    if not (sep and k.strip().isdigit() and n.strip().isdigit()) or not 0 <= int(k) < int(n):
        raise pytest.UsageError(f"--slow-share takes K/N with 0 <= K < N (K from 0), not {spec!r}")
    return int(k), int(n)


def slow_share(nodeids: list[str], k: int, n: int) -> set[str]:
    """The K-th of N shares of ``nodeids``: every N-th of them sorted, from the K-th on. The N shares
    partition the ids and their sizes differ by at most one."""
    return set(sorted(nodeids)[k::n])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    spec = config.getoption("--slow-share")
    share = share_of(spec) if spec is not None else None
    if share is None and (config.option.markexpr or config.getoption("--slow")):
        return  # the run's own -m expression decides, or --slow takes every test
    slow = [item.nodeid for item in items if item.get_closest_marker("slow") is not None]
    dropped = set(slow) - (slow_share(slow, *share) if share is not None else set())
    if dropped:
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in dropped])
        items[:] = [item for item in items if item.nodeid not in dropped]


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
