"""What a reward server keeps of its endpoints in ``state_dir``, so that a restart serves what it served.

One JSON file per endpoint (its name URL-quoted: ``team-a%2Fhelpful.json``) holds the spec in force,
its revision, the scaler options and the scaler's running statistics. It is written atomically
(:func:`rlfleet.common.atomic_files.write_atomic`) before a swap takes effect, after every batch a
normalizing scaler folded into its statistics (before that batch is answered), and every
``state_save_s`` seconds, so a server killed at any instant finds the old state or the new one,
never a mix, and its statistics as of the last batch it answered. Writes of one directory take
turns (a swap writes from a worker thread, a scored batch from the event loop). Endpoints created
at run time (a ``SetRewardSpec`` for a name the config lacks) have a file like any other and come
back too.

What is read back is hostile input like any other: a file that is too large, not JSON, not an
:class:`EndpointState`, or that names another endpoint is a :class:`RewardStateError` naming the
file, and the server does not start on it. Several replicas may share one ``state_dir``: a file is
never replaced by one of a lower revision, so a replica that missed a swap while it was down does
not undo it (and reads it when it starts again).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, unquote

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlfleet.common.atomic_files import PARTIAL_SUFFIX, write_atomic
from rlfleet.common.schema.reward import ScalerConfig, Spec
from rlfleet.reward.errors import RewardStateError
from rlfleet.reward.scaler import ScalerState

logger = logging.getLogger(__name__)

MAX_STATE_BYTES = 1 << 20
"""A state file larger than this is refused unread (a spec and four numbers take a few KiB)."""


class EndpointState(BaseModel):
    """One endpoint as its state file holds it."""

    model_config = ConfigDict(extra="forbid")

    format: Literal[1] = Field(default=1, description="version of this file's layout")
    endpoint: str = Field(default="", description="the endpoint's name (empty in files of rlfleet 0.2)")
    spec: Spec = Field(description="the reward spec in force (text or dict form)")
    revision: int = Field(ge=0, description="the revision of that spec (goes up by one per swap)")
    scaler: ScalerConfig | None = Field(default=None, description="the scaler's options, if any")
    scaler_state: ScalerState | None = Field(default=None, description="the scaler's running statistics")

    @model_validator(mode="after")
    def _state_needs_scaler(self) -> EndpointState:
        if self.scaler_state is not None and self.scaler is None:
            raise ValueError("scaler_state without scaler options")
        return self


class StateDir:
    """The endpoint state files of one directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._writing = threading.Lock()  # one partial file per process: writers take turns

    def file_of(self, name: str) -> Path:
        return self.path / f"{quote(name, safe='')}.json"

    def names(self) -> list[str]:
        """The endpoints that have a state file (files being written, or of other kinds, are skipped)."""
        if not self.path.is_dir():
            return []
        found = []
        for file in sorted(self.path.iterdir()):
            if file.name.startswith(".") or file.name.endswith(PARTIAL_SUFFIX) or file.suffix != ".json":
                continue
            name = unquote(file.stem)
            if not name or self.file_of(name) != file:
                raise RewardStateError(file, "its name is not an endpoint state's ('<quoted name>.json')")
            found.append(name)
        return found

    def read(self, name: str) -> EndpointState | None:
        """Endpoint ``name``'s saved state; None without a file; :class:`RewardStateError` if it is bad."""
        file = self.file_of(name)
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise RewardStateError(file, f"cannot be read ({exc})") from exc
        if size > MAX_STATE_BYTES:
            raise RewardStateError(file, f"{size} bytes, over the {MAX_STATE_BYTES} a state file may hold")
        try:
            state = EndpointState.model_validate(json.loads(file.read_bytes()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RewardStateError(file, f"not JSON ({exc})") from exc
        except ValidationError as exc:
            reasons = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}" for e in exc.errors())
            raise RewardStateError(file, f"not an endpoint state ({reasons})") from exc
        if state.endpoint and state.endpoint != name:
            raise RewardStateError(file, f"it holds endpoint {state.endpoint!r}, not {name!r}")
        return state

    def write(self, name: str, state: EndpointState) -> bool:
        """Save ``state`` as endpoint ``name``'s, atomically; False (nothing written) when the file
        already holds a higher revision (another replica's swap)."""
        with self._writing:
            return self._write(name, state)

    def _write(self, name: str, state: EndpointState) -> bool:
        try:
            stored = self.read(name)
        except RewardStateError as exc:
            logger.warning("%s; it is replaced", exc)
            stored = None
        if stored is not None and stored.revision > state.revision:
            logger.info("endpoint %s: %s holds revision %d, not replaced by revision %d",
                        name, self.file_of(name), stored.revision, state.revision)  # fmt: skip
            return False
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomic(self.file_of(name), json.dumps(state.model_dump(mode="json"), indent=2))
        return True


def state_of(name: str, spec: Any, revision: int, scaler: Any) -> EndpointState:
    """The :class:`EndpointState` of a live endpoint (``scaler`` a RewardScaler or None)."""
    return EndpointState(
        endpoint=name, spec=spec, revision=revision,
        scaler=scaler.config if scaler is not None else None,
        scaler_state=ScalerState.model_validate(scaler.state_dict()) if scaler is not None else None,
    )  # fmt: skip
