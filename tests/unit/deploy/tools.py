"""Paths and command-line tools shared by the deployment tests."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"


def tool(name: str) -> str:
    """A linter/validator on PATH or beside this interpreter (the dev extra installs it)."""
    found = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(found).exists():
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]' brings it")
    return found
