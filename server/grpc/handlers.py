"""How grpc reaches the servicer: the method handlers of `inference.GRPCInferenceService`, built
from the service's descriptor as the generated `add_GRPCInferenceServiceServicer_to_server`
builds them, with one difference: a request message that does not parse reaches the servicer as
a `Malformed` value instead of raising in grpc.

grpc parses each request with the handler's deserializer before calling the servicer, and when
that raises, grpc.aio logs a traceback and answers UNKNOWN "Unexpected <class 'DecodeError'>",
for every such call and before the servicer can check a key. With `Malformed`, the servicer
answers INVALID_ARGUMENT naming the method, after the key check, with a rate-limited log line
(server/grpc/service.py; a stream: server/grpc/stream.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from engine.errors import InvalidInput
from server.grpc.proto import grpc_service_pb2 as pb

SERVICE = "inference.GRPCInferenceService"

_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True, slots=True)
class Malformed:
    """A request message of `method` that is not a valid `message_type` (protobuf could not
    parse its `size_bytes` bytes)."""

    method: str
    message_type: str
    size_bytes: int

    def error(self) -> InvalidInput:
        """The error the call answers (INVALID_ARGUMENT)."""
        return InvalidInput(
            f"gRPC {self.method}: the request message could not be parsed as "
            f"{self.message_type} ({self.size_bytes} bytes); send a serialized "
            f"{self.message_type}"
        )


def deserializer(method: str, message: type[Message]) -> Callable[[bytes], Message | Malformed]:
    """`message.FromString`, or a `Malformed` value for bytes that are not a `message`."""
    parse = message.FromString
    name = message.DESCRIPTOR.full_name

    def deserialize(raw: bytes) -> Message | Malformed:
        try:
            return parse(raw)
        except DecodeError:  # the only error protobuf raises for bad bytes (upb and Python)
            return Malformed(method, name, len(raw))

    return deserialize


def method_handlers(servicer: Any) -> dict[str, grpc.RpcMethodHandler]:
    """Every RPC of the service, by name, bound to `servicer`'s method of that name."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name[SERVICE.split(".")[1]].methods:
        request: type[Message] = getattr(pb, method.input_type.name)
        response: type[Message] = getattr(pb, method.output_type.name)
        # All of the service's messages are top-level in grpc_service.proto; say so if not.
        assert request.DESCRIPTOR is method.input_type, method.input_type.full_name
        assert response.DESCRIPTOR is method.output_type, method.output_type.full_name
        kind = _KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=deserializer(method.name, request),
            response_serializer=response.SerializeToString,
        )
    return handlers


def add_service(servicer: Any, server: grpc.aio.Server) -> None:
    """Serve `servicer` on `server`, as the generated add_..._to_server does (a generic handler
    and the registered-method fast path)."""
    handlers = method_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)
