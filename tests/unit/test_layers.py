"""The layers (docs/development.md): batching/ imports nothing of the other packages, engine/ only
batching/ (no transport: neither server/ nor fastapi, starlette, uvicorn or grpc). Read from
each module's import statements, function-level and TYPE_CHECKING ones included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PACKAGES = {"batching", "engine", "server", "converters", "loadtests"}
TRANSPORTS = {"fastapi", "starlette", "uvicorn", "grpc"}

MAY_NOT_IMPORT = {
    "batching": PACKAGES - {"batching"} | TRANSPORTS,
    "engine": PACKAGES - {"engine", "batching"} | TRANSPORTS,
}


def imported(path: Path) -> set[str]:
    """The top-level names of the modules `path` imports (relative imports stay in its package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(MAY_NOT_IMPORT))
def test_a_lower_layer_imports_nothing_above_it(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no modules under {package}/"
    crossings = {
        str(path.relative_to(ROOT)): sorted(imported(path) & MAY_NOT_IMPORT[package])
        for path in files
    }
    assert {path: names for path, names in crossings.items() if names} == {}
