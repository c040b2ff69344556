"""One GRPO step reads in five trainer files: from ``run_step`` to the first ``backward()`` it calls
functions of ``service.py`` (the entry), ``loop.py`` (the update loop), ``algorithms/grpo.py`` (its
advantages and its loss's terms), the policy loss ``algorithms/policy_losses/ppo_clip.py`` (issue 31
made each policy loss a file of its own, chosen by ``update.policy_loss``) and ``policy.py`` (the
policy's forward) only.

The step runs in process on a tiny Llama under ``sys.setprofile``, which sees every Python function
called; each GRPO setting that changes the step's path (the KL in the loss and its reference, the
KL in the reward, several optimizer steps with recomputed old logprobs) is one case. A first step
runs before the one measured: it loads the frozen reference (the actor's, once) and checks once
that the model computes packed prompts as plain rows; the measured step is every later one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

import rlfleet.trainer
from rlfleet.common.schema.trainer import AlgorithmSettings, BatchSettings, StepSettings, UpdateSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.service import run_step

pytestmark = pytest.mark.timeout(120)

MakeBatch = Callable[..., dict[str, torch.Tensor]]
TRAINER = Path(rlfleet.trainer.__file__).parent
STEP_FILES = {
    "service.py",
    "loop.py",
    "algorithms/grpo.py",
    "algorithms/policy_losses/ppo_clip.py",
    "policy.py",
}


def _files_until_backward(monkeypatch: pytest.MonkeyPatch, step: Callable[[], Any]) -> list[str]:
    """The trainer source files whose functions ``step`` calls before its first backward()."""
    seen: set[str] = set()
    reached = False
    tensor_backward, autograd_backward = torch.Tensor.backward, torch.autograd.backward

    def on_tensor(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        nonlocal reached
        reached = True
        return tensor_backward(tensor, *args, **kwargs)

    def on_autograd(*args: Any, **kwargs: Any) -> Any:
        nonlocal reached
        reached = True
        return autograd_backward(*args, **kwargs)

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event == "call" and not reached:
            path = Path(frame.f_code.co_filename)
            if path.is_relative_to(TRAINER):
                seen.add(path.relative_to(TRAINER).as_posix())

    monkeypatch.setattr(torch.Tensor, "backward", on_tensor)
    monkeypatch.setattr(torch.autograd, "backward", on_autograd)
    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    assert reached, "the step never called backward()"
    return sorted(seen)


UPDATE = UpdateSettings(kl_coef=0.05, micro_batch_size=2)


@pytest.mark.parametrize(
    "step",
    [
        # GRPO's defaults: the KL in the loss (k3 to the reference), one on-policy optimizer step
        StepSettings(algorithm="grpo", update=UPDATE),
        # each token's KL penalty in its advantage: old and reference logprobs first
        StepSettings(algorithm=AlgorithmSettings(name="grpo", kl_mode="reward"), update=UPDATE),
        # old logprobs recomputed
        StepSettings(
            algorithm="grpo",
            update=UpdateSettings(kl_coef=0.05, micro_batch_size=2, ppo_epochs=2),
            batch=BatchSettings(rollout_batch_size=2, train_batch_size=1),
        ),  # fmt: skip
    ],
    ids=["kl-in-loss", "kl-in-reward", "several-optimizer-steps"],
)
def test_a_grpo_step_reaches_backward_through_at_most_five_trainer_files(
    tiny_model_dir: Path, make_batch: MakeBatch, monkeypatch: pytest.MonkeyPatch, step: StepSettings
) -> None:
    actor = Actor(tiny_model_dir, seed=0, learning_rate=1e-3)
    batch, scores = make_batch([3, 5, 2, 4], [4, 2, 6, 3]), [1.0, 0.0, 0.2, 0.6]
    run_step(actor, None, batch, scores, step)  # the first step: loads the reference
    files = _files_until_backward(monkeypatch, lambda: run_step(actor, None, batch, scores, step))
    assert "service.py" in files and len(files) <= 5, files
    assert set(files) <= STEP_FILES, files


def test_the_profile_sees_every_trainer_file_a_step_calls(
    tiny_model_dir: Path, make_batch: MakeBatch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The measure itself: a first step, which also loads the reference, is seen doing so."""
    step = StepSettings(algorithm="grpo", update=UPDATE)
    actor = Actor(tiny_model_dir, seed=0, learning_rate=1e-3)
    batch = make_batch([3, 5, 2, 4], [4, 2, 6, 3])
    files = _files_until_backward(
        monkeypatch, lambda: run_step(actor, None, batch, [1.0, 0.0, 0.2, 0.6], step)
    )
    assert {"actor.py", "model_io.py"} <= set(files) and STEP_FILES <= set(files), files
