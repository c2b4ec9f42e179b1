"""Model config files written and loaded as the repository loads them, for the tests of
engine/model_config.py and its sections."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model_config import ModelConfig, load_model_config
from engine.settings import SettingsError


def load(tmp_path: Path, text: str) -> ModelConfig:
    """`text` as the config.yaml of the model folder `tmp_path`, loaded."""
    (tmp_path / "config.yaml").write_text(text)
    return load_model_config(tmp_path)


def error_of(tmp_path: Path, text: str) -> str:
    """The message of the SettingsError loading `text` raises; it must name the file."""
    with pytest.raises(SettingsError) as caught:
        load(tmp_path, text)
    message = str(caught.value)
    assert str(tmp_path / "config.yaml") in message
    return message
