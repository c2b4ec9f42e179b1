"""What a worker asks of the engine process besides inference: `RemoteControl` answers the
engine facade's control members (engine/facade.py) on the worker's connection
(remote_channel.py), and `RemoteMetrics` sends the front-ends' counts there.

Draining and which models are loaded are a copy the engine pushes when they change (within
STATE_INTERVAL_S); declared-shape checks are cached per model generation (the first request of a
model asks the engine, once however many arrive meanwhile), each naming the model version it
checks against, so the engine does not check a request again (`RemoteCheck`). Readiness
probes ask the engine (`ready_now`), so every worker answers what one process would at that
moment. Metadata, configuration, statistics, the repository index and the metrics exposition
are asked of the engine too: each a CALL frame on this worker's one connection, its REPLY
awaited (never a blocking read: the worker's other requests, health probes and streams carry on
while the engine is slow), given up after CALL_TIMEOUT_S. Front-end request counts are sent to
the engine in batches, so `/metrics` from any worker shows every worker's requests.

Split from remote.py: none of this touches the arenas, and each call is a round trip
off the inference path; `RemoteEngine` (remote.py) adds inference and generation."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from engine import errors
from engine.metrics import Metrics
from engine.types import ModelMetadata, TensorSpec
from engine.validate import InputCheck, check_inputs, check_load_parameters, unchecked
from server.link.frames import Kind
from server.link.remote_channel import EngineChannel

EVENTS_INTERVAL_S = 0.05
"""Front-end counts reach the engine's metrics at most this long after the request."""

CALL_TIMEOUT_S = 10.0
"""A call to the engine (metadata, statistics, readiness...) is given up after this long: an
engine busy loading, overloaded or stopped answers its caller with an error, not never. Loads and
unloads are not bounded: they take as long as the model takes."""


CHECK_TRIES = 3
"""How often an input check is asked for while the loaded models keep changing under the call."""


class RemoteCheck:
    """A model version's input check as the engine described it (`input_spec`): `check_inputs`
    against that version's inputs, and `version_id`, the engine's id of the version, which an
    INFER item carries with the rows the check returned (remote.py `_send_infer`), so the
    engine does not check the inputs again while that version serves (host.py `_infer`)."""

    __slots__ = ("inputs", "label", "max_batch_size", "version_id")

    def __init__(
        self, inputs: tuple[TensorSpec, ...], max_batch_size: int, label: str, version_id: int
    ) -> None:
        self.inputs = inputs
        self.max_batch_size = max_batch_size
        self.label = label
        self.version_id = version_id

    def __call__(self, shapes: Mapping[str, Sequence[int]], datatypes: Mapping[str, str]) -> int:
        return check_inputs(shapes, datatypes, self.inputs, self.max_batch_size, self.label)


def _specs(items: list[Any]) -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(item[0], item[1], tuple(item[2]), tuple(item[3]) if len(item) > 3 else ())
        for item in items
    )


class RemoteMetrics(Metrics):
    """Front-end counts go to the engine process; the exposition is the engine's (whole
    server's)."""

    def __init__(self, remote: RemoteControl) -> None:
        super().__init__(dict)
        self._remote = remote
        self.pending_requests: list[list[Any]] = []
        self.pending_encoded: list[list[Any]] = []

    def request(self, model: str, version: str, protocol: str, status: int, seconds: float) -> None:
        self.pending_requests.append([model, version, protocol, status, seconds])
        self._remote.schedule_events()

    def encoded(self, protocol: str, seconds: float) -> None:
        self.pending_encoded.append([protocol, seconds])
        self._remote.schedule_events()

    def take(self) -> dict[str, list[list[Any]]] | None:
        """The counts not yet sent, or None."""
        if not (self.pending_requests or self.pending_encoded):
            return None
        taken = {"requests": self.pending_requests, "encoded": self.pending_encoded}
        self.pending_requests, self.pending_encoded = [], []
        return taken

    async def exposition(self) -> bytes:
        # This worker's counts go first on the same connection, so the answer includes them.
        return str(await self._remote.call("metrics", events=self.take())).encode()


class RemoteControl(EngineChannel):
    """The engine facade's members other than inference and generation, for a worker process
    (see the module docstring)."""

    def __init__(self, path: str, index: int) -> None:
        super().__init__(path, index)
        self.metrics: Metrics = RemoteMetrics(self)
        self._draining = False
        self._state: dict[str, Any] = {"draining": False, "models": []}
        self._checks: dict[tuple[str, str | None], InputCheck] = {}
        self._checks_generation: object = None
        self._fetching: dict[tuple[str, str | None], asyncio.Task[InputCheck]] = {}
        self._events_scheduled = False

    # -- readiness -------------------------------------------------------------------------------

    async def ready_now(self) -> bool:
        """Asked of the engine, on this worker's connection (the event loop is not blocked): the
        pushed copy lags a change by up to STATE_INTERVAL_S, longer while a load keeps the
        engine busy, where one process answers at once. Not ready without an answer within
        CALL_TIMEOUT_S. A probe affords the round trip; inference never asks."""
        if self.draining:
            return False
        try:
            ready = await self.call("ready")
        except errors.EngineError:  # the engine is gone, or did not answer in time
            return False
        return bool(ready) and not self.draining

    @property
    def draining(self) -> bool:
        return self._draining or bool(self._state.get("draining")) or self.engine_gone.is_set()

    def stop_accepting(self) -> None:
        self._draining = True

    # -- metrics ---------------------------------------------------------------------------------

    def schedule_events(self) -> None:
        if not self._events_scheduled and self._loop is not None:
            self._events_scheduled = True
            self._loop.call_later(EVENTS_INTERVAL_S, self.flush_events)

    def flush_events(self) -> None:
        self._events_scheduled = False
        metrics = self.metrics
        assert isinstance(metrics, RemoteMetrics)
        payload = metrics.take()
        if payload is not None and self._transport is not None:
            self._send(Kind.EVENTS, payload)
            self._flush()

    # -- calls -----------------------------------------------------------------------------------

    async def call(self, method: str, *args: Any, events: dict[str, Any] | None = None) -> Any:
        """The engine's answer to `method(*args)` (host_control.py), awaited on this
        worker's connection. None within CALL_TIMEOUT_S is Overloaded (503 with Retry-After: the
        engine is slow or stopped, not broken) naming the call; the call is withdrawn, and a late
        answer finds no caller and is dropped, never taken for another call's. `events`
        (front-end counts) go in a frame just before the call's, so the engine has counted them
        when it answers."""
        if events is not None:
            self._send(Kind.EVENTS, events)
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                return await self._request(Kind.CALL, {"method": method, "args": list(args)})
        except TimeoutError:
            raise errors.Overloaded(
                f"the engine process did not answer '{method}' within {CALL_TIMEOUT_S:g} s; "
                "retry shortly"
            ) from None

    # -- input checks ----------------------------------------------------------------------------

    def cached_input_check(self, name: str, version: str | None = None) -> InputCheck | None:
        """The check fetched for this model generation, or None (then await `input_check`)."""
        return self._current_checks().get((name, version))

    async def input_check(self, name: str, version: str | None = None) -> InputCheck:
        """The declared-shape check of (name, version), asked of the engine on a miss. Requests
        that miss together wait for one call: a burst on a model's first use (or after a load)
        asks once, and a caller that leaves (its client went away) does not fail the others."""
        key = (name, version)
        check = self._current_checks().get(key)
        if check is not None:
            return check
        fetch = self._fetching.get(key)
        if fetch is None:
            assert self._loop is not None
            fetch = self._fetching[key] = self._loop.create_task(self._fetch_check(name, version))
            fetch.add_done_callback(functools.partial(self._fetched, key))
        return await asyncio.shield(fetch)

    def _current_checks(self) -> dict[tuple[str, str | None], InputCheck]:
        """The cached checks, emptied when the engine's models changed (a new generation)."""
        generation = self._state.get("generation")
        if generation != self._checks_generation:
            self._checks.clear()
            self._checks_generation = generation
        return self._checks

    async def _fetch_check(self, name: str, version: str | None) -> InputCheck:
        """The check as the engine answers it, kept for the generation it answered in. The
        engine computes an answer before any state push it sends after it, but the worker may
        read both at once (its loop was busy) and take the push first: a generation that
        changed while the call was out may have been answered with the model it replaced, so
        it is asked again rather than kept under the new generation."""
        for _ in range(CHECK_TRIES):
            asked_in = self._state.get("generation")
            spec = await self.call("input_spec", name, version)
            if spec["inputs"] is None:  # on_demand, never loaded: the engine checks it, later
                return unchecked
            check: InputCheck = RemoteCheck(
                _specs(spec["inputs"]), spec["max_batch_size"], spec["label"], spec["version_id"]
            )
            if self._state.get("generation") == asked_in:
                self._current_checks()[(name, version)] = check
                break
        return check  # models changing all along: the last answer, used once, not kept

    def _fetched(self, key: tuple[str, str | None], fetch: asyncio.Task[InputCheck]) -> None:
        if self._fetching.get(key) is fetch:
            del self._fetching[key]
        if not fetch.cancelled():
            fetch.exception()  # retrieved: its callers may all have left (asyncio would log it)

    # -- everything else -------------------------------------------------------------------------

    def generative_models(self) -> list[str]:
        """The engine's generative models (from the state it pushes)."""
        return [str(name) for name in self._state.get("generative", ())]

    def server_metadata(self) -> dict[str, Any]:
        return dict(self._state.get("server") or {})

    async def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        meta = await self.call("model_metadata", name, version)
        return ModelMetadata(
            name=meta["name"],
            versions=tuple(meta["versions"]),
            platform=meta["platform"],
            inputs=_specs(meta["inputs"]),
            outputs=_specs(meta["outputs"]),
        )

    async def model_ready(self, name: str, version: str | None = None) -> bool:
        return bool(await self.call("model_ready", name, version)) and not self.draining

    async def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("model_config", name, version)
        return result

    async def statistics(
        self, name: str | None = None, version: str | None = None
    ) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("statistics", name, version)
        return result

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        result: list[dict[str, str]] = await self.call("repository_index", ready_only)
        return result

    async def load_model(
        self, name: str, parameters: Mapping[str, Any] | Collection[str] = ()
    ) -> None:
        # Refused here as the engine would refuse them: what passes is names and a config text,
        # which the channel carries (a value it cannot, bytes or deep nesting, never reaches it).
        check_load_parameters(parameters)
        # The values go too: Triton's `config` parameter carries the model config.
        given = dict(parameters) if isinstance(parameters, Mapping) else list(parameters)
        self._state = await self._request(
            Kind.CALL, {"method": "load_model", "args": [name, given]}
        )

    async def unload_model(self, name: str, parameters: Collection[str] = ()) -> None:
        self._state = await self._request(
            Kind.CALL, {"method": "unload_model", "args": [name, list(parameters)]}
        )

    async def usage(self, tenant: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("usage", tenant)
        return result

    def label_for(self, name: str) -> str:
        return name if name in self._state.get("models", ()) else "_unknown"
