"""Recognise and load a conversion source: a PyTorch module factory (`file.py:callable` or
`package.module:callable`), a TorchScript archive, an exported program (`.pt2`), a scikit-learn
pickle or an ONNX file. Everything is local; nothing is downloaded.

Unpickling runs code, so pickles (scikit-learn files, whole pickled torch modules) load only with
`trust_pickle`. TorchScript archives and state dicts load without it, and so do exported programs
that hold only tensors and plain shape arithmetic (converters/archive.py)."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from converters.errors import ConversionError, MissingDependency
from converters.quiet import quiet

SourceKind = Literal["torch", "torchscript", "exported_program", "sklearn", "onnx"]

_FACTORY = re.compile(r"^(?P<module>[^:]+):(?P<attr>[A-Za-z_][A-Za-z0-9_.]*)$")
_TORCH_SUFFIXES = (".pt", ".ts", ".pt2", ".pth")
_PICKLE_SUFFIXES = (".pkl", ".pickle", ".joblib")
FORMS = (
    "path/to/file.py:callable, package.module:callable (a PyTorch module factory), "
    "a TorchScript file (.pt/.ts), an exported program (.pt2), "
    "a scikit-learn pickle (.pkl/.joblib) or an ONNX file (.onnx)"
)


@dataclass
class Source:
    """A loaded source model and what kind it is."""

    kind: SourceKind
    location: str
    model: Any


def load_source(text: str, weights: Path | None = None, trust_pickle: bool = False) -> Source:
    """Load SOURCE; `weights` is a state-dict file for a factory source."""
    path = Path(text)
    suffix = path.suffix.lower()
    if weights is not None and (path.exists() or not _FACTORY.match(text)):
        raise ConversionError(
            f"--weights applies to a module factory source (module:callable), not '{text}'"
        )
    if suffix in (".onnx", *_TORCH_SUFFIXES, *_PICKLE_SUFFIXES) and not path.is_file():
        raise ConversionError(f"source file '{text}' does not exist")
    if suffix == ".onnx":
        return Source("onnx", text, _load_onnx(path))
    if suffix in _PICKLE_SUFFIXES:
        return Source("sklearn", text, _load_pickle(path, trust_pickle))
    if suffix in _TORCH_SUFFIXES:
        return _load_torch_archive(path, trust_pickle)
    match = _FACTORY.match(text)
    if match:
        return Source("torch", text, _build_module(match["module"], match["attr"], weights))
    raise ConversionError(f"cannot tell what kind of model '{text}' is; expected {FORMS}")


def _load_onnx(path: Path) -> Any:
    import onnx

    try:
        # Loads external weights (`model.onnx.data`) from beside the file, too.
        return onnx.load(str(path))
    except Exception as exc:
        raise ConversionError(f"'{path}' is not a readable ONNX model: {exc}") from exc


def _load_pickle(path: Path, trust_pickle: bool) -> Any:
    if not trust_pickle:
        raise ConversionError(
            f"'{path}' is a pickle, and unpickling runs code from the file; "
            "pass --trust-pickle if you trust where it came from"
        )
    _require("scikit-learn", "sklearn")
    import joblib

    try:
        estimator = joblib.load(path)
    except Exception as exc:
        raise ConversionError(f"cannot unpickle '{path}': {exc}") from exc
    if not hasattr(estimator, "fit"):
        raise ConversionError(
            f"'{path}' holds a {type(estimator).__name__}; expected a scikit-learn estimator "
            "or pipeline"
        )
    return estimator


def _load_torch_archive(path: Path, trust_pickle: bool) -> Source:
    _require("torch", "torch")
    import torch

    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (OSError, zipfile.BadZipFile) as exc:
        raise ConversionError(f"'{path}' is not a PyTorch archive (zip): {exc}") from exc
    if any(name.endswith("/constants.pkl") for name in names):
        with quiet():
            try:
                module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
            except Exception as exc:  # a zip that only looks like TorchScript
                raise ConversionError(
                    f"'{path}' is not a TorchScript archive torch can load: {exc}"
                ) from exc
        return Source("torchscript", str(path), module)
    if any(name.endswith("/archive_format") for name in names):
        from converters.archive import load_exported_program

        return Source("exported_program", str(path), load_exported_program(path, trust_pickle))
    if not trust_pickle:
        raise ConversionError(
            f"'{path}' is neither TorchScript nor an exported program but a pickle (torch.save), "
            "and unpickling runs code; pass --trust-pickle, or save the model with "
            "torch.jit.save / torch.export.save"
        )
    model = torch.load(str(path), map_location="cpu", weights_only=False)
    if not isinstance(model, torch.nn.Module):
        raise ConversionError(
            f"'{path}' holds a {type(model).__name__}, not a torch.nn.Module; a state dict needs "
            "a factory: SOURCE=file.py:build --weights FILE"
        )
    return Source("torch", str(path), model.eval())


def _build_module(module_name: str, attr: str, weights: Path | None) -> Any:
    _require("torch", "torch")
    import torch

    factory: Any = _import(module_name)
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise ConversionError(f"'{module_name}' has no attribute '{attr}'")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ConversionError(f"'{module_name}:{attr}' is a {type(factory).__name__}, not callable")
    try:
        module = factory()
    except Exception as exc:
        raise ConversionError(
            f"'{module_name}:{attr}()' failed: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(module, torch.nn.Module):
        raise ConversionError(
            f"'{module_name}:{attr}()' returned a {type(module).__name__}; "
            "expected a torch.nn.Module"
        )
    if weights is not None:
        try:  # weights_only: tensors and plain containers, never code
            state = torch.load(str(weights), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ConversionError(
                f"weights '{weights}' are not a state dict of tensors torch loads without running "
                f"code: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from exc
        if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
            state = state["state_dict"]
        try:
            module.load_state_dict(state)
        except (RuntimeError, TypeError, AttributeError) as exc:
            raise ConversionError(f"weights '{weights}' do not fit the module: {exc}") from exc
    return module.eval()


def _import(module_name: str) -> Any:
    if not module_name.endswith(".py"):
        try:
            return importlib.import_module(module_name)
        except ImportError as exc:
            raise ConversionError(f"cannot import module '{module_name}': {exc}") from exc
    path = Path(module_name).resolve()
    if not path.is_file():
        raise ConversionError(f"source file '{module_name}' does not exist")
    name = f"sluice_convert_source_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConversionError(f"cannot import '{module_name}' as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look classes up here
    sys.path.insert(0, str(path.parent))  # so the file can import its neighbours
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def _require(package: str, module: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise MissingDependency(
            f"loading a {package} model",
            [f"the {package} package is not installed (pip install 'sluice[convert]')"],
        )
