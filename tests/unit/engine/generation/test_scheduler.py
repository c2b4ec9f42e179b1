"""The generation scheduler against the real tiny GPT-2, converted by `sluice convert`'s causal-LM
path and run by ONNX Runtime: continuous batching must give exactly what transformers `generate`
gives one prompt at a time."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from engine.errors import ContextLengthExceeded, InvalidInput, Overloaded, ShuttingDown
from engine.generation.sampling import sampling_params
from engine.generation.sequence import Chunk, GenSequence
from engine.model import LoadedModel, load_model
from engine.model_config import load_model_config
from engine.settings import BatchingDefaults
from tests.generative import SENTENCES, copy_tiny, publish_tiny, reference_greedy, tiny_llama


@pytest.fixture(scope="module")
def tiny(
    tmp_path_factory: pytest.TempPathFactory, tiny_gpt2_built: tuple[Path, Path]
) -> tuple[Path, Path]:
    """(the Hugging Face folder, the published version folder)."""
    folder, models = copy_tiny(tiny_gpt2_built, tmp_path_factory.mktemp("gen"))
    return folder, models / "tiny" / "1"


@pytest.fixture(scope="module")
def references(tiny: tuple[Path, Path]) -> dict[tuple[int, ...], list[int]]:
    """transformers greedy tokens (40 at most) for each prompt of `prompts()`."""
    folder, _ = tiny
    return {tuple(ids): reference_greedy(folder, ids, 40) for ids, _ in prompts(tiny)}


def prompts(tiny: tuple[Path, Path]) -> list[tuple[list[int], int]]:
    """16 prompts of different lengths, each with its own max_tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny[1] / "tokenizer.json"))
    out = []
    for i in range(16):
        text = " ".join(SENTENCES[j % len(SENTENCES)] for j in range(i % 4 + 1))
        ids = tokenizer.encode(text).ids[: 3 + (i * 5) % 30]
        out.append((ids, 5 + (i * 7) % 36))
    return out


async def load(version: Path, **generative: object) -> LoadedModel:
    config = load_model_config(version.parent)
    assert config.generative is not None
    config = config.model_copy(
        update={"generative": config.generative.model_copy(update=generative)}
    )
    return await load_model("tiny", int(version.name), version / "model.onnx", config,
                            BatchingDefaults())  # fmt: skip


@pytest.fixture
async def model(tiny: tuple[Path, Path]) -> AsyncIterator[LoadedModel]:
    loaded = await load(tiny[1], prefill_chunk_tokens=8)
    yield loaded
    await loaded.close()


async def collect(sequence: GenSequence) -> list[Chunk]:
    return [chunk async for chunk in sequence.stream()]


def expected(reference: list[int], max_tokens: int, eos: int = 0) -> tuple[list[int], str]:
    """The tokens the server sends (no end-of-text token) and the finish reason."""
    cut = reference[:max_tokens]
    if eos in cut:
        return cut[: cut.index(eos)], "stop"
    return cut, "length"


async def test_sixteen_concurrent_sequences_match_transformers(
    model: LoadedModel, tiny: tuple[Path, Path], references: dict[tuple[int, ...], list[int]]
) -> None:
    generator = model.generator
    assert generator is not None
    cases = prompts(tiny)
    sequences = []
    for index, (ids, max_tokens) in enumerate(cases):
        sequences.append(generator.start(ids, sampling_params(max_tokens, temperature=0)))
        if index % 4 == 3:
            await asyncio.sleep(0)  # later ones join a batch already decoding
    results = await asyncio.gather(*(collect(s) for s in sequences))
    assert len({len(ids) for ids, _ in cases}) >= 8  # really different lengths
    for (ids, max_tokens), chunks in zip(cases, results, strict=True):
        tokens = [t for chunk in chunks for t in chunk.tokens]
        want, reason = expected(references[tuple(ids)], max_tokens)
        assert tokens == want, (ids, max_tokens)
        assert chunks[-1].finish_reason == reason
        text = "".join(chunk.text for chunk in chunks)
        assert text == generator.text.decode(want)
    scheduler = generator.scheduler
    assert scheduler.cache.slot_bytes == 0
    assert not scheduler.running
    # Continuous batching really batched: far fewer steps than tokens.
    assert scheduler.stats.steps < sum(len(c) for c in results) / 3


async def test_llama_style_decoder_with_grouped_query_attention_matches_transformers(
    tmp_path: Path,
) -> None:
    version = publish_tiny(tiny_llama(tmp_path / "hf"), tmp_path / "models", name="llama")
    loaded = await load(version)
    try:
        generator = loaded.generator
        assert generator is not None
        assert generator.scheduler.layout.kv_heads == 2
        cases = [([5, 6, 7], 12), (list(range(10, 31)), 20), ([42], 9), ([3] * 40, 24)]
        sequences = [generator.start(ids, sampling_params(n, temperature=0)) for ids, n in cases]
        results = await asyncio.gather(*(collect(s) for s in sequences))
        for (ids, max_tokens), chunks in zip(cases, results, strict=True):
            want, reason = expected(reference_greedy(tmp_path / "hf", ids, 40), max_tokens)
            assert [t for c in chunks for t in c.tokens] == want
            assert chunks[-1].finish_reason == reason
    finally:
        await loaded.close()


async def test_a_shared_prompt_prefix_reuses_its_cache_and_still_matches(
    model: LoadedModel, tiny: tuple[Path, Path]
) -> None:
    generator = model.generator
    assert generator is not None
    prefix = generator.scheduler.prefix
    assert prefix is not None
    shared = list(range(100, 140))  # 40 tokens: two whole blocks of 16
    params = sampling_params(10, temperature=0)
    first = await collect(generator.start([*shared, 7], params))
    assert prefix.hit_tokens == 0
    assert prefix.bytes == 2 * 16 * generator.scheduler.layout.bytes_per_token
    second = generator.start([*shared, 8, 9], params)
    chunks = await collect(second)
    assert prefix.hit_tokens == 32
    for ids, got in (([*shared, 7], first), ([*shared, 8, 9], chunks)):
        want, reason = expected(reference_greedy(tiny[0], ids, 40), 10)
        assert [t for c in got for t in c.tokens] == want
        assert got[-1].finish_reason == reason
    other = await collect(generator.start([1, *shared], params))  # same tokens, shifted
    assert prefix.hit_tokens == 32
    assert other[-1].finish_reason is not None


async def test_cached_prefixes_give_way_to_a_sequence_that_needs_the_room(
    tiny: tuple[Path, Path],
) -> None:
    layout_bytes = 2 * 2 * 2 * 16 * 4  # per token: layers x (k, v) x kv_heads x head_dim x fp32
    loaded = await load(tiny[1], kv_cache_bytes=80 * layout_bytes)
    try:
        generator = loaded.generator
        assert generator is not None
        prefix = generator.scheduler.prefix
        assert prefix is not None
        await collect(generator.start(list(range(1, 41)), sampling_params(2, temperature=0)))
        assert prefix.bytes == 32 * layout_bytes  # two blocks kept after the sequence ended
        # 10 + 54 tokens fit in the 80 only once a block is gone.
        chunks = await asyncio.wait_for(
            collect(generator.start(list(range(200, 210)), sampling_params(54, temperature=0))),
            10,
        )
        assert chunks[-1].finish_reason in ("stop", "length")
        assert prefix.bytes < 32 * layout_bytes
    finally:
        await loaded.close()


async def test_drain_finishes_accepted_sequences_and_refuses_new_ones(
    model: LoadedModel,
) -> None:
    generator = model.generator
    assert generator is not None
    running = generator.start([3, 4, 5], sampling_params(30, temperature=0))
    waiting = generator.start([6, 7, 8], sampling_params(30, temperature=0))
    await asyncio.wait_for(generator.drain(), 10)
    for sequence in (running, waiting):
        assert sequence.finish_reason in ("stop", "length")
    with pytest.raises(ShuttingDown):
        generator.start([1, 2], sampling_params(3))


async def test_engine_drain_waits_for_running_generations(tiny: tuple[Path, Path]) -> None:
    from engine.engine import Engine
    from server.settings import load_settings

    engine = Engine(load_settings(model_repository=tiny[1].parent.parent, log_level="error"))
    await engine.start()
    try:
        generator = engine.registry.resolve("tiny", None).generator
        assert generator is not None
        sequence = generator.start([3, 4, 5], sampling_params(40, temperature=0))
        await engine.drain()
        assert sequence.finish_reason in ("stop", "length")
    finally:
        await engine.close()


async def test_a_generation_the_plane_let_in_is_served_while_the_engine_drains(
    tiny: tuple[Path, Path],
) -> None:
    """Draining is refused once, by the data plane (server/generating.py): the service serves
    a request the plane let in just before the drain began."""
    from engine.engine import Engine
    from engine.generation.service import GenerateRequest
    from server.settings import load_settings

    engine = Engine(load_settings(model_repository=tiny[1].parent.parent, log_level="error"))
    await engine.start()
    try:
        engine.stop_accepting()
        assert engine.generation is not None
        request = GenerateRequest("tiny", "acme", "the", options={"max_tokens": 3})
        stream = await engine.generation.generate(request)
        chunks = [chunk async for chunk in stream.chunks()]
        assert chunks[-1].finish_reason in ("stop", "length")
    finally:
        await engine.close()


async def test_nan_logits_fail_only_their_sequence() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from engine.generation.config import GenerativeOptions
    from engine.generation.kv_cache import CacheLayout
    from engine.generation.scheduler import GenerationScheduler

    layout = CacheLayout(layers=1, kv_heads=1, head_dim=2)

    def decoder(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A fake decoder at the scheduler's seam: row 0 of its first batch is NaN."""
        batch, new = feed["input_ids"].shape
        total = feed["attention_mask"].shape[1]
        logits = np.zeros((batch, new, 5), np.float32)
        logits[:, :, 2] = 1.0
        if feed["input_ids"][0, 0] == 9:
            logits[0] = np.nan
        present = np.zeros((batch, 1, total, 2), np.float32)
        return {"logits": logits, "present.0.key": present, "present.0.value": present}

    with ThreadPoolExecutor(1) as pool:
        scheduler = GenerationScheduler(
            decoder, layout, GenerativeOptions(context_length=32), pool, "fake"
        )
        broken = scheduler.submit([9, 1], sampling_params(4, temperature=1.0, seed=1))
        fine = scheduler.submit([1, 1], sampling_params(4, temperature=0))
        bad, good = await asyncio.wait_for(asyncio.gather(collect(broken), collect(fine)), 5)
        await scheduler.close()
    assert bad[-1].finish_reason == "error"
    assert bad[-1].error is not None
    assert "logits with no token" in bad[-1].error.message
    assert [t for c in good for t in c.tokens] == [2, 2, 2, 2]


async def test_prompt_past_the_context_is_invalid_and_names_both_lengths(
    model: LoadedModel,
) -> None:
    assert model.generator is not None
    with pytest.raises(InvalidInput, match=r"context length is 64 tokens.*resulted in 64") as e:
        model.generator.start([5] * 64, sampling_params(4))
    assert type(e.value) is ContextLengthExceeded  # OpenAI's code for it: what clients test


async def test_max_tokens_past_the_context_is_clamped_with_finish_reason_length(
    model: LoadedModel, tiny: tuple[Path, Path]
) -> None:
    assert model.generator is not None
    ids = [10] * 60
    chunks = await collect(model.generator.start(ids, sampling_params(1000, temperature=0)))
    tokens = [t for c in chunks for t in c.tokens]
    want, reason = expected(reference_greedy(tiny[0], ids, 4), 4)
    assert (tokens, chunks[-1].finish_reason) == (want, reason)


async def test_cancelling_a_stream_frees_its_slot_at_the_next_step(
    model: LoadedModel,
) -> None:
    generator = model.generator
    assert generator is not None
    scheduler = generator.scheduler
    sequence = generator.start([3, 4, 5], sampling_params(50, temperature=0))
    first = await sequence.events.get()
    assert first.finish_reason is None
    assert scheduler.cache.slot_bytes > 0
    generator.cancel(sequence)
    chunks = await asyncio.wait_for(collect(sequence), 5)
    assert chunks[-1].finish_reason == "cancelled"
    assert scheduler.cache.slot_bytes == 0
    assert scheduler.cache.slots == 0
    assert len(sequence.generated) < 50


async def test_a_full_cache_queues_then_admits(tiny: tuple[Path, Path]) -> None:
    # Room for exactly one sequence of 4 + 20 tokens: the second waits for the first.
    loaded = await load(tiny[1], kv_cache_bytes=24 * 2 * 2 * 2 * 16 * 4, max_waiting_sequences=1)
    try:
        generator = loaded.generator
        assert generator is not None
        params = sampling_params(20, temperature=0)
        first = generator.start([1, 2, 3, 4], params)
        await first.events.get()  # running: it holds the whole budget
        second = generator.start([5, 6, 7, 8], params)
        with pytest.raises(Overloaded, match="max_waiting_sequences 1"):
            generator.start([9, 9, 9, 9], params)
        await first.events.get()
        assert second in generator.scheduler.waiting
        assert second.slot is None
        await collect(first)
        chunks = await asyncio.wait_for(collect(second), 10)
        assert chunks[-1].finish_reason in ("stop", "length")
        assert second.slot is not None
        assert generator.scheduler.cache.slot_bytes == 0
    finally:
        await loaded.close()


@pytest.mark.parametrize("waiting", [0, 1])
async def test_sequences_submitted_together_take_a_free_place_before_counting_as_waiting(
    tiny: tuple[Path, Path], waiting: int
) -> None:
    """Sequences submitted back to back before the scheduler's next step (as when two workers'
    GENERATE frames are read together): one takes the free running place, `waiting` wait, and
    only the next is refused. The first used to count as waiting until that step, so the
    second got a 503 from an idle model (and with max_waiting_sequences 0, the first did)."""
    loaded = await load(tiny[1], max_running_sequences=1, max_waiting_sequences=waiting)
    try:
        generator = loaded.generator
        assert generator is not None
        params = sampling_params(8, temperature=0)
        # No await in between: no step has run.
        started = [generator.start([1 + i, 2, 3], params) for i in range(waiting + 1)]
        with pytest.raises(Overloaded, match=f"max_waiting_sequences {waiting}"):
            generator.start([7, 8, 9], params)
        for sequence in started:
            chunks = await asyncio.wait_for(collect(sequence), 10)
            assert chunks[-1].finish_reason in ("stop", "length")
    finally:
        await loaded.close()


async def test_a_long_prompt_does_not_stall_running_streams(model: LoadedModel) -> None:
    generator = model.generator
    assert generator is not None
    running = generator.start([7, 8], sampling_params(40, temperature=0))
    await running.events.get()
    before = len(running.generated)
    steps = generator.scheduler.stats.steps
    # 56 prompt tokens at 8 per step: the running stream gets a token each of those 7 steps.
    long = generator.start(list(range(1, 57)), sampling_params(2, temperature=0))
    await collect(long)
    grew = len(running.generated) - before
    assert grew >= 6 or running.finish_reason is not None
    assert generator.scheduler.stats.steps - steps >= 7
    generator.cancel(running)


async def test_seeded_sampling_repeats_and_differs_from_another_seed(model: LoadedModel) -> None:
    generator = model.generator
    assert generator is not None

    async def run(seed: int) -> list[int]:
        params = sampling_params(12, temperature=1.5, top_k=50, top_p=0.95, seed=seed)
        chunks = await collect(generator.start([3, 4, 5], params))
        return [t for c in chunks for t in c.tokens]

    first, again, other = await asyncio.gather(run(1), run(1), run(2))
    assert first == again
    assert first != other


async def test_stop_string_ends_the_completion_before_it(
    model: LoadedModel, tiny: tuple[Path, Path]
) -> None:
    generator = model.generator
    assert generator is not None
    ids = await generator.prompt_ids("the quick brown")
    full = [t for c in await collect(generator.start(ids, sampling_params(30, temperature=0)))
            for t in c.tokens]  # fmt: skip
    text = generator.text.decode(full)
    stop = text[5:7]
    assert stop
    assert text.find(stop) == 5
    chunks = await collect(generator.start(ids, sampling_params(30, temperature=0, stop=stop)))
    assert "".join(c.text for c in chunks) == text[:5]
    assert chunks[-1].finish_reason == "stop"
