"""ONNX Runtime backend: one InferenceSession per model version, run concurrently by instances."""

from __future__ import annotations

import logging
import queue
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from engine import datatypes
from engine.backends.base import CPU_PROVIDER
from engine.backends.placement import RECORD_PLACEMENT, check_required, describe, node_placement
from engine.backends.provider_libraries import preload_tensorrt
from engine.errors import InvalidInput
from engine.model_config import GPU_PROVIDERS, InstanceGroup, OnnxRuntimeOptions
from engine.types import TensorSpec

log = logging.getLogger("sluice.backend.onnxruntime")
TENSORRT = "TensorrtExecutionProvider"

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
    if CPU_PROVIDER not in chosen:
        chosen.append(CPU_PROVIDER)
    return chosen


class OnnxBackend:
    """A model.onnx file in ONNX Runtime sessions: one shared by every cpu instance (ORT runs
    one session from many threads), and one per gpu instance on its device. Sessions on a GPU
    provider run through IO binding, so each output crosses the bus once, into host memory."""

    platform = "onnxruntime_onnx"

    def __init__(
        self,
        path: Path,
        options: OnnxRuntimeOptions,
        label: str,
        groups: Sequence[InstanceGroup] = (),
    ) -> None:
        self._path, self._options, self._label = path, options, label
        available = ort.get_available_providers()
        if TENSORRT in options.provider_names and TENSORRT in available:
            preload_tensorrt()  # where no LD_LIBRARY_PATH names tensorrt_libs (not the image)
        devices = [device for group in groups for device in group.devices]
        shared_slots = sum(group.count for group in groups if group.kind == "cpu")
        self._sessions: list[ort.InferenceSession] = []
        self._bound: set[int] = set()  # sessions on a GPU provider, run through IO binding
        slots: list[ort.InferenceSession] = []
        if shared_slots or not devices:
            shared = self._open(session_providers(options, available, None))
            slots += [shared] * max(shared_slots, 1)
        for device in devices:
            slots.append(self._open(session_providers(options, available, device)))
        first = self._session = self._sessions[0]
        self.provider = first.get_providers()[0]
        skipped = [p for p in options.provider_names if p not in available]
        running = dict.fromkeys(session.get_providers()[0] for session in self._sessions)
        placement = node_placement(first)
        log.info(
            "%s runs on %s%s%s%s",
            label,
            " and ".join(running),
            f" ({describe(placement)})" if placement else "",
            f" on GPU {', '.join(map(str, sorted(set(devices))))}" if devices else "",
            f" (unavailable, skipped: {', '.join(skipped)})" if skipped else "",
        )
        # One session serves every thread unless there are per-device sessions to hand out.
        self._pool: queue.SimpleQueue[ort.InferenceSession] | None = None
        # Runs that reach every session once (they are handed out in turn): for warm-up.
        self.instance_slots = len(slots) if len(self._sessions) > 1 else 1
        if len(self._sessions) > 1:
            self._pool = queue.SimpleQueue()
            for slot in slots:
                self._pool.put(slot)
        self.inputs = tuple(_spec(arg) for arg in first.get_inputs())
        self.outputs = tuple(_spec(arg) for arg in first.get_outputs())
        self._output_names = [spec.name for spec in self.outputs]
        self._string_outputs = {s.name for s in self.outputs if s.datatype == "BYTES"}
        self._string_inputs = {s.name for s in self.inputs if s.datatype == "BYTES"}

    def _open(self, providers: list[tuple[str, dict[str, str]]]) -> ort.InferenceSession:
        options = self._options
        session_options = ort.SessionOptions()
        session_options.intra_op_num_threads = options.intra_op_threads
        session_options.inter_op_num_threads = options.inter_op_threads
        session_options.graph_optimization_level = _LEVELS[options.graph_optimization_level]
        session_options.log_severity_level = 4  # errors are raised and logged as JSON
        # Where nodes run, not only which providers were created: for require_providers and
        # the load's log line (ignored by an onnxruntime older than 1.24).
        session_options.add_session_config_entry(RECORD_PLACEMENT, "1")
        session = ort.InferenceSession(
            str(self._path), sess_options=session_options, providers=providers
        )
        self._sessions.append(session)
        running = session.get_providers()[0]
        if running in GPU_PROVIDERS:
            self._bound.add(id(session))
        wanted = options.provider_names[0] if options.provider_names else CPU_PROVIDER
        if options.require_providers:
            check_required(self._label, wanted, session, ort.get_available_providers())
        return session

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {
            name: _to_str(name, array) if name in self._string_inputs else array
            for name, array in inputs.items()
        }
        if self._pool is None:
            results = self._run(self._session, feed)
        else:
            session = self._pool.get()  # never waits long: at most one batch per instance
            try:
                results = self._run(session, feed)
            finally:
                self._pool.put(session)
        return {
            name: _to_bytes(value) if name in self._string_outputs else np.asarray(value)
            for name, value in zip(self._output_names, results, strict=True)
        }

    def _run(self, session: ort.InferenceSession, feed: dict[str, np.ndarray]) -> list[Any]:
        if id(session) in self._bound:
            return run_bound(session, self._output_names, feed)
        return session.run(self._output_names, feed)  # type: ignore[no-any-return]

    def close(self) -> None:
        self._pool = None
        self._sessions.clear()
        del self._session


def session_providers(
    options: OnnxRuntimeOptions, available: Sequence[str], device: int | None
) -> list[tuple[str, dict[str, str]]]:
    """What `InferenceSession(providers=...)` is given: the listed providers this build has, in
    order, with their options (as the strings ONNX Runtime parses), CPU last. On a gpu
    instance the instance's device is every GPU provider's `device_id`."""
    chosen = []
    for provider in options.providers:
        if provider.name not in available:
            continue
        values = {key: _option(value) for key, value in provider.options.items()}
        if device is not None and provider.name in GPU_PROVIDERS:
            values["device_id"] = str(device)
        chosen.append((provider.name, values))
    if CPU_PROVIDER not in [name for name, _ in chosen]:
        chosen.append((CPU_PROVIDER, {}))
    return chosen


def run_bound(
    session: ort.InferenceSession, output_names: list[str], feed: dict[str, np.ndarray]
) -> list[np.ndarray]:
    """One run through IO binding: inputs copied to the device once, outputs written by the
    device straight into host memory (no device-side copy handed back to be copied again)."""
    binding = session.io_binding()
    for name, array in feed.items():
        binding.bind_cpu_input(name, array)
    for name in output_names:
        binding.bind_output(name, "cpu")
    session.run_with_iobinding(binding)
    outputs: list[np.ndarray] = binding.copy_outputs_to_cpu()
    return outputs


def _option(value: str | int | float | bool) -> str:
    # ONNX Runtime parses provider options from strings; its bool parser takes true/false.
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


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
