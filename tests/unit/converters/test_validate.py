from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import pytest

from converters.validate import DEFAULT_TOLERANCES, Tolerances, compare, tolerances_for


class FunctionRunner:
    """A runner over a numpy function: the seam validation is written against."""

    def __init__(self, fn: Callable[[np.ndarray], list[np.ndarray]], outputs: list[str]) -> None:
        self.fn = fn
        self.output_names = outputs

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return self.fn(feeds["x"])


def batches(rows: int = 10, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((rows, 4)).astype(np.float32)} for _ in range(3)]


def logits(x: np.ndarray) -> list[np.ndarray]:
    return [x @ np.arange(12, dtype=np.float32).reshape(4, 3) / 10]


def test_identical_models_pass_with_zero_error() -> None:
    runner = FunctionRunner(logits, ["y"])
    result = compare(runner, runner, batches(), DEFAULT_TOLERANCES["fp32"])
    assert result.passed
    assert result.samples == 30
    [check] = result.outputs
    assert check.max_abs_error == 0.0
    assert check.cosine == pytest.approx(1.0)
    assert check.norm_error == 0.0


def test_small_noise_passes_fp16_and_fails_fp32() -> None:
    source = FunctionRunner(logits, ["y"])
    noisy = FunctionRunner(lambda x: [logits(x)[0] + 2e-3], ["y"])
    assert compare(source, noisy, batches(), DEFAULT_TOLERANCES["fp16"]).passed
    failed = compare(source, noisy, batches(), DEFAULT_TOLERANCES["fp32"])
    assert not failed.passed
    assert failed.outputs[0].max_abs_error == pytest.approx(2e-3, rel=1e-3)
    assert "elements exceed atol 0.0001" in failed.outputs[0].reasons[0]


def test_scaled_output_fails_int8_by_norm_error_though_cosine_is_one() -> None:
    source = FunctionRunner(logits, ["y"])
    doubled = FunctionRunner(lambda x: [logits(x)[0] * 2], ["y"])
    result = compare(source, doubled, batches(), DEFAULT_TOLERANCES["int8"])
    check = result.outputs[0]
    assert check.cosine == pytest.approx(1.0)
    assert check.norm_error == pytest.approx(1.0)
    assert not result.passed
    assert check.reasons == ["relative L2 error 1 is above 0.25"]


def test_new_nan_or_inf_fails_even_without_element_bounds() -> None:
    def broken(x: np.ndarray) -> list[np.ndarray]:
        out = logits(x)[0].copy()
        out[0, 0], out[1, 1] = np.nan, np.inf
        return [out]

    loose = Tolerances(None, None, None, None, 1.0)
    result = compare(FunctionRunner(logits, ["y"]), FunctionRunner(broken, ["y"]), batches(), loose)
    assert result.outputs[0].new_nan_inf == 6
    assert not result.passed
    assert "6 NaN/Inf values where the source is finite" in result.outputs[0].reasons


def test_labels_are_compared_by_share_of_mismatches() -> None:
    def labelled(flip: int) -> Callable[[np.ndarray], list[np.ndarray]]:
        def run(x: np.ndarray) -> list[np.ndarray]:
            labels = np.argmax(logits(x)[0], axis=1).astype(np.int64)
            labels[:flip] = (labels[:flip] + 1) % 3
            return [labels]

        return run

    source = FunctionRunner(labelled(0), ["label"])
    one_of_ten = FunctionRunner(labelled(1), ["label"])
    result = compare(source, one_of_ten, batches(), DEFAULT_TOLERANCES["fp16"])
    assert result.outputs[0].mismatch == pytest.approx(0.1)
    assert not result.passed
    assert compare(source, one_of_ten, batches(), DEFAULT_TOLERANCES["int8"]).passed is False
    lenient = Tolerances(None, None, None, None, max_mismatch=0.1)
    assert compare(source, one_of_ten, batches(), lenient).passed


def test_string_labels_compare_exactly() -> None:
    source = FunctionRunner(lambda x: [np.array(["a", "b"] * (len(x) // 2))], ["label"])
    result = compare(source, source, batches(), DEFAULT_TOLERANCES["fp32"])
    assert result.passed
    assert result.outputs[0].mismatch == 0.0
    assert result.outputs[0].max_abs_error is None


def test_same_size_different_rank_is_compared_but_other_sizes_fail() -> None:
    source = FunctionRunner(lambda x: [x[:, 0]], ["y"])
    column = FunctionRunner(lambda x: [x[:, :1]], ["y"])
    assert compare(source, column, batches(), DEFAULT_TOLERANCES["fp32"]).passed
    wider = FunctionRunner(lambda x: [x[:, :2]], ["y"])
    result = compare(source, wider, batches(), DEFAULT_TOLERANCES["fp32"])
    assert not result.passed
    assert result.outputs[0].reasons[0] == "shape [10, 2] differs from the source's [10]"


def test_same_size_other_shape_fails() -> None:
    """A [batch, 6] source converted to a [batch, 2, 3] model: equal element counts passed
    validation and the reshaped model was published."""
    source = FunctionRunner(lambda x: [np.concatenate([x, x[:, :2]], axis=1)], ["y"])
    reshaped = FunctionRunner(lambda x: [np.concatenate([x, x[:, :2]], axis=1).reshape(-1, 2, 3)],
                              ["y"])  # fmt: skip
    result = compare(source, reshaped, batches(), DEFAULT_TOLERANCES["fp32"])
    assert not result.passed
    assert result.outputs[0].reasons[0] == "shape [10, 2, 3] differs from the source's [10, 6]"


def test_output_count_mismatch_fails() -> None:
    source = FunctionRunner(lambda x: [x, x], ["a", "b"])
    converted = FunctionRunner(lambda x: [x], ["a"])
    result = compare(source, converted, batches(), DEFAULT_TOLERANCES["fp32"])
    assert not result.passed
    assert result.outputs[0].reasons == ["source has 2 outputs, converted model has 1"]


def test_tolerances_for_overrides_defaults() -> None:
    assert tolerances_for("fp32") == DEFAULT_TOLERANCES["fp32"]
    custom = tolerances_for("fp16", atol=0.5, min_cosine=0.9, max_norm_error=0.1)
    assert (custom.atol, custom.rtol, custom.min_cosine, custom.max_norm_error) == (
        0.5, 1e-2, 0.9, 0.1,
    )  # fmt: skip
    int8 = tolerances_for("int8", atol=0.2)
    assert (int8.atol, int8.rtol) == (0.2, 0.0)
    assert tolerances_for("int8").atol is None
