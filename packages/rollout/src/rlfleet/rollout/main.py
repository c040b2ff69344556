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


MODEL_HELP = """
rollout worker options:
  --model PATH          the model to serve: a local HF folder or a Hub id (short for the override
                        model_path=PATH); a worker that joins a run must serve the run's model
  (settings as overrides: rollout.engine=vllm, rollout.max_batch_size=32, placement.device=cuda, capacity=2;
  a worker config file holds the same keys: --config FILE)"""


def wants_help(argv: Sequence[str]) -> bool:
    """Whether ``argv`` asks for ``serve``'s help (``serve -h`` / ``serve --help``)."""
    return "serve" in argv and any(arg in ("-h", "--help") for arg in argv)


def main(argv: Sequence[str] | None = None) -> int:
    from rlfleet.common.control.worker import parse_service_args, run_worker_main

    raw = list(sys.argv[1:] if argv is None else argv)
    if wants_help(raw):  # the shared serve parser prints its options and exits; --model is this tier's
        try:
            parse_service_args("rlfleet-rollout", raw)
        finally:
            print(MODEL_HELP)
    from rlfleet.common.schema.rollout import RolloutWorkerConfig
    from rlfleet.rollout.service import RolloutWorker

    args = model_flag_to_override(raw)
    return run_worker_main("rlfleet-rollout", RolloutWorkerConfig, RolloutWorker, args)


if __name__ == "__main__":
    sys.exit(main())
