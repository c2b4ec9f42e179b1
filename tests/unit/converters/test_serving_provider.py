"""Conversion validates on the provider that will serve the model, and says which."""

from __future__ import annotations

import json
from pathlib import Path

import onnxruntime as ort

from converters.runners import OnnxRunner, serving_providers
from tests.models import identity_model
from tests.unit.converters.conftest import run_convert

HAS_CUDA = "CUDAExecutionProvider" in ort.get_available_providers()


def test_validation_runs_on_cuda_where_onnx_runtime_has_it() -> None:
    expected = (
        ("CUDAExecutionProvider", "CPUExecutionProvider") if HAS_CUDA else ("CPUExecutionProvider",)
    )
    assert serving_providers() == expected


def test_the_runner_says_which_provider_ran_it() -> None:
    runner = OnnxRunner(identity_model("FP32").SerializeToString(), providers=serving_providers())
    running = runner.session.get_providers()[0]
    assert runner.provider == f"ONNX Runtime {running}"
    assert running == serving_providers()[0]


def test_the_report_names_the_provider_that_validated(tmp_path: Path) -> None:
    source = tmp_path / "identity.onnx"
    source.write_bytes(identity_model("FP32").SerializeToString())
    result = run_convert(
        source, "--measure-iterations", "0", "--repository", tmp_path / "repo", "--name", "ident"
    )
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "repo" / "ident" / "1" / "conversion.json").read_text())
    assert record["validated_on"] == (
        "ONNX Runtime CUDAExecutionProvider" if HAS_CUDA else "ONNX Runtime CPUExecutionProvider"
    )
    assert record["tensorrt"] is None
    assert "validated on ONNX Runtime" in result.output
