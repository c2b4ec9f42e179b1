"""SlotDecoder against a fake decoder at its seam (a `RunDecoder`: feed in, logits and presents
out) and real cache slots from KVCacheManager: the feed it builds for rows of different cached
lengths (tokens, positions, attention mask, pasts) and where the presents land.

The fake computes each new position's keys/values from the token and position it was fed, as a
real decoder does, and returns past + new as ONNX Runtime's presents are; so a slot whose every
position p holds `kv(token p, p)` was fed and written back right."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from engine.generation.decoder import SlotDecoder
from engine.generation.kv_cache import CacheLayout, KVCacheManager
from engine.generation.sampling import sampling_params
from engine.generation.sequence import GenSequence

LAYOUT = CacheLayout(layers=2, kv_heads=2, head_dim=3)
TENSORS = 2 * LAYOUT.layers  # (key, value) per layer, in the slot's and the feed's order
PASTS = [f"past_key_values.{i}.{kv}" for i in range(LAYOUT.layers) for kv in ("key", "value")]
PRESENTS = [f"present.{i}.{kv}" for i in range(LAYOUT.layers) for kv in ("key", "value")]
UNWRITTEN = -1.0  # what a slot holds where nothing was cached (kv() is never negative)


def kv(token: int, position: int, tensor: int) -> np.ndarray:
    """The fake decoder's keys (or values) of `token` at `position` for `tensor`:
    [kv_heads, head_dim], distinct for every argument."""
    cell = np.arange(LAYOUT.kv_heads * LAYOUT.head_dim, dtype=np.float32)
    cell = cell.reshape(LAYOUT.kv_heads, LAYOUT.head_dim)
    return cell + 8 * (tensor + TENSORS * (position + 64 * token))


def logits_of(token: int, position: int) -> np.ndarray:
    """The fake decoder's logits for `token` fed at `position`."""
    return np.array([token, position], np.float32)


class FakeDecoder:
    """A RunDecoder that records each feed it is given."""

    def __init__(self) -> None:
        self.feeds: list[dict[str, np.ndarray]] = []

    def __call__(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.feeds.append({name: array.copy() for name, array in feed.items()})
        tokens, positions = feed["input_ids"], feed["position_ids"]
        batch, new = tokens.shape
        logits = np.zeros((batch, new, 2), np.float32)
        outputs = {}
        for j, (past, present) in enumerate(zip(PASTS, PRESENTS, strict=True)):
            fresh = np.zeros((batch, LAYOUT.kv_heads, new, LAYOUT.head_dim), np.float32)
            for b in range(batch):
                for t in range(new):
                    fresh[b, :, t] = kv(int(tokens[b, t]), int(positions[b, t]), j)
                    logits[b, t] = logits_of(int(tokens[b, t]), int(positions[b, t]))
            outputs[present] = np.concatenate([feed[past], fresh], axis=2)
        outputs["logits"] = logits
        return outputs


@pytest.fixture
def fake() -> FakeDecoder:
    return FakeDecoder()


@pytest.fixture
def decoder(fake: FakeDecoder) -> SlotDecoder:
    return SlotDecoder(fake, LAYOUT)


@pytest.fixture
def cache() -> KVCacheManager:
    return KVCacheManager(LAYOUT, 100 * LAYOUT.bytes_per_token)


def admitted(
    cache: KVCacheManager, prompt: list[int], cached: int, generated: Sequence[int] = ()
) -> GenSequence:
    """A running sequence as the scheduler holds it: a slot for its prompt and 10 completion
    tokens whose first `cached` positions hold the keys/values of its tokens (as a prefix-cache
    hit or earlier steps leave them), the rest never written."""
    sequence = GenSequence(prompt, sampling_params(10, temperature=0), 10, None)
    sequence.generated = list(generated)
    slot = cache.reserve(len(prompt) + 10)
    assert slot is not None
    slot.kv[:] = UNWRITTEN
    for position, token in enumerate([*prompt, *generated][:cached]):
        for j in range(TENSORS):
            slot.kv[j, :, position] = kv(token, position, j)
    slot.length = cached
    sequence.slot = slot
    return sequence


def decoding(cache: KVCacheManager, prompt: list[int], generated: list[int]) -> GenSequence:
    """A prefilled sequence with `generated` tokens sampled; the last is not cached yet."""
    return admitted(cache, prompt, len(prompt) + len(generated) - 1, generated)


def assert_cached(sequence: GenSequence) -> None:
    """The slot holds kv(token p, p) at every position p below its length, and nothing past."""
    slot = sequence.slot
    assert slot is not None
    tokens = [*sequence.prompt, *sequence.generated][: slot.length]
    assert len(tokens) == slot.length
    for j in range(TENSORS):
        for position, token in enumerate(tokens):
            np.testing.assert_array_equal(slot.kv[j, :, position], kv(token, position, j))
    assert (slot.kv[:, :, slot.length :] == UNWRITTEN).all()


# -- decode: one new token per row, after pasts of different lengths ------------------------------


def test_decode_feeds_each_row_its_last_token_at_its_own_position(
    decoder: SlotDecoder, fake: FakeDecoder, cache: KVCacheManager
) -> None:
    rows = [
        decoding(cache, [11, 12], [13]),  # 2 cached
        decoding(cache, [21, 22, 23, 24], [25, 26]),  # 5 cached
        decoding(cache, [31, 32, 33], [34]),  # 3 cached
    ]
    decoder.step([], rows)
    (feed,) = fake.feeds
    np.testing.assert_array_equal(feed["input_ids"], [[13], [26], [34]])
    np.testing.assert_array_equal(feed["position_ids"], [[2], [5], [3]])


def test_decode_pads_each_past_to_the_longest_with_mask_zeros_before_the_new_token(
    decoder: SlotDecoder, fake: FakeDecoder, cache: KVCacheManager
) -> None:
    rows = [
        decoding(cache, [11, 12], [13]),
        decoding(cache, [21, 22, 23, 24], [25, 26]),
        decoding(cache, [31, 32, 33], [34]),
    ]
    pasts = [[11, 12], [21, 22, 23, 24, 25], [31, 32, 33]]
    decoder.step([], rows)
    (feed,) = fake.feeds
    np.testing.assert_array_equal(
        feed["attention_mask"],
        [
            [1, 1, 0, 0, 0, 1],
            [1, 1, 1, 1, 1, 1],
            [1, 1, 1, 0, 0, 1],
        ],
    )
    assert set(feed) == {"input_ids", "attention_mask", "position_ids", *PASTS}
    for j, name in enumerate(PASTS):
        past = feed[name]
        assert past.shape == (3, LAYOUT.kv_heads, 5, LAYOUT.head_dim)
        assert past.dtype == np.float32
        for b, tokens in enumerate(pasts):
            for position, token in enumerate(tokens):
                np.testing.assert_array_equal(past[b, :, position], kv(token, position, j))
            assert (past[b, :, len(tokens) :] == 0).all()  # padding, not the slot's unwritten


def test_decode_writes_each_rows_new_keys_and_values_into_its_slot_after_its_past(
    decoder: SlotDecoder, cache: KVCacheManager
) -> None:
    rows = [
        decoding(cache, [11, 12], [13]),
        decoding(cache, [21, 22, 23, 24], [25, 26]),
        decoding(cache, [31, 32, 33], [34]),
    ]
    decoder.step([], rows)
    assert [s.slot.length for s in rows if s.slot is not None] == [3, 6, 4]
    for sequence in rows:
        assert_cached(sequence)


def test_decode_returns_every_rows_logits_at_its_token(
    decoder: SlotDecoder, cache: KVCacheManager
) -> None:
    rows = [decoding(cache, [11, 12], [13]), decoding(cache, [21, 22, 23, 24], [25, 26])]
    result = decoder.step([], rows)
    assert [sequence for sequence, _ in result] == rows
    np.testing.assert_array_equal(result[0][1], logits_of(13, 2))
    np.testing.assert_array_equal(result[1][1], logits_of(26, 5))


# -- prefill: chunks of different lengths, some after a cached prefix ------------------------------


@pytest.fixture
def chunks(cache: KVCacheManager) -> list[tuple[GenSequence, int]]:
    """A fresh 7-token prompt prefilling 4, and a 5-token one with 3 cached prefilling its last
    2: past 3, new 4."""
    return [
        (admitted(cache, [41, 42, 43, 44, 45, 46, 47], cached=0), 4),
        (admitted(cache, [51, 52, 53, 54, 55], cached=3), 2),
    ]


def test_prefill_pads_shorter_chunks_on_the_right_at_real_positions(
    decoder: SlotDecoder, fake: FakeDecoder, chunks: list[tuple[GenSequence, int]]
) -> None:
    decoder.step(chunks, [])
    (feed,) = fake.feeds
    np.testing.assert_array_equal(feed["input_ids"], [[41, 42, 43, 44], [54, 55, 0, 0]])
    # The padding repeats the row's last real position (never past the position table).
    np.testing.assert_array_equal(feed["position_ids"], [[0, 1, 2, 3], [3, 4, 4, 4]])
    np.testing.assert_array_equal(
        feed["attention_mask"],
        [
            [0, 0, 0, 1, 1, 1, 1],
            [1, 1, 1, 1, 1, 0, 0],
        ],
    )
    for j, name in enumerate(PASTS):
        past = feed[name]
        assert past.shape == (2, LAYOUT.kv_heads, 3, LAYOUT.head_dim)
        assert (past[0] == 0).all()
        for position, token in enumerate([51, 52, 53]):
            np.testing.assert_array_equal(past[1, :, position], kv(token, position, j))


def test_prefill_writes_only_each_chunks_real_tokens_into_its_slot(
    decoder: SlotDecoder, chunks: list[tuple[GenSequence, int]]
) -> None:
    decoder.step(chunks, [])
    assert [s.slot.length for s, _ in chunks if s.slot is not None] == [4, 5]
    for sequence, _ in chunks:
        assert_cached(sequence)  # the second row's padding left its slot unwritten past 5


def test_prefill_returns_logits_only_for_prompts_it_finished(
    decoder: SlotDecoder, chunks: list[tuple[GenSequence, int]]
) -> None:
    result = decoder.step(chunks, [])
    assert [sequence for sequence, _ in result] == [chunks[1][0]]
    np.testing.assert_array_equal(result[0][1], logits_of(55, 4))  # its last real token


# -- steps as the scheduler runs them ---------------------------------------------------------


def test_one_step_runs_prefill_then_decode_as_two_batches(
    decoder: SlotDecoder, fake: FakeDecoder, cache: KVCacheManager
) -> None:
    prefilling = admitted(cache, [61, 62, 63], cached=0)
    running = decoding(cache, [71, 72], [73])
    result = decoder.step([(prefilling, 3)], [running])
    assert [feed["input_ids"].tolist() for feed in fake.feeds] == [[[61, 62, 63]], [[73]]]
    assert [sequence for sequence, _ in result] == [prefilling, running]
    np.testing.assert_array_equal(result[0][1], logits_of(63, 2))
    np.testing.assert_array_equal(result[1][1], logits_of(73, 2))
    assert_cached(prefilling)
    assert_cached(running)


def test_a_prompt_prefilled_in_chunks_then_decoded_caches_every_token_at_its_position(
    decoder: SlotDecoder, cache: KVCacheManager
) -> None:
    long = admitted(cache, list(range(80, 88)), cached=0)  # 8 tokens in chunks of 3
    short = admitted(cache, [90, 91], cached=0)
    plan = [[(long, 3), (short, 2)], [(long, 3)], [(long, 2)]]
    for step, prefill in enumerate(plan):
        decode = [short] if step > 0 else []
        for sequence, row in decoder.step(prefill, decode):
            sequence.generated.append(100 + int(row[0]))  # a token that depends on the logits
    assert long.generated == [187]
    assert short.generated == [191, 291, 391]
    for sequence in (long, short):
        assert_cached(sequence)
    assert long.slot is not None
    assert long.slot.length == 8
    assert short.slot is not None
    assert short.slot.length == 4
