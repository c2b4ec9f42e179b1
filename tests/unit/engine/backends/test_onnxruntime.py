"""The ONNX Runtime backend: metadata, provider choice, results equal to a direct ORT run."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from engine.backends.onnxruntime import OnnxBackend, choose_providers
from engine.demo import mlp_model
from engine.errors import InvalidInput
from engine.model_config import OnnxRuntimeOptions
from engine.types import TensorSpec
from tests.models import (
    DATATYPES,
    add_sub_model,
    fixed_shape_model,
    identity_model,
    run_onnx,
    sample,
    write_model,
)

CPU = "CPUExecutionProvider"


def backend_for(tmp_path: Path, model: onnx.ModelProto, **options: Any) -> OnnxBackend:
    path = write_model(tmp_path, "m", model)
    return OnnxBackend(path, OnnxRuntimeOptions(**options), "model 'm' version 1")


@pytest.mark.parametrize(
    ("preferred", "available", "chosen"),
    [
        (["CUDAExecutionProvider", CPU], [CPU], [CPU]),
        (["TensorrtExecutionProvider", "CUDAExecutionProvider"], [CPU], [CPU]),
        ([], ["CUDAExecutionProvider", CPU], [CPU]),
        (
            ["CUDAExecutionProvider", CPU],
            ["TensorrtExecutionProvider", "CUDAExecutionProvider", CPU],
            ["CUDAExecutionProvider", CPU],
        ),
        (
            ["AzureExecutionProvider", "CUDAExecutionProvider"],
            ["AzureExecutionProvider", CPU],
            ["AzureExecutionProvider", CPU],
        ),
    ],
)
def test_choose_providers_keeps_order_and_ends_in_cpu(
    preferred: list[str], available: list[str], chosen: list[str]
) -> None:
    assert choose_providers(preferred, available) == chosen


def test_unavailable_gpu_provider_falls_back_to_cpu_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluice.backend.onnxruntime")
    backend = backend_for(tmp_path, mlp_model(), execution_providers=["CUDAExecutionProvider", CPU])
    assert backend.provider == CPU
    lines = [r.getMessage() for r in caplog.records if r.name == "sluice.backend.onnxruntime"]
    assert len(lines) == 1
    assert "model 'm' version 1 runs on CPUExecutionProvider" in lines[0]
    assert "skipped: CUDAExecutionProvider" in lines[0]
    x = sample("FP32", (2, 16))
    assert np.array_equal(
        backend.run({"x": x})["probabilities"], run_onnx(mlp_model(), {"x": x})["probabilities"]
    )


def test_demo_metadata(tmp_path: Path) -> None:
    backend = backend_for(tmp_path, mlp_model())
    assert backend.inputs == (TensorSpec("x", "FP32", (-1, 16)),)
    assert backend.outputs == (TensorSpec("probabilities", "FP32", (-1, 10)),)
    assert backend.platform == "onnxruntime_onnx"


@pytest.mark.parametrize("datatype", DATATYPES)
def test_identity_metadata_per_datatype(tmp_path: Path, datatype: str) -> None:
    backend = backend_for(tmp_path, identity_model(datatype))
    assert backend.inputs == (TensorSpec("INPUT0", datatype, (-1, 4)),)
    assert backend.outputs == (TensorSpec("OUTPUT0", datatype, (-1, 4)),)


def test_unnamed_and_named_dynamic_dims_are_minus_one(tmp_path: Path) -> None:
    value = helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [None, "seq", 3])
    out = helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [None, "seq", 3])
    graph = helper.make_graph([helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "g", [value],
                              [out])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    backend = backend_for(tmp_path, model)
    assert backend.inputs[0].shape == (-1, -1, 3)


def test_fixed_shape_metadata(tmp_path: Path) -> None:
    backend = backend_for(tmp_path, fixed_shape_model("INT32", (2, 3)))
    assert backend.inputs == (TensorSpec("INPUT0", "INT32", (2, 3)),)


def test_two_inputs_two_outputs_in_model_order(tmp_path: Path) -> None:
    backend = backend_for(tmp_path, add_sub_model())
    assert [s.name for s in backend.inputs] == ["INPUT0", "INPUT1"]
    assert [s.name for s in backend.outputs] == ["SUM", "DIFF"]
    a, b = sample("FP32", (3, 4), seed=1), sample("FP32", (3, 4), seed=2)
    result = backend.run({"INPUT0": a, "INPUT1": b})
    assert list(result) == ["SUM", "DIFF"]
    np.testing.assert_array_equal(result["SUM"], a + b)
    np.testing.assert_array_equal(result["DIFF"], a - b)


@pytest.mark.parametrize("datatype", [d for d in DATATYPES if d != "BYTES"])
def test_run_equals_direct_onnxruntime(tmp_path: Path, datatype: str) -> None:
    model = identity_model(datatype)
    backend = backend_for(tmp_path, model)
    x = sample(datatype, (5, 4))
    got = backend.run({"INPUT0": x})["OUTPUT0"]
    want = run_onnx(model, {"INPUT0": x})["OUTPUT0"]
    assert got.dtype == want.dtype == x.dtype
    np.testing.assert_array_equal(got, want)


def test_demo_run_equals_direct_onnxruntime(tmp_path: Path) -> None:
    backend = backend_for(tmp_path, mlp_model(), graph_optimization_level="disable")
    x = sample("FP32", (7, 16), seed=3)
    got = backend.run({"x": x})["probabilities"]
    np.testing.assert_allclose(got, run_onnx(mlp_model(), {"x": x})["probabilities"], rtol=1e-6)
    np.testing.assert_allclose(got.sum(axis=1), np.ones(7), rtol=1e-5)


def test_session_options_are_applied(tmp_path: Path) -> None:
    backend = backend_for(
        tmp_path, mlp_model(), intra_op_threads=2, inter_op_threads=3,
        graph_optimization_level="basic",
    )  # fmt: skip
    options = backend._session.get_session_options()
    assert (options.intra_op_num_threads, options.inter_op_num_threads) == (2, 3)
    assert options.graph_optimization_level.name == "ORT_ENABLE_BASIC"


def test_bytes_round_trip(tmp_path: Path) -> None:
    backend = backend_for(tmp_path, identity_model("BYTES"))
    x = sample("BYTES", (2, 4))
    got = backend.run({"INPUT0": x})["OUTPUT0"]
    assert got.dtype == object
    assert got.shape == (2, 4)
    assert got.tolist() == x.tolist()
    assert all(isinstance(v, bytes) for v in got.ravel())


def test_bytes_empty_batch(tmp_path: Path) -> None:
    backend = backend_for(tmp_path, identity_model("BYTES"))
    got = backend.run({"INPUT0": np.empty((0, 4), dtype=object)})["OUTPUT0"]
    assert got.shape == (0, 4)


def test_non_utf8_bytes_into_string_model_is_invalid_input(tmp_path: Path) -> None:
    backend = backend_for(tmp_path, identity_model("BYTES"))
    x = np.array([[b"ok", b"\xff\xfe", b"a", b"b"]], dtype=object)
    with pytest.raises(InvalidInput) as caught:
        backend.run({"INPUT0": x})
    assert "input 'INPUT0'" in caught.value.message
    assert "not UTF-8" in caught.value.message


def test_close_releases_the_session(tmp_path: Path) -> None:
    backend = backend_for(tmp_path, identity_model("FP32"))
    backend.close()
    assert not hasattr(backend, "_session")
