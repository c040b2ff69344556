"""The reward tier's worker: scores rollout batches pulled straight from the rollout workers' stores.

Subjects (``rlfleet.<cluster>.reward.*``)::

    reward.score            queue group "reward": ScoreRequest -> ScoreResult (N workers share the load)
    reward.worker.<id>      this worker alone: SetRewardSpec -> RewardSpecSet (hot swap),
                            RewardStatsRequest -> RewardStats, ScoreRequest, Shutdown

Every request names an endpoint and carries a token in its ``Rlfleet-Token`` header
(:data:`rlfleet.common.control.transport.TOKEN_HEADER`; a message's own ``token`` field, which clients of
protocol 1.1 filled, is read when the header is absent). With tenants in the
config, the token says who is asking (:mod:`rlfleet.reward.tenants`): a tenant scores and reads
statistics only on its own endpoints, within its quota (rate and concurrency, on every request;
the rate counted in a bucket all replicas share, :mod:`rlfleet.reward.quota_store`),
fetches texts only from its own ``stores``, hot-swaps only its own endpoints (with ``can_update``)
and only to specs that load no code (:meth:`TenantTable.check_spec`); only the admin token may
shut a shared server down. The admin token may do anything, including creating endpoints.
Without tenants the server is open.
Hot swaps and versions are :mod:`rlfleet.reward.endpoints`' business: a request finishes on the
version it started with, and its :class:`ScoreResult` names that version.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import TYPE_CHECKING, Any

from rlfleet.common.control.messages import (
    AnyMessage,
    RewardSpecSet,
    RewardStats,
    RewardStatsRequest,
    ScoreRequest,
    ScoreResult,
    SetRewardSpec,
    Shutdown,
)
from rlfleet.common.control.reply_cache import ReplyCache
from rlfleet.common.control.transport import TOKEN_HEADER, request_headers, subject
from rlfleet.common.control.worker import Worker
from rlfleet.common.errors import WrongMessageKind
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.reward import RewardWorkerConfig
from rlfleet.reward.endpoints import Endpoints, EndpointVersion
from rlfleet.reward.errors import ForbiddenOperation
from rlfleet.reward.loading import allow_remote_code
from rlfleet.reward.quota_store import open_quotas
from rlfleet.reward.registry import parse_reward_spec
from rlfleet.reward.tenants import Tenant, TenantTable

if TYPE_CHECKING:
    from rlfleet.common.tensors.client import ClientPool

logger = logging.getLogger(__name__)

TEXT_TENSORS = ["prompt_text", "prompt_text_offsets", "response_text", "response_text_offsets", "group_index"]
MAX_STORE_CLIENTS = 64
"""Store connections kept open at once (the least recently used one closes past it)."""


def credential(message: AnyMessage) -> str:
    """The token a request carries: its ``Rlfleet-Token`` header, else its body's ``token`` (protocol 1.1)."""
    return request_headers().get(TOKEN_HEADER) or str(getattr(message, "token", "") or "")


class RewardWorker(Worker[RewardWorkerConfig]):
    """Serves ``reward.score`` for its endpoints, to the tenants allowed on each."""

    tier = "reward"

    async def setup(self) -> None:
        cfg = self.config
        self.tenants = TenantTable(cfg.tenants, admin=cfg.admin, allowed_modules=cfg.allowed_modules,
                                   max_concurrency=cfg.max_concurrency,
                                   quotas=await open_quotas(cfg, self.transport))  # fmt: skip
        allow_remote_code(cfg.loading.trust_remote_code)  # the server's own setting, never a tenant's
        self.endpoints = Endpoints(cfg.state_dir)
        await self.endpoints.start(cfg.endpoints)
        self._stores: ClientPool | None = None  # made on the first fetch (the tensor plane imports torch)
        self.replies = ReplyCache()  # a repeated score (same tenant, job id and request): its first reply
        self._saver: asyncio.Task[None] | None = None
        if cfg.state_dir:
            self._saver = asyncio.create_task(self._save_periodically(), name="reward-state-saver")
        verb = subject(cfg.fleet.cluster, "reward", "score")
        await self.subscribe(verb, self._on_score, queue="reward", max_concurrency=cfg.max_concurrency)
        if self.tenants.open:
            logger.warning("no tenants configured: every request is accepted (open server)")
        else:
            logger.info("tenants: %s", ", ".join(t.name for t in self.tenants.tenants))
            for t in self.tenants.tenants:
                if not t.config.stores:
                    logger.warning("tenant %s has no stores: its requests may name any TensorStore", t.name)

    def announce_fields(self) -> dict[str, object]:
        # Announces are seen by anyone on the cluster: endpoint names are listed only on an open server.
        endpoints = ",".join(self.endpoints.names()) if self.tenants.open else ""
        return {"capacity": self.config.max_concurrency, "model_id": endpoints}

    async def _on_own(self, message: AnyMessage) -> AnyMessage | None:
        # Shutdown is the base class's business, but on a shared server only the admin may ask for it.
        if isinstance(message, Shutdown) and not self.tenants.is_admin(credential(message)):
            tenant = self.tenants.identify(credential(message), "shut the reward server down")
            who = tenant.name if tenant is not None else "caller"
            logger.warning("refused shutdown from %s: it needs the admin token", who)
            raise ForbiddenOperation(who, "shut the reward server down (it needs the admin token)")
        return await super()._on_own(message)

    async def handle_own(self, message: AnyMessage) -> AnyMessage | None:
        if isinstance(message, SetRewardSpec):
            return await self.set_spec(message)
        if isinstance(message, ScoreRequest):
            return await self.score(message)
        if isinstance(message, RewardStatsRequest):
            return await self.stats(message)
        return await super().handle_own(message)

    async def _on_score(self, message: AnyMessage) -> AnyMessage | None:
        if not isinstance(message, ScoreRequest):
            raise WrongMessageKind("reward.score", message.kind)
        return await self.score(message)

    async def set_spec(self, message: SetRewardSpec) -> RewardSpecSet:
        """Hot swap: build the endpoint's next version in the background, then switch to it."""
        name = message.endpoint
        tenant = self.tenants.identify(credential(message), f"set the reward of {name!r}")
        self.tenants.check_update(tenant, name)
        await self.tenants.take_request(tenant)
        if tenant is not None and message.spec is not None:
            self.tenants.check_spec(tenant, parse_reward_spec(message.spec))
        with self.tenants.slot(tenant):
            old, new, seconds = await self.endpoints.swap(
                name, spec=message.spec, model_path=message.model_path, component=message.component,
                scaler=message.scaler, scaler_state=message.scaler_state,
            )  # fmt: skip
        who = self.tenants.label(tenant, self.tenants.open) or "open"
        logger.info("endpoint %s: version %s set by %s", name, new.version, who)
        return RewardSpecSet(endpoint=name, spec_version=new.version, spec=str(new.reward.spec),
                             previous_version=old.version if old else "", load_s=seconds)  # fmt: skip

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """Score one rollout batch on the version the endpoint serves when the request starts."""
        name = request.endpoint
        tenant = self.tenants.identify(credential(request), f"score on {name!r}")
        self.tenants.check_endpoint(tenant, name)
        live = self.endpoints.get(name, self.tenants.visible(tenant, self.endpoints.names()))
        await self.tenants.take_request(tenant)
        self.tenants.check_store(tenant, request.rollout.address)
        # A resent score (a retry, a resend after an outage: the same request) is answered from its
        # first reply, so a scaler's statistics count each batch once. Keyed by tenant (job ids are
        # each tenant's own), by the request itself (a client that reuses a job id for another batch
        # is scored as before, not refused) and by the reward version (after a swap: scored anew).
        identity = request.model_dump_json(exclude={"protocol"}).encode()
        digest = hashlib.sha256(identity).hexdigest()[:16]
        key = f"{tenant.name if tenant is not None else ''}/{request.job_id}/{digest}/{live.version}"

        async def once() -> ScoreResult:
            with self.tenants.slot(tenant):
                return await self._score_on(request, live, tenant)

        return await self.replies.once(request, key if request.job_id else "", once)

    async def _score_on(
        self, request: ScoreRequest, live: EndpointVersion, tenant: Tenant | None
    ) -> ScoreResult:
        name = request.endpoint
        self.busy += 1
        done = False
        try:
            if tenant is not None and tenant.config.max_batch is not None:  # before any text is fetched
                counted = await self._fetch(request.rollout, ["group_index"])
                self.tenants.check_batch(tenant, int(counted["group_index"].numel()))
            prompts, responses, groups = await self._texts(request)
            self.tenants.check_batch(tenant, len(responses))
            metadata = [dict(request.metadata[g]) if g < len(request.metadata) else {} for g in groups]
            batch = await asyncio.to_thread(live.reward.score, prompts, responses, metadata)
            done = True
        finally:
            self.busy -= 1
            if not done:
                self.endpoints.record_error(name)
        raw = list(batch.total)
        scores = live.scale(raw)
        self.endpoints.record(name, raw)
        self.endpoints.counted(live)  # the statistics these scores used, on disk before they go out
        return ScoreResult(job_id=request.job_id, endpoint=name, spec_version=live.version, scores=scores,
                           components=batch.components, raw_scores=raw if live.scaler else [])  # fmt: skip

    async def stats(self, request: RewardStatsRequest) -> RewardStats:
        """Statistics of the endpoints the token may see (one, when the request names it)."""
        tenant = self.tenants.identify(credential(request), "read reward statistics")
        await self.tenants.take_request(tenant)
        names = self.tenants.visible(tenant, self.endpoints.names())
        if request.endpoint:
            self.tenants.check_endpoint(tenant, request.endpoint)
            self.endpoints.get(request.endpoint, names)
            names = [request.endpoint]
        if tenant is not None:
            refused = dict(tenant.refused)
        else:
            refused = {f"{t.name}/{code}": n for t in self.tenants.tenants for code, n in t.refused.items()}
        who = self.tenants.label(tenant, self.tenants.open)
        endpoints = {n: self.endpoints.stats(n) for n in names}
        return RewardStats(worker_id=self.worker_id, tenant=who, endpoints=endpoints, refused=refused)

    async def _texts(self, request: ScoreRequest) -> tuple[list[str], list[str], list[int]]:
        from rlfleet.common.schema.batch import unpack_texts

        got = await self._fetch(request.rollout, TEXT_TENSORS)
        prompts = unpack_texts(got["prompt_text"], got["prompt_text_offsets"])
        responses = unpack_texts(got["response_text"], got["response_text_offsets"])
        return prompts, responses, [int(g) for g in got["group_index"].tolist()]

    async def _fetch(self, ref: TensorRef, names: list[str]) -> dict[str, Any]:
        """The tensors ``names`` of ``ref``, through one open client per store (the least recently
        used closes past :data:`MAX_STORE_CLIENTS`)."""
        if self._stores is None:
            from rlfleet.common.tensors.client import ClientPool

            self._stores = ClientPool(self.config.tensor_plane, max_clients=MAX_STORE_CLIENTS)
        return await self._stores.fetch(ref, names)

    async def _save_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.config.state_save_s)
            self.endpoints.save()

    async def teardown(self) -> None:
        if self._saver is not None:
            self._saver.cancel()
            await asyncio.gather(self._saver, return_exceptions=True)
        self.endpoints.save()
        if self._stores is not None:
            await self._stores.close()
