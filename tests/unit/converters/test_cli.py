"""End to end through `sluice convert`: each source kind converted, validated and published (or
refused), with the published entry loaded the way the server loads it."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import joblib
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from click.testing import Result
from onnx import TensorProto, numpy_helper
from sklearn.datasets import load_iris
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from converters.data import random_batches
from converters.optimize import U8S8_WEIGHT_LIMIT
from converters.runners import OnnxRunner
from converters.spec import parse_input
from converters.tensorrt import missing_requirements
from engine.model_config import load_model_config
from engine.repository import Repository
from tests.unit.converters import nets
from tests.unit.converters.avx2 import emulate_avx2
from tests.unit.converters.conftest import run_convert
from tests.unit.converters.graphs import fixed_batch

NETS = Path(nets.__file__)
ENCODER_INPUT = "input_ids:INT64:batch,sequence=16:0..100"
Convert = Callable[..., Result]
Int8Entry = tuple[Any, dict[str, Any]]
"""A published int8 graph and its conversion report."""


def report(path: Path) -> dict:  # type: ignore[type-arg]
    return json.loads(path.read_text())  # type: ignore[no-any-return]


def test_cnn_factory_is_exported_validated_measured_and_published(
    tmp_path: Path, convert_cli: Convert
) -> None:
    result = convert_cli(
        f"{NETS}:build_cnn", "--input", "image:FP32:-1,3,16,16", "--repository", tmp_path,
        "--name", "cnn", "--max-batch-size", "4", "--preferred-batch-size", "4",
        "--measure-iterations", "2", "--json", tmp_path / "report.json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "Published" in result.stdout
    assert "Performance on this machine" in result.stdout
    data = report(tmp_path / "report.json")
    assert data["status"] == "published"
    assert data["validation"]["passed"] is True
    assert data["outputs"] == [{"name": "output", "datatype": "FP32", "shape": ["batch", 10]}]
    assert {(t["model"], t["batch"]) for t in data["timings"]} == {
        ("source", 1), ("converted", 1), ("source", 4), ("converted", 4),
    }  # fmt: skip
    assert set(data["speedup"]) == {"1", "4"}
    assert {t["iterations"] for t in data["timings"]} == {2}  # far within the 10 s bound
    steps = {s["name"]: s["detail"] for s in data["steps"]}
    assert steps["measure"] == "2 runs per model and batch size"
    version_dir = tmp_path / "cnn" / "1"
    assert sorted(p.name for p in version_dir.iterdir()) == ["conversion.json", "model.onnx"]
    config = load_model_config(tmp_path / "cnn")
    assert config.max_batch_size == 4
    assert config.dynamic_batching.preferred_batch_sizes == [4]
    entry = Repository(tmp_path).entry("cnn")
    assert entry is not None
    assert entry.versions == {1: version_dir / "model.onnx"}
    image = np.random.default_rng(3).standard_normal((3, 3, 16, 16)).astype(np.float32)
    [served] = OnnxRunner(version_dir / "model.onnx").run({"image": image})
    with torch.inference_mode():
        expected = nets.build_cnn()(torch.from_numpy(image)).numpy()
    np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-5)


def test_transformer_encoder_has_named_dynamic_axes(encoder_onnx: Path) -> None:
    model = onnx.load(str(encoder_onnx))
    [ids] = model.graph.input
    assert [d.dim_param for d in ids.type.tensor_type.shape.dim] == ["batch", "sequence"]
    assert not list(encoder_onnx.parent.glob("*.data"))
    assert load_model_config(encoder_onnx.parent.parent).max_batch_size == 8
    tokens = np.random.default_rng(0).integers(0, 100, (2, 5))
    [logits] = OnnxRunner(encoder_onnx).run({"input_ids": tokens})
    with torch.inference_mode():
        expected = nets.build_encoder()(torch.from_numpy(tokens)).numpy()
    np.testing.assert_allclose(logits, expected, rtol=1e-3, atol=1e-4)


def test_onnx_model_to_fp16(encoder_onnx: Path, tmp_path: Path, convert_cli: Convert) -> None:
    result = convert_cli(
        encoder_onnx, "--precision", "fp16", "--input", "input_ids:INT64:batch,sequence=16:0..100",
        "--repository", tmp_path, "--name", "enc16", "--measure-iterations", "0",
        "--samples", "9", "--json", tmp_path / "r.json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = report(tmp_path / "r.json")
    [check] = data["validation"]["outputs"]
    assert check["passed"]
    assert 0 < check["max_abs_error"] <= 1e-2
    assert data["validation"]["samples"] == 9
    model = onnx.load(str(tmp_path / "enc16" / "1" / "model.onnx"))
    types = {init.data_type for init in model.graph.initializer}
    assert onnx.TensorProto.FLOAT16 in types
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    # no CPU-provider casts baked in: the compute stays fp16 for the provider that serves it
    assert not [node.name for node in model.graph.node if "InsertedPrecisionFreeCast" in node.name]
    assert [s["name"] for s in data["steps"]][-4:] == [
        "optimize (ONNX Runtime)", "convert to fp16", "validate", "publish",
    ]  # fmt: skip


def test_fp16_io_publishes_the_inputs_the_model_takes(tmp_path: Path, convert_cli: Convert) -> None:
    """--fp16-io makes FP32 inputs FLOAT16: the report and config.yaml's header said FP32."""
    result = convert_cli(
        f"{NETS}:build_cnn", "--input", "image:FP32:-1,3,16,16", "--repository", tmp_path,
        "--name", "cnn16", "--precision", "fp16", "--fp16-io", "--measure-iterations", "0",
        "--json", tmp_path / "report.json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert report(tmp_path / "report.json")["inputs"][0]["datatype"] == "FP16"
    assert "input  image: FP16" in (tmp_path / "cnn16" / "config.yaml").read_text()
    session = ort.InferenceSession(str(tmp_path / "cnn16" / "1" / "model.onnx"))
    assert session.get_inputs()[0].type == "tensor(float16)"


@pytest.fixture(scope="module")
def static_int8(encoder_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Int8Entry:
    """The encoder converted to static int8, calibrated: its published graph and its report."""
    folder = tmp_path_factory.mktemp("int8")
    rng = np.random.default_rng(7)
    np.savez(folder / "calibration.npz", input_ids=rng.integers(0, 100, (32, 16)))
    result = run_convert(
        encoder_onnx, "--precision", "int8", "--calibration", folder / "calibration.npz",
        "--input", ENCODER_INPUT, "--repository", folder, "--name", "enc8",
        "--measure-iterations", "0", "--optimization-level", "basic", "--json", folder / "r.json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return onnx.load(str(folder / "enc8" / "1" / "model.onnx")), report(folder / "r.json")


def test_onnx_model_to_static_int8_with_calibration(static_int8: Int8Entry) -> None:
    model, data = static_int8
    assert any(node.op_type == "QuantizeLinear" for node in model.graph.node)
    # What makes every x86 host compute the same integers: no uint8 x int8 pair sum can leave
    # int16, so AVX2's saturating vpmaddubsw and VNNI's int32 sums agree.
    weights = [
        numpy_helper.to_array(init).astype(np.int64)
        for init in model.graph.initializer
        if init.data_type == TensorProto.INT8
    ]
    assert max(int(np.abs(w).max()) for w in weights) == U8S8_WEIGHT_LIMIT  # 7 bits, all used
    steps = {s["name"]: s["detail"] for s in data["steps"]}
    assert steps["quantize to int8"] == "static QDQ, 2 batches, per-channel, 7-bit weights"
    [check] = data["validation"]["outputs"]
    # 0.9937 and 0.113 on every x86 host; 8-bit weights gave 0.9781 and 0.209 on AVX2.
    assert check["cosine"] >= 0.98
    assert check["norm_error"] <= 0.2


def test_static_int8_computes_on_avx2_what_it_computes_here(
    encoder_onnx: Path, static_int8: Int8Entry
) -> None:
    # ONNX Runtime's kernel for x86 without VNNI, emulated: a failure here is what a host
    # without VNNI would see (8-bit weights failed validation on AVX2 only, cosine 0.978).
    model, data = static_int8
    avx2_model, products = emulate_avx2(model)
    assert products == 9  # 6 MatMul, 3 Gemm by weights; the 4 of two activations are U8U8
    feeds = [dict(b) for b in random_batches([parse_input(ENCODER_INPUT)], 32, 16, True, 0)]
    runners = [
        OnnxRunner(m)
        for m in (encoder_onnx, model.SerializeToString(), avx2_model.SerializeToString())
    ]
    source, here, avx2 = (np.concatenate([r.run(feed)[0] for feed in feeds]) for r in runners)
    np.testing.assert_allclose(avx2, here, rtol=0, atol=1e-3)  # 8-bit weights: 0.14 apart
    [check] = data["validation"]["outputs"]
    assert cosine(avx2, source) == pytest.approx(check["cosine"], abs=1e-4)
    assert cosine(avx2, source) >= 0.98


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_sklearn_pipeline_needs_trust_then_converts(tmp_path: Path, convert_cli: Convert) -> None:
    x, y = load_iris(return_X_y=True)
    pipeline = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)).fit(x, y)
    joblib.dump(pipeline, tmp_path / "iris.joblib")
    refused = convert_cli(tmp_path / "iris.joblib", "--repository", tmp_path / "repo")
    assert refused.exit_code == 1
    assert "pass --trust-pickle" in refused.output
    result = convert_cli(
        tmp_path / "iris.joblib", "--trust-pickle", "--repository", tmp_path / "repo",
        "--measure-iterations", "0", "--json", tmp_path / "r.json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    label, proba = report(tmp_path / "r.json")["validation"]["outputs"]
    assert (label["name"], label["mismatch"]) == ("label", 0.0)
    assert proba["max_abs_error"] < 1e-5
    features = x[::10].astype(np.float32)
    labels, _ = OnnxRunner(tmp_path / "repo" / "iris" / "1" / "model.onnx").run({"input": features})
    np.testing.assert_array_equal(labels, pipeline.predict(features))


def test_torchscript_file(tmp_path: Path, convert_cli: Convert) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(  # type: ignore[no-untyped-call]
            nets.build_cnn(), (torch.randn(2, 3, 8, 8),)
        )
    traced.save(str(tmp_path / "cnn.pt"))
    result = convert_cli(
        tmp_path / "cnn.pt", "--input", "image:FP32:-1,3,8,8", "--repository", tmp_path,
        "--measure-iterations", "0", "--json", tmp_path / "r.json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = report(tmp_path / "r.json")
    assert (data["source_kind"], data["name"]) == ("torchscript", "cnn")
    assert data["validation"]["passed"] is True


def test_sabotaged_model_fails_validation_and_publishes_nothing(
    tmp_path: Path, convert_cli: Convert
) -> None:
    result = convert_cli(
        "tests.unit.converters.nets:build_sabotaged", "--input", "x:FP32:-1,4",
        "--repository", tmp_path / "repo", "--measure-iterations", "0",
        "--json", tmp_path / "r.json",
    )  # fmt: skip
    assert result.exit_code == 3
    assert "Validation failed: nothing was published" in result.stdout
    assert not (tmp_path / "repo").exists()
    data = report(tmp_path / "r.json")
    assert data["status"] == "validation_failed"
    assert data["published"] is None


def test_too_tight_tolerance_fails_and_force_publishes(
    encoder_onnx: Path, tmp_path: Path, convert_cli: Convert
) -> None:
    args = [encoder_onnx, "--precision", "fp16", "--atol", "0", "--rtol", "0",
            "--repository", tmp_path, "--name", "tight", "--measure-iterations", "0",
            "--samples", "4"]  # fmt: skip
    failed = convert_cli(*args)
    assert failed.exit_code == 3
    assert "elements exceed atol 0 + rtol 0" in failed.stdout
    assert not (tmp_path / "tight").exists()
    forced = convert_cli(*args, "--force", "--json", tmp_path / "r.json")
    assert forced.exit_code == 0, forced.output
    assert "forced despite failed validation" in forced.stdout
    data = report(tmp_path / "r.json")
    assert (data["status"], data["forced"]) == ("published", True)
    assert (tmp_path / "tight" / "1" / "model.onnx").is_file()


def test_unexportable_operator_is_a_clear_error(tmp_path: Path, convert_cli: Convert) -> None:
    result = convert_cli(
        f"{NETS}:build_eigen", "--input", "x:FP32:-1,3,3", "--repository", tmp_path,
        "--json", tmp_path / "r.json",
    )  # fmt: skip
    assert result.exit_code == 1
    assert "operator aten.linalg_eig cannot be exported to ONNX" in result.output
    data = report(tmp_path / "r.json")
    assert data["status"] == "error"
    assert data["steps"][-1]["name"] == "export to ONNX"


def test_two_inputs_dict_outputs_padding_and_dry_run(tmp_path: Path, convert_cli: Convert) -> None:
    args = ["tests.unit.converters.nets:build_two_heads", "--input", "a:FP32:-1,sequence=5",
            "--input", "b:FP32:-1,sequence", "--output", "total", "--output", "dot",
            "--pad", "a:1:0", "--pad", "b:1:0", "--repository", tmp_path,
            "--measure-iterations", "0"]  # fmt: skip
    dry = convert_cli(*args, "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "Dry run: nothing was published" in dry.stdout
    assert list(tmp_path.iterdir()) == []
    result = convert_cli(*args, "--name", "heads")
    assert result.exit_code == 0, result.output
    config = load_model_config(tmp_path / "heads")
    assert {name: pad.axis for name, pad in config.dynamic_batching.pad.items()} == {"a": 1, "b": 1}
    runner = OnnxRunner(tmp_path / "heads" / "1" / "model.onnx")
    assert runner.output_names == ["total", "dot"]


def test_external_weights_are_published_in_one_file(tmp_path: Path, convert_cli: Convert) -> None:
    from tests.unit.converters.graphs import mlp

    onnx.save(mlp(), str(tmp_path / "mlp.onnx"), save_as_external_data=True, size_threshold=0)
    result = convert_cli(
        tmp_path / "mlp.onnx", "--repository", tmp_path / "repo", "--measure-iterations", "0",
        "--optimization-level", "disable", "--no-simplify",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    version_dir = tmp_path / "repo" / "mlp" / "1"
    assert sorted(p.name for p in version_dir.iterdir()) == ["conversion.json", "model.onnx"]
    model = onnx.load(str(version_dir / "model.onnx"), load_external_data=False)
    assert all(init.data_location == onnx.TensorProto.DEFAULT for init in model.graph.initializer)


def test_fixed_batch_model_is_published_unbatched(tmp_path: Path, convert_cli: Convert) -> None:
    onnx.save(fixed_batch(), str(tmp_path / "fixed.onnx"))
    refused = convert_cli(
        tmp_path / "fixed.onnx", "--max-batch-size", "4", "--repository", tmp_path
    )
    assert refused.exit_code == 1
    assert "needs a dynamic first (batch) axis on every input; fixed on: x" in refused.output
    result = convert_cli(
        tmp_path / "fixed.onnx", "--repository", tmp_path, "--measure-iterations", "1"
    )
    assert result.exit_code == 0, result.output
    config = load_model_config(tmp_path / "fixed")
    assert config.max_batch_size == 0
    assert not config.dynamic_batching.enabled


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--input", "x:FP32"], "Invalid value for --input: --input 'x:FP32' is not NAME:DTYPE"),
        (["--pad", "x:0:0"], "the batch axis 0 is never padded"),
        (["--precision", "fp64"], "'fp64' is not one of 'fp32', 'fp16', 'int8'"),
        (["--measure-seconds", "0"], "'--measure-seconds': 0.0 is not in the range x>0"),
    ],
)
def test_usage_errors_exit_2(
    tmp_path: Path, convert_cli: Convert, args: list[str], message: str
) -> None:
    result = convert_cli(f"{NETS}:build_cnn", "--repository", tmp_path, *args)
    assert result.exit_code == 2
    assert message in result.output


def test_option_combinations_are_checked(tmp_path: Path, convert_cli: Convert) -> None:
    np.savez(tmp_path / "c.npz", image=np.zeros((2, 3, 8, 8), np.float32))
    result = convert_cli(f"{NETS}:build_cnn", "--calibration", tmp_path / "c.npz")
    assert result.exit_code == 1
    assert "--calibration is used only with --precision int8" in result.output
    onnx.save(fixed_batch(), str(tmp_path / "fixed.onnx"))
    for args, message in [
        (["--preferred-batch-size", "8"], "--preferred-batch-size 8 is above max_batch_size 0"),
        (["--pad", "x:1:0"], "only a dynamic axis other than the batch axis can be padded"),
    ]:
        result = convert_cli(tmp_path / "fixed.onnx", "--repository", tmp_path, *args)
        assert result.exit_code == 1
        assert message in result.output


@pytest.mark.skipif(not missing_requirements(), reason="this machine can build TensorRT engines")
def test_tensorrt_target_names_what_is_missing(tmp_path: Path, convert_cli: Convert) -> None:
    result = convert_cli(
        f"{NETS}:build_cnn", "--input", "image:FP32:-1,3,8,8", "--target", "tensorrt",
        "--repository", tmp_path,
    )  # fmt: skip
    assert result.exit_code == 1
    assert "--target tensorrt is not possible here" in result.output
    assert "tensorrt package is not installed" in result.output
    assert list(tmp_path.iterdir()) == []


def test_importing_the_command_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, converters.cli; print(sorted({'torch', 'sklearn'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_a_failed_validation_is_marked_failed_and_tables_are_never_cut(
    tmp_path: Path, convert_cli: Convert
) -> None:
    # CliRunner's stdout is not a terminal, as in CI logs, where rich would cut at 80 columns.
    name = "probabilities_for_every_class_of_the_label_set"
    result = convert_cli(
        "tests.unit.converters.nets:build_sabotaged", "--input", "x:FP32:-1,4",
        "--output", name, "--repository", tmp_path / "repo", "--measure-iterations", "0",
    )  # fmt: skip
    assert result.exit_code == 3
    row = next(line for line in result.stdout.splitlines() if name in line)
    assert "…" not in result.stdout
    assert row.rstrip().endswith("FAIL │")
    assert "✗ validate FAILED" in result.stderr
    assert "✓ validate" not in result.stderr
