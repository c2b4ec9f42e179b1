"""The converted model's signature: input specs (read from an ONNX or scikit-learn model, or
given with --input, merged and checked), max_batch_size, and the output tensors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import ConversionError
from converters.export import onnx_specs
from converters.sources import Source
from converters.spec import Axis, InputSpec
from engine.datatypes import from_numpy

DEFAULT_MAX_BATCH_SIZE = 32


def resolve_specs(source: Source, given: list[InputSpec]) -> list[InputSpec]:
    """The input specs: from the model (ONNX, scikit-learn) with the user's overrides."""
    if source.kind == "onnx":
        return merge_specs(onnx_specs(source.model), given)
    if given:
        return given
    if source.kind == "sklearn":
        features = getattr(source.model, "n_features_in_", None)
        if features is None:
            raise ConversionError("the estimator does not say its feature count; give --input")
        return [InputSpec("input", np.dtype(np.float32), (Axis(8, "batch"), Axis(features)))]
    raise ConversionError(
        "a PyTorch source needs --input NAME:DTYPE:SHAPE for each forward() argument, in order "
        "(e.g. --input image:FP32:-1,3,32,32)"
    )


def merge_specs(model: list[InputSpec], given: list[InputSpec]) -> list[InputSpec]:
    """The model's input specs, each replaced by a compatible user spec of the same name."""
    by_name = {spec.name: spec for spec in model}
    for spec in given:
        own = by_name.get(spec.name)
        if own is None:
            raise ConversionError(
                f"--input '{spec.name}' is not a model input; inputs: {', '.join(by_name)}"
            )
        fits = len(spec.axes) == len(own.axes) and all(
            mine.dynamic or (not theirs.dynamic and theirs.size == mine.size)
            for mine, theirs in zip(own.axes, spec.axes, strict=True)
        )
        if not fits or spec.dtype != own.dtype:
            raise ConversionError(
                f"--input {spec.name}: {spec.datatype} {spec.dims()} does not fit the model's "
                f"{own.datatype} {own.dims()}"
            )
    overrides = {spec.name: spec for spec in given}
    return [overrides.get(spec.name, spec) for spec in model]


def resolve_max_batch(specs: list[InputSpec], requested: int | None) -> int:
    """max_batch_size: requested, else 32 when every input has a dynamic first axis, else 0."""
    unbatched = [spec.name for spec in specs if not spec.batched]
    if requested is None:
        return 0 if unbatched else DEFAULT_MAX_BATCH_SIZE
    if requested > 0 and unbatched:
        raise ConversionError(
            f"--max-batch-size {requested} needs a dynamic first (batch) axis on every input; "
            f"fixed on: {', '.join(unbatched)}"
        )
    return requested


def default_name(source: str) -> str:
    """A model name from the source: the factory's name, or the file's stem (the model folder's
    name for a file already in a repository, `<name>/<version>/model.onnx`)."""
    if ":" in source and not Path(source).exists():
        base = source.rsplit(":", 1)[-1].rsplit(".", 1)[-1]
    else:
        path = Path(source)
        in_repository = path.stem == "model" and path.parent.name.isdigit()
        base = path.parent.parent.name if in_repository else path.stem
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", base).lstrip(".-") or "model"


def tensor_info(model: Any, inputs: bool = False) -> list[tuple[str, str, list[Any]]]:
    """(name, datatype, dims) of each graph output (or input: initializers aside)."""
    from onnx import helper

    info = []
    weights = {init.name for init in model.graph.initializer}
    values = (
        [v for v in model.graph.input if v.name not in weights] if inputs else model.graph.output
    )
    for value in values:
        tensor = value.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.elem_type))
        dims = [
            d.dim_param or (d.dim_value if d.HasField("dim_value") else -1)
            for d in tensor.shape.dim
        ]
        info.append((value.name, from_numpy(dtype), dims))
    return info


def opset_of(model: Any) -> int:
    """The model's default-domain opset version."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
