from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sklearn.linear_model import Ridge

from converters.errors import ConversionError
from converters.signature import (
    default_name,
    merge_specs,
    resolve_max_batch,
    resolve_specs,
    tensor_info,
)
from converters.sources import Source
from converters.spec import Axis, parse_input
from tests.unit.converters.graphs import fixed_batch, mlp


def test_onnx_specs_with_a_user_override() -> None:
    source = Source("onnx", "mlp.onnx", mlp())
    [spec] = resolve_specs(source, [parse_input("x:FP32:-1,8:0..1")])
    assert spec.axes[0].dynamic
    assert (spec.low, spec.high) == (0.0, 1.0)
    assert resolve_specs(source, [])[0].axes == (Axis(8, "N"), Axis(8))


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("y:FP32:-1,8", "--input 'y' is not a model input; inputs: x"),
        ("x:FP32:-1,9", r"FP32 \['batch', 9\] does not fit the model's FP32 \['N', 8\]"),
        ("x:INT64:-1,8", "INT64"),
        ("x:FP32:-1", "does not fit"),
    ],
)
def test_user_spec_must_fit_the_onnx_model(given: str, message: str) -> None:
    with pytest.raises(ConversionError, match=message):
        merge_specs(resolve_specs(Source("onnx", "m", mlp()), []), [parse_input(given)])


def test_sklearn_specs_default_to_the_feature_count() -> None:
    ridge = Ridge().fit(np.eye(5), np.arange(5))
    [spec] = resolve_specs(Source("sklearn", "r.pkl", ridge), [])
    assert (spec.name, spec.datatype, spec.dims()) == ("input", "FP32", ["batch", 5])


def test_torch_sources_need_input_specs() -> None:
    with pytest.raises(ConversionError, match=r"needs --input NAME:DTYPE:SHAPE"):
        resolve_specs(Source("torch", "m.py:f", object()), [])


def test_max_batch_size_default_and_checks() -> None:
    batched = [parse_input("x:FP32:-1,3")]
    fixed = resolve_specs(Source("onnx", "f", fixed_batch()), [])
    assert resolve_max_batch(batched, None) == 32
    assert resolve_max_batch(batched, 4) == 4
    assert resolve_max_batch(fixed, None) == 0
    assert resolve_max_batch(fixed, 0) == 0
    with pytest.raises(ConversionError, match=r"needs a dynamic first .batch. axis.*fixed on: x"):
        resolve_max_batch(fixed, 4)


def test_default_names(tmp_path: Path) -> None:
    assert default_name("path/to/nets.py:build_cnn") == "build_cnn"
    assert default_name("pkg.models:Factory.create") == "create"
    assert default_name("exports/resnet 50.onnx") == "resnet_50"
    assert default_name("models/bert/3/model.onnx") == "bert"
    assert default_name(".hidden.pkl") == "hidden"


def test_tensor_info_lists_outputs() -> None:
    assert tensor_info(mlp()) == [("y", "FP32", ["N", 4])]
