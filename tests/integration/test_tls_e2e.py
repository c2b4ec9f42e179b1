"""TLS and mTLS against a real `sluice serve`: tritonclient over HTTPS and gRPC with TLS, client
certificates, and certificates replaced on SIGHUP without dropping open connections.

The CA and every certificate are made by the test (tests/tls_certs.py). tritonclient.grpc cannot
be imported in the pytest process (see test_tritonclient.py), so its calls run in a child process:
this file run as a script."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.servers import ServerProcess
from tests.tls_certs import CertFiles, TestCA, peer_serial

INPUT = np.arange(32, dtype=np.float32).reshape(2, 16) / 32


class TlsServer(ServerProcess):
    """`sluice serve` with TLS on: ready once /v2/health/ready answers over HTTPS."""

    def __init__(self, *args: str, ca: TestCA, client: CertFiles | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ca = ca
        self.client = client

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.http_port}"

    def context(self, client: CertFiles | None = None) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca.cert_file)
        if client is not None:
            context.load_cert_chain(client.cert, client.key)
        return context

    def start(self, timeout_s: float = 60.0, ready: bool = True) -> TlsServer:
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(self.args, env=self.env, stdout=self._log, stderr=self._log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sluice exited with {self.process.returncode}: {self.logs()}")
            try:
                response = httpx.get(
                    f"{self.url}/v2/health/ready", verify=self.context(self.client), timeout=1.0
                )
                if response.status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"sluice did not become ready in {timeout_s} s: {self.logs()}")


def tls_args(folder: Path, server: CertFiles, ca: TestCA | None = None) -> list[str]:
    """Flags for a server whose certificate files are copies in `folder` (tests replace them)."""
    shutil.copy(server.cert, folder / "server.crt")
    shutil.copy(server.key, folder / "server.key")
    args = [
        "--tls-cert-file",
        str(folder / "server.crt"),
        "--tls-key-file",
        str(folder / "server.key"),
    ]
    if ca is not None:
        args += ["--tls-client-ca-file", str(ca.cert_file)]
    return args


@pytest.fixture
def ca(tmp_path: Path) -> TestCA:
    return TestCA(tmp_path / "ca")


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    """One server for the module's mTLS tests: they only connect, with or without a certificate."""
    folder = tmp_path_factory.mktemp("mtls")
    ca = TestCA(folder / "ca")
    client = ca.issue("client-a", server=False)
    args = tls_args(folder, ca.issue("server-a"), ca)
    env = {"SLUICE_TLS__REQUIRE_CLIENT_CERT": "true"}
    server = TlsServer(*args, ca=ca, client=client, env=env, log_path=folder / "server.log")
    yield server.start()
    server.stop()


# -- gRPC, in a child process ---------------------------------------------------------------------


def grpc_calls(url: str, root: str, key: str | None, chain: str | None) -> dict[str, Any]:
    """tritonclient.grpc over TLS with the given files; runs in the child process."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(
        url, ssl=True, root_certificates=root, private_key=key, certificate_chain=chain
    )
    try:
        live = client.is_server_live(client_timeout=10)
        infer_input = grpcclient.InferInput("x", list(INPUT.shape), "FP32")
        infer_input.set_data_from_numpy(INPUT)
        result = client.infer("demo", [infer_input], client_timeout=10)
        return {"live": live, "probabilities": result.as_numpy("probabilities").tolist()}
    except InferenceServerException as exc:
        return {"error": str(exc.status()), "message": exc.message()}
    finally:
        client.close()


def run_grpc(url: str, root: Path, client: CertFiles | None) -> dict[str, Any]:
    files = [str(root), str(client.key) if client else "", str(client.cert) if client else ""]
    done = subprocess.run(
        [sys.executable, "-m", "tests.integration.test_tls_e2e", url, *files],
        capture_output=True,
        timeout=90,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result


# -- mTLS with tritonclient ------------------------------------------------------------------------


def test_tritonclient_http_over_mtls(mtls_server: TlsServer) -> None:
    import tritonclient.http as httpclient

    server = mtls_server
    assert server.client is not None

    def factory() -> ssl.SSLContext:
        return server.context(server.client)

    client = httpclient.InferenceServerClient(
        f"127.0.0.1:{server.http_port}", ssl=True, ssl_context_factory=factory
    )
    try:
        assert client.is_server_live()
        infer_input = httpclient.InferInput("x", list(INPUT.shape), "FP32")
        infer_input.set_data_from_numpy(INPUT)
        result = client.infer("demo", [infer_input])
        probabilities = result.as_numpy("probabilities")
        assert probabilities.shape == (2, 10)
        np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)
    finally:
        client.close()


def test_http_client_without_a_certificate_is_refused(mtls_server: TlsServer) -> None:
    with pytest.raises((ssl.SSLError, httpx.TransportError)):
        # TLS 1.3 sends the server's refusal after the client's handshake finished: the
        # request (or its response) fails instead.
        httpx.get(f"{mtls_server.url}/v2/health/live", verify=mtls_server.context(), timeout=5)
    other_ca = TestCA(mtls_server.ca.folder / "other", name="other CA")
    stranger = other_ca.issue("stranger", server=False)
    with pytest.raises((ssl.SSLError, httpx.TransportError)):
        httpx.get(
            f"{mtls_server.url}/v2/health/live", verify=mtls_server.context(stranger), timeout=5
        )
    ok = httpx.get(
        f"{mtls_server.url}/v2/health/live",
        verify=mtls_server.context(mtls_server.client),
        timeout=5,
    )
    assert ok.status_code == 200


def test_tritonclient_grpc_over_mtls(mtls_server: TlsServer) -> None:
    result = run_grpc(mtls_server.grpc_url, mtls_server.ca.cert_file, mtls_server.client)
    assert result.get("live") is True, result
    probabilities = np.array(result["probabilities"])
    assert probabilities.shape == (2, 10)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, rtol=1e-5)


def test_grpc_client_without_a_certificate_is_refused(mtls_server: TlsServer) -> None:
    result = run_grpc(mtls_server.grpc_url, mtls_server.ca.cert_file, None)
    assert result.get("error") == "StatusCode.UNAVAILABLE", result


# -- certificates replaced on SIGHUP ---------------------------------------------------------------


def served_serial(port: int, context: ssl.SSLContext, alpn: str | None = None) -> int:
    """The serial of the certificate a fresh TLS handshake on `port` gets."""
    if alpn is not None:
        context.set_alpn_protocols([alpn])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        return peer_serial(der)


def wait_for_serial(port: int, context: ssl.SSLContext, serial: int, alpn: str | None) -> None:
    deadline = time.monotonic() + 10
    while (seen := served_serial(port, context, alpn)) != serial:
        assert time.monotonic() < deadline, f"still served serial {seen}, expected {serial}"
        time.sleep(0.05)


def test_sighup_reloads_certificates_and_keeps_open_connections(tmp_path: Path, ca: TestCA) -> None:
    first, second = ca.issue("server-a"), ca.issue("server-b")
    server = TlsServer(
        *tls_args(tmp_path, first), ca=ca, client=None, log_path=tmp_path / "server.log"
    ).start()
    try:
        assert served_serial(server.http_port, server.context()) == first.serial
        assert served_serial(server.grpc_port, server.context(), "h2") == first.serial
        kept = http.client.HTTPSConnection("localhost", server.http_port, context=server.context())
        kept.request("GET", "/v2/health/live")
        assert kept.getresponse().read() == b'{"live":true}'

        shutil.copy(second.cert, tmp_path / "server.crt")
        shutil.copy(second.key, tmp_path / "server.key")
        assert server.process is not None
        server.process.send_signal(signal.SIGHUP)
        wait_for_serial(server.http_port, server.context(), second.serial, None)
        wait_for_serial(server.grpc_port, server.context(), second.serial, "h2")

        # The connection opened before the reload still works, on its old certificate.
        kept.request("GET", "/v2/health/live")
        assert kept.getresponse().read() == b'{"live":true}'
        assert kept.sock is not None
        assert peer_serial(kept.sock.getpeercert(binary_form=True)) == first.serial
        kept.close()

        # A broken replacement keeps the certificate in use.
        (tmp_path / "server.key").write_text("not a key")
        server.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "TLS certificates not reloaded" not in server.logs():
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.05)
        assert served_serial(server.http_port, server.context()) == second.serial
        assert served_serial(server.grpc_port, server.context(), "h2") == second.serial
    finally:
        server.stop()


def serve_fails(*args: str, env: dict[str, str] | None = None) -> str:
    """Run `sluice serve` expecting it to refuse to start; its stderr."""
    done = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--http-port", "0", "--grpc-port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode != 0, done.stderr
    return done.stderr


@pytest.mark.parametrize("workers", ["1", "2"])  # 2: each worker failed, restarted for good
def test_unusable_tls_files_fail_the_start(tmp_path: Path, ca: TestCA, workers: str) -> None:
    args = [*tls_args(tmp_path, ca.issue("server-a")), "--workers", workers]
    (tmp_path / "server.crt").unlink()
    assert re.search(r"cannot read tls\.cert_file \S*server\.crt: No such file", serve_fails(*args))
    other = ca.issue("server-b")
    shutil.copy(other.cert, tmp_path / "server.crt")
    shutil.copy(ca.issue("server-c").key, tmp_path / "server.key")
    assert "do not make a certificate and its key" in serve_fails(*args)


def test_incomplete_tls_settings_fail_the_start(tmp_path: Path, ca: TestCA) -> None:
    cert = ca.issue("server-a")
    stderr = serve_fails("--tls-cert-file", str(cert.cert))
    assert "tls.cert_file is set but tls.key_file is not" in stderr
    stderr = serve_fails(
        "--tls-cert-file", str(cert.cert), "--tls-key-file", str(cert.key),
        env={"SLUICE_TLS__REQUIRE_CLIENT_CERT": "true"},
    )  # fmt: skip
    assert "tls.require_client_cert needs tls.client_ca_file" in stderr


if __name__ == "__main__":
    url, root, key, chain = sys.argv[1:5]
    print(json.dumps(grpc_calls(url, root, key or None, chain or None)))
