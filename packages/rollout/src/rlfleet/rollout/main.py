"""``rlfleet-rollout serve``: start a rollout worker and join a cluster (or a running job).

``--model PATH`` is short for the override ``model_path=PATH``; the other flags (``--nats``,
``--nats-user``/``--nats-creds``/``--nats-ca``... (passwords and tokens from ``RLFLEET_NATS_*``),
``--cluster``, ``--worker-id``, ``--pool``, ``--config``) are every worker's (see
:func:`rlfleet.common.control.worker.parse_service_args`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def model_flag_to_override(argv: Sequence[str]) -> list[str]:
    """Rewrite ``--model PATH`` / ``--model=PATH`` into a trailing ``model_path=PATH`` override."""
    out: list[str] = []
    extra: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--model" and i + 1 < len(args):
            extra.append(f"model_path={args[i + 1]}")
            i += 2
            continue
        if arg.startswith("--model="):
            extra.append(f"model_path={arg.removeprefix('--model=')}")
        else:
            out.append(arg)
        i += 1
    return out + extra


def main(argv: Sequence[str] | None = None) -> int:
    from rlfleet.common.control.worker import run_worker_main
    from rlfleet.common.schema.rollout import RolloutWorkerConfig
    from rlfleet.rollout.service import RolloutWorker

    args = model_flag_to_override(sys.argv[1:] if argv is None else argv)
    return run_worker_main("rlfleet-rollout", RolloutWorkerConfig, RolloutWorker, args)


if __name__ == "__main__":
    sys.exit(main())
