"""A small stand-in for engine.Engine at the facade seam: real ONNX Runtime sessions over tiny
models built with onnx.helper, no batcher, and hooks to make the next call fail or hang.

Models:
  double  x FP32 [-1,4] -> y = 2x FP32 [-1,4], total = sum(x, axis 1) FP32 [-1]
  echo    text BYTES [-1] -> text_out BYTES [-1]
  types   a INT8 [-1,2], h FP16 [-1,2], flag BOOL [-1,2] -> a_out, h_out, flag_out (identity)
  slow    like double, but infer waits for `release` (to test cancellation)
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from engine import datatypes
from engine.auth import Authenticator
from engine.errors import EngineError, InvalidInput, ModelNotFound
from engine.metrics import Metrics
from engine.regions import SystemRegions
from engine.settings import AuthSettings, SharedMemorySettings
from engine.types import InferRequest, InferResponse, ModelMetadata, TensorSpec
from engine.validate import InputCheck, check_inputs, check_load_parameters, check_unload_parameters


def _info(name: str, elem: int, shape: list[Any]) -> Any:
    return helper.make_tensor_value_info(name, elem, shape)


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any]) -> bytes:
    model = helper.make_model(
        helper.make_graph(nodes, "g", inputs, outputs),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model.ir_version = 8
    return bytes(model.SerializeToString())


MAX_BATCH_SIZE = 1024
"""Every fake model's batch limit, as its config reports and its input check enforces."""


def model_files() -> dict[str, bytes]:
    """The serialized ONNX models by name (also used to build a model repository on disk)."""
    double = _model(
        [
            helper.make_node("Constant", [], ["axes"], value_ints=[1]),
            helper.make_node("Add", ["x", "x"], ["y"]),
            helper.make_node("ReduceSum", ["x", "axes"], ["total"], keepdims=0),
        ],
        [_info("x", TensorProto.FLOAT, ["batch", 4])],
        [_info("y", TensorProto.FLOAT, ["batch", 4]), _info("total", TensorProto.FLOAT, ["batch"])],
    )
    echo = _model(
        [helper.make_node("Identity", ["text"], ["text_out"])],
        [_info("text", TensorProto.STRING, ["batch"])],
        [_info("text_out", TensorProto.STRING, ["batch"])],
    )
    kinds = [("a", TensorProto.INT8), ("h", TensorProto.FLOAT16), ("flag", TensorProto.BOOL)]
    types = _model(
        [helper.make_node("Identity", [n], [f"{n}_out"]) for n, _ in kinds],
        [_info(n, t, ["batch", 2]) for n, t in kinds],
        [_info(f"{n}_out", t, ["batch", 2]) for n, t in kinds],
    )
    return {"double": double, "echo": echo, "types": types, "slow": double}


def _text(array: np.ndarray) -> np.ndarray:
    """ONNX Runtime wants str elements; the engine contract is bytes."""
    return np.array([b.decode() for b in array.reshape(-1)], dtype=object).reshape(array.shape)


class FakeEngine:
    """Implements the engine facade the front-ends call."""

    def __init__(
        self, auth: AuthSettings | None = None, regions: SystemRegions | None = None
    ) -> None:
        self.authenticator = Authenticator(auth or AuthSettings())
        self.regions = regions or SystemRegions(SharedMemorySettings())
        self.sessions = {name: ort.InferenceSession(blob) for name, blob in model_files().items()}
        self.loaded = set(self.sessions)
        self.live = True
        self.ready = True
        self.draining = False
        self.fail_next: BaseException | None = None
        self.requests: list[InferRequest] = []
        self.counts: dict[str, int] = dict.fromkeys(self.sessions, 0)
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = asyncio.Event()

        self.tracing = None
        self.metrics = Metrics(lambda: {"models": [], "index": [], "in_flight": 0})

    @property
    def generation(self) -> Any:
        """None: no generation, unless a test gives this engine `generate` and
        `generative_models` (a Generation then)."""
        return self if hasattr(self, "generate") else None

    async def ready_now(self) -> bool:
        return self.ready

    async def usage(self, tenant: str) -> dict[str, Any]:
        return {"tenant": tenant}

    def label_for(self, name: str) -> str:
        return name if name in self.sessions else "_unknown"

    def _session(self, name: str, version: str | None) -> ort.InferenceSession:
        if name not in self.loaded:
            raise ModelNotFound(name, available=sorted(self.loaded))
        if version not in (None, "1"):
            raise ModelNotFound(name, version, available=["1"])
        return self.sessions[name]

    @staticmethod
    def _specs(args: list[Any]) -> tuple[TensorSpec, ...]:
        return tuple(
            TensorSpec(
                a.name,
                datatypes.from_onnx(a.type),
                tuple(d if isinstance(d, int) else -1 for d in a.shape),
            )
            for a in args
        )

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "sluice", "version": "0.1.0", "extensions": ["binary_tensor_data"]}

    async def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        return self._metadata(name, version)

    def _metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        session = self._session(name, version)
        return ModelMetadata(
            name,
            ("1",),
            "onnxruntime_onnx",
            self._specs(session.get_inputs()),
            self._specs(session.get_outputs()),
        )

    def cached_input_check(self, name: str, version: str | None = None) -> InputCheck:
        inputs = self._metadata(name, version).inputs
        return functools.partial(
            check_inputs, inputs=inputs, max_batch_size=MAX_BATCH_SIZE, label=name
        )

    async def input_check(self, name: str, version: str | None = None) -> InputCheck:
        return self.cached_input_check(name, version)

    async def model_ready(self, name: str, version: str | None = None) -> bool:
        return name in self.loaded and version in (None, "1")

    async def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        meta = self._metadata(name, version)

        def tensor(spec: TensorSpec) -> dict[str, Any]:
            kind = "TYPE_STRING" if spec.datatype == "BYTES" else f"TYPE_{spec.datatype}"
            return {"name": spec.name, "data_type": kind, "dims": list(spec.shape[1:])}

        return {
            "name": name,
            "platform": "onnxruntime_onnx",
            "backend": "onnxruntime",
            "max_batch_size": MAX_BATCH_SIZE,
            "input": [tensor(s) for s in meta.inputs],
            "output": [tensor(s) for s in meta.outputs],
            "dynamic_batching": {
                "preferred_batch_size": [4, 8],
                "max_queue_delay_microseconds": 2000,
            },
            "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
            "version_policy": {"latest": {"num_versions": 1}},
            "sluice_only_field": True,
        }

    async def statistics(
        self, name: str | None = None, version: str | None = None
    ) -> dict[str, Any]:
        names = sorted(self.loaded) if name is None else [name]
        for each in names:
            self._session(each, version)
        stats = [
            {
                "name": n,
                "version": "1",
                "inference_count": self.counts[n],
                "execution_count": self.counts[n],
                "inference_stats": {"success": {"count": self.counts[n], "ns": 1000}},
                "batch_stats": [
                    {"batch_size": 1, "compute_infer": {"count": self.counts[n], "ns": 10}}
                ],
            }
            for n in names
        ]
        return {"model_stats": stats}

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        rows = [
            {
                "name": n,
                "version": "1",
                "state": "READY" if n in self.loaded else "UNAVAILABLE",
                "reason": "" if n in self.loaded else "unloaded",
            }
            for n in sorted(self.sessions)
        ]
        return [r for r in rows if r["state"] == "READY"] if ready_only else rows

    async def load_model(
        self, name: str, parameters: Mapping[str, Any] | Collection[str] = ()
    ) -> None:
        check_load_parameters(parameters)
        if name not in self.sessions:
            raise ModelNotFound(name, available=sorted(self.sessions))
        self.loaded.add(name)

    async def unload_model(self, name: str, parameters: Collection[str] = ()) -> None:
        check_unload_parameters(parameters)
        if name not in self.sessions:
            raise ModelNotFound(name, available=sorted(self.sessions))
        self.loaded.discard(name)

    async def infer(self, request: InferRequest) -> InferResponse:
        self.requests.append(request)
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            try:
                raise exc
            finally:
                del exc  # this frame is in the error's traceback: it must not hold the error
        session = self._session(request.model_name, request.model_version)
        meta = self._metadata(request.model_name)
        for spec in meta.inputs:
            if spec.name not in request.inputs:
                raise InvalidInput(f"missing input '{spec.name}'")
            if request.datatypes[spec.name] != spec.datatype:
                raise InvalidInput(
                    f"input '{spec.name}' has datatype {request.datatypes[spec.name]}"
                )
        if request.model_name == "slow":
            self.started.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        feed = {k: _text(v) if v.dtype == object else v for k, v in request.inputs.items()}
        names = request.outputs or [spec.name for spec in meta.outputs]
        results = await asyncio.to_thread(session.run, names, feed)
        outputs = {
            n: np.vectorize(str.encode, otypes=[object])(r) if r.dtype == object else r
            for n, r in zip(names, results, strict=True)
        }
        self.counts[request.model_name] += 1
        types = {s.name: s.datatype for s in meta.outputs}
        return InferResponse(
            request.model_name, "1", outputs, {n: types[n] for n in names}, id=request.id
        )


__all__ = ["EngineError", "FakeEngine"]
