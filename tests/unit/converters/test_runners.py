from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.datasets import load_iris
from sklearn.decomposition import PCA
from sklearn.linear_model import LinearRegression, LogisticRegression

from converters.errors import ConversionError
from converters.runners import (
    OnnxRunner,
    SklearnRunner,
    TorchRunner,
    flatten_outputs,
    ort_level,
)
from tests.unit.converters.graphs import mlp


def reference_mlp(x: np.ndarray) -> np.ndarray:
    weights = {init.name: init for init in mlp().graph.initializer}
    from onnx import numpy_helper

    w = {name: numpy_helper.to_array(value) for name, value in weights.items()}
    hidden = np.maximum(x @ w["w1"] + w["b1"], 0)
    return np.exp(hidden @ w["w2"] + w["b2"])  # type: ignore[no-any-return]


def test_onnx_runner_runs_and_casts_float_inputs() -> None:
    runner = OnnxRunner(mlp().SerializeToString())
    assert runner.output_names == ["y"]
    x = np.random.default_rng(0).standard_normal((3, 8))  # float64 on purpose
    [y] = runner.run({"x": x})
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, reference_mlp(x.astype(np.float32)), rtol=1e-5)


def test_onnx_runner_reports_an_unloadable_model() -> None:
    with pytest.raises(ConversionError, match="ONNX Runtime cannot load the model"):
        OnnxRunner(b"not a model")


def test_unknown_optimization_level() -> None:
    with pytest.raises(ConversionError, match="'fast' is unknown; allowed: disable, basic"):
        ort_level("fast")


def test_flatten_outputs_walks_tuples_lists_and_dicts_in_order() -> None:
    a, b, c = torch.zeros(1), torch.ones(1), torch.full((1,), 2.0)
    flat = flatten_outputs({"first": a, "rest": (b, [c])})
    assert [float(t[0]) for t in flat] == [0.0, 1.0, 2.0]
    with pytest.raises(ConversionError, match="the module returned a str"):
        flatten_outputs((a, "label"))


def test_torch_runner_feeds_inputs_in_order_and_sets_threads() -> None:
    runner = TorchRunner(lambda a, b: (a - b, a + b), ["a", "b"], ["d", "s"], threads=1)
    a = np.arange(4, dtype=np.float32)
    diff, total = runner.run({"b": np.ones(4, np.float32), "a": a})
    np.testing.assert_array_equal(diff, a - 1)
    np.testing.assert_array_equal(total, a + 1)
    assert torch.get_num_threads() == 1


def test_sklearn_runner_outputs_follow_skl2onnx_order() -> None:
    x, y = load_iris(return_X_y=True)
    classifier = SklearnRunner(LogisticRegression(max_iter=1000).fit(x, y), "input")
    assert classifier.output_names == ["label", "probabilities"]
    label, proba = classifier.run({"input": x[:5]})
    assert label.shape == (5,)
    assert proba.shape == (5, 3)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0)
    regressor = SklearnRunner(LinearRegression().fit(x, y), "input")
    assert regressor.output_names == ["variable"]
    assert regressor.run({"input": x[:5]})[0].shape == (5,)
    transformer = SklearnRunner(PCA(2).fit(x), "input")
    assert transformer.run({"input": x[:5]})[0].shape == (5, 2)


def test_sklearn_runner_rejects_objects_that_cannot_predict() -> None:
    with pytest.raises(ConversionError, match="dict has neither predict nor transform"):
        SklearnRunner({}, "input")


def test_run_failures_name_the_inputs() -> None:
    from tests.unit.converters.graphs import fixed_batch

    runner = OnnxRunner(fixed_batch().SerializeToString())
    with pytest.raises(ConversionError, match=r"the ONNX model failed on x float32\[2, 4\]: "):
        runner.run({"x": np.zeros((2, 4), np.float32)})
    embedding = torch.nn.Embedding(10, 2)
    torch_runner = TorchRunner(embedding, ["ids"], ["y"])
    with pytest.raises(ConversionError, match=r"the PyTorch model failed on ids int64\[1, 3\]"):
        torch_runner.run({"ids": np.array([[1, 2, 99]])})
    x, y = load_iris(return_X_y=True)
    sklearn_runner = SklearnRunner(LinearRegression().fit(x, y), "input")
    with pytest.raises(ConversionError, match=r"the estimator failed on input float64\[2, 3\]"):
        sklearn_runner.run({"input": np.zeros((2, 3))})
