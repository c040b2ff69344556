"""Fixtures of the reward tests: tiny sequence-classification models, a rollout store, in-process servers.

``make_tiny_rm(num_labels, seed)`` builds (once per session and arguments) a 2-layer BERT
classifier with a character tokenizer in a temporary folder (its tests skip where the ``models``
extra, transformers, is not installed). ``rollout_store`` is a real TensorStore gRPC server
holding rollout batches made from texts (numpy arrays: no torch needed). ``reward_server`` starts a
:class:`RewardWorker` on an in-process transport (tenants' quotas counted in the process) and
returns a client transport next to it. ``spawn`` starts ``rlfleet-reward serve`` processes (or any
command) with a log file each, and stops exactly those at the end of the test.
"""

from __future__ import annotations

import string
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from rlfleet.common.control.inproc_transport import InProcessBroker, InProcessTransport
from rlfleet.common.control.worker import Worker
from rlfleet.common.schema.refs import TensorRef

CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
SPECIALS = ("[PAD]", "[CLS]", "[SEP]", "[UNK]")


def build_char_bert_tokenizer() -> Any:
    """A character-level tokenizer with BERT's specials and text-pair template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIALS, *CHARS))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", unk_token="[UNK]", model_max_length=128)  # fmt: skip


def build_tiny_rm(folder: Path, *, num_labels: int, seed: int) -> Path:
    """Save a random-init 2-layer BERT sequence classifier (hidden 32) and its tokenizer to ``folder``."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = build_char_bert_tokenizer()
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128, num_labels=num_labels,
        id2label={i: f"label{i}" for i in range(num_labels)},
        label2id={f"label{i}": i for i in range(num_labels)},
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def make_tiny_rm(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    # A server of rule rewards is installed without the models extra (scripts/isolated_tests.py): there
    # the tests that need a reward model skip; in the workspace, where the extra is installed, they run.
    pytest.importorskip("transformers", reason="rlfleet-reward[models] is not installed")
    built: dict[tuple[int, int], Path] = {}

    def make(num_labels: int = 1, seed: int = 0) -> Path:
        key = (num_labels, seed)
        if key not in built:
            folder = tmp_path_factory.mktemp(f"tiny-rm-{num_labels}-{seed}")
            built[key] = build_tiny_rm(folder, num_labels=num_labels, seed=seed)
        return built[key]

    return make


class RolloutStore:
    """A real TensorStore holding rollout batches built from texts."""

    def __init__(self) -> None:
        from rlfleet.common.tensors.store import TensorStoreServer

        self.server = TensorStoreServer()

    def put(self, prompts: Sequence[str], responses: Sequence[str], group_index: Sequence[int]) -> TensorRef:
        """Store one rollout batch and return its ref: what the reward server reads of the contract (the
        packed texts and group indices), as numpy arrays, so that it runs where torch is not installed
        (the bytes on the wire are those of torch tensors)."""
        import numpy as np

        from rlfleet.common.schema.batch import pack_texts

        tensors = {"group_index": np.asarray(list(group_index), dtype=np.int64)}
        tensors["prompt_text"], tensors["prompt_text_offsets"] = pack_texts(prompts, arrays="numpy")
        tensors["response_text"], tensors["response_text_offsets"] = pack_texts(responses, arrays="numpy")
        return self.server.put_local(f"batch-{uuid.uuid4().hex[:8]}", tensors)


@pytest.fixture
async def rollout_store() -> AsyncIterator[RolloutStore]:
    store = RolloutStore()
    await store.server.start()
    yield store
    await store.server.stop()


ServerFactory = Callable[[dict[str, Any]], Awaitable[tuple[InProcessTransport, Worker[Any]]]]


@pytest.fixture
async def reward_server() -> AsyncIterator[ServerFactory]:
    """``await reward_server(config_dict)`` -> (client transport, started RewardWorker)."""
    from rlfleet.common.schema.config import load_config
    from rlfleet.reward.service import RewardWorker, RewardWorkerConfig

    started: list[tuple[InProcessTransport, InProcessTransport, RewardWorker]] = []

    async def start(config: dict[str, Any]) -> tuple[InProcessTransport, RewardWorker]:
        broker = InProcessBroker()
        # No NATS here: quotas are counted in the process (tests/reward/test_shared_quotas.py shares them).
        data = {"fleet": {"cluster": "test"}, "worker_id": "reward-0", "quota_store": "process", **config}
        cfg = load_config(RewardWorkerConfig, data=data)
        server = InProcessTransport(broker, tier="reward", name="server")
        client = InProcessTransport(broker, tier="controller", name="client")
        worker = RewardWorker(cfg, server)
        await worker.start()
        started.append((client, server, worker))
        return client, worker

    yield start
    for client, server, worker in started:
        await worker.stop("test over")
        await client.close()
        await server.close()


class Spawned:
    """Processes one test starts, each logging to ``<name>.log``; :meth:`stop` ends exactly those, by pid."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def serve(self, name: str, config: Path, *args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """``rlfleet-reward serve --config CONFIG ARGS...`` (the console script next to this Python)."""
        script = Path(sys.executable).parent / "rlfleet-reward"
        assert script.exists(), f"rlfleet-reward is not installed next to {sys.executable}"
        return self.start(name, [str(script), "serve", "--config", str(config), *args], env=env)

    def start(self, name: str, command: Sequence[str], *, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.log_path(name), "wb") as log:
            proc = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs[name] = proc
        return proc

    def log_path(self, name: str) -> Path:
        return self.where / f"{name}.log"

    def log(self, name: str) -> str:
        return self.log_path(name).read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM to each process still running, then SIGKILL to any that outlives 15 s."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for name, proc in self.procs.items():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            if proc.returncode not in (0, -15):
                print(f"--- {name} exited {proc.returncode}:\n{self.log(name)[-3000:]}")


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawned]:
    started = Spawned(tmp_path)
    try:
        yield started
    finally:
        started.stop()
