"""The stages that produce the converted model: the source's runner and ONNX graph (export),
then simplification, ONNX Runtime optimization and precision conversion, or a TensorRT build."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from converters import tensorrt
from converters.data import load_npz, split_rows
from converters.errors import ConversionError
from converters.export import sklearn_to_onnx, torch_to_onnx
from converters.optimize import ort_optimize, quantize_int8, simplify, to_fp16
from converters.options import ConvertOptions
from converters.report import Steps
from converters.runners import OnnxRunner, Runner, SklearnRunner, TorchRunner, serving_providers
from converters.signature import opset_of
from converters.sources import Source
from converters.spec import EXPORT_BATCH, InputSpec, random_feeds

CALIBRATION_BATCH_ROWS = 16


def optimize(
    model: Any, specs: list[InputSpec], max_batch: int, options: ConvertOptions, steps: Steps
) -> tuple[Runner, bytes, Any]:
    """Simplify, optimize and convert precision (or build a TensorRT engine); returns the
    converted model's runner, its file contents and its ONNX graph."""
    with tempfile.TemporaryDirectory(prefix="sluice-convert-") as folder:
        workdir = Path(folder)
        if options.simplify:
            with steps.step("simplify") as step:
                before = len(model.graph.node)
                model = simplify(model)
                step.detail = f"{before} -> {len(model.graph.node)} nodes"
        if options.target == "tensorrt":
            if options.precision == "int8":
                model = _quantize(model, specs, max_batch, options, steps, workdir)
            with steps.step("build TensorRT engine") as step:
                build = tensorrt.build_engine(
                    model.SerializeToString(),
                    specs,
                    max_batch,
                    options.preferred_batch_sizes,
                    options.precision,
                    options.tensorrt_builder_workspace_bytes or tensorrt.BUILDER_WORKSPACE_BYTES,
                    options.tensorrt_engine_cache,
                    options.tensorrt_engine_cache_enabled,
                    options.tensorrt_hardware_compatibility,
                )
                steps.report.tensorrt = build.record
                cached = " (from the engine cache)" if build.record["cached"] else ""
                step.detail = f"{len(build.plan)} bytes{cached}"
            built = build.record
            steps.report.validated_on = f"TensorRT {built['version']} on {built['gpu']}"
            return tensorrt.TensorRTRunner(build.plan), build.plan, model
        level = options.optimization_level
        if options.precision == "fp16":
            # Saving a model through ONNX Runtime bakes in what its CPU provider needs, and for
            # fp16 that is fp32 casts around every op it lacks fp16 kernels for, which would
            # publish an fp32 model in disguise. So: provider-neutral rewrites on the fp32 graph,
            # then the conversion; the server optimizes further at load for its own provider.
            model = _ort_optimize(model, "basic" if level != "disable" else level, steps, workdir)
            with steps.step("convert to fp16") as step:
                model = to_fp16(model, options.fp16_block, options.keep_io_types)
                step.detail = "fp32 inputs/outputs kept" if options.keep_io_types else "fp16 I/O"
        else:
            if options.precision == "int8":
                model = _quantize(model, specs, max_batch, options, steps, workdir)
            model = _ort_optimize(model, level, steps, workdir)
    payload = model.SerializeToString()
    converted = OnnxRunner(payload, options.threads, providers=serving_providers())
    steps.report.validated_on = converted.provider
    return converted, payload, model


def _ort_optimize(model: Any, level: str, steps: Steps, workdir: Path) -> Any:
    if level == "disable":
        return model
    with steps.step("optimize (ONNX Runtime)") as step:
        before = len(model.graph.node)
        model = ort_optimize(model, level, workdir)
        step.detail = f"{level}: {before} -> {len(model.graph.node)} nodes"
    return model


def _quantize(
    model: Any,
    specs: list[InputSpec],
    max_batch: int,
    options: ConvertOptions,
    steps: Steps,
    workdir: Path,
) -> Any:
    with steps.step("quantize to int8") as step:
        calibration = None
        if options.calibration is not None:
            arrays = load_npz(options.calibration, specs, max_batch > 0)
            calibration = split_rows(arrays, min(max_batch, CALIBRATION_BATCH_ROWS), max_batch > 0)
        # TensorRT wants symmetric activations and its kernels do not saturate; ONNX Runtime's
        # x86 kernels without VNNI do unless the weights have 7 bits (see U8S8_WEIGHT_LIMIT).
        tensorrt_model = options.target == "tensorrt"
        model = quantize_int8(
            model,
            workdir,
            calibration,
            options.per_channel,
            symmetric=tensorrt_model,
            reduce_range=not tensorrt_model,
        )
        kind = f"static QDQ, {len(calibration)} batches" if calibration else "dynamic"
        bits = "8-bit" if tensorrt_model else "7-bit"
        granularity = "per-channel" if options.per_channel else "per-tensor"
        step.detail = f"{kind}, {granularity}, {bits} weights"
    return model


def export(source: Source, specs: list[InputSpec], options: ConvertOptions) -> tuple[Runner, Any]:
    """The source's runner and its ONNX graph."""
    if options.output_names and source.kind in ("onnx", "sklearn"):
        raise ConversionError(
            "--output names the outputs of a PyTorch source; ONNX and scikit-learn models "
            "keep their own output names"
        )
    if source.kind == "onnx":
        model = source.model
        if options.opset is not None and opset_of(model) != options.opset:
            from onnx import version_converter

            model = version_converter.convert_version(model, options.opset)
        return OnnxRunner(source.model.SerializeToString(), options.threads), model
    if source.kind == "sklearn":
        model = sklearn_to_onnx(source.model, specs, options.opset)
        return SklearnRunner(source.model, specs[0].name), model
    module = source.model.module() if source.kind == "exported_program" else source.model
    names = [spec.name for spec in specs]
    probe = TorchRunner(module, names, [], options.threads)
    count = len(probe.run(random_feeds(specs, EXPORT_BATCH, np.random.default_rng(0))))
    outputs = options.output_names or (
        ["output"] if count == 1 else [f"output_{i}" for i in range(count)]
    )
    if len(outputs) != count:
        raise ConversionError(f"--output gives {len(outputs)} names; the module returns {count}")
    model = torch_to_onnx(source, specs, outputs, options.opset, options.exporter)
    return TorchRunner(module, names, outputs, options.threads), model
