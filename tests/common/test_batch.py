"""batch: text packing, padding helpers and RolloutBatch round trips through the tensor contract."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.common.errors import BatchContractError
from rlfleet.common.schema.batch import DTYPES, RolloutBatch, pack_texts, pad_left, pad_right, unpack_texts
from rlfleet.common.tensors.codec import assemble_tensors, split_tensors


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=20), max_size=12))
def test_texts_round_trip(texts: list[str]) -> None:
    data, offsets = pack_texts(texts)
    assert data.dtype == torch.uint8 and data.dim() == 1
    assert offsets.dtype == torch.int64 and offsets.shape == (len(texts) + 1,)
    assert unpack_texts(data, offsets) == texts


def test_pack_texts_layout() -> None:
    data, offsets = pack_texts(["hé", "", "日本"])
    assert bytes(data.tolist()) == "hé日本".encode()
    assert offsets.tolist() == [0, 3, 3, 9]


@pytest.mark.parametrize(
    ("offsets", "match"),
    [([1, 3], "do not fit"), ([0, 2], "do not fit"), ([0, 3, 1, 3], "do not fit"), ([], "do not fit")],
)
def test_unpack_texts_refuses_bad_offsets(offsets: list[int], match: str) -> None:
    data, _ = pack_texts(["abc"])
    with pytest.raises(BatchContractError, match=match):
        unpack_texts(data, torch.tensor(offsets, dtype=torch.int64))


def test_unpack_texts_refuses_split_characters_and_wrong_dtypes() -> None:
    data, _ = pack_texts(["é"])  # two bytes
    with pytest.raises(BatchContractError, match="utf-8"):
        unpack_texts(data, torch.tensor([0, 1, 2]))
    with pytest.raises(BatchContractError, match="uint8"):
        unpack_texts(data.long(), torch.tensor([0, 2]))


def test_padding_sides_and_masks() -> None:
    ids, mask = pad_left([[1, 2, 3], [4], []], pad_value=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]
    values, vmask = pad_right([[0.5], [1.5, 2.5]], pad_value=0.0, dtype="float32", width=3)
    assert values.tolist() == [[0.5, 0.0, 0.0], [1.5, 2.5, 0.0]]
    assert vmask.tolist() == [[1, 0, 0], [1, 1, 0]]
    assert ids.dtype == mask.dtype == vmask.dtype == torch.int64 and values.dtype == torch.float32
    assert pad_left([], 0)[0].shape == (0, 0)
    with pytest.raises(BatchContractError, match="shorter than the longest row"):
        pad_right([[1, 2]], 0, "int64", width=1)


def _batch() -> RolloutBatch:
    """2 prompts x 2 samples, prompt-major."""
    return RolloutBatch.from_rows(
        prompts=[[5, 6, 7], [5, 6, 7], [4], [4]],
        responses=[[8, 1], [9, 10, 11], [12], [13, 14, 1]],
        logprobs=[[-0.5, -0.25], [-1.0, -2.0, -3.0], [-0.125], [0.0, -1.0, -0.5]],
        group_index=[0, 0, 1, 1],
        pad_id=0,
        prompt_text=["q1", "q1", "q2", "q2"],
        response_text=["a", "bcd", "", "日本"],
    )


def test_from_rows_follows_the_contract() -> None:
    batch = _batch()
    assert batch.num_samples == 4
    assert batch.prompt_ids.tolist() == [[5, 6, 7], [5, 6, 7], [0, 0, 4], [0, 0, 4]]
    assert batch.response_ids.tolist() == [[8, 1, 0], [9, 10, 11], [12, 0, 0], [13, 14, 1]]
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]
    assert batch.rollout_logprobs[2].tolist() == [-0.125, 0.0, 0.0]
    tensors = batch.to_tensors()
    assert {k: str(v.dtype).removeprefix("torch.") for k, v in tensors.items()} == DTYPES


def test_round_trip_through_tensors_and_a_chunk_stream() -> None:
    batch = _batch()
    streamed = assemble_tensors(split_tensors("rollout/1", batch.to_tensors(), chunk_bytes=16))
    back = RolloutBatch.from_tensors(streamed)
    for name in (
        "prompt_ids",
        "prompt_mask",
        "response_ids",
        "response_mask",
        "rollout_logprobs",
        "group_index",
    ):
        assert torch.equal(getattr(back, name), getattr(batch, name)), name
    assert back.prompt_text == batch.prompt_text and back.response_text == batch.response_text


def test_contract_violations_name_the_field() -> None:
    tensors = _batch().to_tensors()
    with pytest.raises(BatchContractError, match="'group_index': missing"):
        RolloutBatch.from_tensors({k: v for k, v in tensors.items() if k != "group_index"})
    with pytest.raises(BatchContractError, match="'rollout_logprobs': expected a float32"):
        RolloutBatch.from_tensors({**tensors, "rollout_logprobs": tensors["rollout_logprobs"].double()})
    with pytest.raises(BatchContractError, match="'response_mask': shape"):
        RolloutBatch.from_tensors({**tensors, "response_mask": tensors["response_mask"][:, :2]})
    with pytest.raises(BatchContractError, match="'prompt_ids': expected 2 dims"):
        RolloutBatch.from_tensors({**tensors, "prompt_ids": tensors["prompt_ids"].reshape(-1)})
    with pytest.raises(BatchContractError, match="'response_text': 3 texts for 4 rows"):
        texts, offsets = pack_texts(["a", "b", "c"])
        RolloutBatch.from_tensors({**tensors, "response_text": texts, "response_text_offsets": offsets})
    with pytest.raises(BatchContractError, match="row 0: 1 logprobs for 2 tokens"):
        RolloutBatch.from_rows(prompts=[[1]], responses=[[1, 2]], logprobs=[[0.0]], group_index=[0], pad_id=0)


def test_response_versions_are_checked_and_merged_with_unknown_as_minus_one() -> None:
    from rlfleet.common.schema.batch import VERSIONS, check_rollout_tensors, merge_rollouts

    tensors = _batch().to_tensors()
    versioned = {**tensors, VERSIONS: torch.tensor([[3, 3, -1], [3, 4, 4], [3, -1, -1], [4, 4, 4]])}
    assert check_rollout_tensors(versioned) == 4
    with pytest.raises(BatchContractError, match="'response_versions': expected an int64"):
        check_rollout_tensors({**versioned, VERSIONS: versioned[VERSIONS].float()})
    with pytest.raises(BatchContractError, match="'response_versions': shape"):
        check_rollout_tensors({**versioned, VERSIONS: versioned[VERSIONS][:, :2]})
    short = RolloutBatch.from_rows(
        prompts=[[1]], responses=[[2]], logprobs=[[0.0]], group_index=[0], pad_id=0
    )
    merged = merge_rollouts([versioned, short.to_tensors()])  # the second chunk's versions are unknown
    assert merged[VERSIONS].tolist() == [*versioned[VERSIONS].tolist(), [-1, -1, -1]]
    assert VERSIONS not in merge_rollouts([tensors, short.to_tensors()])  # none: none in the batch


def test_select_groups_keeps_the_rows_of_the_named_prompts_renumbered() -> None:
    from rlfleet.common.schema.batch import VERSIONS, merge_rollouts, select_groups

    three = RolloutBatch.from_rows(  # 3 prompts x 2 samples
        prompts=[[1], [1], [2, 3], [2, 3], [4], [4]],
        responses=[[5], [6, 7], [8], [9], [10, 11], [12]],
        logprobs=[[-0.5], [-1.0, -2.0], [-0.25], [-0.75], [-1.5, -0.5], [-0.125]],
        group_index=[0, 0, 1, 1, 2, 2],
        pad_id=0,
    ).to_tensors()
    three[VERSIONS] = torch.tensor([[1, -1], [1, 2], [2, -1], [2, -1], [3, 3], [3, -1]])
    kept = select_groups(three, [0, 2])
    assert kept["group_index"].tolist() == [0, 0, 1, 1]
    assert kept["response_ids"].tolist() == [[5, 0], [6, 7], [10, 11], [12, 0]]
    assert kept[VERSIONS].tolist() == [[1, -1], [1, 2], [3, 3], [3, -1]]
    assert "prompt_text" not in kept  # like merge_rollouts: token fields only
    merged = merge_rollouts([select_groups(three, [1]), kept])  # the second chunk's groups follow the first's
    assert merged["group_index"].tolist() == [0, 0, 1, 1, 2, 2]
    for groups, match in (([], "at least one"), ([2, 0], "ascending"), ([1, 1], "ascending"),
                          ([0, 3], "group 3 is not in the chunk \\(it holds 0..2\\)")):  # fmt: skip
        with pytest.raises(BatchContractError, match=match):
            select_groups(three, groups)


def test_a_train_step_request_carries_group_lists() -> None:
    from pydantic import ValidationError

    from rlfleet.common.control.messages import TrainStepRequest
    from rlfleet.common.schema.refs import TensorRef

    refs = [TensorRef(address="127.0.0.1:1", key=f"rollout/{i}") for i in range(2)]
    request = TrainStepRequest(step=1, rollouts=refs, scores=[0.0, 1.0], groups=[[0], [2]])
    assert TrainStepRequest.model_validate_json(request.model_dump_json()).groups == [[0], [2]]
    assert TrainStepRequest(step=1, rollouts=refs, scores=[]).groups is None  # every group of every chunk
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        TrainStepRequest(step=1, rollouts=refs, scores=[], groups=[[-1], [0]])
