"""A tiny GPT-2 for generative-model tests, built here (no downloads): a byte-level BPE tokenizer
trained on a few sentences and a transformers GPT2LMHeadModel with random weights from a fixed
seed, saved as a Hugging Face folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a chat template)."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a batcher merges concurrent requests into one batch",
    "tokens stream out one step at a time",
    "the scheduler admits new sequences at every decode step",
    "a prompt goes in and a completion comes out",
    "the server answers every request exactly once",
]
EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
N_POSITIONS = 64
SEED = 0


def train_tokenizer(folder: Path) -> Any:
    """A byte-level BPE tokenizer (GPT-2's kind) saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=400,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(SENTENCES, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "model_max_length": N_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return tokenizer


def tiny_gpt2(
    folder: Path,
    n_layer: int = 2,
    n_embd: int = 32,
    n_head: int = 2,
    n_positions: int = N_POSITIONS,
) -> Path:
    """Write a tiny random GPT-2 causal LM with its tokenizer into `folder`; returns `folder`."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = train_tokenizer(folder)
    eos = tokenizer.token_to_id(EOS)
    torch.manual_seed(SEED)
    config = GPT2Config(
        vocab_size=tokenizer.get_vocab_size(),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    model = GPT2LMHeadModel(config).eval()
    # Random init gives near-uniform logits, so greedy ties would make tests flaky; sharper
    # weights make every argmax clear.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(4.0)
    model.save_pretrained(folder)
    return folder


def tiny_llama(folder: Path) -> Path:
    """A tiny random Llama-style causal LM (rotary positions, grouped-query attention: 4 heads
    over 2 key/value heads) with the same tokenizer, written into `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer(folder)
    eos = tokenizer.token_to_id(EOS)
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=N_POSITIONS,
        bos_token_id=eos,
        eos_token_id=eos,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper logits, as for tiny_gpt2
        for parameter in model.parameters():
            parameter.mul_(4.0)
    model.save_pretrained(folder)
    return folder


@functools.cache
def _reference_model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()


def reference_greedy(folder: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers `generate` (greedy) on one prompt: the tokens generated after it (ending at
    the end-of-text token, included, or after `max_new_tokens` clamped to the context)."""
    import torch

    steps = min(max_new_tokens, N_POSITIONS - len(prompt_ids))
    with torch.no_grad():
        out = _reference_model(folder).generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


def publish_tiny(
    folder: Path, repository: Path, name: str = "tiny", precision: str = "fp32"
) -> Path:
    """Build the tiny GPT-2 in `folder` (unless there) and `sluice convert` it into
    `repository/name`; returns the version folder."""
    from converters.causal_lm import convert_causal_lm
    from converters.options import ConvertOptions
    from converters.report import Report, Steps

    if not (folder / "config.json").is_file():
        tiny_gpt2(folder)
    options = ConvertOptions(
        source=str(folder), repository=repository, name=name, precision=precision
    )
    report = convert_causal_lm(options, Steps(Report(source=str(folder))))
    assert report.status == "published", report.to_json()
    assert report.published is not None
    return Path(report.published["model_path"]).parent


def copy_tiny(built: tuple[Path, Path], root: Path) -> tuple[Path, Path]:
    """Copy the session's tiny GPT-2 (the `tiny_gpt2_built` fixture: its Hugging Face folder and
    a repository with it published as `tiny`) to root/hf and root/models, for a module to serve
    and change; returns the copies. Building and converting it again would give the same files."""
    hf, models = built
    shutil.copytree(hf, root / "hf")
    shutil.copytree(models, root / "models")
    return root / "hf", root / "models"


TOKEN_QUOTA = 50
"""A daily quota in tokens (`rate_limit.unit: tokens`) for `check_unused_tokens_are_refunded`."""


def token_quota_settings() -> dict[str, Any]:
    return {"rate_limit": {"unit": "tokens", "default": {"quota_per_day": TOKEN_QUOTA}}}


def check_unused_tokens_are_refunded(url: str, folder: Path) -> None:
    """Against a server of the tiny GPT-2 under `token_quota_settings()`: a completion charged
    prompt + max_tokens up front that stops at its first token pays prompt + 1, so a second one
    that fits only in what the first left unused is admitted, and the quota counts exactly the
    prompt and completion tokens of both. Each request on a new connection (under `--workers`
    they land on different workers)."""
    import httpx
    from tokenizers import Tokenizer

    prompt = list(range(1, 11))
    first_token = reference_greedy(folder, prompt, 1)
    stop = Tokenizer.from_file(str(folder / "tokenizer.json")).decode(first_token)
    assert stop.strip(), f"the first greedy token {first_token} has no text to stop on"
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 30, "temperature": 0, "stop": stop}
    first = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["finish_reason"] == "stop"
    used = first.json()["usage"]["total_tokens"]  # 10 + 1 of the 40 charged up front
    assert used == 11
    fits = TOKEN_QUOTA - used - len(prompt)  # 29: admitted only once 29 of the 40 came back
    body = {"model": "tiny", "prompt": prompt, "max_tokens": fits, "temperature": 0}
    second = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert second.status_code == 200, second.text
    used += second.json()["usage"]["total_tokens"]
    day = httpx.get(f"{url}/v2/tenants/self/usage", timeout=10).json()["day"]
    assert (day["used"], day["limit"]) == (used, TOKEN_QUOTA)
