"""GenSequence's behaviour beyond its fields: when it counts as prefilled, its own sampler, and
its stream, which ends with the chunk that carries a finish reason."""

from __future__ import annotations

import asyncio

import numpy as np

from engine.errors import BackendError
from engine.generation.kv_cache import CacheLayout, KVCacheManager
from engine.generation.sampling import sampling_params
from engine.generation.sequence import Chunk, GenSequence


def sequence(prompt: list[int], temperature: float = 0, seed: int | None = None) -> GenSequence:
    return GenSequence(prompt, sampling_params(8, temperature=temperature, seed=seed), 8, None)


def test_a_sequence_is_prefilled_once_its_slot_holds_the_whole_prompt() -> None:
    cache = KVCacheManager(CacheLayout(layers=1, kv_heads=1, head_dim=2), 1 << 16)
    waiting = sequence([1, 2, 3])
    assert not waiting.prefilled  # no slot yet
    waiting.slot = cache.reserve(3 + 8)
    assert waiting.slot is not None
    seen = []
    for length in range(5):
        waiting.slot.length = length
        seen.append(waiting.prefilled)
    assert seen == [False, False, False, True, True]


def test_each_sequence_samples_with_its_own_seeded_generator() -> None:
    rng = np.random.default_rng(0)
    rows = [rng.normal(size=50).astype(np.float32) for _ in range(12)]
    alone = sequence([1], temperature=1.0, seed=7)
    solo = [alone.sampler(row) for row in rows]
    first, second = sequence([1], temperature=1.0, seed=7), sequence([2], temperature=1.0, seed=7)
    # Interleaved, as the scheduler samples the sequences of one step one after another.
    together = [(first.sampler(row), second.sampler(row)) for row in rows]
    assert [a for a, _ in together] == solo
    assert [b for _, b in together] == solo
    assert len(set(solo)) > 1  # really sampled, not argmax


async def test_the_stream_ends_with_the_chunk_that_carries_a_finish_reason() -> None:
    running = sequence([1, 2])
    failure = BackendError("generation step failed")
    sent = [Chunk([5], "a"), Chunk([6], "b"), Chunk([], "", "error", failure), Chunk([7], "c")]
    for chunk in sent:
        running.events.put_nowait(chunk)

    async def collect() -> list[Chunk]:
        return [chunk async for chunk in running.stream()]

    received = await asyncio.wait_for(collect(), 5)  # the bound only guards a hang
    assert received == sent[:3]
    assert received[-1].error is failure
    assert running.events.qsize() == 1  # what follows the finish is not read
