"""An OpenAI-compatible chat-completions endpoint on the rollout worker, recording every request's
tokens for training (issue 33, "bring your own agent").

The controller opens it (:class:`~rlfleet.common.control.messages.AgentOpen`: the run's bearer token,
sampling and session limits); the user's agent, written against any OpenAI client, calls

- ``POST /v1/chat/completions`` with ``Authorization: Bearer <token>`` and its session id in the
  ``X-Session-Id`` header (``OpenAI(base_url=url, api_key=token, default_headers={"X-Session-Id": sid})``);
- ``GET /v1/models``.

Each request is generated through the worker's engine under the worker's engine gate, at the weight
version the worker holds then, one completion (``n`` must be 1) of at most ``max_tokens`` (the
request's ``max_tokens``/``max_completion_tokens``, capped by the run's). The run's sampling applies
(temperature, top_p, top_k): the trained policy is the one that sampled, whatever the agent asks.

Token in, token out. A session records segments (an :class:`~rlfleet.rollout.episodes.Episode` each):
the first request's messages are rendered with the tokenizer's chat template (plain ``role: text``
lines without one) into the segment's prompt; the sampled tokens are appended (loss_mask 1, their
logprobs, the weight version). A later request that repeats the segment's messages and the assistant
reply it was given, then adds messages, is conditioned on exactly the segment's tokens plus the new
messages' tokens (rendered as a delta after an assistant turn, as :mod:`~rlfleet.rollout.chat_turns`
renders observations; loss_mask 0): never a re-tokenised transcript. A request that does not extend
the segment (the agent rewrote its history) starts a new segment, counted; the session's batch row is
its last segment.

Every request is hostile until read: a wrong or missing token is 401; a body over
:data:`MAX_BODY_BYTES` 413; malformed JSON, bad messages, ``n`` or ``max_tokens`` out of bounds, or a
context past ``max_session_tokens`` or the model's length 400; more than ``max_sessions`` sessions or
:data:`MAX_IN_FLIGHT` requests at once 429; each answered with an OpenAI-style JSON error naming the
problem. Sessions unused for ``idle_s`` are dropped; :meth:`OpenAIEndpoint.collect` drops the sessions
it makes a batch of.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rlfleet.common.control.messages import AgentCollect, AgentOpen, SamplingParams
from rlfleet.common.control.messages.agent import SESSION_ID
from rlfleet.rollout.chat_turns import DUMMY_ASSISTANT, DUMMY_USER, ChatTurns
from rlfleet.rollout.engines.base import Completion
from rlfleet.rollout.episodes import Episode, Episodes

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
"""A request body's bytes at most (413 past it)."""
MAX_MESSAGES = 512
MAX_HEADER_BYTES = 8190
"""A request line's and a header field's bytes at most (aiohttp answers 400 past it)."""
MAX_IN_FLIGHT = 256
"""Requests handled at once (429 past it); they queue for the engine gate."""
SESSION_HEADER = "X-Session-Id"
ROLES = ("system", "user", "assistant", "tool")

Generate = Callable[[list[int], SamplingParams, float], Awaitable[tuple[Completion, int]]]
"""One engine call under the worker's gate: the completion of a context, and the weight version that
sampled it; the float is the seconds it may take."""

Turn = tuple[str, str]
"""A message as the endpoint compares and renders it: (role, text)."""


class ApiError(Exception):
    """A request refused: its HTTP status and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> web.Response:
        kind = {401: "authentication_error", 413: "invalid_request_error", 429: "rate_limit_error"}
        body = {"error": {"message": self.message, "type": kind.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}  # fmt: skip
        return web.json_response(body, status=self.status)


@dataclass
class Segment:
    """A run of requests that extend each other: its tokens (an Episode) and the conversation so far."""

    episode: Episode
    messages: list[Turn] = field(default_factory=list)
    """The last request's messages and the reply it got: what the next request must repeat."""
    stopped: bool = False


@dataclass
class Session:
    id: str
    segments: list[Segment] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    requests: int = 0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def rewritten(self) -> int:
        """Segments begun by a request that did not extend the one before."""
        return max(len(self.segments) - 1, 0)


class MessageTurns(ChatTurns):
    """Renders a request's messages: a first prompt, or the delta of new messages after a turn."""

    def prompt(self, messages: Sequence[Turn]) -> list[int]:
        if not self.templated:
            return self.encode("".join(f"{role}: {text}\n" for role, text in messages))
        return self.encode(self._render(messages, "the messages"))

    def delta(self, new: Sequence[Turn], turn: Sequence[int], stopped: bool) -> list[int]:
        """The tokens after a model turn ``turn`` for messages ``new``, up to the next assistant turn."""
        plain = "".join(f"\n{role}: {text}\n" for role, text in new)
        if not self.templated:
            return self.encode(plain)
        dummy = [(DUMMY_USER["role"], DUMMY_USER["content"]), ("assistant", DUMMY_ASSISTANT["content"])]
        whole = self._render([*dummy, *new], "the new messages")
        at = whole.find(DUMMY_ASSISTANT["content"])
        split = at + len(DUMMY_ASSISTANT["content"])
        head, delta = self.encode(whole[:split]), self.encode(whole[split:])
        if at < 0 or head + delta != self.encode(whole):
            self._plain("the template's tokens do not split at the end of the assistant's turn")
            return self.encode(plain)
        if stopped and turn and delta and turn[-1] == delta[0]:
            return delta[1:]  # the model closed its turn itself: its stop token is the template's
        return delta

    def _render(self, messages: Sequence[Turn], what: str) -> str:
        from jinja2 import TemplateError  # what chat templates raise

        chat = [{"role": role, "content": text} for role, text in messages]
        try:
            return self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        except (TemplateError, ValueError, TypeError) as exc:
            raise ApiError(
                400, f"the model's chat template refused {what}: {exc}", param="messages"
            ) from None


def read_messages(body: dict[str, Any]) -> list[Turn]:
    """The request's ``messages`` as (role, text), or an :class:`ApiError` naming what is wrong."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(
            400, "'messages' must be a non-empty list of {role, content} objects", param="messages"
        )
    if len(messages) > MAX_MESSAGES:
        raise ApiError(
            400, f"'messages' holds {len(messages)} messages, over {MAX_MESSAGES}", param="messages"
        )
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object, got {type(message).__name__}", param=where)
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {str(role)[:40]!r}",
                           param=f"{where}.role")  # fmt: skip
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):  # fmt: skip
                raise ApiError(400, f"{where}.content: only parts of type 'text' are supported",
                               param=f"{where}.content")  # fmt: skip
            content = "".join(p["text"] for p in content)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string or a list of text parts",
                           param=f"{where}.content")  # fmt: skip
        out.append((role, content))
    return out


def read_max_tokens(body: dict[str, Any], cap: int) -> int:
    """The request's ``max_completion_tokens`` (or ``max_tokens``): an int in 1..``cap`` (default ``cap``)."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= cap:
            raise ApiError(400, f"'{name}' must be an integer in 1..{cap} (the run's max_tokens), got "
                           f"{str(value)[:40]}", param=name)  # fmt: skip
        return value
    return cap


def check_options(body: dict[str, Any]) -> None:
    """Refuse what the endpoint does not do (several choices, streaming) rather than ignore it."""
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise ApiError(
            400, f"'n' must be 1 (one recorded completion per request), got {str(n)[:40]}", param="n"
        )
    if body.get("stream"):
        raise ApiError(400, "'stream' is not supported: ask for the whole completion", param="stream")


class SessionBook:
    """The sessions of the open endpoint, within the run's limits."""

    def __init__(self, opened: AgentOpen) -> None:
        self.opened = opened
        self.sessions: dict[str, Session] = {}
        self.expired = 0

    def get(self, session_id: str) -> Session:
        now = time.monotonic()
        for sid in [s for s, v in self.sessions.items() if now - v.last_used > self.opened.idle_s]:
            if not self.sessions[sid].lock.locked():
                del self.sessions[sid]
                self.expired += 1
        session = self.sessions.get(session_id)
        if session is None:
            if len(self.sessions) >= self.opened.max_sessions:
                raise ApiError(429, f"{len(self.sessions)} sessions are open, the run's max_sessions; "
                               "collect or let some expire first", code="too_many_sessions")  # fmt: skip
            session = self.sessions[session_id] = Session(session_id)
        session.last_used = now
        return session


class OpenAIEndpoint:
    """The endpoint of one rollout worker (see the module docstring)."""

    def __init__(self, worker_id: str, model_name: str, tokenizer: Any, generate: Generate,
                 max_model_len: int | None = None) -> None:  # fmt: skip
        self.worker_id, self.model_name = worker_id, model_name
        self.tokenizer, self.generate = tokenizer, generate
        self.max_model_len = max_model_len
        self.turns = MessageTurns(tokenizer)
        self.book: SessionBook | None = None
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._in_flight = 0

    async def open(self, message: AgentOpen, bind_host: str = "127.0.0.1", advertise_host: str = "") -> str:
        """Serve with ``message``'s token and limits (started on the first open); the endpoint's URL."""
        if self.book is None or not hmac.compare_digest(self.book.opened.token, message.token):
            self.book = SessionBook(message)  # a new run's token: the old sessions go
        else:
            self.book.opened = message
        if self._runner is None:
            app = web.Application(client_max_size=MAX_BODY_BYTES)
            app.router.add_post("/v1/chat/completions", self._chat)
            app.router.add_get("/v1/models", self._models)
            runner = web.AppRunner(app, access_log=None, handler_args={
                "max_line_size": MAX_HEADER_BYTES, "max_field_size": MAX_HEADER_BYTES})  # fmt: skip
            await runner.setup()
            site = web.TCPSite(runner, bind_host, 0)
            await site.start()
            self._runner = runner
            port = runner.addresses[0][1]
            host = advertise_host or (
                socket.gethostname() if bind_host in ("0.0.0.0", "::", "") else bind_host
            )
            self.url = f"http://{host}:{port}/v1"
            logger.info("OpenAI-compatible endpoint for agents at %s", self.url)
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- requests ------------------------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> SessionBook:
        book = self.book
        given = request.headers.get("Authorization", "")
        if book is None or not hmac.compare_digest(given.encode(), f"Bearer {book.opened.token}".encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer <the run's token>)",
                           code="invalid_api_key")  # fmt: skip
        return book

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._authorized(request)
        except ApiError as exc:
            return exc.response()
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlfleet"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.Response:
        if self._in_flight >= MAX_IN_FLIGHT:
            return ApiError(429, f"{MAX_IN_FLIGHT} requests are in flight; retry", code="busy").response()
        self._in_flight += 1
        try:
            book = self._authorized(request)
            body = await self._body(request)
            return web.json_response(await self._complete(book, request.headers.get(SESSION_HEADER), body))
        except ApiError as exc:
            return exc.response()
        finally:
            self._in_flight -= 1

    async def _body(self, request: web.Request) -> dict[str, Any]:
        if (request.content_length or 0) > MAX_BODY_BYTES:
            raise ApiError(413, f"the body has {request.content_length} bytes, over {MAX_BODY_BYTES}")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes") from None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}")
        return body

    async def _complete(
        self, book: SessionBook, session_id: str | None, body: dict[str, Any]
    ) -> dict[str, Any]:
        if not session_id or not re.match(SESSION_ID, session_id):
            raise ApiError(400, f"the {SESSION_HEADER} header must name the session (1-128 of A-Z a-z 0-9 "
                           f"_ . : -), got {(session_id or '')[:140]!r}", param=SESSION_HEADER)  # fmt: skip
        check_options(body)
        messages = read_messages(body)
        max_tokens = read_max_tokens(body, book.opened.sampling.max_tokens)
        session = book.get(session_id)
        async with session.lock:  # a session's requests one at a time: each extends the one before
            segment, delta = await asyncio.to_thread(self._context, session, messages)
            context = segment.episode.context + delta
            self._check_length(book, len(context), max_tokens)
            params = book.opened.sampling.model_copy(update={"n": 1, "max_tokens": max_tokens, "seed": None,
                                                             "logprobs": True})  # fmt: skip
            completion, version = await self.generate(context, params, book.opened.request_timeout_s)
            if segment not in session.segments:
                session.segments.append(segment)
            segment.episode.add_observation(delta)
            segment.episode.add_turn(completion, version)
            segment.messages = [*messages, ("assistant", completion.text)]
            segment.stopped = completion.finish_reason == "stop"
            session.requests += 1
            session.last_used = time.monotonic()
        return self._reply(body, context, completion, version)

    def _context(self, session: Session, messages: list[Turn]) -> tuple[Segment, list[int]]:
        """The segment the request goes on, and the tokens its new messages add to it."""
        last = session.segments[-1] if session.segments else None
        if (
            last is not None
            and len(messages) > len(last.messages)
            and messages[: len(last.messages)] == last.messages
        ):
            turn = last.episode.last_turn
            assert turn is not None
            return last, self.turns.delta(messages[len(last.messages) :], turn.token_ids, last.stopped)
        if last is not None:
            logger.info("session %s: request %d does not extend the conversation (history rewritten): a new "
                        "segment", session.id, session.requests + 1)  # fmt: skip
        prompt = self.turns.prompt(messages)
        return Segment(Episode(prompt=0, sample=0, episode_id=session.id, prompt_ids=prompt)), []

    def _check_length(self, book: SessionBook, context: int, max_tokens: int) -> None:
        caps = [("the run's max_session_tokens", book.opened.max_session_tokens),
                ("the model's max_model_len", self.max_model_len)]  # fmt: skip
        for name, cap in caps:
            if cap is not None and context + max_tokens > cap:
                why = f"the context of {context} tokens plus max_tokens={max_tokens} is over {name}={cap}"
                raise ApiError(400, why, param="messages", code="context_length_exceeded")

    def _reply(self, body: dict[str, Any], context: list[int], c: Completion, version: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": c.text},
                                  "finish_reason": c.finish_reason, "logprobs": None,
                                  "token_ids": list(c.token_ids)}  # fmt: skip
        if body.get("logprobs"):
            tokens = self.tokenizer.convert_ids_to_tokens(list(c.token_ids))
            choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                              for t, lp in zip(tokens, c.logprobs, strict=True)]}  # fmt: skip
        usage = {"prompt_tokens": len(context), "completion_tokens": len(c.token_ids),
                 "total_tokens": len(context) + len(c.token_ids)}  # fmt: skip
        return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion",
                "created": int(time.time()), "model": self.model_name, "choices": [choice], "usage": usage,
                "prompt_token_ids": context, "weight_version": version}  # fmt: skip

    # --- the batch -----------------------------------------------------------------------------------

    def collect(self, message: AgentCollect, filler_token: int) -> tuple[Episodes, dict[str, int]]:
        """The episodes of ``message``'s sessions, prompt-major, each its session's last segment with
        the agent's reward (end ``done``, or ``env_error`` for a failed agent: reward 0); a session with
        no request is the prompt and one ``filler_token`` out of the loss. The sessions are dropped."""
        n = len(message.sessions) // len(message.prompt_token_ids)
        sessions = self.book.sessions if self.book is not None else {}
        episodes, counts = [], {"sessions": 0, "rewritten": 0, "empty": 0, "failed": 0}
        for k, sid in enumerate(message.sessions):
            session = sessions.pop(sid, None)
            if session is not None and session.segments:
                ep = session.segments[-1].episode
                counts["rewritten"] += session.rewritten
            else:
                ep = Episode(
                    prompt=0, sample=0, episode_id=sid, prompt_ids=list(message.prompt_token_ids[k // n])
                )
                ep.add_observation([filler_token])
                counts["empty"] += 1
            ep.prompt, ep.sample = k // n, k % n
            failed = message.failed[k]
            ep.end, ep.reward = ("env_error", 0.0) if failed else ("done", message.rewards[k])
            counts["failed"] += failed
            counts["sessions"] += 1
            episodes.append(ep)
        versions = sorted({v for ep in episodes for v in ep.versions if v >= 0})
        return Episodes(episodes, versions), counts
