"""TensorRT engine builds (`--target tensorrt`), import-guarded: without a CUDA GPU and the
`tensorrt` package every entry point raises MissingDependency naming what is absent.

fp16 engines are built from the fp32 ONNX model with TensorRT's FP16 flag. int8 engines use
explicit quantization: the ONNX model is first quantized to symmetric QDQ with the calibration
data (TensorRT's recommended path since its implicit calibrators were deprecated), then built
with the INT8 flag. One optimization profile covers batch 1 to max_batch_size, tuned for the
largest preferred batch size; other dynamic axes range from 1 to their example size."""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Mapping
from typing import Any

import numpy as np

from converters.errors import ConversionError, MissingDependency
from converters.spec import InputSpec

WORKSPACE_BYTES = 1 << 30


def missing_requirements() -> list[str]:
    """What this machine lacks for TensorRT builds; empty when everything is there."""
    missing = []
    if importlib.util.find_spec("tensorrt") is None:
        missing.append(
            "the tensorrt package is not installed (pip install 'sluice[gpu]' "
            "--extra-index-url https://pypi.nvidia.com)"
        )
    count, why = cuda_devices()
    if count == 0:
        missing.append(f"no CUDA GPU: {why}")
    return missing


def cuda_devices() -> tuple[int, str]:
    """The number of CUDA GPUs the driver sees, and why there are none when so."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0, "the NVIDIA driver library libcuda.so.1 is not installed"
    status = driver.cuInit(0)
    if status != 0:
        return 0, f"the CUDA driver failed to initialise (cuInit returned {status})"
    count = ctypes.c_int(0)
    if driver.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return 0, "the CUDA driver reports no devices"
    return count.value, ""


def require_tensorrt() -> None:
    """Raise MissingDependency unless a TensorRT build can run here."""
    missing = missing_requirements()
    if missing:
        raise MissingDependency("--target tensorrt", missing)


def profile_shapes(
    spec: InputSpec, max_batch_size: int, preferred: list[int]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(min, opt, max) shapes of one input for the optimization profile."""
    fitting = [size for size in preferred if 0 < size <= max_batch_size]
    opt_batch = max(fitting) if fitting else max_batch_size
    low, opt, high = [], [], []
    for index, axis in enumerate(spec.axes):
        if index == 0 and spec.batched and max_batch_size > 0:
            sizes = (1, opt_batch, max_batch_size)
        elif axis.dynamic:
            sizes = (1, axis.size, axis.size)
        else:
            sizes = (axis.size, axis.size, axis.size)
        low.append(sizes[0])
        opt.append(sizes[1])
        high.append(sizes[2])
    return tuple(low), tuple(opt), tuple(high)


def build_engine(
    onnx_model: bytes,
    specs: list[InputSpec],
    max_batch_size: int,
    preferred: list[int],
    precision: str,
) -> bytes:
    """A serialized TensorRT engine (`model.plan`) for this GPU and TensorRT version."""
    require_tensorrt()
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_model):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ConversionError(f"TensorRT cannot parse the ONNX model: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    if precision in ("fp16", "int8"):
        config.set_flag(trt.BuilderFlag.FP16)
    if precision == "int8":
        config.set_flag(trt.BuilderFlag.INT8)
    profile = builder.create_optimization_profile()
    for spec in specs:
        profile.set_shape(spec.name, *profile_shapes(spec, max_batch_size, preferred))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ConversionError("TensorRT could not build an engine; its log above says why")
    return bytes(plan)


class TensorRTRunner:
    """Runs a serialized engine on the GPU (buffers are torch CUDA tensors)."""

    def __init__(self, plan: bytes) -> None:
        require_tensorrt()
        import tensorrt as trt
        import torch

        if not torch.cuda.is_available():
            raise MissingDependency(
                "running a TensorRT engine", ["the installed torch has no CUDA support"]
            )
        self._trt: Any = trt
        self.engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(plan)
        if self.engine is None:
            raise ConversionError("TensorRT cannot load the engine it built")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        output = trt.TensorIOMode.OUTPUT
        self.output_names = [n for n in names if self.engine.get_tensor_mode(n) == output]

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        import torch

        kept = []
        for name, value in feeds.items():
            dtype = self._trt.nptype(self.engine.get_tensor_dtype(name))
            tensor = torch.from_numpy(np.ascontiguousarray(value.astype(dtype))).cuda()
            self.context.set_input_shape(name, tuple(tensor.shape))
            self.context.set_tensor_address(name, tensor.data_ptr())
            kept.append(tensor)
        results = []
        for name in self.output_names:
            dtype = self._trt.nptype(self.engine.get_tensor_dtype(name))
            shape = tuple(self.context.get_tensor_shape(name))
            tensor = torch.from_numpy(np.empty(shape, dtype=dtype)).cuda()
            self.context.set_tensor_address(name, tensor.data_ptr())
            results.append(tensor)
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise ConversionError("TensorRT failed to run the engine")
        stream.synchronize()
        return [tensor.cpu().numpy() for tensor in results]
