"""A served generative model: its decoder's scheduler and its text (tokenizer, chat template).
Built by engine/model.py for a model whose config.yaml has a `generative:` section."""

from __future__ import annotations

import re
from collections.abc import Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Protocol

from engine.backends.base import Backend
from engine.generation.config import GenerativeOptions
from engine.generation.context import check_prompt_chars
from engine.generation.kv_cache import CacheLayout
from engine.generation.sampling import SamplingParams
from engine.generation.scheduler import GenerationScheduler
from engine.generation.sequence import GenSequence
from engine.generation.stats import GenerationStats
from engine.generation.text import Detokenizer, ModelText

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")


def cache_layout(backend: Backend, label: str) -> CacheLayout:
    """The cache shape from the decoder's inputs (past_key_values.{i}.key: [batch, kv_heads,
    past, head_dim]); ValueError when the model does not follow the decoder contract."""
    names = {spec.name: spec for spec in backend.inputs}
    needed = {"input_ids", "attention_mask", "position_ids"}
    past = [spec for spec in backend.inputs if _PAST.match(spec.name)]
    if not needed <= set(names) or not past:
        raise ValueError(
            f"{label} has a generative: section but its model is not a decoder with a cache "
            f"(inputs {', '.join(names)}; expected input_ids, attention_mask, position_ids and "
            "past_key_values.{i}.key/value, as `sluice convert` of a causal LM writes)"
        )
    shape = past[0].shape
    if len(shape) != 4 or shape[1] <= 0 or shape[3] <= 0:
        raise ValueError(
            f"{label}: {past[0].name} has shape {list(shape)}; expected "
            "[batch, kv_heads, past, head_dim] with fixed heads and head_dim"
        )
    return CacheLayout(layers=len(past) // 2, kv_heads=shape[1], head_dim=shape[3])


class SequenceScheduler(Protocol):
    """What a generator's scheduler does for it (GenerationScheduler, or GenaiScheduler on
    onnxruntime-genai's Engine)."""

    def submit(
        self, prompt: Sequence[int], params: SamplingParams, detokenizer: Detokenizer | None = None
    ) -> GenSequence: ...
    def cancel(self, sequence: GenSequence) -> None: ...
    async def drain(self) -> None: ...
    async def close(self) -> None: ...


class TextGenerator:
    """What the front-ends call for text generation on one model version: the model's text
    (tokenizer, chat template) around a scheduler of sequences."""

    options: GenerativeOptions
    text: ModelText
    scheduler: SequenceScheduler
    guided = False
    """Whether its scheduler takes SamplingParams.guidance (guided decoding)."""

    async def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        return await self._tokens(prompt, chat=False)

    async def chat_ids(self, messages: list[dict[str, Any]], tools: object = None) -> list[int]:
        """The tokens of the chat `messages` rendered by the model's template, with `tools`
        (OpenAI's list) given to it as transformers' apply_chat_template gives them."""
        # Its contents bound the rendered prompt's work (the template adds a few tokens each).
        contents = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        most = self.text.most_chars(self.options.context_length)
        check_prompt_chars(contents, most, self.options.context_length, chat=True)
        return await self._tokens(self.text.chat_prompt(messages, tools), chat=True)

    async def _tokens(self, text: str, chat: bool) -> list[int]:
        """The tokens of `text`, refused untokenized when more than the context could ever
        hold. A prompt gets the special tokens the tokenizer adds (BOS); a chat's come from
        its template."""
        context = self.options.context_length
        check_prompt_chars(len(text), self.text.most_chars(context), context, chat)
        return await self.text.encode_async(text, special=not chat)

    def start(self, prompt: list[int], params: SamplingParams) -> GenSequence:
        """Queue a sequence; its `stream()` yields the chunks."""
        return self.scheduler.submit(prompt, params, Detokenizer(self.text, params.stop))

    def cancel(self, sequence: GenSequence) -> None:
        self.scheduler.cancel(sequence)

    async def drain(self) -> None:
        """Refuse new sequences; return once the accepted ones have finished."""
        await self.scheduler.drain()

    async def close(self) -> None:
        await self.scheduler.close()


class Generator(TextGenerator):
    """Generation on sluice's own scheduler over an ONNX Runtime decoder (`sluice convert`'s
    export of a causal LM)."""

    def __init__(
        self,
        backend: Backend,
        options: GenerativeOptions,
        folder: Path,
        executor: Executor,
        label: str,
        stats: GenerationStats | None = None,
    ) -> None:
        if options.context_length < 2:
            raise ValueError(
                f"{label}: generative.context_length must be set (2 or more) for a decoder "
                "sluice runs itself (the model's positions)"
            )
        self.options = options
        self.text = ModelText(folder)
        self.scheduler: GenerationScheduler = GenerationScheduler(
            backend.run, cache_layout(backend, label), options, executor, label, stats
        )
