"""The ``rlfleet-reward`` console script: ``serve`` starts a reward worker, ``admin`` operates one.

::

    rlfleet-reward serve --config reward.yaml [--nats URL] [key=value ...]
    rlfleet-reward admin --nats URL --cluster NAME {stats,set-spec,set-model,score} ...

Exit codes: 0 done; 2 the settings cannot work (a config error, a spec that does not build, a token
variable that is unset or too short), said in one line; 1 a runtime failure (NATS unreachable...),
also one line. Heavy modules load only when a command needs them, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys
from collections.abc import Sequence

PROG = "rlfleet-reward"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: it only names the two commands; each parses its own arguments."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="rlfleet's reward service: serve rule rewards, reward models and environments to "
        "tenants over NATS, and operate a running server.",
        epilog="'rlfleet-reward serve --help' and 'rlfleet-reward admin --help' list each command's options; "
        "'rlfleet-reward admin ACTION --help' each admin action's.",
    )
    version = importlib.metadata.version(PROG)
    parser.add_argument("--version", action="version", version=f"{PROG} {version}")
    sub = parser.add_subparsers(dest="command", metavar="{serve,admin}", required=True)
    for name, text in (
        ("serve", "start a reward worker and join a cluster (--config FILE, --nats URL, a.b=value ...)"),
        ("admin", "operate a running reward server: stats, set-spec, set-model, score (a smoke test)"),
    ):
        command = sub.add_parser(name, help=text, add_help=False)
        command.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["admin"]:
        from rlfleet.reward.admin import main as admin_main

        return admin_main(args[1:])
    if args[:1] != ["serve"]:
        build_parser().parse_args(args)  # --help, --version, or a usage error (exit 2)
        return 2
    return serve_main(args)


def serve_main(args: list[str]) -> int:
    """``rlfleet-reward serve ...``; a failure to reach NATS (or the quota store) is one line, exit 1."""
    # Reward models load from local directories only; never let transformers reach for a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from rlfleet.common.control.worker import run_worker_main
    from rlfleet.common.errors import Failure
    from rlfleet.common.schema.reward import RewardWorkerConfig
    from rlfleet.reward.service import RewardWorker

    try:
        return run_worker_main(PROG, RewardWorkerConfig, RewardWorker, args)
    except Failure as exc:
        print(f"{PROG}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
