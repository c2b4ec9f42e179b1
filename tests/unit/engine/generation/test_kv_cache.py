"""engine.generation.kv_cache: slots for running sequences within one byte budget."""

from __future__ import annotations

from engine.generation.kv_cache import CacheLayout, KVCacheManager

LAYOUT = CacheLayout(layers=2, kv_heads=2, head_dim=4)  # 2 x 2 x 2 x 4 floats = 128 B a token


def test_bytes_per_token_count_keys_and_values_of_every_layer() -> None:
    assert LAYOUT.bytes_per_token == 2 * 2 * 2 * 4 * 4
    assert CacheLayout(layers=2, kv_heads=2, head_dim=4, itemsize=2).bytes_per_token == 64


def test_a_slot_holds_every_layers_keys_and_values_for_its_positions() -> None:
    cache = KVCacheManager(LAYOUT, budget_bytes=128 * 100)
    slot = cache.reserve(10)
    assert slot is not None
    assert slot.kv.shape == (4, 2, 10, 4)
    assert (slot.capacity, slot.length, slot.nbytes) == (10, 0, 1280)
    assert (cache.used_bytes, cache.slot_bytes, cache.slots, cache.free_bytes) == (
        1280,
        1280,
        1,
        128 * 90,
    )


def test_a_slot_that_does_not_fit_is_none_until_bytes_come_back() -> None:
    cache = KVCacheManager(LAYOUT, budget_bytes=128 * 16)
    first = cache.reserve(10)
    assert first is not None
    assert cache.reserve(7) is None  # 17 tokens: one past the budget
    assert cache.used_bytes == 1280  # a refusal takes nothing
    cache.release(first)
    assert cache.reserve(16) is not None  # exactly the budget fits


def test_a_second_release_is_ignored() -> None:
    cache = KVCacheManager(LAYOUT, budget_bytes=128 * 16)
    slot = cache.reserve(4)
    assert slot is not None
    cache.release(slot)
    cache.release(slot)
    assert (cache.used_bytes, cache.slot_bytes, cache.slots) == (0, 0, 0)


def test_fits_ever_asks_an_empty_cache() -> None:
    cache = KVCacheManager(LAYOUT, budget_bytes=128 * 16)
    assert cache.reserve(16) is not None
    assert cache.fits_ever(16)  # not now, but once the others are gone
    assert not cache.fits_ever(17)


def test_bytes_taken_outside_slots_share_the_budget() -> None:
    cache = KVCacheManager(LAYOUT, budget_bytes=128 * 16)
    assert cache.take(128 * 10)
    assert not cache.take(128 * 7)
    assert cache.reserve(7) is None
    assert (cache.used_bytes, cache.slot_bytes) == (1280, 0)
    cache.give(128 * 10)
    assert cache.free_bytes == 128 * 16
