"""The before/after table: greedy answers to a few fixed prompts at the start and the end of a run.

Only this table's few response texts travel to the controller (for printing); training data
never does.
"""

from __future__ import annotations

import random
import textwrap
from typing import Any, Protocol

from rlfleet.common.control.messages import GenerateResult, SamplingParams
from rlfleet.common.schema.batch import unpack_texts
from rlfleet.common.schema.refs import TensorRef
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.dataset import PromptItem
from rlfleet.controller.ports import FleetClient
from rlfleet.controller.routing import chunk_metadata, episode_items

EPISODE_COUNTS = {"episode_turns": "turns", "episode_tool_calls": "tool_calls"}
"""The batch fields a multi-turn run's answers add to their rows (field -> row key)."""


class RunStore(Protocol):
    """What the table needs of the run's store (:class:`rlfleet.controller.own_store.OwnStore`)."""

    async def fetch(self, ref: TensorRef, names: list[str] | None = None) -> dict[str, Any]: ...
    async def release(self, results: list[GenerateResult]) -> None: ...


class SampleTable:
    """Greedy answers of the current policy to ``items`` (at most ``max_tokens`` new tokens each;
    None: the run's ``max_response_length``), captured under labels; the table shows ``shown`` of
    them (picked by the seed alone; None: all)."""

    def __init__(
        self,
        items: list[PromptItem],
        config: TrainerConfig,
        shown: int | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.items = items
        self.config = config
        self.max_tokens = config.max_response_length if max_tokens is None else max_tokens
        self.captures: dict[str, list[dict[str, Any]]] = {}
        count = len(items) if shown is None else min(shown, len(items))
        picker = random.Random(f"rlfleet-samples:{config.placement.seed}")
        self.shown = sorted(picker.sample(range(len(items)), count))
        """Positions in ``items`` of the rows the table shows."""

    async def capture(
        self,
        label: str,
        fleet: FleetClient,
        weight_version: int,
        store: RunStore,
    ) -> list[dict[str, Any]]:
        """Generate, score and read back the answers at ``weight_version``; keep them as ``label``.

        ``store`` (the run's) reads the answers with the run's tensor plane settings, then releases
        what it holds of them.
        """
        cfg = self.config
        sampling = SamplingParams(n=1, temperature=0.0, max_tokens=self.max_tokens, seed=cfg.placement.seed)
        env = cfg.environment  # a multi-turn run's answers are whole episodes
        episode = env.episodes(self.max_tokens, episode_items(self.items)) if env.enabled else None
        results = await fleet.generate(
            [it.token_ids for it in self.items], sampling, weight_version, episode=episode
        )
        scored = await fleet.score(results, chunk_metadata(self.items, results), cfg.reward.endpoint)
        texts: list[str] = []
        tokens: list[int] = []
        episodes: list[dict[str, int]] = []  # a multi-turn run's: each episode's turns and tool calls
        names = ["response_text", "response_text_offsets", "response_mask"]
        names += list(EPISODE_COUNTS) if episode is not None else []
        for result in results:
            got = await store.fetch(result.ref, names=names)
            texts.extend(unpack_texts(got["response_text"], got["response_text_offsets"]))
            tokens.extend(int(n) for n in got["response_mask"].sum(dim=-1).tolist())
            if episode is not None:
                counts = {key: got[name].tolist() for name, key in EPISODE_COUNTS.items()}
                episodes.extend(
                    dict(zip(counts, row, strict=True)) for row in zip(*counts.values(), strict=True)
                )
        await store.release(results)
        scores = [s for result in scored for s in result.scores]
        components = [
            {k: v[i] for k, v in result.components.items()}
            for result in scored
            for i in range(len(result.scores))
        ]
        rows = [
            {"prompt": question_text(item), "answer": text, "words": len(text.split()), "tokens": n,
             "reward": score, "components": parts}
            for item, text, n, score, parts in zip(self.items, texts, tokens, scores, components, strict=True)
        ]  # fmt: skip
        for row, counts in zip(rows, episodes, strict=False):
            row.update(counts)
        self.captures[label] = rows
        return rows

    def render(self) -> str:
        """A Markdown table of before/after answers with word counts and rewards, plus the means."""
        before, after = self._shown("before"), self._shown("after")
        lines = ["## Sample answers, before and after training", "",
                 "| prompt | before | after |", "|---|---|---|"]  # fmt: skip
        for b, a in zip(before, after, strict=False):
            lines.append(f"| {_cell(b['prompt'], 80)} | {_answer(b)} | {_answer(a)} |")
        if before and after:
            lines += [
                "",
                f"mean words: {_mean(before, 'words'):.1f} -> {_mean(after, 'words'):.1f}; "
                f"mean reward: {_mean(before, 'reward'):.3f} -> {_mean(after, 'reward'):.3f}",
            ]
        return "\n".join(lines)

    def _shown(self, label: str) -> list[dict[str, Any]]:
        rows = self.captures.get(label, [])
        return [rows[i] for i in self.shown if i < len(rows)]


def _answer(row: dict[str, Any]) -> str:
    return f"{_cell(row['answer'])} ({row['words']} words, reward {row['reward']:.2f})"


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(row[key] for row in rows) / len(rows)


def question_text(item: PromptItem) -> str:
    """The prompt as the user wrote it (the last user message of a chat), not the templated text."""
    prompt = item.prompt
    if isinstance(prompt, str):
        return prompt
    users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    return str(users[-1]) if users else item.text


def _cell(text: str, width: int = 240) -> str:
    flat = " ".join(text.split()).replace("|", "\\|")
    return textwrap.shorten(flat, width=width, placeholder=" …") if flat else "(empty)"
