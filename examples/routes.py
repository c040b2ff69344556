"""Rollout routing for examples/tiny_routed.yaml (``rollout_fn: examples.routes:by_length``).

``by_length`` sees each prompt (a ``PromptItem``: ``.text``, ``.token_ids``, ``.metadata``) and
returns the rollout pool that generates it, or the response itself: short prompts go to the
``small`` pool, long ones to the ``big`` pool, and prompts whose digits contain a 7 are answered
here with the dataset's own ``digits`` column (every sample the same text: under GRPO such a
group carries no advantage, it is scored and logged like any other).
"""

from __future__ import annotations

from typing import Any

SHORT_TOKENS = 14


def by_length(item: Any) -> str:
    if "7" in item.metadata.get("digits", ""):
        return item.metadata["digits"]
    return "small" if len(item.token_ids) <= SHORT_TOKENS else "big"
