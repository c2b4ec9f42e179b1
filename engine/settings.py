"""Server settings: one YAML file, overridden by `SLUICE_*` environment variables, overridden by
CLI flags. Parsed once at start and passed down; unknown keys are errors.

This module is the root (`Settings`), where its values come from (`load_settings`) and how bad
ones are reported; the nested sections live in `engine.settings_sections`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from engine.settings_sections import (
    ApiKey,
    AuthSettings,
    BatchingDefaults,
    CacheSettings,
    MetricsSettings,
    MiB,
    ModelMemorySettings,
    RateLimitSettings,
    SharedMemorySettings,
    TenantLimits,
    TlsSettings,
    TracingSettings,
)

# The root's own names, and the sections its schema is made of (engine.settings_sections).
__all__ = [
    "ENV_EXTRAS",
    "ApiKey",
    "AuthSettings",
    "BatchingDefaults",
    "CacheSettings",
    "MetricsSettings",
    "ModelMemorySettings",
    "RateLimitSettings",
    "Settings",
    "SettingsError",
    "SharedMemorySettings",
    "TenantLimits",
    "TlsSettings",
    "TracingSettings",
    "check_environment",
    "describe",
    "load_settings",
    "read_yaml",
]


class Settings(BaseSettings):
    """The root of the server configuration (see configs/server.yaml for every field)."""

    model_config = SettingsConfigDict(
        env_prefix="SLUICE_",
        env_nested_delimiter="__",
        extra="forbid",
        use_attribute_docstrings=True,
    )

    host: str = "127.0.0.1"
    """Address both front-ends bind to."""
    http_port: int = Field(8000, ge=0, lt=65536)
    """HTTP/REST port (0 picks a free one)."""
    grpc_port: int = Field(8001, ge=0, lt=65536)
    """gRPC port (0 picks a free one)."""
    grpc_enabled: bool = True
    """Serve the gRPC front-end."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Least severe log level written."""
    log_format: Literal["auto", "json", "text"] = "auto"
    """`auto`: plain text lines when stderr is a terminal, structured JSON lines otherwise (a
    file, a pipe, a container's log); `json` or `text` force either."""
    model_repository: Path | None = None
    """Folder of models (`<name>/config.yaml`, `<name>/<version>/model.onnx`); unset serves the
    built-in demo model."""
    model_control_mode: Literal["none", "explicit", "poll", "on_demand"] = "none"
    """`none` loads everything at start; `explicit` loads `load_models` and then what the API asks;
    `poll` also rescans the repository every `poll_interval_s`; `on_demand` loads a model on its
    first inference request and evicts idle ones to stay within `model_memory`."""
    load_models: list[str] = Field(default_factory=list)
    """Models to load at start in `explicit` mode (`*` for all)."""
    poll_interval_s: float = Field(5.0, gt=0)
    """Repository rescan interval in `poll` mode; in `on_demand` mode, how often the loaded
    models' files are checked (a resident model whose files changed is reloaded)."""
    max_request_bytes: int = Field(80 * MiB, gt=0)
    """Largest HTTP request body; larger bodies get 413."""
    grpc_max_message_bytes: int = Field(80 * MiB, gt=0)
    """Largest gRPC message, received or sent."""
    grpc_stream_max_pending: int = Field(64, gt=0, le=65536)
    """Per `ModelStreamInfer` stream: most requests running plus answers the client has not
    read yet. At the bound the server stops reading that stream until the client reads."""
    grpc_max_concurrent_streams: int = Field(100, gt=0, le=65536)
    """Per connection: gRPC calls (HTTP/2 streams) open at once. The server announces it
    (SETTINGS_MAX_CONCURRENT_STREAMS) and a client holds further calls until one ends; with
    `grpc_max_message_bytes` it bounds the requests one connection can make the server hold."""
    drain_timeout_s: float = Field(30.0, ge=0)
    """On SIGTERM, how long queued and running requests may take to finish."""
    workers: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = 1
    """Front-end worker processes sharing the HTTP and gRPC ports, in front of one engine
    process (admission, cache, batchers, backends); `auto` is one per core, at most 8. 1 serves
    everything in one process (see the worker processes guide, docs/guides/workers.md)."""
    worker_arena_bytes: int = Field(128 * MiB, ge=MiB, le=64 * 1024 * MiB)
    """Shared memory per worker and direction: the decoded inputs of a worker's requests in
    flight (and their answers) must fit; past it a request is answered 503 with Retry-After."""
    strict_readiness: bool = True
    """Triton's strict readiness: the server is ready only while every model asked for serves
    (one that failed to load keeps it unready). False: ready once started; a model that failed
    is unready on its own (/v2/models/<name>/ready). A failed reload that keeps the old version
    serving never drops readiness either way."""
    http_header_timeout_s: float = Field(10.0, gt=0, le=3600)
    """A request's line and headers must arrive within this long of their first byte (or of the
    connection opening); else 408 and the connection closes (slow-client defence)."""
    http_body_timeout_s: float = Field(60.0, gt=0, le=3600)
    """A request's whole body must arrive within this long of its headers; else 408 and close."""
    http_max_connections: int = Field(4096, gt=0)
    """Open HTTP connections at most; a connection past it is answered 503 and closed."""
    http_max_pipelined_requests: int = Field(16, gt=0, le=1024)
    """Per connection: requests a client may pipeline (send before their answers) waiting
    behind the one being answered. At the bound the server stops reading the connection until
    an answer goes out, so a client cannot make it hold more (see the security guide)."""
    http_write_buffer_bytes: int = Field(64 * 1024, ge=4096, le=64 * MiB)
    """Per connection: answer bytes the server holds that the client has not read yet. Past
    it the server writes no more answers and reads no more requests on the connection until
    the client reads (an answer larger than this is still sent whole)."""
    http_write_timeout_s: float = Field(30.0, gt=0, le=3600)
    """A connection whose client reads none of its unsent answers for this long is closed and
    its requests' work cancelled (a client that pipelines and never reads)."""
    allow_unauthenticated: bool = False
    """Allow binding a non-loopback address with no API keys configured."""
    allow_python_models: bool = False
    """Load Python steps (`backend: python`, a `model.py` in the repository). Such a file is
    code the server runs, so it is never imported unless this is true; a Python model's load
    fails naming this setting otherwise."""
    model_memory: ModelMemorySettings = Field(default_factory=ModelMemorySettings)
    """The memory budget and load bounds of `on_demand` model control."""
    batching: BatchingDefaults = Field(default_factory=BatchingDefaults)
    """Defaults for models whose config does not set dynamic batching."""
    cache: CacheSettings = Field(default_factory=CacheSettings)
    """Result cache."""
    auth: AuthSettings = Field(default_factory=AuthSettings)
    """API keys and tenants."""
    rate_limit: RateLimitSettings = Field(default_factory=RateLimitSettings)
    """Per-tenant rate limits and quotas."""
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    """Prometheus metrics."""
    tls: TlsSettings = Field(default_factory=TlsSettings)
    """HTTPS and gRPC TLS (and mTLS); off unless `tls.cert_file` and `tls.key_file` are set.
    Certificates are re-read on SIGHUP."""
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    """OpenTelemetry tracing (off unless an OTLP endpoint is set)."""
    shared_memory: SharedMemorySettings = Field(default_factory=SharedMemorySettings)
    """Triton's system shared-memory extension for same-host clients (off unless enabled)."""

    @field_validator("model_repository")
    @classmethod
    def _repository_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_dir():
            raise ValueError(f"model repository '{value}' is not a directory")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Precedence: CLI flags (init) > SLUICE_* environment > YAML file.
        return (init_settings, env_settings, _YamlSource(settings_cls))


class SettingsError(Exception):
    """Settings that cannot be used; the message names every bad key."""


class _YamlSource(InitSettingsSource):
    """The YAML file's values, lowest precedence; `load_settings` passes the file's mapping."""

    data: ContextVar[dict[str, Any]] = ContextVar("sluice_yaml_settings")

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls, self.data.get({}))


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML file's top-level mapping, or SettingsError saying why it is not one."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise SettingsError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise SettingsError(
            f"{path}: expected a mapping at the top level, got {type(data).__name__}"
        )
    return data


# SLUICE_* variables that are not settings fields but are read elsewhere (the CLI's --config).
ENV_EXTRAS = frozenset({"SLUICE_CONFIG_FILE"})


def check_environment(environ: Mapping[str, str]) -> None:
    """SettingsError for a SLUICE_* variable that names no setting (a misspelling would
    otherwise be ignored without a word)."""
    problems = []
    for variable in sorted(environ):
        if not variable.upper().startswith("SLUICE_") or variable.upper() in ENV_EXTRAS:
            continue
        model: Any = Settings
        path: list[str] = []
        for part in variable[len("SLUICE_") :].lower().split("__"):
            fields = getattr(model, "model_fields", None)
            if fields is None:  # dict-valued field (tenants.<name>): any key may follow
                break
            path.append(part)
            if part not in fields:
                problems.append(
                    f"  {'.'.join(path)} (from {variable}): unknown key; allowed keys here: "
                    f"{', '.join(sorted(fields))}"
                )
                break
            model = _section(fields[part].annotation)
    if problems:
        raise SettingsError(
            "\n".join(["invalid configuration in SLUICE_* environment:", *problems])
        )


def _section(annotation: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def load_settings(
    config_file: Path | None = None, environ: Mapping[str, str] | None = None, **overrides: Any
) -> Settings:
    """Settings from `config_file`, the environment and `overrides` (CLI flags, None ignored)."""
    check_environment(os.environ if environ is None else environ)
    token = _YamlSource.data.set(read_yaml(config_file) if config_file else {})
    flags = {key: value for key, value in overrides.items() if value is not None}
    try:
        return Settings(**flags)
    except ValidationError as exc:
        source = f"{config_file}, " if config_file else ""
        source += "SLUICE_* environment or flags"
        raise SettingsError(describe(exc, Settings, source=source)) from exc
    finally:
        _YamlSource.data.reset(token)


def describe(exc: ValidationError, model: type[BaseModel], source: str) -> str:
    """One line per problem: the dotted key, what is wrong, what was received, what is allowed."""
    lines = [f"invalid configuration in {source}:"]
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"])
        message = error["msg"]
        variable = "SLUICE_" + "__".join(str(part) for part in error["loc"]).upper()
        if variable in os.environ:
            key = f"{key} (from {variable})"
        if error["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, error["loc"][:-1])
            message = f"unknown key; allowed keys here: {', '.join(allowed)}"
        elif "input" in error and not isinstance(error["input"], dict):
            message = f"{message} (got {error['input']!r})"
        lines.append(f"  {key}: {message}")
    return "\n".join(lines)


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    current: Any = model
    for part in loc:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = field.annotation
        args = getattr(current, "__args__", ())
        if args:  # dict[str, X] / X | None: descend into the model argument
            current = next(
                (a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), current
            )
    return sorted(getattr(current, "model_fields", {}))
