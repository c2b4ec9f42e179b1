"""engine.generation.prefix_cache: prompt prefixes' keys and values kept in blocks, matched
only after the same whole prefix, evicted first when a sequence needs room."""

from __future__ import annotations

import numpy as np

from engine.generation.kv_cache import CacheLayout, KVCacheManager, Slot
from engine.generation.prefix_cache import PrefixCache

LAYOUT = CacheLayout(layers=1, kv_heads=1, head_dim=2)  # 16 B a token
BLOCK = 4


def _prefilled(cache: KVCacheManager, prompt: list[int]) -> Slot:
    """A slot as a prefill leaves it: position i of every tensor holds the prompt's token i."""
    slot = cache.reserve(len(prompt) + 4)
    assert slot is not None
    slot.kv[:, :, : len(prompt)] = np.asarray(prompt, np.float32)[None, None, :, None]
    slot.length = len(prompt)
    return slot


def _filled(prefixes: PrefixCache, cache: KVCacheManager, prompt: list[int]) -> tuple[int, Slot]:
    slot = cache.reserve(len(prompt) + 4)
    assert slot is not None
    slot.kv[:] = -1
    return prefixes.fill(prompt, slot), slot


def test_a_prompt_that_starts_the_same_way_copies_the_cached_blocks() -> None:
    cache = KVCacheManager(LAYOUT, budget_bytes=16 * 1000)
    prefixes = PrefixCache(cache, BLOCK)
    first = list(range(10))
    prefixes.store(first, _prefilled(cache, first))  # two full blocks kept
    assert prefixes.bytes == 2 * BLOCK * 16
    copied, slot = _filled(prefixes, cache, [*range(8), 99, 98, 97])
    assert copied == 8
    assert slot.length == 8
    assert slot.kv[0, 0, :8, 0].tolist() == list(range(8))
    assert slot.kv[0, 0, 8, 0] == -1  # the rest is left to prefill
    assert (prefixes.hit_tokens, prefixes.prompt_tokens) == (8, 11)


def test_the_last_prompt_token_is_always_prefilled() -> None:
    cache = KVCacheManager(LAYOUT, budget_bytes=16 * 1000)
    prefixes = PrefixCache(cache, BLOCK)
    prompt = list(range(8))
    prefixes.store(prompt, _prefilled(cache, prompt))
    copied, _ = _filled(prefixes, cache, prompt)  # the same 8 tokens: its logits are needed
    assert copied == 4


def test_a_block_matches_only_after_the_same_whole_prefix() -> None:
    cache = KVCacheManager(LAYOUT, budget_bytes=16 * 1000)
    prefixes = PrefixCache(cache, BLOCK)
    prompt = list(range(12))
    prefixes.store(prompt, _prefilled(cache, prompt))
    # Its second block, after another first block: no match at all.
    copied, _ = _filled(prefixes, cache, [50, 51, 52, 53, 4, 5, 6, 7, 8])
    assert copied == 0
    # Its second block's tokens at the start of a prompt: computed after other tokens, its keys
    # and values are not this prompt's.
    copied, _ = _filled(prefixes, cache, [4, 5, 6, 7, 9, 9, 9])
    assert copied == 0


def test_blocks_fit_in_the_budget_without_taking_a_sequences_room() -> None:
    cache = KVCacheManager(LAYOUT, budget_bytes=16 * 20)
    prefixes = PrefixCache(cache, BLOCK)
    prompt = list(range(12))
    slot = _prefilled(cache, prompt)  # 16 positions of the 20
    prefixes.store(prompt, slot)  # room for one block of 4 only
    assert prefixes.bytes == BLOCK * 16
    assert cache.free_bytes == 0


def test_eviction_gives_up_least_recently_used_blocks_first() -> None:
    cache = KVCacheManager(LAYOUT, budget_bytes=16 * 1000)
    prefixes = PrefixCache(cache, BLOCK)
    a, b = [1, 2, 3, 4, 0], [5, 6, 7, 8, 0]
    prefixes.store(a, _prefilled(cache, a))
    prefixes.store(b, _prefilled(cache, b))
    _filled(prefixes, cache, a)  # a used last
    free = cache.free_bytes
    prefixes.evict(free + BLOCK * 16)  # room for one more block: one goes
    assert prefixes.bytes == BLOCK * 16
    assert _filled(prefixes, cache, a)[0] == 4
    assert _filled(prefixes, cache, b)[0] == 0
    prefixes.clear()
    assert prefixes.bytes == 0
    assert _filled(prefixes, cache, a)[0] == 0
