"""`sluice tune` for real: a `sluice serve` process in explicit mode serving the demo model, short
tune runs through the CLI with a small --budget-s (the winner written, the original config
restored, a second run in the same folder resuming without measuring again what it had, Ctrl-C
or SIGTERM restoring too), and tritonclient's load_model(config=...) over HTTP and gRPC."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from engine.demo import write_demo_repository
from engine.model_config import ModelConfig
from tests.servers import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SLO_MS = "500"  # loose: two shared cores, other tests running beside


@pytest.fixture
def explicit_server(tmp_path: Path) -> Any:
    repo = write_demo_repository(tmp_path / "models")
    server = ServerProcess(
        "--model-repository", str(repo), "--model-control-mode", "explicit",
        "--load-model", "demo", log_path=tmp_path / "server.log",
    ).start(timeout_s=90)  # fmt: skip
    yield server
    server.stop()


def tune_command(server: ServerProcess, out: Path, budget_s: float) -> list[str]:
    return [
        sys.executable, "-m", "server", "tune", "--url", server.url, "--model", "demo",
        "--slo-p99-ms", SLO_MS, "--budget-s", str(budget_s), "--ramp", "2:4:x2",
        "--trial-s", "1", "--cores", "1", "--out", str(out),
    ]  # fmt: skip


def tune(server: ServerProcess, out: Path, budget_s: float) -> tuple[int, str, float]:
    started = time.monotonic()
    done = subprocess.run(
        tune_command(server, out, budget_s),
        capture_output=True, text=True, timeout=budget_s + 60, check=False,
    )  # fmt: skip
    return done.returncode, done.stderr, time.monotonic() - started


def served_config(server: ServerProcess) -> tuple[int, str, dict[str, Any]]:
    config = httpx.get(f"{server.url}/v2/models/demo/config", timeout=10).json()
    parameters = config["parameters"]
    written = json.loads(parameters["sluice_config"]["string_value"])
    return config["max_batch_size"], parameters["sluice_config_source"]["string_value"], written


ORIGINAL = (
    64,
    "repository",
    {"max_batch_size": 64, "dynamic_batching": {"max_queue_delay_s": 0.002}},
)


def test_a_short_tune_writes_the_winner_restores_and_resumes(
    explicit_server: ServerProcess, tmp_path: Path
) -> None:
    out = tmp_path / "tune"
    code, stderr, took = tune(explicit_server, out, budget_s=25)
    assert code == 0, stderr
    assert took < 25 + 5  # the budget, plus interpreter start-up and imports
    assert "candidate 1 of at most" in stderr
    assert "original config restored" in stderr
    assert served_config(explicit_server) == ORIGINAL
    first = json.loads((out / "results.json").read_text())
    measured = [trial["key"] for trial in first["trials"]]
    assert len(measured) >= 2
    assert first["budget_exhausted"] is True
    assert first["trials"][0]["candidate"]["preferred"] == "original"  # the original goes first
    winner = yaml.safe_load((out / "config.yaml").read_text())
    assert winner == next(t["config"] for t in first["trials"] if t["key"] == first["winner"])
    ModelConfig(**winner)
    report = (out / "report.md").read_text()
    assert all(f"| {i + 1}" in report for i in range(len(measured)))
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 2

    code, stderr, _ = tune(explicit_server, out, budget_s=25)
    assert code == 0, stderr
    assert f"resuming {out}: {len(measured)} trial(s) measured before" in stderr
    assert stderr.count("(measured by the earlier run)") == len(measured)
    second = json.loads((out / "results.json").read_text())
    assert second["trials_reused"] == len(measured)
    assert [t["key"] for t in second["trials"][: len(measured)]] == measured
    assert second["trials_measured"] >= 1  # it went on where the first run stopped
    assert served_config(explicit_server) == ORIGINAL


def test_sigterm_mid_tune_restores_the_original(
    explicit_server: ServerProcess, tmp_path: Path
) -> None:
    out = tmp_path / "tune"
    process = subprocess.Popen(
        tune_command(explicit_server, out, budget_s=120),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        # Wait until a candidate (not the original) is being served, then stop the tune.
        while served_config(explicit_server)[1] != "load":
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "no candidate was loaded in time"
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    assert "original config restored" in stderr
    assert served_config(explicit_server) == ORIGINAL
    assert json.loads((out / "results.json").read_text())["interrupted"] is True


def test_tune_refuses_a_server_not_in_explicit_mode(tmp_path: Path) -> None:
    server = ServerProcess(log_path=tmp_path / "server.log").start(timeout_s=90)
    try:
        code, stderr, _ = tune(server, tmp_path / "tune", budget_s=20)
    finally:
        server.stop()
    assert code == 3
    assert "model control mode is 'none'" in stderr


GRPC_LOAD = """
import json, sys
import tritonclient.grpc as grpcclient
client = grpcclient.InferenceServerClient(sys.argv[1])
client.load_model("demo", config=json.dumps({"max_batch_size": 4}))
print(json.dumps(client.get_model_config("demo", as_json=True)["config"]["max_batch_size"]))
"""


def test_tritonclient_loads_with_a_config_over_http_and_grpc(
    explicit_server: ServerProcess,
) -> None:
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(explicit_server.url.removeprefix("http://"))
    inline = {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_s": "auto",
                                                        "latency_target_s": 0.05}}  # fmt: skip
    client.load_model("demo", config=json.dumps(inline))
    assert served_config(explicit_server) == (8, "load", inline)
    with pytest.raises(InferenceServerException, match="max_batch_size"):
        client.load_model("demo", config=json.dumps({"max_batch_size": "lots"}))
    assert served_config(explicit_server)[0] == 8  # a refused config changes nothing
    done = subprocess.run(
        [sys.executable, "-c", GRPC_LOAD, explicit_server.grpc_url],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == 4
    client.load_model("demo")  # no config: the folder's config.yaml again
    assert served_config(explicit_server) == ORIGINAL
