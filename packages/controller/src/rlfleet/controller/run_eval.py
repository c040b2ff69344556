"""A run's held-out evaluation and its before/after table (``eval.data``, ``eval.every``).

Before the first step, every ``eval.every`` steps and at the end the run answers its held-out
prompts greedily (up to ``eval.max_tokens`` new tokens) through its own rollout tier and scores
them on its reward tier, under the reward's spec text
(:class:`~rlfleet.controller.samples.SampleTable` does both); lengths are measured from the
answers, and similarity (MiniLM cosine of question and answer) and, for prompts with an ``answer``,
the ``numeric`` answer check come from an extra endpoint of the run's own reward worker
(:data:`~rlfleet.controller.eval_scoring.BUILTIN_ENDPOINT`, created when first needed; a run
scoring on a shared reward server measures no similarity). Each evaluation is a line of
``eval.jsonl``; ``eval.json`` holds the first and the last summaries and every one between, and
the end of the run prints the before/after summary. Without ``eval.data`` only the before/after
table of a few training prompts is made, as before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlfleet.common.atomic_files import write_atomic
from rlfleet.common.errors import RlfleetError
from rlfleet.controller.dataset import PromptDataset
from rlfleet.controller.eval_metrics import CORRECT, SIMILARITY, EvalRow, make_row, summarize, summary_line
from rlfleet.controller.eval_scoring import BUILTIN_ENDPOINT, builtin_spec, checks_answers, score_answers
from rlfleet.controller.own_store import OwnStore
from rlfleet.controller.ports import FleetClient, RunState
from rlfleet.controller.run_reward import RunReward
from rlfleet.controller.samples import SampleTable

if TYPE_CHECKING:
    from rlfleet.controller.reward_control import RewardControl

logger = logging.getLogger(__name__)


def reward_name(spec: Any) -> str:
    """How eval.jsonl and eval.json name the run's reward: its spec text (a dict spec as JSON, a
    Python reward by its name); ``reward`` when the run has none."""
    if spec is None:
        return "reward"
    return spec if isinstance(spec, str) else json.dumps(spec, sort_keys=True, default=str)


class RunEval:
    """The held-out evaluations of a run (or just its sample table, without ``eval.data``): its
    ``state``, its training ``dataset`` (the held-out file is read the same way; the table's prompts
    come from it without one), its ``tokenizer``, its own ``store`` (the answers are read back from
    there), its ``reward`` (None: offline) and where it reports (``say``). Each capture answers
    through the fleet client it is given."""

    def __init__(
        self, state: RunState, dataset: PromptDataset, tokenizer: Any, store: OwnStore,
        reward: RunReward | None, say: Callable[[str], None],
    ) -> None:  # fmt: skip
        cfg = state.config
        self.state = state
        self.store = store
        self.tokenizer = tokenizer
        self.reward = reward
        self.say = say
        self.heldout = cfg.eval.data is not None
        if cfg.eval.data is not None:
            data = dataset
            heldout = PromptDataset(
                cfg.eval.data,
                max_prompt_length=cfg.max_prompt_length,
                prompt_key=data.prompt_key,
                seed=cfg.placement.seed,
                shuffle=False,
                overlong=data.overlong,
                system_prompt=data.system_prompt,
                tokenizer=tokenizer,
            )
            self.table = SampleTable(
                [heldout[i] for i in range(len(heldout))],
                cfg,
                shown=cfg.sample_table_size,
                max_tokens=cfg.eval.max_tokens,
            )
        else:
            self.table = SampleTable(dataset.sample_items(cfg.sample_table_size), cfg)
        self.records: list[dict[str, Any]] = []
        self.path = state.output_dir / "eval.jsonl"
        self._builtin: RewardControl | bool | None = None  # on the built-in endpoint; False: none to be had

    def due(self, step: int) -> bool:
        every = self.state.config.eval.every
        return self.heldout and every > 0 and step % every == 0

    async def capture(self, label: str, fleet: FleetClient) -> None:
        """Answer (and, with ``eval.data``, measure) the prompts at the run's current weights."""
        state = self.state
        last = self.records[-1] if self.records else None
        if label == "after" and last is not None and last["weight_version"] == state.weight_version:
            self.table.captures["after"] = self.table.captures[last["label"]]  # answered at these weights
            self._record(label, [EvalRow.from_json(row) for row in last["rows"]])
            return
        self.say(self.starting_line(label))
        rows = await self.table.capture(label, fleet, state.weight_version, self.store)
        if not self.heldout:
            return
        limit = state.config.eval.limit_words
        name = reward_name(self.reward.spec if self.reward else None)
        evals = []
        for item, row in zip(self.table.items, rows, strict=True):
            got = make_row(item.index, row["prompt"], 0, row["answer"], row["tokens"], limit)
            got.rewards, got.components = {name: row["reward"]}, {name: row["components"]}
            got.prompt_tokens = len(item.token_ids or [])
            got.turns, got.tool_calls = row.get("turns"), row.get("tool_calls")
            evals.append(got)
        await self._measure(evals, fleet)
        self._record(label, evals)

    def starting_line(self, label: str) -> str:
        """What the console says as a capture begins: ``evaluating 66 held-out prompts (before, step
        0, up to 128 new tokens each)``; without ``eval.data``, the sample table's prompts."""
        doing = "evaluating {} held-out prompts" if self.heldout else "answering {} sample prompts"
        return (
            f"{doing.format(len(self.table.items))} ({label}, step {self.state.global_step}, "
            f"up to {self.table.max_tokens} new tokens each)"
        )

    def _record(self, label: str, rows: list[EvalRow]) -> None:
        state = self.state
        summary = summarize(rows, state.config.eval.limit_words)
        record = {
            "label": label,
            "step": state.global_step,
            "weight_version": state.weight_version,
            "summary": summary,
            "rows": [row.to_json() for row in rows],
        }
        with self.path.open("w" if not self.records else "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        self.records.append(record)
        self.say(
            f"held-out eval {label} (step {state.global_step}, {len(rows)} prompts): {summary_line(summary)}"
        )

    async def _measure(self, rows: list[EvalRow], fleet: FleetClient) -> None:
        """Similarity and the answer check of each row, from the built-in endpoint."""
        control = await self._builtin_control(fleet)
        if control is None:
            return
        items = self.table.items
        answers = [[row.answer] for row in rows]
        scored = await score_answers(
            control, self.store, BUILTIN_ENDPOINT, items, [r.prompt for r in rows], answers, self.tokenizer
        )
        for i, row in enumerate(rows):
            row.similarity = scored.components[SIMILARITY][i]
            if CORRECT in scored.components:
                row.correct = scored.components[CORRECT][i] >= 0.5

    async def _builtin_control(self, fleet: FleetClient) -> RewardControl | None:
        """A reward control of its own (the run's step metrics stay the run's reward's) on the built-in
        endpoint, created on the run's own reward worker the first time; None when there is none."""
        if self._builtin is None:
            self._builtin = False
            from rlfleet.controller.reward_control import RewardControl

            run_control = fleet.reward
            assert run_control is not None, "an online run attaches its reward tier when it starts"
            if self.state.config.reward.url or not run_control.registry.workers("reward"):
                logger.warning("held-out eval: no reward worker of the run's own; similarity is not measured")
                return None
            control = RewardControl(
                run_control.transport,
                run_control.cluster,
                run_control.registry,
                token=run_control.token,
                faults=run_control.faults,
            )
            try:
                await control.set_reward(
                    {"spec": builtin_spec(checks_answers(self.table.items))}, BUILTIN_ENDPOINT
                )
            except RlfleetError as exc:
                logger.warning("held-out eval: the reward worker could not serve similarity (%s)", exc)
                return None
            self._builtin = control
        return self._builtin or None

    def write(self) -> None:
        """``samples.md`` (the table, and the held-out means before and after), ``eval.json``; print both."""
        cfg, output_dir = self.state.config, self.state.output_dir
        text = self.table.render()
        if self.records:
            first, last = self.records[0], self.records[-1]
            text += (
                f"\n\nheld-out eval ({cfg.eval.data}, {first['summary']['prompts']} prompts):\n"
                f"- before: {summary_line(first['summary'])}\n- after:  {summary_line(last['summary'])}"
            )
            data = {
                "eval_data": cfg.eval.data,
                "limit_words": cfg.eval.limit_words,
                "before": first["summary"],
                "after": last["summary"],
                "evals": [
                    {k: r[k] for k in ("label", "step", "weight_version", "summary")} for r in self.records
                ],
            }
            write_atomic(output_dir / "eval.json", json.dumps(data, indent=1))
        (output_dir / "samples.md").write_text(text)
        self.say(text)
