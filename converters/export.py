"""Export a source to one ONNX graph: torch.onnx (dynamo exporter, or the TorchScript exporter for
TorchScript archives), skl2onnx for scikit-learn, or the ONNX file itself. Then name the dynamic
axes after the input specs, run `onnx.checker` and shape inference, and keep the weights inside
the model (a repository entry is a single self-contained file)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import ConversionError
from converters.quiet import quiet
from converters.sources import Source
from converters.spec import EXPORT_BATCH, Axis, InputSpec, random_feeds

MAX_MODEL_BYTES = 2**31 - 1
"""Protobuf's limit: a single-file ONNX model must stay below 2 GiB."""


def torch_to_onnx(
    source: Source,
    specs: list[InputSpec],
    output_names: list[str],
    opset: int | None,
    exporter: str,
) -> Any:
    """Export a torch module, TorchScript module or exported program to an ONNX ModelProto."""
    import onnx
    import torch

    feeds = random_feeds(specs, EXPORT_BATCH, np.random.default_rng(0))
    args = tuple(torch.from_numpy(feeds[spec.name]) for spec in specs)
    names = [spec.name for spec in specs]
    dynamic = [
        {index: axis.name for index, axis in enumerate(spec.axes) if axis.name} for spec in specs
    ]
    legacy = exporter == "torchscript" or source.kind == "torchscript"
    try:
        with quiet():
            if not legacy:
                program = torch.onnx.export(
                    source.model,
                    args,
                    input_names=names,
                    output_names=output_names,
                    opset_version=opset,
                    dynamo=True,
                    dynamic_shapes=None if source.kind == "exported_program" else tuple(dynamic),
                    verbose=False,
                )
                assert program is not None
                return program.model_proto
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "model.onnx"
                torch.onnx.export(
                    source.model,
                    args,
                    str(path),
                    input_names=names,
                    output_names=output_names,
                    opset_version=opset,
                    dynamo=False,
                    dynamic_axes={name: axes for name, axes in zip(names, dynamic, strict=True)},
                )
                return onnx.load(str(path))
    except Exception as exc:
        raise ConversionError(describe_export_error(exc, opset)) from exc


def describe_export_error(exc: BaseException, opset: int | None) -> str:
    """One line that names the operator that could not be exported, when the exporter says."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    target = f"ONNX opset {opset}" if opset else "ONNX"
    op = re.search(r"op='([^']+)'", text) or re.search(r"Exporting the operator '([^']+)'", text)
    if op:
        why = re.search(r"Failure message: (.+)", text)
        reason = why.group(1).strip() if why else _summary(text)
        return f"operator {op.group(1)} cannot be exported to {target}: {reason}"[:500]
    return f"the model cannot be exported to {target}: {_summary(text)}"


def _summary(text: str) -> str:
    lines = [line.strip() for line in text.splitlines()]
    causes = [line for line in lines if line.startswith("<class ")]
    chosen = causes[0] if causes else next((line for line in lines if line), "no message")
    return re.sub(r"^<class '(?:[\w.]*\.)?(\w+)'>: ", r"\1: ", chosen)[:400]


def sklearn_to_onnx(estimator: Any, specs: list[InputSpec], opset: int | None) -> Any:
    """Convert a scikit-learn estimator or pipeline with skl2onnx (probabilities as a tensor)."""
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import (
        DoubleTensorType,
        FloatTensorType,
        Int64TensorType,
    )
    from sklearn.base import is_classifier
    from sklearn.pipeline import Pipeline

    if len(specs) != 1:
        raise ConversionError(
            f"a scikit-learn model takes one input (a feature matrix); got {len(specs)} specs"
        )
    types = {"f4": FloatTensorType, "f8": DoubleTensorType, "i8": Int64TensorType}
    key = specs[0].dtype.str.lstrip("<>|=")
    if key not in types:
        raise ConversionError(
            f"scikit-learn input dtype {specs[0].datatype} is not supported; "
            "use FP32, FP64 or INT64"
        )
    shape = [None if axis.dynamic else axis.size for axis in specs[0].axes]
    final = estimator[-1] if isinstance(estimator, Pipeline) else estimator
    options = {id(final): {"zipmap": False}} if is_classifier(estimator) else None
    try:
        with quiet():
            return to_onnx(
                estimator,
                initial_types=[(specs[0].name, types[key](shape))],
                options=options,
                target_opset=opset,
            )
    except Exception as exc:
        raise ConversionError(
            f"skl2onnx cannot convert {type(estimator).__name__}: {exc}".splitlines()[0][:400]
        ) from exc


def onnx_specs(model: Any) -> list[InputSpec]:
    """Input specs read from an ONNX graph (initializers listed as inputs are skipped)."""
    from onnx import helper

    weights = {init.name for init in model.graph.initializer}
    specs = []
    for value in model.graph.input:
        if value.name in weights:
            continue
        tensor = value.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type))
        axes = []
        for index, dim in enumerate(tensor.shape.dim):
            if dim.HasField("dim_value") and dim.dim_value > 0:
                axes.append(Axis(dim.dim_value))
            else:
                name = dim.dim_param or ("batch" if index == 0 else f"{value.name}_{index}")
                axes.append(Axis(8, re.sub(r"[^A-Za-z0-9_]", "_", name)))
        specs.append(InputSpec(value.name, dtype, tuple(axes)))
    return specs


def finalize(model: Any, specs: list[InputSpec]) -> Any:
    """Name dynamic axes after the specs, check the model and infer shapes."""
    import onnx

    renames: dict[str, str] = {}
    by_name = {spec.name: spec for spec in specs}
    for value in model.graph.input:
        spec = by_name.get(value.name)
        if spec is None:
            continue
        for dim, axis in zip(value.type.tensor_type.shape.dim, spec.axes, strict=False):
            if axis.name and dim.dim_param and dim.dim_param != axis.name:
                renames[dim.dim_param] = axis.name
            if axis.name and not dim.dim_param:
                dim.dim_param = axis.name
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in renames:
                dim.dim_param = renames[dim.dim_param]
    size = model.ByteSize()
    if size > MAX_MODEL_BYTES:
        raise ConversionError(
            f"the model is {size} bytes; a single-file ONNX model must be below 2 GiB"
        )
    try:
        onnx.checker.check_model(model)
        return onnx.shape_inference.infer_shapes(model)
    except Exception as exc:
        raise ConversionError(f"the exported model is not valid ONNX: {exc}") from exc
