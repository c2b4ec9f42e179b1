"""`sluice tune` for real: a `sluice serve` process in explicit mode serving the demo model, short
tune runs through the CLI with a small --budget-s (the winner written, the original config
restored, a second run in the same folder resuming without measuring again what it had, Ctrl-C
or SIGTERM restoring too), and tritonclient's load_model(config=...) over HTTP and gRPC."""

from __future__ import annotations

import json
import shlex
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
# One step per trial: these tests need trials, not ramps (test_loadtest.py runs the ramp's steps).
# Until it has timed a trial, tune plans 4 s for one of a single 1 s step.
RAMP = "2:2:1"


@pytest.fixture(scope="module")
def explicit_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One server for the module: every test that loads a config ends with the original again
    (and checks that it does)."""
    folder = tmp_path_factory.mktemp("explicit")
    repo = write_demo_repository(folder / "models")
    server = ServerProcess(
        "--model-repository", str(repo), "--model-control-mode", "explicit",
        "--load-model", "demo", log_path=folder / "server.log",
    ).start(timeout_s=90)  # fmt: skip
    yield server
    server.stop()


def tune_command(server: ServerProcess, out: Path, budget_s: float) -> list[str]:
    return [
        sys.executable, "-m", "server", "tune", "--url", server.url, "--model", "demo",
        "--slo-p99-ms", SLO_MS, "--budget-s", str(budget_s), "--ramp", RAMP,
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
    # 14 s: the 5 s reserve, a first trial of up to 4.5 s and a second planned at 4 s or the
    # first's length (a trial takes about 2 s on two shared cores).
    code, stderr, took = tune(explicit_server, out, budget_s=14)
    assert code == 0, stderr
    assert took < 14 + 5  # the budget, plus interpreter start-up and imports
    assert "candidate 1 of at most" in stderr
    assert "original config restored" in stderr
    assert served_config(explicit_server) == ORIGINAL
    first = json.loads((out / "results.json").read_text())
    measured = [trial["key"] for trial in first["trials"]]
    assert len(measured) >= 2
    ran = [t for t in first["trials"] if t["error"] is None]  # a candidate may fail to load
    assert all([step["users"] for step in t["steps"]] == [2] for t in ran)  # RAMP's one step
    assert first["budget_exhausted"] is True
    assert first["trials"][0]["candidate"]["preferred"] == "original"  # the original goes first
    winner = yaml.safe_load((out / "config.yaml").read_text())
    assert winner == next(t["config"] for t in first["trials"] if t["key"] == first["winner"])
    ModelConfig(**winner)
    report = (out / "report.md").read_text()
    assert all(f"| {i + 1}" in report for i in range(len(measured)))
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 2

    code, stderr, _ = tune(explicit_server, out, budget_s=10)  # room for one more trial
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


def test_tune_refuses_a_server_not_in_explicit_mode(
    demo_server: ServerProcess, tmp_path: Path
) -> None:
    code, stderr, _ = tune(demo_server, tmp_path / "tune", budget_s=20)
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


def owned_tune_command(tmp_path: Path, out: Path, budget_s: float) -> tuple[list[str], Path]:
    """A tune that starts its own server on free ports (the repository path marks its
    processes, the workers it forks included)."""
    from tests.redis_process import free_port

    repo = write_demo_repository(tmp_path / "owned-models")
    http_port, grpc_port = free_port(), free_port()
    serve = [
        sys.executable, "-m", "server", "serve", "--http-port", str(http_port),
        "--grpc-port", str(grpc_port), "--model-repository", str(repo),
        "--model-control-mode", "explicit", "--load-model", "demo", "--log-format", "json",
    ]  # fmt: skip
    command = [
        sys.executable, "-m", "server", "tune", "--url", f"http://127.0.0.1:{http_port}",
        "--model", "demo", "--slo-p99-ms", SLO_MS, "--budget-s", str(budget_s),
        "--ramp", RAMP, "--trial-s", "1", "--cores", "1", "--out", str(out),
        "--serve-cmd", shlex.join(serve), "--workers-range", "1:2",
    ]  # fmt: skip
    return command, repo


def left_running(marker: str) -> list[str]:
    """Command lines of live processes naming `marker`."""
    import psutil

    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        if marker in cmdline and process.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(cmdline)
    return found


def test_a_tune_that_owns_the_server_searches_workers_and_stops_it(tmp_path: Path) -> None:
    out = tmp_path / "tune"
    command, repo = owned_tune_command(tmp_path, out, budget_s=16)  # two trials, a restart between
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert left_running(str(repo)) == []  # the server and its workers are gone
    assert "starting the server:" in done.stderr
    results = json.loads((out / "results.json").read_text())
    assert results["space"]["workers"] == [1, 2]
    search = [t for t in results["trials"] if t["phase"] == "search"]
    searched = [t["candidate"]["workers"] for t in search]
    assert searched[:2] == [1, 2]  # the command's own count first, then the other
    assert search[1]["error"] is None  # measured on the restarted server
    assert search[1]["ok_rps"] > 0
    assert results["workers_trials"] == searched.count(2) >= 1
    winner = next(t for t in results["trials"] if t["key"] == results["winner"])
    assert results["winner_workers"] == winner["candidate"]["workers"] in (1, 2)
    server_yaml = (out / "server.yaml").read_text()
    assert yaml.safe_load(server_yaml) == {"workers": results["winner_workers"]}
    assert f"serve with --workers {results['winner_workers']}" in done.stderr
    assert "workers" not in yaml.safe_load((out / "config.yaml").read_text())
    assert "Front-end worker processes (`--workers`) were searched over 1, 2" in (
        (out / "report.md").read_text()
    )
    assert (out / "server.log").read_text()  # the server's output is kept beside the report


def test_sigterm_stops_the_owned_server(tmp_path: Path) -> None:
    out = tmp_path / "tune"
    command, repo = owned_tune_command(tmp_path, out, budget_s=120)
    log = tmp_path / "tune.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 90
        while "candidate 1 of at most" not in log.read_text():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the tune did not start a trial in time"
            time.sleep(0.2)
        assert left_running(str(repo)) != []
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=90)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, log.read_text()
    assert left_running(str(repo)) == []


@pytest.mark.parametrize(
    ("program", "timeout_s", "expected"),
    [
        # A timeout waited out whole is short; one the exit must beat is long (it costs nothing).
        ("import time; time.sleep(600)", "0.3",
         "was not ready at http://127.0.0.1:{port}/v2/health/ready within 0.3 s "
         "(--serve-ready-timeout-s)"),
        ("raise SystemExit(4)", "30", "exited with status 4 before it was ready"),
    ],
    ids=["never-ready", "exits"],
)  # fmt: skip
def test_a_server_that_never_gets_ready_fails_with_3_and_is_stopped(
    tmp_path: Path, program: str, timeout_s: str, expected: str
) -> None:
    from tests.redis_process import free_port

    port = free_port()
    marker = f"never-ready-{tmp_path.name}"
    serve = shlex.join([sys.executable, "-c", program, marker])
    command = [
        sys.executable, "-m", "server", "tune", "--url", f"http://127.0.0.1:{port}",
        "--model", "demo", "--slo-p99-ms", SLO_MS, "--out", str(tmp_path / "tune"),
        "--serve-cmd", serve, "--serve-ready-timeout-s", timeout_s,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 3, done.stderr
    assert expected.format(port=port) in " ".join(done.stderr.split())
    assert left_running(marker) == []


def test_serve_cmd_refuses_a_url_another_server_answers(
    explicit_server: ServerProcess, tmp_path: Path
) -> None:
    marker = f"never-started-{tmp_path.name}"
    command = [
        *tune_command(explicit_server, tmp_path / "tune", budget_s=20),
        "--serve-cmd", shlex.join([sys.executable, "-c", "pass", marker]),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 3, done.stderr
    assert f"a server already answers at {explicit_server.url}" in done.stderr
    assert not (tmp_path / "tune" / "server.log").exists()  # the command never ran
    assert served_config(explicit_server) == ORIGINAL  # and the other server was not touched
