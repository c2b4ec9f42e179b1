"""Engine settings as a settings file gives them, and what they are refused with, for the tests
of engine/settings.py and engine/settings_sections.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from engine.settings import EngineSettings, SettingsError, describe, read_yaml


def write(tmp_path: Path, text: str, name: str = "server.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load(config: Path | dict[str, Any] | None = None, **fields: object) -> EngineSettings:
    """EngineSettings from a settings file (or a mapping) and `fields` over it."""
    data = read_yaml(config) if isinstance(config, Path) else dict(config or {})
    return EngineSettings.model_validate({**data, **fields})


def error_of(config: Path | dict[str, Any] | None = None, **fields: object) -> str:
    """What `load(config, **fields)` is refused with, as the server says it (describe)."""
    with pytest.raises((SettingsError, ValidationError)) as caught:
        load(config, **fields)
    if isinstance(caught.value, ValidationError):
        return describe(caught.value, EngineSettings, "the test")
    return str(caught.value)
