"""converters.options: ConvertOptions, everything the `sluice convert` command line can say."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import converters.pipeline
from converters.options import ConvertOptions
from server.cli import main


class Captured(Exception):
    """Stops the conversion once its options are built."""


def _options_of(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str) -> ConvertOptions:
    seen: list[ConvertOptions] = []

    def capture(options: ConvertOptions, steps: Any) -> Any:
        seen.append(options)
        raise Captured

    monkeypatch.setattr(converters.pipeline, "convert_model", capture)
    source = tmp_path / "model.onnx"
    source.write_bytes(b"not read: the conversion stops first")
    command = ["convert", str(source), "--repository", str(tmp_path / "repo"), *args]
    result = CliRunner().invoke(main, command)
    assert isinstance(result.exception, Captured), result.output
    (options,) = seen
    return options


def test_the_command_lines_defaults_are_the_options_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    given = _options_of(monkeypatch, tmp_path)
    defaults = ConvertOptions(source=given.source, repository=given.repository)
    differ = {
        field.name: (getattr(given, field.name), getattr(defaults, field.name))
        for field in dataclasses.fields(ConvertOptions)
        if getattr(given, field.name) != getattr(defaults, field.name)
    }
    assert differ == {}
    assert given.repository == tmp_path / "repo"


def test_flags_reach_their_fields(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    options = _options_of(
        monkeypatch,
        tmp_path,
        *("--precision", "fp16", "--max-batch-size", "16", "--seed", "7", "--name", "m"),
    )
    assert (options.precision, options.max_batch_size, options.seed) == ("fp16", 16, 7)
    assert options.name == "m"
