"""Read prompt rows from JSONL, CSV or Parquet files, chosen by extension, or from memory (a list of
dicts, a ``datasets.Dataset``), and check each prompt.

A prompt is a non-empty string or a non-empty list of chat messages ``{"role", "content"}``.
CSV cells are always strings (the format carries no types); JSONL and Parquet keep theirs.
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlfleet.controller.errors import DatasetError

logger = logging.getLogger(__name__)

Message = dict[str, Any]
Prompt = str | list[Message]
Record = dict[str, Any]


def _read_jsonl(path: Path) -> list[Record]:
    records: list[Record] = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(path, f"line {number} is not valid JSON: {exc.msg}") from exc
            if not isinstance(record, dict):
                raise DatasetError(path, f"line {number} is a JSON {type(record).__name__}, not an object")
            records.append(record)
    return records


def _read_csv(path: Path) -> list[Record]:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        records = []
        for record in reader:
            if None in record:  # DictReader files surplus cells under the key None
                raise DatasetError(path, f"line {reader.line_num} has more cells than the header")
            records.append(dict(record))
    return records


def _read_parquet(path: Path) -> list[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except pa.ArrowException as exc:
        raise DatasetError(path, f"cannot read as Parquet: {exc}") from exc
    return table.to_pylist()


READERS: dict[str, Callable[[Path], list[Record]]] = {
    ".jsonl": _read_jsonl,
    ".ndjson": _read_jsonl,
    ".csv": _read_csv,
    ".parquet": _read_parquet,
    ".pq": _read_parquet,
}


def read_records(path: Path, prompt_key: str) -> list[tuple[Prompt, Record]]:
    """Every row of ``path`` as (checked prompt, whole record); raises ``DatasetError`` naming the path."""
    if not path.exists():
        raise DatasetError(path, "no such file")
    if not path.is_file():
        raise DatasetError(path, "is not a file")
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise DatasetError(
            path, f"unsupported file extension {path.suffix!r}; use one of {', '.join(sorted(READERS))}"
        )
    records = reader(path)
    return [(check_prompt(path, i, record, prompt_key), record) for i, record in enumerate(records)]


def check_prompt(path: Path, index: int, record: Record, prompt_key: str) -> Prompt:
    """The record's prompt if it is a non-empty string or a well-formed message list."""
    if prompt_key not in record:
        raise DatasetError(path, f"row {index} has no {prompt_key!r} column (it has {sorted(record)})")
    prompt = record[prompt_key]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DatasetError(path, f"row {index}: the prompt is empty")
        return prompt
    if isinstance(prompt, list) and prompt:
        for message in prompt:
            fields = ("role", "content")
            if not (isinstance(message, dict) and all(isinstance(message.get(k), str) for k in fields)):
                raise DatasetError(
                    path, f"row {index}: chat message {message!r} needs string 'role' and 'content' fields"
                )
        return prompt
    raise DatasetError(
        path, f"row {index}: the prompt must be a non-empty string or chat message list, got {prompt!r:.80}"
    )


def is_in_memory(data: Any) -> bool:
    """Whether ``data`` is rows held in memory (a list or tuple of dicts, a ``datasets.Dataset`` or
    anything with its ``to_list`` and ``column_names``) rather than a path."""
    if isinstance(data, list | tuple):
        return True
    return hasattr(data, "to_list") and hasattr(data, "column_names")


def memory_label(data: Any) -> str:
    """How errors and ``config.yaml`` name rows held in memory: ``<list of 8 rows>``."""
    kind = "list" if isinstance(data, list | tuple) else type(data).__name__
    return f"<{kind} of {len(data)} rows>"


def read_memory_records(data: Any, prompt_key: str) -> list[tuple[Prompt, Record]]:
    """Every row of ``data`` (see :func:`is_in_memory`) as (checked prompt, a copy of the record)."""
    label = Path(memory_label(data))
    if isinstance(data, list | tuple):
        rows = list(data)
    else:  # a datasets.Dataset: its rows as plain dicts (no datasets import needed here)
        if prompt_key not in data.column_names:
            reason = f"has no {prompt_key!r} column (it has {data.column_names}); set prompt_key"
            raise DatasetError(label, reason)
        rows = data.to_list()
    records = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise DatasetError(label, f"row {i} is a {type(row).__name__}; each row is a dict of columns")
        record = dict(row)
        records.append((check_prompt(label, i, record, prompt_key), record))
    return records
