"""The engine facade: the only thing front-ends talk to.

infer: resolve model -> validate -> (admission) -> (result cache) -> batcher -> backend."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from engine.auth import ANONYMOUS_TENANT, Authenticator
from engine.cache import (
    CachedResult,
    Coalescer,
    ResultCache,
    build_cache,
    cache_key_async,
    cache_requested,
    copy_result,
)
from engine.demo import write_demo_repository
from engine.errors import (
    EngineError,
    Forbidden,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    ShuttingDown,
)
from engine.limits import Limiter, build_limiter
from engine.metrics import Metrics
from engine.model import LoadedModel, load_model
from engine.repository import ModelEntry, Repository, check_name
from engine.settings import Settings
from engine.tracing import build_tracing
from engine.triton_config import triton_config
from engine.types import InferRequest, InferResponse, ModelMetadata
from engine.validate import check_request

log = logging.getLogger("sluice.engine")

VERSION = "0.1.0"
EXTENSIONS = [
    "binary_tensor_data", "model_configuration", "model_repository",
    "model_repository(unload_dependents)", "statistics", "schedule_policy",
]  # fmt: skip


class Engine:
    """Loads models from the repository and answers inference requests."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._tempdir: Path | None = None
        self._repository: Repository | None = None
        self._models: dict[str, dict[str, LoadedModel]] = {}
        self._failed: dict[tuple[str, str], str] = {}  # (name, version) -> reason
        self._loading: set[str] = set()
        self._locks: dict[str, asyncio.Lock] = {}
        self._started = False
        self._draining = False
        self._poller: asyncio.Task[None] | None = None
        self._in_flight = 0
        self.metrics = Metrics(self._snapshot)
        self.tracing = build_tracing(settings.tracing)  # None: off
        self.cache: ResultCache | None = None
        self.authenticator = Authenticator(settings.auth)
        self.limiter: Limiter = build_limiter(settings.rate_limit)
        self._coalescer: Coalescer[CachedResult] = Coalescer(clone=copy_result)

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def repository(self) -> Repository:
        if self._repository is None:
            raise RuntimeError("engine not started")
        return self._repository

    async def start(self) -> None:
        """Scan the repository and load what the model control mode says."""
        root = self.settings.model_repository
        if root is None:
            self._tempdir = Path(tempfile.mkdtemp(prefix="sluice-demo-"))
            root = write_demo_repository(self._tempdir)
        self._repository = Repository(root)
        self.cache = build_cache(self.settings.cache)
        mode = self.settings.model_control_mode
        names = self.repository.names()
        if mode == "explicit" and "*" not in self.settings.load_models:
            names = [check_name("model", n) for n in self.settings.load_models]
        for name in names:
            await self._load(name)
        if mode == "poll":
            self._poller = asyncio.create_task(self._poll(), name="repository-poll")
        self._started = True

    @property
    def live(self) -> bool:
        return True

    @property
    def ready(self) -> bool:
        """Started, not draining, nothing loading, and every model that was asked for loaded."""
        return self._started and not self._draining and not self._loading and not self._failed

    @property
    def draining(self) -> bool:
        return self._draining

    async def drain(self) -> None:
        """Stop taking requests and finish every queued and running one, bounded by
        `drain_timeout_s`; whatever is still left then is answered ShuttingDown by close()."""
        self._draining = True
        if self._poller is not None:
            self._poller.cancel()
        models = self._all_models()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.drain_timeout_s):
                await asyncio.gather(*(m.batcher.drain() for m in models))
        # Whatever is still queued or running after the timeout is answered 503 now.
        await asyncio.gather(*(m.batcher.close() for m in models))

    async def close(self) -> None:
        self._draining = True
        if self._poller is not None:
            self._poller.cancel()
        for model in self._all_models():
            await model.close()
        self._models.clear()
        if self.cache is not None:
            await self.cache.close()
        await self.limiter.aclose()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.close)  # flushes spans: network, off the loop
        if self._tempdir is not None:
            shutil.rmtree(self._tempdir, ignore_errors=True)

    # -- inference -------------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        """Answer one request, or raise an EngineError saying why not."""
        self._in_flight += 1
        try:
            return await self._infer(request)
        finally:
            self._in_flight -= 1

    async def _infer(self, request: InferRequest) -> InferResponse:
        started = time.monotonic()
        if self._draining:
            raise ShuttingDown()
        model = self._resolve(request.model_name, request.model_version)
        rows = check_request(
            request, model.backend.inputs, model.backend.outputs, model.max_batch_size, model.label
        )
        tenant = request.tenant or ANONYMOUS_TENANT
        admit = self.limiter.admit(tenant, model.name, rows)
        if self.tracing is not None:
            admit = self.tracing.stage("admission", admit)
        async with await admit as admission:
            priority = self._priority(model, request.priority, tenant, admission.priority)
            return await self._admitted(model, request, rows, priority, started)

    def _priority(
        self, model: LoadedModel, asked: int | None, tenant: str, tenant_priority: int
    ) -> int:
        """The request's batching level: as asked, or the tenant's, or the model's default. With
        API keys configured, no tenant may ask for more than its own priority."""
        batching = model.config.dynamic_batching
        top = batching.priority_levels - 1
        if asked is None:
            return min(tenant_priority, top) if tenant_priority else batching.default_priority
        if not 0 <= asked <= top:
            raise InvalidInput(
                f"priority {asked} is out of range for {model.label}: it has priority levels "
                f"0 to {top}"
            )
        if not self.authenticator.open and asked > tenant_priority:
            raise Forbidden(
                f"tenant '{tenant}' may use priority up to {tenant_priority}; asked for {asked}"
            )
        return asked

    async def _admitted(
        self,
        model: LoadedModel,
        request: InferRequest,
        rows: int,
        priority: int,
        started: float,
    ) -> InferResponse:
        batching = model.config.dynamic_batching
        timeout_s = request.timeout_s or batching.default_timeout_s
        deadline = started + timeout_s if timeout_s else None
        names = request.outputs or [spec.name for spec in model.backend.outputs]
        types = {s.name: s.datatype for s in model.backend.outputs if s.name in names}

        async def compute() -> CachedResult:
            submit = model.batcher.submit(
                request.inputs, rows, priority, request.tenant or ANONYMOUS_TENANT, deadline
            )
            if self.tracing is not None:
                submit = self.tracing.batched(submit, model.last_run)
            outputs = await submit
            return CachedResult({name: outputs[name] for name in names}, types)

        parameters: dict[str, Any] = {}
        try:
            if (
                self.cache is not None
                and model.config.cache.enabled
                and cache_requested(request.parameters)
            ):
                result, hit = await self._cached(model, request, compute)
                parameters["cache_hit"] = hit
            else:
                result = await compute()
        except EngineError:
            model.stats.request_done(time.monotonic() - started, ok=False)
            raise
        model.stats.request_done(time.monotonic() - started, ok=True)
        return InferResponse(
            model_name=model.name,
            model_version=model.version,
            outputs=dict(result.outputs),
            datatypes=dict(result.datatypes),
            id=request.id,
            parameters=parameters,
        )

    async def _cached(
        self,
        model: LoadedModel,
        request: InferRequest,
        compute: Callable[[], Awaitable[CachedResult]],
    ) -> tuple[CachedResult, bool]:
        """The cached result, or one computed once for every identical request in flight."""
        assert self.cache is not None
        cache = self.cache
        key = await cache_key_async(
            self.settings.cache.namespace, model.name, model.version, model.generation,
            request.inputs, request.datatypes, request.outputs, request.parameters,
        )  # fmt: skip
        looked_up = time.monotonic()
        lookup = cache.get(key)
        hit = await (lookup if self.tracing is None else self.tracing.stage("cache", lookup))
        if hit is not None:
            model.stats.cache_hit.add(time.monotonic() - looked_up)
            return hit, True
        model.stats.cache_miss.add(time.monotonic() - looked_up)

        async def compute_and_store() -> CachedResult:
            result = await compute()
            await cache.put(key, result, model.config.cache.ttl_s)
            return result

        return await self._coalescer.run(key, compute_and_store), False

    # -- metadata --------------------------------------------------------------------------------

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "sluice", "version": VERSION, "extensions": EXTENSIONS}

    def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        model = self._resolve(name, version)
        return ModelMetadata(
            name=model.name,
            versions=tuple(sorted(self._models[name], key=int)),
            platform=model.backend.platform,
            inputs=model.backend.inputs,
            outputs=model.backend.outputs,
        )

    def model_ready(self, name: str, version: str | None = None) -> bool:
        try:
            self._resolve(name, version)
        except EngineError:
            return False
        return not self._draining

    def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        return triton_config(self._resolve(name, version))

    def loaded(self, name: str, version: str | None = None) -> LoadedModel:
        """The loaded model a request would go to (for front-ends needing config facts)."""
        return self._resolve(name, version)

    def statistics(self, name: str | None = None, version: str | None = None) -> dict[str, Any]:
        if name is None:
            models = self._all_models()
        elif version is None:
            self._resolve(name, None)
            models = list(self._models[name].values())
        else:
            models = [self._resolve(name, version)]
        return {"model_stats": [m.stats.triton(m.name, m.version) for m in models]}

    def label_for(self, name: str) -> str:
        """`name` if such a model is loaded, else a fixed label (clients cannot grow metrics)."""
        return name if name in self._models else "_unknown"

    def models(self) -> list[LoadedModel]:
        """Every loaded model version."""
        return self._all_models()

    def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        index = []
        for name in self.repository.names():
            for version in sorted(self._models.get(name, {}), key=int):
                index.append({"name": name, "version": version, "state": "READY", "reason": ""})
            for (failed, version), reason in sorted(self._failed.items()):
                if failed == name:
                    index.append(
                        {"name": name, "version": version, "state": "UNAVAILABLE", "reason": reason}
                    )
            if name in self._loading:
                index.append({"name": name, "version": "", "state": "LOADING", "reason": ""})
            elif name not in self._models and not any(f == name for f, _ in self._failed):
                index.append({"name": name, "version": "", "state": "UNAVAILABLE",
                              "reason": "unloaded"})  # fmt: skip
        return [row for row in index if row["state"] == "READY"] if ready_only else index

    # -- repository control ----------------------------------------------------------------------

    async def load_model(self, name: str) -> None:
        """Load (or reload) a model by API: only in `explicit` and `poll` modes."""
        self._require_control()
        await self._load(check_name("model", name))
        failed = [reason for (n, _), reason in self._failed.items() if n == name]
        if failed:
            raise InvalidInput(f"failed to load model '{name}': {failed[0]}")
        if name not in self._models:
            raise ModelNotFound(name, available=self.repository.names())

    async def unload_model(self, name: str) -> None:
        self._require_control()
        check_name("model", name)
        if name not in self._models and name not in self.repository.names():
            raise ModelNotFound(name, available=self.repository.names())
        async with self._lock(name):
            await self._retire(list(self._models.pop(name, {}).values()))
            self._clear_failed(name)

    # -- internals -------------------------------------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        return {
            "models": self._all_models(),
            "index": self.repository_index() if self._repository else [],
            "in_flight": self._in_flight,
            "cache": self.cache.stats if self.cache is not None else None,
            "limiter": self.limiter.counters,
        }

    def _require_control(self) -> None:
        if self.settings.model_control_mode == "none":
            raise InvalidInput(
                "model control mode is 'none': loading and unloading by API needs "
                "--model-control-mode explicit or poll"
            )

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def _clear_failed(self, name: str) -> None:
        for key in [key for key in self._failed if key[0] == name]:
            del self._failed[key]

    def _all_models(self) -> list[LoadedModel]:
        return [m for versions in self._models.values() for m in versions.values()]

    def _resolve(self, name: str, version: str | None) -> LoadedModel:
        versions = self._models.get(name)  # loaded names are valid: check only the others
        if not versions:
            check_name("model", name)
            if name in self._loading:
                raise ModelNotReady(name, version or "latest", "loading")
            raise ModelNotFound(name, available=sorted(self._models))
        if version is None or version == "":
            return versions[max(versions, key=int)]
        model = versions.get(version)
        if model is None:
            check_name("version", version)
            raise ModelNotFound(name, version, available=sorted(versions, key=int))
        return model

    async def _load(self, name: str) -> None:
        """Bring the model's served versions in line with its folder: load new or changed
        versions, retire versions no longer served (after their in-flight requests finish)."""
        async with self._lock(name):
            self._loading.add(name)
            try:
                entry = self.repository.entry(name)
                if entry is None or not entry.versions:
                    self._clear_failed(name)
                    await self._retire(list(self._models.pop(name, {}).values()))
                    if entry is not None:
                        self._failed[(name, "")] = "no version folder with a model file"
                    return
                await self._load_entry(entry)
            finally:
                self._loading.discard(name)

    async def _load_entry(self, entry: ModelEntry) -> None:
        self._clear_failed(entry.name)
        current = self._models.get(entry.name, {})
        fresh: dict[str, LoadedModel] = {}
        for version, path in entry.versions.items():
            try:
                fresh[str(version)] = await load_model(
                    entry.name, version, path, entry.config, self.settings.batching,
                    lambda tenant: self.limiter.limits_for(tenant).max_queue_share,
                )  # fmt: skip
            except Exception as exc:
                log.error("failed to load model '%s' version %d: %s", entry.name, version, exc)
                self._failed[(entry.name, str(version))] = f"{type(exc).__name__}: {exc}"
        if fresh:
            self._models[entry.name] = fresh
        else:
            self._models.pop(entry.name, None)
        await self._retire(list(current.values()))

    async def _retire(self, models: list[LoadedModel]) -> None:
        for model in models:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.drain_timeout_s):
                    await model.batcher.drain()
            await model.close()

    async def _poll(self) -> None:
        seen = self._fingerprints()
        while True:
            await asyncio.sleep(self.settings.poll_interval_s)
            now = self._fingerprints()
            for name in sorted(set(seen) | set(now)):
                if seen.get(name) != now.get(name):
                    log.info("model '%s' changed on disk; reloading", name)
                    await self._load(name)
            seen = now

    def _fingerprints(self) -> dict[str, tuple[tuple[str, float], ...]]:
        prints = {}
        for name in self.repository.names():
            folder = self.repository.root / name
            files = [p for p in folder.rglob("*") if p.is_file()]
            prints[name] = tuple(sorted((str(p), p.stat().st_mtime) for p in files))
        return prints
