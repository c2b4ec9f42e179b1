"""`sluice convert`: turn a PyTorch, scikit-learn or ONNX model into a validated, optimized
model-repository entry. Imports stay light (no torch) until the command runs.

Exit status: 0 published (or dry run passed), 1 conversion error, 2 usage error,
3 validation failed (nothing published)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

EXIT_VALIDATION_FAILED = 3


def _parse_all(parse: Any, values: tuple[str, ...], option: str) -> list[Any]:
    from converters.errors import ConversionError

    try:
        return [parse(value) for value in values]
    except ConversionError as exc:
        raise click.BadParameter(exc.message, param_hint=option) from None


class _Bytes(click.ParamType):  # type: ignore[type-arg]  # generic only since click 8.2
    """A positive whole number of bytes; a size with a unit is refused with what to give."""

    name = "bytes"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            count = int(value)
        except ValueError:
            self.fail(f"{value!r} is not a number of bytes (give an integer: 1073741824 is 1 GiB)")
        if count < 1:
            self.fail(f"{count} is not a positive number of bytes")
        return count


def _check_tensorrt_options(params: dict[str, Any]) -> None:
    given = [
        option
        for option, value in (
            ("--builder-workspace", params["workspace"]),
            ("--hardware-compatibility", params["hardware_compatibility"]),
            ("--engine-cache", params["engine_cache"]),
            ("--no-engine-cache", params["no_engine_cache"] or None),
        )
        if value is not None
    ]
    if given and params["target"] != "tensorrt":
        raise click.UsageError(
            f"{given[0]} is used only with --target tensorrt (the target is {params['target']})"
        )
    if params["engine_cache"] is not None and params["no_engine_cache"]:
        raise click.UsageError(
            f"--engine-cache {params['engine_cache']} and --no-engine-cache contradict each "
            "other: give one"
        )


@click.command("convert")
@click.argument("source")
@click.option("--name", help="Model name in the repository [default: from SOURCE].")
@click.option(
    "--repository",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("models"),
    show_default=True,
    help="Model repository folder to publish into.",
)
@click.option(
    "--input",
    "inputs",
    multiple=True,
    metavar="NAME:DTYPE:SHAPE[:LOW..HIGH]",
    help="An input, batch axis included: -1 or a NAME for dynamic axes, NAME=N sets the example "
    "size (e.g. input_ids:INT64:batch,sequence=16:0..1000). Repeat per input, in order.",
)
@click.option("--output", "outputs", multiple=True, help="Output names of a PyTorch source.")
@click.option(
    "--weights",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="State-dict file loaded into the module a factory SOURCE builds.",
)
@click.option("--trust-pickle", is_flag=True, help="Allow loading pickles (unpickling runs code).")
@click.option(
    "--precision",
    type=click.Choice(["fp32", "fp16", "int8", "int4"]),
    default="fp32",
    show_default=True,
    help="int4 (and fp16 on CUDA): causal LMs onnxruntime-genai's model builder converts.",
)
@click.option(
    "--target",
    type=click.Choice(["onnxruntime", "tensorrt"]),
    default="onnxruntime",
    show_default=True,
)
@click.option(
    "--builder-workspace",
    "--workspace",
    "workspace",
    type=_Bytes(),
    metavar="BYTES",
    help="tensorrt: device memory TensorRT may use while building, in bytes [default: 1 GiB] "
    "(--workspace is its old name). Serving's limit is the model config's "
    "tensorrt.activation_memory_bytes.",
)
@click.option(
    "--hardware-compatibility",
    type=click.Choice(["none", "same_compute_capability", "ampere_plus"]),
    help="tensorrt: GPUs the engine may run on besides this GPU model: any of its compute "
    "capability, or any Ampere or newer GPU (both cost some speed) [default: none].",
)
@click.option(
    "--engine-cache",
    type=click.Path(file_okay=False, path_type=Path),
    metavar="DIR",
    help="tensorrt: engine cache folder [default: $SLUICE_TENSORRT_CACHE, else "
    "~/.cache/sluice/tensorrt].",
)
@click.option(
    "--no-engine-cache",
    is_flag=True,
    help="tensorrt: build even if the engine cache has this engine, and store nothing.",
)
@click.option(
    "--calibration",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="FILE.npz of representative inputs: int8 becomes static quantization calibrated on it.",
)
@click.option(
    "--validation-data",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="FILE.npz to validate on instead of random inputs.",
)
@click.option(
    "--samples",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Random rows to validate on.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--atol", type=click.FloatRange(min=0), help="Absolute tolerance [default: by precision]."
)
@click.option(
    "--rtol", type=click.FloatRange(min=0), help="Relative tolerance [default: by precision]."
)
@click.option("--min-cosine", type=click.FloatRange(-1, 1), help="Least cosine similarity allowed.")
@click.option(
    "--max-norm-error",
    type=click.FloatRange(min=0),
    help="Largest relative L2 error ||converted - source|| / ||source|| [default: 0.25 for int8].",
)
@click.option("--opset", type=click.IntRange(min=7), help="ONNX opset [default: the exporter's].")
@click.option(
    "--exporter",
    type=click.Choice(["dynamo", "torchscript"]),
    default="dynamo",
    show_default=True,
    help="torch.onnx exporter for module factories (TorchScript files always use torchscript).",
)
@click.option(
    "--simplify/--no-simplify",
    default=True,
    show_default=True,
    help="Simplify the graph with onnxslim.",
)
@click.option(
    "--optimization-level",
    type=click.Choice(["disable", "basic", "extended", "all"]),
    default="extended",
    show_default=True,
    help="ONNX Runtime offline graph optimization saved into the model (basic stays portable "
    "across execution providers; all adds CPU-specific layouts).",
)
@click.option("--fp16-block", multiple=True, metavar="OP", help="More ops to keep in fp32.")
@click.option("--fp16-io", is_flag=True, help="Make inputs/outputs fp16 too (default: keep fp32).")
@click.option("--per-tensor", is_flag=True, help="int8: one scale per tensor, not per channel.")
@click.option(
    "--max-batch-size",
    type=click.IntRange(min=0),
    help="[default: 32 if every input has a dynamic first axis, else 0]",
)
@click.option("--preferred-batch-size", "preferred", multiple=True, type=click.IntRange(min=1))
@click.option(
    "--pad",
    "pads",
    multiple=True,
    metavar="NAME:AXIS:VALUE",
    help="Let the server pad input NAME along AXIS with VALUE to batch different lengths.",
)
@click.option(
    "--version",
    "version",
    type=click.IntRange(min=1),
    help="Version to write [default: the next one].",
)
@click.option("--replace-config", is_flag=True, help="Overwrite an existing config.yaml.")
@click.option(
    "--measure-iterations",
    type=click.IntRange(min=0),
    default=50,
    show_default=True,
    help="Most timed runs per model and batch size (0 skips measuring).",
)
@click.option(
    "--measure-seconds",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,  # converters.measure.MEASURE_SECONDS, not imported here: imports stay light
    show_default=True,
    help="Time bound of the measurement at each batch size, warm-up included: runs stop once "
    "it is spent (after at least 3 timed runs per model).",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Threads for the source and the converted model while measuring.",
)
@click.option("--force", is_flag=True, help="Publish even if validation fails.")
@click.option("--dry-run", is_flag=True, help="Convert, validate and measure; publish nothing.")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the report as JSON to this file.",
)
def convert(**params: Any) -> None:
    """Convert SOURCE to a validated, optimized model in the repository.

    SOURCE is path/to/file.py:callable or package.module:callable (a factory returning a
    torch.nn.Module), a TorchScript file (.pt/.ts), an exported program (.pt2), a scikit-learn
    pickle (.pkl/.joblib, needs --trust-pickle), an ONNX file (.onnx), a Hugging Face
    causal-LM folder (config.json of a *ForCausalLM and tokenizer.json: a generative model), or
    a Hugging Face encoder folder (a sentence-transformers folder with modules.json, or a
    *ForSequenceClassification, with tokenizer.json: a text pipeline, text in and embeddings or
    logits and labels out).
    """
    from converters.causal_lm import convert_causal_lm
    from converters.encoder_conversion import convert_encoder
    from converters.errors import ConversionError
    from converters.genai_convert import builder_architecture, convert_with_builder
    from converters.hf_decoder import is_causal_lm_folder
    from converters.hf_encoder import is_hf_folder
    from converters.options import ConvertOptions
    from converters.pipeline import convert_model
    from converters.report import Report, Steps, console_for, progress_bar, render
    from converters.spec import parse_input, parse_pad

    _check_tensorrt_options(params)
    options = ConvertOptions(
        source=params["source"],
        repository=params["repository"],
        name=params["name"],
        inputs=_parse_all(parse_input, params["inputs"], "--input"),
        output_names=list(params["outputs"]),
        weights=params["weights"],
        trust_pickle=params["trust_pickle"],
        precision=params["precision"],
        target=params["target"],
        tensorrt_builder_workspace_bytes=params["workspace"],
        tensorrt_hardware_compatibility=params["hardware_compatibility"] or "none",
        tensorrt_engine_cache=params["engine_cache"],
        tensorrt_engine_cache_enabled=not params["no_engine_cache"],
        calibration=params["calibration"],
        validation_data=params["validation_data"],
        samples=params["samples"],
        seed=params["seed"],
        atol=params["atol"],
        rtol=params["rtol"],
        min_cosine=params["min_cosine"],
        max_norm_error=params["max_norm_error"],
        opset=params["opset"],
        exporter=params["exporter"],
        simplify=params["simplify"],
        optimization_level=params["optimization_level"],
        fp16_block=list(params["fp16_block"]),
        keep_io_types=not params["fp16_io"],
        per_channel=not params["per_tensor"],
        max_batch_size=params["max_batch_size"],
        preferred_batch_sizes=list(params["preferred"]),
        pads=_parse_all(parse_pad, params["pads"], "--pad"),
        version=params["version"],
        replace_config=params["replace_config"],
        measure_iterations=params["measure_iterations"],
        measure_seconds=params["measure_seconds"],
        threads=params["threads"],
        force=params["force"],
        dry_run=params["dry_run"],
    )
    console = console_for()
    report = Report(source=options.source)
    try:
        with progress_bar(console_for(stderr=True)) as progress:
            # A Hugging Face causal-LM folder becomes a generative model (past key/values in
            # and out, tokenizer beside it); everything else is a single-shot model.
            # Any other Hugging Face folder is an encoder (sentence-transformers,
            # *ForSequenceClassification), which becomes a text pipeline: tokenizer -> encoder;
            # the encoder conversion names the architectures it takes.
            # An architecture onnxruntime-genai's model builder knows goes through it (int8
            # stays on sluice's own export); GPT-2 and the rest keep sluice's.
            run = convert_causal_lm if is_causal_lm_folder(options.source) else convert_model
            builder = run is convert_causal_lm and builder_architecture(Path(options.source))
            if builder and options.precision != "int8":
                run = convert_with_builder
            if run is convert_model and is_hf_folder(options.source):
                run = convert_encoder
            if options.precision == "int4" and run is not convert_with_builder:
                raise ConversionError(
                    "--precision int4 is for causal LMs onnxruntime-genai's model builder "
                    "converts (Llama, Mistral, Qwen, Phi, Gemma, ...)"
                )
            run(options, Steps(report, progress))
    except ConversionError as exc:
        report.status, report.error = "error", exc.message
    finally:
        if params["json_path"] is not None:
            params["json_path"].write_text(report.to_json())
    render(report, console)
    if report.status == "error":
        raise click.ClickException(report.error or "conversion failed")
    if report.status == "validation_failed":
        raise SystemExit(EXIT_VALIDATION_FAILED)
