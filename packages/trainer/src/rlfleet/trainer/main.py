"""``rlfleet-trainer serve``: start a trainer worker and join a cluster.

Started with the torchrun variables (``RANK``, ``WORLD_SIZE``...), rank 0 is the worker that
joins NATS and the other ranks follow it (see :mod:`rlfleet.trainer.service`). The config is
:class:`~rlfleet.common.schema.trainer.TrainerWorkerConfig` on every rank.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    if int(os.environ.get("RANK", "0")) > 0:
        from rlfleet.trainer.follower import follower_main

        return follower_main("rlfleet-trainer", argv)
    from rlfleet.common.control.worker import run_worker_main
    from rlfleet.common.schema.trainer import TrainerWorkerConfig
    from rlfleet.trainer.service import TrainerWorker

    return run_worker_main("rlfleet-trainer", TrainerWorkerConfig, TrainerWorker, argv)


if __name__ == "__main__":
    sys.exit(main())
