"""The contract every backend meets: load a model file, describe it, run a batch."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from engine.types import TensorSpec

CPU_PROVIDER = "CPUExecutionProvider"
"""ONNX Runtime's CPU provider, the `provider` of a backend that computes in the calling thread
(named here, where importing costs nothing: the ONNX Runtime backend's module loads onnxruntime)."""


class Backend(Protocol):
    """A loaded model. `run` is synchronous and thread-safe: the engine calls it from a thread
    pool, possibly from several threads at once (one per model instance). A backend built from
    the config's instance groups may hold state per instance (a session or TensorRT execution
    context on each GPU); each run then takes a free instance, and since the engine runs at most
    one batch per instance at a time, one is always free; such a backend sets `instance_slots`
    to the number of runs that reach every instance once (warm-up uses it). Load failures and
    failed runs raise engine errors (BackendError naming what failed, InvalidInput for input
    the model refuses)."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    platform: str
    provider: str

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every output for one batch; BYTES tensors in and out are object arrays of bytes."""
        ...

    def close(self) -> None: ...
