"""Exported-program archives (`.pt2`, and `.pt` zips with an `archive_format` entry) never run
code from the file unless `--trust-pickle` is given: every tampered archive below is a real
`torch.export.save` output with one piece replaced, and each would run its payload (create a
marker file) through `torch.export.load`."""

from __future__ import annotations

import json
import pickle
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from converters.cli import convert
from tests.unit.converters import nets

Convert = Callable[..., Result]
SUFFIXES = (".pt2", ".pt")


class _Payload:
    """Unpickling this creates `marker`: what a hostile pickle in an archive would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _export(path: Path) -> None:
    model = nets.build_cnn()
    batch = torch.export.Dim("batch", min=1, max=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(
            model, (torch.randn(2, 3, 8, 8),), dynamic_shapes=({0: batch},)
        )
        torch.export.save(program, str(path))


def _rewrite(path: Path, change: Callable[[dict[str, bytes]], None]) -> None:
    """Replace records of the archive at `path` (names without the archive's top folder)."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        top = names[0].split("/", 1)[0] + "/"
        records = {name.removeprefix(top): archive.read(name) for name in names}
    change(records)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for name, data in records.items():
            archive.writestr(top + name, data)


def _tampered(tmp_path: Path, suffix: str, change: Callable[[dict[str, bytes]], None]) -> Path:
    path = tmp_path / f"model{suffix}"
    _export(path)
    _rewrite(path, change)
    return path


def _edit_json(records: dict[str, bytes], name: str, edit: Callable[[Any], None]) -> None:
    data = json.loads(records[name])
    edit(data)
    records[name] = json.dumps(data).encode()


def _convert(path: Path, tmp_path: Path, *more: str) -> Result:
    args = [str(path), "--input", "image:FP32:-1,3,8,8", "--repository", str(tmp_path / "repo")]
    # Exceptions are caught, so a crash after the payload ran still reaches the marker check.
    return CliRunner().invoke(convert, [*args, "--measure-iterations", "0", *more])


def _refused(path: Path, tmp_path: Path, marker: Path) -> str:
    result = _convert(path, tmp_path)
    assert not marker.exists(), "code from the archive ran"
    assert result.exit_code == 1, result.output
    assert "--trust-pickle" in result.output
    assert not (tmp_path / "repo").exists()
    return result.output


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_pickle_in_the_sample_inputs_never_runs(tmp_path: Path, suffix: str) -> None:
    marker = tmp_path / "marker"

    def change(records: dict[str, bytes]) -> None:
        records["data/sample_inputs/model.pt"] = pickle.dumps(_Payload(marker))

    path = _tampered(tmp_path, suffix, change)
    output = _refused(path, tmp_path, marker)
    assert "sample inputs" in output


def test_a_pickled_weight_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "marker"

    def change(records: dict[str, bytes]) -> None:
        name = "data/weights/model_weights_config.json"
        config = json.loads(records[name])
        entry = next(iter(config["config"].values()))
        entry["use_pickle"] = True
        records["data/weights/" + entry["path_name"]] = pickle.dumps(_Payload(marker))
        records[name] = json.dumps(config).encode()

    _refused(_tampered(tmp_path, ".pt2", change), tmp_path, marker)


def test_an_object_constant_is_refused(tmp_path: Path) -> None:
    # torch.export.load plain-unpickles constants named opaque_obj_* (pickle.loads).
    marker = tmp_path / "marker"

    def change(records: dict[str, bytes]) -> None:
        records["data/constants/opaque_obj_0"] = pickle.dumps(_Payload(marker))
        _edit_json(
            records,
            "data/constants/model_constants_config.json",
            lambda config: config["config"].update(
                {
                    "evil": {
                        "path_name": "opaque_obj_0",
                        "is_param": False,
                        "use_pickle": True,
                        "tensor_meta": None,
                    }
                }
            ),
        )

    output = _refused(_tampered(tmp_path, ".pt2", change), tmp_path, marker)
    assert "'evil'" in output


def _walk(value: Any, key: str) -> list[dict[str, Any]]:
    """Every dict in `value` that has `key`."""
    found: list[dict[str, Any]] = []
    if isinstance(value, dict):
        if key in value:
            found.append(value)
        for item in value.values():
            found += _walk(item, key)
    elif isinstance(value, list):
        for item in value:
            found += _walk(item, key)
    return found


def test_a_symbolic_shape_that_is_code_never_runs(tmp_path: Path) -> None:
    # Shapes are sympy expressions parsed with sympy.sympify, which evaluates Python.
    marker = tmp_path / "marker"
    code = f"__import__('os').system('touch {marker}')"

    def change(records: dict[str, bytes]) -> None:
        def edit(program: Any) -> None:
            for holder in _walk(program, "expr_str"):
                holder["expr_str"] = code

        _edit_json(records, "models/model.json", edit)

    output = _refused(_tampered(tmp_path, ".pt2", change), tmp_path, marker)
    assert "symbolic shape" in output


def test_guard_code_never_runs(tmp_path: Path) -> None:
    # ExportedProgram.module() compiles the archive's guards with exec.
    marker = tmp_path / "marker"

    def change(records: dict[str, bytes]) -> None:
        _edit_json(
            records,
            "models/model.json",
            lambda program: program.update(
                guards_code=[f"__import__('os').system('touch {marker}') == 0"]
            ),
        )

    output = _refused(_tampered(tmp_path, ".pt2", change), tmp_path, marker)
    assert "guard" in output


def test_an_argument_name_that_is_code_never_runs(tmp_path: Path) -> None:
    # torch.fx writes argument names verbatim into the module's source, twice; a triple-quoted
    # string spans from one copy to the other, so this name is valid Python in both places.
    marker = tmp_path / "marker"
    name = f"x='''):\n    pass\nimport os; os.system('touch {marker}')\ndef g(self):\n    q = (([0"

    def change(records: dict[str, bytes]) -> None:
        def edit(program: Any) -> None:
            program["graph_module"]["module_call_graph"][0]["signature"]["forward_arg_names"] = [
                name
            ]

        _edit_json(records, "models/model.json", edit)

    output = _refused(_tampered(tmp_path, ".pt2", change), tmp_path, marker)
    assert "names an input or weight" in output


def test_a_graph_that_calls_a_python_function_is_refused(tmp_path: Path) -> None:
    # Node targets are looked up as attributes of `torch`; only operators may be called.
    def change(records: dict[str, bytes]) -> None:
        def edit(program: Any) -> None:
            node = _walk(program, "target")[0]
            node["target"] = "torch.serialization.os.system"

        _edit_json(records, "models/model.json", edit)

    result = _convert(_tampered(tmp_path, ".pt2", change), tmp_path)
    assert result.exit_code == 1, result.output
    assert "is not a readable exported program" in result.output
    assert "system" in result.output
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_an_untouched_exported_program_converts_without_trust(
    tmp_path: Path, convert_cli: Convert, suffix: str
) -> None:
    path = tmp_path / f"cnn{suffix}"
    _export(path)
    result = convert_cli(
        path, "--input", "image:FP32:-1,3,8,8", "--repository", tmp_path / "repo",
        "--name", "cnn", "--measure-iterations", "0",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (tmp_path / "repo" / "cnn" / "1" / "model.onnx").exists()


def test_trust_pickle_hands_the_archive_to_torch(tmp_path: Path) -> None:
    marker = tmp_path / "marker"

    def change(records: dict[str, bytes]) -> None:
        records["data/sample_inputs/model.pt"] = pickle.dumps(_Payload(marker))

    result = _convert(_tampered(tmp_path, ".pt2", change), tmp_path, "--trust-pickle")
    assert result.exit_code == 1  # the payload does not return sample inputs...
    assert "is not a readable exported program" in result.output
    assert marker.exists()  # trusted: torch.export.load's own (unsafe) fallback ran it
