"""ONNX Runtime backend: one InferenceSession per model version, run concurrently by instances."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

from engine import datatypes
from engine.errors import InvalidInput
from engine.model_config import InstanceGroup, OnnxRuntimeOptions
from engine.types import TensorSpec

log = logging.getLogger("sluice.backend.onnxruntime")

_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def _spec(arg: ort.NodeArg) -> TensorSpec:
    shape = tuple(dim if isinstance(dim, int) and dim >= 0 else -1 for dim in arg.shape)
    names = tuple(dim if isinstance(dim, str) and dim else None for dim in arg.shape)
    return TensorSpec(arg.name, datatypes.from_onnx(arg.type), shape, names)


def choose_providers(preferred: list[str], available: list[str]) -> list[str]:
    """The preferred providers that this onnxruntime build has, in order, always ending in CPU."""
    chosen = [name for name in preferred if name in available]
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")
    return chosen


class OnnxBackend:
    """A model.onnx file in an ONNX Runtime session."""

    platform = "onnxruntime_onnx"

    def __init__(
        self,
        path: Path,
        options: OnnxRuntimeOptions,
        label: str,
        groups: Sequence[InstanceGroup] = (),
    ) -> None:
        session_options = ort.SessionOptions()
        session_options.intra_op_num_threads = options.intra_op_threads
        session_options.inter_op_num_threads = options.inter_op_threads
        session_options.graph_optimization_level = _LEVELS[options.graph_optimization_level]
        session_options.log_severity_level = 4  # errors are raised and logged as JSON
        providers = choose_providers(options.provider_names, ort.get_available_providers())
        self._session = ort.InferenceSession(
            str(path), sess_options=session_options, providers=providers
        )
        self.provider = self._session.get_providers()[0]
        skipped = [p for p in options.provider_names if p not in providers]
        log.info(
            "%s runs on %s%s",
            label,
            self.provider,
            f" (unavailable, skipped: {', '.join(skipped)})" if skipped else "",
        )
        self.inputs = tuple(_spec(arg) for arg in self._session.get_inputs())
        self.outputs = tuple(_spec(arg) for arg in self._session.get_outputs())
        self._output_names = [spec.name for spec in self.outputs]
        self._string_outputs = {s.name for s in self.outputs if s.datatype == "BYTES"}
        self._string_inputs = {s.name for s in self.inputs if s.datatype == "BYTES"}

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {
            name: _to_str(name, array) if name in self._string_inputs else array
            for name, array in inputs.items()
        }
        results = self._session.run(self._output_names, feed)
        return {
            name: _to_bytes(value) if name in self._string_outputs else np.asarray(value)
            for name, value in zip(self._output_names, results, strict=True)
        }

    def close(self) -> None:
        del self._session


def _to_str(name: str, array: np.ndarray) -> np.ndarray:
    # ONNX Runtime takes string tensors as Python str; the protocol carries bytes.
    try:
        decoded: np.ndarray = np.vectorize(lambda b: b.decode("utf-8"), otypes=[object])(array)
        return decoded
    except UnicodeDecodeError as exc:
        raise InvalidInput(
            f"input '{name}' holds bytes that are not UTF-8 text ({exc.reason} at byte "
            f"{exc.start}); this model takes string tensors"
        ) from exc


def _to_bytes(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array, dtype=object)
    if array.size == 0:
        return array
    encode = np.vectorize(lambda s: s.encode("utf-8") if isinstance(s, str) else s, otypes=[object])
    encoded: np.ndarray = encode(array)
    return encoded
