"""Hugging Face Hub model ids as local folders, through ``huggingface_hub`` and its cache.

``org/name`` (or ``org/name@revision``: a branch, tag or commit) resolves to the snapshot folder
of the local Hugging Face cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``), the layout ``models--org--name/snapshots/<commit>/`` that
``huggingface_hub`` writes. A model already in the cache is used without asking the Hub; one that
is not is downloaded, unless ``HF_HUB_OFFLINE`` is set, in which case it is a
:class:`~rlfleet.common.errors.HubModelNotFound` saying so. Every tier then loads the folder with
``from_pretrained`` like any local model.

``huggingface_hub`` is imported inside :func:`resolve_hub_model`: every tier that loads models has
it (transformers depends on it), and nothing else needs it.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from rlfleet.common.errors import HubModelNotFound

logger = logging.getLogger(__name__)

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?)(?:@(?P<rev>[\w./-]+))?$")
"""``name`` or ``org/name``, optionally ``@revision``: the shape of a Hub model id."""
SKIPPED_FILES = (
    "*.gguf",
    "*.onnx",
    "*.h5",
    "*.msgpack",
    "*.ot",
    "*.tflite",
    "onnx/*",
    "openvino/*",
    "original/*",
)
"""Files a download leaves out: other frameworks' copies of the weights, which no tier loads."""
_TRUE = frozenset({"1", "true", "yes", "on"})


def split_hub_id(spec: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``spec`` has the shape of a Hub model id, else None."""
    found = HUB_ID.fullmatch(spec.strip())
    if found is None or ".." in found["repo"]:
        return None
    return found["repo"], found["rev"]


def hub_cache_dir() -> Path:
    """The Hugging Face cache folder, read from the environment now (not at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "huggingface"
    return base / "hub"


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids any request to the Hub."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def resolve_hub_model(spec: str) -> Path:
    """The local snapshot folder of the Hub model ``spec`` (``org/name[@revision]``).

    Raises:
        HubModelNotFound: ``spec`` is not a Hub id, is not cached while ``HF_HUB_OFFLINE`` is set,
            could not be downloaded, or its snapshot has no ``config.json``.
    """
    parts = split_hub_id(spec)
    if parts is None:
        raise HubModelNotFound(spec, "not a Hub model id (expected 'org/name' or 'org/name@revision')")
    repo_id, revision = parts
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        folder = _download(repo_id, revision, cache)
    except HFValidationError as exc:
        raise HubModelNotFound(spec, f"not a valid Hub model id: {exc}") from exc
    if not (folder / "config.json").is_file():
        raise HubModelNotFound(
            spec, f"its snapshot {folder} holds no config.json: is it a transformers model?"
        )
    logger.info("model %r: Hugging Face cache snapshot %s", spec, folder)
    return folder


def _download(repo_id: str, revision: str | None, cache: Path) -> Path:
    """Download ``repo_id`` into ``cache``, or say why not (offline, or the Hub's error)."""
    where = f"{repo_id}@{revision}" if revision else repo_id
    if hub_offline():
        raise HubModelNotFound(
            where,
            f"it is not in the local Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; download it "
            f"where the Hub is reachable (hf download {repo_id}) into that cache, or unset HF_HUB_OFFLINE",
        )
    from huggingface_hub import snapshot_download

    logger.info("model %r: not in the cache %s, downloading", where, cache)
    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=cache, ignore_patterns=list(SKIPPED_FILES)
            )
        )
    except Exception as exc:  # noqa: BLE001 - every hub/network error becomes one clear user error
        raise HubModelNotFound(
            where,
            f"it is not in the local Hugging Face cache ({cache}) and downloading it failed: "
            f"{type(exc).__name__}: {' '.join(str(exc).split())}",  # one line
        ) from exc
