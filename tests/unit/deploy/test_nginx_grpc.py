"""deploy/nginx.conf's gRPC side (grpc_pass over HTTP/2) in a real nginx, two real gRPC replicas."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tests.nginx_process import NGINX_CONF, NginxProcess, adapt_config
from tests.redis_process import free_port

METHOD = "/inference.GRPCInferenceService/ServerReady"


class GrpcReplica:
    """A grpc server whose one unary method answers with the replica's name (raw bytes)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0
        self.server = grpc.server(ThreadPoolExecutor(max_workers=4))

        def answer(request: bytes, context: grpc.ServicerContext) -> bytes:
            self.calls += 1
            return self.name.encode() + b":" + request

        handler = grpc.unary_unary_rpc_method_handler(answer)
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(METHOD.split("/")[1], {"ServerReady": handler}),)
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(None).wait()


@pytest.fixture
def grpc_replicas() -> Iterator[tuple[GrpcReplica, GrpcReplica]]:
    a, b = GrpcReplica("a"), GrpcReplica("b")
    yield a, b
    a.stop()
    b.stop()


@pytest.fixture
def channel(
    tmp_path: Path, grpc_replicas: tuple[GrpcReplica, GrpcReplica]
) -> Iterator[grpc.Channel]:
    """A channel to nginx's gRPC port, nginx running deploy/nginx.conf in front of the replicas."""
    a, b = grpc_replicas
    http_port, grpc_port = free_port(), free_port()
    text = adapt_config(
        NGINX_CONF.read_text(),
        tmp_path,
        {"sluice-a": (free_port(), a.port), "sluice-b": (free_port(), b.port)},
        http_port,
        grpc_port,
    )
    nginx = NginxProcess(tmp_path, text, http_port, grpc_port)
    nginx.start()
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as chan:
        yield chan
    nginx.stop()


def call(channel: grpc.Channel, payload: bytes) -> bytes:
    result = channel.unary_unary(METHOD)(payload, timeout=10)
    assert isinstance(result, bytes)
    return result


def test_grpc_is_proxied_to_both_replicas(
    channel: grpc.Channel, grpc_replicas: tuple[GrpcReplica, GrpcReplica]
) -> None:
    answers = [call(channel, f"{i}".encode()) for i in range(10)]
    assert sorted(answer.split(b":")[1] for answer in answers) == sorted(
        f"{i}".encode() for i in range(10)
    )
    assert {answer.split(b":")[0] for answer in answers} == {b"a", b"b"}
    assert sum(replica.calls for replica in grpc_replicas) == 10


def test_grpc_skips_a_replica_that_is_gone(
    channel: grpc.Channel, grpc_replicas: tuple[GrpcReplica, GrpcReplica]
) -> None:
    a, b = grpc_replicas
    a.stop()
    answers = [call(channel, b"x") for _ in range(6)]
    assert answers == [b"b:x"] * 6
    assert b.calls == 6


def test_grpc_with_no_replica_is_unavailable(
    channel: grpc.Channel, grpc_replicas: tuple[GrpcReplica, GrpcReplica]
) -> None:
    for replica in grpc_replicas:
        replica.stop()
    with pytest.raises(grpc.RpcError) as caught:
        call(channel, b"x")
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no sluice replica" in (caught.value.details() or "")
