"""Prefix caching: the keys and values of prompt prefixes that sequences already computed,
kept in blocks of `block_tokens` so a new prompt that starts the same way (a system prompt, a
few-shot preamble, a chat history) copies them into its slot instead of prefilling them.

A block is keyed by a hash chained over every token up to its end, so a block matches only
after the same whole prefix. Blocks live inside the model's `kv_cache_bytes`, and are the
first thing given up: a sequence that needs room evicts least recently used blocks, so the
prefix cache never keeps a sequence waiting."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from engine.generation.kv_cache import KVCacheManager, Slot


class PrefixCache:
    """Blocks of cached prompt keys/values, accounted in `cache`'s byte budget."""

    def __init__(self, cache: KVCacheManager, block_tokens: int) -> None:
        self.cache = cache
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.bytes = 0
        self.hit_tokens = 0
        """Prompt tokens taken from the cache instead of prefilled."""
        self.prompt_tokens = 0
        """Prompt tokens of every admitted sequence (the hit rate's denominator)."""

    def _keys(self, prompt: Sequence[int], blocks: int) -> list[bytes]:
        keys, digest = [], b""
        size = self.block_tokens
        for index in range(blocks):
            block = np.asarray(prompt[index * size : (index + 1) * size], np.int64)
            digest = hashlib.blake2b(digest + block.tobytes(), digest_size=16).digest()
            keys.append(digest)
        return keys

    def fill(self, prompt: Sequence[int], slot: Slot) -> int:
        """Copy the longest cached prefix of `prompt` into the empty `slot` (leaving at least
        the prompt's last token to prefill, whose logits give the first new token); returns
        the tokens copied."""
        self.prompt_tokens += len(prompt)
        usable = (len(prompt) - 1) // self.block_tokens
        copied = 0
        for key in self._keys(prompt, usable):
            block = self._blocks.get(key)
            if block is None:
                break
            self._blocks.move_to_end(key)
            slot.kv[:, :, copied : copied + self.block_tokens] = block
            copied += self.block_tokens
        slot.length = copied
        self.hit_tokens += copied
        return copied

    def store(self, prompt: Sequence[int], slot: Slot) -> None:
        """Keep the full blocks of a prefilled prompt that are not cached yet, as far as the
        budget has room without evicting anything a running sequence holds."""
        size = self.block_tokens
        for index, key in enumerate(self._keys(prompt, len(prompt) // size)):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            block = slot.kv[:, :, index * size : (index + 1) * size].copy()
            if not self.cache.take(block.nbytes):
                return
            self._blocks[key] = block
            self.bytes += block.nbytes

    def evict(self, needed_bytes: int) -> None:
        """Drop least recently used blocks until `needed_bytes` are free (or none is left)."""
        while self._blocks and self.cache.free_bytes < needed_bytes:
            _, block = self._blocks.popitem(last=False)
            self.cache.give(block.nbytes)
            self.bytes -= block.nbytes

    def clear(self) -> None:
        self.evict(self.cache.budget_bytes + 1)
