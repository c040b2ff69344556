"""FSDP2 on 2 gloo ranks (CPU) against one process: loss, gradients, update, publish, memory.

The ranks run ``fsdp_ranks.py`` as two processes with the torchrun variables set (the module
docstring there says what each writes); this file computes the same things in one process and
compares. One launch covers every check, so the two interpreters start once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from batches import contract_batch, update  # this folder's helper module (conftest puts it on sys.path)
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from rlfleet.common.schema.trainer import StepSettings, UpdateSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms.grpo import PolicyObjective, prepare
from rlfleet.trainer.distributed import build_mesh, init_distributed, resolve_sharding, setup_nccl
from rlfleet.trainer.loop import accumulate
from rlfleet.trainer.model_io import load_causal_lm
from rlfleet.trainer.policy import local_rows

RANKS_SCRIPT = Path(__file__).with_name("fsdp_ranks.py")
PROMPTS, RESPONSES = [3, 5, 2, 4, 5], [4, 2, 6, 1, 3]  # 5 rows: rank 1 pads one micro-batch row
AGGS = ("token-mean", "seq-mean-token-mean")
BUCKET_BYTES = 9216


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _inputs() -> dict[str, torch.Tensor]:
    """A contract batch (left-padded prompts, right-padded responses), advantages and perturbations."""
    data = contract_batch(PROMPTS, RESPONSES, seed=3)
    del data["group_index"]
    gen = torch.Generator().manual_seed(4)
    n, r = data["response_ids"].shape
    data["advantages"] = torch.tensor([1.0, -0.5, 2.0, -1.0, 0.3])
    data["old_noise"] = 0.3 * torch.randn((n, r), generator=gen)  # so that clipping acts
    data["ref_shift"] = torch.full((n, r), -0.2)  # so that the KL term acts
    return data


@pytest.fixture(scope="module")
def odd_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer tied Llama whose vocabulary (67) splits unevenly over 2 ranks (34 + 33 rows)."""
    path = tmp_path_factory.mktemp("odd-llama")
    config = LlamaConfig(
        vocab_size=67, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(1234)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def fsdp_run(
    odd_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, torch.Tensor]]:
    """Run the two ranks once; returns their output directory and the batch they used."""
    out = tmp_path_factory.mktemp("fsdp")
    data = _inputs()
    save_file(data, str(out / "batch.safetensors"))
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
    procs = []
    for rank in range(2):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}
        log = open(out / f"rank{rank}.log", "wb")  # noqa: SIM115  (closed below)
        command = [
            sys.executable,
            str(RANKS_SCRIPT),
            str(odd_model_dir),
            str(out / "batch.safetensors"),
            str(out),
        ]
        procs.append((subprocess.Popen(command, env=rank_env, stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=120)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for rank, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, (out / f"rank{rank}.log").read_text()[-3000:]
    return out, data


def _single(model_dir: Path) -> Actor:
    return Actor(model_dir, learning_rate=1e-2, weight_decay=0.0)


@pytest.mark.slow  # the two ranks start once per module (about 25 s on 2 cores)
@pytest.mark.timeout(150)
def test_two_ranks_give_the_loss_and_gradients_of_one_process(
    fsdp_run: tuple[Path, dict[str, torch.Tensor]], odd_model_dir: Path
) -> None:
    out, data = fsdp_run
    batch = dict(data)
    adv, old_noise, ref_shift = batch.pop("advantages"), batch.pop("old_noise"), batch.pop("ref_shift")
    actor = _single(odd_model_dir)
    prepared = prepare(actor, batch, adv, micro_batch_size=5, with_reference=True)
    prepared = dataclasses.replace(
        prepared,
        old_logprobs=prepared.old_logprobs + old_noise,
        ref_logprobs=prepared.ref_logprobs + ref_shift,
    )
    ranked = json.loads((out / "metrics.json").read_text())
    for agg in AGGS:
        settings = StepSettings(update=UpdateSettings(kl_coef=0.1, entropy_coef=0.01, loss_agg=agg))
        loss = PolicyObjective(actor, prepared, settings)
        metrics = accumulate(loss, torch.arange(5), 5)
        grads = {n: p.grad for n, p in actor.model.named_parameters() if p.grad is not None}
        got = load_file(str(out / f"grads_{agg}.safetensors"))
        assert got.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-4, msg=f"{agg}: {name}")
        assert metrics["clip_frac"] > 0 and metrics["kl_loss"] != 0
        if agg == AGGS[0]:  # the same gradient with gradient checkpointing under FSDP
            checkpointed = load_file(str(out / "grads_checkpointed.safetensors"))
            for name, grad in grads.items():
                torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-4, msg=name)
        for key, value in metrics.items():
            assert ranked[agg][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (agg, key)
        actor.optimizer.zero_grad(set_to_none=True)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_ranks_update_and_save_like_one_process(
    fsdp_run: tuple[Path, dict[str, torch.Tensor]], odd_model_dir: Path
) -> None:
    out, data = fsdp_run
    batch = dict(data)
    adv = batch.pop("advantages")
    actor = _single(odd_model_dir)
    metrics = update(actor, batch, adv, micro_batch_size=2, num_updates=2, ppo_epochs=2, max_grad_norm=0.5)
    ranked = json.loads((out / "metrics.json").read_text())["update"]
    assert ranked["num_optimizer_steps"] == metrics["num_optimizer_steps"] == 4.0
    for key in ("loss", "pg_loss", "entropy", "approx_kl", "grad_norm", "clip_frac"):
        assert ranked[key] == pytest.approx(metrics[key], rel=1e-3, abs=1e-6), key
    got = load_file(str(out / "params_after.safetensors"))
    moved = 0.0
    initial = load_causal_lm(odd_model_dir).state_dict()
    for name, param in actor.model.named_parameters():
        torch.testing.assert_close(got[name], param.detach(), atol=1e-5, rtol=1e-4, msg=name)
        moved += (param.detach() - initial[name]).abs().sum().item()
    assert moved > 0.1  # the update did change the weights
    saved = load_causal_lm(out / "hf")
    for name, value in saved.state_dict().items():
        torch.testing.assert_close(value, got[name if name in got else "model.embed_tokens.weight"], msg=name)
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_publish_gathers_the_full_state_dict_bucket_by_bucket(
    fsdp_run: tuple[Path, dict[str, torch.Tensor]], odd_model_dir: Path
) -> None:
    out, _ = fsdp_run
    state = load_causal_lm(odd_model_dir).state_dict()
    got = load_file(str(out / "buckets.safetensors"))
    assert set(got) == set(state) - {"lm_head.weight"}  # the tied alias travels once
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)
    main, other = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert main["dtensor_params"] and other["dtensor_params"] and main["mesh"] == [2]
    assert not main["share_prompts"] and not other["share_prompts"]  # ranks do not share prompts
    assert len(main["bucket_bytes"]) == len(other["bucket_bytes"]) > 4
    assert all(size <= BUCKET_BYTES for size in main["bucket_bytes"])
    assert not any(other["bucket_bytes"])  # rank 1 gathers with rank 0 but keeps nothing


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_publish_memory_stays_within_about_one_bucket(fsdp_run: tuple[Path, dict[str, torch.Tensor]]) -> None:
    out, _ = fsdp_run
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen["model_bytes"] > 8 * BUCKET_BYTES  # the model is many buckets large
        # the host bucket, the gathered shards (a bucket) and this rank's half of them, and one
        # full parameter being cut out of the gathered buffer
        bound = 2.5 * BUCKET_BYTES + seen["largest_param_bytes"] + 1024
        assert seen["peak_bytes"] <= bound, (rank, seen["peak_bytes"], bound)
        # the measurement sees real allocations: at least the gathered parameter (and rank 0's bucket)
        assert seen["peak_bytes"] >= seen["largest_param_bytes"]
        if rank == 0:
            assert seen["peak_bytes"] >= max(seen["bucket_bytes"])


def test_local_rows_balance_and_pad() -> None:
    lengths = torch.tensor([5, 9, 1, 7, 3])
    rows = torch.arange(5)
    shares = [local_rows(rows, lengths, rank, 2) for rank in range(2)]
    # longest first (9, 7, 5, 3, 1 -> rows 1, 3, 0, 4, 2), dealt out in turn; rank 1 pads with row 0
    assert shares[0].rows.tolist() == [1, 0, 2] and shares[0].weights.tolist() == [1.0, 1.0, 1.0]
    assert shares[1].rows.tolist() == [3, 4, 0] and shares[1].weights.tolist() == [1.0, 1.0, 0.0]
    real = sorted(r for s in shares for r in s.rows[s.real].tolist())
    assert real == [0, 1, 2, 3, 4]  # every row exactly once
    single = local_rows(torch.tensor([4, 0, 2]), lengths, 0, 1)  # one rank: longest first too
    assert single.rows.tolist() == [0, 4, 2] and single.weights.tolist() == [1.0, 1.0, 1.0]
    tiny = local_rows(torch.tensor([2]), lengths, 1, 2)  # fewer rows than ranks: a padding row
    assert tiny.rows.tolist() == [2] and tiny.weights.tolist() == [0.0]
    with pytest.raises(ValueError, match="empty"):
        local_rows(torch.tensor([], dtype=torch.int64), lengths, 0, 2)


def test_sharding_choice_and_nccl_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_sharding("auto", 1) == "full"
    assert resolve_sharding("auto", 2) == "hybrid"
    assert resolve_sharding("none", 4) == "none"
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        build_mesh("cpu", "auto", 6, 4)
    for name in (
        "NCCL_P2P_DISABLE",
        "NCCL_NVLS_ENABLE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "RLFLEET_DIST_TIMEOUT_MINUTES",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST",
        "TORCH_NCCL_BLOCKING_WAIT",
    ):
        monkeypatch.delenv(name, raising=False)  # fmt: skip
    timeout = setup_nccl(timeout_minutes=15, enable_p2p=False)
    assert timeout.total_seconds() == 900
    assert os.environ["NCCL_P2P_DISABLE"] == "1" and os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert os.environ["RLFLEET_DIST_TIMEOUT_MINUTES"] == "15.0"
    setup_nccl()
    assert os.environ["NCCL_P2P_DISABLE"] == "0" and os.environ["RLFLEET_DIST_TIMEOUT_MINUTES"] == "20.0"
    with pytest.raises(ValueError, match="timeout_minutes"):
        setup_nccl(timeout_minutes=0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ctx = init_distributed(device="cpu")
    assert not ctx.distributed and ctx.mesh is None and ctx.is_main and ctx.device.type == "cpu"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK"):
        init_distributed(device="cpu")
