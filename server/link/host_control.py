"""What the engine process answers its workers besides inference: `HostControl` keeps every
worker's copy of the engine's state current (whether it drains, which models are loaded, pushed
within STATE_INTERVAL_S of a change and at once after a load or unload), answers their CALL
frames (metadata, input specs, readiness, configuration, statistics, the repository and its
loads, usage, the metrics exposition) and adds the front-end counts they send (EVENTS) to the
engine's metrics, so every worker shows the whole server.

An input spec names the model version it describes by an id (`version_id`); a worker's INFER
item gives it back with the rows its check of the request returned, and `checked` hands the
engine that version's check in their place, so the engine checks a request once, as in one
process, while that version serves. The id, not the state's `generation`: the state is read
every STATE_INTERVAL_S, so a model changed since its last read has the same generation, where a
replaced version no longer serves at once (`Engine._checked_model`).

Split from host.py: none of this touches the arenas; `EngineHost` (host.py) builds on it with the
connections and inference. The worker's side is remote_control.py."""

from __future__ import annotations

import asyncio
import itertools
import logging
import zlib
from typing import Any

import orjson

from engine import errors
from engine.engine import Engine
from engine.model import ModelCheck
from engine.types import Checked, ModelMetadata
from server.link.frames import Kind, ProtocolError, error_payload
from server.link.host_peer import Peer

log = logging.getLogger("sluice.host")

STATE_INTERVAL_S = 0.1
"""How often the host looks for a change of readiness or of the loaded models to push."""


def metadata_payload(meta: ModelMetadata) -> dict[str, Any]:
    return {
        "name": meta.name,
        "versions": list(meta.versions),
        "platform": meta.platform,
        "inputs": [[s.name, s.datatype, list(s.shape), list(s.dim_names)] for s in meta.inputs],
        "outputs": [[s.name, s.datatype, list(s.shape), list(s.dim_names)] for s in meta.outputs],
    }


class HostControl:
    """The engine's answers to its workers' calls and its state pushes (see the module
    docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._peers: set[Peer] = set()
        self._state: dict[str, Any] = {}
        self._state_task: asyncio.Task[None] | None = None
        self._checks: dict[int, ModelCheck] = {}  # by version id (`version_id`)
        self._version_ids: dict[ModelCheck, int] = {}
        self._next_id = itertools.count(1)

    # -- the state every worker keeps a copy of --------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What every worker keeps a copy of: whether the engine drains, which models are loaded
        (`generation` changes whenever a model is loaded, reloaded or unloaded), and the client
        shared-memory regions when that extension is on."""
        engine = self.engine
        models = engine.registry.all() if engine.live and _started(engine) else []
        index = engine.registry.index() if _started(engine) else []
        marks = orjson.dumps([index, [[m.name, m.version, m.content_fingerprint] for m in models]])
        state = {
            "draining": engine.draining,
            "models": sorted({m.name for m in models}),
            "generative": engine.generation.generative_models() if _started(engine) else [],
            "generation": zlib.crc32(marks),
            "server": engine.server_metadata(),
        }
        if engine.regions.enabled:  # the client shared-memory regions (remote_regions.py)
            state["shm_regions"] = engine.regions.table()
        return state

    async def _push_state(self) -> None:
        while True:
            await asyncio.sleep(STATE_INTERVAL_S)
            state = self.state()
            if state != self._state:
                self._state = state
                for peer in self._peers:
                    peer.send(Kind.STATE, state)

    # -- calls -----------------------------------------------------------------------------------

    async def _call(self, peer: Peer, message: dict[str, Any]) -> None:
        call_id, method, args = message["id"], message["method"], message.get("args") or []
        try:
            result = await self._method(method, args)
        except errors.EngineError as exc:
            peer.send(Kind.ERROR, error_payload(call_id, exc))
            return
        except Exception:
            log.exception("engine call %r failed", method)
            peer.send(Kind.ERROR, error_payload(call_id, errors.BackendError("internal error")))
            return
        peer.send(Kind.REPLY, {"id": call_id, "result": result})

    async def _method(self, method: str, args: list[Any]) -> Any:
        engine = self.engine
        if method == "model_metadata":
            return metadata_payload(await engine.model_metadata(*args))
        if method == "input_spec":
            model = engine.checked_model(*args)
            if model is None:  # on_demand, never loaded: checked by the engine once loaded
                return {"inputs": None, "max_batch_size": 0, "label": ""}
            return {
                "inputs": [[s.name, s.datatype, list(s.shape)] for s in model.backend.inputs],
                "max_batch_size": model.max_batch_size,
                "label": model.label,
                "version_id": self.version_id(model.input_check),
            }
        if method == "ready":
            return engine.ready
        if method == "model_ready":
            return await engine.model_ready(*args)
        if method == "model_config":
            return await engine.model_config(*args)
        if method == "statistics":
            return await engine.statistics(*args)
        if method == "repository_index":
            return await engine.repository_index(*args)
        if method == "load_model":
            await engine.load_model(args[0], args[1])
            return self._fresh_state()
        if method == "unload_model":
            await engine.unload_model(args[0], args[1])
            return self._fresh_state()
        if method in ("shm_register", "shm_unregister"):  # a change every worker mirrors
            await getattr(engine.regions, method.removeprefix("shm_"))(*args)
            return self._fresh_state()
        if method == "shm_status":
            return await engine.regions.status(*args)
        if method == "shm_keep_keys":
            engine.regions.keep_keys(frozenset(args[0]))
            self._fresh_state()
            return None
        if method == "usage":
            return await engine.usage(args[0])
        if method == "metrics":
            return (await engine.metrics.exposition()).decode()
        raise ProtocolError(f"unknown method {method!r}")

    # -- the versions workers check requests against ---------------------------------------------

    def version_id(self, check: ModelCheck) -> int:
        """The id by which a worker's INFER items name the model version of `check`, whose
        inputs (`input_spec`) the worker checked their declared shapes against."""
        known = self._version_ids.get(check)
        if known is None:
            # The versions gone since (unloaded, replaced) are forgotten: one id a version.
            for gone in [c for c in self._version_ids if c.model is None]:
                del self._checks[self._version_ids.pop(gone)]
            known = self._version_ids[check] = next(self._next_id)
            self._checks[known] = check
        return known

    def checked(self, version_id: object, rows: object, version: object) -> Checked | None:
        """What a worker's check of a request established, as one process's data plane hands
        it to the engine (`InferRequest.checked`): the check of the version `version_id` names
        and the `rows` it returned; None (the engine checks the request itself) when they are
        not an id given here and whole rows, or the request names another version.

        The engine then neither resolves the request nor checks its inputs again while that
        version serves (`Engine._checked_model`, `LoadedModel.rows`): the worker is this
        server's own process, and what it checked is what the engine reads. It ran the check on
        the declared shapes and datatypes; every decoder builds each array with exactly its
        declared shape (`reshape(shape)`: server/raw_tensors.py `tensor_from_buffer`,
        server/http/json_arrays.py, server/http/codec.py, server/grpc/tensors.py,
        server/shared_tensors.py; an embeddings request is checked on its arrays), the worker
        describes those arrays as they are (shm/layout.py), `view_tensors` builds arrays of the
        described shapes here, and the datatypes travel as the check saw them. A version
        replaced or unloaded meanwhile no longer serves: the engine resolves and checks the
        request again, as it does in one process."""
        if type(version_id) is not int or type(rows) is not int:
            return None
        check = self._checks.get(version_id)
        if check is None:
            return None
        model = check.model
        if model is None or (version is not None and version != "" and version != model.version):
            return None
        checked = Checked(check)
        checked.rows = rows
        return checked

    def _fresh_state(self) -> dict[str, Any]:
        self._state = self.state()
        for peer in self._peers:
            peer.send(Kind.STATE, self._state)
        return self._state

    def _events(self, message: dict[str, Any]) -> None:
        """Front-end counts from a worker, added to the engine's metrics (one view)."""
        metrics = self.engine.metrics
        for model, version, protocol, status, seconds in message.get("requests", ()):
            metrics.request(str(model), str(version), str(protocol), int(status), float(seconds))
        for protocol, seconds in message.get("encoded", ()):
            metrics.encoded(str(protocol), float(seconds))


def _started(engine: Engine) -> bool:
    try:
        engine.registry  # noqa: B018 - raises until started
    except RuntimeError:
        return False
    return True
