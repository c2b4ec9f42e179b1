"""A tiny Llama with grouped-query attention and a BOS-adding tokenizer, built here (no
downloads) and turned into an onnxruntime-genai model by its model builder, for the tests of
generation on onnxruntime-genai.

The Hugging Face folder is what transformers 5 saves: config.json, model.safetensors,
tokenizer.json (a byte-level BPE trained on a few sentences whose post-processor puts <s> before
every text), tokenizer_config.json and chat_template.jinja beside it. Random weights from a
fixed seed, sharpened so that greedy argmaxes are clear."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from tests.generative import SENTENCES

BOS, EOS = "<s>", "</s>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: "
    "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
CONTEXT = 128
SEED = 0


def bos_tokenizer() -> Any:
    """A byte-level BPE tokenizer whose post-processor adds BOS (as Llama's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=400,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(SENTENCES, trainer)
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tokenizer


def tiny_gqa_llama_tokenizer(folder: Path) -> Any:
    """Save the BOS-adding tokenizer as transformers 5 does (tokenizer.json,
    tokenizer_config.json, chat_template.jinja) into `folder`; returns it."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = bos_tokenizer()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS)  # type: ignore[no-untyped-call]
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return tokenizer


def tiny_gqa_llama(folder: Path) -> Path:
    """Write the tiny Llama (2 layers, hidden 64, 4 heads over 2 key/value heads, a context of
    CONTEXT tokens) and its tokenizer into `folder`; returns `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_gqa_llama_tokenizer(folder)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
    )
    model = LlamaForCausalLM(config).eval()  # type: ignore[no-untyped-call]
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(4.0)
    model.save_pretrained(folder)
    return folder


def build_genai(hf: Path, out: Path, precision: str = "fp32") -> Path:
    """onnxruntime-genai's model builder on the Hugging Face folder `hf` (CPU), in process;
    returns `out` (genai_config.json, model.onnx and its data, the tokenizer files)."""
    from onnxruntime_genai.models.builder import create_model, parse_extra_options

    cache = out.parent / f"{out.name}-cache"
    extra = parse_extra_options(None, str(hf), str(out), precision, "cpu", str(cache), None)
    create_model(None, str(hf), str(out), precision, "cpu", str(cache), **extra)
    return out


def publish_genai(built: Path, repository: Path, name: str = "llama", config: str = "") -> Path:
    """Copy a model builder's output to `repository/name/1` (with `config` as config.yaml when
    given); returns the version folder."""
    import shutil

    version = repository / name / "1"
    shutil.copytree(built, version)
    if config:
        (repository / name / "config.yaml").write_text(config)
    return version


@functools.cache
def _reference(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()  # type: ignore[no-untyped-call]


def reference_greedy(folder: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate`, greedy, from exactly `prompt_ids` (BOS included when given):
    the tokens after the prompt, without the end-of-text token it may end with."""
    import torch

    model = _reference(folder)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=min(max_new_tokens, CONTEXT - len(prompt_ids)),
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
        )
    tokens = [int(t) for t in out[0, len(prompt_ids) :]]
    return tokens[:-1] if tokens and tokens[-1] == model.config.eos_token_id else tokens
