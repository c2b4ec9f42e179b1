"""Text around the token stream: the model's tokenizer and chat template, and incremental
detokenization with stop strings.

Text is released only when it is final: a token that ends inside a multi-byte character
(byte-level BPE splits them) decodes to U+FFFD until its next token arrives, and text that could
still become a stop string is held back until it cannot; a stop string itself never reaches the
client."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from engine.errors import InvalidInput

REPLACEMENT = "\ufffd"
OFF_LOOP_CHARS = 16 * 1024
"""Text longer than this is tokenized in a worker thread, by the tokenizer's batch call, which
lets go of the GIL (its one-text call holds it: a 2 MB prompt held the event loop 1 s)."""
WORD_CHARS = 100
"""The fewest characters a token is taken to stand for at most in `ModelText.most_chars`: an
unknown-word token may stand for a whole word (WordPiece's, up to 100 characters)."""


class ModelText:
    """A generative model's tokenizer.json and its chat template (tokenizer_config.json's
    chat_template, else chat_template.jinja beside it)."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            loaded = json.loads(config_path.read_text())
            config = loaded if isinstance(loaded, dict) else {}
        template = config.get("chat_template")
        jinja = folder / "chat_template.jinja"  # where transformers 5 writes it
        if not isinstance(template, str) and jinja.is_file():
            template = jinja.read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.special = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token")}
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        self._token_chars = max(WORD_CHARS, *map(len, vocab))

    def most_chars(self, tokens: int) -> int:
        """More characters than any text of `tokens` tokens has: `tokens` times the longest
        token's text (at least WORD_CHARS), twice over (a normalizer may fold two characters
        into one)."""
        return 2 * tokens * self._token_chars

    def encode(self, text: str, special: bool = False) -> list[int]:
        """The ids of `text`; `special`: with the special tokens the tokenizer's post-processor
        adds (a Llama's BOS), as transformers encodes a prompt. A chat prompt is encoded
        without: its template writes them, as transformers' apply_chat_template does."""
        return list(self.tokenizer.encode(text, add_special_tokens=special).ids)

    async def encode_async(self, text: str, special: bool = False) -> list[int]:
        """`encode(text, special)`, off the event loop past OFF_LOOP_CHARS."""
        if len(text) <= OFF_LOOP_CHARS:
            return self.encode(text, special)
        batch = self.tokenizer.encode_batch
        encoded = await asyncio.to_thread(batch, [text], add_special_tokens=special)
        return list(encoded[0].ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def chat_prompt(self, messages: list[dict[str, Any]], tools: object = None) -> str:
        """The prompt the model's chat template makes of `messages` (sandboxed Jinja), with
        `tools` when given (templates test `tools is not none`, as transformers passes it)."""
        if self.chat_template is None:
            raise InvalidInput(
                "this model has no chat template (tokenizer_config.json chat_template or "
                "chat_template.jinja); "
                "use /v1/completions"
            )
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise  # Hugging Face templates refuse input so
        try:
            template = env.from_string(self.chat_template)
            return template.render(
                messages=messages,
                add_generation_prompt=True,
                tools=tools,
                **{k: v for k, v in self.special.items() if v is not None},
            )
        except TemplateError as exc:
            raise InvalidInput(
                f"the chat template cannot render these messages: {exc}", "messages"
            ) from exc


def _raise(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


PENDING_TOKENS = 8
"""Tokens whose text may stay unfinished (ending in U+FFFD) before it is released as it is: a
character takes at most 4 bytes, so a longer run is a model writing bytes that are not UTF-8,
and waiting on would make each step decode the whole run again."""


class Detokenizer:
    """Turns a sequence's tokens into text deltas and finds its stop strings.

    A token's text is decoded from a window of the last few tokens, not from the whole sequence
    (a step then cost the sequence's length: 8,000 tokens, 3.2 s of the event loop): the
    tokens since the text was last final, after the ones before them for context (a tokenizer
    may decode a token differently at the start of a text: SentencePiece drops a leading
    space), as vLLM and TGI detokenize. Only the text still held back for a stop string is
    kept."""

    def __init__(self, text: ModelText, stop: tuple[str, ...]) -> None:
        self._text = text
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix = 0  # the window's first token: context for the tokens from `_read` on
        self._read = 0  # tokens whose text is final
        self._held = ""  # final text not released yet: it could still begin a stop string
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; return the text that became final (possibly empty). After a stop
        string is found, `stopped` is set and the text before it is the last delta."""
        self._ids.append(token)
        new = self._new_text()
        if new.endswith(REPLACEMENT) and len(self._ids) - self._read < PENDING_TOKENS:
            return ""  # a character split across tokens: wait for the rest
        if new.endswith(REPLACEMENT):  # not UTF-8: released as decoded, with no context after
            self._prefix = len(self._ids)
        else:
            self._prefix = self._read
        self._read = len(self._ids)
        held = self._held + new
        # The earliest stop wins: two can complete in one token, in either order of the list.
        # None begins in text already released: that much is held back.
        found = [at for at in (held.find(stop) for stop in self._stop) if at != -1]
        if found:
            self.stopped = True
            self._held = ""
            return held[: min(found)]
        cut = max(0, len(held) - self._hold)
        self._held = held[cut:]
        return held[:cut]

    def flush(self) -> str:
        """The held-back text at the end of a sequence that ended without a stop string."""
        if self.stopped:
            return ""
        held, self._held = self._held + self._new_text(), ""
        self._prefix = self._read = len(self._ids)
        return held

    def _new_text(self) -> str:
        """The text of the tokens from `_read` on."""
        ids, prefix, read = self._ids, self._prefix, self._read
        before = self._text.decode(ids[prefix:read]) if read > prefix else ""
        return self._text.decode(ids[prefix:])[len(before) :]
