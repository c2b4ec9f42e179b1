"""converters.pipeline: convert_model runs its steps in order into the report, publishes only
what validated (or --dry-run publishes nothing), and refuses option combinations that cannot
work before loading anything (the command around it: test_cli.py)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from converters.errors import ConversionError
from converters.options import ConvertOptions
from converters.pipeline import convert_model
from converters.report import Report, Steps
from converters.spec import PadRequest
from engine.model_config import load_model_config
from tests.unit.converters.graphs import mlp


def converted(source: Path, repository: Path, **options: object) -> Report:
    steps = Steps(Report(str(source)))
    given = ConvertOptions(str(source), repository, measure_iterations=0, **options)  # type: ignore[arg-type]
    return convert_model(given, steps)


@pytest.fixture
def mlp_file(tmp_path: Path) -> Path:
    onnx.save(mlp(), tmp_path / "mlp.onnx")
    return tmp_path / "mlp.onnx"


def test_an_onnx_model_runs_every_step_in_order_and_is_published(
    mlp_file: Path, tmp_path: Path
) -> None:
    report = converted(mlp_file, tmp_path / "repo", max_batch_size=8, preferred_batch_sizes=[4])
    assert [step.name for step in report.steps] == [
        "load source", "check ONNX", "simplify", "optimize (ONNX Runtime)", "validate", "publish",
    ]  # fmt: skip
    assert (report.status, report.name, report.source_kind) == ("published", "mlp", "onnx")
    assert report.inputs == [{"name": "x", "datatype": "FP32", "shape": ["N", 8]}]
    assert report.outputs == [{"name": "y", "datatype": "FP32", "shape": ["N", 4]}]
    assert report.validation is not None
    assert report.validation.passed
    config = load_model_config(tmp_path / "repo" / "mlp")
    assert (config.max_batch_size, config.dynamic_batching.preferred_batch_sizes) == (8, [4])
    assert (tmp_path / "repo" / "mlp" / "1" / "model.onnx").stat().st_size == report.model_bytes


def test_a_dry_run_validates_and_publishes_nothing(mlp_file: Path, tmp_path: Path) -> None:
    report = converted(mlp_file, tmp_path / "repo", dry_run=True, name="m")
    assert report.status == "not_published"
    assert report.steps[-1].name == "validate"
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"fp16_block": ["Relu"]}, "--fp16-block is used only with --precision fp16"),
        ({"calibration": Path("c.npz")}, "--calibration is used only with --precision int8"),
        ({"max_batch_size": 4, "preferred_batch_sizes": [2, 8]},
         "--preferred-batch-size 8 is above max_batch_size 4"),
    ],
)  # fmt: skip
def test_options_that_cannot_work_are_refused_naming_them(
    mlp_file: Path, tmp_path: Path, options: dict[str, object], message: str
) -> None:
    with pytest.raises(ConversionError, match=f"^{message}$"):
        converted(mlp_file, tmp_path / "repo", **options)
    assert not (tmp_path / "repo").exists()


def test_padding_needs_a_batched_model(tmp_path: Path) -> None:
    # x[1, length]: an axis that may be padded, but the first axis is not a batch axis.
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "unbatched",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "length"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "length"])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "unbatched.onnx")
    with pytest.raises(
        ConversionError, match=r"^--pad needs a batched model \(max_batch_size > 0\)$"
    ):
        converted(tmp_path / "unbatched.onnx", tmp_path / "repo", pads=[PadRequest("x", 1, 0.0)])
