"""The conversion pipeline behind `sluice convert`: load the source, export to ONNX, simplify,
optimize and convert precision (or build a TensorRT engine), validate against the source,
measure both, and publish a repository entry only when validation passed (or `force` is set)."""

from __future__ import annotations

import datetime

import numpy as np

from converters import tensorrt
from converters.data import load_npz, random_batches, split_rows
from converters.errors import ConversionError
from converters.export import finalize
from converters.measure import measure, measure_detail
from converters.options import ConvertOptions
from converters.publish import build_config, check_name, config_text, describe_tensors, publish
from converters.report import Report, Steps
from converters.signature import (
    default_name,
    opset_of,
    resolve_max_batch,
    resolve_specs,
    tensor_info,
)
from converters.sources import load_source
from converters.spec import check_pads, random_feeds, unify_axes
from converters.stages import export, optimize
from converters.validate import compare, tolerances_for

VALIDATION_BATCH_ROWS = 16


def convert_model(options: ConvertOptions, steps: Steps) -> Report:
    """Run every step, filling `steps.report`; ConversionError stops at the failing step."""
    report = steps.report
    report.precision, report.target, report.threads = (
        options.precision,
        options.target,
        options.threads,
    )
    _check_options(options)
    with steps.step("load source") as step:
        source = load_source(options.source, options.weights, options.trust_pickle)
        report.source_kind = source.kind
        report.name = check_name(options.name or default_name(options.source))
        specs = unify_axes(resolve_specs(source, options.inputs))
        max_batch = resolve_max_batch(specs, options.max_batch_size)
        check_pads(options.pads, specs)
        if options.pads and max_batch == 0:
            raise ConversionError("--pad needs a batched model (max_batch_size > 0)")
        too_large = [size for size in options.preferred_batch_sizes if size > max_batch]
        if too_large:
            raise ConversionError(
                f"--preferred-batch-size {too_large[0]} is above max_batch_size {max_batch}"
            )
        report.max_batch_size = max_batch
        report.inputs = [{"name": s.name, "datatype": s.datatype, "shape": s.dims()} for s in specs]
        step.detail = f"{source.kind}; max_batch_size {max_batch}"
    with steps.step("check ONNX" if source.kind == "onnx" else "export to ONNX") as step:
        source_runner, model = export(source, specs, options)
        model = finalize(model, specs)
        step.detail = f"opset {opset_of(model)}, {len(model.graph.node)} nodes"
    batched = max_batch > 0
    converted, payload, model = optimize(model, specs, max_batch, options, steps)
    report.outputs = [{"name": n, "datatype": d, "shape": s} for n, d, s in tensor_info(model)]
    # As the published model takes them (--fp16-io makes FP32 inputs FLOAT16).
    served = {name: datatype for name, datatype, _ in tensor_info(model, inputs=True)}
    report.inputs = [{**i, "datatype": served.get(i["name"], i["datatype"])} for i in report.inputs]
    report.model_bytes = len(payload)
    try:
        with steps.step("validate") as step:
            if options.validation_data is not None:
                arrays = load_npz(options.validation_data, specs, batched)
                batches = split_rows(arrays, min(max_batch, VALIDATION_BATCH_ROWS), batched)
            else:
                rows = min(max_batch, VALIDATION_BATCH_ROWS)
                batches = random_batches(specs, options.samples, rows, batched, options.seed)
            tolerances = tolerances_for(
                options.precision,
                options.atol,
                options.rtol,
                options.min_cosine,
                options.max_norm_error,
            )
            report.validation = compare(source_runner, converted, batches, tolerances)
            step.detail = "passed" if report.validation.passed else "FAILED"
            step.failed = not report.validation.passed
        if options.measure_iterations > 0:
            with steps.step("measure") as step:
                rng = np.random.default_rng(options.seed)
                for batch in sorted({1, max_batch}) if batched else [1]:
                    feeds = random_feeds(specs, batch if batched else None, rng)
                    runners = [("source", source_runner), ("converted", converted)]
                    report.timings += measure(
                        runners, feeds, batch, options.measure_iterations, options.measure_seconds
                    )
                step.detail = measure_detail(
                    report.timings, options.measure_iterations, options.measure_seconds
                )
    finally:
        # A TensorRT runner holds device memory and a stream: freed before publishing.
        close = getattr(converted, "close", None)
        if close is not None:
            close()
    if not report.may_publish(options.force, options.dry_run):
        return report
    with steps.step("publish") as step:
        backend = "tensorrt" if options.target == "tensorrt" else "onnxruntime"
        config = build_config(backend, max_batch, options.preferred_batch_sizes, options.pads)
        header = [
            f"Generated by `sluice convert` from {options.source} "
            f"({options.precision}, {options.target}) on {datetime.date.today().isoformat()}.",
            *describe_tensors(report.inputs, tensor_info(model)),
        ]
        published = publish(
            options.repository,
            report.name,
            options.version,
            "model.plan" if backend == "tensorrt" else "model.onnx",
            payload,
            config_text(config, header),
            report.to_json(),
            options.replace_config,
        )
        report.published = published.summary()
        step.detail = f"version {published.version}"
    return report


def _check_options(options: ConvertOptions) -> None:
    if options.target == "tensorrt":
        tensorrt.require_tensorrt()
    if options.calibration is not None and options.precision != "int8":
        raise ConversionError("--calibration is used only with --precision int8")
    if options.target == "tensorrt" and options.precision == "int8" and not options.calibration:
        raise ConversionError("--target tensorrt --precision int8 needs --calibration FILE.npz")
    if options.fp16_block and options.precision != "fp16":
        raise ConversionError("--fp16-block is used only with --precision fp16")
