"""Graph optimizations: simplification (onnxslim), fp16 conversion, int8 quantization (dynamic,
or static with calibration data) and ONNX Runtime's offline graph optimization.

Each function takes and returns an onnx ModelProto; ONNX Runtime's tools work on files, so they
get a scratch folder."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from contextlib import chdir
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import ConversionError
from converters.quiet import quiet
from converters.runners import OnnxRunner

FP16_EXTRA_BLOCK = (
    "Exp",
    "Pow",
    "ReduceSum",
    "ReduceSumSquare",
    "ReduceL2",
    "ReduceLogSumExp",
    "ReduceProd",
    "LayerNormalization",
)
"""Ops kept in fp32 on top of ONNX Runtime's default list: sums, squares and exponentials are
where fp16's range (65504) overflows into Inf and then NaN."""

INT8_OP_TYPES = ("Conv", "ConvTranspose", "MatMul", "Gemm")
"""Ops quantized by default: the compute-heavy ones; normalizations and element-wise ops stay
in float, which keeps int8 models close to their source."""

U8S8_WEIGHT_LIMIT = 64
"""Largest |int8 weight| in a model quantized for ONNX Runtime on a CPU (7-bit weights, ONNX
Runtime's `reduce_range`). x86 CPUs without VNNI (AVX2, AVX-512 without VNNI) multiply uint8
activations by int8 weights with vpmaddubsw, which adds each two neighbouring products into an
int16 and saturates: 2 * 255 * 127 = 64770 does not fit in 32767, 2 * 255 * 64 = 32640 does. So
the kernels with and without VNNI compute the same integers and a model validated on one host
answers the same on the next."""


def simplify(model: Any) -> Any:
    """Constant-fold and remove redundant nodes with onnxslim."""
    import onnxslim

    try:
        with quiet():
            return onnxslim.slim(model)
    except Exception as exc:
        raise ConversionError(f"onnxslim cannot simplify the model: {exc}") from exc


def to_fp16(model: Any, block: Sequence[str] = (), keep_io_types: bool = True) -> Any:
    """Convert float weights and compute to fp16; blocked ops and (by default) the model's
    inputs and outputs stay fp32, so clients send and receive the same tensors as before."""
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    block_list = sorted({*DEFAULT_OP_BLOCK_LIST, *FP16_EXTRA_BLOCK, *block})
    try:
        with quiet():
            return convert_float_to_float16(
                model, keep_io_types=keep_io_types, op_block_list=block_list
            )
    except Exception as exc:
        raise ConversionError(f"fp16 conversion failed: {exc}") from exc


def quantize_int8(
    model: Any,
    workdir: Path,
    calibration: Sequence[Mapping[str, np.ndarray]] | None = None,
    per_channel: bool = True,
    symmetric: bool = False,
    reduce_range: bool = True,
) -> Any:
    """int8 weights: dynamic quantization (activations quantized at run time) when no
    calibration data is given, else static QDQ quantization calibrated on those batches.
    `symmetric` makes activations signed and symmetric, as TensorRT requires. `reduce_range`
    keeps weights within +-U8S8_WEIGHT_LIMIT (7 bits) so that no x86 kernel saturates; only a
    model for TensorRT, whose GPU kernels do not saturate, needs the full 8 bits."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    source, prepared, output = (workdir / f"int8_{n}.onnx" for n in ("in", "prep", "out"))
    onnx.save(model, str(source))
    _pre_process(source, prepared)

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self, batches: Sequence[Mapping[str, np.ndarray]]) -> None:
            self.batches = iter(batches)

        def get_next(self) -> dict[str, np.ndarray] | None:
            batch = next(self.batches, None)
            return None if batch is None else dict(batch)

    try:
        with quiet():
            if calibration is None:
                quantize_dynamic(
                    str(prepared),
                    str(output),
                    per_channel=per_channel,
                    reduce_range=reduce_range,
                    weight_type=QuantType.QInt8,
                    op_types_to_quantize=["MatMul", "Gemm", "Attention", "LSTM"],
                )
            else:
                quantize_static(
                    str(prepared),
                    str(output),
                    Reader(calibration),
                    quant_format=QuantFormat.QDQ,
                    per_channel=per_channel,
                    reduce_range=reduce_range,
                    activation_type=QuantType.QInt8 if symmetric else QuantType.QUInt8,
                    weight_type=QuantType.QInt8,
                    op_types_to_quantize=list(INT8_OP_TYPES),
                    extra_options={"ActivationSymmetric": symmetric, "WeightSymmetric": True},
                )
    except Exception as exc:
        kind = "dynamic" if calibration is None else "static"
        raise ConversionError(f"int8 {kind} quantization failed: {exc}") from exc
    return onnx.load(str(output))


def _pre_process(source: Path, target: Path) -> None:
    # Shape inference and basic fusions first, as ONNX Runtime recommends before quantizing;
    # symbolic shape inference fails on some graphs, and plain ONNX inference then suffices.
    from onnxruntime.quantization.shape_inference import quant_pre_process

    # Symbolic shape inference that comes out incomplete dumps the model into the current
    # directory (sym_shape_infer_temp.onnx and its external data): never the user's.
    source, target = source.resolve(), target.resolve()
    with quiet(), tempfile.TemporaryDirectory(prefix="sluice-quant-") as scratch, chdir(scratch):
        try:
            quant_pre_process(str(source), str(target))
        except Exception:
            quant_pre_process(str(source), str(target), skip_symbolic_shape=True)


def ort_optimize(model: Any, level: str, workdir: Path) -> Any:
    """Apply ONNX Runtime's graph optimizations at `level` offline and return the saved result.
    `extended` and `all` may use ONNX Runtime's own fused ops (com.microsoft), so the result is
    meant for ONNX Runtime; `all` also adds CPU-specific layouts."""
    import onnx

    if level == "disable":
        return model
    source, target = workdir / "ort_in.onnx", workdir / "ort_out.onnx"
    onnx.save(model, str(source))
    with quiet():
        runner = OnnxRunner(source, optimization=level, save_to=target)
    del runner
    optimized = onnx.load(str(target))
    _prune_opsets(optimized)
    return optimized


def _prune_opsets(model: Any) -> None:
    # ONNX Runtime lists every domain it knows when it saves a model; keep the used ones.
    used = {""} | _domains(model.graph.node)
    for function in model.functions:
        used |= _domains(function.node)
    kept = [opset for opset in model.opset_import if opset.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(kept)


def _domains(nodes: Any) -> set[str]:
    found: set[str] = set()
    for node in nodes:
        found.add(node.domain)
        for attribute in node.attribute:  # subgraphs of If, Loop and Scan
            for graph in [attribute.g, *attribute.graphs]:
                found |= _domains(graph.node)
    return found
