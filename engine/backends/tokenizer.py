"""Tokenizer backend: a Hugging Face `tokenizer.json` as a batched model step.

`encode` turns BYTES text rows into `input_ids` / `attention_mask` / `token_type_ids`, padded to
the longest row (so the next step's length buckets apply) and cut at `max_length`; `decode` turns
ids back into text. The `tokenizers` library (the `text` extra) runs in Rust, off the GIL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import BackendError, InvalidInput
from engine.step_config import TokenizerOptions
from engine.types import TensorSpec

TEXT = "text"
TOKEN_OUTPUTS = ("input_ids", "attention_mask", "token_type_ids")
TRUNCATED = "truncated"
_ROWS_BY_SEQUENCE = ("batch", "sequence")


def _load_library(label: str) -> Any:
    try:
        import tokenizers
    except ImportError as exc:
        raise BackendError(
            f"{label} has backend tokenizer, which needs the `tokenizers` library: "
            "pip install 'sluice[text]'"
        ) from exc
    return tokenizers


class TokenizerBackend:
    """One tokenizer.json; `run` is thread-safe (the tokenizer is configured once, at load)."""

    platform = "tokenizer"
    provider = "tokenizers"

    def __init__(self, path: Path, options: TokenizerOptions, label: str) -> None:
        library = _load_library(label)
        try:
            self._tokenizer = library.Tokenizer.from_file(str(path))
            # A second copy that never cuts, only to say how long a refused row is (the
            # library's settings are per object, and changing them per call is not thread-safe).
            self._measure = library.Tokenizer.from_file(str(path))
        except Exception as exc:  # the library raises a bare Exception on a bad file
            raise BackendError(f"{label}: cannot read {path.name}: {exc}") from exc
        self._options, self._label = options, label
        # The library cuts rows (keeping the post-processor's special tokens); padding is done
        # here, per request, so one long row in a batch does not widen its neighbours.
        self._tokenizer.no_padding()
        self._tokenizer.enable_truncation(max_length=options.max_length)
        self._measure.no_truncation()
        self._pad_id = self._find_pad_id(options.pad_id)
        self._vocab_size = int(self._tokenizer.get_vocab_size(with_added_tokens=True))
        ids = [TensorSpec(n, "INT64", (-1, -1), _ROWS_BY_SEQUENCE) for n in TOKEN_OUTPUTS]
        text = TensorSpec(TEXT, "BYTES", (-1,), ("batch",))
        if options.direction == "encode":
            self.inputs: tuple[TensorSpec, ...] = (text,)
            self.outputs: tuple[TensorSpec, ...] = (
                *ids,
                TensorSpec(TRUNCATED, "BOOL", (-1,), ("batch",)),
            )
        else:
            self.inputs, self.outputs = (ids[0],), (text,)

    def _find_pad_id(self, configured: int | None) -> int:
        if configured is not None:
            return configured
        padding = self._tokenizer.padding  # the file's own padding settings, if any
        if padding and padding.get("pad_id") is not None:
            return int(padding["pad_id"])
        for token in ("[PAD]", "<pad>"):
            found = self._tokenizer.token_to_id(token)
            if found is not None:
                return int(found)
        return 0

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self._options.direction == "decode":
            return {TEXT: self._decode(inputs[TOKEN_OUTPUTS[0]])}
        return self._encode(inputs[TEXT])

    def _encode(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        texts = [_text(row, index) for index, row in enumerate(rows.reshape(-1))]
        encodings = self._tokenizer.encode_batch(
            texts, add_special_tokens=self._options.add_special_tokens
        )
        truncated = np.array([bool(e.overflowing) for e in encodings], dtype=np.bool_)
        if truncated.any() and not self._options.truncation:
            row = int(np.argmax(truncated))
            encoded = self._measure.encode(
                texts[row], add_special_tokens=self._options.add_special_tokens
            )
            length = len(encoded.ids)
            raise InvalidInput(
                f"input '{TEXT}' row {row} is {length} tokens long; {self._label} takes at most "
                f"max_length {self._options.max_length} (tokenizer.truncation is false)"
            )
        width = max((len(e.ids) for e in encodings), default=0)
        ids = np.full((len(encodings), width), self._pad_id, dtype=np.int64)
        mask = np.zeros((len(encodings), width), dtype=np.int64)
        types = np.zeros((len(encodings), width), dtype=np.int64)
        for row, encoding in enumerate(encodings):
            length = len(encoding.ids)
            ids[row, :length] = encoding.ids
            mask[row, :length] = encoding.attention_mask
            types[row, :length] = encoding.type_ids
        outputs = dict(zip(TOKEN_OUTPUTS, (ids, mask, types), strict=True))
        return {**outputs, TRUNCATED: truncated}

    def finish_request(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One request's share of a batch, padded only to its own longest row: the batch was
        padded to the longest row of every request in it."""
        mask = outputs.get("attention_mask")
        if self._options.direction == "decode" or mask is None or mask.ndim != 2:
            return outputs
        width = int(mask.sum(axis=1).max(initial=0))
        if width == mask.shape[1]:
            return outputs
        return {
            name: array[:, :width] if name in TOKEN_OUTPUTS else array
            for name, array in outputs.items()
        }

    def _decode(self, ids: np.ndarray) -> np.ndarray:
        if ids.ndim != 2:
            raise InvalidInput(
                f"input '{TOKEN_OUTPUTS[0]}' of {self._label} has shape {list(ids.shape)}; "
                "it takes [rows, tokens]"
            )
        bad = (ids < 0) | (ids >= self._vocab_size)
        if bad.any():
            row, column = (int(i) for i in np.argwhere(bad)[0])
            raise InvalidInput(
                f"input '{TOKEN_OUTPUTS[0]}' row {row} holds token id {int(ids[row, column])} at "
                f"position {column}; {self._label} knows ids 0 to {self._vocab_size - 1}"
            )
        texts = self._tokenizer.decode_batch(
            ids.tolist(), skip_special_tokens=self._options.skip_special_tokens
        )
        decoded = np.empty(len(texts), dtype=object)
        decoded[:] = [text.encode("utf-8") for text in texts]
        return decoded

    def close(self) -> None:
        del self._tokenizer, self._measure


def _text(value: object, row: int) -> str:
    """One text row: bytes that must be UTF-8 (the protocol's BYTES), or a str."""
    if isinstance(value, str):
        return value
    if not isinstance(value, bytes | bytearray | memoryview):
        raise InvalidInput(f"input '{TEXT}' row {row} is {type(value).__name__}, not text bytes")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(
            f"input '{TEXT}' row {row} is not valid UTF-8 ({exc.reason} at byte {exc.start})"
        ) from exc
