"""Hugging Face causal-LM folders are told apart by their config.json's architectures."""

from __future__ import annotations

from pathlib import Path

import pytest

from converters.hf_decoder import is_causal_lm_folder
from tests.generative import tiny_gpt2


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gpt2(tmp_path_factory.mktemp("hf") / "tiny-gpt2")


def test_only_causal_lm_folders_are_detected(hf_folder: Path, tmp_path: Path) -> None:
    assert is_causal_lm_folder(str(hf_folder))
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"]}')
    assert not is_causal_lm_folder(str(tmp_path))
    (tmp_path / "config.json").write_text("not json")
    assert not is_causal_lm_folder(str(tmp_path))
    assert not is_causal_lm_folder(str(tmp_path / "missing"))
