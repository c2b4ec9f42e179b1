"""API-key authentication: who is calling (`Principal`) and what they may do.

Keys are configured as SHA-256 digests (`auth.keys[].digest`), never in plain text. Both
front-ends read the key with `api_key_from_headers` (HTTP headers or gRPC metadata) and turn it
into a `Principal` with `Authenticator.authenticate`; the principal then answers "may this tenant
use this model" (`check_model`) and "may it call this admin endpoint group" (`require_admin`).

With no keys configured the server is open: every caller is the `anonymous` tenant with the
`admin` role, because there is nobody to tell apart and a local developer must be able to
load and unload models. `ensure_safe_bind` keeps such a server on loopback unless told otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from engine.errors import Forbidden, Unauthenticated
from engine.settings import AuthSettings, SettingsError

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

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    def may_use(self, model: str) -> bool:
        """Whether this caller may run or inspect `model`."""
        return self.models is None or model in self.models

    def check_model(self, model: str) -> None:
        """Raise Forbidden unless this caller may use `model`."""
        if not self.may_use(model):
            allowed = ", ".join(self.models or ())
            raise Forbidden(f"tenant '{self.tenant}' may use models [{allowed}]; got '{model}'")

    def require_admin(self, group: AdminGroup) -> None:
        """Raise Forbidden if `group` is admin-only here and this caller is not an admin."""
        if group not in _ADMIN_GROUPS:
            raise ValueError(f"unknown endpoint group {group!r}; known: {sorted(_ADMIN_GROUPS)}")
        if group in self.admin_endpoints and not self.is_admin:
            raise Forbidden(
                f"tenant '{self.tenant}' has role '{self.role}'; {group} endpoints need an "
                "admin key"
            )


class Authenticator:
    """Maps API keys to principals, comparing digests in constant time."""

    def __init__(self, settings: AuthSettings) -> None:
        admin_endpoints = frozenset(settings.admin_endpoints)
        self._entries: list[tuple[bytes, Principal]] = [
            (
                bytes.fromhex(key.digest.removeprefix(_DIGEST_PREFIX)),
                Principal(
                    tenant=key.tenant,
                    role=key.role,
                    models=tuple(key.models) if key.models is not None else None,
                    admin_endpoints=admin_endpoints,
                ),
            )
            for key in settings.keys
        ]
        self._anonymous = Principal(ANONYMOUS_TENANT, "admin", None, admin_endpoints)

    @property
    def open(self) -> bool:
        """True when no keys are configured and every caller is the anonymous admin."""
        return not self._entries

    @property
    def tenants(self) -> frozenset[str]:
        """Every tenant a caller can authenticate as."""
        if self.open:
            return frozenset({ANONYMOUS_TENANT})
        return frozenset(principal.tenant for _, principal in self._entries)

    def authenticate(self, api_key: str | None) -> Principal:
        """The principal for `api_key`; Unauthenticated if it is missing or unknown.

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
        found: Principal | None = None
        for digest, principal in self._entries:
            if hmac.compare_digest(presented, digest):
                found = principal
        if found is None:
            raise Unauthenticated(
                f"unknown API key (digest {_DIGEST_PREFIX}{presented.hex()[:12]}...): it is not "
                "configured on this server"
            )
        return found


def authenticate_headers(
    authenticator: Authenticator,
    headers: Mapping[str, str] | Iterable[tuple[str, str | bytes]],
    model: str | None = None,
) -> Principal:
    """The principal behind HTTP headers or gRPC metadata; Forbidden when it may not use `model`.
    Every front-end authenticates through this one function."""
    principal = authenticator.authenticate(api_key_from_headers(headers))
    if model is not None:
        principal.check_model(model)
    return principal


def api_key_from_headers(
    headers: Mapping[str, str] | Iterable[tuple[str, str | bytes]],
) -> str | None:
    """The API key in HTTP headers or gRPC metadata, or None when neither header is present.

    Accepts `Authorization: Bearer <key>` and `x-api-key: <key>` with any header-name case.
    `headers` may be a mapping (HTTP) or the (key, value) pairs of gRPC invocation metadata.
    Raises Unauthenticated for an Authorization header of another scheme (when no x-api-key is
    sent) and for two different keys in the two headers, rather than guessing which one counts.
    """
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    bearer: str | None = None
    scheme: str | None = None
    x_api_key: str | None = None
    for name, raw in pairs:
        value = (raw.decode("latin-1") if isinstance(raw, bytes) else raw).strip()
        lowered = name.lower()
        if lowered == "x-api-key":
            x_api_key = value or None
        elif lowered == "authorization":
            found_scheme, _, credentials = value.partition(" ")
            if found_scheme.lower() == "bearer":
                bearer = credentials.strip() or None
            else:
                scheme = found_scheme
    if bearer is not None and x_api_key is not None and bearer != x_api_key:
        raise Unauthenticated(
            "two different API keys sent (Authorization: Bearer and x-api-key); send one"
        )
    if bearer is None and x_api_key is None and scheme:
        raise Unauthenticated(
            f"Authorization header uses scheme '{scheme}'; expected 'Bearer <key>' "
            "(or send the key as 'x-api-key: <key>')"
        )
    return bearer or x_api_key


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # any other host name may resolve to a public address


def ensure_safe_bind(host: str, settings: AuthSettings, allow_unauthenticated: bool) -> None:
    """Raise SettingsError when `host` is not loopback, no keys are set and nobody said it's OK."""
    if settings.keys or allow_unauthenticated or is_loopback(host):
        return
    raise SettingsError(
        f"refusing to bind {host} with no API keys configured: anyone who can reach it could "
        "run every model and load or unload models. Add auth.keys (create one with "
        "`sluice keys create --tenant NAME`), bind 127.0.0.1, or pass --allow-unauthenticated"
    )
