"""Partial fine-tuning: only the top blocks train, and only they are published."""

from __future__ import annotations

import pytest
import torch
from batches import update  # this folder's helper module (conftest puts it on sys.path)

from rlfleet.common.schema.trainer import ModelSettings
from rlfleet.trainer.actor import Actor


@pytest.mark.timeout(120)
def test_top_layers_train_and_publish_alone(tiny_model_dir, make_batch):
    actor = Actor(tiny_model_dir, ModelSettings(trainable_layers=1), learning_rate=1e-2, weight_decay=0.01)
    before = {k: v.clone() for k, v in actor.model.state_dict().items()}
    batch = make_batch([3, 4, 2, 5], [4, 2, 3, 4])
    n = batch["response_ids"].shape[0]
    update(actor, batch, torch.linspace(-1, 1, n), micro_batch_size=n)
    after = actor.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed, "the top block must have been updated"
    assert all(k.startswith(("model.layers.1.", "model.norm.")) for k in changed), changed
    published = {name for bucket in actor.iter_weight_buckets(1 << 20) for name in bucket}
    assert changed <= published
    assert not any(name.startswith(("model.layers.0.", "model.embed_tokens")) for name in published)


def test_trainable_layers_out_of_range(tiny_model_dir):
    with pytest.raises(ValueError, match="trainable_layers must be in 1..2"):
        Actor(tiny_model_dir, ModelSettings(trainable_layers=3))
