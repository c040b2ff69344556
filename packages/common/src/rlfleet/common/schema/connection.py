"""How a process authenticates to NATS and secures the link: :class:`NatsConnection`, defined once.

Every tier's worker config, the controller's ``TrainerConfig`` (through
:class:`~rlfleet.common.schema.worker.FleetAddress`) and the reward admin CLI take these settings.
Each field may be left unset and come from the environment instead (``RLFLEET_NATS_USER``,
``RLFLEET_NATS_PASSWORD``, ``RLFLEET_NATS_TOKEN``, ``RLFLEET_NATS_NKEY_SEED_FILE``,
``RLFLEET_NATS_CREDS_FILE``, ``RLFLEET_NATS_TLS``, ``RLFLEET_NATS_TLS_CA_FILE``,
``RLFLEET_NATS_TLS_CERT_FILE``, ``RLFLEET_NATS_TLS_KEY_FILE``, ``RLFLEET_NATS_INBOX_PREFIX``):
:meth:`NatsConnection.resolved` fills them in at connect time, so a secret from the environment
never lands in a config object that is dumped.

Secrets never show: a dumped config (``model_dump(mode="json")``, the ``config.yaml`` a run writes)
holds ``'***'`` for a password or token that is set, and :func:`mask_url` hides the credentials of
a ``nats://user:pass@host`` URL in logs and error messages.

A NATS URL may name several servers, the nodes of one NATS cluster, comma-separated
(``nats://a:4222,nats://b:4222``): :func:`server_urls` splits and checks it, and clients fail over
between them.
"""

from __future__ import annotations

import os
import re
import ssl
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, PlainSerializer, SecretStr, model_validator

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.config import ConfigModel

ENV_PREFIX = "RLFLEET_NATS_"
MASK = "***"

Secret = Annotated[
    SecretStr,
    PlainSerializer(lambda s: MASK if s.get_secret_value() else "", return_type=str, when_used="json"),
]
"""A credential: hidden in reprs, written as ``'***'`` (or ``''`` when unset) by a JSON-mode dump."""

_INBOX_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


class NatsConnection(ConfigModel):
    """Credentials and TLS for the NATS connection; at most one way to authenticate.

    Unset fields come from ``RLFLEET_NATS_<FIELD>`` when the connection is made.
    """

    user: str = Field(default="", description="NATS user name (with password)")
    password: Secret = Field(
        default=SecretStr(""), description="NATS password of user (env: RLFLEET_NATS_PASSWORD)"
    )
    token: Secret = Field(
        default=SecretStr(""), description="NATS authorization token (env: RLFLEET_NATS_TOKEN)"
    )
    nkey_seed_file: str = Field(default="", description="file holding an NKey seed (SU...)")
    creds_file: str = Field(default="", description="a .creds file (user JWT and NKey seed)")
    tls: bool = Field(default=False, description="use TLS even without a CA file (system CAs)")
    tls_ca_file: str = Field(default="", description="CA bundle that signs the server's certificate")
    tls_cert_file: str = Field(default="", description="client certificate (mutual TLS), with tls_key_file")
    tls_key_file: str = Field(default="", description="client private key (mutual TLS)")
    inbox_prefix: str = Field(
        default="",
        description="prefix of reply subjects; empty: _INBOX.<user> with a user, else _INBOX "
        "(a server that gives each user only its own inboxes needs the per-user form)",
    )

    @model_validator(mode="after")
    def _check(self) -> NatsConnection:
        methods = [name for name in ("token", "nkey_seed_file", "creds_file") if _is_set(getattr(self, name))]
        if self.user or _is_set(self.password):
            methods.insert(0, "user/password")
        if len(methods) > 1:
            raise ValueError("NATS credentials: set one of user/password, token, nkey_seed_file, creds_file; "
                             f"got {', '.join(methods)}")  # fmt: skip
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("NATS mutual TLS needs both tls_cert_file and tls_key_file")
        if self.inbox_prefix and not all(_INBOX_TOKEN.match(t) for t in self.inbox_prefix.split(".")):
            raise ValueError(f"inbox_prefix {self.inbox_prefix!r}: dot-separated letters, digits, '_' or '-'")
        return self

    # --- environment ----------------------------------------------------------------------------

    def resolved(self, env: Mapping[str, str] | None = None, prefix: str = ENV_PREFIX) -> NatsConnection:
        """This connection with every unset field taken from ``env`` (``os.environ``): ``<prefix><FIELD>``.

        A config that names one way to authenticate keeps it: the environment fills in credentials
        only when the config names none.
        """
        env = os.environ if env is None else env
        data: dict[str, Any] = {name: getattr(self, name) for name in type(self).model_fields}
        has_auth = self.has_credentials
        for name in type(self).model_fields:
            raw = env.get(prefix + name.upper())
            if raw is None or raw == "" or _is_set(data[name]):
                continue
            if has_auth and name in ("user", "password", "token", "nkey_seed_file", "creds_file"):
                continue
            data[name] = raw.strip().lower() in ("1", "true", "yes", "on") if name == "tls" else raw
        try:
            return NatsConnection.model_validate(data)
        except ValueError as exc:
            raise ConfigError(f"{prefix}*", "(environment)", _first_message(exc)) from None

    def env(self, prefix: str = ENV_PREFIX) -> dict[str, str]:
        """The set fields as the ``<prefix><FIELD>`` variables :meth:`resolved` reads back: how a
        launcher hands a worker its login (secrets in clear: a child's environment, never a file)."""
        out: dict[str, str] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            value = value.get_secret_value() if isinstance(value, SecretStr) else value
            if value:
                out[prefix + name.upper()] = "true" if value is True else str(value)
        return out

    @property
    def has_credentials(self) -> bool:
        """Whether a way to authenticate is set."""
        return bool(self.user or self.creds_file or self.nkey_seed_file or _is_set(self.token))

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.tls_ca_file or self.tls_cert_file)

    def effective_inbox_prefix(self) -> str:
        """Where replies to this client's requests go."""
        if self.inbox_prefix:
            return self.inbox_prefix
        return f"_INBOX.{self.user}" if self.user and _INBOX_TOKEN.match(self.user) else "_INBOX"

    # --- what nats-py takes -----------------------------------------------------------------------

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for ``nats.aio.client.Client.connect`` (files read here, checked first)."""
        options: dict[str, Any] = {"inbox_prefix": self.effective_inbox_prefix()}
        if self.user:
            options["user"] = self.user
            options["password"] = self.password.get_secret_value()
        if _is_set(self.token):
            options["token"] = self.token.get_secret_value()
        if self.nkey_seed_file:
            _need_nkeys("nkey_seed_file")
            options["nkeys_seed"] = str(_readable("nkey_seed_file", self.nkey_seed_file))
        if self.creds_file:
            _need_nkeys("creds_file")
            options["user_credentials"] = str(_readable("creds_file", self.creds_file))
        if self.uses_tls:
            options["tls"] = self.ssl_context()
        return options

    def ssl_context(self) -> ssl.SSLContext:
        """The client's TLS context: the CA file (else the system's), and its certificate for mTLS."""
        ca = str(_readable("tls_ca_file", self.tls_ca_file)) if self.tls_ca_file else None
        try:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
            if self.tls_cert_file:
                cert = _readable("tls_cert_file", self.tls_cert_file)
                key = _readable("tls_key_file", self.tls_key_file)
                context.load_cert_chain(str(cert), str(key))
        except ssl.SSLError as exc:
            raise ConfigError(
                "nats_auth.tls_*", "(files)", f"not a usable certificate or key: {exc.reason}"
            ) from None
        return context


URL_SCHEMES = ("nats", "tls", "ws", "wss")


def server_urls(url: str | Sequence[str]) -> list[str]:
    """The servers of a NATS URL: ``"nats://a:4222,nats://b:4222"`` (or a list) -> one URL each.

    A client given several servers (the nodes of one NATS cluster) connects to one and fails over
    to another when it goes. Raises :class:`ConfigError` for an empty list or a URL without a
    ``nats://``, ``tls://``, ``ws://`` or ``wss://`` scheme and a host (credentials masked).
    """
    parts = url.split(",") if isinstance(url, str) else [p for u in url for p in u.split(",")]
    servers = [part.strip() for part in parts if part.strip()]
    if not servers:
        raise ConfigError("nats_url", url, "no NATS server URL given")
    for server in servers:
        try:
            split = urlsplit(server)
            host = split.hostname
        except ValueError:
            split, host = None, None
        if split is None or split.scheme not in URL_SCHEMES or not host:
            raise ConfigError(
                "nats_url", mask_url(server), f"not a NATS server URL (want {URL_SCHEMES[0]}://HOST:PORT, "
                "comma-separated for the nodes of a cluster)",
            )  # fmt: skip
    return servers


def mask_url(url: str) -> str:
    """``url`` with any user info hidden: ``nats://u:secret@h:4222`` -> ``nats://u:***@h:4222``,
    ``nats://token@h`` -> ``nats://***@h``. Comma-separated lists are masked one by one."""
    if "," in url:
        return ",".join(mask_url(part) for part in url.split(","))
    try:
        parts = urlsplit(url)
    except ValueError:
        return MASK if "@" in url else url
    if "@" not in parts.netloc:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    user, sep, _ = userinfo.partition(":")
    shown = f"{user}:{MASK}" if sep else MASK
    return urlunsplit((parts.scheme, f"{shown}@{host}", parts.path, parts.query, parts.fragment))


def _is_set(value: object) -> bool:
    if isinstance(value, SecretStr):
        return bool(value.get_secret_value())
    return bool(value)


def _readable(field: str, path: str) -> Path:
    found = Path(path).expanduser()
    if not found.is_file() or not os.access(found, os.R_OK):
        raise ConfigError(f"nats_auth.{field}", str(found), "no such readable file")
    return found


def _need_nkeys(field: str) -> None:
    try:
        import nkeys  # noqa: F401 - nats-py signs with it
    except ImportError:
        raise ConfigError(f"nats_auth.{field}", "(set)", "NKey and .creds authentication need the "
                          "'nkeys' package; pip install nkeys") from None  # fmt: skip


def _first_message(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        return str(first.get("msg", exc))
    return str(exc)
