"""No request is lost on SIGTERM with `--workers 2`: the load of tests/integration/test_sigterm.py
(32 clients, HTTP keep-alive and fresh connections, gRPC channels honouring Retry-After) against
a supervisor, its two workers and the engine process; the workers drain first, then the engine.
(A file of its own: tritonclient.grpc and server.grpc.proto cannot share a process.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.test_sigterm import WARM_ANSWERS, grpc_run, http_run, started

RUNS = 3


@pytest.mark.parametrize("protocol", ["http", "grpc"])
async def test_sigterm_under_load_loses_no_request(tmp_path: Path, protocol: str) -> None:
    run_load = http_run if protocol == "http" else grpc_run
    with started(tmp_path, RUNS, "--workers", "2", grpc_enabled=protocol == "grpc") as servers:
        tallies = [await run_load(server) for server in servers]
    summary = [(t.answers, len(t.lost), t.lost[:3]) for t in tallies]
    assert [len(t.lost) for t in tallies] == [0] * RUNS, summary
    assert [t.no_retry_after for t in tallies] == [0] * RUNS, summary
    ok = "200" if protocol == "http" else "OK"
    assert all(t.answers[ok] >= WARM_ANSWERS for t in tallies), summary
