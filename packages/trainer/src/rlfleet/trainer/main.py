"""``rlfleet-trainer serve``: start a trainer worker and join a cluster."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from rlfleet.common.service import run_worker_main
    from rlfleet.trainer.service import TrainerServiceConfig, TrainerWorker

    return run_worker_main("rlfleet-trainer", TrainerServiceConfig, TrainerWorker, argv)


if __name__ == "__main__":
    sys.exit(main())
