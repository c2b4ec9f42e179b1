"""The gRPC front-end: `inference.GRPCInferenceService` (Open Inference Protocol plus Triton's
extensions) on grpc.aio, answering from the engine facade only.

Every RPC but ServerLive/ServerReady authenticates the caller from the `authorization`
("Bearer <key>") or `x-api-key` metadata. Engine errors become the status code of the one table
in server/errors.py with the engine's message, plus trailing metadata such as `retry-after`.
Malformed tensors (raw contents of the wrong size, contents that disagree with the shape, an
unknown datatype) are INVALID_ARGUMENT with a message naming the input. A request message that
does not parse at all is INVALID_ARGUMENT too, naming the method, once the caller's key is checked
(server/grpc/handlers.py), with at most one log line per method per MALFORMED_LOG_INTERVAL_S.

Every call carries a request id: the caller's `x-request-id` metadata when it is sane, else a
fresh one; it is on every log line about the call and comes back as trailing metadata
`x-request-id`. Inference requests (unary, and each message of a stream) are counted in the
metrics with protocol `grpc` and the HTTP-equivalent status code.

This module is the servicer and its server; what each call goes through around its RPC (context,
request id, error status) is server/grpc/calls.py, a ModelInfer request as the data plane sees it
is server/grpc/infer.py, how grpc calls the servicer (and parses requests) is
server/grpc/handlers.py, and a ModelStreamInfer stream (its bound, order, errors and end) is
server/grpc/stream.py.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NoReturn, TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from engine.errors import BackendError, EngineError
from engine.facade import EngineFacade
from engine.settings import SettingsError
from server.dataplane import DataPlane
from server.errors import INTERNAL_ERROR
from server.grpc import tensors
from server.grpc.calls import Context, abort, bind_request_id, fail, metadata
from server.grpc.handlers import Malformed, add_service
from server.grpc.infer import GrpcCall
from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc
from server.grpc.proto import model_config_pb2
from server.grpc.stream import InferStream
from server.ledger import Metadata
from server.logs import request_id
from server.settings import Settings

log = logging.getLogger("sluice.grpc")

Req = TypeVar("Req")
Resp = TypeVar("Resp")
Method = Callable[["GrpcService", Req, Context, Metadata], Awaitable[Resp]]
"""A servicer method as written here: it also gets the call's metadata, read once."""
Handler = Callable[["GrpcService", Req, Context], Awaitable[Resp | None]]
"""A servicer method as grpc calls it."""
UNIMPLEMENTED_LOG_INTERVAL_S = 60.0
"""At most one log line per unimplemented RPC per this many seconds (callers can repeat them)."""
MALFORMED_LOG_INTERVAL_S = 60.0
"""At most one log line per RPC per this many seconds about request messages that do not parse."""
PUBLIC_RPCS = frozenset({"ServerLive", "ServerReady"})
"""The RPCs that need no API key (health probes)."""


def _guarded(method: Method[Req, Resp]) -> Handler[Req, Resp]:
    """Read the call's metadata once and bind its request id; map engine errors to gRPC
    statuses; anything else is logged and answered INTERNAL."""

    @functools.wraps(method)
    async def wrapper(self: GrpcService, request: Req, context: Context) -> Resp | None:
        self._clock.last_call_at = time.monotonic()
        caller = metadata(context)
        token = request_id.set(bind_request_id(context, caller))
        try:
            if isinstance(request, Malformed):  # grpc could not parse it (server/grpc/handlers.py)
                if method.__name__ not in PUBLIC_RPCS:
                    self._plane.authenticate(caller)
                raise self._refusal(request)
            return await method(self, request, context, caller)
        except EngineError as exc:
            fail(context, exc)
        except grpc.aio.AbortError:
            raise
        except Exception:  # a bug (inference's own are logged and mapped by the data plane)
            log.exception("gRPC %s failed", method.__name__)
            fail(context, BackendError(INTERNAL_ERROR))
        finally:
            request_id.reset(token)
        return None  # the status set above ends the call; grpc sends no message with it

    return wrapper


class _LogThrottle:
    """At most one log line per key per interval; each line says how many it stood in for."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._next: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def due(self, key: str) -> int | None:
        """None when `key` was logged within the interval, else the count skipped since."""
        now = time.monotonic()
        if now < self._next.get(key, 0.0):
            self._skipped[key] = self._skipped.get(key, 0) + 1
            return None
        self._next[key] = now + self._interval_s
        return self._skipped.pop(key, 0)


def _unimplemented(name: str, why: str) -> Handler[Message, NoReturn]:
    """An RPC sluice does not serve: authenticated like the others, then UNIMPLEMENTED, with one
    log line per interval instead of grpc's traceback per call."""

    async def method(
        self: GrpcService, request: Message, context: Context, caller: Metadata
    ) -> NoReturn:
        self._plane.authenticate(caller)
        skipped = self._unimplemented_log.due(name)
        if skipped is not None:
            log.warning(
                "gRPC %s called; it is not implemented (answered UNIMPLEMENTED; %d more such "
                "calls since the last line)",
                name,
                skipped,
            )
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, f"sluice does not implement {name}: {why}"
        )

    method.__name__ = method.__qualname__ = name
    return _guarded(method)


class GrpcService(pb_grpc.GRPCInferenceServiceServicer):
    """The servicer: every RPC of `inference.GRPCInferenceService` over the data plane; those
    sluice does not serve (trace and log settings) answer UNIMPLEMENTED.

    `stream_max_pending` bounds each ModelStreamInfer stream: requests running plus answers not
    yet sent to the client. At the bound the stream is not read, so HTTP/2 flow control holds
    the client's writes until it reads its answers."""

    def __init__(
        self, plane: DataPlane, stream_max_pending: int = 64, clock: CallClock | None = None
    ) -> None:
        self._plane = plane
        self._clock = clock if clock is not None else CallClock()
        self._stream_max_pending = stream_max_pending
        self._unimplemented_log = _LogThrottle(UNIMPLEMENTED_LOG_INTERVAL_S)
        self._malformed_log = _LogThrottle(MALFORMED_LOG_INTERVAL_S)

    def _refusal(self, malformed: Malformed) -> EngineError:
        """The error a request that did not parse answers, logged once per method and interval
        (a client sending garbage would otherwise fill the log)."""
        skipped = self._malformed_log.due(malformed.method)
        if skipped is not None:
            log.warning(
                "gRPC %s: a request message could not be parsed as %s (answered "
                "INVALID_ARGUMENT; %d more such calls since the last line)",
                malformed.method,
                malformed.message_type,
                skipped,
            )
        return malformed.error()

    # -- health and metadata ---------------------------------------------------------------------

    @_guarded
    async def ServerLive(
        self, request: pb.ServerLiveRequest, context: Context, caller: Metadata
    ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self._plane.live)

    @_guarded
    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: Context, caller: Metadata
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self._plane.ready_now())

    @_guarded
    async def ModelReady(
        self, request: pb.ModelReadyRequest, context: Context, caller: Metadata
    ) -> pb.ModelReadyResponse:
        ready = await self._plane.model_ready(caller, request.name, request.version or None)
        return pb.ModelReadyResponse(ready=ready)

    @_guarded
    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Context, caller: Metadata
    ) -> pb.ServerMetadataResponse:
        meta = self._plane.server_metadata(caller)
        return pb.ServerMetadataResponse(
            name=meta["name"], version=meta["version"], extensions=meta["extensions"]
        )

    @_guarded
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: Context, caller: Metadata
    ) -> pb.ModelMetadataResponse:
        meta = await self._plane.model_metadata(caller, request.name, request.version or None)
        return tensors.metadata_response(meta)

    # -- inference -------------------------------------------------------------------------------

    @_guarded
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: Context, caller: Metadata
    ) -> pb.ModelInferResponse:
        return await self._plane.infer(GrpcCall(request, context, caller))

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest | Malformed], context: Context
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Each request is answered as soon as it completes (out of order, matched by `id`); a
        failed request answers `error_message` and the stream carries on; at most
        `stream_max_pending` requests are running or answered-but-unsent; a message that does
        not parse ends the stream with INVALID_ARGUMENT once those read before it are answered
        (server/grpc/stream.py says what a stream guarantees)."""
        self._clock.last_call_at = time.monotonic()
        stream = InferStream(self._plane, context, self._stream_max_pending)
        # aclosing: when grpc closes this generator (the client left), the stream ends at once.
        async with contextlib.aclosing(stream.answers(request_iterator)) as answers:
            async for answer in answers:
                yield answer
        if stream.malformed is not None:  # answered what it read before, then ends
            await abort(context, self._refusal(stream.malformed))

    # -- Triton extensions -----------------------------------------------------------------------

    TraceSetting = _unimplemented(
        "TraceSetting", "tracing is set by the server's `tracing` settings at start"
    )
    LogSettings = _unimplemented(
        "LogSettings", "logging is set by the server's `log_level` and `log_format` at start"
    )

    @_guarded
    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: Context, caller: Metadata
    ) -> pb.ModelConfigResponse:
        config = await self._plane.model_config(caller, request.name, request.version or None)
        message = model_config_pb2.ModelConfig()
        json_format.ParseDict(config, message, ignore_unknown_fields=True)
        return pb.ModelConfigResponse(config=message)

    @_guarded
    async def ModelStatistics(
        self, request: pb.ModelStatisticsRequest, context: Context, caller: Metadata
    ) -> pb.ModelStatisticsResponse:
        name, version = request.name or None, request.version or None
        stats = await self._plane.statistics(caller, name, version)
        message = pb.ModelStatisticsResponse()
        json_format.ParseDict(stats, message, ignore_unknown_fields=True)
        return message

    @_guarded
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: Context, caller: Metadata
    ) -> pb.RepositoryIndexResponse:
        rows = await self._plane.repository_index(caller, ready_only=request.ready)
        models = [pb.RepositoryIndexResponse.ModelIndex(**row) for row in rows]
        return pb.RepositoryIndexResponse(models=models)

    @_guarded
    async def RepositoryModelLoad(
        self, request: pb.RepositoryModelLoadRequest, context: Context, caller: Metadata
    ) -> pb.RepositoryModelLoadResponse:
        parameters = tensors.parameters(request.parameters)
        await self._plane.load_model(caller, request.model_name, parameters, "grpc")
        return pb.RepositoryModelLoadResponse()

    @_guarded
    async def RepositoryModelUnload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context, caller: Metadata
    ) -> pb.RepositoryModelUnloadResponse:
        names = list(request.parameters)
        await self._plane.unload_model(caller, request.model_name, names, "grpc")
        return pb.RepositoryModelUnloadResponse()

    # -- Triton's system shared-memory extension (engine/regions.py) -----------------------------

    @_guarded
    async def SystemSharedMemoryStatus(
        self, request: pb.SystemSharedMemoryStatusRequest, context: Context, caller: Metadata
    ) -> pb.SystemSharedMemoryStatusResponse:
        rows = await self._plane.shm_status(caller, request.name or None)
        status = pb.SystemSharedMemoryStatusResponse.RegionStatus
        return pb.SystemSharedMemoryStatusResponse(
            regions={row["name"]: status(**row) for row in rows}
        )

    @_guarded
    async def SystemSharedMemoryRegister(
        self, request: pb.SystemSharedMemoryRegisterRequest, context: Context, caller: Metadata
    ) -> pb.SystemSharedMemoryRegisterResponse:
        r = request
        await self._plane.shm_register(caller, r.name, r.key, r.offset, r.byte_size, "grpc")
        return pb.SystemSharedMemoryRegisterResponse()

    @_guarded
    async def SystemSharedMemoryUnregister(
        self, request: pb.SystemSharedMemoryUnregisterRequest, context: Context, caller: Metadata
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        await self._plane.shm_unregister(caller, request.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    # -- Triton's CUDA shared-memory extension (engine/cuda_regions.py) ---------------------------

    @_guarded
    async def CudaSharedMemoryStatus(
        self, request: pb.CudaSharedMemoryStatusRequest, context: Context, caller: Metadata
    ) -> pb.CudaSharedMemoryStatusResponse:
        rows = await self._plane.cuda_shm_status(caller, request.name or None)
        status = pb.CudaSharedMemoryStatusResponse.RegionStatus
        return pb.CudaSharedMemoryStatusResponse(
            regions={row["name"]: status(**row) for row in rows}
        )

    @_guarded
    async def CudaSharedMemoryRegister(
        self, request: pb.CudaSharedMemoryRegisterRequest, context: Context, caller: Metadata
    ) -> pb.CudaSharedMemoryRegisterResponse:
        r = request  # raw_handle: the handle's bytes as they are (base64 is HTTP's)
        await self._plane.cuda_shm_register(
            caller, r.name, r.raw_handle, r.device_id, r.byte_size, "grpc"
        )
        return pb.CudaSharedMemoryRegisterResponse()

    @_guarded
    async def CudaSharedMemoryUnregister(
        self, request: pb.CudaSharedMemoryUnregisterRequest, context: Context, caller: Metadata
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        await self._plane.cuda_shm_unregister(caller, request.name or None)
        return pb.CudaSharedMemoryUnregisterResponse()


def server_options(settings: Settings) -> list[tuple[str, int]]:
    """grpc.aio server options: message size limits, calls open at once per connection (what a
    connection can make the server hold: that many messages of at most the size limit; gRPC's
    default is no limit), and no SO_REUSEPORT (a second server on the same port must fail to
    start, not silently share it) unless the workers share it by design (`workers` > 1:
    server/supervisor.py reserves the port first)."""
    return [
        ("grpc.max_receive_message_length", settings.grpc_max_message_bytes),
        ("grpc.max_send_message_length", settings.grpc_max_message_bytes),
        ("grpc.max_concurrent_streams", settings.grpc_max_concurrent_streams),
        # The limit as HTTP/2 counts it, which clients obey by queueing their further calls.
        # gRPC's default also counts streams that ended but are not yet freed, and refuses a
        # call past that (UNAVAILABLE, "RST_STREAM with error code 7") to a client within the
        # limit: measured in test_calls_past_the_streams_limit_wait_on_their_connection.
        ("grpc.http.overload_protection", 0),
        ("grpc.so_reuseport", int(settings.workers not in (1, "auto"))),
    ]


class CallClock:
    """When the last call arrived. grpc cancels (CANCELLED, which clients do not retry) every
    call that arrives after its server's stop begins, or is still waiting for a handler then,
    so the drain stops the server only once calls have stopped coming (server/server.py).
    The servicer sets it as each call starts: a grpc.aio server interceptor would cost every
    call a coroutine and a handler lookup in Python (about 10 µs, loadtests/benchmarks/
    grpc_floor.py)."""

    def __init__(self) -> None:
        self.last_call_at = time.monotonic()


def build_grpc_server(
    settings: Settings,
    engine: EngineFacade,
    credentials: grpc.ServerCredentials | None = None,
    clock: CallClock | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server (not started) serving `engine` on settings.host:grpc_port, and the
    port it bound (the picked one when grpc_port is 0). Start and stop it in the running loop.
    With `credentials` (server/tls.py) the port speaks TLS only; `clock` sees every call."""
    server = grpc.aio.server(options=server_options(settings))
    servicer = GrpcService(DataPlane(engine, settings), settings.grpc_stream_max_pending, clock)
    add_service(servicer, server)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    address = f"{host}:{settings.grpc_port}"
    try:
        port: int = (
            server.add_secure_port(address, credentials)
            if credentials is not None
            else server.add_insecure_port(address)
        )
    except RuntimeError as exc:
        raise SettingsError(f"cannot listen on {address} for gRPC: {exc}") from exc
    if port == 0:
        raise SettingsError(f"cannot listen on {address} for gRPC")
    return server, port
