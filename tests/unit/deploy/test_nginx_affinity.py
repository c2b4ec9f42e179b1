"""Model affinity in deploy/nginx.conf (turned on as its comment says), in a real nginx in front of
three real (scripted) HTTP replicas: each model's requests land on one replica, models spread
over the replicas, a stopping replica (503) moves only its own models, and the OpenAI routes follow
the X-Sluice-Model header to the same replica as the model's v2 routes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.nginx_process import NGINX_CONF, NginxProcess, adapt_config
from tests.redis_process import free_port
from tests.unit.deploy.scripted_replica import ScriptedReplica

MODELS = [f"model-{i}" for i in range(24)]


def with_affinity(text: str) -> str:
    """deploy/nginx.conf with affinity on and a third replica, as its comments say to do."""
    text, turned_on = re.subn(r"(\$affinity_by_model \{\n\s+)default off;", r"\1default on;", text)
    assert turned_on == 1
    for port in ("8000", "8001"):
        line = re.search(rf"^(\s+)server sluice-b:{port}(.*)$", text, flags=re.MULTILINE)
        assert line is not None
        third = f"{line.group(1)}server sluice-c:{port}{line.group(2)}"
        text = text.replace(line.group(0), f"{line.group(0)}\n{third}")
    return text


@pytest.fixture
def replicas() -> Iterator[dict[str, ScriptedReplica]]:
    started = {name: ScriptedReplica(name) for name in ("a", "b", "c")}
    yield started
    for replica in started.values():
        replica.stop()


def start_nginx(workdir: Path, replicas: dict[str, ScriptedReplica]) -> tuple[NginxProcess, str]:
    workdir.mkdir(exist_ok=True)
    http_port, grpc_port = free_port(), free_port()
    ports = {f"sluice-{name}": (r.port, free_port()) for name, r in replicas.items()}
    text = adapt_config(with_affinity(NGINX_CONF.read_text()), workdir, ports, http_port, grpc_port)
    process = NginxProcess(workdir, text, http_port, grpc_port)
    process.start()
    return process, f"http://127.0.0.1:{http_port}"


@pytest.fixture
def nginx(tmp_path: Path, replicas: dict[str, ScriptedReplica]) -> Iterator[str]:
    process, url = start_nginx(tmp_path / "nginx", replicas)
    yield url
    process.stop()


def placement(client: httpx.Client, rounds: int = 2) -> dict[str, str]:
    """The replica that answered each model, asserting every round agrees."""
    seen: dict[str, set[str]] = {model: set() for model in MODELS}
    for _ in range(rounds):
        for model in MODELS:
            response = client.post(f"/v2/models/{model}/infer", content=b"{}")
            assert response.status_code == 200
            seen[model].add(response.json()["replica"])
    assert all(len(replicas) == 1 for replicas in seen.values()), seen
    return {model: replicas.pop() for model, replicas in seen.items()}


def test_each_model_lands_on_one_replica_and_a_stopping_one_moves_only_its_own(
    nginx: str, replicas: dict[str, ScriptedReplica]
) -> None:
    with httpx.Client(base_url=nginx, timeout=10) as client:
        before = placement(client)
        assert set(before.values()) == {"a", "b", "c"}  # spread, 24 models over 3 replicas
        gone = max("abc", key=lambda name: list(before.values()).count(name))
        # Stopping: a sluice replica draining after SIGTERM answers 503 until it exits (the
        # scripted one keeps nginx's pooled connections open, so it is told to refuse).
        replicas[gone].status, replicas[gone].headers = 503, {"Retry-After": "1"}
        after = placement(client)
    moved = {model for model in MODELS if after[model] != before[model]}
    assert moved == {model for model in MODELS if before[model] == gone}
    assert gone not in after.values()


def test_a_replica_that_is_down_moves_only_its_own_models(
    tmp_path: Path, replicas: dict[str, ScriptedReplica]
) -> None:
    first, url = start_nginx(tmp_path / "first", replicas)
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            before = placement(client, rounds=1)
    finally:
        first.stop()
    replicas["b"].stop()  # down: its port refuses connections (a fresh nginx has none pooled)
    second, url = start_nginx(tmp_path / "second", replicas)
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            after = placement(client, rounds=2)
    finally:
        second.stop()
    assert {model for model in MODELS if after[model] != before[model]} == {
        model for model in MODELS if before[model] == "b"
    }


def test_the_openai_routes_follow_the_model_header_to_the_models_replica(nginx: str) -> None:
    with httpx.Client(base_url=nginx, timeout=10) as client:
        before = placement(client, rounds=1)
        for model in MODELS[:10]:
            for _ in range(2):
                response = client.post(
                    "/v1/chat/completions", content=b"{}", headers={"X-Sluice-Model": model}
                )
                assert response.json()["replica"] == before[model]
        # Without the header there is no key: round robin over the replicas.
        answered = {client.post("/v1/chat/completions", content=b"{}").json()["replica"]
                    for _ in range(12)}  # fmt: skip
    assert answered == {"a", "b", "c"}
