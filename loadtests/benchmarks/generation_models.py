"""The models, prompts and repositories of loadtests/benchmarks/generation.py: random-weight
Llamas with grouped-query attention generated here (no downloads), prompts of an exact token
count, and the model published as each sluice system serves it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

MODELS: dict[str, dict[str, int]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "100m": {
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
    },
}
CONTEXT = 2048


def build_llama(folder: Path, shape: dict[str, Any]) -> Path:
    """A random-weight Llama of `shape` with the tests' BOS-adding tokenizer; end-of-text is
    never the argmax (its output row is zero, every other logit's maximum is positive)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.genai_models import BOS, EOS, tiny_gqa_llama_tokenizer

    tokenizer = tiny_gqa_llama_tokenizer(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        max_position_embeddings=CONTEXT,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        tie_word_embeddings=False,
        **shape,
    )
    model = LlamaForCausalLM(config).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        model.lm_head.weight[config.eos_token_id].zero_()
    model.save_pretrained(folder)
    return folder


def prompts(folder: Path, tokens: int, count: int, seed: int) -> list[str]:
    """`count` different texts of exactly `tokens` tokens each, BOS included."""
    from transformers import AutoTokenizer

    from tests.generative import SENTENCES

    tokenizer = AutoTokenizer.from_pretrained(folder)
    # Words that are one token after a space and after BOS alike (ByteLevel splits at spaces).
    words = sorted(
        {
            w
            for s in SENTENCES
            for w in s.split()
            if len(tokenizer(f"the {w}").input_ids) == 3 and len(tokenizer(w).input_ids) == 2
        }
    )
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(count):
        chosen = rng.choice(words, tokens - 1)
        text = " ".join(chosen)
        assert len(tokenizer(text).input_ids) == tokens, text
        texts.append(text)
    return texts


def publish(system: str, hf: Path, repository: Path, streams: int) -> None:
    """The model as `system` serves it, published as `bench` in `repository`."""
    room = f"  max_running_sequences: {streams}\n  max_waiting_sequences: {streams}\n"
    if system.startswith("sluice-genai"):
        from tests.genai_models import build_genai, publish_genai

        precision = "int4" if system.endswith("int4") else "fp32"
        built = build_genai(hf, repository.parent / f"built-{precision}", precision)
        publish_genai(built, repository, "bench", config=f"generative:\n{room}")
    elif system == "sluice-loop":
        from converters.causal_lm import convert_causal_lm
        from converters.options import ConvertOptions
        from converters.report import Report, Steps

        options = ConvertOptions(source=str(hf), repository=repository, name="bench")
        report = convert_causal_lm(options, Steps(Report(source=str(hf))))
        assert report.status == "published", report.to_json()
        import yaml

        path = repository / "bench" / "config.yaml"
        config = yaml.safe_load(path.read_text())
        shape = json.loads((hf / "config.json").read_text())
        per_token = (
            2
            * shape["num_hidden_layers"]
            * shape["num_key_value_heads"]
            * 4
            * (shape["hidden_size"] // shape["num_attention_heads"])
        )  # keys and values of every layer, fp32
        config["generative"].update(
            max_running_sequences=streams,
            max_waiting_sequences=streams,
            kv_cache_bytes=per_token * CONTEXT * streams,
        )
        path.write_text(yaml.safe_dump(config))
