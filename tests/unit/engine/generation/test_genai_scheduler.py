"""Generation on onnxruntime-genai's Engine, in process: the tiny GQA Llama built by the model
builder (tests/genai_models.py) served by GenaiGenerator. Greedy tokens must be identical to
transformers `generate` from the same ids (BOS included); the Engine's steps run off the event
loop's thread; a cancelled sequence's Engine request is closed before the next one needs its
place; past the decode batch and the waiting room a sequence is refused with Overloaded."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.errors import InvalidInput, Overloaded
from engine.generation.config import GenerativeOptions
from engine.generation.genai import GenaiGenerator, is_genai_folder
from engine.generation.sampling import sampling_params
from engine.generation.sequence import GenSequence
from tests.genai_models import CONTEXT, reference_greedy
from tests.generative import SENTENCES

PROMPTS = [*SENTENCES, "the quick", "a prompt goes in and the server answers every request"]


def generator(built: tuple[Path, Path], **section: Any) -> GenaiGenerator:
    options = GenerativeOptions.model_validate(section)
    return GenaiGenerator(built[1], options if section else None, "model 'llama' version 1")


async def collect(sequence: GenSequence) -> list[int]:
    tokens: list[int] = []
    async for chunk in sequence.stream():
        tokens += chunk.tokens
    return tokens


def test_a_model_builder_folder_is_recognised(tiny_genai_built: tuple[Path, Path]) -> None:
    hf, built = tiny_genai_built
    assert is_genai_folder(built)
    assert not is_genai_folder(hf)


async def test_greedy_tokens_match_transformers_from_the_same_ids(
    tiny_genai_built: tuple[Path, Path],
) -> None:
    gen = generator(tiny_genai_built)
    try:
        ids = [await gen.prompt_ids(p) for p in PROMPTS]
        bos = gen.text.tokenizer.token_to_id("<s>")
        assert all(i[0] == bos for i in ids)  # the tokenizer's post-processor adds it
        params = sampling_params(max_tokens=40, temperature=0)
        sequences = [gen.start(i, params) for i in ids]  # all at once: batched together
        got = await asyncio.gather(*map(collect, sequences))
    finally:
        await gen.close()
    want = [reference_greedy(tiny_genai_built[0], i, 40) for i in ids]
    assert got == want
    assert gen.options.context_length == CONTEXT


class Gated:
    """onnxruntime_genai with an Engine whose steps record their thread, each wait for a
    permit of `gate` (a test opens it with `gate.release(n)`) and take `step_s` longer."""

    def __init__(self, permits: int = 1_000_000, step_s: float = 0.0) -> None:
        import onnxruntime_genai as og

        self.og = og
        self.threads: set[int] = set()
        self.gate = threading.Semaphore(permits)
        self.steps = 0
        library = self

        class Engine:
            def __init__(self, model: Any) -> None:
                self.engine = og.Engine(model)

            def __getattr__(self, name: str) -> Any:
                return getattr(self.engine, name)

            def run(self, buffer: Any) -> Any:
                library.threads.add(threading.get_ident())
                assert library.gate.acquire(timeout=30)
                library.steps += 1
                if step_s:  # a step of a real model's length, the GIL let go as the library does
                    time.sleep(step_s)
                return self.engine.run(buffer)

        self.Engine = Engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self.og, name)


async def test_engine_steps_run_off_the_loop_and_the_loop_stays_responsive(
    tiny_genai_built: tuple[Path, Path],
) -> None:
    """Steps of 5 ms (a real model's): run on the loop, each would hold it that long."""
    gen = generator(tiny_genai_built)
    library = Gated(step_s=0.005)
    gen.scheduler._og = library
    lags: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        while not done.is_set():
            before = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - before - 0.001)

    ticker = asyncio.create_task(tick())
    try:
        ids = [await gen.prompt_ids(p) for p in PROMPTS]
        params = sampling_params(max_tokens=30, temperature=0)
        got = await asyncio.gather(*(collect(gen.start(i, params)) for i in ids))
    finally:
        done.set()
        await ticker
        await gen.close()
    assert sum(map(len, got)) >= 8 * 20  # it generated while the ticker ran
    assert library.steps >= 30
    assert library.threads
    assert threading.get_ident() not in library.threads
    # The median, not the tail: a shared CI host preempts the loop now and then whatever runs.
    assert float(np.median(lags)) < 0.0025, f"median loop lag {np.median(lags)}"


async def test_a_cancelled_sequence_gives_its_place_back_at_once(
    tiny_genai_built: tuple[Path, Path],
) -> None:
    gen = generator(tiny_genai_built, max_running_sequences=1, max_waiting_sequences=1)
    scheduler, library = gen.scheduler, Gated(permits=1)
    scheduler._og = library
    try:
        ids = await gen.prompt_ids(PROMPTS[0])
        first = gen.start(ids, sampling_params(max_tokens=100, temperature=0))
        await anext(first.stream())  # its first step ran; the next waits for the gate
        gen.cancel(first)
        second = gen.start(ids, sampling_params(max_tokens=3, temperature=0))
        library.gate.release(1_000)
        assert len(await collect(second)) == 3
        # The second had the only place of the batch within a few steps: the first was closed
        # at once, not left to generate its 100 tokens there.
        assert library.steps < 10, library.steps
        assert first.finish_reason == "cancelled"
        assert len(first.generated) == 1
    finally:
        await gen.close()
    assert scheduler.live == []
    assert scheduler.engine_requests == 0


async def test_past_the_batch_and_the_waiting_room_a_sequence_is_refused(
    tiny_genai_built: tuple[Path, Path],
) -> None:
    gen = generator(tiny_genai_built, max_running_sequences=1, max_waiting_sequences=1)
    try:
        ids = await gen.prompt_ids(PROMPTS[0])
        params = sampling_params(max_tokens=50, temperature=0)
        running, waiting = gen.start(ids, params), gen.start(ids, params)
        with pytest.raises(Overloaded, match="2 sequences in flight"):
            gen.start(ids, params)
        assert await collect(running) == await collect(waiting)  # both served in turn
    finally:
        await gen.close()


async def test_queued_are_the_sequences_the_engine_has_not_given_a_token(
    tiny_genai_built: tuple[Path, Path],
) -> None:
    # What the metrics (and an inference gateway) read as running and queued. Six sequences
    # are more than the Engine decodes at once: those it holds out have had no token.
    gen = generator(tiny_genai_built, max_running_sequences=2, max_waiting_sequences=6)
    scheduler, library = gen.scheduler, Gated(permits=0)
    scheduler._og = library
    try:
        ids = await gen.prompt_ids(PROMPTS[0])
        params = sampling_params(max_tokens=40, temperature=0)
        sequences = [gen.start(ids, params) for _ in range(6)]
        assert (scheduler.running, scheduler.waiting) == ([], sequences)
        library.gate.release(4)  # too few steps for any to finish its 40 tokens
        stream = sequences[0].stream()
        for _ in range(4):  # the first sequence has a token of each of the four steps
            await anext(stream)
        running, waiting = scheduler.running, scheduler.waiting
        assert running == sequences[: len(running)]  # in arrival order
        assert waiting == sequences[len(running) :]
        assert waiting, "the Engine decoded all six at once"
        assert all(s.generated for s in running)
        assert not any(s.generated for s in waiting)
        library.gate.release(1_000)
        assert [len(await collect(s)) for s in waiting] == [40] * len(waiting)
    finally:
        await gen.close()


async def test_a_prompt_the_context_cannot_hold_is_refused_naming_it(
    tiny_genai_built: tuple[Path, Path],
) -> None:
    gen = generator(tiny_genai_built)
    try:
        with pytest.raises(InvalidInput, match=f"maximum context length is {CONTEXT} tokens"):
            gen.start(list(range(2, 2 + CONTEXT)), sampling_params(max_tokens=1))
    finally:
        await gen.close()


async def test_no_max_tokens_means_the_rest_of_the_context(
    tiny_genai_built: tuple[Path, Path],
) -> None:
    gen = generator(tiny_genai_built)
    try:
        assert gen.options.default_max_tokens == CONTEXT
        sized = generator(tiny_genai_built, default_max_tokens=5)
        assert sized.options.default_max_tokens == 5  # the config's, when it sets one
        await sized.close()
    finally:
        await gen.close()


async def test_guided_tokens_match_the_grammar_and_a_bad_grammar_is_invalid_input(
    tiny_genai_built: tuple[Path, Path],
) -> None:
    gen = generator(tiny_genai_built)
    try:
        ids = await gen.prompt_ids("the quick")
        guided = sampling_params(max_tokens=20, temperature=0, guidance=["regex", "(yes|no)!"])
        chunks = [c async for c in gen.start(ids, guided).stream()]
        bad = sampling_params(max_tokens=5, guidance=["regex", "(unclosed"])
        refused = [c async for c in gen.start(ids, bad).stream()]
        # The Engine goes on: an unguided sequence after it is served.
        after = await collect(gen.start(ids, sampling_params(max_tokens=3, temperature=0)))
    finally:
        await gen.close()
    assert "".join(c.text for c in chunks) in ("yes!", "no!")
    assert chunks[-1].finish_reason == "stop"
    assert isinstance(refused[-1].error, InvalidInput)
    assert refused[-1].error.param == "guidance"
    assert refused[-1].error.message.startswith("the guided decoding cannot compile it: ")
    assert "unclosed group" in refused[-1].error.message
    assert len(after) == 3


async def test_a_seed_with_sampling_is_refused_naming_it_and_greedy_takes_one(
    tiny_genai_built: tuple[Path, Path],
) -> None:
    # The static-batching Engine refused it in begin_turn: a BackendError, a 500.
    gen = generator(tiny_genai_built)
    try:
        ids = await gen.prompt_ids("the quick")
        with pytest.raises(InvalidInput) as caught:
            gen.start(ids, sampling_params(max_tokens=3, temperature=1.0, seed=1))
        greedy = await collect(gen.start(ids, sampling_params(max_tokens=3, temperature=0, seed=1)))
    finally:
        await gen.close()
    assert caught.value.param == "seed"
    assert "per-request seed only with dynamic batching" in caught.value.message
    assert len(greedy) == 3
