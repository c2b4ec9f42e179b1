"""Conversion writes nothing into the directory it is run from: ONNX Runtime's symbolic shape
inference, when it comes out incomplete (as for a BERT encoder), dumps the model there as
sym_shape_infer_temp.onnx plus a uuid-named external data file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result

from tests.hf_models import sentence_transformer_folder


def test_int8_conversion_leaves_the_working_directory_as_it_was(
    tmp_path: Path, convert_cli: Callable[..., Result], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = sentence_transformer_folder(tmp_path / "mini-st")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    result = convert_cli(
        str(folder), "--precision", "int8", "--dry-run", "--repository", tmp_path / "repo",
        "--measure-iterations", "0",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in cwd.iterdir()) == []
