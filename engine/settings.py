"""The engine's own settings (`EngineSettings`: the model repository and its control, readiness,
drain, the memory budget, batching defaults, cache, API keys, rate limits, tracing, shared
memory) and what every settings file of sluice shares: `read_yaml`, `describe` (one line per bad
key) and `SettingsError`.

The server's root (`server.settings.Settings`) composes these fields, flat at its top level,
with the front-ends' and the process's own (addresses, ports, HTTP, gRPC, TLS, workers, logs,
metrics); it reads the YAML file, the `SLUICE_*` environment and the CLI flags. Engine code takes
`EngineSettings` only. The nested sections live in `engine.settings_sections`."""

from __future__ import annotations

import os
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.settings_sections import (
    ApiKey,
    AuthSettings,
    BatchingDefaults,
    CacheSettings,
    ModelMemorySettings,
    RateLimitSettings,
    SharedMemorySettings,
    TenantLimits,
    TracingSettings,
)

# This module's own names, and the sections the engine's settings are made of
# (engine.settings_sections).
__all__ = [
    "ApiKey",
    "AuthSettings",
    "BatchingDefaults",
    "CacheSettings",
    "EngineSettings",
    "ModelMemorySettings",
    "RateLimitSettings",
    "SettingsError",
    "SharedMemorySettings",
    "TenantLimits",
    "TracingSettings",
    "describe",
    "read_yaml",
]


class EngineSettings(BaseModel):
    """The engine's fields of the server settings (the root, server.settings.Settings, holds
    these at its top level beside the front-ends' own)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

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
    drain_timeout_s: float = Field(30.0, ge=0)
    """On SIGTERM, how long queued and running requests may take to finish."""
    strict_readiness: bool = True
    """Triton's strict readiness: the server is ready only while every model asked for serves
    (one that failed to load keeps it unready). False: ready once started; a model that failed
    is unready on its own (/v2/models/<name>/ready). A failed reload that keeps the old version
    serving never drops readiness either way."""
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
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    """OpenTelemetry tracing (off unless an OTLP endpoint is set)."""
    shared_memory: SharedMemorySettings = Field(default_factory=SharedMemorySettings)
    """Triton's system and CUDA shared-memory extensions for same-host clients (off unless
    enabled)."""

    @field_validator("model_repository")
    @classmethod
    def _repository_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_dir():
            raise ValueError(f"model repository '{value}' is not a directory")
        return value


class SettingsError(Exception):
    """Settings that cannot be used; the message names every bad key."""


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
    """The keys allowed at `loc` (a field path whose parts below a `dict[str, Model]` field
    include the dict's own key, a tenant's name: skipped, it names no field)."""
    current: Any = model
    parts = iter(loc)
    for part in parts:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = field.annotation
        args = getattr(current, "__args__", ())
        if typing.get_origin(current) is dict:
            next(parts, None)  # the dict's key
        if args:  # dict[str, X] / X | None: descend into the model argument
            current = next(
                (a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), current
            )
    return sorted(getattr(current, "model_fields", {}))
