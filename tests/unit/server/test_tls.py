from __future__ import annotations

import asyncio
import logging
import shutil
import ssl
from pathlib import Path

import pytest

from engine.settings import SettingsError
from server.bind import warn_plaintext_bind
from server.settings import TlsSettings, load_settings
from server.tls import ServerTls
from tests.tls_certs import CertFiles, TestCA, peer_serial


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path / "ca")


def settings_for(folder: Path, cert: CertFiles, **extra: object) -> TlsSettings:
    """TLS settings naming copies of `cert` in `folder` (tests replace them)."""
    shutil.copy(cert.cert, folder / "server.crt")
    shutil.copy(cert.key, folder / "server.key")
    return TlsSettings.model_validate(
        {"cert_file": folder / "server.crt", "key_file": folder / "server.key", **extra}
    )


async def handshake_serial(port: int, context: ssl.SSLContext) -> int:
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return peer_serial(der)
    finally:
        writer.close()
        await writer.wait_closed()


async def test_reload_changes_new_handshakes_only(tmp_path: Path, ca: TestCA) -> None:
    first, second = ca.issue("server-a"), ca.issue("server-b")
    tls = ServerTls(settings_for(tmp_path, first))

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while line := await reader.readline():
            writer.write(line)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=tls.ssl_context)
    port = server.sockets[0].getsockname()[1]
    client = ssl.create_default_context(cafile=ca.cert_file)
    try:
        assert await handshake_serial(port, client) == first.serial
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
        settings_for(tmp_path, second)
        assert tls.reload()
        assert await handshake_serial(port, client) == second.serial
        writer.write(b"still here\n")
        assert await reader.readline() == b"still here\n"
        kept = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        assert peer_serial(kept) == first.serial
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()


def test_a_failed_reload_keeps_the_certificate_in_use(
    tmp_path: Path, ca: TestCA, caplog: pytest.LogCaptureFixture
) -> None:
    tls = ServerTls(settings_for(tmp_path, ca.issue("server-a")))
    before = tls._current
    (tmp_path / "server.key").write_text("garbage")
    assert not tls.reload()
    assert tls._current is before
    assert "TLS certificates not reloaded" in caplog.text


def test_unreadable_files_name_the_setting(tmp_path: Path, ca: TestCA) -> None:
    settings = settings_for(tmp_path, ca.issue("server-a"))
    (tmp_path / "server.key").unlink()
    with pytest.raises(SettingsError, match=r"cannot read tls\.key_file .*server\.key"):
        ServerTls(settings)


def test_a_key_of_another_certificate_is_refused(tmp_path: Path, ca: TestCA) -> None:
    settings = settings_for(tmp_path, ca.issue("server-a"))
    shutil.copy(ca.issue("server-b").key, tmp_path / "server.key")
    with pytest.raises(SettingsError, match="do not make a certificate and its key"):
        ServerTls(settings)


@pytest.mark.parametrize("text", ["not a certificate", ""])  # empty: a ValueError, uncaught
def test_a_client_ca_file_without_certificates_is_refused(
    tmp_path: Path, ca: TestCA, text: str
) -> None:
    (tmp_path / "ca.pem").write_text(text)
    settings = settings_for(tmp_path, ca.issue("server-a"), client_ca_file=tmp_path / "ca.pem")
    with pytest.raises(SettingsError, match=r"tls\.client_ca_file .*ca\.pem holds no PEM CA"):
        ServerTls(settings)


def test_client_certificates_are_required_only_when_asked(tmp_path: Path, ca: TestCA) -> None:
    cert = ca.issue("server-a")
    optional = ServerTls(settings_for(tmp_path, cert, client_ca_file=ca.cert_file))
    assert optional.ssl_context.verify_mode == ssl.CERT_OPTIONAL
    required = ServerTls(
        settings_for(tmp_path, cert, client_ca_file=ca.cert_file, require_client_cert=True)
    )
    assert required.ssl_context.verify_mode == ssl.CERT_REQUIRED
    assert ServerTls(settings_for(tmp_path, cert)).ssl_context.verify_mode == ssl.CERT_NONE


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        ({"cert_file": "a.crt"}, "tls.cert_file is set but tls.key_file is not"),
        ({"key_file": "a.key"}, "tls.key_file is set but tls.cert_file is not"),
        (
            {"cert_file": "a", "key_file": "b", "require_client_cert": True},
            "tls.require_client_cert needs tls.client_ca_file",
        ),
        ({"client_ca_file": "ca.pem"}, "need tls.cert_file and key_file"),
    ],
)
def test_incomplete_tls_settings_are_errors(tls: dict[str, object], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(environ={}, tls=tls)


def test_public_bind_without_tls_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="sluice.auth")
    tls_on = TlsSettings(cert_file=Path("a"), key_file=Path("b"))
    assert not warn_plaintext_bind("127.0.0.1", TlsSettings())
    assert not warn_plaintext_bind("::1", TlsSettings())
    assert not warn_plaintext_bind("0.0.0.0", tls_on)
    assert caplog.records == []
    assert warn_plaintext_bind("0.0.0.0", TlsSettings())
    assert "binding 0.0.0.0 without TLS" in caplog.text


async def test_reload_drops_a_client_ca_removed_from_the_file(tmp_path: Path, ca: TestCA) -> None:
    # load_verify_locations only adds CAs to a context: the reload swaps in a new context, so a
    # CA taken out of client_ca_file stops being trusted.
    other = TestCA(tmp_path / "other", name="other CA")
    shutil.copy(ca.cert_file, tmp_path / "clients.pem")
    settings = settings_for(
        tmp_path,
        ca.issue("server-a"),
        client_ca_file=tmp_path / "clients.pem",
        require_client_cert=True,
    )
    tls = ServerTls(settings)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(await reader.readline())
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0, ssl=tls.ssl_context)
    port = server.sockets[0].getsockname()[1]

    async def echoes(client: CertFiles) -> bool:
        context = ssl.create_default_context(cafile=ca.cert_file)
        context.load_cert_chain(client.cert, client.key)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
            writer.write(b"hi\n")
            line = await reader.readline()  # TLS 1.3: a refused certificate shows up here
            writer.close()
        except (ssl.SSLError, ConnectionError):
            return False
        return line == b"hi\n"

    ours, theirs = ca.issue("client-a", server=False), other.issue("client-b", server=False)
    try:
        assert await echoes(ours)
        assert not await echoes(theirs)
        shutil.copy(other.cert_file, tmp_path / "clients.pem")
        assert tls.reload()
        assert not await echoes(ours)
        assert await echoes(theirs)
    finally:
        server.close()
        await server.wait_closed()
