"""Python steps: never imported unless allowed, run in the inference pool, and every output
checked against the config (names, datatypes, shapes, rows) with errors naming the model."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from engine.backends.python_model import PythonBackend
from engine.engine import Engine
from engine.errors import BackendError, InvalidInput, ModelNotReady
from engine.model_config import ModelConfig
from engine.step_config import PythonOptions
from engine.types import InferRequest
from server.settings import load_settings
from tests.text_models import NORMALIZE_CONFIG, NORMALIZE_PY

LABEL = "model 'step' version 1"
OPTIONS = PythonOptions(
    inputs=[{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],  # type: ignore[list-item]
    outputs=[
        {"name": "y", "datatype": "FP32", "shape": [-1, 2]},  # type: ignore[list-item]
        {"name": "label", "datatype": "BYTES", "shape": [-1]},  # type: ignore[list-item]
    ],
    parameters={"scale": 3},
)


def write_step(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.py"
    path.write_text("import numpy as np\n\n" + body)
    return path


def step(tmp_path: Path, infer_body: str) -> PythonBackend:
    body = f"""
class Step:
    def load(self, config):
        self.scale = config["parameters"]["scale"]

    def infer(self, inputs):
        x = inputs["x"]
{infer_body}
"""
    return PythonBackend(write_step(tmp_path / "1", body), OPTIONS, LABEL)


GOOD = '        return {"y": x * self.scale, "label": np.array([b"a"] * len(x), dtype=object)}'


def test_outputs_come_back_as_returned(tmp_path: Path) -> None:
    x = np.array([[1, 2], [3, 4]], np.float32)
    out = step(tmp_path, GOOD).run({"x": x})
    assert out["y"].tolist() == (x * 3).tolist()
    assert out["label"].tolist() == [b"a", b"a"]


@pytest.mark.parametrize(
    ("infer_body", "message"),
    [
        (
            "        return [x]",
            f"{LABEL}: infer returned list; it must return a dict of output name -> numpy array",
        ),
        (
            '        return {"y": x}',
            f"{LABEL}: infer returned outputs ['y']; the config declares ['y', 'label'] "
            "(missing ['label'])",
        ),
        (
            '        return {"y": x, "label": np.array([b"a"] * len(x)), "z": x}',
            f"{LABEL}: infer returned outputs ['label', 'y', 'z']; the config declares "
            "['y', 'label'] (undeclared ['z'])",
        ),
        (
            '        return {"y": x.astype(np.float64), "label": np.array([b"a"] * len(x))}',
            f"{LABEL}: infer returned float64 for output 'y'; the config declares FP32 (float32)",
        ),
        (
            '        return {"y": x, "label": np.array(["a"] * len(x), dtype=object)}',
            f"{LABEL}: infer returned objects other than bytes for output 'label'; the config "
            "declares BYTES (bytes objects)",
        ),
        (
            '        return {"y": x[:1], "label": np.array([b"a"] * len(x))}',
            f"{LABEL}: infer returned 1 rows for output 'y' from a batch of 2 rows; it must "
            "return one row per input row",
        ),
        (
            '        return {"y": x[:, :1], "label": np.array([b"a"] * len(x))}',
            f"{LABEL}: infer returned shape [2, 1] for output 'y'; the config declares [-1, 2]",
        ),
        (
            '        return {"y": x.tolist(), "label": np.array([b"a"] * len(x))}',
            f"{LABEL}: infer returned list for output 'y'; it must be a numpy array",
        ),
    ],
)
def test_a_wrong_return_is_a_backend_error_naming_model_and_output(
    tmp_path: Path, infer_body: str, message: str
) -> None:
    backend = step(tmp_path, infer_body)
    with pytest.raises(BackendError) as caught:
        backend.run({"x": np.ones((2, 2), np.float32)})
    assert caught.value.message == message


def test_model_py_may_use_dataclasses_and_its_module_is_dropped_on_close(tmp_path: Path) -> None:
    body = """
import dataclasses


@dataclasses.dataclass
class Scale:
    factor: float


class Step:
    def load(self, config):
        self.scale = Scale(config["parameters"]["scale"])

    def infer(self, inputs):
        x = inputs["x"]
        return {"y": x * self.scale.factor, "label": np.array([b"a"] * len(x), dtype=object)}
"""
    backend = PythonBackend(write_step(tmp_path / "1", body), OPTIONS, LABEL)
    module = type(backend._model).__module__
    assert backend.run({"x": np.ones((1, 2), np.float32)})["y"].tolist() == [[3, 3]]
    assert module in sys.modules
    backend.close()
    assert module not in sys.modules


def test_the_step_may_refuse_its_input_as_invalid(tmp_path: Path) -> None:
    body = "        raise InvalidInput(\"input 'x' must be positive\")"
    backend = step(tmp_path, body.replace("raise", "from engine.errors import InvalidInput; raise"))
    with pytest.raises(InvalidInput, match="must be positive"):
        backend.run({"x": np.ones((1, 2), np.float32)})


@pytest.mark.parametrize(
    ("body", "class_name", "message"),
    [
        ("x = 1\n", None, "found none"),
        (
            "class A:\n    def load(self, c): pass\n    def infer(self, i): pass\n"
            "class B(A): pass\n",
            None,
            "found A, B",
        ),
        ("class A:\n    pass\n", "Missing", r"defines no class Missing \(python.class_name\)"),
        ("raise RuntimeError('boom')\n", None, "importing model.py failed: RuntimeError: boom"),
        (
            "class A:\n    def load(self, c): raise KeyError('vocab')\n"
            "    def infer(self, i): pass\n",
            None,
            "A.load failed: KeyError: 'vocab'",
        ),
    ],
)
def test_a_broken_model_py_fails_the_load_saying_why(
    tmp_path: Path, body: str, class_name: str | None, message: str
) -> None:
    options = OPTIONS.model_copy(update={"class_name": class_name})
    with pytest.raises(BackendError, match=rf"^{LABEL}: .*{message}"):
        PythonBackend(write_step(tmp_path / "1", body), options, LABEL)


def python_repository(root: Path) -> Path:
    marker = root / "imported"
    body = NORMALIZE_PY + f"\nimport threading\nopen({str(marker)!r}, 'w').close()\n"
    body = body.replace(
        '        x = inputs["x"]\n',
        '        x = inputs["x"]\n        self.thread = threading.current_thread().name\n',
    )
    (root / "norm" / "1").mkdir(parents=True)
    (root / "norm" / "1" / "model.py").write_text(body)
    (root / "norm" / "config.yaml").write_text(NORMALIZE_CONFIG)
    return root


async def test_without_the_setting_model_py_is_never_imported(tmp_path: Path) -> None:
    repo = python_repository(tmp_path / "models")
    engine = Engine(load_settings(model_repository=repo, strict_readiness=False))
    await engine.start()
    try:
        with pytest.raises(ModelNotReady) as caught:
            engine.registry.resolve("norm", None)
        index = await engine.repository_index()
    finally:
        await engine.close()
    assert "allow_python_models: true (--allow-python-models" in caught.value.message
    assert index[0]["reason"] == (
        "BackendError: model 'norm' version 1 is a Python model (model.py, code the server would "
        "run); it is loaded only when the server allows Python models: allow_python_models: "
        "true (--allow-python-models, SLUICE_ALLOW_PYTHON_MODELS=true)"
    )
    assert not (tmp_path / "models" / "imported").exists()


async def test_allowed_it_serves_and_infer_runs_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLUICE_ALLOW_PYTHON_MODELS", "true")  # the env route of the setting
    repo = python_repository(tmp_path / "models")
    engine = Engine(load_settings(model_repository=repo))
    await engine.start()
    try:
        x = np.array([[3, 4, 0, 0, 0, 0, 0, 0]], np.float32)
        answer = await engine.infer(InferRequest("norm", {"x": x}, {"x": "FP32"}))
        backend = engine.registry.resolve("norm", None).backend
        for _ in range(3):  # fast runs too: a Python step is never run inline on the loop
            await engine.infer(InferRequest("norm", {"x": x}, {"x": "FP32"}))
            ran_on = backend._model.thread  # type: ignore[attr-defined]
            assert ran_on.startswith("infer-norm-1"), ran_on
    finally:
        await engine.close()
    assert answer.outputs["y"].tolist() == np.float32([[0.6, 0.8, 0, 0, 0, 0, 0, 0]]).tolist()
    assert ran_on != threading.current_thread().name


def test_backend_python_and_its_section_go_together() -> None:
    with pytest.raises(ValidationError, match="backend python and a `python:` section"):
        ModelConfig(backend="python")
    with pytest.raises(ValidationError, match="backend python and a `python:` section"):
        ModelConfig(python=OPTIONS)
