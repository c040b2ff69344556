"""``rlfleet-reward serve --config FILE`` starts a reward worker, ``rlfleet-reward admin`` operates one."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["admin"]:
        from rlfleet.reward.admin import main as admin_main

        return admin_main(args[1:])
    # Reward models load from local directories only; never let transformers reach for a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rlfleet.common.control.worker import run_worker_main
    from rlfleet.common.schema.reward import RewardWorkerConfig
    from rlfleet.reward.service import RewardWorker

    return run_worker_main("rlfleet-reward", RewardWorkerConfig, RewardWorker, args)


if __name__ == "__main__":
    sys.exit(main())
