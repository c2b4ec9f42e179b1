"""A request the model refuses costs no tensor memory (issue 12.6): the server checks names,
datatypes, shapes and batch size from the request header before it decodes any data. Measured
on a real `sluice serve` as the growth of its peak RSS (VmHWM)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.servers import ServerProcess

MiB = 1024 * 1024
ROWS = 1_250_000  # x 16 values of "0," = 40 MB of JSON


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("memory") / "server.log"
    process = ServerProcess(log_path=log, grpc=False)
    yield process.start()
    process.stop()


def peak_rss_bytes(server: ServerProcess) -> int:
    assert server.process is not None
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


def test_a_40_mb_body_over_the_batch_limit_is_refused_before_its_data_is_parsed(
    server: ServerProcess,
) -> None:
    url = f"{server.url}/v2/models/demo/infer"
    small = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [0] * 16}]}
    assert httpx.post(url, json=small, timeout=10).status_code == 200
    values = ROWS * 16
    body = (
        b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [%d, 16], "data": [' % ROWS
        + b"0," * (values - 1)
        + b"0]}]}"
    )
    assert len(body) > 40_000_000
    before = peak_rss_bytes(server)
    response = httpx.post(url, content=body, timeout=120)
    growth = peak_rss_bytes(server) - before
    assert response.status_code == 400
    assert response.json() == {
        "error": f"batch size {ROWS} exceeds the maximum of 64 for model 'demo' version 1"
    }
    print(f"peak RSS growth for a {len(body) / MiB:.1f} MiB refused body: {growth / MiB:.1f} MiB")
    assert growth < 150 * MiB
