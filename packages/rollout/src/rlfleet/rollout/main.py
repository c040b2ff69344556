"""``rlfleet-rollout serve``: start a rollout worker and join a cluster (or a running job)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from rlfleet.common.service import run_worker_main
    from rlfleet.rollout.service import RolloutServiceConfig, RolloutWorker

    return run_worker_main("rlfleet-rollout", RolloutServiceConfig, RolloutWorker, argv)


if __name__ == "__main__":
    sys.exit(main())
