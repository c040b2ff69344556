"""The multi-turn fields of a rollout batch (issue 33): ``loss_mask`` and ``episode_*`` are checked with
the contract, carried by ``merge_rollouts`` and ``select_groups``, and filled in for chunks without
them (a single-turn chunk's loss mask is its response mask; its episode fields are 0)."""

from __future__ import annotations

import pytest
import torch

from rlfleet.common.errors import BatchContractError
from rlfleet.common.schema.batch import (
    EPISODE_ENDS,
    LOSS_MASK,
    OPTIONAL_FIELDS,
    RolloutBatch,
    check_rollout_tensors,
    merge_rollouts,
    select_groups,
)

EPISODE = [name for name in OPTIONAL_FIELDS if name.startswith("episode_")]


def _episodic() -> dict[str, torch.Tensor]:
    """2 prompts x 2 samples; responses are a model turn, an observation, a model turn."""
    tensors = RolloutBatch.from_rows(
        prompts=[[1, 2], [1, 2], [3], [3]],
        responses=[[5, 6, 7, 8], [5, 9], [10, 11, 12], [13]],
        logprobs=[
            [-0.5, float("nan"), float("nan"), -1.0],
            [-0.5, -0.25],
            [-1.0, float("nan"), -2.0],
            [-3.0],
        ],
        group_index=[0, 0, 1, 1],
        pad_id=0,
    ).to_tensors()
    tensors[LOSS_MASK] = torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 0]])
    tensors["episode_reward"] = torch.tensor([1.0, 0.0, 0.5, 0.0])
    tensors["episode_turns"] = torch.tensor([2, 1, 2, 1])
    tensors["episode_tool_calls"] = torch.tensor([1, 0, 1, 0])
    tensors["episode_tool_errors"] = torch.tensor([0, 0, 1, 0])
    tensors["episode_env_s"] = torch.tensor([0.25, 0.5, 0.125, 0.0])
    tensors["episode_end"] = torch.tensor(
        [EPISODE_ENDS.index(e) for e in ("done", "env_error", "done", "max_tokens")]
    )
    tensors["episode_obs_cut"] = torch.tensor([0, 0, 3, 0])
    return tensors


@pytest.mark.timeout(10)
def test_the_episode_fields_are_checked_by_name() -> None:
    tensors = _episodic()
    assert check_rollout_tensors(tensors) == 4
    with pytest.raises(BatchContractError, match="'loss_mask': expected an int64 tensor, got torch.float32"):
        check_rollout_tensors({**tensors, LOSS_MASK: tensors[LOSS_MASK].float()})
    with pytest.raises(BatchContractError, match=r"'loss_mask': shape \[4, 3\], expected \[4, 4\]"):
        check_rollout_tensors({**tensors, LOSS_MASK: tensors[LOSS_MASK][:, :3]})
    with pytest.raises(BatchContractError, match="'episode_reward': expected a float32 tensor"):
        check_rollout_tensors({**tensors, "episode_reward": tensors["episode_reward"].double()})
    with pytest.raises(BatchContractError, match=r"'episode_turns': shape \[4, 1\], expected \[4\]"):
        check_rollout_tensors({**tensors, "episode_turns": tensors["episode_turns"][:, None]})


@pytest.mark.timeout(10)
def test_merge_carries_them_and_fills_chunks_without_them() -> None:
    episodic = _episodic()
    plain = RolloutBatch.from_rows(  # a single-turn chunk, wider responses
        prompts=[[4, 4, 4]], responses=[[7, 7, 7, 7, 7]], logprobs=[[-1.0] * 5], group_index=[0], pad_id=0
    ).to_tensors()
    merged = merge_rollouts([episodic, plain])
    assert check_rollout_tensors(merged) == 5
    assert merged[LOSS_MASK].tolist() == [[1, 0, 0, 1, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 0, 0, 0],
                                          [1, 1, 1, 1, 1]]  # fmt: skip
    for name in EPISODE:
        assert merged[name].tolist() == [*episodic[name].tolist(), 0], name
        assert merged[name].dtype == episodic[name].dtype
    assert merged["group_index"].tolist() == [0, 0, 1, 1, 2]
    assert LOSS_MASK not in merge_rollouts([plain, plain])  # none: none in the batch


@pytest.mark.timeout(10)
def test_select_groups_keeps_them_for_the_rows_it_keeps() -> None:
    episodic = _episodic()
    kept = select_groups(episodic, [1])
    assert kept["group_index"].tolist() == [0, 0]
    assert kept[LOSS_MASK].tolist() == [[1, 0, 1, 0], [1, 0, 0, 0]]
    for name in EPISODE:
        assert kept[name].tolist() == episodic[name][2:].tolist(), name
    merged = merge_rollouts([kept, select_groups(episodic, [0])])
    assert merged["episode_reward"].tolist() == [0.5, 0.0, 1.0, 0.0]
