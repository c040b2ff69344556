"""``rlfleet-trainer serve``: start a trainer worker and join a cluster.

Started with the torchrun variables (``RANK``, ``WORLD_SIZE``...), rank 0 is the worker that
joins NATS and the other ranks follow it (see :mod:`rlfleet.trainer.ranks`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    if int(os.environ.get("RANK", "0")) > 0:
        from rlfleet.trainer.ranks import follower_main

        return follower_main("rlfleet-trainer", argv)
    from rlfleet.common.service import run_worker_main
    from rlfleet.trainer.service import TrainerServiceConfig, TrainerWorker

    return run_worker_main("rlfleet-trainer", TrainerServiceConfig, TrainerWorker, argv)


if __name__ == "__main__":
    sys.exit(main())
