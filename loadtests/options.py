"""The settings the harness hands to the locust users.

Each setting is a custom locust command-line option backed by an environment variable, so the
harness passes them through the environment, a hand-run `locust -f ...` takes them as flags, and
in master/worker mode locust forwards the master's values to every worker (remote workers need
none of them set). This module never imports locust: the harness imports it too.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, Protocol

ENV_PREFIX = "SLUICE_LOADTEST_"


class ArgumentParserLike(Protocol):
    """The part of locust's `LocustArgumentParser` (a configargparse parser) that we call."""

    def add_argument(self, *args: Any, **kwargs: Any) -> Any: ...


# (option name, type, default, help, secret). The attribute on locust's parsed options is the
# option name with dashes turned into underscores.
_OPTIONS: tuple[tuple[str, type, object, str, bool], ...] = (
    ("sluice-model", str, "", "Model to load test (required).", False),
    ("sluice-model-version", str, "", "Model version; empty means the server's policy.", False),
    ("sluice-batch-size", int, 1, "Rows per request (size of a dynamic first dimension).", False),
    ("sluice-dynamic-size", int, 1, "Size of every other dynamic (-1) dimension.", False),
    ("sluice-cache-hit-fraction", float, 0.0, "Fraction of requests that repeat an input.", False),
    ("sluice-api-keys", str, "", "Comma-separated API keys; users take them in turn.", True),
    ("sluice-metadata", str, "", "The model's v2 metadata JSON; fetched when empty.", False),
    ("sluice-timeout-s", float, 30.0, "Per-request timeout in seconds.", False),
    ("sluice-seed", int, 0, "Seed of the repeated (cacheable) inputs.", False),
)


def env_name(option: str) -> str:
    """The environment variable behind a custom option: `sluice-model` -> SLUICE_LOADTEST_MODEL."""
    return ENV_PREFIX + option.removeprefix("sluice-").replace("-", "_").upper()


def add_arguments(parser: ArgumentParserLike) -> None:
    """Register the custom options on locust's parser (from `init_command_line_parser`)."""
    for name, kind, default, help_text, secret in _OPTIONS:
        parser.add_argument(
            f"--{name}",
            type=kind,
            default=default,
            env_var=env_name(name),
            help=help_text,
            is_secret=secret,
        )


@dataclass(frozen=True, slots=True)
class UserOptions:
    """What every load-test user needs to know; see `_OPTIONS` for the meaning of each field."""

    model: str
    model_version: str = ""
    batch_size: int = 1
    dynamic_size: int = 1
    cache_hit_fraction: float = 0.0
    api_keys: tuple[str, ...] = ()
    metadata: dict[str, Any] | None = None
    timeout_s: float = 30.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError(
                f"no model name given; set {env_name('sluice-model')} or --sluice-model"
            )
        if not 0.0 <= self.cache_hit_fraction <= 1.0:
            raise ValueError(
                f"cache hit fraction is {self.cache_hit_fraction}; allowed: 0.0 to 1.0 inclusive"
            )
        if self.batch_size < 1 or self.dynamic_size < 1:
            raise ValueError(
                f"batch size {self.batch_size} and dynamic size {self.dynamic_size} must be >= 1"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout is {self.timeout_s} s; it must be > 0")

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace | None) -> UserOptions:
        """Read locust's `environment.parsed_options`."""
        values = vars(namespace) if namespace is not None else {}
        metadata_json = values.get("sluice_metadata") or ""
        keys = values.get("sluice_api_keys") or ""
        return cls(
            model=values.get("sluice_model") or "",
            model_version=values.get("sluice_model_version") or "",
            batch_size=int(values.get("sluice_batch_size") or 1),
            dynamic_size=int(values.get("sluice_dynamic_size") or 1),
            cache_hit_fraction=float(values.get("sluice_cache_hit_fraction") or 0.0),
            api_keys=tuple(key.strip() for key in keys.split(",") if key.strip()),
            metadata=json.loads(metadata_json) if metadata_json else None,
            timeout_s=float(values.get("sluice_timeout_s") or 30.0),
            seed=int(values.get("sluice_seed") or 0),
        )

    def to_env(self) -> dict[str, str]:
        """The environment variables that make locust's parser produce these options."""
        env = {
            env_name("sluice-model"): self.model,
            env_name("sluice-model-version"): self.model_version,
            env_name("sluice-batch-size"): str(self.batch_size),
            env_name("sluice-dynamic-size"): str(self.dynamic_size),
            env_name("sluice-cache-hit-fraction"): repr(self.cache_hit_fraction),
            env_name("sluice-api-keys"): ",".join(self.api_keys),
            env_name("sluice-timeout-s"): repr(self.timeout_s),
            env_name("sluice-seed"): str(self.seed),
        }
        if self.metadata is not None:
            env[env_name("sluice-metadata")] = json.dumps(self.metadata, separators=(",", ":"))
        return env

    def api_key_for(self, user_index: int) -> str | None:
        """The key user number `user_index` sends: keys are dealt round-robin (a uniform mix)."""
        if not self.api_keys:
            return None
        return self.api_keys[user_index % len(self.api_keys)]

    def tenant_label(self, user_index: int) -> str:
        """A request-name suffix telling tenants apart in locust's stats without showing keys."""
        if len(self.api_keys) < 2:
            return ""
        return f" [tenant {user_index % len(self.api_keys) + 1}]"
