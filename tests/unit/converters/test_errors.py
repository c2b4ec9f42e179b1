"""converters.errors: the errors of `sluice convert`, shown to a person at a terminal."""

from __future__ import annotations

from converters.errors import ConversionError, MissingDependency


def test_a_conversion_error_keeps_its_message() -> None:
    exc = ConversionError("operator 'NonMaxSuppression' has no TensorRT plugin")
    assert exc.message == str(exc) == "operator 'NonMaxSuppression' has no TensorRT plugin"


def test_a_missing_dependency_names_what_is_not_possible_and_each_missing_piece() -> None:
    exc = MissingDependency("a TensorRT build", ("no CUDA GPU", "tensorrt is not installed"))
    assert isinstance(exc, ConversionError)
    assert exc.message == (
        "a TensorRT build is not possible here: no CUDA GPU; tensorrt is not installed"
    )
    assert exc.missing == ["no CUDA GPU", "tensorrt is not installed"]
