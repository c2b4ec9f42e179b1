"""Python step backend: `models/<name>/<version>/model.py` as a batched model.

The file defines a class with `load(config)` and `infer(inputs) -> outputs` (dicts of numpy
arrays); its inputs and outputs are declared in config.yaml's `python:` section. The file is code
the server runs, so the registry loads it only with `allow_python_models` (see `refuse`). `infer`
runs in the model's thread pool like any backend, never on the event loop, and what it returns is
checked against the declared outputs before it reaches the batcher."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from engine import datatypes
from engine.errors import BackendError, EngineError
from engine.step_config import PythonOptions, TensorDecl
from engine.types import TensorSpec

_SETTING = "allow_python_models: true (--allow-python-models, SLUICE_ALLOW_PYTHON_MODELS=true)"


def refuse(label: str) -> BackendError:
    """The load error of a Python model on a server that does not allow them."""
    return BackendError(
        f"{label} is a Python model (model.py, code the server would run); it is loaded only "
        f"when the server allows Python models: {_SETTING}"
    )


def _spec(decl: TensorDecl) -> TensorSpec:
    return TensorSpec(decl.name, decl.datatype, tuple(decl.shape))


class PythonBackend:
    """One instance of the user's class, shared by the model's instances (with `instances` > 1
    its `infer` is called from several threads at once)."""

    platform = "python"
    provider = "python"

    def __init__(self, path: Path, options: PythonOptions, label: str) -> None:
        self._label = label
        module = _import(path, label)
        cls = _find_class(module, options.class_name, label)
        try:
            self._model = cls()
            self._model.load(
                {"label": label, "path": str(path.parent), "parameters": dict(options.parameters)}
            )
        except Exception as exc:
            raise BackendError(
                f"{label}: {cls.__name__}.load failed: {type(exc).__name__}: {exc}"
            ) from exc
        self.inputs = tuple(_spec(decl) for decl in options.inputs)
        self.outputs = tuple(_spec(decl) for decl in options.outputs)
        self._batched = all(spec.shape and spec.shape[0] == -1 for spec in self.inputs)

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        try:
            result = self._model.infer(dict(inputs))
        except EngineError:
            raise  # the step's own verdict on its input (e.g. InvalidInput) reaches the client
        first = next(iter(inputs.values()), None)
        rows = first.shape[0] if self._batched and first is not None and first.ndim else None
        return self._check(result, rows)

    def _check(self, result: Any, rows: int | None) -> dict[str, np.ndarray]:
        """The returned outputs, or a BackendError naming the model and what is wrong."""
        where = f"{self._label}: infer"
        if not isinstance(result, dict):
            raise BackendError(
                f"{where} returned {type(result).__name__}; it must return a dict of output "
                "name -> numpy array"
            )
        declared = [spec.name for spec in self.outputs]
        missing = [name for name in declared if name not in result]
        extra = [str(name) for name in result if name not in declared]
        if missing or extra:
            raise BackendError(
                f"{where} returned outputs {sorted(map(str, result))}; the config declares "
                f"{declared}"
                + (f" (missing {missing})" if missing else "")
                + (f" (undeclared {extra})" if extra else "")
            )
        checked = {}
        for spec in self.outputs:
            array = result[spec.name]
            if not isinstance(array, np.ndarray):
                raise BackendError(
                    f"{where} returned {type(array).__name__} for output '{spec.name}'; it must "
                    "be a numpy array"
                )
            checked[spec.name] = self._check_array(where, spec, array, rows)
        return checked

    def _check_array(
        self, where: str, spec: TensorSpec, array: np.ndarray, rows: int | None
    ) -> np.ndarray:
        expected = datatypes.numpy_dtype(spec.datatype)
        if spec.datatype == "BYTES" and array.dtype.kind == "S":
            array = array.astype(object)  # fixed-width bytes: the protocol's BYTES all the same
        if array.dtype != expected or (
            spec.datatype == "BYTES" and not all(isinstance(v, bytes) for v in array.flat)
        ):
            got = "objects other than bytes" if array.dtype == expected else str(array.dtype)
            raise BackendError(
                f"{where} returned {got} for output '{spec.name}'; the config declares "
                f"{spec.datatype} ({'bytes objects' if spec.datatype == 'BYTES' else expected})"
            )
        shape = list(array.shape)
        fits = len(shape) == len(spec.shape) and all(
            want in (-1, got) for want, got in zip(spec.shape, shape, strict=True)
        )
        if not fits:
            raise BackendError(
                f"{where} returned shape {shape} for output '{spec.name}'; the config declares "
                f"{list(spec.shape)}"
            )
        if rows is not None and spec.shape[0] == -1 and shape[0] != rows:
            raise BackendError(
                f"{where} returned {shape[0]} rows for output '{spec.name}' from a batch of "
                f"{rows} rows; it must return one row per input row"
            )
        return array

    def close(self) -> None:
        close = getattr(self._model, "close", None)
        if callable(close):
            close()
        sys.modules.pop(type(self._model).__module__, None)  # each load imports its own copy
        del self._model


def _import(path: Path, label: str) -> ModuleType:
    """Import model.py under a name of its own (two versions never share a module)."""
    name = f"sluice_python_model_{abs(hash((str(path), path.stat().st_mtime_ns))):x}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BackendError(f"{label}: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pickle, get_type_hints and dataclasses look classes up there
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise BackendError(
            f"{label}: importing model.py failed: {type(exc).__name__}: {exc}"
        ) from exc
    return module


def _find_class(module: ModuleType, class_name: str | None, label: str) -> type[Any]:
    classes = [
        value
        for value in vars(module).values()
        if inspect.isclass(value) and value.__module__ == module.__name__
    ]
    if class_name is not None:
        chosen = [cls for cls in classes if cls.__name__ == class_name]
        if not chosen:
            raise BackendError(
                f"{label}: model.py defines no class {class_name} (python.class_name); it "
                f"defines {', '.join(cls.__name__ for cls in classes) or 'no class'}"
            )
        return chosen[0]
    steps = [
        cls
        for cls in classes
        if callable(getattr(cls, "load", None)) and callable(getattr(cls, "infer", None))
    ]
    if len(steps) != 1:
        found = ", ".join(cls.__name__ for cls in steps) or "none"
        raise BackendError(
            f"{label}: model.py must define exactly one class with load(config) and "
            f"infer(inputs) (or name one in python.class_name); found {found}"
        )
    return steps[0]
