"""``hf:`` data paths through Hugging Face ``datasets``, offline, on files the test writes: a
``save_to_disk`` DatasetDict and Dataset, a Parquet file, CSV files per split (``data_files``), a
folder of split files; splits and slices, ``prompt_key``, and the errors (bad split, bad option,
a Hub name that is not there offline, the extra not installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlfleet.controller.dataset import PromptDataset
from rlfleet.controller.errors import DatasetError

datasets = pytest.importorskip("datasets")  # the dev environment installs the extra

ROWS = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(10)]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline, as a user's ``HF_HUB_OFFLINE=1`` makes it: the libraries read the variables when they
    are imported (above, before this fixture), so their constants are set too (without them a Hub
    name spent about 25 s on network retries before failing)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _questions(source: str) -> list[str]:
    ds = PromptDataset(source, prompt_key="question", shuffle=False)
    return [item.prompt for item in (ds[i] for i in range(len(ds)))]  # type: ignore[misc]


def test_a_saved_dataset_dict_by_split_and_slice(tmp_path: Path) -> None:
    folder = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:6]), "test": datasets.Dataset.from_list(ROWS[6:])}
    ).save_to_disk(str(folder))
    assert _questions(f"hf:{folder}") == [r["question"] for r in ROWS[:6]]  # split defaults to train
    assert _questions(f"hf:{folder}?split=test") == [r["question"] for r in ROWS[6:]]
    assert _questions(f"hf:{folder}?split=train[:50%]") == [r["question"] for r in ROWS[:3]]
    item = PromptDataset(f"hf:{folder}?split=test[-1:]", prompt_key="question")[0]
    assert item.metadata == {"answer": ROWS[-1]["answer"]}
    with pytest.raises(DatasetError, match=r"no split 'validation' .*\['test', 'train'\]"):
        _questions(f"hf:{folder}?split=validation")


def test_a_saved_dataset_and_a_parquet_file(tmp_path: Path) -> None:
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert _questions(f"hf:{tmp_path / 'one'}?split=train[2:5]") == [r["question"] for r in ROWS[2:5]]
    parquet = tmp_path / "prompts.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(parquet))
    assert _questions(f"hf:{parquet}?split=train[:3]") == [r["question"] for r in ROWS[:3]]
    with pytest.raises(DatasetError, match="could not load it"):
        _questions(f"hf:{parquet}?split=test")  # one file is the train split


def test_csv_files_per_split_through_data_files(tmp_path: Path) -> None:
    for name, rows in (("a.csv", ROWS[:7]), ("b.csv", ROWS[7:])):
        datasets.Dataset.from_list(rows).to_csv(str(tmp_path / name), index=False)
    source = f"hf:csv?data_files.train={tmp_path / 'a.csv'}&data_files.test={tmp_path / 'b.csv'}&split=test"
    assert _questions(source) == [r["question"] for r in ROWS[7:]]


def test_a_folder_of_split_files(tmp_path: Path) -> None:
    folder = tmp_path / "files"
    folder.mkdir()
    for split, rows in (("train", ROWS[:8]), ("test", ROWS[8:])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _questions(f"hf:{folder}?split=test") == [r["question"] for r in ROWS[8:]]
    with pytest.raises(DatasetError, match="has no 'prompt' column .*set prompt_key"):
        PromptDataset(f"hf:{folder}")


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("hf:x?spilt=train", r"unknown option\(s\) \['spilt'\]"),
        ("hf:x?split", "must be key=value"),
        ("hf:?split=train", "name a dataset after 'hf:'"),
        ("hf:rlfleet-test/no-such-dataset", "could not load it"),
    ],
)
def test_bad_sources_are_dataset_errors(source: str, problem: str) -> None:
    with pytest.raises(DatasetError, match=problem):
        PromptDataset(source)


@pytest.mark.timeout(120)
def test_without_the_extra_it_says_what_to_install() -> None:
    probe = (
        "import sys; sys.modules['datasets'] = None\n"  # what an environment without the extra sees
        "from rlfleet.controller.dataset import PromptDataset\n"
        "from rlfleet.controller.errors import DatasetError\n"
        "try:\n    PromptDataset('hf:openai/gsm8k')\nexcept DatasetError as exc:\n    print(exc)\n"
    )
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=100)
    assert shown.returncode == 0, shown.stderr
    assert "pip install 'rlfleet-controller[datasets]'" in shown.stdout, shown.stdout
