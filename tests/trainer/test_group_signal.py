"""The waste a step reports (issue 31): groups whose rewards are all equal carry no group-relative
signal, and the share of the generated tokens they took."""

from __future__ import annotations

import torch


def test_groups_whose_rewards_are_all_equal_are_counted_with_their_tokens() -> None:
    from rlfleet.trainer.service import group_signal_metrics

    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    batch = {"group_index": torch.tensor([0, 0, 1, 1, 2, 2]), "response_mask": mask}
    metrics = group_signal_metrics(batch, torch.tensor([1.0, 1.0, 0.0, 0.5, 0.0, 0.0]))  # groups 0, 2 flat
    assert metrics == {"groups/total": 3.0, "groups/flat": 2.0, "groups/wasted_token_frac": 6 / 12,
                       "groups/signal_tokens": 6.0}  # fmt: skip


def test_a_step_keeps_the_named_groups_of_each_chunk_and_refuses_them_for_pairs() -> None:
    """Dynamic sampling: every rank fetches the chunks and keeps the groups the request names."""
    import asyncio
    from types import SimpleNamespace

    import pytest

    from rlfleet.common.control.messages import TrainStepRequest
    from rlfleet.common.errors import BatchContractError
    from rlfleet.common.schema.batch import RolloutBatch
    from rlfleet.common.schema.refs import TensorRef
    from rlfleet.common.schema.trainer import StepSettings
    from rlfleet.trainer.service import fetch_batch

    chunks = {
        f"rollout/{i}": RolloutBatch.from_rows(
            prompts=[[1]] * 4, responses=[[2 + i], [3], [4], [5, 6]], group_index=[0, 0, 1, 1], pad_id=0,
            logprobs=[[0.0], [0.0], [0.0], [0.0, 0.0]],
        ).to_tensors()
        for i in range(2)
    }  # fmt: skip

    async def fetch(ref: TensorRef) -> dict[str, torch.Tensor]:
        return chunks[ref.key]

    embeddings = SimpleNamespace(num_embeddings=16)
    actor = SimpleNamespace(model=SimpleNamespace(get_input_embeddings=lambda: embeddings))
    rank = SimpleNamespace(stores=SimpleNamespace(fetch=fetch), actor=actor, critic=None)
    refs = [TensorRef(address="127.0.0.1:1", key=key) for key in chunks]
    request = TrainStepRequest(step=1, rollouts=refs, scores=[0.0] * 4, groups=[[1], [0]])
    batch = asyncio.run(fetch_batch(rank, request))
    assert batch["group_index"].tolist() == [0, 0, 1, 1]
    assert batch["response_ids"][:, 0].tolist() == [4, 5, 3, 3]  # chunk 0's group 1, chunk 1's group 0
    short = request.model_copy(update={"groups": [[1]]})
    with pytest.raises(BatchContractError, match="one list a rollout chunk: 1 lists for 2 chunks"):
        asyncio.run(fetch_batch(rank, short))
    pairs = request.model_copy(update={"settings": StepSettings(algorithm={"name": "dpo"})})
    with pytest.raises(BatchContractError, match="'groups': only rollout chunks have groups to keep"):
        asyncio.run(fetch_batch(rank, pairs))
