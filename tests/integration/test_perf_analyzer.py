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
from tests.integration.helpers_e2e import start_all, stop_all
from tests.models import identity_model, write_model
from tests.servers import ServerProcess

PERF_ANALYZER = Path(sys.executable).parent / "perf_analyzer"

pytestmark = pytest.mark.skipif(
    not PERF_ANALYZER.exists(), reason="perf_analyzer is not installed (./dev.sh test installs it)"
)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """A server per protocol, both serving the same repository (see `Runs`)."""
    root = tmp_path_factory.mktemp("perf_analyzer")
    repo = root / "repo"
    write_demo_repository(repo)
    write_model(repo, "cached", identity_model("FP32"), "cache:\n  enabled: true\n")
    processes = {
        protocol: ServerProcess("--model-repository", str(repo), log_path=root / f"{protocol}.log")
        for protocol in ("http", "grpc")
    }
    start_all(list(processes.values()))
    yield processes
    stop_all(list(processes.values()))


Case = tuple[str, str, int]
"""(protocol, model, batch size)"""

CASES: list[Case] = [
    (protocol, model, batch)
    for protocol in ("http", "grpc")
    for model, batch in (("demo", 1), ("demo", 4), ("cached", 1))
]


class Runs:
    """perf_analyzer's runs, by case, all started by the first test: a count window lasts a
    second at least (perf_analyzer sleeps a second between its checks of the count), so a run
    is three seconds of mostly waiting, and the runs overlap instead of adding up. Each reads
    only its own model's statistics, and a server counts a batch's stages together whatever else
    it runs. HTTP and gRPC runs go to servers of their own: on one server, one front-end's load
    starves the other's windows tenfold, where each protocol's three share theirs evenly."""

    def __init__(self, servers: dict[str, ServerProcess]) -> None:
        self.servers = servers
        self.processes: dict[Case, subprocess.Popen[str]] = {}
        self.outputs: dict[Case, tuple[int, str]] = {}

    def command(self, protocol: str, model: str, batch: int) -> list[str]:
        server = self.servers[protocol]
        url = server.grpc_url if protocol == "grpc" else server.url.removeprefix("http://")
        return [
            str(PERF_ANALYZER), "-m", model, "-u", url, "-i", protocol, "-b", str(batch),
            "--concurrency-range", "4", "--measurement-mode", "count_windows",
            "--measurement-request-count", "100", "--max-trials", "10",
            # No stability is required on a noisy shared machine: any 3 windows in a row within
            # 11x of each other's rate and latency (a stalled window once failed 3 trials).
            "--stability-percentage", "999",
        ]  # fmt: skip

    def result(self, case: Case) -> tuple[int, str]:
        """(exit status, stdout and stderr) of the case's run."""
        if not self.processes:
            for other in CASES:
                self.processes[other] = subprocess.Popen(
                    self.command(*other),
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                )  # fmt: skip
        if case not in self.outputs:
            process = self.processes[case]
            output, _ = process.communicate(timeout=100)
            self.outputs[case] = process.returncode, output
        return self.outputs[case]

    def stop(self) -> None:
        """Kill the runs no test read (deselected, or timed out), and close their pipes."""
        for case, process in self.processes.items():
            if case not in self.outputs:
                process.kill()
                process.communicate()


@pytest.fixture(scope="module")
def runs(servers: dict[str, ServerProcess]) -> Iterator[Runs]:
    started = Runs(servers)
    yield started
    started.stop()


@pytest.mark.parametrize(
    ("protocol", "model", "batch"), CASES, ids=[f"{m}-{b}-{p}" for p, m, b in CASES]
)
def test_perf_analyzer_completes_and_reads_the_statistics(
    runs: Runs, protocol: str, model: str, batch: int
) -> None:
    code, output = runs.result((protocol, model, batch))
    assert code == 0, output
    assert "compute counts must be the same" not in output
    # It printed the server-side split, which it takes from the statistics endpoint.
    assert "Server: " in output
    assert "compute input" in output
    assert "throughput: " in output
