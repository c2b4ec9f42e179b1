"""engine.generation.emit: what both schedulers do with each token a step gives a sequence, and
when a sequence ends (statistics, end-of-text, stop strings, max_tokens, the stream's chunks)."""

from __future__ import annotations

import asyncio

from engine.errors import BackendError
from engine.generation.config import GenerativeOptions
from engine.generation.emit import TokenSink
from engine.generation.sampling import SamplingParams
from engine.generation.sequence import Chunk, GenSequence
from engine.generation.stats import GenerationStats

EOS = 2


class Sink(TokenSink):
    """A scheduler's token sink that records what each finished sequence gives back."""

    def __init__(self) -> None:
        self.stats = GenerationStats()
        self.options = GenerativeOptions(eos_token_ids=[EOS])
        self._idle = asyncio.Event()
        self.released: list[GenSequence] = []

    def _release(self, sequence: GenSequence) -> None:
        self.released.append(sequence)


class StopAt:
    """A detokenizer whose text for token t is f"<t>", stopping at `stop_token`."""

    def __init__(self, stop_token: int) -> None:
        self.stop_token = stop_token
        self.stopped = False

    def push(self, token: int) -> str:
        if token == self.stop_token:
            self.stopped = True
            return ""
        return f"<{token}>"

    def flush(self) -> str:
        return "|end"


def _sequence(max_tokens: int = 8, detokenizer: object = None) -> GenSequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return GenSequence([5, 6], params, max_tokens, detokenizer, arrived=10.0)  # type: ignore[arg-type]


def _chunks(sequence: GenSequence) -> list[Chunk]:
    chunks = []
    while not sequence.events.empty():
        chunks.append(sequence.events.get_nowait())
    return chunks


async def test_tokens_become_chunks_and_are_timed() -> None:
    sink, sequence = Sink(), _sequence()
    sink._emit(sequence, 7, now=10.5)
    sink._emit(sequence, 8, now=10.75)
    assert [(c.tokens, c.text, c.finish_reason) for c in _chunks(sequence)] == [
        ([7], "", None),
        ([8], "", None),
    ]
    assert sequence.generated == [7, 8]
    assert sink.stats.generated_tokens == 2
    assert list(sink.stats.time_to_first_token_s) == [0.5]
    assert list(sink.stats.inter_token_s) == [0.25]


async def test_end_of_text_finishes_with_stop_and_is_not_part_of_the_text() -> None:
    sink, sequence = Sink(), _sequence()
    sink._emit(sequence, 7, now=10.1)
    sink._emit(sequence, EOS, now=10.2)
    assert [(c.tokens, c.finish_reason) for c in _chunks(sequence)] == [([7], None), ([], "stop")]
    assert sequence.generated == [7]
    assert sink.released == [sequence]
    assert sink._idle.is_set()


async def test_max_tokens_finishes_with_length_on_the_last_token() -> None:
    sink, sequence = Sink(), _sequence(max_tokens=2)
    for token, now in ((7, 10.1), (8, 10.2), (9, 10.3)):
        sink._emit(sequence, token, now)
    assert [(c.tokens, c.finish_reason) for c in _chunks(sequence)] == [
        ([7], None),
        ([8], "length"),
    ]
    assert sink.stats.generated_tokens == 2  # nothing counted after the finish


async def test_a_stop_string_finishes_with_the_text_before_it_and_the_flush() -> None:
    sink, sequence = Sink(), _sequence(detokenizer=StopAt(9))
    sink._emit(sequence, 7, now=10.1)
    sink._emit(sequence, 9, now=10.2)
    assert [(c.tokens, c.text, c.finish_reason) for c in _chunks(sequence)] == [
        ([7], "<7>", None),
        ([9], "|end", "stop"),
    ]


async def test_a_sequence_finishes_once() -> None:
    sink, sequence = Sink(), _sequence()
    error = BackendError("decoder step failed")
    sink._finish(sequence, "error", error)
    sink._finish(sequence, "cancelled")
    (chunk,) = _chunks(sequence)
    assert (chunk.finish_reason, chunk.error) == ("error", error)
    assert sink.released == [sequence]
    assert sum(sink.stats.e2e.counts) == 1
