"""`sluice loadtest` for real: short locust runs against real `sluice serve` processes, through
the CLI, checking the report folder and that locust's counts agree with the server's /metrics."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.demo import write_demo_repository
from loadtests.results import LoadTestResult
from tests.servers import ServerProcess

PNGS = (
    "throughput_over_time",
    "latency_over_time",
    "concurrency",
    "errors",
    "batch_size",
    "queue_wait",
    "cache_hit_ratio",
)


def loadtest(url: str, out: Path, *args: str) -> tuple[int, dict[str, Any]]:
    """Run `sluice loadtest` and return its exit status and results.json."""
    command = [sys.executable, "-m", "server", "loadtest", "--url", url, "--out", str(out), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=90, check=False)
    results = out / "results.json"
    assert results.exists(), f"no report (exit {done.returncode}):\n{done.stderr[-3000:]}"
    return done.returncode, json.loads(results.read_text())


def check_report_folder(out: Path, data: dict[str, Any]) -> None:
    for name in PNGS:
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    markdown = (out / "report.md").read_text()
    assert markdown.startswith(f"# Load test: `{data['settings']['model']}`")
    assert (out / "report.html").read_text().count("data:image/png;base64,") == len(PNGS)
    assert LoadTestResult.from_dict(data).to_dict() == data  # results.json reads back whole


def test_http_ramp_meets_a_loose_slo(demo_server: ServerProcess, tmp_path: Path) -> None:
    code, data = loadtest(
        demo_server.url, tmp_path, "--ramp", "1:2:1", "--duration", "1", "--slo-p99-ms", "5000"
    )
    assert code == 0
    check_report_folder(tmp_path, data)
    assert [step["users"] for step in data["steps"]] == [1, 2]
    assert all(step["ok_rps"] > 0 for step in data["steps"])
    assert data["summary"]["unexpected_errors"] == 0
    assert data["summary"]["failures"] == 0
    assert data["summary"]["verdict"] == "pass"
    assert data["summary"]["best_users"] in (1, 2)
    for step in data["steps"]:
        served = step["server"]["requests_by_status"]["200"]
        answered = step["total"]["requests"]
        # The server also finished the requests locust abandoned at the end (one per user) and
        # those sent while users spawned (before locust reset its counts).
        assert answered <= served <= answered + 200
        assert step["server"]["batch_size"]["counts"][-1] > 0
        assert step["server"]["queue_wait_s"]["counts"][-1] > 0
        # sluice exports these; with the demo's cache off and no limits they are just zero.
        assert (step["server"]["cache_hits"], step["server"]["cache_misses"]) == (0, 0)
        assert step["server"]["rejections"] == {}
    assert "not exported" not in (tmp_path / "report.md").read_text()


def test_grpc_through_a_master_and_a_worker(demo_server: ServerProcess, tmp_path: Path) -> None:
    code, data = loadtest(
        demo_server.url,
        tmp_path,
        "--protocol",
        "grpc",
        "--grpc-url",
        demo_server.grpc_url,
        "--users",
        "2",
        "--duration",
        "1",
        "--workers",
        "1",
    )
    assert code == 0
    (step,) = data["steps"]
    assert step["total"]["requests"] > 0
    assert step["ok_rps"] > 0
    assert step["unexpected_errors"] == 0
    assert data["settings"]["workers"] == 1
    assert data["settings"]["target"] == demo_server.grpc_url
    assert (tmp_path / "locust" / "step-01-worker-1.log").exists()


def test_binary_with_an_slo_nothing_meets_exits_1(
    demo_server: ServerProcess, tmp_path: Path
) -> None:
    code, data = loadtest(
        demo_server.url,
        tmp_path,
        "--protocol",
        "http-binary",
        "--ramp",
        "2:4:2",
        "--duration",
        "1",
        "--slo-p99-ms",
        "0.001",
    )
    assert code == 1
    assert data["summary"]["verdict"] == "fail"
    (step,) = data["steps"]  # the ramp stops at the first step over the SLO
    assert step["meets_slo"] is False
    assert step["ok_rps"] > 0
    assert step["unexpected_errors"] == 0
    check_report_folder(tmp_path, data)
    assert (
        "**FAIL**: even the lowest step (2 users) missed p99 ≤ 0.001 ms"
        in (tmp_path / "report.md").read_text()
    )


def _key(tenant: str) -> tuple[str, str]:
    key = f"sluice_loadtest_{tenant}_key"
    return key, "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def test_tenant_mix_with_a_rate_limit_and_the_cache(
    start_server: type[ServerProcess], tmp_path: Path
) -> None:
    repository = write_demo_repository(tmp_path / "models")
    config_file = repository / "demo" / "config.yaml"
    config_file.write_text(config_file.read_text() + "cache:\n  enabled: true\n")
    (fast, fast_digest), (slow, slow_digest) = _key("fast"), _key("slow")
    settings = tmp_path / "server.yaml"
    settings.write_text(
        "auth:\n  keys:\n"
        f"    - {{digest: '{fast_digest}', tenant: fast}}\n"
        f"    - {{digest: '{slow_digest}', tenant: slow}}\n"
        "rate_limit:\n  tenants:\n    slow: {rate_per_s: 20, burst: 2}\n"
    )
    server = start_server("--config", str(settings), "--model-repository", str(repository))
    out = tmp_path / "report"
    code, data = loadtest(
        server.url,
        out,
        "--users",
        "2",
        "--duration",
        "1",
        "--api-key",
        fast,
        "--api-key",
        slow,
        "--cache-hit-fraction",
        "0.5",
    )
    assert code == 0
    (step,) = data["steps"]
    assert step["errors"]["429"] > 0  # the slow tenant is limited...
    assert set(step["errors"]) == {"429"}
    assert step["unexpected_errors"] == 0  # ...and that is backpressure, not a fault
    tenants = {t["name"]: t for t in step["tenants"]}
    assert tenants["infer [tenant 1]"]["failures"] == 0
    assert tenants["infer [tenant 2]"]["failures"] == step["errors"]["429"]
    assert step["server"]["requests_by_status"]["429"] >= step["errors"]["429"]
    ratio = data["server"]["cache_hit_ratio"]
    assert 0.3 < ratio < 0.7, ratio  # half the admitted requests repeat one of 8 inputs
    markdown = (out / "report.md").read_text()
    assert "| 429 | backpressure |" in markdown
    assert fast not in markdown
    assert slow not in markdown


ROOT = Path(__file__).resolve().parents[2]


def _quick_start() -> tuple[list[str], list[str]]:
    """The two commands of the load-testing guide's Quick start, as argument lists (the README
    shows the same two)."""
    section = (ROOT / "docs" / "guides" / "load-testing.md").read_text()
    block = section.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    readme = (ROOT / "README.md").read_text().split("## Load test\n", 1)[1]
    assert block in readme.split("\n## ", 1)[0]  # the README's example is this Quick start
    serve, loadtest = [
        shlex.split(line.removesuffix("&")) for line in block.replace("\\\n", " ").splitlines()
    ]
    return serve, loadtest


def test_the_quick_start_runs_as_written_from_the_repo_root(demo_server: ServerProcess) -> None:
    serve, command = _quick_start()
    assert serve == ["sluice", "serve", "--http-port", "18720", "--grpc-port", "18721"]
    out = command[command.index("--out") + 1]
    assert not Path(out).is_absolute()  # the case that broke: locust runs in another folder
    report = ROOT / out
    if report.exists():
        pytest.skip(f"{report} exists; not overwriting it")
    # One short step, and the port of the module's `sluice serve` (the Quick start's serve has
    # flags for its ports only); everything else as written.
    swaps = {"http://127.0.0.1:18720": demo_server.url, "5": "1", "1:8:x2": "1:1:x2"}
    args = [swaps.get(arg, arg) for arg in command[1:]]
    assert args[:3] == ["loadtest", "--url", demo_server.url]
    sluice = Path(sys.executable).with_name("sluice")  # the installed console script
    try:
        done = subprocess.run(
            [str(sluice), *args], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode in (0, 1), done.stderr[-3000:]  # 1: the 25 ms SLO was missed
        files = [report / name for name in ("report.md", "report.html", "results.json")]
        assert all(path.is_file() for path in files), sorted(report.rglob("*"))
        assert json.loads(files[2].read_text())["steps"][0]["users"] == 1
        shown = re.search(r"Report: (.*)", done.stderr)
        assert shown is not None, done.stderr[-3000:]
        assert shown.group(1).split(", ") == [f"{out}/{path.name}" for path in files]
    finally:
        shutil.rmtree(report, ignore_errors=True)
