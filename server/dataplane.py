"""The data plane: the work every request shares, whichever transport carried it.

HTTP (server/http/infer_route.py, server/http/app.py, server/http/triton.py, and for generation
server/http/openai.py and server/http/triton_generate.py) and gRPC (server/grpc/service.py,
server/grpc/generate.py) convert wire <-> engine types and nothing else; they call one
`DataPlane`, which authenticates and authorizes the caller, calls the engine facade (this
process's `Engine`, or a proxy to the engine process with `--workers`), and times, traces,
counts and logs each request once (server/ledger.py), a generation when its last stream ends
(server/generating.py). Errors stay typed `EngineError`s here (a bug becomes
BackendError(INTERNAL_ERROR), logged with its traceback); each transport renders them through
the one table in server/errors.py.

    plane = DataPlane(engine, settings)
    meta = await plane.model_metadata(headers, "demo", None)  # 401 / 403 / 404 as EngineError
    answer = await plane.infer(call)                          # call: an InferCall of the wire
    call = plane.generation_call(route, "tiny")               # before the body is parsed
    [tokens] = await call.start([GenerateRequest("tiny", call.tenant, "Hello")])

Everything the engine answers is awaited: with `--workers` it is asked of the engine process,
and the worker's event loop serves its other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

from engine.auth import Principal, admin_action, log_admin_action
from engine.errors import BackendError, EngineError, ShuttingDown
from engine.facade import EngineFacade
from engine.types import Checked, InferRequest, InferResponse, ModelMetadata
from engine.validate import InputCheck
from server import shared_tensors
from server.auth_headers import authenticate_headers
from server.bind import metrics_need_key
from server.errors import INTERNAL_ERROR, http_status
from server.generating import GenerationCall, GenerationRoute
from server.ledger import CLIENT_GONE, LOGS, Entry, Headers, Ledger
from server.raw_tensors import OFFLOAD_BYTES
from server.settings import Settings

W = TypeVar("W")
W_co = TypeVar("W_co", covariant=True)

Caller = Headers | Principal
"""Who calls: the headers to authenticate, or a principal the data plane authenticated before
(a transport that must know the caller before it reads a body; each message of a stream)."""


class ClientGone(Exception):
    """The caller disconnected before its answer was ready."""


class InferCall(Entry, Protocol[W_co]):
    """One inference call as a transport holds it: where it came from (its protocol, model and
    access text: server/ledger.py `Entry`) and how to convert it."""

    @property
    def version(self) -> str | None:
        """The version named on the wire, or None for the model's default."""
        ...

    @property
    def headers(self) -> Headers:
        """The caller's headers or metadata: its API key and W3C trace context."""
        ...

    @property
    def span_name(self) -> str:
        """The root span's name."""
        ...

    async def decode(self, check: InputCheck) -> InferRequest:
        """The engine's request; `check` runs on declared shapes before any tensor is built."""
        ...

    def encode(self, response: InferResponse) -> W_co:
        """The wire answer (run in a worker thread when the outputs are large)."""
        ...

    async def wait(self, answer: Awaitable[InferResponse]) -> InferResponse:
        """The engine's answer; may raise ClientGone when the caller leaves first."""
        ...


class DataPlane:
    """Authenticate, authorize, call the engine, time, trace and count: for tensors and for
    generation."""

    def __init__(self, engine: EngineFacade, settings: Settings) -> None:
        self.engine = engine
        self._metrics_need_key = metrics_need_key(settings.host, settings.metrics.require_key)
        self._metrics_what = (
            "/metrics (metrics.require_key)"
            if settings.metrics.require_key
            else f"/metrics on a server bound to {settings.host} (metrics.require_key unset; "
            "metrics.port serves them without a key)"
        )
        self._request_bytes = settings.max_request_bytes
        self.ledger = Ledger(engine)

    # -- identity --------------------------------------------------------------------------------

    def authenticate(self, who: Caller, model: str | None = None) -> Principal:
        """The caller behind `who` (authenticated once: a Principal is taken as it is);
        Forbidden when it may not use `model`."""
        if isinstance(who, Principal):
            if model is not None:
                who.check_model(model)
            return who
        return authenticate_headers(self.engine.authenticator, who, model)

    def repository_caller(self, who: Caller, name: str | None = None) -> Principal:
        """The caller, once it may change the repository (and `name`): before a body is read."""
        caller = self.authenticate(who)
        caller.require_admin("repository")
        if name is not None:
            caller.check_model(name)
        return caller

    # -- health and metadata ---------------------------------------------------------------------

    @property
    def live(self) -> bool:
        """Liveness: the process serves (no key needed)."""
        return self.engine.live

    async def ready_now(self) -> bool:
        """Readiness: started, not draining and (strict readiness) every model asked for serves,
        as the engine holds it now, so every worker answers as one process does (no key
        needed)."""
        return await self.engine.ready_now()

    @property
    def draining(self) -> bool:
        """A drain has begun: new requests are refused."""
        return self.engine.draining

    def server_metadata(self, who: Caller) -> dict[str, Any]:
        """Name, version and extensions, for any valid key."""
        self.authenticate(who)
        return self.engine.server_metadata()

    async def model_metadata(self, who: Caller, name: str, version: str | None) -> ModelMetadata:
        """A model's tensors, for a caller that may use it; ModelNotFound when unknown."""
        self.authenticate(who, name)
        return await self.engine.model_metadata(name, version)

    async def model_ready(
        self, who: Caller, name: str, version: str | None, unknown_is_error: bool = False
    ) -> bool:
        """Whether the model version serves; an unknown one is not ready, or (HTTP, with
        `unknown_is_error`) ModelNotFound."""
        self.authenticate(who, name)
        if unknown_is_error:
            await self.engine.model_metadata(name, version)
        return await self.engine.model_ready(name, version)

    async def usage(self, who: Caller) -> dict[str, Any]:
        """The caller's own quotas, buckets and slots."""
        return await self.engine.usage(self.authenticate(who).tenant)

    async def metrics(self, who: Caller) -> bytes:
        """The Prometheus exposition; for admin keys only when `metrics.require_key` says so,
        or, unset, when the server binds beyond loopback (server.bind.metrics_need_key)."""
        if self._metrics_need_key:
            self.authenticate(who).require_admin_role(self._metrics_what)
        return await self.engine.metrics.exposition()

    # -- Triton extensions -----------------------------------------------------------------------

    async def model_config(self, who: Caller, name: str, version: str | None) -> dict[str, Any]:
        """The effective config in Triton's JSON shape (the `config` admin group)."""
        caller = self.authenticate(who)
        caller.require_admin("config")
        caller.check_model(name)
        return await self.engine.model_config(name, version)

    async def statistics(
        self, who: Caller, name: str | None = None, version: str | None = None
    ) -> dict[str, Any]:
        """Triton statistics of the models the caller may use (the `statistics` group)."""
        caller = self.authenticate(who)
        caller.require_admin("statistics")
        if name is not None:
            caller.check_model(name)
        stats = await self.engine.statistics(name, version)
        return {"model_stats": [s for s in stats["model_stats"] if caller.may_use(s["name"])]}

    async def repository_index(self, who: Caller, ready_only: bool) -> list[dict[str, str]]:
        """The repository's models (the `repository` group)."""
        self.repository_caller(who)
        return await self.engine.repository_index(ready_only=ready_only)

    async def load_model(
        self, who: Caller, name: str, parameters: Mapping[str, Any], protocol: str
    ) -> None:
        """Load or reload a model (the `repository` group), with an audit line; `parameters`
        are Triton's load parameters as plain values (a `config` JSON string)."""
        caller = self.repository_caller(who, name)
        with admin_action(caller, "load", model=name, protocol=protocol):
            await self.engine.load_model(name, parameters)

    async def unload_model(
        self, who: Caller, name: str, parameters: Iterable[str], protocol: str
    ) -> None:
        """Unload a model (the `repository` group), with an audit line."""
        caller = self.repository_caller(who, name)
        with admin_action(caller, "unload", model=name, protocol=protocol):
            await self.engine.unload_model(name, list(parameters))

    # -- Triton's system shared-memory extension ---------------------------------------------------

    async def shm_register(
        self, who: Caller, name: str, key: str, offset: Any, byte_size: Any, protocol: str
    ) -> None:
        """Register file `key` of /dev/shm as the caller's region `name` (engine/regions.py)."""
        caller = self.authenticate(who)
        regions = self.engine.regions
        await regions.register(caller.tenant, caller.key_name, name, key, offset, byte_size)
        log_admin_action(caller, "shm_register", region=name, shm_key=key, protocol=protocol)

    async def shm_unregister(self, who: Caller, name: str | None) -> None:
        """Drop the caller's region `name`, or all its regions when `name` is None or empty."""
        caller = self.authenticate(who)
        await self.engine.regions.unregister(caller.tenant, name)

    async def shm_status(self, who: Caller, name: str | None) -> list[dict[str, Any]]:
        """The caller's regions (only `name`, when given): name, key, offset, byte_size."""
        return await self.engine.regions.status(self.authenticate(who).tenant, name)

    async def cuda_shm_register(
        self, who: Caller, name: str, handle: bytes, device_id: Any, byte_size: Any, protocol: str
    ) -> None:
        """Open a CUDA IPC `handle` as the caller's region `name` (engine/cuda_regions.py)."""
        caller = self.authenticate(who)
        regions = self.engine.regions.cuda
        await regions.register(caller.tenant, caller.key_name, name, handle, device_id, byte_size)
        log_admin_action(
            caller, "cuda_shm_register", region=name, device_id=device_id, protocol=protocol
        )

    async def cuda_shm_unregister(self, who: Caller, name: str | None) -> None:
        """Drop the caller's CUDA region `name`, or all of them when `name` is None or empty."""
        caller = self.authenticate(who)
        await self.engine.regions.cuda.unregister(caller.tenant, name)

    async def cuda_shm_status(self, who: Caller, name: str | None) -> list[dict[str, Any]]:
        """The caller's CUDA regions (only `name`, when given): name, device_id, byte_size."""
        return await self.engine.regions.cuda.status(self.authenticate(who).tenant, name)

    # -- generation ------------------------------------------------------------------------------

    @property
    def serves_generation(self) -> bool:
        """Whether the engine serves generation (the generation routes are mounted)."""
        return self.engine.generation is not None

    def generative_models(self) -> list[str]:
        """The engine's generative models (none where it serves no generation)."""
        generation = self.engine.generation
        return [] if generation is None else generation.generative_models()

    def generation_call(self, route: GenerationRoute, model: str | None = None) -> GenerationCall:
        """A generation request arriving by `route`, its caller authenticated from the route's
        headers (before any body is read: a stranger's is never parsed); with `model`, chosen
        (`GenerationCall.choose`; a route that reads the model from the body chooses it then).
        From here it is timed, traced and counted once (server/generating.py), a refusal here
        included."""
        call = GenerationCall(self.ledger, route, time.monotonic())
        with call.reading():
            call.caller = self.authenticate(route.headers)
            if model is not None:
                call.choose(model)
        return call

    # -- inference -------------------------------------------------------------------------------

    async def infer(self, call: InferCall[W], principal: Principal | None = None) -> W:
        """Answer one inference call (authenticating it unless `principal` is given, as for
        each message of a stream), counted in the metrics, logged at debug level and traced.
        The plane owns the call's door and clock: it refuses it while draining, before it is
        decoded, and its start is the request's `arrived`. Errors reach the transport as
        EngineErrors: a bug is logged here with its traceback and becomes
        BackendError(INTERNAL_ERROR)."""
        started = time.monotonic()
        engine = self.engine
        span = (  # checked here: a call per request costs more than this test
            None
            if engine.tracing is None
            else self.ledger.begin(call.span_name, call.protocol, call.model, call.headers)
        )
        status, served = 200, ""
        try:
            if engine.draining:  # refuse before reading and decoding the request
                raise ShuttingDown()
            if principal is None:
                principal = self.authenticate(call.headers, call.model)
            else:
                principal.check_model(call.model)
            request = await self._decode(call, principal.tenant, started)
            response = await call.wait(engine.infer(request))
            if request.shared_outputs is not None:
                response = await shared_tensors.write_outputs(
                    engine.regions, principal.tenant, request, response
                )
            served = response.model_version
            encode_started = time.monotonic()
            # Checked here, not in off_loop: a coroutine per call costs more than this test.
            if sum(array.nbytes for array in response.outputs.values()) <= OFFLOAD_BYTES:
                answer = call.encode(response)
            else:
                answer = await asyncio.to_thread(call.encode, response)
            self._encoded(call.protocol, encode_started)
            return answer
        except EngineError as exc:
            status = http_status(exc)
            if status == 500:
                LOGS[call.protocol].error(
                    "inference failed: %s", exc.message, extra={"model": call.model}
                )
            raise
        except (ClientGone, asyncio.CancelledError):
            status = CLIENT_GONE
            raise
        except Exception as exc:  # a bug: the traceback goes to the log, the caller a 500
            status = 500
            LOGS[call.protocol].error("unhandled error in inference", exc_info=exc)
            raise BackendError(INTERNAL_ERROR) from exc
        finally:
            self.ledger.count(call, served, status, time.monotonic() - started, span)

    async def _decode(self, call: InferCall[W], tenant: str, started: float) -> InferRequest:
        """The call's request, checked by the engine's input check of its model as it is
        decoded (`InferRequest.checked`: the engine does not check it again), its inputs in
        shared memory read."""
        engine = self.engine
        check = engine.cached_input_check(call.model, call.version)
        if check is None:  # a worker's first request for this model (generation)
            check = await engine.input_check(call.model, call.version)
        checked = Checked(check)
        request = await call.decode(checked)
        request.checked = checked
        request.tenant = tenant
        request.arrived = started  # its deadline counts from here, decoding included
        if request.shared_inputs is not None:
            await shared_tensors.read_inputs(engine.regions, tenant, request, self._request_bytes)
        return request

    def _encoded(self, protocol: str, started: float) -> None:
        """An answer encoded since `started`: timed in the metrics and the trace."""
        encoded = time.monotonic()
        self.engine.metrics.encoded(protocol, encoded - started)
        if self.engine.tracing is not None:
            self.engine.tracing.record("encode", started, encoded)
