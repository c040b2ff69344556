"""``rlfleet-reward admin``: operators hot-swap rewards, read statistics and smoke-test endpoints over NATS.

::

    rlfleet-reward admin --nats nats://host:4222 --cluster shared stats
    rlfleet-reward admin ... set-spec team-a/helpful "0.5*rm:path=/models/rm-v2 + 0.5*concise"
    rlfleet-reward admin ... set-model team-a/helpful /models/rm-v3 [--component rm]
    rlfleet-reward admin ... score team-a/helpful --prompt "2+2?" --response "4" --response "five"

The token comes from ``--token`` or ``$RLFLEET_REWARD_TOKEN`` (the admin token, or a tenant's for
its own endpoints). ``stats``, ``set-spec`` and ``set-model`` go to every reward worker of the
cluster on its own subject (all replicas swap together); each reply is printed as one JSON line on
stdout, each refusal as one line on stderr naming the worker and the server's reason.

``score`` serves the texts from a TensorStore of its own (on ``--store-host``, which the reward
server must be able to reach: the server fetches rollout texts from the store a request names, as
it does from a rollout worker's) and sends one score request, to one worker's own subject or, with
``--queue``, through the ``reward.score`` queue group as a training run does (a tenant's NATS user
may publish only there). It prints one line per response: its score, its components, its text.

Exit codes: 0 every worker accepted; 1 one refused or failed (its reason on stderr, one line);
2 the command cannot work: bad arguments, NATS unreachable, no reward worker answered.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlfleet.common.control.messages import (
    Message,
    RewardStatsRequest,
    ScoreRequest,
    ScoreResult,
    SetRewardSpec,
)
from rlfleet.common.control.transport import TOKEN_ENV, TOKEN_HEADER, subject
from rlfleet.common.control.worker import add_nats_arguments, connection_from_args
from rlfleet.common.errors import NatsServerError, NoResponders, RemoteError, RequestTimeout, TransportClosed
from rlfleet.common.schema.connection import NatsConnection

if TYPE_CHECKING:
    from rlfleet.common.control.nats_transport import NatsTransport

PROG = "rlfleet-reward admin"
REFUSED, UNUSABLE = 1, 2
"""Exit codes: a worker refused or failed; the command cannot work (arguments, NATS, no worker)."""


class AdminUsageError(ValueError):
    """The command's arguments cannot work (exit 2, one line)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="operate a running reward server: statistics, hot swaps, smoke tests",
        epilog="exit codes: 0 accepted; 1 a worker refused or failed (its reason on stderr); "
        "2 bad arguments, NATS unreachable or no reward worker answered",
    )  # fmt: skip
    parser.add_argument("--nats", default="nats://127.0.0.1:4222", help="NATS URL of the reward server")
    parser.add_argument("--cluster", default="default", help="the reward server's cluster name")
    parser.add_argument("--token", default=None, help=f"admin or tenant token (default: ${TOKEN_ENV})")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each reply")
    add_nats_arguments(parser)  # --nats-user, --nats-ca ...; the password from $RLFLEET_NATS_PASSWORD
    sub = parser.add_subparsers(dest="action", required=True, metavar="{stats,set-spec,set-model,score}")
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
    add_score_parser(sub)
    return parser


def add_score_parser(sub: Any) -> None:
    score = sub.add_parser(
        "score", help="score plain texts on an endpoint (a smoke test) and print the scores",
        description="Score responses to prompts on ENDPOINT and print each score. One --prompt with "
        "several --response: one group; as many --prompt as --response: one pair each.",
    )  # fmt: skip
    score.add_argument("endpoint")
    score.add_argument("--prompt", action="append", required=True, help="a prompt (repeat: one per response)")
    score.add_argument("--response", action="append", required=True, help="a response to score (repeatable)")
    score.add_argument("--metadata", default=None,
                       help='JSON object given to every prompt (e.g. {"answer": "4"}), or a list, one per '
                       "prompt")  # fmt: skip
    score.add_argument("--store-host", default="127.0.0.1",
                       help="where the texts are served from to the reward server (bind address; it must "
                       "reach it)")  # fmt: skip
    score.add_argument("--advertise-host", default="", help="the name the reward server dials (default: the "
                       "bind address)")  # fmt: skip
    score.add_argument("--queue", action="store_true",
                       help="send through the reward.score queue group (a tenant's NATS user may publish "
                       "only there) instead of to one worker")  # fmt: skip
    score.add_argument("--json", action="store_true", help="print the reply as one JSON line instead")


def message_for(args: argparse.Namespace) -> Message:
    """The control message ``stats``, ``set-spec`` and ``set-model`` send."""
    if args.action == "stats":
        return RewardStatsRequest(endpoint=args.endpoint)
    if args.action == "set-spec":
        spec = json.loads(args.spec) if args.spec.lstrip().startswith("{") else args.spec
        scaler = json.loads(args.scaler) if args.scaler else None
        return SetRewardSpec(endpoint=args.endpoint, spec=spec, scaler=scaler)
    return SetRewardSpec(endpoint=args.endpoint, model_path=os.path.abspath(args.path),
                         component=args.component)  # fmt: skip


def score_rows(args: argparse.Namespace) -> tuple[list[str], list[str], list[int], list[dict[str, Any]]]:
    """``(prompts, responses, group_index, metadata per group)`` of ``score``'s arguments."""
    prompts, responses = list(args.prompt), list(args.response)
    if len(prompts) == 1:
        prompts, groups = prompts * len(responses), [0] * len(responses)
    elif len(prompts) == len(responses):
        groups = list(range(len(prompts)))
    else:
        raise AdminUsageError(f"{len(prompts)} --prompt for {len(responses)} --response: give one prompt "
                              "for all responses, or one per response")  # fmt: skip
    count = max(groups) + 1
    meta = json.loads(args.metadata) if args.metadata else {}
    if isinstance(meta, dict):
        metadata = [dict(meta) for _ in range(count)]
    elif isinstance(meta, list) and len(meta) == count and all(isinstance(m, dict) for m in meta):
        metadata = meta
    else:
        raise AdminUsageError(f"--metadata must be a JSON object or a list of {count} objects (one per "
                              "prompt)")  # fmt: skip
    return prompts, responses, groups, metadata


def one_line(text: object) -> str:
    return " ".join(str(text).split())


async def connect(url: str, auth: NatsConnection | None) -> NatsTransport:
    from rlfleet.common.control.nats_transport import NatsTransport

    return await NatsTransport.connect(url, name="rlfleet-reward-admin", tier="controller", auth=auth)


async def send_to_all(
    url: str, cluster: str, message: Message, timeout: float, token: str = "",
    auth: NatsConnection | None = None,
) -> int:  # fmt: skip
    """Send ``message`` (``token`` in its ``Rlfleet-Token`` header) to every reward worker of ``cluster``;
    print the replies (refusals on stderr, one line each); return the exit code."""
    from rlfleet.common.control.membership import WorkerRegistry

    transport = await connect(url, auth)
    registry = WorkerRegistry(transport, cluster)
    code = 0
    try:
        await registry.start()
        try:
            workers = await registry.wait_for("reward", 1, timeout=min(timeout, 10.0))
        except TimeoutError as exc:
            print(f"{PROG}: {one_line(exc)}", file=sys.stderr)
            return UNUSABLE
        await asyncio.sleep(0.2)  # let the other replicas' announces in
        for worker in registry.workers("reward") or workers:
            try:
                headers = {TOKEN_HEADER: token} if token else None
                reply = await transport.request(worker.subject, message, timeout=timeout, tier="reward",
                                                headers=headers)  # fmt: skip
                print(json.dumps({"worker": worker.worker_id, **reply.model_dump(mode="json")}))
            except (RemoteError, RequestTimeout, ConnectionError) as exc:
                print(f"{PROG}: {worker.worker_id} refused {message.kind}: {one_line(exc)}", file=sys.stderr)
                code = REFUSED
    finally:
        await registry.stop()
        await transport.close()
    return code


async def score(args: argparse.Namespace, token: str, auth: NatsConnection | None) -> int:
    """Serve ``score``'s texts from a TensorStore of its own, ask the reward server to score them, print.

    The texts are numpy arrays (the wire carries the same bytes as torch's): no torch needed.
    """
    import numpy as np

    from rlfleet.common.schema.batch import pack_texts
    from rlfleet.common.tensors.server import TensorStoreServer

    prompts, responses, groups, metadata = score_rows(args)
    tensors = {"group_index": np.asarray(groups, dtype=np.int64)}
    tensors["prompt_text"], tensors["prompt_text_offsets"] = pack_texts(prompts, arrays="numpy")
    tensors["response_text"], tensors["response_text_offsets"] = pack_texts(responses, arrays="numpy")
    store = TensorStoreServer(capacity_bytes=64 << 20, ttl_s=max(60.0, args.timeout))
    try:
        await store.start(host=args.store_host, advertise_host=args.advertise_host)
    except OSError as exc:  # the bind failed
        where = f"--store-host {args.store_host}"
        raise AdminUsageError(f"cannot serve the texts on {where}: {one_line(exc)}") from exc
    try:
        job_id = f"admin-score-{uuid.uuid4().hex[:12]}"
        ref = store.put_local(job_id, tensors)
        request = ScoreRequest(job_id=job_id, endpoint=args.endpoint, rollout=ref, metadata=metadata,
                               deadline=time.time() + args.timeout)  # fmt: skip
        reply = await _send_score(args, request, token, auth)
    finally:
        await store.stop()
    if reply is None:
        return UNUSABLE
    if isinstance(reply, str):
        print(f"{PROG}: {reply}", file=sys.stderr)
        return REFUSED
    print_scores(reply, responses, as_json=args.json)
    return 0


async def _send_score(
    args: argparse.Namespace, request: ScoreRequest, token: str, auth: NatsConnection | None
) -> ScoreResult | str | None:
    """The reply to ``request``; a refusal as one line; None (said on stderr) when nobody answered."""
    from rlfleet.common.control.membership import WorkerRegistry

    headers = {TOKEN_HEADER: token} if token else None
    transport = await connect(args.nats, auth)
    try:
        if args.queue:
            where, who = subject(args.cluster, "reward", "score"), "the reward.score queue group"
        else:
            registry = WorkerRegistry(transport, args.cluster)
            await registry.start()
            try:
                (worker, *_) = await registry.wait_for("reward", 1, timeout=min(args.timeout, 10.0))
            except TimeoutError as exc:
                print(f"{PROG}: {one_line(exc)}", file=sys.stderr)
                return None
            finally:
                await registry.stop()
            where, who = worker.subject, worker.worker_id
        try:
            reply = await transport.request(where, request, timeout=args.timeout, tier="reward",
                                            headers=headers)  # fmt: skip
        except NoResponders:
            print(f"{PROG}: no reward worker answered on {where} (is the server up, on cluster "
                  f"{args.cluster!r}?)", file=sys.stderr)  # fmt: skip
            return None
        except (RemoteError, RequestTimeout, ConnectionError) as exc:
            return f"{who} refused {request.kind} on {args.endpoint!r}: {one_line(exc)}"
    finally:
        await transport.close()
    if not isinstance(reply, ScoreResult):
        return f"{who} answered {reply.kind}, not a score result"
    return reply


def print_scores(result: ScoreResult, responses: Sequence[str], *, as_json: bool) -> None:
    """One line per response: score, components, text (cut at 60 characters); or the reply as JSON."""
    if as_json:
        print(json.dumps(result.model_dump(mode="json")))
        return
    print(f"endpoint {result.endpoint} (version {result.spec_version}): {len(result.scores)} score(s)")
    for i, (value, text) in enumerate(zip(result.scores, responses, strict=True)):
        parts = " ".join(f"{label}={scores[i]:.4f}" for label, scores in result.components.items())
        shown = one_line(text)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        print(f"{value:10.4f}  {parts}  {shown!r}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The transport's reconnect warnings are noise to a one-shot command: its outcome is one line.
    logging.basicConfig(level=logging.ERROR, format=f"{PROG}: %(levelname)s %(name)s: %(message)s")
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV, "")
    try:
        auth = connection_from_args(args)
        if args.action == "score":
            return asyncio.run(score(args, token, auth))
        message = message_for(args)
        return asyncio.run(send_to_all(args.nats, args.cluster, message, args.timeout, token, auth))
    except (ValueError, NatsServerError, TransportClosed) as exc:  # JSON, pydantic, usage; NATS unreachable
        print(f"{PROG}: {one_line(exc)}", file=sys.stderr)
        return UNUSABLE
