"""PromptDataset reading JSONL, CSV and Parquet, and its errors for bad files and rows."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlfleet.controller.dataset import PromptDataset
from rlfleet.controller.errors import DatasetError

ROWS = [
    {"prompt": "What is 2+2?", "answer": 4, "source": "math"},
    {"prompt": "Capital of France?", "answer": 7, "source": "geo"},
    {"prompt": "Name a color.", "answer": 9, "source": "misc"},
]


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize(
    ("suffix", "answer_type"),
    [(".jsonl", int), (".csv", str), (".parquet", int)],
    ids=["jsonl", "csv", "parquet"],
)
def test_reads_each_format_with_metadata(tmp_path: Path, suffix: str, answer_type: type) -> None:
    ds = PromptDataset(_write(tmp_path / f"data{suffix}", ROWS), shuffle=False)
    assert len(ds) == 3
    items = [ds[i] for i in range(3)]
    assert [it.text for it in items] == [r["prompt"] for r in ROWS]
    assert [it.index for it in items] == [0, 1, 2]
    assert all(it.token_ids is None for it in items)  # no tokenizer bound yet
    # CSV has no types: its cells stay strings; JSONL and Parquet keep theirs.
    assert [it.metadata for it in items] == [
        {"answer": answer_type(r["answer"]), "source": r["source"]} for r in ROWS
    ]


def test_parquet_chat_messages_render_with_template(tmp_path: Path, chat_tokenizer: Any) -> None:
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}]
    path = _write(tmp_path / "chat.parquet", rows)
    ds = PromptDataset(path, prompt_key="messages", tokenizer=chat_tokenizer)
    assert ds[0].text == "<system>Be brief.\n<user>Hi\n<assistant>"
    assert ds[0].prompt == rows[0]["messages"]


def test_metadata_keys_selects_columns(tmp_path: Path) -> None:
    ds = PromptDataset(_write(tmp_path / "d.jsonl", ROWS), metadata_keys=["answer"], shuffle=False)
    assert ds[1].metadata == {"answer": 7}
    with pytest.raises(DatasetError, match=r"lacks metadata column\(s\) \['label'\]"):
        PromptDataset(_write(tmp_path / "d.jsonl", ROWS), metadata_keys=["label"])


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DatasetError, match="no such file") as info:
        PromptDataset(missing)
    assert str(missing) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unsupported_extension_names_path_and_formats(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("hello\n")
    with pytest.raises(
        DatasetError, match=r"unsupported file extension '\.txt'.*\.csv.*\.jsonl.*\.parquet"
    ) as info:
        PromptDataset(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "ok"}\n{"prompt": \n', "line 2 is not valid JSON"),
        ('["a list"]\n', "line 1 is a JSON list"),
        ('{"question": "x"}\n', "row 0 has no 'prompt' column"),
        ('{"prompt": "ok"}\n{"prompt": "   "}\n', "row 1: the prompt is empty"),
        ('{"prompt": 42}\n', "row 0: the prompt must be"),
        ('{"prompt": [{"role": "user"}]}\n', "needs string 'role' and 'content'"),
        ("\n\n", "holds no rows"),
    ],
    ids=["bad-json", "not-object", "no-prompt", "empty", "number", "bad-message", "empty-file"],
)
def test_bad_rows_raise_dataset_error(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        PromptDataset(path)


def test_csv_row_with_surplus_cells(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("prompt,answer\nhello,1\nworld,2,extra\n")
    with pytest.raises(DatasetError, match="line 3 has more cells than the header"):
        PromptDataset(path)


def test_corrupt_parquet(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DatasetError, match="cannot read as Parquet"):
        PromptDataset(path)
