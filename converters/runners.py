"""Runners: one call shape (`run(feeds) -> outputs in order`) for a PyTorch module, a
scikit-learn estimator and an ONNX Runtime session, so validation and measurement treat the source
and the converted model alike. torch and scikit-learn are imported only when used."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from converters.errors import ConversionError

OPTIMIZATION_LEVELS = ("disable", "basic", "extended", "all")


class Runner(Protocol):
    """Runs a model on named numpy inputs and returns its outputs in a fixed order."""

    output_names: list[str]

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]: ...


def serving_providers() -> tuple[str, ...]:
    """The ONNX Runtime providers a converted model is validated on: CUDA first where this
    onnxruntime has it (so fp16 is checked on the numerics that will serve it), then CPU."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        return ("CUDAExecutionProvider", "CPUExecutionProvider")
    return ("CPUExecutionProvider",)


class OnnxRunner:
    """An ONNX Runtime session (CPU unless told); float inputs are cast to the dtype the model
    declares."""

    def __init__(
        self,
        model: bytes | Path,
        threads: int = 1,
        optimization: str = "all",
        save_to: Path | None = None,
        providers: Sequence[str] = ("CPUExecutionProvider",),
    ) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        options.graph_optimization_level = ort_level(optimization)
        if save_to is not None:
            options.optimized_model_filepath = str(save_to)
        source = str(model) if isinstance(model, Path) else model
        try:
            self.session = ort.InferenceSession(source, options, providers=list(providers))
        except Exception as exc:
            raise ConversionError(f"ONNX Runtime cannot load the model: {exc}") from exc
        self.output_names = [output.name for output in self.session.get_outputs()]
        self.provider = f"ONNX Runtime {self.session.get_providers()[0]}"
        self.input_types = {
            node.name: _onnx_numpy_type(node.type) for node in self.session.get_inputs()
        }

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        cast = {
            name: value.astype(self.input_types[name], copy=False)
            if value.dtype.kind == "f" and name in self.input_types
            else value
            for name, value in feeds.items()
        }
        try:
            return [np.asarray(value) for value in self.session.run(None, cast)]
        except Exception as exc:
            raise ConversionError(f"the ONNX model failed on {describe(feeds)}: {exc}") from exc


def describe(feeds: Mapping[str, np.ndarray]) -> str:
    """The inputs' names, dtypes and shapes, for error messages."""
    return ", ".join(f"{name} {value.dtype}{list(value.shape)}" for name, value in feeds.items())


def ort_level(name: str) -> Any:
    """The onnxruntime GraphOptimizationLevel for `disable|basic|extended|all`."""
    import onnxruntime as ort

    levels = {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }
    if name not in levels:
        raise ConversionError(
            f"optimization level '{name}' is unknown; allowed: {', '.join(OPTIMIZATION_LEVELS)}"
        )
    return levels[name]


def _onnx_numpy_type(type_str: str) -> np.dtype[np.generic]:
    kinds = {"tensor(float16)": np.float16, "tensor(double)": np.float64}
    return np.dtype(kinds.get(type_str, np.float32))


class TorchRunner:
    """A PyTorch module (eager, TorchScript, or an exported program's module) in inference mode."""

    def __init__(
        self,
        module: Callable[..., Any],
        input_names: list[str],
        output_names: list[str],
        threads: int = 1,
    ) -> None:
        self.module = module
        self.input_names = input_names
        self.output_names = output_names
        self.threads = threads

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        import torch

        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        args = [torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in self.input_names]
        try:
            with torch.inference_mode():
                result = self.module(*args)
        except Exception as exc:
            raise ConversionError(f"the PyTorch model failed on {describe(feeds)}: {exc}") from exc
        return [tensor.detach().cpu().numpy() for tensor in flatten_outputs(result)]


def flatten_outputs(result: Any) -> list[Any]:
    """The tensors of a module's result in order: a tensor, or nested tuples/lists/dicts of them."""
    if isinstance(result, tuple | list):
        return [tensor for item in result for tensor in flatten_outputs(item)]
    if isinstance(result, dict):
        return [tensor for item in result.values() for tensor in flatten_outputs(item)]
    if hasattr(result, "detach"):
        return [result]
    raise ConversionError(
        f"the module returned a {type(result).__name__}; outputs must be tensors, or "
        "tuples, lists or dicts of tensors"
    )


class SklearnRunner:
    """A scikit-learn estimator or pipeline; outputs match skl2onnx's order: a classifier gives
    (label, probabilities), a regressor its prediction, a transformer its transform."""

    def __init__(self, estimator: Any, input_name: str) -> None:
        from sklearn.base import is_classifier

        if not (hasattr(estimator, "predict") or hasattr(estimator, "transform")):
            raise ConversionError(
                f"{type(estimator).__name__} has neither predict nor transform; "
                "expected a scikit-learn estimator or pipeline"
            )
        self.estimator = estimator
        self.input_name = input_name
        self.classifier = bool(is_classifier(estimator))
        self.output_names = ["label", "probabilities"] if self.classifier else ["variable"]

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return self._run(feeds[self.input_name])
        except Exception as exc:
            raise ConversionError(f"the estimator failed on {describe(feeds)}: {exc}") from exc

    def _run(self, features: np.ndarray) -> list[np.ndarray]:
        if self.classifier:
            return [
                np.asarray(self.estimator.predict(features)),
                np.asarray(self.estimator.predict_proba(features)),
            ]
        if hasattr(self.estimator, "predict"):
            return [np.asarray(self.estimator.predict(features))]
        return [np.asarray(self.estimator.transform(features))]
