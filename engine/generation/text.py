"""Text around the token stream: the model's tokenizer and chat template, and incremental
detokenization with stop strings.

Text is released only when it is final: a token that ends inside a multi-byte character
(byte-level BPE splits them) decodes to U+FFFD until its next token arrives, and text that could
still become a stop string is held back until it cannot; a stop string itself never reaches the
client."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.errors import InvalidInput

REPLACEMENT = "\ufffd"


class ModelText:
    """A generative model's tokenizer.json and tokenizer_config.json (chat template)."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            loaded = json.loads(config_path.read_text())
            config = loaded if isinstance(loaded, dict) else {}
        template = config.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.special = {key: _token_text(config.get(key)) for key in ("bos_token", "eos_token")}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def chat_prompt(self, messages: list[dict[str, Any]]) -> str:
        """The prompt the model's chat template makes of `messages` (sandboxed Jinja)."""
        if self.chat_template is None:
            raise InvalidInput(
                "this model has no chat template (tokenizer_config.json chat_template); "
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


class Detokenizer:
    """Turns a sequence's tokens into text deltas and finds its stop strings."""

    def __init__(self, text: ModelText, stop: tuple[str, ...]) -> None:
        self._text = text
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self._sent = 0  # characters of the decoded text already released
        self.stopped = False

    def push(self, token: int) -> str:
        """Add a token; return the text that became final (possibly empty). After a stop
        string is found, `stopped` is set and the text before it is the last delta."""
        self._ids.append(token)
        decoded = self._text.decode(self._ids)
        if decoded.endswith(REPLACEMENT):
            return ""  # a character split across tokens: wait for the rest
        # The earliest stop wins: two can complete in one token, in either order of the list.
        found = [decoded.find(stop, max(0, self._sent - len(stop) + 1)) for stop in self._stop]
        found = [at for at in found if at != -1]
        if found:
            self.stopped = True
            return self._release(decoded[: min(found)])
        return self._release(decoded[: max(self._sent, len(decoded) - self._hold)])

    def flush(self) -> str:
        """The held-back text at the end of a sequence that ended without a stop string."""
        if self.stopped:
            return ""
        return self._release(self._text.decode(self._ids))

    def _release(self, upto: str) -> str:
        delta = upto[self._sent :]
        self._sent = max(self._sent, len(upto))
        return delta
