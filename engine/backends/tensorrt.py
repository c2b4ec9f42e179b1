"""TensorRT backend for `model.plan` engines. Needs a CUDA GPU, the `tensorrt` package and
`cuda-python` (the `gpu` extra); everything is imported lazily so CPU-only installs never touch it.

Not run on the machines this project is developed on (no GPU, and TensorRT's libraries cannot be
installed there): its tests are marked `gpu`."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np

from engine import datatypes
from engine.types import TensorSpec

_NP_TO_V2 = {"float32": "FP32", "float16": "FP16", "int32": "INT32", "int64": "INT64",
             "int8": "INT8", "uint8": "UINT8", "bool": "BOOL"}  # fmt: skip


def missing_requirements() -> list[str]:
    """What this machine lacks for TensorRT (empty when it can run engines)."""
    missing = [
        f"the '{module}' Python package"
        for module in ("tensorrt", "cuda")
        if importlib.util.find_spec(module) is None
    ]
    if not missing:
        from cuda import cudart

        err, count = cudart.cudaGetDeviceCount()
        if err != 0 or count == 0:
            missing.append("a CUDA GPU")
    return missing


class TensorRTBackend:
    """A serialized TensorRT engine; one execution context per run (thread-safe by construction)."""

    platform = "tensorrt_plan"
    provider = "TensorrtExecutionProvider"

    def __init__(self, path: Path, options: dict[str, Any], label: str) -> None:
        missing = missing_requirements()
        if missing:
            raise RuntimeError(
                f"{label} needs TensorRT, but this machine lacks {', '.join(missing)}; install "
                "the `gpu` extra on a machine with an NVIDIA GPU, or serve the ONNX model"
            )
        import tensorrt as trt

        self._trt = trt
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = runtime.deserialize_cuda_engine(path.read_bytes())
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        inputs: list[TensorSpec] = []
        outputs: list[TensorSpec] = []
        for name in names:
            dtype = np.dtype(trt.nptype(self._engine.get_tensor_dtype(name)))
            spec = TensorSpec(
                name, _NP_TO_V2[dtype.name], tuple(self._engine.get_tensor_shape(name))
            )
            is_input = self._engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            (inputs if is_input else outputs).append(spec)
        self.inputs, self.outputs = tuple(inputs), tuple(outputs)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from cuda import cudart

        context = self._engine.create_execution_context()
        buffers: list[int] = []
        outputs: dict[str, np.ndarray] = {}
        try:
            for spec in self.inputs:
                array = np.ascontiguousarray(inputs[spec.name])
                context.set_input_shape(spec.name, array.shape)
                pointer = _device_copy(cudart, array)
                buffers.append(pointer)
                context.set_tensor_address(spec.name, pointer)
            for spec in self.outputs:
                shape = tuple(context.get_tensor_shape(spec.name))
                outputs[spec.name] = np.empty(shape, datatypes.numpy_dtype(spec.datatype))
                _, pointer = cudart.cudaMalloc(outputs[spec.name].nbytes)
                buffers.append(pointer)
                context.set_tensor_address(spec.name, pointer)
            context.execute_async_v3(0)
            cudart.cudaStreamSynchronize(0)
            for spec, pointer in zip(self.outputs, buffers[len(self.inputs) :], strict=True):
                out = outputs[spec.name]
                cudart.cudaMemcpy(out.ctypes.data, pointer, out.nbytes, 2)  # device to host
        finally:
            for pointer in buffers:
                cudart.cudaFree(pointer)
        return outputs

    def close(self) -> None:
        del self._engine


def _device_copy(cudart: Any, array: np.ndarray) -> int:
    _, pointer = cudart.cudaMalloc(array.nbytes)
    cudart.cudaMemcpy(pointer, array.ctypes.data, array.nbytes, 1)  # host to device
    return int(pointer)
