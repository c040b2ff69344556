"""The before/after table: greedy answers to a few fixed prompts at the start and the end of a run.

Only this table's few response texts travel to the controller (for printing); training data
never does.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Any

from rlfleet.common.messages import SamplingParams

if TYPE_CHECKING:
    from rlfleet.controller.dataset import PromptItem


class SampleTable:
    """Greedy answers of the current policy to ``items``, captured under labels."""

    def __init__(self, runner: Any, items: list[PromptItem]) -> None:
        self.runner = runner
        self.items = items
        self.captures: dict[str, list[dict[str, Any]]] = {}

    async def capture(self, label: str) -> list[dict[str, Any]]:
        from rlfleet.common.batch import unpack_texts
        from rlfleet.common.tensor_store import TensorStoreClient

        runner = self.runner
        cfg = runner.config
        sampling = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.max_response_length, seed=cfg.seed)
        results = await runner.fleet.generate([it.token_ids for it in self.items], sampling, runner.weight_version)
        metadata = runner._chunk_metadata(self.items, results)
        scored = await runner.fleet.score(results, metadata, cfg.reward_endpoint)
        texts: list[str] = []
        for result in results:
            client = TensorStoreClient(result.ref.address)
            try:
                got = await client.get(result.ref.key, names=["response_text", "response_text_offsets"])
            finally:
                await client.close()
            texts.extend(unpack_texts(got["response_text"], got["response_text_offsets"]))
        await runner._release(results)
        scores = [s for result in scored for s in result.scores]
        rows = [
            {"prompt": item.text, "answer": text, "words": len(text.split()), "reward": score}
            for item, text, score in zip(self.items, texts, scores, strict=True)
        ]
        self.captures[label] = rows
        return rows

    def render(self) -> str:
        """A Markdown table of before/after answers with word counts and rewards, plus the means."""
        before, after = self.captures.get("before", []), self.captures.get("after", [])
        lines = ["## Sample answers, before and after training", "",
                 "| prompt | before | after |", "|---|---|---|"]  # fmt: skip
        for b, a in zip(before, after, strict=False):
            lines.append(f"| {_cell(b['prompt'], 80)} | {_cell(b['answer'])} ({b['words']} words, reward "
                         f"{b['reward']:.2f}) | {_cell(a['answer'])} ({a['words']} words, reward {a['reward']:.2f}) |")  # fmt: skip
        if before and after:
            mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
            lines += ["", f"mean words: {mean(before, 'words'):.1f} -> {mean(after, 'words'):.1f}; "
                          f"mean reward: {mean(before, 'reward'):.3f} -> {mean(after, 'reward'):.3f}"]  # fmt: skip
        return "\n".join(lines)


def _cell(text: str, width: int = 240) -> str:
    flat = " ".join(text.split()).replace("|", "\\|")
    return textwrap.shorten(flat, width=width, placeholder=" …") if flat else "(empty)"
