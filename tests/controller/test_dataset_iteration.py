"""PromptDataset epochs: seeded shuffle, batches, sharding and the resumable position."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlfleet.controller.dataset import PromptDataset
from rlfleet.controller.errors import DatasetError


@pytest.fixture
def path10(tmp_path: Path) -> Path:
    path = tmp_path / "ten.jsonl"
    path.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(10)))
    return path


def _epoch(ds: PromptDataset, batch_size: int, epoch: int, drop_last: bool = True) -> list[list[int]]:
    return [[it.index for it in batch] for batch in ds.batches(batch_size, epoch, drop_last=drop_last)]


def test_seeded_shuffle_is_reproducible_and_a_permutation(path10: Path) -> None:
    a, b = PromptDataset(path10, seed=3), PromptDataset(path10, seed=3)
    assert _epoch(a, 5, 0) == _epoch(b, 5, 0)
    assert _epoch(a, 5, 1) == _epoch(b, 5, 1)
    flat = [i for batch in _epoch(a, 5, 0) for i in batch]
    assert sorted(flat) == list(range(10))
    assert flat != list(range(10))
    assert _epoch(a, 10, 0) != _epoch(a, 10, 1)  # a fresh order each epoch
    assert _epoch(a, 10, 0) != _epoch(PromptDataset(path10, seed=4), 10, 0)
    assert _epoch(PromptDataset(path10, shuffle=False), 10, 0) == [list(range(10))]


def test_drop_last_and_steps_per_epoch(path10: Path) -> None:
    ds = PromptDataset(path10)
    assert ds.steps_per_epoch(3) == 3
    assert ds.steps_per_epoch(3, drop_last=False) == 4
    assert [len(b) for b in _epoch(ds, 3, 0)] == [3, 3, 3]
    assert [len(b) for b in _epoch(ds, 3, 0, drop_last=False)] == [3, 3, 3, 1]
    with pytest.raises(DatasetError, match="10 prompts are fewer than batch_size=11"):
        ds.batches(11)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        ds.steps_per_epoch(0)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shards_are_disjoint_and_covering(path10: Path, char_tokenizer: Any, world_size: int) -> None:
    for ds in (PromptDataset(path10), PromptDataset(path10, tokenizer=char_tokenizer)):
        shards = [ds.shard(rank, world_size) for rank in range(world_size)]
        indices = [{shard[i].index for i in range(len(shard))} for shard in shards]
        assert sum(len(s) for s in indices) == len(ds)
        assert set().union(*indices) == set(range(10))
        assert all(len(s) in (10 // world_size, -(-10 // world_size)) for s in indices)
        assert all(shard.tokenizer is ds.tokenizer for shard in shards)
    with pytest.raises(ValueError, match="need 0 <= rank < world_size"):
        ds.shard(world_size, world_size)


def test_shard_of_bound_dataset_rebinds_within_itself(path10: Path, char_tokenizer: Any) -> None:
    shard = PromptDataset(path10, tokenizer=char_tokenizer).shard(1, 3)
    before = [shard[i] for i in range(len(shard))]
    shard.bind_tokenizer(char_tokenizer)
    assert [shard[i] for i in range(len(shard))] == before


def test_state_round_trip_mid_epoch(path10: Path) -> None:
    ds = PromptDataset(path10, seed=1)
    it = ds.batches(2, 0)
    seen = [next(it), next(it)]
    state = ds.state_dict()
    assert state == {"epoch": 0, "index": 4, "seed": 1, "num_prompts": 10}
    rest = [[x.index for x in b] for b in it]
    resumed = PromptDataset(path10, seed=1)
    resumed.load_state_dict(state)
    assert [[x.index for x in b] for b in resumed.batches(2, 0)] == rest
    assert len(seen) + len(rest) == 5
    assert ds.state_dict()["epoch"] == 1 and ds.state_dict()["index"] == 0  # epoch done: next one


def test_next_batch_rolls_over_epochs_and_resumes(path10: Path) -> None:
    ds = PromptDataset(path10, seed=2)
    first = [[x.index for x in ds.next_batch(4)] for _ in range(3)]  # 2 batches of epoch 0, 1 of epoch 1
    assert first[:2] == _epoch(PromptDataset(path10, seed=2), 4, 0)
    assert first[2] == _epoch(PromptDataset(path10, seed=2), 4, 1)[0]
    assert ds.epoch == 1
    resumed = PromptDataset(path10, seed=2)
    resumed.load_state_dict(ds.state_dict())
    assert [x.index for x in resumed.next_batch(4)] == [x.index for x in ds.next_batch(4)]


def test_load_state_dict_rejects_another_dataset(path10: Path, tmp_path: Path) -> None:
    other = tmp_path / "five.jsonl"
    other.write_text("".join(f'{{"prompt": "p{i}"}}\n' for i in range(5)))
    state = PromptDataset(path10).state_dict()
    with pytest.raises(
        DatasetError, match="saved position is for num_prompts=10, this dataset has num_prompts=5"
    ):
        PromptDataset(other).load_state_dict(state)
    with pytest.raises(DatasetError, match="saved position is for seed=0"):
        PromptDataset(path10, seed=9).load_state_dict(state)
    with pytest.raises(DatasetError, match="bad position"):
        PromptDataset(path10).load_state_dict({"epoch": 0, "index": 11})


def test_sample_items_are_fixed_by_seed(path10: Path) -> None:
    a = [it.index for it in PromptDataset(path10, seed=5).sample_items(4)]
    assert a == [it.index for it in PromptDataset(path10, seed=5).sample_items(4)]
    assert len(set(a)) == 4
    assert len(PromptDataset(path10).sample_items(50)) == 10
