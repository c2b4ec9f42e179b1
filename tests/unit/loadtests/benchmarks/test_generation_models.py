"""loadtests.benchmarks.generation_models: the prompts of the generation benchmark, texts of
exactly the number of tokens asked for (building and publishing its random-weight models: the
benchmark's own command)."""

from __future__ import annotations

from pathlib import Path

from loadtests.benchmarks.generation_models import prompts
from tests.genai_models import tiny_gqa_llama_tokenizer


def test_prompts_are_different_texts_of_exactly_the_tokens_asked(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tiny_gqa_llama_tokenizer(tmp_path)
    texts = prompts(tmp_path, tokens=12, count=4, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert [len(tokenizer(text).input_ids) for text in texts] == [12] * 4  # BOS included
    assert len(set(texts)) == 4
    assert prompts(tmp_path, tokens=12, count=4, seed=0) == texts
