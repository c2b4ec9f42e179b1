"""TLS for both front-ends (`tls.*` settings), with certificates that change without a restart.

`ServerTls` reads the certificate chain, key and client CA once at start (an unreadable file or
a key that does not match its certificate is a SettingsError naming the file) and again on
`reload()` (SIGHUP). A reload changes what new handshakes get and leaves open connections alone:

- HTTP: uvicorn listens with `ssl_context`, whose SNI callback (called by OpenSSL on every
  handshake, with or without a server name) moves the handshake onto the newest context. Swapping
  the whole context, rather than loading new files into one, also drops a CA that was removed
  from `client_ca_file`: `load_verify_locations` only ever adds.
- gRPC: `grpc.dynamic_ssl_server_credentials` asks `_fetch` for a new configuration before each
  handshake; it gets one once after each reload.

A reload that fails (a missing file, a key for another certificate) keeps the old certificates
and logs why.
"""

from __future__ import annotations

import logging
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.settings import SettingsError
from server.settings import TlsSettings

log = logging.getLogger("sluice.tls")


@dataclass(frozen=True)
class _Material:
    context: ssl.SSLContext
    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None


def _read(path: Path, field: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise SettingsError(f"cannot read tls.{field} {path}: {exc.strerror}") from exc


def _load(tls: TlsSettings) -> _Material:
    """Read and check every file named by `tls`; SettingsError saying which one is wrong."""
    assert tls.cert_file is not None
    assert tls.key_file is not None
    cert_chain = _read(tls.cert_file, "cert_file")
    private_key = _read(tls.key_file, "key_file")
    client_ca = _read(tls.client_ca_file, "client_ca_file") if tls.client_ca_file else None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except ssl.SSLError as exc:
        raise SettingsError(
            f"tls.cert_file {tls.cert_file} and tls.key_file {tls.key_file} do not make a "
            f"certificate and its key (PEM): {exc.reason or exc}"
        ) from exc
    if client_ca is not None:
        try:
            context.load_verify_locations(cadata=client_ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as exc:  # ValueError: an empty file
            reason = getattr(exc, "reason", None) or exc
            raise SettingsError(
                f"tls.client_ca_file {tls.client_ca_file} holds no PEM CA certificate: {reason}"
            ) from exc
        # Without require_client_cert a certificate is checked when a client sends one.
        context.verify_mode = ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_OPTIONAL
    return _Material(context, cert_chain, private_key, client_ca)


class ServerTls:
    """The certificates of this server, for uvicorn (`ssl_context`) and grpc
    (`grpc_credentials()`), re-read by `reload()`."""

    def __init__(self, tls: TlsSettings) -> None:
        self.settings = tls
        self._current = _load(tls)
        self._lock = threading.Lock()  # gRPC calls _fetch from its own threads
        self._grpc_used = False  # reloads prepare a gRPC configuration only when it is used
        self._grpc_pending: Any = None
        # The listening context: it starts handshakes, and the callback hands each one to the
        # newest context (the same settings, so verify modes always agree).
        self.ssl_context = _load(tls).context
        self.ssl_context.sni_callback = self._select

    def _select(self, connection: Any, server_name: str | None, _: ssl.SSLContext) -> None:
        connection.context = self._current.context

    def reload(self) -> bool:
        """Re-read the files; new handshakes use them from now on. False (and logged) when they
        cannot be used: the certificates in use stay."""
        try:
            material = _load(self.settings)
        except SettingsError as exc:
            log.error("TLS certificates not reloaded, the old ones stay in use: %s", exc)
            return False
        grpc_config = self._grpc_configuration(material) if self._grpc_used else None
        with self._lock:
            self._current = material
            if grpc_config is not None:
                self._grpc_pending = grpc_config
        log.info(
            "TLS certificates reloaded from %s",
            self.settings.cert_file,
            extra={"action": "tls_reload", "cert_file": str(self.settings.cert_file)},
        )
        return True

    def grpc_credentials(self) -> Any:
        """Server credentials for `add_secure_port` that follow `reload()`; client certificates
        are required and verified against `client_ca_file` when `require_client_cert` is on."""
        import grpc  # the HTTP front-end alone must not need it

        self._grpc_used = True
        return grpc.dynamic_ssl_server_credentials(
            self._grpc_configuration(self._current),
            self._fetch,
            require_client_authentication=self.settings.require_client_cert,
        )

    @staticmethod
    def _grpc_configuration(material: _Material) -> Any:
        import grpc

        return grpc.ssl_server_certificate_configuration(
            [(material.private_key, material.cert_chain)], root_certificates=material.client_ca
        )

    def _fetch(self) -> Any:
        """grpc's question before a handshake: a new configuration, or None to keep the last."""
        with self._lock:
            pending, self._grpc_pending = self._grpc_pending, None
        return pending
