"""The two-checkout benchmark (loadtests/benchmarks/versus.py): a real server started (by the
harness's `serving`, as the benchmark starts it) in another checkout runs that checkout's code,
and the table's ratios are taken round by round."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import psutil

import loadtests.benchmarks.versus as versus
from loadtests.benchmarks import harness
from loadtests.benchmarks.batching import SERVER_CORE
from loadtests.benchmarks.harness import serving
from loadtests.benchmarks.models import write_repository


def test_the_base_server_runs_the_code_of_its_own_checkout(tmp_path: Path) -> None:
    here = Path(__file__).resolve().parents[4]
    base = tmp_path / "base"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base), "HEAD"], cwd=here,
                   check=True)  # fmt: skip
    try:
        marker = "0.0-versus-test"
        app = base / "server" / "http" / "app.py"
        app.write_text(app.read_text().replace('version="0.1.0"', f'version="{marker}"'))
        repo = write_repository(tmp_path / "repo")
        with serving("sluice", repo, SERVER_CORE, "--workers", "1", cwd=base) as served:
            seen = httpx.get(f"{served.url}/openapi.json", timeout=10).json()["info"]["version"]
        assert seen == marker
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=here,
                       check=True)  # fmt: skip


def test_the_table_takes_each_ratio_within_a_round() -> None:
    rows = [
        {"round": 0, "case": "mlp:json:16", "server": "base", "cpu_us": 200.0, "errors": 0},
        {"round": 0, "case": "mlp:json:16", "server": "this", "cpu_us": 100.0, "errors": 0},
        {"round": 1, "case": "mlp:json:16", "server": "this", "cpu_us": 400.0, "errors": 1},
        {"round": 1, "case": "mlp:json:16", "server": "base", "cpu_us": 400.0, "errors": 0},
    ]
    for row, p50, p99 in zip(rows, (900, 500, 700, 1100), (3000, 2000, 4000, 5000), strict=True):
        row |= {"p50_us": p50, "p99_us": p99}
    report = {"rows": rows, "cases": ["mlp:json:16"], "rounds": 2, "seconds": 3.0, "base": "/b",
              "base_commit": "abc", "this_commit": "def", "machine": {}}  # fmt: skip
    line = versus.table(report).splitlines()[-1]
    # Medians of 200/400 and 100/400 would give 1.20; within rounds: 2.00 and 1.00, median 1.50.
    cells = [cell.strip() for cell in line.strip("|").split("|")]
    assert cells == ["mlp:json:16", "300.0 (200.0-400.0)", "250.0 (100.0-400.0)",
                     "1.50 (1.00-2.00)", "2.00 1.00", "1,000 / 4,000", "600 / 3,000",
                     "1"]  # fmt: skip


def test_a_server_s_cpu_counts_every_process_under_it() -> None:
    # With --workers 2 the supervisor's own process idles while its engine and workers work.
    child = (
        "import sys, time\nend = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\nprint('spun', flush=True)\nsys.stdin.read()"
    )
    spawn = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    with subprocess.Popen(  # the child inherits its pipes: it lives until stdin closes
        [sys.executable, "-c", spawn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as parent:
        assert parent.stdout is not None
        assert parent.stdout.readline() == "spun\n"
        assert versus.cpu_s(psutil.Process(parent.pid)) >= 0.25
        assert harness.cpu_s(parent.pid) < 0.2  # the parent's own, which versus counted before


def test_the_table_names_the_worker_count() -> None:
    report = {"rows": [], "cases": [], "rounds": 1, "seconds": 3.0, "base": "/b", "workers": 2,
              "base_commit": "abc", "this_commit": "def", "machine": {}}  # fmt: skip
    assert "--workers 2`" in versus.table(report)
