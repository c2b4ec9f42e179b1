"""`sluice convert` of a Hugging Face encoder folder (converters/hf_encoder.py): export, optimize
and convert precision with the single-shot stages, validate end to end on sample texts against
the source, and publish three repository entries:

    <name>-tokenizer/<v>/tokenizer.json   backend tokenizer, max_length as the source cuts
    <name>-encoder/<v>/model.onnx         padded along `seq`, so lengths share batches
    <name>/config.yaml                    the pipeline: text BYTES [-1] -> embeddings, or
                                          logits and labels

The pipeline's config is written last, so a server polling the repository finds its steps
already in place."""

from __future__ import annotations

import datetime
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import ConversionError
from converters.export import finalize
from converters.hf_encoder import (
    SEQUENCE_AXIS,
    EncoderSource,
    ServedRunner,
    SourceRunner,
    add_label_head,
    export_encoder,
    load_encoder,
)
from converters.measure import measure, measure_detail
from converters.options import ConvertOptions
from converters.publish import build_config, check_name, config_text, publish, versions
from converters.quiet import quiet
from converters.report import Report, Steps
from converters.runners import OnnxRunner, Runner, serving_providers
from converters.signature import opset_of, tensor_info
from converters.spec import Axis, InputSpec, PadRequest
from converters.stages import optimize
from converters.validate import compare, tolerances_for
from engine.model_config import load_model_config
from engine.settings import SettingsError

DEFAULT_MAX_BATCH = 64
VALIDATION_BATCH_ROWS = 16
_WORD_TEXT = (
    "the quick brown fox jumps over lazy dog a server answers every request once text goes in "
    "and answers come out embeddings place similar sentences close together while batches merge "
    "concurrent requests of different lengths café naïve 2026 3.14 e-mail don't Hello, world! "
    "tokenizers split unknown words like zyxwv into pieces 東京 🙂"
)
WORDS = tuple(_WORD_TEXT.split())
"""Words the sample texts are drawn from: plain words, punctuation, numbers, accents, a word
the vocabulary lacks, CJK and an emoji (unknown pieces)."""


def sample_texts(source: EncoderSource, count: int, seed: int) -> list[str]:
    """`count` texts of varied lengths: an empty one, one word, a spread up to max_length, and
    one longer than max_length (so truncation is validated too)."""
    rng = np.random.default_rng(seed)
    limit = source.max_length
    texts = ["", "hello"]
    while len(texts) < max(count - 1, 2):
        words = int(rng.integers(2, max(3, int(limit * 0.8))))
        texts.append(" ".join(rng.choice(WORDS, words)))
    long_words = list(rng.choice(WORDS, limit))
    with quiet():  # transformers warns of a text longer than the model's limit: that is the point
        while len(source.tokenizer(" ".join(long_words), truncation=False)["input_ids"]) <= limit:
            long_words += list(rng.choice(WORDS, limit))
    texts.append(" ".join(long_words))
    order = rng.permutation(len(texts))  # mix lengths within each validation batch
    return [texts[i] for i in order][: max(count, 3)]


def _text_batches(texts: list[str], rows: int) -> list[dict[str, np.ndarray]]:
    return [
        {"text": np.array(texts[start : start + rows], dtype=object)}
        for start in range(0, len(texts), rows)
    ]


def _check_options(options: ConvertOptions) -> None:
    given = [
        flag
        for flag, value in (
            ("--input", options.inputs),
            ("--output", options.output_names),
            ("--weights", options.weights),
            ("--calibration", options.calibration),
            ("--validation-data", options.validation_data),
            ("--pad", options.pads),
        )
        if value
    ]
    if given:
        raise ConversionError(
            f"{', '.join(given)} do not apply to a Hugging Face encoder folder: its inputs, "
            "outputs and padding come from the folder"
        )
    if options.target != "onnxruntime":
        raise ConversionError(
            f"a Hugging Face encoder converts for onnxruntime; got --target {options.target}"
        )
    if options.fp16_block and options.precision != "fp16":
        raise ConversionError("--fp16-block is used only with --precision fp16")


def convert_encoder(options: ConvertOptions, steps: Steps) -> Report:
    """Load, export, optimize, validate, measure and publish an encoder folder."""
    report = steps.report
    report.precision, report.target, report.threads = (
        options.precision,
        options.target,
        options.threads,
    )
    _check_options(options)
    folder = Path(options.source)
    with steps.step("load source") as step:
        source = load_encoder(folder)
        report.source_kind = f"hf_{source.kind}"
        report.name = check_name(options.name or folder.resolve().name)
        names = _entry_names(report.name)
        max_batch = options.max_batch_size or DEFAULT_MAX_BATCH
        report.max_batch_size = max_batch
        report.inputs = [{"name": "text", "datatype": "BYTES", "shape": ["batch"]}]
        step.detail = f"{source.description}; max_length {source.max_length}"
    with tempfile.TemporaryDirectory(prefix="sluice-convert-") as scratch:
        with steps.step("export to ONNX") as step:
            path = Path(scratch) / "encoder.onnx"
            export_encoder(source, path, options.opset)
            import onnx

            specs = [
                InputSpec(n, np.dtype(np.int64), (Axis(2, "batch"), Axis(8, SEQUENCE_AXIS)))
                for n in source.input_names
            ]
            model = finalize(onnx.load(str(path)), specs)
            step.detail = f"opset {opset_of(model)}, {len(model.graph.node)} nodes"
        converted, payload, model = optimize(model, specs, max_batch, options, steps)
        if source.labels is not None:
            with steps.step("add label head") as step:
                model = add_label_head(model, source.labels)
                payload = model.SerializeToString()
                converted = OnnxRunner(payload, options.threads, providers=serving_providers())
                step.detail = f"labels: id2label of argmax(logits), {len(source.labels)} labels"
        tokenizer_bytes = source.tokenizer_json()
        tokenizer_config = _tokenizer_config(source, max_batch)
        tokenizer = _served_tokenizer(tokenizer_bytes, tokenizer_config, Path(scratch))
        served = ServedRunner(tokenizer, converted, source.input_names)
        report.outputs = [{"name": n, "datatype": d, "shape": s} for n, d, s in tensor_info(model)]
        report.model_bytes = len(payload)
        with steps.step("validate") as step:
            texts = sample_texts(source, options.samples, options.seed)
            tolerances = tolerances_for(
                options.precision,
                options.atol,
                options.rtol,
                options.min_cosine,
                options.max_norm_error,
            )
            batches = _text_batches(texts, min(max_batch, VALIDATION_BATCH_ROWS))
            report.validation = compare(
                SourceRunner(source, options.threads), served, batches, tolerances
            )
            step.detail = (
                f"{len(texts)} texts: {'passed' if report.validation.passed else 'FAILED'}"
            )
            step.failed = not report.validation.passed
        if options.measure_iterations > 0:
            with steps.step("measure") as step:
                runners: list[tuple[str, Runner]] = [
                    ("source", SourceRunner(source, options.threads)),
                    ("converted", served),
                ]
                for batch in sorted({1, min(max_batch, len(texts))}):
                    feeds = {"text": np.array(texts[:batch], dtype=object)}
                    report.timings += measure(
                        runners, feeds, batch, options.measure_iterations, options.measure_seconds
                    )
                detail = measure_detail(
                    report.timings, options.measure_iterations, options.measure_seconds
                )
                step.detail = f"{detail} (texts)"
    if not report.may_publish(options.force, options.dry_run):
        return report
    with steps.step("publish") as step:
        report.published = _publish(
            options, report, source, names, tokenizer_bytes, tokenizer_config, payload, model
        )
        step.detail = f"{names['pipeline']} -> {names['tokenizer']}, {names['encoder']}"
    return report


def _entry_names(name: str) -> dict[str, str]:
    return {
        "pipeline": name,
        "tokenizer": check_name(f"{name}-tokenizer"),
        "encoder": check_name(f"{name}-encoder"),
    }


def _tokenizer_config(source: EncoderSource, max_batch: int) -> dict[str, Any]:
    return {
        "backend": "tokenizer",
        "max_batch_size": max_batch,
        "tokenizer": {"max_length": source.max_length, "pad_id": source.pad_id},
    }


def _served_tokenizer(payload: bytes, config: dict[str, Any], scratch: Path) -> Any:
    """sluice's tokenizer step, loaded from what will be published."""
    from engine.backends.tokenizer import TokenizerBackend
    from engine.step_config import TokenizerOptions

    path = scratch / "tokenizer.json"
    path.write_bytes(payload)
    return TokenizerBackend(path, TokenizerOptions(**config["tokenizer"]), "tokenizer step")


def _pipeline_config(source: EncoderSource, names: dict[str, str]) -> dict[str, Any]:
    def same(tensors: list[str]) -> dict[str, str]:  # a fresh mapping: no YAML anchors
        return {name: name for name in tensors}

    outputs = source.output_names
    tokens = source.input_names
    return {
        "pipeline": {
            "steps": [
                {"model": names["tokenizer"], "inputs": {"text": "text"}, "outputs": same(tokens)},
                {"model": names["encoder"], "inputs": same(tokens), "outputs": same(outputs)},
            ],
            "outputs": outputs,
        }
    }


def _publish(
    options: ConvertOptions,
    report: Report,
    source: EncoderSource,
    names: dict[str, str],
    tokenizer_bytes: bytes,
    tokenizer_config: dict[str, Any],
    payload: bytes,
    model: Any,
) -> dict[str, Any]:
    repository = options.repository
    for entry in ("tokenizer", "encoder"):  # refuse before writing anything
        existing = versions(repository / names[entry])
        if options.version is not None and options.version in existing:
            raise ConversionError(
                f"version {options.version} of model '{names[entry]}' already exists in "
                f"{repository}; existing versions: {existing}"
            )
    header = (
        f"Generated by `sluice convert` from {options.source} ({options.precision}) on "
        f"{datetime.date.today().isoformat()}."
    )
    tokenizer = publish(
        repository,
        names["tokenizer"],
        options.version,
        "tokenizer.json",
        tokenizer_bytes,
        config_text(tokenizer_config, [header, f"Tokenizer step of pipeline {names['pipeline']}."]),
        report.to_json(),
        options.replace_config,
    )
    pads = [
        PadRequest(name, 1, float(source.pad_id if name == "input_ids" else 0))
        for name in source.input_names
    ]
    config = build_config("onnxruntime", report.max_batch_size, options.preferred_batch_sizes, pads)
    outputs = [f"  output {n}: {d} {s}" for n, d, s in tensor_info(model)]
    encoder = publish(
        repository,
        names["encoder"],
        options.version,
        "model.onnx",
        payload,
        config_text(config, [header, f"Model step of pipeline {names['pipeline']}.", *outputs]),
        report.to_json(),
        options.replace_config,
    )
    pipeline_header = [
        header,
        f"Pipeline: text BYTES [-1] -> {', '.join(source.output_names)}.",
    ]
    written = _write_pipeline_config(
        repository / names["pipeline"],
        config_text(_pipeline_config(source, names), pipeline_header),
        options.replace_config,
    )
    return {
        "model_path": str(repository / names["pipeline"] / "config.yaml"),
        "version": encoder.version,
        "config_written": written,
        "tokenizer_path": str(tokenizer.model_path),
        "encoder_path": str(encoder.model_path),
        "tokenizer_version": tokenizer.version,
    }


def _write_pipeline_config(model_dir: Path, text: str, replace: bool) -> bool:
    """Write the pipeline's config.yaml whole (a temporary file renamed over it), checked as the
    server would load it; an existing one stays unless `replace`."""
    path = model_dir / "config.yaml"
    if path.exists() and not replace:
        return False
    model_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".sluice-convert-", dir=model_dir))
    try:
        (staging / "config.yaml").write_text(text)
        try:
            load_model_config(staging)
        except SettingsError as exc:
            raise ConversionError(f"{path} would not load in sluice serve: {exc}") from exc
        os.replace(staging / "config.yaml", path)
    finally:
        for leftover in staging.iterdir():
            leftover.unlink()
        staging.rmdir()
    return True
