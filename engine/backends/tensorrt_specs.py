"""A TensorRT engine's I/O tensors as sluice reads them: their specs (name, V2 datatype, shape)
in the engine's order, each input's (min, opt, max) shapes per optimization profile, and the
numpy type of each datatype the backend serves. Takes the `tensorrt` module and a deserialized
engine as arguments, so it imports neither."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.backends.tensorrt_profiles import Limits
from engine.errors import BackendError
from engine.types import TensorSpec

_NP_TO_V2 = {"float32": "FP32", "float16": "FP16", "int32": "INT32", "int64": "INT64",
             "int8": "INT8", "uint8": "UINT8", "bool": "BOOL"}  # fmt: skip


def describe(trt: Any, engine: Any) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(inputs, outputs) of an engine, in its I/O tensor order."""
    inputs: list[TensorSpec] = []
    outputs: list[TensorSpec] = []
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        trt_type = engine.get_tensor_dtype(name)
        try:
            dtype = np.dtype(trt.nptype(trt_type))
        except TypeError:  # bf16, fp8, int4: no numpy type
            dtype = None
        if dtype is None or dtype.name not in _NP_TO_V2:
            raise BackendError(f"tensor '{name}' has type {trt_type}, which sluice cannot serve")
        if engine.is_shape_inference_io(name):
            raise BackendError(
                f"input '{name}' is a shape tensor (read on the host); this backend serves "
                "engines whose inputs are all device tensors"
            )
        spec = TensorSpec(name, _NP_TO_V2[dtype.name], tuple(engine.get_tensor_shape(name)))
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        (inputs if is_input else outputs).append(spec)
    return tuple(inputs), tuple(outputs)


def profile_limits(engine: Any, spec: TensorSpec, profile: int) -> Limits:
    """An input's (min, opt, max) shapes under a profile. A static input's are its shape: an
    engine built without profiles has no profile shapes to report for it."""
    if -1 not in spec.shape:
        return spec.shape, spec.shape, spec.shape
    low, opt, high = (
        tuple(int(size) for size in shape)
        for shape in engine.get_tensor_profile_shape(spec.name, profile)
    )
    return low, opt, high


def numpy_type(datatype: str) -> str:
    """The numpy type name of a datatype `describe` admits."""
    return next(np_name for np_name, v2 in _NP_TO_V2.items() if v2 == datatype)
