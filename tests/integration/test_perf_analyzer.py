"""Triton's perf_analyzer runs against sluice unchanged (issue 12.3).

At the end of every run perf_analyzer reads the server-side statistics and aborts ("Server side
statistics compute counts must be the same") unless compute_input, compute_infer and
compute_output were counted alike. `./dev.sh test` installs the binary (its last pip-borne
build, from tritonclient 2.40.0's wheel) as .venv/bin/perf_analyzer."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.demo import write_demo_repository
from tests.models import identity_model, write_model
from tests.servers import ServerProcess

PERF_ANALYZER = Path(sys.executable).parent / "perf_analyzer"

pytestmark = pytest.mark.skipif(
    not PERF_ANALYZER.exists(), reason="perf_analyzer is not installed (./dev.sh test installs it)"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("perf_analyzer")
    repo = root / "repo"
    write_demo_repository(repo)
    write_model(repo, "cached", identity_model("FP32"), "cache:\n  enabled: true\n")
    process = ServerProcess("--model-repository", str(repo), log_path=root / "server.log")
    yield process.start()
    process.stop()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize(("model", "batch"), [("demo", 1), ("demo", 4), ("cached", 1)])
def test_perf_analyzer_completes_and_reads_the_statistics(
    server: ServerProcess, protocol: str, model: str, batch: int
) -> None:
    url = server.grpc_url if protocol == "grpc" else server.url.removeprefix("http://")
    command = [
        str(PERF_ANALYZER), "-m", model, "-u", url, "-i", protocol, "-b", str(batch),
        "--concurrency-range", "4", "--measurement-mode", "count_windows",
        "--measurement-request-count", "100", "--max-trials", "10",
        # No stability is required on a noisy shared machine: any 3 windows in a row within
        # 11x of each other's rate and latency (a stalled window once failed 3 trials).
        "--stability-percentage", "999",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=100, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "compute counts must be the same" not in output
    # It printed the server-side split, which it takes from the statistics endpoint.
    assert "Server: " in output
    assert "compute input" in output
    assert "throughput: " in output
