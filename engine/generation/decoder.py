"""One scheduler step's decoder runs, in a worker thread: the prefill chunks as one batch and the
decode batch as another, each row fed after the keys/values cached in its sequence's slot
(padded to the longest with attention_mask zeros over the padding, each at its own position)
and its new keys/values written back into the slot.

The decoder contract is converters/hf_decoder.py's (past key/values in, present out)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.generation.kv_cache import CacheLayout, Slot
from engine.generation.sequence import GenSequence

RunDecoder = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


class SlotDecoder:
    """Runs a generative model's decoder over its sequences' cache slots."""

    def __init__(self, run: RunDecoder, layout: CacheLayout) -> None:
        self._run = run
        self.layout = layout
        self._past_names = [
            f"past_key_values.{i}.{kv}" for i in range(layout.layers) for kv in ("key", "value")
        ]
        self._present_names = [
            f"present.{i}.{kv}" for i in range(layout.layers) for kv in ("key", "value")
        ]

    def step(
        self, prefill: list[tuple[GenSequence, int]], decode: list[GenSequence]
    ) -> list[tuple[GenSequence, np.ndarray]]:
        """Run the prefill chunks (one batch) and the decode batch; the logits of every
        sequence that has a next token to sample (a prefill that reached the prompt's end,
        every decode)."""
        rows = []
        if prefill:
            slots = [s.slot for s, _ in prefill if s.slot is not None]
            chunks = [
                s.prompt[slot.length : slot.length + n]
                for (s, n), slot in zip(prefill, slots, strict=True)
            ]
            logits = self._forward(slots, chunks)
            for (sequence, _), row in zip(prefill, logits, strict=True):
                if sequence.prefilled:
                    rows.append((sequence, row))
        if decode:
            slots = [s.slot for s in decode if s.slot is not None]
            logits = self._forward(slots, [[s.generated[-1]] for s in decode])
            rows += list(zip(decode, logits, strict=True))
        return rows

    def _forward(self, slots: list[Slot], ids: list[list[int]]) -> np.ndarray:
        """One decoder run: row b feeds `ids[b]` after the `slots[b].length` positions cached
        in its slot. Rows are padded to the longest past (on the left of the new tokens) and
        the longest `ids` (on the right), attention_mask hiding both paddings; each row keeps
        its own positions. Writes the new keys/values into the slots; returns each row's
        logits at its last real token."""
        starts = [slot.length for slot in slots]
        lengths = [len(row) for row in ids]
        batch, new, past = len(slots), max(lengths), max(starts)
        mask = np.zeros((batch, past + new), np.int64)
        tokens = np.zeros((batch, new), np.int64)
        positions = np.zeros((batch, new), np.int64)
        for b, (start, length, row) in enumerate(zip(starts, lengths, ids, strict=True)):
            mask[b, :start] = 1
            mask[b, past : past + length] = 1
            tokens[b, :length] = row
            # Padding takes a real position (its outputs are discarded): never past the table.
            positions[b] = start + np.minimum(np.arange(new), length - 1)
        feed: dict[str, np.ndarray] = {
            "input_ids": tokens,
            "attention_mask": mask,
            "position_ids": positions,
        }
        layout = self.layout
        for j, name in enumerate(self._past_names):
            tensor = np.zeros((batch, layout.kv_heads, past, layout.head_dim), np.float32)
            for b, (slot, start) in enumerate(zip(slots, starts, strict=True)):
                tensor[b, :, :start] = slot.kv[j, :, :start]
            feed[name] = tensor
        outputs = self._run(feed)
        for j, name in enumerate(self._present_names):
            present = outputs[name]
            for b, (slot, start, length) in enumerate(zip(slots, starts, lengths, strict=True)):
                slot.kv[j, :, start : start + length] = present[b, :, past : past + length]
        for slot, length in zip(slots, lengths, strict=True):
            slot.length += length
        logits = outputs["logits"]
        return np.stack([logits[b, length - 1] for b, length in enumerate(lengths)])
