"""Compressed request bodies against a real server (issue 12.5): a gzip or deflate bomb is
inflated off the event loop and only up to `max_request_bytes` (413 past it), so health probes
keep answering while bombs arrive; bytes after the compressed stream are a 400."""

from __future__ import annotations

import asyncio
import gzip
import time
import zlib
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.servers import ServerProcess

MiB = 1024 * 1024
LIMIT = 200 * MiB  # inflating this much takes the best part of a second
INFER = "/v2/models/demo/infer"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("compressed") / "server.log"
    process = ServerProcess(env={"SLUICE_MAX_REQUEST_BYTES": str(LIMIT)}, log_path=log,
                            grpc=False)  # fmt: skip
    yield process.start()
    process.stop()


def bomb(encoding: str) -> bytes:
    """250 MiB of JSON-looking whitespace, compressed to under 256 KiB: small enough that the
    old code inflated it on the event loop (never held whole here)."""
    packer = zlib.compressobj(9, wbits=31 if encoding == "gzip" else 15)
    chunk = b" " * MiB
    parts = [packer.compress(b'{"inputs": [')]
    parts += [packer.compress(chunk) for _ in range(250)]
    return b"".join([*parts, packer.compress(b"]}"), packer.flush()])


async def test_bombs_get_413_while_health_probes_answer(server: ServerProcess) -> None:
    bombs = {encoding: bomb(encoding) for encoding in ("gzip", "deflate")}
    assert all(len(body) < 256 * 1024 for body in bombs.values())
    probes: list[float] = []
    done = asyncio.Event()

    async def probe(client: httpx.AsyncClient) -> None:
        while not done.is_set():
            started = time.monotonic()
            response = await client.get(f"{server.url}/v2/health/live", timeout=30.0)
            assert response.status_code == 200
            probes.append(time.monotonic() - started)
            await asyncio.sleep(0.05)

    async def send(client: httpx.AsyncClient, encoding: str) -> int:
        response = await client.post(f"{server.url}{INFER}", content=bombs[encoding], timeout=60,
                                     headers={"content-encoding": encoding})  # fmt: skip
        assert f"exceeds the limit of {LIMIT} bytes" in response.json()["error"]
        return response.status_code

    async with httpx.AsyncClient() as prober, httpx.AsyncClient() as sender:
        # How long this machine takes to refuse one bomb: inflated on the event loop, that is
        # how long a probe would wait. The bound below scales with it, not with a fixed second
        # that a loaded machine can miss with the loop free.
        started = time.monotonic()
        assert await send(sender, "gzip") == 413
        one_bomb_s = time.monotonic() - started
        watcher = asyncio.create_task(probe(prober))
        await asyncio.sleep(0.2)
        # Two at a time: on the loop, their inflates would run back to back (one pair is enough:
        # a stall shows in every pair, and each bomb costs the best part of a second).
        statuses = await asyncio.gather(send(sender, "gzip"), send(sender, "deflate"))
        done.set()
        await watcher
    assert statuses == [413] * 2
    assert len(probes) >= 3
    # Inflated on the loop, two bombs sent together stall a probe for about two bombs' time;
    # so did one zlib call per bomb in a thread (1-2 s: it holds the GIL for the final copy of
    # everything it inflated). Inflated in steps it never waits as long as one bomb takes.
    worst = max(probes)
    assert worst < max(one_bomb_s, 0.1), (
        f"a health probe waited {worst:.2f} s while one bomb takes {one_bomb_s:.2f} s to refuse"
    )


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_garbage_after_the_compressed_stream_is_400(server: ServerProcess, encoding: str) -> None:
    plain = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16],
                                      "data": [0.5] * 16}]})  # fmt: skip
    packed = gzip.compress(plain) if encoding == "gzip" else zlib.compress(plain)
    url = f"{server.url}{INFER}"
    ok = httpx.post(url, content=packed, headers={"content-encoding": encoding}, timeout=10)
    assert ok.status_code == 200
    bad = httpx.post(url, content=packed + b"\x00trailing", timeout=10,
                     headers={"content-encoding": encoding})  # fmt: skip
    assert bad.status_code == 400
    assert bad.json() == {"error": f"body has 9 bytes after the end of its {encoding} data"}
