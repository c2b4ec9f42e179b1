"""deploy/nginx.conf in a real nginx, in front of two real (scripted) HTTP replicas."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from server.settings import Settings
from tests.nginx_process import NGINX_CONF, NginxProcess, adapt_config
from tests.redis_process import free_port
from tests.unit.deploy.scripted_replica import ScriptedReplica
from tests.unit.deploy.tools import ROOT

MiB = 1024 * 1024


@pytest.fixture
def replicas() -> Iterator[tuple[ScriptedReplica, ScriptedReplica]]:
    a, b = ScriptedReplica("a"), ScriptedReplica("b")
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture
def nginx(tmp_path: Path, replicas: tuple[ScriptedReplica, ScriptedReplica]) -> Iterator[str]:
    """The balancer's base URL, nginx running deploy/nginx.conf in front of `replicas`."""
    a, b = replicas
    http_port, grpc_port = free_port(), free_port()
    text = adapt_config(
        NGINX_CONF.read_text(),
        tmp_path,
        {"sluice-a": (a.port, free_port()), "sluice-b": (b.port, free_port())},
        http_port,
        grpc_port,
    )
    process = NginxProcess(tmp_path, text, http_port, grpc_port)
    process.start()
    yield f"http://127.0.0.1:{http_port}"
    process.stop()


def infer(base_url: str, count: int, **headers: str) -> list[httpx.Response]:
    with httpx.Client(base_url=base_url, timeout=10) as client:
        return [
            client.post("/v2/models/m/infer", content=b'{"inputs": []}', headers=headers)
            for _ in range(count)
        ]


def test_config_passes_nginx_t(tmp_path: Path) -> None:
    ports = {"sluice-a": (free_port(), free_port()), "sluice-b": (free_port(), free_port())}
    text = adapt_config(NGINX_CONF.read_text(), tmp_path, ports, free_port(), free_port())
    result = NginxProcess(tmp_path, text, 0, 0).check()
    assert result.returncode == 0, result.stderr
    assert "syntax is ok" in result.stderr
    assert "test is successful" in result.stderr


def test_body_limit_is_sluices_max_request_bytes() -> None:
    found = re.findall(r"^\s*client_max_body_size (\d+)m;", NGINX_CONF.read_text(), re.MULTILINE)
    assert [int(size) * MiB for size in found] == [Settings().max_request_bytes]


def test_upstream_idle_connections_close_before_sluice_closes_them() -> None:
    upstream = re.search(r"upstream sluice_http \{(.*?)\}", NGINX_CONF.read_text(), re.DOTALL)
    assert upstream
    nginx_idle = re.search(r"keepalive_timeout (\d+)s;", upstream[1])
    server = (ROOT / "server" / "server.py").read_text()
    sluice_idle = re.search(r"timeout_keep_alive=(\d+)", server)
    assert nginx_idle
    assert sluice_idle
    assert int(nginx_idle[1]) < int(sluice_idle[1])


def test_proxied_replies_come_from_both_replicas_over_pooled_connections(
    nginx: str, replicas: tuple[ScriptedReplica, ScriptedReplica]
) -> None:
    a, b = replicas
    responses = infer(nginx, 30, **{"X-Request-ID": "req-42"})
    assert [r.status_code for r in responses] == [200] * 30
    assert {r.json()["replica"] for r in responses} == {"a", "b"}
    assert a.hits + b.hits == 30
    # Keep-alive upstream pools: a handful of connections (per nginx worker), not one per request.
    assert len(a.peers) + len(b.peers) <= 8
    assert {h["X-Request-ID"] for h in a.seen_headers + b.seen_headers} == {"req-42"}


def test_a_503_is_retried_on_the_other_replica(
    nginx: str, replicas: tuple[ScriptedReplica, ScriptedReplica]
) -> None:
    a, b = replicas
    a.status, a.headers = 503, {"Retry-After": "1"}
    responses = infer(nginx, 10)
    assert [r.status_code for r in responses] == [200] * 10
    assert {r.json()["replica"] for r in responses} == {"b"}
    assert a.hits >= 1  # it was asked, refused, and the POST went on to b
    assert b.hits == 10


def test_a_replica_that_is_gone_is_skipped(
    nginx: str, replicas: tuple[ScriptedReplica, ScriptedReplica]
) -> None:
    a, b = replicas
    a.stop()
    responses = infer(nginx, 10)
    assert [r.status_code for r in responses] == [200] * 10
    assert b.hits == 10


@pytest.mark.parametrize(("status", "retry_after"), [(429, "3"), (500, None), (504, None)])
def test_other_errors_are_not_retried(
    nginx: str,
    replicas: tuple[ScriptedReplica, ScriptedReplica],
    status: int,
    retry_after: str | None,
) -> None:
    for replica in replicas:
        replica.status = status
        replica.headers = {"Retry-After": retry_after} if retry_after else {}
    responses = infer(nginx, 6)
    assert [r.status_code for r in responses] == [status] * 6
    assert [r.headers.get("Retry-After") for r in responses] == [retry_after] * 6
    assert sum(replica.hits for replica in replicas) == 6


def test_all_replicas_refusing_passes_their_503_and_retry_after_through(
    nginx: str, replicas: tuple[ScriptedReplica, ScriptedReplica]
) -> None:
    for replica in replicas:
        replica.status, replica.headers = 503, {"Retry-After": "5"}
    (response,) = infer(nginx, 1)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "5"
    assert [replica.hits for replica in replicas] == [1, 1]


def test_no_reachable_replica_is_a_503_with_retry_after(
    nginx: str, replicas: tuple[ScriptedReplica, ScriptedReplica]
) -> None:
    for replica in replicas:
        replica.stop()
    (response,) = infer(nginx, 1)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    assert "no sluice replica" in response.json()["error"]


def test_an_oversized_body_is_refused_before_any_replica_sees_it(
    nginx: str, replicas: tuple[ScriptedReplica, ScriptedReplica]
) -> None:
    port = int(nginx.rsplit(":", 1)[1])
    too_big = Settings().max_request_bytes + 1
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {too_big}\r\n\r\n".encode()
        )
        status_line = sock.recv(4096).split(b"\r\n", 1)[0]
    assert status_line == b"HTTP/1.1 413 Request Entity Too Large"
    assert sum(replica.hits for replica in replicas) == 0


def test_metrics_are_not_served_through_the_balancer(
    nginx: str, replicas: tuple[ScriptedReplica, ScriptedReplica]
) -> None:
    with httpx.Client(base_url=nginx, timeout=10) as client:
        assert client.get("/metrics").status_code == 404
        assert client.get("/v2/health/ready").status_code == 200
    assert sum(replica.hits for replica in replicas) == 1
