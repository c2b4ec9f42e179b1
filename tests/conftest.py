from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_process import RedisProcess


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server shared by the session; tests use their own key prefixes or flush."""
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    """A private redis-server that the test may kill and restart."""
    server = RedisProcess(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_gpt2_built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny GPT-2 of tests/generative.py built and converted once for the session: (its
    Hugging Face folder, a repository with it as `tiny`). Modules take copies (`copy_tiny`)."""
    from tests.generative import publish_tiny

    root = tmp_path_factory.mktemp("tiny-gpt2")
    publish_tiny(root / "hf", root / "models")
    return root / "hf", root / "models"


@pytest.fixture(scope="session")
def tiny_genai_built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny GQA Llama of tests/genai_models.py built once for the session: (its Hugging
    Face folder, onnxruntime-genai's model builder output of it). Tests publish copies."""
    from tests.genai_models import build_genai, tiny_gqa_llama

    root = tmp_path_factory.mktemp("tiny-genai")
    hf = tiny_gqa_llama(root / "hf")
    return hf, build_genai(hf, root / "genai")
