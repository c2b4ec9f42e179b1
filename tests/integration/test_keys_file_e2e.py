"""`auth.keys_file` and the exposed surfaces against a real `sluice serve`: keys created and
revoked with `sluice keys --file` while the server runs, expiry, a broken file, SIGHUP, the audit
log of admin actions, and /openapi.json and /metrics behind keys."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml

from tests.integration.helpers_e2e import Key, demo_repository, infer_body, write_settings
from tests.servers import ServerProcess

StartServer = Callable[..., ServerProcess]


def sluice_keys(*args: str) -> str:
    """Run `sluice keys ARGS` as a user would; its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "server", "keys", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def create_key(keys_file: Path, tenant: str, *options: str) -> str:
    out = sluice_keys("create", "--file", str(keys_file), "--tenant", tenant, "--json", *options)
    key: str = json.loads(out)["key"]
    return key


def infer(server: ServerProcess, key: str) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v2/models/demo/infer",
        json=infer_body(seed=1),
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    )


def wait_for_status(server: ServerProcess, key: str, status: int, within_s: float) -> float:
    """Seconds until `key` gets `status`; fails after `within_s`."""
    start = time.monotonic()
    while (got := infer(server, key)).status_code != status:
        elapsed = time.monotonic() - start
        assert elapsed < within_s, f"still {got.status_code} after {elapsed:.2f} s: {got.text}"
        time.sleep(0.02)
    return time.monotonic() - start


def wait_for_log(server: ServerProcess, text: str, within_s: float = 10) -> None:
    deadline = time.monotonic() + within_s
    while text not in server.logs():
        assert time.monotonic() < deadline, f"no {text!r} in the log: {server.logs()}"
        time.sleep(0.02)


def audit_lines(server: ServerProcess) -> list[dict[str, Any]]:
    assert server.log_path is not None
    lines = server.log_path.read_text(errors="replace").splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return [record for record in records if record.get("logger") == "sluice.audit"]


def test_keys_file_create_revoke_break_without_restart(
    tmp_path: Path, start_server: StartServer
) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("keys: []\n")
    config = write_settings(tmp_path / "server.yaml", {"auth": {"keys_file": str(keys_file)}})
    server = start_server("--config", str(config))

    # An empty keys file still means "keys are configured": nobody gets in without one.
    response = infer(server, "sluice_not-a-key")
    assert response.status_code == 401, response.text
    assert httpx.post(f"{server.url}/v2/models/demo/infer", json=infer_body(1)).status_code == 401

    ci = create_key(keys_file, "acme", "--name", "ci")
    wait_for_status(server, ci, 200, within_s=5)
    other = create_key(keys_file, "beta", "--name", "other")
    wait_for_status(server, other, 200, within_s=5)
    assert [r["action"] for r in audit_lines(server)].count("key_added") == 2

    out = sluice_keys("list", "--file", str(keys_file), "--json")
    listed = [json.loads(line) for line in out.splitlines()]
    assert [(row["name"], row["tenant"], row["expired"]) for row in listed] == [
        ("ci", "acme", False),
        ("other", "beta", False),
    ]

    sluice_keys("revoke", "--file", str(keys_file), "ci")
    elapsed = wait_for_status(server, ci, 401, within_s=1.0)
    assert elapsed < 1.0
    assert infer(server, other).status_code == 200
    revoked = [r for r in audit_lines(server) if r["action"] == "key_revoked"]
    assert [(r["subject_key"], r["subject_tenant"], r["actor"]) for r in revoked] == [
        ("ci", "acme", "auth.keys_file")
    ]

    # A broken file keeps the keys read before (and says why in the log): bad YAML, then a
    # digest listed twice.
    good = yaml.safe_load(keys_file.read_text())
    keys_file.write_text("keys: [ {name: broken, digest: nonsense")
    wait_for_log(server, "auth.keys_file not reloaded")
    assert infer(server, other).status_code == 200
    assert infer(server, ci).status_code == 401
    twice = {"keys": [*good["keys"], {**good["keys"][0], "name": "other-again"}]}
    keys_file.write_text(yaml.safe_dump(twice))
    deadline = time.monotonic() + 10
    while "is listed twice" not in server.logs():
        assert time.monotonic() < deadline, server.logs()
        time.sleep(0.02)
    assert infer(server, other).status_code == 200
    assert infer(server, ci).status_code == 401


def test_expired_key_is_refused_saying_so(tmp_path: Path, start_server: StartServer) -> None:
    keys_file = tmp_path / "keys.yaml"
    old = create_key(keys_file, "acme", "--name", "old", "--expires-at", "2020-01-01T00:00:00Z")
    fresh = create_key(keys_file, "acme", "--name", "fresh", "--expires-at", "2999-01-01T00:00:00")
    config = write_settings(tmp_path / "server.yaml", {"auth": {"keys_file": str(keys_file)}})
    server = start_server("--config", str(config))
    response = infer(server, old)
    assert response.status_code == 401
    assert response.json()["error"] == (
        "API key 'old' (tenant 'acme') expired at 2020-01-01T00:00:00+00:00"
    )
    assert infer(server, fresh).status_code == 200


def test_sighup_rereads_the_keys_file(tmp_path: Path, start_server: StartServer) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("")
    config = write_settings(
        tmp_path / "server.yaml",
        {"auth": {"keys_file": str(keys_file), "keys_file_poll_interval_s": 60}},
    )
    server = start_server("--config", str(config))
    key = create_key(keys_file, "acme")
    assert infer(server, key).status_code == 401  # the next poll is a minute away
    assert server.process is not None
    server.process.send_signal(signal.SIGHUP)
    wait_for_status(server, key, 200, within_s=5)


@pytest.mark.parametrize("workers", ["1", "2"])  # 2: the engine process's traceback was shown
def test_a_missing_keys_file_fails_the_start(tmp_path: Path, workers: str) -> None:
    config = write_settings(
        tmp_path / "server.yaml", {"auth": {"keys_file": str(tmp_path / "absent.yaml")}}
    )
    done = subprocess.run(
        [sys.executable, "-m", "server", "serve", "--config", str(config), "--http-port", "0",
         "--workers", workers],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert f"cannot read auth.keys_file {tmp_path / 'absent.yaml'}" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr


# -- audit log of admin actions -------------------------------------------------------------------


def test_load_and_unload_are_logged_with_key_name_and_tenant(
    tmp_path: Path, start_server: StartServer
) -> None:
    from server.grpc.proto import grpc_service_pb2 as pb
    from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc

    repo = demo_repository(tmp_path / "repo", {"demo": "", "spare": ""})
    keys_file = tmp_path / "keys.yaml"
    admin = create_key(keys_file, "ops", "--name", "deployer", "--role", "admin")
    config = write_settings(tmp_path / "server.yaml", {"auth": {"keys_file": str(keys_file)}})
    server = start_server(
        "--config", str(config), "--model-repository", str(repo),
        "--model-control-mode", "explicit", "--load-model", "demo",
    )  # fmt: skip
    headers = {"x-api-key": admin}
    url = f"{server.url}/v2/repository/models/spare"
    assert httpx.post(f"{url}/load", headers=headers, timeout=30).status_code == 200
    assert httpx.post(f"{url}/unload", headers=headers, timeout=30).status_code == 200
    missing = httpx.post(f"{server.url}/v2/repository/models/nope/load", headers=headers)
    assert missing.status_code == 404
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        metadata = (("x-api-key", admin),)
        stub.RepositoryModelLoad(
            pb.RepositoryModelLoadRequest(model_name="spare"), metadata=metadata, timeout=30
        )
        stub.RepositoryModelUnload(
            pb.RepositoryModelUnloadRequest(model_name="spare"), metadata=metadata, timeout=30
        )
    seen = [
        (r["action"], r["model"], r["protocol"], r["outcome"], r["key"], r["tenant"])
        for r in audit_lines(server)
        if r["action"] in ("load", "unload")
    ]
    assert seen == [
        ("load", "spare", "http", "ok", "deployer", "ops"),
        ("unload", "spare", "http", "ok", "deployer", "ops"),
        ("load", "nope", "http", "failed", "deployer", "ops"),
        ("load", "spare", "grpc", "ok", "deployer", "ops"),
        ("unload", "spare", "grpc", "ok", "deployer", "ops"),
    ]


# -- /openapi.json, /docs and /metrics ------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, Key, Key]]:
    """One server for the tests that only read its surfaces with and without keys."""
    folder = tmp_path_factory.mktemp("keyed")
    user, admin = Key.create("acme"), Key.create("ops", role="admin")
    config = write_settings(
        folder / "server.yaml",
        {"auth": {"keys": [user.entry(), admin.entry()]}, "metrics": {"require_key": True}},
    )
    server = ServerProcess("--config", str(config), log_path=folder / "server.log").start()
    yield server, user, admin
    server.stop()


def test_openapi_needs_a_key_once_keys_are_configured(
    keyed_server: tuple[ServerProcess, Key, Key],
) -> None:
    server, user, _ = keyed_server
    assert httpx.get(f"{server.url}/openapi.json").status_code == 401
    schema = httpx.get(f"{server.url}/openapi.json", headers=user.bearer())
    assert schema.status_code == 200
    assert "/v2/health/live" in schema.json()["paths"]
    for page in ("/docs", "/redoc"):
        assert httpx.get(f"{server.url}{page}", headers=user.bearer()).status_code == 404


def test_metrics_require_an_admin_key(keyed_server: tuple[ServerProcess, Key, Key]) -> None:
    server, user, admin = keyed_server
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    forbidden = httpx.get(f"{server.url}/metrics", headers=user.bearer())
    assert forbidden.status_code == 403
    assert "needs an admin key" in forbidden.json()["error"]
    scraped = httpx.get(f"{server.url}/metrics", headers=admin.bearer())
    assert scraped.status_code == 200
    assert "sluice_" in scraped.text


def test_open_server_serves_openapi_and_metrics(demo_server: ServerProcess) -> None:
    assert httpx.get(f"{demo_server.url}/openapi.json").status_code == 200
    assert httpx.get(f"{demo_server.url}/metrics").status_code == 200
