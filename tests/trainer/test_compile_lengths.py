"""A compiled actor trains through batches of changing lengths and row counts on the graphs of its first
step: the decoder blocks and the logprob reduction compile once for each variant (grad on and off), not
again for each new shape; and its steps agree with the eager actor's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental import _config as shape_config

from rlfleet.common.schema.trainer import StepSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.service import run_step

# compiling takes about 40 s on 2 cores with torch's compile caches cold (a few seconds warm)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MakeBatch = Callable[..., dict[str, torch.Tensor]]

SHAPES = [  # (prompt lengths, response lengths): one micro-batch a step, padded, of 3 to 7 rows
    ([3, 5, 2, 4, 5, 3], [4, 2, 6, 1, 3, 5]),
    ([6, 2, 4, 1, 3], [9, 3, 1, 7, 2]),
    ([2, 7, 3, 5], [2, 1, 3, 2]),
    ([4, 8, 2, 6, 3, 1, 5], [11, 4, 8, 2, 6, 3, 1]),
    ([3, 5, 2, 4], [1, 1, 1, 1]),  # one response token: the labels are a strided view of the ids
    ([6, 2, 3], [1, 1, 1]),
    ([5, 3, 4, 2, 6], [6, 12, 2, 4, 3]),
]

VARIANTS = 4
"""Graphs a step needs: the blocks and the reduction, each with grad off (old and reference logprobs)
and on (the policy's update)."""

COMPARED = ("loss", "entropy", "kl", "grad_norm")


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """No graph of an earlier test reused; the torch settings that compiling sets are torch's
    defaults before and after (through their own ``patch``: pytest's monkeypatch deletes a torch
    config on undo, which hides it)."""
    torch._dynamo.reset()
    with (
        torch._dynamo.config.patch(recompile_limit=8, specialize_float=False),
        shape_config.patch(use_duck_shape=True),
    ):
        yield
    torch._dynamo.reset()


def _steps(actor: Actor, make_batch: MakeBatch, after_each: Callable[[], None]) -> list[dict[str, float]]:
    settings = StepSettings(micro_batch_size=8, kl_coef=0.05, learning_rate=1e-2)
    metrics = []
    for seed, (prompts, responses) in enumerate(SHAPES):
        scores = torch.linspace(-1.0, 1.0, len(prompts)).roll(seed).tolist()
        metrics.append(run_step(actor, None, make_batch(prompts, responses, seed=seed), scores, settings))
        after_each()
    return metrics


@pytest.mark.usefixtures("fresh_dynamo")
def test_new_lengths_and_row_counts_compile_nothing_new(tiny_model_dir: Path, make_batch: MakeBatch) -> None:
    start = counters["stats"]["unique_graphs"]
    graphs: list[int] = []
    compiled = Actor(tiny_model_dir, seed=0, compile=True)
    compiled_metrics = _steps(
        compiled, make_batch, lambda: graphs.append(counters["stats"]["unique_graphs"] - start)
    )
    # before: each block and the reduction compiled again for the second shape (and the first new
    # row count), as static graphs do, and the reduction for each new stride of its labels
    assert graphs == [VARIANTS] * len(SHAPES)
    eager_metrics = _steps(Actor(tiny_model_dir, seed=0), make_batch, lambda: None)
    for step, (got, want) in enumerate(zip(compiled_metrics, eager_metrics, strict=True)):
        for key in COMPARED:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (step, key)
    assert compiled_metrics[-1]["kl"] > 0  # the policy moved away from the reference: KL was compared
