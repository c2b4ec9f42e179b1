"""Entries in Redis are untrusted: anyone who can write to Redis can plant one with a valid CRC.
A decoded entry answers a request only if it is what the model computes for that request (output
names, datatypes, shapes, rows), and with `cache.signing_key` only if it carries an HMAC made with
that key for the key it is stored under."""

from __future__ import annotations

import logging
import os
import struct
import uuid
import zlib
from collections.abc import AsyncIterator

import numpy as np
import pytest
from redis.asyncio import Redis

from engine.cache.codec import CorruptEntry, Signer, decode, encode
from engine.cache.contract import CachedResult, Expected
from engine.cache.memory import MemoryCache
from engine.cache.redis_cache import RedisCache
from engine.cache.tiered import TieredCache
from engine.settings import CacheSettings
from engine.types import TensorSpec
from server.logs import effective_settings
from server.settings import Settings

SECRET = b"0123456789abcdef-shared-secret"
SPECS = (TensorSpec("y", "FP32", (-1, 3)), TensorSpec("label", "BYTES", (-1,)))
EXPECTED = Expected.for_outputs(SPECS, ["y", "label"], rows=2)


def answer(rows: int = 2, *, name: str = "y", datatype: str = "FP32") -> CachedResult:
    y = np.arange(rows * 3, dtype=np.float32).reshape(rows, 3)
    if datatype == "INT32":
        y = y.astype(np.int32)
    labels = np.array([b"row"] * rows, dtype=object)
    return CachedResult({name: y, "label": labels}, {name: datatype, "label": "BYTES"})


PLANTED = {
    "wrong output name": answer(name="z"),
    "wrong datatype": answer(datatype="INT32"),
    "1000 rows for a 2-row request": answer(rows=1000),
    "a missing output": CachedResult({"y": np.zeros((2, 3), np.float32)}, {"y": "FP32"}),
    "an extra output": CachedResult(
        {**answer().outputs, "extra": np.zeros(2, np.float32)},
        {**answer().datatypes, "extra": "FP32"},
    ),
    "a wrong inner dimension": CachedResult(
        {"y": np.zeros((2, 4), np.float32), "label": answer().outputs["label"]},
        dict(answer().datatypes),
    ),
    "a wrong rank": CachedResult(
        {"y": np.zeros((2, 3, 1), np.float32), "label": answer().outputs["label"]},
        dict(answer().datatypes),
    ),
}


@pytest.mark.parametrize("planted", PLANTED.values(), ids=PLANTED.keys())
def test_expected_names_what_does_not_fit(planted: CachedResult) -> None:
    assert EXPECTED.mismatch(answer()) is None
    problem = EXPECTED.mismatch(planted)
    assert problem is not None
    assert "expected" in problem


def test_expected_without_a_batch_dimension_uses_the_model_shape() -> None:
    expected = Expected.for_outputs((TensorSpec("y", "FP32", (2, -1)),), None, rows=None)
    fits = CachedResult({"y": np.zeros((2, 7), np.float32)}, {"y": "FP32"})
    wrong = CachedResult({"y": np.zeros((3, 7), np.float32)}, {"y": "FP32"})
    assert expected.mismatch(fits) is None
    assert expected.mismatch(wrong) == "output 'y' has shape [3, 7]; expected [2, -1]"


# -- signing in the codec ----------------------------------------------------------------------


def test_signed_entries_round_trip_and_are_bound_to_their_key() -> None:
    signer = Signer(SECRET)
    data = encode(answer(), signer=signer, key=b"ns:k1")
    assert struct.unpack_from("<B", data, 5) == (1,)  # the flags byte marks it signed
    assert decode(data, signer=signer, key=b"ns:k1").outputs["y"].tolist() == [
        [0.0, 1.0, 2.0],
        [3.0, 4.0, 5.0],
    ]
    with pytest.raises(CorruptEntry, match="signature"):
        decode(data, signer=signer, key=b"ns:k2")  # moved to another key
    with pytest.raises(CorruptEntry, match="signature"):
        decode(data, signer=Signer(b"another secret of enough length"), key=b"ns:k1")
    # A server without a key reads signed entries (it trusts unsigned ones anyway), so a key can
    # be rolled out replica by replica.
    assert decode(data).outputs["label"].tolist() == [b"row", b"row"]


def test_the_signature_covers_every_byte_of_the_entry() -> None:
    signer = Signer(SECRET)
    data = encode(answer(), signer=signer, key=b"k")
    body = len(data) - 32
    for offset in (6, 12, 40, body - 1):  # count, metadata, payload, padding
        altered = bytearray(data)
        altered[offset] ^= 0x01
        # Recompute the CRC, as a writer without the secret can: only the signature catches it.
        struct.pack_into("<I", altered, 8, zlib.crc32(altered[12:body], zlib.crc32(altered[:8])))
        with pytest.raises(CorruptEntry, match="signature"):
            decode(bytes(altered), signer=signer, key=b"k")


def test_unsigned_and_forged_entries_fail_with_a_key() -> None:
    signer = Signer(SECRET)
    unsigned = encode(answer())
    with pytest.raises(CorruptEntry, match="not signed"):
        decode(unsigned, signer=signer, key=b"k")
    # Claims to be signed, valid CRC, made-up signature.
    forged = bytearray(unsigned)
    forged[5] = 1
    forged += os.urandom(32)
    with pytest.raises(CorruptEntry, match="signature"):
        decode(bytes(forged), signer=signer, key=b"k")
    with pytest.raises(CorruptEntry):
        decode(bytes(forged[:40]), signer=signer, key=b"k")


# -- through a real Redis ----------------------------------------------------------------------


@pytest.fixture
def key() -> bytes:
    return f"test:{uuid.uuid4().hex}".encode()


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def make_cache(redis_url: str) -> AsyncIterator[type[RedisCache]]:
    made: list[RedisCache] = []

    def make(signing_key: bytes | None = None, **options: object) -> RedisCache:
        cache = RedisCache(
            redis_url,
            timeout_s=2.0,
            retry_interval_s=0,
            signing_key=signing_key,
            **options,  # type: ignore[arg-type]
        )
        made.append(cache)
        return cache

    yield make  # type: ignore[misc]
    for cache in made:
        await cache.close()


@pytest.mark.parametrize("planted", PLANTED.values(), ids=PLANTED.keys())
async def test_a_planted_entry_that_does_not_fit_is_a_miss(
    make_cache, raw: Redis, key: bytes, planted: CachedResult, caplog: pytest.LogCaptureFixture
) -> None:
    cache = make_cache()
    await raw.set(key, encode(planted), px=60_000)
    with caplog.at_level(logging.WARNING, logger="sluice.cache"):
        assert await cache.get(key, EXPECTED) is None
    assert (cache.stats.hits, cache.stats.misses, cache.stats.rejected) == (0, 1, 1)
    assert "does not fit the request" in caplog.text
    # The fitting answer, stored by this server, is served.
    await cache.put(key, answer(), ttl_s=60)
    await cache.flush()
    found = await cache.get(key, EXPECTED)
    assert found is not None
    assert found.outputs["y"].shape == (2, 3)


async def test_a_result_larger_than_max_entry_bytes_is_a_miss(
    make_cache, raw: Redis, key: bytes
) -> None:
    cache = make_cache(max_entry_bytes=64)
    await raw.set(key, encode(answer(rows=2)), px=60_000)  # 24 + 6 bytes: fits
    assert await cache.get(key, EXPECTED) is not None
    await raw.set(key, encode(answer(rows=100)), px=60_000)  # 1500 bytes: never stored by us
    assert await cache.get(key) is None
    assert cache.stats.rejected == 1


async def test_with_a_signing_key_unsigned_and_forged_entries_are_misses(
    make_cache, raw: Redis, key: bytes
) -> None:
    keyed = make_cache(SECRET)
    unkeyed = make_cache()
    await unkeyed.put(key, answer(), ttl_s=60)  # a writer without the key
    await unkeyed.flush()
    assert await unkeyed.get(key, EXPECTED) is not None
    assert await keyed.get(key, EXPECTED) is None
    await raw.set(key, encode(answer(), signer=Signer(b"a guessed secret, not ours"), key=key))
    assert await keyed.get(key, EXPECTED) is None
    assert (keyed.stats.hits, keyed.stats.rejected) == (0, 2)


async def test_replicas_with_the_same_key_share_entries_but_not_across_keys(
    make_cache, raw: Redis, key: bytes
) -> None:
    writer, reader = make_cache(SECRET), make_cache(SECRET)
    await writer.put(key, answer(), ttl_s=60)
    await writer.flush()
    found = await reader.get(key, EXPECTED)
    assert found is not None
    assert found.outputs["label"].tolist() == [b"row", b"row"]
    # A valid entry copied to another key (another request's) is refused there.
    other = key + b":other"
    await raw.set(other, await raw.get(key), px=60_000)
    assert await reader.get(other, EXPECTED) is None
    assert (reader.stats.hits, reader.stats.rejected) == (1, 1)


async def test_a_bad_redis_entry_never_reaches_the_memory_tier(
    make_cache, raw: Redis, key: bytes
) -> None:
    memory = MemoryCache(1 << 20)
    tiered = TieredCache(memory, make_cache())
    await raw.set(key, encode(answer(rows=1000)), px=60_000)
    assert await tiered.get(key, EXPECTED) is None
    assert key not in memory
    assert tiered.stats.rejected == 1
    # A fitting entry from Redis fills memory as before.
    await raw.set(key, encode(answer()), px=60_000)
    assert await tiered.get(key, EXPECTED) is not None
    assert key in memory


# -- the setting -------------------------------------------------------------------------------


def test_signing_key_is_a_secret_masked_in_the_start_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SLUICE_CACHE__SIGNING_KEY", SECRET.decode())
    settings = Settings()
    assert settings.cache.signing_key is not None
    assert settings.cache.signing_key.get_secret_value() == SECRET.decode()
    assert SECRET.decode() not in repr(settings)
    shown = effective_settings(settings)
    assert shown["cache"]["signing_key"] != SECRET.decode()
    assert SECRET.decode() not in str(shown)


def test_a_short_signing_key_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 16"):
        CacheSettings(signing_key="short")  # type: ignore[arg-type]
