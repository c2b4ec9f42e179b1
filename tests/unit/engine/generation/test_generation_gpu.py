"""A generative model on ONNX Runtime's CUDA provider (gpu-marked: scripts/gpu-check.sh runs it).

The generation scheduler runs each step through the model's own backend, so a generative model
whose config lists CUDAExecutionProvider steps on the GPU like any model (the KV cache stays in
host memory and crosses to the device with each step). Greedy tokens must be the ones
transformers' `generate` gives on the CPU."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from engine.engine import Engine
from engine.generation.sampling import SamplingParams
from server.settings import Settings

CUDA = "CUDAExecutionProvider"
HAS_CUDA = CUDA in ort.get_available_providers()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs onnxruntime-gpu with a working CUDA provider")
async def test_greedy_generation_on_cuda_matches_transformers(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the reference generate needs transformers")
    from tests.generative import publish_tiny, reference_greedy

    version = publish_tiny(tmp_path / "hf", tmp_path / "models")
    config = version.parent / "config.yaml"
    config.write_text(
        config.read_text()
        + "onnxruntime:\n  require_providers: true\n"
        + f"  execution_providers: [{CUDA}, CPUExecutionProvider]\n"
    )
    engine = Engine(Settings(model_repository=tmp_path / "models"))
    await engine.start()
    try:
        model = engine.registry.resolve("tiny", None)
        assert model.backend.provider == CUDA
        assert model.generator is not None
        prompt = await model.generator.prompt_ids("the quick brown fox")
        sequence = model.generator.start(prompt, SamplingParams(max_tokens=24, temperature=0))
        tokens = [token async for chunk in sequence.stream() for token in chunk.tokens]
    finally:
        await engine.close()
    expected = reference_greedy(tmp_path / "hf", prompt, 24)
    assert tokens == expected[: len(tokens)]
    assert len(tokens) == 24 or 0 in expected  # shorter only where the model says end of text
