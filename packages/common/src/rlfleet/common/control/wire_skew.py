"""Releases and wire versions across the fleet: what a worker announces of its release, and what a
registry does with a worker that speaks another MAJOR wire version.

A worker's :class:`~rlfleet.common.control.messages.WorkerAnnounce` carries its package and the
package's installed version (:func:`release_of`, wire 2.4) beside the ``protocol`` every message
carries; ``rlfleet status`` shows both. A MINOR skew is served as usual. A worker of another MAJOR
version is refused at connect: its announce and heartbeats fail to decode
(:class:`~rlfleet.common.errors.ProtocolMismatch`), and the refused message's own fields say who
sent it (``ProtocolMismatch.sender``). The :class:`~rlfleet.common.control.membership.WorkerRegistry`
keeps a :class:`WireRefusal` per such worker, logs it once, tells the worker (:func:`tell_refused`: a
message on the worker's own subject, which the worker refuses in turn, naming both versions in its
own log), and ``wait_for`` raises :class:`WorkerWireRefused` at once instead of waiting for a worker
that can never join. tests/compat runs the previous release of each tier against this code.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
from dataclasses import dataclass

from rlfleet.common.control.messages import ErrorReply
from rlfleet.common.control.transport import Transport, worker_subject
from rlfleet.common.errors import ProtocolMismatch

logger = logging.getLogger(__name__)


@functools.cache
def installed_version(package: str) -> str:
    """The installed version of ``package`` ('' when it is not installed as a distribution)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def release_of(tier: str) -> dict[str, str]:
    """A tier worker's announce fields for its release: ``rlfleet-<tier>`` and its version."""
    package = f"rlfleet-{tier}"
    return {"package": package, "package_version": installed_version(package)}


@dataclass(frozen=True)
class WireRefusal:
    """A worker refused for speaking another MAJOR wire version (what its refused message said)."""

    tier: str
    worker_id: str
    protocol: str
    pool: str = ""
    package: str = ""
    package_version: str = ""
    host: str = ""

    @classmethod
    def of(cls, tier: str, exc: ProtocolMismatch) -> WireRefusal | None:
        """The refusal of the worker that sent a message on ``tier``'s membership subject; None when
        the message does not name a worker of that tier."""
        sender = exc.sender
        worker_id = sender.get("worker_id", "")
        if sender.get("tier") != tier or not worker_id:
            return None
        return cls(tier, worker_id, str(exc.theirs)[:32], sender.get("pool", ""), sender.get("package", ""),
                   sender.get("package_version", ""), sender.get("host", ""))  # fmt: skip

    def describe(self) -> str:
        """``rollout worker rollout-0 (rlfleet-rollout 0.1.0 on host-a) speaks wire protocol 3.0``."""
        release = " ".join(part for part in (self.package, self.package_version) if part)
        where = f" on {self.host}" if self.host else ""
        return (f"{self.tier} worker {self.worker_id} ({release or 'release not announced'}{where}) "
                f"speaks wire protocol {self.protocol}")  # fmt: skip


class WorkerWireRefused(ProtocolMismatch):
    """A worker was refused at connect: it speaks another MAJOR wire version than this process."""

    def __init__(self, refusal: WireRefusal, ours: str) -> None:
        self.ours, self.theirs, self.refusal = ours, refusal.protocol, refusal
        self.sender = {"tier": refusal.tier, "worker_id": refusal.worker_id}
        common = installed_version("rlfleet-common")
        us = f"this process (rlfleet-common {common})" if common else "this process"
        super(ProtocolMismatch, self).__init__(
            f"{refusal.describe()}, but {us} speaks wire protocol {ours}: MAJOR versions must match, so "
            "it was refused at connect; run releases of the same MAJOR wire version on every tier "
            "(upgrade the older side)"
        )


async def tell_refused(transport: Transport, cluster: str, refusal: WireRefusal, ours: str) -> None:
    """Send the refused worker a message on its own subject: it cannot read it (another MAJOR
    version), and its log says so, naming both versions. Never raises: a worker id that is no
    subject token, or a connection that cannot send, is only logged."""
    try:
        subject = worker_subject(cluster, refusal.tier, refusal.worker_id)
        notice = ErrorReply(tier="controller", code="protocol_mismatch",
                            message=str(WorkerWireRefused(refusal, ours)))  # fmt: skip
        await transport.publish(subject, notice)
        await transport.flush()
    except (ValueError, ConnectionError, OSError, RuntimeError) as exc:
        logger.debug("could not tell %s worker %r of its refusal: %s", refusal.tier, refusal.worker_id, exc)
