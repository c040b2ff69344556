"""``rlfleet eval``: answer held-out prompts with one or more models and measure the answers.

::

    rlfleet eval MODEL [MODEL ...] --data FILE [--split NAME] [--reward SPEC ...] [--max-new-tokens 128]
                 [--greedy | --temperature T --samples K] [--limit-words 50] [--out results.json]
                 [--chat-template TEXT_OR_FILE] [--trust-remote-code]

A MODEL is a model folder, a built-in name (``smollm2``, ``tiny:<name>``) or anything else
:func:`~rlfleet.controller.models.resolve_model` takes, or a run's ``output_dir`` (each
``checkpoint-<step>/hf`` in step order, then ``final``). Prompts are read and rendered (chat
template, system prompt) by :class:`~rlfleet.controller.dataset.PromptDataset`, as a run reads them;
``--split`` reads ``--data`` through Hugging Face ``datasets`` (an ``hf:`` data path, see
:mod:`~rlfleet.controller.hf_datasets`; a local file or folder of split files becomes one). Each
model's tokenizer is loaded as a run loads it (:func:`~rlfleet.controller.run_tokenizer.load_run_tokenizer`:
``--chat-template`` replaces its template, ``--trust-remote-code`` lets a folder's own code run).

Design: generation runs here, in-process, with Hugging Face transformers (prompts batched with left
padding; greedy unless ``--temperature``/``--samples``); lengths are measured here; everything that
needs a model or a reward rule (similarity, the answer check, ``--reward`` specs) is scored by one
reward worker started for the eval (:class:`~rlfleet.controller.eval_scoring.EvalRewardTier`), so
the controller never imports the reward package and the numbers are the reward tier's own.
The table goes to stdout, the per-answer rows and summaries to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfleet.common.atomic_files import write_atomic
from rlfleet.common.errors import ConfigError
from rlfleet.common.remote_code import refused_remote_code, remote_code_reason
from rlfleet.controller.dataset import PromptDataset, PromptItem
from rlfleet.controller.eval_metrics import CORRECT, SIMILARITY, EvalRow, make_row, render_table, summarize
from rlfleet.controller.hf_datasets import HF_PREFIX, is_hf_source
from rlfleet.controller.run_tokenizer import load_run_tokenizer

if TYPE_CHECKING:
    from rlfleet.controller.eval_scoring import EvalRewardTier

logger = logging.getLogger(__name__)

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class EvalOptions:
    """What ``rlfleet eval`` was asked (its flags)."""

    models: list[str]
    data: str | Path
    """A prompt file or an ``hf:`` data path."""
    rewards: list[str] = field(default_factory=list)
    split: str | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    samples: int = 1
    limit_words: int = 50
    max_prompts: int | None = None
    batch_size: int = 8
    prompt_key: str = "prompt"
    system_prompt: str | None = None
    seed: int = 0
    chat_template: str | None = None
    """A Jinja template, or the path of a .jinja file, replacing each model's own."""
    trust_remote_code: bool = False

    def check(self) -> None:
        """Raise ConfigError naming the flag that is out of range."""
        for flag, value, low in (("--max-new-tokens", self.max_new_tokens, 1), ("--samples", self.samples, 1),
                                 ("--limit-words", self.limit_words, 0), ("--batch-size", self.batch_size, 1),
                                 ("--max-prompts", self.max_prompts or 1, 1)):  # fmt: skip
            if value < low:
                raise ConfigError(flag, value, f"must be >= {low}")
        if self.temperature < 0:
            raise ConfigError("--temperature", self.temperature, "must be >= 0 (0: greedy)")
        if self.samples > 1 and self.temperature == 0:
            raise ConfigError(
                "--samples", self.samples, "several samples need --temperature > 0 (greedy gives one)"
            )


def model_targets(spec: str) -> list[tuple[str, str]]:
    """(label, model spec) pairs for ``spec``: a run's output_dir (or one checkpoint) becomes its
    model folders (``checkpoint-<step>/hf`` by step, then ``final``); anything else stays as given."""
    path = Path(spec).expanduser()
    if not path.is_dir() or (path / "config.json").is_file():
        return [(spec, spec)]
    if (path / "hf" / "config.json").is_file():
        return [(spec, str(path / "hf"))]
    steps = sorted(
        (int(m.group(1)), child) for child in path.iterdir() if (m := _CHECKPOINT.match(child.name))
    )
    found = [
        (f"{spec.rstrip('/')}/{c.name}", str(c / "hf"))
        for _, c in steps
        if (c / "hf" / "config.json").is_file()
    ]
    if (path / "final" / "config.json").is_file():
        found.append((f"{spec.rstrip('/')}/final", str(path / "final")))
    return found or [(spec, spec)]  # not a run either: resolve_model names the problem


def prompt_source(options: EvalOptions) -> str:
    """The data path to read: ``--data`` as given, or with ``--split`` one read through ``datasets``
    (an ``hf:`` path takes the split as its option; a local file or folder becomes ``hf:PATH?split=``)."""
    data = str(options.data)
    if options.split is None:
        return data
    if not is_hf_source(data):
        return f"{HF_PREFIX}{data}?split={options.split}"
    query = data.partition("?")[2]
    if any(pair.partition("=")[0] == "split" for pair in query.split("&")):
        raise ConfigError("--split", options.split, f"{data} names its split already; give only one of them")
    return f"{data}{'' if data.endswith(('?', '&')) else '&' if '?' in data else '?'}split={options.split}"


def load_prompts(options: EvalOptions) -> PromptDataset:
    """The prompts, read as a run reads them (not shuffled; rendered once a tokenizer is bound)."""
    return PromptDataset(prompt_source(options), max_prompt_length=1 << 20, prompt_key=options.prompt_key,
                         seed=options.seed, shuffle=False, system_prompt=options.system_prompt)  # fmt: skip


def _as_flag(exc: ConfigError) -> ConfigError:
    """A run setting's error (``chat_template``, ``trust_remote_code``) named by its ``rlfleet eval`` flag."""
    return ConfigError(f"--{exc.path.replace('_', '-')}", exc.value, exc.reason)


def load_model(model_dir: Path, options: EvalOptions) -> tuple[Any, Any]:
    """(tokenizer, model) of ``model_dir``, loaded as a run loads them (with the two flags above)."""
    import torch
    from transformers import AutoModelForCausalLM

    trust = options.trust_remote_code
    try:
        tokenizer = load_run_tokenizer(
            model_dir, trust_remote_code=trust, chat_template=options.chat_template
        )
    except ConfigError as exc:
        raise _as_flag(exc) from None
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32, trust_remote_code=trust
        )
    except ValueError as exc:
        if refused_remote_code(exc):
            raise ConfigError("--trust-remote-code", False, remote_code_reason(model_dir)) from None
        raise
    return tokenizer, model.eval()


def generate(
    model_dir: Path, dataset: PromptDataset, options: EvalOptions
) -> tuple[list[PromptItem], list[list[tuple[str, int]]]]:
    """Greedy (or sampled) answers of the model in ``model_dir``: per prompt, ``samples`` (text,
    generated tokens before EOS). Prompts go in batches of ``batch_size``, left-padded."""
    import torch

    from rlfleet.common.schema.batch import pad_left

    tokenizer, model = load_model(model_dir, options)
    dataset.bind_tokenizer(tokenizer)
    items = [dataset[i] for i in range(len(dataset))][: options.max_prompts]
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos or 0)
    sampled = options.temperature > 0
    answers: list[list[tuple[str, int]]] = []
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(options.seed)
        for start in range(0, len(items), options.batch_size):
            batch = items[start : start + options.batch_size]
            ids, mask = pad_left([it.token_ids or [] for it in batch], pad)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=options.max_new_tokens,
                                 do_sample=sampled, temperature=options.temperature if sampled else None,
                                 top_p=None, top_k=None, num_return_sequences=options.samples,
                                 pad_token_id=pad, eos_token_id=eos)  # fmt: skip
            rows = [_cut(row.tolist(), eos, pad) for row in out[:, ids.shape[1] :]]
            for i in range(len(batch)):
                group = rows[i * options.samples : (i + 1) * options.samples]
                answers.append(
                    [(tokenizer.decode(r, skip_special_tokens=True).strip(), len(r)) for r in group]
                )
    return items, answers


def _cut(ids: list[int], eos: int | None, pad: int) -> list[int]:
    """Generated ids up to (not including) the first EOS; padding after it dropped."""
    if eos is not None and eos in ids:
        return ids[: ids.index(eos)]
    while ids and ids[-1] == pad and pad != eos:
        ids = ids[:-1]
    return ids


async def score_rows(
    tier: EvalRewardTier, rewards: Sequence[str], items: list[PromptItem], answers: list[list[str]],
    rows: list[EvalRow], tokenizer: Any,
) -> None:  # fmt: skip
    """Fill each row's similarity, answer check, rewards and components from the reward tier."""
    from rlfleet.controller.eval_scoring import BUILTIN_ENDPOINT
    from rlfleet.controller.samples import question_text

    questions = [question_text(item) for item in items]
    endpoints = [BUILTIN_ENDPOINT] + [f"reward-{i}" for i in range(len(rewards))]
    scored = await asyncio.gather(*(tier.score(e, items, questions, answers, tokenizer) for e in endpoints))
    builtin, specs = scored[0], scored[1:]
    for j, row in enumerate(rows):
        row.similarity = builtin.components[SIMILARITY][j]
        if CORRECT in builtin.components:
            row.correct = builtin.components[CORRECT][j] >= 0.5
        for spec, result in zip(rewards, specs, strict=True):
            row.rewards[spec] = result.scores[j]
            row.components[spec] = {name: values[j] for name, values in result.components.items()}


@dataclass
class ModelAnswers:
    """One model's answers, before scoring."""

    label: str
    path: Path
    items: list[PromptItem]
    answers: list[list[tuple[str, int]]]
    tokenizer: Any


async def evaluate(options: EvalOptions) -> dict[str, Any]:
    """Every model's rows and summary, as ``rlfleet eval`` writes them: all models answer first
    (in-process), then one reward worker scores every model's answers."""
    from rlfleet.controller.eval_scoring import BUILTIN_ENDPOINT, EvalRewardTier, builtin_spec, checks_answers
    from rlfleet.controller.models import resolve_model
    from rlfleet.controller.progress_bars import hide_third_party_bars
    from rlfleet.controller.samples import question_text

    hide_third_party_bars()  # "Loading weights" bars would land between the table's lines
    options.check()
    dataset = load_prompts(options)
    targets = [target for spec in options.models for target in model_targets(spec)]
    resolved = [
        (label, resolve_model(spec, seed=options.seed)) for label, spec in targets
    ]  # bad ones fail here
    answered = []
    for label, path in resolved:
        items, answers = await asyncio.to_thread(generate, path, dataset, options)
        answered.append(ModelAnswers(label, path, items, answers, dataset.tokenizer))
        logger.info("%s answered %d prompts", label, len(items))
    endpoints: dict[str, Any] = {BUILTIN_ENDPOINT: builtin_spec(checks_answers(answered[0].items))}
    endpoints.update({f"reward-{i}": spec for i, spec in enumerate(options.rewards)})
    results = []
    async with EvalRewardTier(endpoints) as tier:
        for got in answered:
            rows = [make_row(item.index, question_text(item), s, text, tokens, options.limit_words)
                    for item, group in zip(got.items, got.answers, strict=True)
                    for s, (text, tokens) in enumerate(group)]  # fmt: skip
            prompt_tokens = {item.index: len(item.token_ids or []) for item in got.items}
            for row in rows:
                row.prompt_tokens = prompt_tokens[row.index]
            texts = [[text for text, _ in group] for group in got.answers]
            await score_rows(tier, options.rewards, got.items, texts, rows, got.tokenizer)
            summary = summarize(rows, options.limit_words)
            results.append({"model": got.label, "path": str(got.path), "summary": summary,
                            "rows": [r.to_json() for r in rows]})  # fmt: skip
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(options).items() if k != "models"}
    return {"data": dataset.data_path.as_posix(), "settings": settings, "models": results}


def add_eval_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "eval", help="evaluate models (folders, built-in names, a run's checkpoints) on prompts"
    )
    p.add_argument(
        "models",
        nargs="+",
        metavar="MODEL",
        help="model folder, 'smollm2', 'tiny:<name>' or a run's output_dir",
    )
    p.add_argument(
        "--data",
        required=True,
        help="prompt file (JSONL/CSV/Parquet with a prompt column), a folder of split files or an hf: path",
    )
    p.add_argument(
        "--split", default=None, help="split to read through Hugging Face datasets (e.g. test, train[:10%%])"
    )
    p.add_argument(
        "--chat-template", default=None, metavar="TEXT_OR_FILE",
        help="Jinja chat template (text or a .jinja file) replacing each model's own",
    )  # fmt: skip
    p.add_argument(
        "--trust-remote-code", action="store_true", help="let model folders run their own code (auto_map)"
    )
    p.add_argument(
        "--reward", action="append", default=[], metavar="SPEC", help="reward spec to score with (repeatable)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="longest answer in tokens (default 128)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="greedy decoding (the default)")
    mode.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature")
    p.add_argument("--samples", type=int, default=1, help="answers per prompt when sampling (pass@k)")
    p.add_argument(
        "--limit-words", type=int, default=50, help="word limit for the within-limit share (default 50)"
    )
    p.add_argument("--max-prompts", type=int, default=None, help="evaluate only the first N prompts")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (default 8)")
    p.add_argument("--prompt-key", default="prompt", help="column holding the prompt")
    p.add_argument("--system-prompt", default=None, help="system message for chat templates")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and tiny models' init seed)")
    p.add_argument("--out", type=Path, default=None, help="write the rows and summaries here (JSON)")
    p.add_argument("--log-level", default="WARNING", help="log level (default WARNING)")
    p.set_defaults(handler=run_eval_command)


def run_eval_command(args: argparse.Namespace) -> int:
    """``rlfleet eval``: print the table, write the JSON; user mistakes raise UserError (exit 2)."""
    options = EvalOptions(
        models=list(args.models), data=args.data, rewards=list(args.reward), split=args.split,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, samples=args.samples,
        limit_words=args.limit_words, max_prompts=args.max_prompts, batch_size=args.batch_size,
        prompt_key=args.prompt_key, system_prompt=args.system_prompt, seed=args.seed,
        chat_template=args.chat_template, trust_remote_code=args.trust_remote_code,
    )  # fmt: skip
    result = asyncio.run(evaluate(options))
    labels = [m["model"] for m in result["models"]]
    print(render_table(labels, [m["summary"] for m in result["models"]]), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.out, json.dumps(result, indent=1, default=str))
        print(f"results written to {args.out}", flush=True)
    return 0
