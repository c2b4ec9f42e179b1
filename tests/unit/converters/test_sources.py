from __future__ import annotations

import warnings
from pathlib import Path

import joblib
import numpy as np
import onnx
import pytest
import torch
from sklearn.linear_model import Ridge

from converters.errors import ConversionError
from converters.sources import load_source
from tests.unit.converters import nets
from tests.unit.converters.graphs import mlp

NETS = Path(nets.__file__)


def test_onnx_file_with_external_weights_loads_them(tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    onnx.save(mlp(), str(path), save_as_external_data=True, size_threshold=0, location="w.data")
    assert (tmp_path / "w.data").stat().st_size > 0
    source = load_source(str(path))
    assert source.kind == "onnx"
    assert all(init.raw_data for init in source.model.graph.initializer)


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match=r"source file '.*nope.onnx' does not exist"):
        load_source(str(tmp_path / "nope.onnx"))
    (tmp_path / "junk.onnx").write_bytes(b"\x00junk")
    with pytest.raises(ConversionError, match=r"is not a readable ONNX model"):
        load_source(str(tmp_path / "junk.onnx"))
    with pytest.raises(ConversionError, match=r"cannot tell what kind of model 'model.h5' is"):
        load_source("model.h5")


def test_sklearn_pickle_needs_trust(tmp_path: Path) -> None:
    path = tmp_path / "ridge.joblib"
    joblib.dump(Ridge().fit(np.eye(3), np.arange(3)), path)
    with pytest.raises(ConversionError, match=r"unpickling runs code.*--trust-pickle"):
        load_source(str(path))
    source = load_source(str(path), trust_pickle=True)
    assert source.kind == "sklearn"
    assert isinstance(source.model, Ridge)
    joblib.dump({"not": "a model"}, tmp_path / "dict.pkl")
    with pytest.raises(ConversionError, match=r"holds a dict; expected a scikit-learn estimator"):
        load_source(str(tmp_path / "dict.pkl"), trust_pickle=True)


def test_factory_from_a_file_or_a_module() -> None:
    from_file = load_source(f"{NETS}:build_cnn")
    from_module = load_source("tests.unit.converters.nets:build_cnn")
    assert from_file.kind == from_module.kind == "torch"
    assert not from_file.model.training
    x = torch.randn(2, 3, 8, 8)
    with torch.inference_mode():
        torch.testing.assert_close(from_file.model(x), from_module.model(x))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"{NETS}:nothing", "has no attribute 'nothing'"),
        (f"{NETS}:build_number", r"build_number\(\)' returned a int; expected a torch.nn.Module"),
        (f"{NETS}:torch", "is a module, not callable"),
        ("no_such_package.models:build", "cannot import module 'no_such_package.models'"),
        ("missing_file.py:build", "source file 'missing_file.py' does not exist"),
    ],
)
def test_factory_errors(text: str, message: str) -> None:
    with pytest.raises(ConversionError, match=message):
        load_source(text)


def test_factory_with_state_dict_weights(tmp_path: Path) -> None:
    trained = nets.build_cnn()
    with torch.no_grad():
        trained.head.bias.fill_(5.0)
    torch.save({"state_dict": trained.state_dict()}, tmp_path / "weights.pt")
    source = load_source(f"{NETS}:build_cnn", weights=tmp_path / "weights.pt")
    assert torch.all(source.model.head.bias == 5.0)
    torch.save({"other": torch.zeros(1)}, tmp_path / "wrong.pt")
    with pytest.raises(ConversionError, match=r"weights '.*wrong.pt' do not fit the module"):
        load_source(f"{NETS}:build_cnn", weights=tmp_path / "wrong.pt")
    with pytest.raises(ConversionError, match=r"--weights applies to a module factory source"):
        load_source(str(tmp_path / "wrong.pt"), weights=tmp_path / "weights.pt")


def test_torch_archives_are_told_apart(tmp_path: Path) -> None:
    model = nets.build_cnn()
    example = (torch.randn(2, 3, 8, 8),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.trace(model, example).save(  # type: ignore[no-untyped-call]
            str(tmp_path / "cnn.ts")
        )
        program = torch.export.export(model, example)
        torch.export.save(program, str(tmp_path / "cnn.pt2"))
    torch.save(model, tmp_path / "whole.pt")
    torch.save(model.state_dict(), tmp_path / "state.pt")
    assert load_source(str(tmp_path / "cnn.ts")).kind == "torchscript"
    assert load_source(str(tmp_path / "cnn.pt2")).kind == "exported_program"
    with pytest.raises(ConversionError, match=r"but a pickle.*pass --trust-pickle"):
        load_source(str(tmp_path / "whole.pt"))
    assert load_source(str(tmp_path / "whole.pt"), trust_pickle=True).kind == "torch"
    with pytest.raises(ConversionError, match=r"holds a OrderedDict, not a torch.nn.Module"):
        load_source(str(tmp_path / "state.pt"), trust_pickle=True)
    (tmp_path / "plain.pt").write_text("not a zip")
    with pytest.raises(ConversionError, match=r"is not a PyTorch archive"):
        load_source(str(tmp_path / "plain.pt"))


def test_broken_torch_sources_are_conversion_errors_not_tracebacks(tmp_path: Path) -> None:
    """Each was an uncaught exception out of `sluice convert` (a traceback, exit 1)."""
    import zipfile

    with zipfile.ZipFile(tmp_path / "fake.ts", "w") as archive:
        archive.writestr("x/constants.pkl", b"not a pickle")
    with pytest.raises(ConversionError, match=r"fake.ts' is not a TorchScript archive"):
        load_source(str(tmp_path / "fake.ts"))
    (tmp_path / "factory.py").write_text("def build():\n    raise RuntimeError('no net')\n")
    with pytest.raises(ConversionError, match=r"build\(\)' failed: RuntimeError: no net"):
        load_source(f"{tmp_path / 'factory.py'}:build")
    torch.save({"path": Path("x")}, tmp_path / "objects.pt")  # not tensors: refused unpickled
    (tmp_path / "junk.pt").write_bytes(b"junk")
    for weights in ("objects.pt", "junk.pt"):
        with pytest.raises(ConversionError, match=rf"weights '.*{weights}' are not a state dict"):
            load_source(f"{NETS}:build_cnn", weights=tmp_path / weights)
