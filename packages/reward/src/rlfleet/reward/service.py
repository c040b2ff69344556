"""The reward tier's worker: scores rollout batches pulled straight from the rollout workers' stores.

Subjects (``rlfleet.<cluster>.*``)::

    reward.score            queue group "reward": ScoreRequest -> ScoreResult (N workers share the load)
    env.reset               queue group "env", only with environments: EnvReset -> EnvObservation
    env.episode.<id>        this worker's episodes: EnvStep -> EnvObservation, EnvClose -> Ack (what a
                            rollout worker may send it; NATS roles keep it off reward.worker.<id>)
    reward.worker.<id>      this worker alone: SetRewardSpec -> RewardSpecSet (hot swap),
                            RewardStatsRequest -> RewardStats, ScoreRequest, Shutdown; the episodes it
                            holds: EnvStep -> EnvObservation, EnvClose -> Ack (and EnvReset)

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

A tenant's request is bounded before any work (issue 29): its store address must resolve to an
address its ``stores`` admit, and that address is the one connected to; the sizes its store
declares (``Stat``) must fit its ``request_bytes`` and, beside its requests in progress, its
``bytes_in_flight``; its offsets are read first, so no sample over ``sample_bytes`` is fetched; and
the texts are read with the declared size as a hard cap (a store that sends more is cut off). A
request stops at its deadline (its own ``deadline``, for a tenant no later than ``request_s``):
the fetch is cancelled, scoring stops between slices of :data:`SCORE_SLICE` samples, and the
tenant's slot and bytes are freed only once no work of the request is left running.
Hot swaps and versions are :mod:`rlfleet.reward.endpoints`' business: a request finishes on the
version it started with, and its :class:`ScoreResult` names that version.

Environments (issue 33) are served to rollout workers' episodes: a reset goes to any replica (the
``env`` queue group) and the one that takes it names itself in its :class:`EnvObservation`
(``worker_id``); the episode's steps and close go to that worker's own subject. They are named
endpoints of the server with the same tokens and tenants (a tenant's ``endpoints`` list them by
name), checked as a score is; each reset and step counts against the tenant's ``requests_per_s``
(not its ``concurrency``: a rollout worker steps many episodes at once; the worker runs
``max_concurrency`` resets and steps at a time, the rest wait in arrival order), and a tenant holds
at most its even share of ``max_episodes`` live episodes. A server runs only
the environments in its config: no message carries code, and the ``python`` tool runs only what the
model wrote, in the sandbox. The episodes themselves: :mod:`rlfleet.reward.environments.host`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from rlfleet.common.control.messages import (
    Ack,
    AnyMessage,
    EnvClose,
    EnvObservation,
    EnvReset,
    EnvStep,
    RewardSpecSet,
    RewardStats,
    RewardStatsRequest,
    ScoreRequest,
    ScoreResult,
    SetRewardSpec,
    Shutdown,
)
from rlfleet.common.control.reply_cache import ReplyCache
from rlfleet.common.control.transport import TOKEN_HEADER, episode_subject, request_headers, subject
from rlfleet.common.control.worker import Worker
from rlfleet.common.errors import MessageTooLarge, UnknownTensor, WrongMessageKind
from rlfleet.common.schema.refs import TensorRef
from rlfleet.common.schema.reward import RewardWorkerConfig
from rlfleet.reward.composite import ScoreBatch
from rlfleet.reward.endpoints import Endpoints, EndpointVersion
from rlfleet.reward.environments.host import EnvironmentHost
from rlfleet.reward.errors import (
    DeadlinePassed,
    ForbiddenOperation,
    RewardFunctionError,
    RewardInputError,
    UnknownEpisode,
)
from rlfleet.reward.loading import allow_remote_code
from rlfleet.reward.quota_store import open_quotas
from rlfleet.reward.registry import parse_reward_spec
from rlfleet.reward.rules import EPISODE_REWARD, Episode
from rlfleet.reward.tenants import StoreTarget, Tenant, TenantTable

if TYPE_CHECKING:
    from rlfleet.common.tensors.client import ClientPool, TensorStoreClient

logger = logging.getLogger(__name__)

T = TypeVar("T")

BOUNDS = ["prompt_text_offsets", "response_text_offsets", "group_index"]
"""What a tenant's request reads first: where each sample's texts start and end, and its group."""
TEXTS = ["prompt_text", "response_text"]
TEXT_TENSORS = TEXTS + BOUNDS
MAX_STORE_CLIENTS = 64
"""Store connections kept open at once (the least recently used one closes past it)."""
SCORE_SLICE = 64
"""Samples scored per step of a request that has a deadline: past it, the work stops between steps
(as many as the largest default model batch, so a slice keeps the models' batches whole)."""
Texts = tuple[list[str], list[str], list[int], list[float] | None]
"""A batch's prompts and responses (N,) and each sample's group index (N,)."""


def credential(message: AnyMessage) -> str:
    """The token a request carries: its ``Rlfleet-Token`` header, else its body's ``token`` (protocol 1.1)."""
    return request_headers().get(TOKEN_HEADER) or str(getattr(message, "token", "") or "")


class RewardWorker(Worker[RewardWorkerConfig]):
    """Serves ``reward.score`` for its endpoints, to the tenants allowed on each."""

    tier = "reward"

    async def setup(self) -> None:
        cfg = self.config
        self.tenants = TenantTable(cfg.tenants, admin=cfg.admin, allowed_modules=cfg.allowed_modules,
                                   max_concurrency=cfg.max_concurrency, limits=cfg.tenant_limits,
                                   quotas=await open_quotas(cfg, self.transport))  # fmt: skip
        allow_remote_code(cfg.loading.trust_remote_code)  # the server's own setting, never a tenant's
        self.endpoints = Endpoints(cfg.state_dir)
        await self.endpoints.start(cfg.endpoints)
        self._stores: ClientPool | None = None  # made on the first fetch (gRPC channels, in this loop)
        self.replies = ReplyCache()  # a repeated score (same tenant, job id and request): its first reply
        self._saver: asyncio.Task[None] | None = None
        if cfg.state_dir:
            self._saver = asyncio.create_task(self._save_periodically(), name="reward-state-saver")
        verb = subject(cfg.fleet.cluster, "reward", "score")
        await self.subscribe(verb, self._on_score, queue="reward", max_concurrency=cfg.max_concurrency)
        self.environments = EnvironmentHost(
            cfg.environments, worker_id=self.worker_id, max_episodes=cfg.max_episodes,
            idle_s=cfg.episode_idle_s, max_concurrency=cfg.max_concurrency,
        )  # fmt: skip
        if cfg.environments:
            resets = subject(cfg.fleet.cluster, "env", "reset")
            await self.subscribe(resets, self._on_env_reset, queue="env", max_concurrency=cfg.max_concurrency)
            episodes = episode_subject(cfg.fleet.cluster, self.worker_id)  # its episodes' steps and closes
            await self.subscribe(episodes, self._on_episode, max_concurrency=cfg.max_concurrency)
            logger.info("environments: %s", ", ".join(self.environments.names()))
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
        if isinstance(message, EnvStep):
            return await self.env_step(message)
        if isinstance(message, EnvReset):
            return await self.env_reset(message)
        if isinstance(message, EnvClose):
            return await self.env_close(message)
        return await super().handle_own(message)

    async def _on_episode(self, message: AnyMessage) -> AnyMessage | None:
        if isinstance(message, EnvStep):
            return await self.env_step(message)
        if isinstance(message, EnvClose):
            return await self.env_close(message)
        raise WrongMessageKind("env.step or env.close", message.kind)

    async def _on_env_reset(self, message: AnyMessage) -> AnyMessage | None:
        if not isinstance(message, EnvReset):
            raise WrongMessageKind("env.reset", message.kind)
        return await self.env_reset(message)

    async def env_reset(self, message: EnvReset) -> EnvObservation:
        """Start an episode of ``message.env`` here; its observation names this worker."""
        tenant, owner = await self._env_caller(message, f"start an episode of {message.env!r}")
        self.tenants.check_episodes(tenant, self.environments.held_by(owner), self.config.max_episodes)
        return await self.environments.reset(message, owner, self.tenants.deadline(tenant, message.deadline))

    async def env_step(self, message: EnvStep) -> EnvObservation:
        """The environment's answer to the model's turn in an episode this worker holds."""
        tenant, owner = await self._env_caller(message, f"step an episode of {message.env!r}")
        return await self.environments.step(message, owner, self.tenants.deadline(tenant, message.deadline))

    async def env_close(self, message: EnvClose) -> Ack:
        """Drop an episode (not counted against the tenant's rate: closing frees what it holds); one
        this worker does not hold for the caller (done, closed, dropped, never reset) is refused like a
        step for it (:class:`UnknownEpisode`): a close changes nothing it was not given."""
        tenant = self.tenants.identify(credential(message), f"close an episode of {message.env!r}")
        if not self.environments.close(_owner(tenant), message.env, message.episode_id):
            raise UnknownEpisode(message.episode_id, message.env, self.worker_id)
        return Ack(detail=f"episode {message.episode_id} closed")

    async def _env_caller(self, message: EnvReset | EnvStep, operation: str) -> tuple[Tenant | None, str]:
        """Who asks (None: the admin or an open server) and the owner its episodes are kept under, once
        it may use the environment the message names (which must be configured here) and is within its
        rate: the checks a score gets."""
        tenant = self.tenants.identify(credential(message), operation)
        self.tenants.check_endpoint(tenant, message.env, what="environment")
        self.environments.get(message.env, self.tenants.visible(tenant, self.environments.names()))
        await self.tenants.take_request(tenant)
        return tenant, _owner(tenant)

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
        if tenant is not None and message.model_path is not None:
            self.tenants.check_model_paths(tenant, [message.model_path])
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
        target = await self.tenants.admit_store(tenant, request.rollout.address)
        deadline = self.tenants.deadline(tenant, request.deadline)
        # A resent score (a retry, a resend after an outage: the same request) is answered from its
        # first reply, so a scaler's statistics count each batch once. Keyed by tenant (job ids are
        # each tenant's own), by the request itself (a client that reuses a job id for another batch
        # is scored as before, not refused; a retry's later deadline does not make it another) and
        # by the reward version (after a swap: scored anew).
        same = request.model_copy(update={"deadline": None})
        identity = same.model_dump_json(exclude={"protocol"}).encode()
        digest = hashlib.sha256(identity).hexdigest()[:16]
        key = f"{tenant.name if tenant is not None else ''}/{request.job_id}/{digest}/{live.version}"

        async def once() -> ScoreResult:
            with self.tenants.slot(tenant):
                return await self._score_on(request, live, tenant, target, deadline)

        return await self.replies.once(same, key if request.job_id else "", once)

    async def _score_on(
        self,
        request: ScoreRequest,
        live: EndpointVersion,
        tenant: Tenant | None,
        target: StoreTarget,
        deadline: float | None,
    ) -> ScoreResult:
        name = request.endpoint
        self.busy += 1
        done = False
        try:
            _in_time(request.job_id, deadline, "before any work")
            episodes = any(isinstance(c.fn, Episode) for c in live.reward.components)
            texts = self._texts(request, target, tenant, deadline, episodes)
            async with texts as (prompts, responses, groups, rewards):
                self.tenants.check_batch(tenant, len(responses))
                metadata = [dict(request.metadata[g]) if g < len(request.metadata) else {} for g in groups]
                for meta, reward in zip(metadata, rewards or [], strict=False):  # multi-turn: each episode's
                    meta[EPISODE_REWARD] = reward
                batch = await self._score_slices(live, prompts, responses, metadata, request.job_id, deadline)
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

    async def _score_slices(
        self,
        live: EndpointVersion,
        prompts: list[str],
        responses: list[str],
        metadata: list[dict[str, Any]],
        job_id: str,
        deadline: float | None,
    ) -> ScoreBatch:
        """The batch's scores; with a deadline, :data:`SCORE_SLICE` samples at a time, stopping
        (:class:`DeadlinePassed`) before a slice once the deadline has passed."""
        if deadline is None:
            return await asyncio.to_thread(live.reward.score, prompts, responses, metadata)
        n, parts = len(responses), []
        for start in range(0, max(n, 1), SCORE_SLICE):
            _in_time(job_id, deadline, f"after {start} of {n} samples were scored")
            end = start + SCORE_SLICE
            try:
                parts.append(await asyncio.to_thread(
                    live.reward.score, prompts[start:end], responses[start:end], metadata[start:end]
                ))  # fmt: skip
            except RewardFunctionError as exc:  # its sample index counts from the slice's start
                index = None if exc.index is None else exc.index + start
                raise RewardFunctionError(exc.function, index, exc.reason) from exc
        components = {label: [s for p in parts for s in p.components[label]] for label in parts[0].components}
        total = [s for p in parts for s in p.total]
        return ScoreBatch(total=total, components=components, version=parts[0].version)

    @asynccontextmanager
    async def _texts(
        self, request: ScoreRequest, target: StoreTarget, tenant: Tenant | None, deadline: float | None,
        episodes: bool = False,
    ) -> AsyncIterator[Texts]:  # fmt: skip
        """The request's texts, held (for a tenant: counted in its ``bytes_in_flight``) while the block runs;
        with ``episodes`` (the reward scores episodes), each sample's ``episode_reward`` too.

        For a tenant, every size is checked before the bytes it sizes are fetched: the sample count
        (``max_batch``) and the texts' total (``request_bytes``, ``bytes_in_flight``) from what the
        store declares, each sample (``sample_bytes``) from the offsets, read first; every read is
        capped at the declared size.
        """
        from rlfleet.common.schema.batch import unpack_texts

        ref, job = request.rollout, request.job_id
        extra = [EPISODE_REWARD] if episodes else []
        if tenant is None:
            try:
                got, held = await _by(job, deadline, self._fetch(target, ref, TEXT_TENSORS + extra)), 0
            except UnknownTensor as exc:
                if episodes and EPISODE_REWARD in str(exc):  # a single-turn batch scored by the episode rule
                    _episode_rewards({}, 0)
                raise
        else:
            declared, samples = await _by(job, deadline, self._declared(target, ref, extra))
            self.tenants.check_batch(tenant, samples)
            held = sum(declared.values())
            self.tenants.check_bytes(tenant, "request_bytes", held)
        with self.tenants.holding(tenant, held):
            if tenant is not None:
                got = await _by(job, deadline, self._fetch_within(tenant, target, ref, BOUNDS, declared))
                self.tenants.check_bytes(tenant, "sample_bytes", _largest_sample(got))
                got.update(await _by(job, deadline, self._fetch_within(tenant, target, ref, TEXTS + extra,
                                                                      declared)))  # fmt: skip
            prompts = unpack_texts(got["prompt_text"], got["prompt_text_offsets"])
            responses = unpack_texts(got["response_text"], got["response_text_offsets"])
            groups = [int(g) for g in np.asarray(got["group_index"]).reshape(-1).tolist()]
            rewards = _episode_rewards(got, len(responses)) if episodes else None
            del got
            yield prompts, responses, groups, rewards

    async def _declared(
        self, target: StoreTarget, ref: TensorRef, extra: Sequence[str] = ()
    ) -> tuple[dict[str, int], int]:
        """The bytes the store says each text tensor (and each of ``extra``) of ``ref`` holds, and its
        sample count."""
        stat = await self._store(target).stat(ref)
        sizes = {t.name: t.nbytes for t in stat.tensors if t.name in TEXT_TENSORS or t.name in extra}
        samples = next((t.shape[0] for t in stat.tensors if t.name == "group_index" and t.shape), 0)
        return sizes, samples

    async def _fetch_within(
        self,
        tenant: Tenant,
        target: StoreTarget,
        ref: TensorRef,
        names: list[str],
        declared: Mapping[str, int],
    ) -> dict[str, Any]:
        """``names`` of ``ref``, cut off past the bytes the store declared for them."""
        cap = sum(declared.get(n, 0) for n in names)
        try:
            return await self._fetch(target, ref, names, max_bytes=cap)
        except MessageTooLarge as exc:  # the store sends more than it declared: cut off before allocating it
            self.tenants.check_bytes(tenant, "declared_bytes", exc.size, cap=cap)
            raise

    async def _fetch(
        self, target: StoreTarget, ref: TensorRef, names: list[str], *, max_bytes: int | None = None
    ) -> dict[str, Any]:
        """The tensors ``names`` of ``ref``, from the store at ``target`` (at most ``max_bytes``), as
        numpy arrays: the server reads texts and numbers, with or without torch installed."""
        client = self._store(target)
        return await client.get(ref.key, names, capability=ref.capability, nbytes=max_bytes or 0,
                                max_bytes=max_bytes, arrays="numpy")  # fmt: skip

    def _store(self, target: StoreTarget) -> TensorStoreClient:
        """One open client per store address (the least recently used closes past
        :data:`MAX_STORE_CLIENTS`), dialling the address the tenant's ``stores`` admitted."""
        if self._stores is None:
            from rlfleet.common.tensors.client import ClientPool

            self._stores = ClientPool(max_clients=MAX_STORE_CLIENTS, connect=self._connect)
        return self._stores.get(f"{target.connect}|{target.server_name}")

    def _connect(self, key: str) -> TensorStoreClient:
        from rlfleet.common.tensors.client import worker_client

        address, _, server_name = key.partition("|")
        return worker_client(address, self.config.tensor_plane, tls_server_name=server_name)

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


def _owner(tenant: Tenant | None) -> str:
    """Whom an episode belongs to: its tenant, or ``""`` for the admin token and an open server."""
    return tenant.name if tenant is not None else ""


def _in_time(job_id: str, deadline: float | None, when: str) -> None:
    """Raise :class:`DeadlinePassed` once ``deadline`` (UNIX seconds; None: none) has passed."""
    if deadline is not None and time.time() > deadline:
        raise _passed(job_id, deadline, when)


def _passed(job_id: str, deadline: float, when: str) -> DeadlinePassed:
    late = max(0.0, time.time() - deadline)
    logger.warning("score job %s stopped %s: its deadline passed %.2fs ago", job_id, when, late)
    return DeadlinePassed(job_id, when, late)


async def _by(job_id: str, deadline: float | None, step: Awaitable[T]) -> T:
    """``step``, cancelled with :class:`DeadlinePassed` when ``deadline`` passes first."""
    if deadline is None:
        return await step
    try:
        async with asyncio.timeout(deadline - time.time()) as scope:
            return await step
    except TimeoutError:
        if not scope.expired():
            raise  # the step's own timeout (a stalled store), not the deadline
        raise _passed(job_id, deadline, "while its texts were fetched") from None


def _episode_rewards(got: Mapping[str, Any], samples: int) -> list[float]:
    """Each sample's ``episode_reward`` from a fetched batch; a batch without episodes, or with a
    count or value that does not fit, is refused by name (the episode rule scores multi-turn batches)."""
    rewards = got.get(EPISODE_REWARD)
    if rewards is None:
        raise RewardInputError("the batch holds no episode_reward: the episode rule scores the batches of "
                               "multi-turn runs (a job with environment.env)")  # fmt: skip
    values = [float(v) for v in np.asarray(rewards).reshape(-1).tolist()]
    if len(values) != samples or not all(math.isfinite(v) for v in values):
        raise RewardInputError(f"episode_reward holds {len(values)} values for {samples} samples, or a "
                               "non-finite one")  # fmt: skip
    return values


def _largest_sample(bounds: Mapping[str, Any]) -> int:
    """The most text bytes (prompt and response) of one sample, from the batch's offsets (N+1,)."""
    prompts, responses = (
        np.asarray(bounds["prompt_text_offsets"]),
        np.asarray(bounds["response_text_offsets"]),
    )
    if prompts.ndim != 1 or prompts.shape != responses.shape or prompts.size < 2:
        return 0  # malformed or empty: unpacking the texts names the problem
    if prompts.dtype.kind not in "iu" or responses.dtype.kind not in "iu":
        return 0  # not offsets: unpacking the texts names the problem
    return int((np.diff(prompts) + np.diff(responses)).max())
