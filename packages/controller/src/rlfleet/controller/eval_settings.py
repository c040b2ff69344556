"""A run's held-out evaluation settings (issue 14), the job's ``eval`` section: ``data``, ``every``,
``limit_words``, ``max_tokens`` (the previous release's ``eval_data``, ``eval_every``...).

With ``eval.data`` the run answers every prompt of that file greedily (up to ``eval.max_tokens`` new
tokens, however long the run's training responses are) through its own rollout tier before the
first step, every ``eval.every`` steps and at the end, measures the answers
(:mod:`rlfleet.controller.run_eval`) and takes its before/after table from them.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from rlfleet.common.schema.config import ConfigModel


class EvalSettings(ConfigModel):
    """Held-out evaluation during training."""

    data: str | None = Field(
        default=None,
        description="held-out prompt file (JSONL/CSV/Parquet, like data.path) answered greedily before the "
        "first step, every eval.every steps and at the end (eval.jsonl, eval.json); the before/after "
        "table of samples.md comes from it. None: no held-out evaluation",
    )
    every: int = Field(
        default=0,
        ge=0,
        description="steps between held-out evaluations; 0: only before the first step and at the end",
    )
    limit_words: int = Field(
        default=50,
        ge=1,
        description="word limit of the held-out 'within limit' share (answers at or under it)",
    )
    max_tokens: int = Field(
        default=128,
        ge=1,
        description="longest held-out answer in new tokens (the held-out answers and the before/after table "
        "drawn from them; training responses keep max_response_length); max_prompt_length plus this must "
        "fit every vLLM rollout pool's engine.max_model_len",
    )

    @model_validator(mode="after")
    def _every_needs_data(self) -> EvalSettings:
        if self.every and not self.data:
            raise ValueError(f"eval.every={self.every} needs eval.data (a held-out prompt file); set it")
        return self
