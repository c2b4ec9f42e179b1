"""The conversion guide's `sluice convert` recipes (docs/guides/conversion.md) run as written: the
`models.py` it shows, the one-liners that make `cnn_weights.pt` and `cnn.ts` from it, and the
TorchScript example's command."""

from __future__ import annotations

import re
import shlex
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result

ROOT = Path(__file__).resolve().parents[3]
SECTION = (ROOT / "docs" / "guides" / "conversion.md").read_text()


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)  # the examples use relative paths (cnn.ts, models/)
    return tmp_path


def test_the_recipes_make_the_files_the_examples_convert(
    in_tmp: Path, convert_cli: Callable[..., Result]
) -> None:
    shown = re.search(r"`models.py`:\n\n(?:<!-- test: .* -->\n)?```python\n(.*?)```", SECTION, re.S)
    assert shown is not None
    models = shown.group(1)
    (in_tmp / "models.py").write_text(models)
    recipe = r"`cnn_weights.pt` is a state dict \(`(.+?)`\) and\s+`cnn.ts`.*?\(`(.+?)`\)"
    recipes = re.search(recipe, SECTION, re.DOTALL)
    assert recipes is not None
    namespace: dict[str, object] = {}
    exec(models, namespace)  # the guide's models.py, then its one-liners beside it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for recipe in recipes.groups():
            exec(recipe, namespace)
    assert (in_tmp / "cnn_weights.pt").stat().st_size > 0
    example = SECTION.split("## Example: TorchScript file", 1)[1].split("```console\n$ ", 1)[1]
    written = example.split("\n ✓", 1)[0]
    readme = (ROOT / "README.md").read_text().split("## Convert\n", 1)[1].split("\n## ", 1)[0]
    assert f"```console\n$ {written}\n```" in readme  # the README's example is this command
    command = shlex.split(written.replace("\\\n", " "))
    assert command[:3] == ["sluice", "convert", "cnn.ts"]
    result = convert_cli(*command[2:])
    assert result.exit_code == 0, result.output
    assert "Published models/cnn-ts/1/model.onnx" in result.stdout
