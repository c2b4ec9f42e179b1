"""engine.backends.base: the contract every backend meets (load, describe, run a batch, close)
and the CPU provider's name, importable without loading ONNX Runtime."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import get_type_hints

import numpy as np
import onnx
import onnxruntime as ort

from engine.backends.base import CPU_PROVIDER, Backend
from engine.backends.onnxruntime import OnnxBackend
from engine.backends.python_model import PythonBackend
from engine.backends.tensorrt import TensorRTBackend
from engine.demo import mlp_model
from engine.model_config_sections import OnnxRuntimeOptions
from engine.types import TensorSpec


def test_the_cpu_provider_is_onnx_runtimes_own_name_for_it() -> None:
    assert CPU_PROVIDER in ort.get_all_providers()
    assert CPU_PROVIDER == "CPUExecutionProvider"


def test_naming_it_costs_no_onnx_runtime_import() -> None:
    code = "import sys, engine.backends.base; print('onnxruntime' in sys.modules)"
    root = Path(__file__).resolve().parents[4]
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    )
    assert done.stdout.strip() == "False"


def test_every_backend_has_the_contracts_methods() -> None:
    wanted = {"run", "close"}
    for backend in (OnnxBackend, PythonBackend, TensorRTBackend):
        missing = {name for name in wanted if not callable(getattr(backend, name, None))}
        assert missing == set(), backend.__name__


def test_a_loaded_onnx_model_meets_the_contract(tmp_path: Path) -> None:
    onnx.save(mlp_model((4, 8, 2)), tmp_path / "model.onnx")
    backend: Backend = OnnxBackend(tmp_path / "model.onnx", OnnxRuntimeOptions(), "model 'm'")
    try:
        hints = get_type_hints(Backend)
        assert set(hints) == {"inputs", "outputs", "platform", "provider"}
        assert all(isinstance(s, TensorSpec) for s in (*backend.inputs, *backend.outputs))
        assert (backend.platform, backend.provider) == ("onnxruntime_onnx", CPU_PROVIDER)
        x = np.ones((3, 4), np.float32)
        assert backend.run({"x": x})["probabilities"].shape == (3, 2)
    finally:
        backend.close()
