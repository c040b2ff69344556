"""A batch with a token id outside the model's vocabulary is refused before any collective, naming the
field and the id, and the trainer serves on (real nats-server, one process)."""

# ruff: noqa: F811  (test_worker's `trainer` fixture, imported, is every test's argument)
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_worker import SCORES, Trainer, _rollouts, trainer  # noqa: F401  (the fixture)

from rlfleet.common.control.messages import TrainStepRequest, TrainStepResult
from rlfleet.common.errors import RemoteUserError

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(("field", "bad"), [("response_ids", 10_000), ("prompt_ids", -3)])
async def test_a_token_id_outside_the_vocabulary_is_refused(
    trainer: Trainer, make_batch: Callable[..., dict[str, torch.Tensor]], field: str, bad: int
) -> None:
    batch = _rollouts(make_batch)
    batch[field][0, -1] = bad
    with pytest.raises(
        RemoteUserError, match=rf"{field}.*token id {bad} is outside the vocabulary"
    ) as refused:
        await trainer.ask("step", TrainStepRequest(step=1, rollouts=[trainer.put(batch)], scores=SCORES))
    assert refused.value.code == "bad_request"
    ok = await trainer.ask("step", TrainStepRequest(step=1, rollouts=[trainer.put(_rollouts(make_batch))],
                                                    scores=SCORES))  # fmt: skip
    assert isinstance(ok, TrainStepResult)
