"""deploy/compose.yaml: interpolation, cross-references to nginx.conf, the image and the config."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from server.settings import load_settings
from tests.nginx_process import NGINX_CONF, REPLICAS
from tests.unit.deploy.tools import DEPLOY, ROOT

COMPOSE = DEPLOY / "compose.yaml"
KEYS = '[{"digest": "sha256:' + "ab" * 32 + '", "tenant": "acme"}]'
VARIABLE = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:-|:\?)(?P<arg>[^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's `${VAR}`, `${VAR:-default}` and `${VAR:?error}` (the forms this file uses),
    applied like compose does: to the string values of the parsed file, not to its text."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def replace(match: re.Match[str]) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        if env.get(name):
            return env[name]
        if op == ":?":
            raise KeyError(f"{name}: {arg}")
        return arg if op == ":-" else ""

    return VARIABLE.sub(replace, value)


def compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    base = {"SLUICE_API_KEYS": KEYS, "SLUICE_MODELS": "/srv/models"}
    data = interpolate(yaml.safe_load(COMPOSE.read_text()), {**base, **(env or {})})
    assert isinstance(data, dict)
    return data


def seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", duration)
    assert match, duration
    return int(match[1]) * (60 if match[2] == "m" else 1)


def replica_settings(monkeypatch: pytest.MonkeyPatch, service: dict[str, Any]) -> Any:
    """The Settings a replica builds: the image's ENV, the compose environment, the mounted file."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    image_env = dict(re.findall(r"(SLUICE_\w+)=(\S+)", dockerfile.split("FROM", 2)[2]))
    image_env.pop("SLUICE_MODEL_REPOSITORY")  # a path inside the container
    for key, value in {**image_env, **service["environment"]}.items():
        monkeypatch.setenv(key, str(value))
    mounted = {target: source for source, target, *_ in (v.split(":") for v in service["volumes"])}
    return load_settings(DEPLOY / mounted["/etc/sluice/server.yaml"])


@pytest.mark.parametrize("missing", ["SLUICE_API_KEYS", "SLUICE_MODELS"])
def test_keys_and_models_are_required(missing: str) -> None:
    with pytest.raises(KeyError, match=missing):
        compose({missing: ""})


def test_services() -> None:
    services = compose()["services"]
    assert set(services) == {*REPLICAS, "redis", "nginx"}
    assert services["sluice-a"] == services["sluice-b"]  # identical replicas


def test_nginx_upstreams_are_the_replica_services() -> None:
    upstreams = re.findall(r"^\s*server ([\w-]+):(\d+)", NGINX_CONF.read_text(), re.MULTILINE)
    services = compose()["services"]
    assert sorted(upstreams) == sorted(
        (name, port) for name in REPLICAS for port in ("8000", "8001")
    )
    assert all(name in services for name, _ in upstreams)
    nginx = services["nginx"]
    assert "./nginx.conf:/etc/nginx/nginx.conf:ro" in nginx["volumes"]
    assert nginx["ports"] == ["8000:8000", "8001:8001"]
    assert nginx["depends_on"] == {name: {"condition": "service_healthy"} for name in REPLICAS}


def test_only_the_balancer_is_published() -> None:
    published = {name for name, service in compose()["services"].items() if "ports" in service}
    assert published == {"nginx"}


def test_replica_settings_share_redis_and_match_nginx(monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose()["services"]
    settings = replica_settings(monkeypatch, services["sluice-a"])
    assert settings.host == "0.0.0.0"
    assert (settings.http_port, settings.grpc_port) == (8000, 8001)
    assert settings.cache.backend == "tiered"
    assert settings.rate_limit.backend == "redis"
    assert settings.cache.redis_url == settings.rate_limit.redis_url == "redis://redis:6379/0"
    assert [(key.tenant, key.role) for key in settings.auth.keys] == [("acme", "user")]
    nginx_limit = re.search(r"client_max_body_size (\d+)m;", NGINX_CONF.read_text())
    assert nginx_limit
    assert settings.max_request_bytes == int(nginx_limit[1]) * 1024 * 1024


def test_stop_grace_period_covers_the_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    service = compose()["services"]["sluice-a"]
    settings = replica_settings(monkeypatch, service)
    assert service["stop_signal"] == "SIGTERM"
    grace = seconds(service["stop_grace_period"])
    assert settings.drain_timeout_s + 5 <= grace <= settings.drain_timeout_s + 30


def test_replica_health_is_readiness_on_the_http_port() -> None:
    service = compose()["services"]["sluice-a"]
    command = " ".join(service["healthcheck"]["test"])
    assert "http://127.0.0.1:8000/v2/health/ready" in command
    assert service["depends_on"] == {"redis": {"condition": "service_healthy"}}
    assert compose()["services"]["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]


def test_replicas_run_locked_down_with_models_read_only() -> None:
    service = compose()["services"]["sluice-a"]
    assert service["read_only"] is True
    assert service["cap_drop"] == ["ALL"]
    assert "/srv/models:/models:ro" in service["volumes"]


def test_bind_mounts_exist() -> None:
    for service in compose()["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).is_file(), volume


def test_images_are_pinned_to_exact_versions() -> None:
    for name, service in compose()["services"].items():
        image = service["image"]
        assert re.search(r":\d+\.\d+\.\d+", image), f"{name}: {image} is not an exact version"
