"""API-key authentication: who is calling (`Principal`) and what they may do.

Keys are configured as SHA-256 digests (`auth.keys[].digest`), never in plain text. The
front-ends extract the key a request carries (from HTTP headers or gRPC metadata) and this
module turns it into a `Principal` with `Authenticator.authenticate`; the principal then answers
"may this tenant use this model" (`check_model`) and "may it call this admin endpoint group"
(`require_admin`).

Keys come from `auth.keys` and from `auth.keys_file` (engine/keys_file.py), which
`reload_file` swaps in without a restart: the key table is one tuple, replaced whole, so a request
sees the old table or the new one. A key past its `expires_at` is refused with a message saying so.

With no keys configured the server is open: every caller is the `anonymous` tenant with the
`admin` role, because there is nobody to tell apart and a local developer must be able to
load and unload models; which addresses such a server may bind is the front-ends' to decide.

Admin actions (load, unload, key changes) are logged by `log_admin_action` on the `sluice.audit`
logger with the key's name and tenant.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, get_args

from engine.errors import Forbidden, InvalidApiKey, ModelForbidden, Unauthenticated
from engine.keys_file import read_keys
from engine.settings import ApiKey, AuthSettings, SettingsError

log = logging.getLogger("sluice.auth")
audit = logging.getLogger("sluice.audit")

ANONYMOUS_TENANT = "anonymous"
"""The tenant of every caller when no API keys are configured."""

AdminGroup = Literal["repository", "config", "statistics"]
Role = Literal["user", "admin"]

_ADMIN_GROUPS: frozenset[str] = frozenset(get_args(AdminGroup))
_DIGEST_PREFIX = "sha256:"


def digest_key(key: str) -> str:
    """The `sha256:<hex>` line that stands for `key` in `auth.keys[].digest`."""
    return _DIGEST_PREFIX + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller: its tenant, role and (optional) model allow-list."""

    tenant: str
    role: Role
    models: tuple[str, ...] | None = None
    """The only models this caller may use; None allows all."""
    admin_endpoints: frozenset[str] = field(default_factory=lambda: frozenset({"repository"}))
    """Endpoint groups that need the `admin` role (from `auth.admin_endpoints`)."""
    key_name: str | None = None
    """The key's `name`, or the start of its digest when it has none; None when anonymous."""

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def may_use(self, model: str) -> bool:
        """Whether this caller may run or inspect `model`."""
        return self.models is None or model in self.models

    def check_model(self, model: str) -> None:
        """Raise ModelForbidden unless this caller may use `model`."""
        if not self.may_use(model):
            raise ModelForbidden(self.tenant, self.models or (), model)

    def require_admin(self, group: AdminGroup) -> None:
        """Raise Forbidden if `group` is admin-only here and this caller is not an admin."""
        if group not in _ADMIN_GROUPS:
            raise ValueError(f"unknown endpoint group {group!r}; known: {sorted(_ADMIN_GROUPS)}")
        if group in self.admin_endpoints and not self.is_admin:
            raise Forbidden(
                f"tenant '{self.tenant}' has role '{self.role}'; {group} endpoints need an "
                "admin key"
            )

    def require_admin_role(self, what: str) -> None:
        """Raise Forbidden unless this caller is an admin; `what` names the endpoint."""
        if not self.is_admin:
            raise Forbidden(
                f"tenant '{self.tenant}' has role '{self.role}'; {what} needs an admin key"
            )


@dataclass(frozen=True, slots=True)
class _Entry:
    digest: bytes
    principal: Principal
    expires_at: float | None  # Unix time: expiry is a date on the calendar, not a duration
    source: str  # "auth.keys" or "auth.keys_file"


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def log_admin_action(principal: Principal, action: str, **fields: Any) -> None:
    """One audit line for an admin action, naming the key and tenant that did it."""
    audit.info(
        "admin action %s by key %s (tenant %s)",
        action,
        principal.key_name,
        principal.tenant,
        extra={"action": action, "key": principal.key_name, "tenant": principal.tenant, **fields},
    )


def log_key_change(action: str, subject: Principal, path: str) -> None:
    """One audit line for a key the keys file added, changed or revoked. The actor is the file
    (an operator's edit, or `sluice keys`), not the key: the key is the subject."""
    audit.info(
        "keys file %s: %s key %s (tenant %s)",
        path,
        action,
        subject.key_name,
        subject.tenant,
        extra={
            "action": action,
            "actor": "auth.keys_file",
            "path": path,
            "subject_key": subject.key_name,
            "subject_tenant": subject.tenant,
        },
    )


@contextlib.contextmanager
def admin_action(principal: Principal, action: str, **fields: Any) -> Iterator[None]:
    """Log the admin action done inside the block once it ends, with its outcome: `ok`, or
    `failed` and the error (which still propagates)."""
    try:
        yield
    except Exception as exc:
        log_admin_action(principal, action, outcome="failed", error=str(exc), **fields)
        raise
    log_admin_action(principal, action, outcome="ok", **fields)


class Authenticator:
    """Maps API keys to principals, comparing digests in constant time."""

    def __init__(self, settings: AuthSettings) -> None:
        self._admin_endpoints = frozenset(settings.admin_endpoints)
        self._static = tuple(self._entry(key, "auth.keys") for key in settings.keys)
        self._entries: tuple[_Entry, ...] = self._static
        self.keys_file = settings.keys_file
        # A keys_file means "keys are configured", even while it lists none: never open up.
        self._open = not settings.keys and settings.keys_file is None
        self._anonymous = Principal(ANONYMOUS_TENANT, "admin", None, self._admin_endpoints)
        self.on_reload: list[Callable[[frozenset[str | None]], None]] = []
        """Called after each reload of the keys file with the names of the keys served now
        (what a revoked key held, such as its shared-memory regions, goes with it)."""
        if settings.keys_file is not None:
            self.reload_file(read_keys(settings.keys_file), quiet=True)

    def _entry(self, key: ApiKey, source: str) -> _Entry:
        hex_digest = key.digest.removeprefix(_DIGEST_PREFIX)
        principal = Principal(
            tenant=key.tenant,
            role=key.role,
            models=tuple(key.models) if key.models is not None else None,
            admin_endpoints=self._admin_endpoints,
            key_name=key.name or f"{_DIGEST_PREFIX}{hex_digest[:12]}",
        )
        expires = _utc(key.expires_at).timestamp() if key.expires_at is not None else None
        return _Entry(bytes.fromhex(hex_digest), principal, expires, source)

    def reload_file(self, keys: Sequence[ApiKey], quiet: bool = False) -> None:
        """Serve `keys` (the key file's) beside `auth.keys` from now on. SettingsError, with the
        table unchanged, when a digest is also in `auth.keys`. Logs each added and removed key
        unless `quiet` (the first read, at start)."""
        static = {entry.digest: entry for entry in self._static}
        for key in keys:
            clash = static.get(bytes.fromhex(key.digest.removeprefix(_DIGEST_PREFIX)))
            if clash is not None:
                raise SettingsError(
                    f"auth.keys_file {self.keys_file}: key '{key.name}' has the digest of "
                    f"auth.keys entry {clash.principal.key_name} (tenant "
                    f"'{clash.principal.tenant}'); each key must map to one entry"
                )
        before = {e.principal.key_name: e for e in self._entries if e.source == "auth.keys_file"}
        entries = tuple(self._entry(key, "auth.keys_file") for key in keys)
        self._entries = self._static + entries  # one assignment: requests see old or new
        names = frozenset(entry.principal.key_name for entry in self._entries)
        for listener in self.on_reload:
            listener(names)
        if quiet:
            return
        after = {entry.principal.key_name: entry for entry in entries}
        for name, entry in after.items():
            if before.get(name) != entry:
                action = "key_added" if name not in before else "key_changed"
                log_key_change(action, entry.principal, str(self.keys_file))
        for name, entry in before.items():
            if name not in after:
                log_key_change("key_revoked", entry.principal, str(self.keys_file))
        log.info(
            "auth.keys_file reloaded: %d keys",
            len(entries),
            extra={"action": "keys_reload", "path": str(self.keys_file), "keys": len(entries)},
        )

    @property
    def open(self) -> bool:
        """True when no keys are configured and every caller is the anonymous admin."""
        return self._open

    @property
    def tenants(self) -> frozenset[str]:
        """Every tenant a caller can authenticate as now."""
        if self.open:
            return frozenset({ANONYMOUS_TENANT})
        return frozenset(entry.principal.tenant for entry in self._entries)

    def authenticate(self, api_key: str | None) -> Principal:
        """The principal for `api_key`; Unauthenticated if it is missing, InvalidApiKey (an
        Unauthenticated) if it is unknown or expired.

        The presented key is hashed and compared with `hmac.compare_digest` against every
        configured digest, without stopping at a match: the time taken depends only on the
        number of configured keys, never on which one matched or how many bytes agreed. A dict
        keyed by digest would hash the digest and then compare colliding entries with an
        early-exit `==`, so its timing varies with the table's content; the leak would be hard
        to use (the attacker cannot choose digest bytes), but the loop removes it for ~60 ns
        per key.
        """
        if self.open:
            return self._anonymous
        if not api_key:
            raise Unauthenticated(
                "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )
        presented = hashlib.sha256(api_key.encode()).digest()
        found: _Entry | None = None
        for entry in self._entries:  # one read of the table: a reload cannot split the loop
            if hmac.compare_digest(presented, entry.digest):
                found = entry
        if found is None:
            raise InvalidApiKey(
                f"unknown API key (digest {_DIGEST_PREFIX}{presented.hex()[:12]}...): it is not "
                "configured on this server"
            )
        if found.expires_at is not None and time.time() >= found.expires_at:
            expired = datetime.fromtimestamp(found.expires_at, UTC).isoformat()
            raise InvalidApiKey(
                f"API key '{found.principal.key_name}' (tenant '{found.principal.tenant}') "
                f"expired at {expired}"
            )
        return found.principal
