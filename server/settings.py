"""Server settings: one YAML file, overridden by `SLUICE_*` environment variables, overridden by
CLI flags. Parsed once at start and passed down; unknown keys are errors.

The root (`Settings`) composes the engine's own fields (engine.settings.EngineSettings: the
repository, batching, cache, keys, limits, ...) with the front-ends' and the process's
(`ServerSettings`: addresses and ports, HTTP, gRPC, TLS, workers, logs, metrics), both flat at
its top level, so each key has one name in the YAML file, the environment and the flags. This
module also says where values come from (`load_settings`) and refuses a `SLUICE_*` variable
that names no setting (`check_environment`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from engine.settings import EngineSettings, SettingsError, describe, read_yaml
from engine.settings_sections import MiB, Section


class MetricsSettings(Section):
    enabled: bool = True
    """Serve Prometheus metrics at /metrics on the HTTP port."""
    port: int | None = Field(None, gt=0, lt=65536)
    """Also serve them on this port of their own."""
    require_key: bool | None = None
    """Whether /metrics on the HTTP port needs an admin key once keys are configured (its
    labels name tenants and models). Unset: it does when `host` is not loopback, and answers
    anyone on a loopback bind. Scrape with an admin key (Prometheus `authorization`), or
    serve the metrics on `port` instead, whose listener never asks for one: keep that port
    private. `false` answers anyone on the HTTP port."""


class TlsSettings(Section):
    cert_file: Path | None = None
    """PEM certificate chain of this server; with `key_file`, turns on HTTPS and gRPC TLS."""
    key_file: Path | None = None
    """PEM private key of `cert_file`."""
    client_ca_file: Path | None = None
    """PEM CA bundle that client certificates are verified against (mTLS)."""
    require_client_cert: bool = False
    """Refuse clients without a certificate signed by `client_ca_file`. Without it, a client
    certificate is verified only when one is sent."""

    @model_validator(mode="after")
    def _complete(self) -> TlsSettings:
        if (self.cert_file is None) != (self.key_file is None):
            given, missing = ("cert_file", "key_file")[:: 1 if self.key_file is None else -1]
            raise ValueError(f"tls.{given} is set but tls.{missing} is not; TLS needs both")
        if self.cert_file is None and (self.client_ca_file or self.require_client_cert):
            raise ValueError(
                "tls.client_ca_file and tls.require_client_cert need tls.cert_file and key_file"
            )
        if self.require_client_cert and self.client_ca_file is None:
            raise ValueError(
                "tls.require_client_cert needs tls.client_ca_file (the CA that signs client "
                "certificates)"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


class ServerSettings(BaseModel):
    """The front-ends' and the process's fields of the server settings: where and how requests
    arrive (HTTP, gRPC, TLS), the worker processes, logs and metrics."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

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
    workers: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = 1
    """Front-end worker processes sharing the HTTP and gRPC ports, in front of one engine
    process (admission, cache, batchers, backends); `auto` is one per core, at most 8. 1 serves
    everything in one process (see the worker processes guide, docs/guides/workers.md)."""
    worker_arena_bytes: int = Field(128 * MiB, ge=MiB, le=64 * 1024 * MiB)
    """Shared memory per worker and direction: the decoded inputs of a worker's requests in
    flight (and their answers) must fit; past it a request is answered 503 with Retry-After."""
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
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    """Prometheus metrics."""
    tls: TlsSettings = Field(default_factory=TlsSettings)
    """HTTPS and gRPC TLS (and mTLS); off unless `tls.cert_file` and `tls.key_file` are set.
    Certificates are re-read on SIGHUP."""


class Settings(EngineSettings, ServerSettings, BaseSettings):
    """The root of the server configuration (see configs/server.yaml for every field): the
    front-ends' fields (ServerSettings) first, then the engine's (EngineSettings)."""

    model_config = SettingsConfigDict(
        env_prefix="SLUICE_",
        env_nested_delimiter="__",
        extra="forbid",
        use_attribute_docstrings=True,
    )

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


class _YamlSource(InitSettingsSource):
    """The YAML file's values, lowest precedence; `load_settings` passes the file's mapping."""

    data: ContextVar[dict[str, Any]] = ContextVar("sluice_yaml_settings")

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls, self.data.get({}))


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
