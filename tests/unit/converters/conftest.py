from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from converters.cli import convert
from tests.hf_models import classifier_folder, sentence_transformer_folder

NETS = Path(__file__).parent / "nets.py"


def run_convert(*args: str | Path) -> Result:
    """`sluice convert ARGS` in process; the result's exit_code and output are asserted on."""
    return CliRunner().invoke(convert, [str(arg) for arg in args], catch_exceptions=False)


@pytest.fixture
def convert_cli() -> Callable[..., Result]:
    return run_convert


@pytest.fixture(scope="session")
def encoder_onnx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small transformer encoder exported once to a plain (basic-optimized) ONNX file."""
    repository = tmp_path_factory.mktemp("encoder-repo")
    result = run_convert(
        f"{NETS}:build_encoder",
        "--input", "input_ids:INT64:batch,sequence=16:0..100",
        "--max-batch-size", "8",
        "--optimization-level", "basic",
        "--measure-iterations", "0",
        "--repository", repository,
        "--name", "encoder",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return repository / "encoder" / "1" / "model.onnx"


@pytest.fixture(scope="session")
def st_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small sentence-transformers folder (built once: torch makes it take seconds)."""
    return sentence_transformer_folder(tmp_path_factory.mktemp("hf") / "mini-st")


@pytest.fixture(scope="session")
def cls_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small sequence-classification folder (built once)."""
    return classifier_folder(tmp_path_factory.mktemp("hf") / "mini-cls")
