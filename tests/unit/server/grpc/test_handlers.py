"""The method handlers (server/grpc/handlers.py): the same RPCs, kinds and messages as the
generated add_GRPCInferenceServiceServicer_to_server, and a request that does not parse becomes
a `Malformed` value instead of an exception inside grpc."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from server.grpc.handlers import SERVICE, Malformed, add_service, deserializer, method_handlers
from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc


class _Recorder:
    """Stands in for a grpc.aio.Server: records what a registration adds."""

    def __init__(self) -> None:
        self.generic: tuple[Any, ...] = ()
        self.registered: dict[str, dict[str, Any]] = {}

    def add_generic_rpc_handlers(self, handlers: tuple[Any, ...]) -> None:
        self.generic += tuple(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.registered[service] = handlers


def test_the_handlers_match_the_generated_ones() -> None:
    servicer = pb_grpc.GRPCInferenceServiceServicer()
    generated, ours = _Recorder(), _Recorder()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, generated)  # type: ignore[no-untyped-call]
    add_service(servicer, ours)
    assert list(ours.registered) == list(generated.registered) == [SERVICE]
    theirs, mine = generated.registered[SERVICE], ours.registered[SERVICE]
    assert sorted(mine) == sorted(theirs)
    assert len(mine) == 20
    for name, handler in mine.items():
        expected = theirs[name]
        assert (handler.request_streaming, handler.response_streaming) == (
            expected.request_streaming,
            expected.response_streaming,
        ), name
        assert handler.response_serializer == expected.response_serializer, name
        # The same message type: a valid request parses to what the generated one gives.
        message = expected.request_deserializer(b"")
        assert type(handler.request_deserializer(b"")) is type(message), name
    assert len(ours.generic) == len(generated.generic) == 1


def test_a_valid_message_parses_as_before() -> None:
    request = pb.ModelInferRequest(model_name="demo", id="7")
    request.raw_input_contents.append(b"\x01\x02")
    parsed = deserializer("ModelInfer", pb.ModelInferRequest)(request.SerializeToString())
    assert parsed == request


@pytest.mark.parametrize(
    "raw",
    [b"\xff\xff\xff", b"\x0a\x05ab", b"\x0a\x01\xff", b"\x3a\xff\xff\xff\xff\x0f"],
    ids=["bad-tag", "truncated", "bad-utf8", "huge-length"],
)
def test_bytes_that_do_not_parse_are_malformed(raw: bytes) -> None:
    parsed = deserializer("ModelInfer", pb.ModelInferRequest)(raw)
    assert parsed == Malformed("ModelInfer", "inference.ModelInferRequest", len(raw))
    assert isinstance(parsed, Malformed)
    error = parsed.error()
    assert error.message == (
        f"gRPC ModelInfer: the request message could not be parsed as "
        f"inference.ModelInferRequest ({len(raw)} bytes); send a serialized "
        f"inference.ModelInferRequest"
    )


def test_every_rpc_parses_through_a_guarded_deserializer() -> None:
    handlers = method_handlers(pb_grpc.GRPCInferenceServiceServicer())
    for name, handler in handlers.items():
        assert isinstance(handler, grpc.RpcMethodHandler)
        assert isinstance(handler.request_deserializer(b"\xff\xff\xff"), Malformed), name
