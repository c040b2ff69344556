"""``rlfleet-reward admin``: operators hot-swap rewards and read statistics over NATS.

::

    rlfleet-reward admin --nats nats://host:4222 --cluster shared stats
    rlfleet-reward admin ... set-spec team-a/helpful "0.5*rm:path=/models/rm-v2 + 0.5*concise"
    rlfleet-reward admin ... set-model team-a/helpful /models/rm-v3 [--component rm]

The token comes from ``--token`` or ``$RLFLEET_REWARD_TOKEN`` (the admin token, or a tenant's for
its own endpoints). Every reward worker of the cluster gets the message on its own subject (all
replicas swap together); each reply is printed as one JSON line. Exit code 0 when every worker
accepted, 1 when one refused or failed, 2 when no reward worker answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence

from rlfleet.common.control.messages import Message, RewardStatsRequest, SetRewardSpec
from rlfleet.common.control.transport import TOKEN_HEADER
from rlfleet.common.control.worker import add_nats_arguments, connection_from_args
from rlfleet.common.errors import RemoteError, RequestTimeout
from rlfleet.common.schema.connection import NatsConnection

TOKEN_ENV = "RLFLEET_REWARD_TOKEN"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlfleet-reward admin", description="operate a reward server")
    parser.add_argument("--nats", default="nats://127.0.0.1:4222", help="NATS URL of the reward server")
    parser.add_argument("--cluster", default="default", help="the reward server's cluster name")
    parser.add_argument("--token", default=None, help=f"admin or tenant token (default: ${TOKEN_ENV})")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each reply")
    add_nats_arguments(parser)  # --nats-user, --nats-ca ...; the password from $RLFLEET_NATS_PASSWORD
    sub = parser.add_subparsers(dest="action", required=True)
    stats = sub.add_parser("stats", help="print endpoint statistics")
    stats.add_argument("endpoint", nargs="?", default="", help="one endpoint (default: all visible)")
    spec = sub.add_parser("set-spec", help="hot-swap an endpoint's reward spec")
    spec.add_argument("endpoint")
    spec.add_argument("spec", help="reward spec, text form (or JSON of the dict form)")
    spec.add_argument(
        "--scaler", default=None, help='RewardScaler options as JSON, e.g. {"temperature": 0.7}'
    )
    model = sub.add_parser("set-model", help="point an endpoint's rm component at another model directory")
    model.add_argument("endpoint")
    model.add_argument("path")
    model.add_argument("--component", default=None, help="label of the rm component, when there are several")
    return parser


def message_for(args: argparse.Namespace) -> Message:
    """The control message an admin command sends."""
    if args.action == "stats":
        return RewardStatsRequest(endpoint=args.endpoint)
    if args.action == "set-spec":
        spec = json.loads(args.spec) if args.spec.lstrip().startswith("{") else args.spec
        scaler = json.loads(args.scaler) if args.scaler else None
        return SetRewardSpec(endpoint=args.endpoint, spec=spec, scaler=scaler)
    return SetRewardSpec(endpoint=args.endpoint, model_path=os.path.abspath(args.path),
                         component=args.component)  # fmt: skip


async def send_to_all(
    url: str, cluster: str, message: Message, timeout: float, token: str = "",
    auth: NatsConnection | None = None,
) -> int:  # fmt: skip
    """Send ``message`` (``token`` in its ``Rlfleet-Token`` header) to every reward worker of ``cluster``;
    print the replies; return the exit code."""
    from rlfleet.common.control.membership import WorkerRegistry
    from rlfleet.common.control.nats_transport import NatsTransport

    transport = await NatsTransport.connect(url, name="rlfleet-reward-admin", tier="controller", auth=auth)
    registry = WorkerRegistry(transport, cluster)
    code = 0
    try:
        await registry.start()
        try:
            workers = await registry.wait_for("reward", 1, timeout=min(timeout, 10.0))
        except TimeoutError as exc:
            print(f"rlfleet-reward admin: {exc}", file=sys.stderr)
            return 2
        await asyncio.sleep(0.2)  # let the other replicas' announces in
        for worker in registry.workers("reward") or workers:
            try:
                headers = {TOKEN_HEADER: token} if token else None
                reply = await transport.request(worker.subject, message, timeout=timeout, tier="reward",
                                                headers=headers)  # fmt: skip
                print(json.dumps({"worker": worker.worker_id, **reply.model_dump(mode="json")}))
            except (RemoteError, RequestTimeout, ConnectionError) as exc:
                print(json.dumps({"worker": worker.worker_id, "error": str(exc)}))
                code = 1
    finally:
        await registry.stop()
        await transport.close()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV, "")
    try:
        message = message_for(args)
        auth = connection_from_args(args)
    except (ValueError, json.JSONDecodeError) as exc:
        print(f"rlfleet-reward admin: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(send_to_all(args.nats, args.cluster, message, args.timeout, token, auth))
