"""Prompt rows through Hugging Face ``datasets`` (the optional extra ``rlfleet-controller[datasets]``).

A data path that starts with ``hf:`` is read with ``datasets`` instead of the plain file readers::

    hf:openai/gsm8k?subset=main&split=test[:10%]    a dataset on the Hub (or in the local datasets cache)
    hf:/data/saved                                  a save_to_disk folder (a Dataset: its own split)
    hf:/data/folder?split=test                      a folder of data files (train.parquet, test.csv, ...)
    hf:/data/prompts.parquet?split=train[:100]      one data file: .parquet, .csv, .json, .jsonl, .arrow
    hf:csv?data_files.train=a.csv&data_files.test=b.csv&split=test    a builder with a file per split

Options follow ``?`` as ``key=value`` pairs joined by ``&`` (taken literally, no URL escapes):
``split`` (default ``train``; slices such as ``test[:10%]`` or ``train[10:20]`` work everywhere),
``subset`` (the dataset's configuration name), and ``data_files.<split>`` (a file for that split).
``HF_DATASETS_OFFLINE`` and the rest of ``datasets``' settings apply as usual.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rlfleet.controller.dataset_files import Prompt, Record, check_prompt
from rlfleet.controller.errors import DatasetError

logger = logging.getLogger(__name__)

HF_PREFIX = "hf:"
INSTALL = "pip install 'rlfleet-controller[datasets]'"
FILE_BUILDERS = {".parquet": "parquet", ".pq": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json",
                 ".arrow": "arrow"}  # fmt: skip
"""The ``datasets`` builder of a single data file, by extension."""
SAVED_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
"""Files that mark a ``save_to_disk`` folder."""


def is_hf_source(path: str | Path) -> bool:
    """Whether a data path is read through ``datasets`` (it starts with ``hf:``)."""
    return str(path).startswith(HF_PREFIX)


def parse_source(source: str) -> tuple[str, str, str | None, dict[str, str]]:
    """``(target, split, subset, data_files)`` of an ``hf:`` data path; DatasetError for a bad option."""
    target, _, query = source[len(HF_PREFIX) :].partition("?")
    options: dict[str, str] = {}
    for pair in filter(None, query.split("&")):
        key, eq, value = pair.partition("=")
        if not eq or not value or key in options:
            raise DatasetError(source, f"option {pair!r} must be key=value, each key once")
        options[key] = value
    files = {
        key.removeprefix("data_files."): options.pop(key)
        for key in list(options)
        if key.startswith("data_files.")
    }
    split, subset = options.pop("split", "train"), options.pop("subset", None)
    if options:
        raise DatasetError(
            source, f"unknown option(s) {sorted(options)}; use split, subset, data_files.<split>"
        )
    if not target:
        raise DatasetError(source, "name a dataset after 'hf:' (e.g. hf:openai/gsm8k?subset=main)")
    return target, split, subset, files


def read_hf_records(source: str, prompt_key: str) -> list[tuple[Prompt, Record]]:
    """Every row of the ``hf:`` data path ``source`` as (checked prompt, whole record)."""
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            source, f"an hf: data path needs the Hugging Face datasets library: {INSTALL}"
        ) from None
    target, split, subset, files = parse_source(source)
    try:
        loaded = _load(datasets, target, split, subset, files)
    except DatasetError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds (missing, offline, bad split)
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise DatasetError(source, f"datasets could not load it: {type(exc).__name__}: {message}") from exc
    if prompt_key not in loaded.column_names:
        raise DatasetError(
            source, f"has no {prompt_key!r} column (it has {loaded.column_names}); set prompt_key"
        )
    rows = loaded.to_list()
    logger.info("dataset %s: %d rows through datasets (split %s)", source, len(rows), split)
    return [(check_prompt(Path(source), i, row, prompt_key), row) for i, row in enumerate(rows)]


def _load(datasets: Any, target: str, split: str, subset: str | None, files: dict[str, str]) -> Any:
    """The rows of one split (a ``datasets.Dataset``), from whatever ``target`` names."""
    path = Path(target).expanduser()
    if path.is_dir() and any((path / marker).is_file() for marker in SAVED_MARKERS):
        return _saved_split(datasets, datasets.load_from_disk(str(path)), split)
    if path.is_file():
        builder = FILE_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DatasetError(
                target, f"unsupported data file; use one of {', '.join(sorted(FILE_BUILDERS))}"
            )
        return datasets.load_dataset(builder, data_files={"train": str(path)}, split=split)
    if path.is_dir():
        return datasets.load_dataset(str(path), name=subset, split=split)
    return datasets.load_dataset(target, name=subset, split=split, data_files=files or None)


def _saved_split(datasets: Any, saved: Any, split: str) -> Any:
    """``split`` (with its slice) of a ``load_from_disk`` result: one Dataset, or a DatasetDict's split."""
    name = split.partition("[")[0]
    if isinstance(saved, datasets.DatasetDict):
        if name not in saved:
            raise DatasetError(split, f"no split {name!r} in the saved dataset (it has {sorted(saved)})")
        saved = saved[name]
    if "[" not in split:
        return saved
    spans = datasets.ReadInstruction.from_spec(split).to_absolute({name: len(saved)})
    rows = [i for span in spans for i in range(span.from_, span.to)]
    return saved.select(rows)
