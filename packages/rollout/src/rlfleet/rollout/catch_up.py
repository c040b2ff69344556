"""Late join: a rollout worker loads the trainer's current weights before it announces itself.

The trainer answers ``rlfleet.<cluster>.trainer.latest`` with the :class:`WeightsPublished` of
its current version; the worker pulls those buckets from the trainer's TensorStore exactly as for
a regular publish (a LoRA run's adapter, applied to the base the worker loaded from disk: base
plus the current adapter). Before the first publish (or with no trainer running yet, as when the embedded
launcher starts the tiers together) the model on disk is the current version and nothing is loaded.
A publish may delete the buckets while the worker fetches them: it then asks again. A version
shared only by CUDA IPC with another GPU cannot be loaded here: the worker joins at the version it
holds, and the controller, which now sees it, stages gRPC buckets too from the next publish on.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from rlfleet.common.control.messages import LatestWeights, LoadWeights, WeightsLoaded, WeightsPublished
from rlfleet.common.control.transport import Transport, subject
from rlfleet.common.errors import NoResponders, RequestTimeout, TensorError
from rlfleet.rollout.errors import NoUsableCarrier

logger = logging.getLogger(__name__)

Loader = Callable[[LoadWeights], Awaitable[WeightsLoaded]]


async def latest_weights(
    transport: Transport, cluster: str, worker_id: str, timeout: float
) -> WeightsPublished | None:
    """The trainer's current version and buckets; None when no trainer answers."""
    try:
        reply = await transport.request(
            subject(cluster, "trainer", "latest"), LatestWeights(worker_id=worker_id), timeout=timeout,
            tier="trainer",
        )  # fmt: skip
    except (NoResponders, RequestTimeout) as exc:
        logger.info("no trainer answered the latest-weights request (%s); serving the model on disk", exc)
        return None
    if not isinstance(reply, WeightsPublished):
        raise TypeError(f"trainer.latest replied {reply.kind!r}, expected 'trainer.published'")
    return reply


async def catch_up(
    transport: Transport,
    cluster: str,
    worker_id: str,
    current: int,
    load: Loader,
    *,
    timeout: float = 10.0,
    attempts: int = 3,
) -> int:
    """Load the trainer's latest weights unless already at that version; returns the version held.

    Raises the last fetch error when every attempt met a bucket deleted by a newer publish.
    """  # fmt: skip
    for attempt in range(1, attempts + 1):
        latest = await latest_weights(transport, cluster, worker_id, timeout)
        if latest is None or latest.weight_version == current or not (latest.buckets or latest.ipc_buckets):
            return current
        message = LoadWeights(weight_version=latest.weight_version, buckets=latest.buckets,
                              ipc_buckets=latest.ipc_buckets, adapter=latest.adapter)  # fmt: skip
        try:
            loaded = await load(message)
        except NoUsableCarrier as exc:  # shared by CUDA IPC with another GPU: wait for the next publish
            logger.warning("%s; joining at version %d, the controller admits this worker after the next "
                           "publish", exc, current)  # fmt: skip
            return current
        except (TensorError, ConnectionError) as exc:
            if attempt == attempts:
                raise
            logger.warning("catching up to version %d failed (%s); asking again", latest.weight_version, exc)
            continue
        logger.info("caught up to weight version %d before joining", loaded.weight_version)
        return loaded.weight_version
    return current
