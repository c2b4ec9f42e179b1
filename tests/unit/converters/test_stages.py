"""converters.stages: the source's runner and graph (export), then the steps that make the
converted model (simplify, ONNX Runtime's rewrites, precision), each recorded with its detail,
and a runner of the result that computes what the source does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

from converters.errors import ConversionError
from converters.options import ConvertOptions
from converters.report import Report, Steps
from converters.signature import opset_of, resolve_specs
from converters.sources import load_source
from converters.stages import export, optimize
from tests.unit.converters.graphs import mlp

X = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)


@pytest.fixture
def mlp_file(tmp_path: Path) -> Path:
    onnx.save(mlp(), tmp_path / "mlp.onnx")
    return tmp_path / "mlp.onnx"


def options(path: Path, **given: object) -> ConvertOptions:
    return ConvertOptions(str(path), path.parent / "repo", **given)  # type: ignore[arg-type]


def test_an_onnx_source_is_its_own_graph_or_converted_to_the_opset_asked(mlp_file: Path) -> None:
    source = load_source(str(mlp_file))
    specs = resolve_specs(source, [])
    runner, model = export(source, specs, options(mlp_file))
    assert model is source.model
    assert runner.run({"x": X})[0].shape == (3, 4)
    _, converted = export(source, specs, options(mlp_file, opset=18))
    assert (opset_of(model), opset_of(converted)) == (17, 18)


def test_output_names_are_refused_for_an_onnx_source(mlp_file: Path) -> None:
    source = load_source(str(mlp_file))
    with pytest.raises(ConversionError, match=r"^--output names the outputs of a PyTorch source"):
        export(source, resolve_specs(source, []), options(mlp_file, output_names=["z"]))


def stages(mlp_file: Path, **given: object) -> tuple[Report, bytes, list[np.ndarray]]:
    """Optimize the MLP with `given` options: the report, the payload, the runner's outputs."""
    source = load_source(str(mlp_file))
    specs = resolve_specs(source, [])
    steps = Steps(Report(str(mlp_file)))
    runner, payload, model = optimize(source.model, specs, 8, options(mlp_file, **given), steps)
    assert payload == model.SerializeToString()
    return steps.report, payload, runner.run({"x": X})


def test_fp32_is_simplified_and_rewritten_and_computes_the_same(mlp_file: Path) -> None:
    report, _, outputs = stages(mlp_file)
    assert [s.name for s in report.steps] == ["simplify", "optimize (ONNX Runtime)"]
    assert report.steps[1].detail.startswith("extended: 6 -> ")
    assert report.validated_on.startswith("ONNX Runtime ")  # the provider that will serve it
    want = ort.InferenceSession(mlp().SerializeToString()).run(None, {"x": X})[0]
    np.testing.assert_allclose(outputs[0], want, rtol=1e-5)


def test_nothing_asked_is_nothing_done(mlp_file: Path) -> None:
    report, payload, _ = stages(mlp_file, simplify=False, optimization_level="disable")
    assert report.steps == []
    assert payload == mlp().SerializeToString()


def test_fp16_converts_after_provider_neutral_rewrites_and_keeps_fp32_io(mlp_file: Path) -> None:
    report, payload, outputs = stages(mlp_file, precision="fp16")
    assert [s.name for s in report.steps] == [
        "simplify", "optimize (ONNX Runtime)", "convert to fp16",
    ]  # fmt: skip
    assert report.steps[1].detail.startswith("basic: ")  # not extended: see stages.optimize
    assert report.steps[2].detail == "fp32 inputs/outputs kept"
    model = onnx.load_from_string(payload)
    assert {i.data_type for i in model.graph.initializer} == {TensorProto.FLOAT16}
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert outputs[0].dtype == np.float32


def test_dynamic_int8_says_how_it_quantized(mlp_file: Path) -> None:
    report, payload, _ = stages(mlp_file, precision="int8", optimization_level="disable")
    assert [s.name for s in report.steps] == ["simplify", "quantize to int8"]
    assert report.steps[1].detail == "dynamic, per-channel, 7-bit weights"
    ops = {node.op_type for node in onnx.load_from_string(payload).graph.node}
    assert "MatMulInteger" in ops or "DynamicQuantizeLinear" in ops
