"""A run's ``config.yaml``: the whole job in the form of a job file, so that ``rlfleet train
outputs/<run>/config.yaml`` runs it again unchanged (and ``rlfleet config`` shows it).

It is a :class:`~rlfleet.controller.config.JobConfig` in its nested form: a CLI run writes its job
as it was loaded; a library run writes its ``TrainerConfig`` with the model's ``name`` in ``model``,
the reward's ``spec`` in ``reward``, a ``data`` section read off its dataset, and the
``num_epochs`` / ``max_steps`` it was trained with. A local data file is written by its absolute
path, so the file runs from any folder. Two top-level keys are records for readers, not settings:
``model_path`` (the local folder ``model.name`` resolved to) and ``dataset`` (the data file); a job
file holding both beside ``model`` is a saved run's, and :func:`drop_records` drops them before
validation. Credentials are never written: a password or token that was set reads ``''`` (a rerun
takes it from ``RLFLEET_NATS_*`` / ``RLFLEET_REWARD_TOKEN``), a URL's login is masked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rlfleet.common.schema.connection import MASK

RECORDS = ("model_path", "dataset")
"""Top-level keys of a saved config that record where things resolved (ignored when read back)."""
SECRET_KEYS = frozenset({"password", "token"})
DATASET_KEYS = ("prompt_key", "chosen_key", "rejected_key", "overlong", "system_prompt", "num_workers")
"""The ``data`` settings a dataset object carries as attributes of the same names."""

HEADER = (
    "# This run's config, saved by rlfleet: `rlfleet train {path}` runs it again.\n"
    "# model_path and dataset record where model.name and data.path resolved (ignored when read back);\n"
    "# credentials are not saved: set them through RLFLEET_NATS_* or RLFLEET_REWARD_TOKEN.\n"
)


def drop_records(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the records of a saved run's config (:data:`RECORDS`), when it is one: both
    records beside a ``model``. Anything else is left for validation to name."""
    if "model" in data and all(key in data for key in RECORDS):
        return {key: value for key, value in data.items() if key not in RECORDS}
    return data


def data_section(dataset: Any) -> dict[str, Any]:
    """The job's ``data`` section read off a dataset object (its ``data_path`` and key settings)."""
    out: dict[str, Any] = {"path": local_or_as_is(str(getattr(dataset, "data_path", "")))}
    out.update({key: getattr(dataset, key) for key in DATASET_KEYS if hasattr(dataset, key)})
    return out


def local_or_as_is(path: str) -> str:
    """An existing local path made absolute; anything else (``hf:...``, a missing file) as it is."""
    found = Path(path)
    return str(found.resolve()) if path and not path.startswith("hf:") and found.exists() else path


def saved_job(job: dict[str, Any], *, model_path: str, dataset: str, header_path: Path | None = None) -> str:
    """The text of ``config.yaml``: ``job`` (JobConfig data in JSON form, credentials masked) with
    its data file made absolute, the credentials blanked and the two records first."""
    data = _blank_secrets(job)
    if isinstance(data.get("data"), dict) and isinstance(data["data"].get("path"), str):
        data["data"] = {**data["data"], "path": local_or_as_is(data["data"]["path"])}
    body = yaml.safe_dump({"model_path": model_path, "dataset": dataset, **data}, sort_keys=False)
    return (HEADER.format(path=header_path) if header_path is not None else "") + body


def _blank_secrets(value: Any) -> Any:
    """``value`` with every masked password or token (``'***'``) written as ``''``."""
    if isinstance(value, dict):
        return {
            key: "" if key in SECRET_KEYS and item == MASK else _blank_secrets(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_blank_secrets(item) for item in value]
    return value
