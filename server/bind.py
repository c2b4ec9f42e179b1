"""Binding the server's ports: whether an address may be bound as configured, and the listening
sockets themselves.

With no API keys configured every caller is the anonymous admin (engine/auth.py), so
`ensure_safe_bind` keeps such a server on loopback unless told otherwise (`allow_unauthenticated`);
`warn_plaintext_bind` warns when a server reachable from elsewhere speaks plain text, and
`metrics_need_key` asks for an admin key on /metrics once the server is reachable from elsewhere.
`listen_socket` binds a port (and shares it between worker processes, SO_REUSEPORT)."""

from __future__ import annotations

import ipaddress
import logging
import socket

from engine.settings import AuthSettings, SettingsError
from server.settings import TlsSettings

log = logging.getLogger("sluice.auth")


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # any other host name may resolve to a public address


def metrics_need_key(host: str, require_key: bool | None) -> bool:
    """Whether /metrics on the HTTP port asks for an admin key: as `metrics.require_key` says,
    or when it is unset, whenever `host` is reachable from other machines (the metrics name
    tenants and models). Without keys configured every caller is the anonymous admin, so this
    changes nothing there."""
    return require_key if require_key is not None else not is_loopback(host)


def note_metrics_key(host: str, settings: AuthSettings, require_key: bool | None) -> bool:
    """Log (and return True) when /metrics on the HTTP port asks for an admin key only because
    the server binds beyond loopback with keys: a scraper without one gets 401 from now on."""
    if require_key is not None or not (settings.keys or settings.keys_file):
        return False
    if not metrics_need_key(host, require_key):
        return False
    log.info(
        "/metrics on the HTTP port needs an admin key (bound to %s with API keys; "
        "metrics.require_key unset). Scrape with one, serve them on metrics.port, or set "
        "metrics.require_key: false",
        host,
        extra={"host": host},
    )
    return True


def ensure_safe_bind(host: str, settings: AuthSettings, allow_unauthenticated: bool) -> None:
    """Raise SettingsError when `host` is not loopback, no keys are set and nobody said it's OK."""
    if settings.keys or settings.keys_file or allow_unauthenticated or is_loopback(host):
        return
    raise SettingsError(
        f"refusing to bind {host} with no API keys configured: anyone who can reach it could "
        "run every model and load or unload models. Add auth.keys (create one with "
        "`sluice keys create --tenant NAME`), bind 127.0.0.1, or pass --allow-unauthenticated"
    )


def warn_plaintext_bind(host: str, tls: TlsSettings) -> bool:
    """Log a warning (and return True) when `host` is reachable from other machines and TLS is
    off: API keys and tensors would cross the network in plain text."""
    if tls.enabled or is_loopback(host):
        return False
    log.warning(
        "binding %s without TLS: API keys and request data travel in plain text. Set "
        "tls.cert_file and tls.key_file, or terminate TLS in front of sluice on a trusted network",
        host,
        extra={"host": host},
    )
    return True


def listen_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to (host, port), inheritable by child processes; `reuse_port`: others
    may bind the port too (SO_REUSEPORT: the kernel spreads connections over their listening
    sockets). SettingsError naming the address when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SettingsError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock
