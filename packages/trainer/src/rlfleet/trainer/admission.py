"""``trainer.configure``: whether a trainer may take a run, its fixed settings against the run's.

A run's fixed settings (:class:`~rlfleet.common.schema.trainer.ModelSettings`, the device, whether
it trains a critic, the model's fingerprint) cannot change once the models are built, so a trainer
whose own differ refuses the run with a
:class:`~rlfleet.trainer.errors.SettingsConflict` that names each field and both values.
"""

from __future__ import annotations

from rlfleet.common.control.messages import TrainerConfigure
from rlfleet.common.schema.trainer import TrainerWorkerConfig, resolve_precision


def conflicts(
    request: TrainerConfigure,
    config: TrainerWorkerConfig,
    *,
    device: str,
    fingerprint: str,
    holds_critic: bool,
) -> list[tuple[str, str, str]]:
    """``(field, run's value, worker's value)`` for every fixed setting the run asks otherwise.

    ``device`` is the device type the worker's models are on, ``fingerprint`` the hash of its
    model's ``config.json`` (empty: unknown), ``holds_critic`` whether it built a critic. ``auto``
    devices and precisions compare as what they resolve to on that device (a precision that
    differs only through the device is the device's conflict); the model is compared by
    fingerprint when both sides have one.
    """
    mine = config.model
    run_device = device if request.device == "auto" else request.device
    found = [(name, repr(run), repr(ours)) for name, (run, ours) in request.model.conflicts(mine).items()
             if name != "mixed_precision"]  # fmt: skip
    theirs, ours = request.model.mixed_precision, mine.mixed_precision
    if resolve_precision(theirs, device) != resolve_precision(ours, device):  # as they run here
        resolved = f" ({resolve_precision(ours, device)} on {device})" if ours == "auto" else ""
        found.append(("mixed_precision", repr(theirs), f"{ours!r}{resolved}"))
    if run_device != device:
        ours_device = config.placement.device
        auto = f" ({device})" if ours_device == "auto" else ""
        found.append(("device", repr(request.device), f"{ours_device!r}{auto}"))
    if request.model_fingerprint and fingerprint and request.model_fingerprint != fingerprint:
        found.append(("model", f"fingerprint {request.model_fingerprint}",
                      f"fingerprint {fingerprint} ({config.model_path})"))  # fmt: skip
    if request.critic != holds_critic:
        found.append(("critic", "trains one" if request.critic else "trains none",
                      f"holds {'one' if holds_critic else 'none'} "
                      f"(algorithm {config.step.algorithm.name})"))  # fmt: skip
    return found
