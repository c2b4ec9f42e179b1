"""The sections of the engine's settings, one per concern (result cache, API keys, rate limits,
batching defaults, tracing, shared memory, the model memory budget), and `Section`, the base that
forbids unknown keys and reads each field's docstring.

Apart from `engine.settings` (`EngineSettings`, and the error messages) so that each concern's
schema reads on its own; `EngineSettings` composes these sections and is where importers find
them. The front-ends' sections (metrics, TLS) are in server/settings.py.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

MiB = 1024 * 1024

MAX_LIMIT = 2**53 - 1
"""The largest rate, burst and quota: the Redis backend's script (engine/limits/admit.lua)
counts in doubles, exact up to here, while the memory backend counts in Python ints. Past it
the two disagree (a daily quota of 2^53 admitted in Redis a request the memory backend refused,
and the script takes a counter past 2^53 for planted garbage and resets it)."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class CacheSettings(Section):
    backend: Literal["memory", "redis", "tiered"] = "memory"
    """Where results are cached: in this process, in Redis (shared by replicas), or both."""
    shared_across_tenants: bool = False
    """Let one tenant's cached results answer another's identical requests. Off by default:
    a shared entry (and the `cache_hit` flag) tells a tenant what another one asked."""
    redis_url: str | None = None
    """Redis URL for the `redis` and `tiered` backends, e.g. redis://127.0.0.1:6379/0."""
    memory_bytes: int = Field(256 * MiB, gt=0)
    """Upper bound of the in-memory cache, counted in bytes of cached arrays."""
    redis_timeout_s: float = Field(0.05, gt=0, le=10)
    """Bound on every Redis call; a slower call counts as a miss (or a skipped store)."""
    namespace: str = Field("sluice", pattern=r"^[A-Za-z0-9_.:-]+$")
    """Prefix of every Redis key, so several deployments can share one Redis."""
    max_entry_bytes: int = Field(16 * MiB, gt=0)
    """Results larger than this are not cached."""
    error_log_interval_s: float = Field(30.0, gt=0)
    """Cache failures are logged at most once per this interval (all are counted)."""
    redis_retry_interval_s: float = Field(0.5, ge=0, le=60)
    """After a Redis failure, skip Redis (serve misses) this long before trying again; 0 retries
    on every call."""
    redis_max_connections: int = Field(64, gt=0, le=10000)
    """Connections to Redis per process; a call that finds none free within the timeout misses."""
    redis_max_pending_writes: int = Field(1024, gt=0)
    """Stores still on their way to Redis beyond which new stores are skipped (and counted)."""
    signing_key: SecretStr | None = Field(None, min_length=16)
    """A secret shared by the replicas (or `SLUICE_CACHE__SIGNING_KEY`): Redis entries then carry
    an HMAC-SHA256 bound to their key, and entries without a valid one are misses, so a writer
    who can reach Redis but lacks the secret cannot plant answers. Masked in logs."""


class ApiKey(Section):
    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    """`sha256:` and the hex SHA-256 of the key; `sluice keys create` prints this line."""
    tenant: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    """The tenant this key acts as (rate limits and quotas are per tenant)."""
    role: Literal["user", "admin"] = "user"
    """`admin` may also load/unload models and read configs and statistics."""
    models: list[str] | None = None
    """If set, the only models this key may use."""
    name: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.@-]+$")
    """A label for logs (admin actions name the key) and `sluice keys revoke`; required in
    `auth.keys_file`, optional here."""
    expires_at: datetime | None = None
    """When the key stops working (ISO 8601; a time without a zone is UTC); unset never."""


class AuthSettings(Section):
    keys: list[ApiKey] = Field(default_factory=list)
    """API keys. With none, the server is open (and refuses a non-loopback bind by default)."""
    # A plain default: pydantic copies it per instance, and mypy cannot type a lambda's list.
    admin_endpoints: list[Literal["repository", "config", "statistics"]] = Field(
        default=["repository"]
    )
    """Endpoint groups that need an `admin` key when keys are configured."""
    keys_file: Path | None = None
    """A YAML file of more keys (`keys:` entries with a `name`), managed by `sluice keys
    create|revoke --file`. Read at start (an unreadable file fails the start), re-read on SIGHUP
    and when it changes; a broken file keeps the keys read before. Setting it means keys are
    configured even while the file lists none."""
    keys_file_poll_interval_s: float = Field(0.5, gt=0, le=60)
    """How often `keys_file` is checked for changes (revocation takes at most this long)."""

    @field_validator("keys")
    @classmethod
    def _digests_unique(cls, keys: list[ApiKey]) -> list[ApiKey]:
        # One digest naming two tenants would make the acting tenant depend on list order.
        seen: dict[str, str] = {}
        for key in keys:
            if key.digest in seen:
                raise ValueError(
                    f"digest {key.digest[:15]}... is listed twice (tenants '{seen[key.digest]}' "
                    f"and '{key.tenant}'); each key must map to exactly one tenant"
                )
            seen[key.digest] = key.tenant
        return keys


class TenantLimits(Section):
    rate_per_s: float | None = Field(None, gt=0, le=MAX_LIMIT)
    """Sustained rate (token bucket refill) in units per second; unset means unlimited."""
    burst: float | None = Field(None, ge=1, le=MAX_LIMIT)
    """Bucket size; defaults to one second of `rate_per_s` (at least 1). A request larger than
    the bucket can never pass and is rejected as invalid input."""
    max_concurrent: int | None = Field(None, gt=0)
    """Cap on this tenant's requests in flight at once (per replica)."""
    priority: int = Field(0, ge=0)
    """Batching priority level of this tenant's requests, numbered as in Triton: 1 is the
    highest; 0 means each model's default_priority_level; a level past a model's
    priority_levels is its lowest. With API keys configured, the tenant's requests may ask for
    its level or a lower one (a larger number), never a higher one."""
    quota_per_day: int | None = Field(None, gt=0, le=MAX_LIMIT)
    """Units per UTC day. Rates, bursts and quotas stop at 2^53 - 1, where the Redis backend's
    doubles stop counting every unit."""
    quota_per_month: int | None = Field(None, gt=0, le=MAX_LIMIT)
    """Units per UTC month (at most 2^53 - 1, as quota_per_day)."""
    models: dict[str, TenantLimits] = Field(default_factory=dict)
    """Extra limits for this tenant on one model (rate, burst, concurrency)."""
    max_queue_share: float = Field(1.0, gt=0, le=1)
    """Largest share of a model's queue (in rows) this tenant may hold."""


class RateLimitSettings(Section):
    backend: Literal["memory", "redis"] = "memory"
    """Where buckets and quotas live: this process, or Redis (one limit across replicas)."""
    redis_url: str | None = None
    """Redis URL for the `redis` backend."""
    redis_timeout_s: float = Field(0.05, gt=0, le=10)
    """Bound on every Redis call."""
    fail_open: bool = True
    """Redis unreachable or slower than `redis_timeout_s`: true falls back to the local limiter
    (Redis still counts the request when it catches up); false answers 503 and the refused
    request is not charged (Redis running its admission late charges nothing, and a charge whose
    reply came late is given back)."""
    redis_retry_interval_s: float = Field(1.0, gt=0, le=300)
    """After a Redis failure, how long to skip Redis (using the fallback, or answering 503)
    before trying it again, so an outage does not add `redis_timeout_s` to every request."""
    namespace: str = Field("sluice", pattern=r"^[A-Za-z0-9_.:-]+$")
    """Prefix of every Redis key, so several deployments can share one Redis."""
    error_log_interval_s: float = Field(30.0, gt=0)
    """Redis failures are logged at most once per this interval (all are counted)."""
    unit: Literal["requests", "rows", "tokens"] = "requests"
    """What a token counts: one request, one row of the batch dimension, or one text token
    (a generation request is charged its prompt plus the completion tokens it may generate,
    max_tokens clamped to the context, at admission, and the tokens it did not generate are
    given back when it ends; other requests count their rows)."""
    default: TenantLimits = Field(default_factory=TenantLimits)
    """Limits for tenants not listed (and the anonymous tenant when no keys are set)."""
    tenants: dict[str, TenantLimits] = Field(default_factory=dict)
    """Per-tenant limits, by tenant name."""


class BatchingDefaults(Section):
    max_batch_size: int = Field(32, ge=0)
    """Rows per batch for models whose config does not say (auto-completed configs)."""
    max_queue_delay_s: float = Field(0.002, ge=0, le=10)
    """How long a batch waits for more requests after its first one."""
    max_queue_size: int = Field(4096, gt=0)
    """Rows a model version's queue holds before new requests get 503."""


class SharedMemorySettings(Section):
    enabled: bool = False
    """Serve Triton's system and CUDA shared-memory extensions: same-host clients register
    files of /dev/shm, or CUDA IPC handles of device memory they allocated, and pass tensors
    through them by name (docs/protocol/triton-extensions.md). Off, their routes and any request
    naming a region answer 403. A registered region lets its tenant read and write that file or
    memory through the server: see the threat model in the security guide."""
    max_regions_per_tenant: int = Field(64, gt=0, le=4096)
    """Regions one tenant may hold registered at once, system and CUDA ones together (each
    holds an open file or a device mapping)."""
    max_bytes_per_tenant: int = Field(4096 * MiB, gt=0)
    """Bytes one tenant's registered regions, of both kinds, may span together (their
    `byte_size`s)."""


class TracingSettings(Section):
    otlp_endpoint: str | None = Field(None, pattern=r"^https?://")
    """OTLP/HTTP traces URL, e.g. http://127.0.0.1:4318/v1/traces; unset turns tracing off
    (and nothing imports OpenTelemetry). Needs the `tracing` extra."""
    service_name: str = Field("sluice", min_length=1)
    """`service.name` of the exported spans."""
    sample_ratio: float = Field(1.0, ge=0, le=1)
    """Share of requests traced (by trace id); a caller's sampled `traceparent` is followed."""
    export_timeout_s: float = Field(5.0, gt=0, le=60)
    """Bound on one export call to the collector (spans are sent in the background)."""


class ModelMemorySettings(Section):
    """The memory budget of `model_control_mode: on_demand` (see docs/guides/many-models.md)."""

    host_bytes: int | None = Field(None, gt=0)
    """Host memory the loaded model versions may hold together, as measured (the growth of the
    bytes the C allocator holds across each load). Before a load that would pass it, idle models
    are evicted least recently used first; unset: no budget (models still load on demand)."""
    gpu_bytes: int | None = Field(None, gt=0)
    """Device memory per GPU the loaded versions may hold together (the growth of NVML's count
    of the device's memory in use across each load); unset: not budgeted."""
    max_models: int | None = Field(None, gt=0)
    """At most this many models resident at once, whatever their bytes (Ray Serve's
    multiplexing rule), as well as the byte budgets; unset: only bytes count. For comparing
    the rules (loadtests/benchmarks/many_models.py): models of mixed sizes fit a byte budget
    better than a count."""
    max_concurrent_loads: int = Field(1, gt=0, le=64)
    """Loads running at once. Each load's cost is the memory growth across it, so loads that
    overlap each count the others' growth too (an over-count, never an under-count): 1 measures
    exactly."""
    load_queue_size: int = Field(256, gt=0, le=1_000_000)
    """Requests that may wait for one model's load; the next is answered 503 with Retry-After."""
    load_wait_s: float = Field(30.0, gt=0, le=3600)
    """The longest a request without a timeout of its own waits for its model to load (a
    request's own timeout bounds its wait otherwise); past it, 503 with Retry-After."""
    idle_unload_s: float | None = Field(None, gt=0)
    """Unload a version no request used for this long (pinned ones never); unset: only the
    budget evicts."""
    pinned: list[str] = Field(default_factory=list)
    """Models loaded at start and never evicted. A server setting, not a model's: what deserves
    memory is decided per deployment (replicas sharing one repository pin different models),
    and the budget they spend is this server's."""
