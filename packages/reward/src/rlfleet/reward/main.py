"""``rlfleet-reward serve``: start a reward worker and join a cluster."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from rlfleet.common.service import run_worker_main
    from rlfleet.reward.service import RewardServiceConfig, RewardWorker

    return run_worker_main("rlfleet-reward", RewardServiceConfig, RewardWorker, argv)


if __name__ == "__main__":
    sys.exit(main())
