"""The loaded models: loading, unloading and polling the repository, over the books of which
versions serve and which failed and why (engine.model_books). The registry is the upper layer of
the two: in `on_demand` mode it makes the loader (engine.on_demand), hands it itself as the books
and its own load and retire, and routes requests for models not resident to it. The engine
resolves every request through `ModelRegistry.resolve`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from engine import memory
from engine.backends.python_model import refuse
from engine.budget import Cost, MemoryBudget
from engine.errors import InvalidInput, ModelNotFound
from engine.kv_budget import kv_cost
from engine.model import LoadedModel, load_model
from engine.model_books import ModelBooks
from engine.model_config import ModelConfig, load_model_config
from engine.on_demand import OnDemandLoader
from engine.on_demand_answers import NOT_LOADED
from engine.pipeline import load_pipeline
from engine.repository import ModelEntry, Repository, check_name
from engine.settings import EngineSettings, SettingsError
from engine.stats import ModelStats

log = logging.getLogger("sluice.registry")

NO_VERSION = (
    "no version folder holds the backend's model file among the versions its version_policy selects"
)


class ModelRegistry(ModelBooks):
    """Model versions by name, kept in line with the repository folder: the books
    (engine.model_books) and what loads, unloads and polls them."""

    def __init__(
        self, settings: EngineSettings, repository: Repository, tenant_share: Callable[[str], float]
    ) -> None:
        super().__init__(repository)
        self.settings = settings
        self._tenant_share = tenant_share
        self._locks: dict[str, asyncio.Lock] = {}
        self._poller: asyncio.Task[None] | None = None
        budget = settings.model_memory
        self.budget = MemoryBudget(budget.host_bytes, budget.gpu_bytes, budget.max_models)
        """Every loaded version's measured bytes (in every mode; a budget only in on_demand)."""
        self._gpu = memory.GpuMemory() if budget.gpu_bytes is not None else None
        self.on_demand = (
            OnDemandLoader(
                self, self._load, self._retire, budget, self.budget, settings.poll_interval_s
            )
            if settings.model_control_mode == "on_demand"
            else None
        )
        self._stats: dict[tuple[str, str], ModelStats] = {}  # on_demand: kept across evictions

    async def start(self) -> None:
        """Load what the model control mode says; in `poll` mode, start watching the folder."""
        mode = self.settings.model_control_mode
        # Before the loads: a folder added or changed meanwhile is then seen by the first poll
        # (taken once the poll task first ran, a folder added before it was never loaded).
        seen = await asyncio.to_thread(self._fingerprints) if mode == "poll" else {}
        names = self.repository.names()
        if mode == "explicit" and "*" not in self.settings.load_models:
            names = [check_name("model", n) for n in self.settings.load_models]
        if self.on_demand is not None:
            # The runtime's one-time cost goes into the baseline, not the first model's bytes.
            memory.map_large_blocks()
            gpus = self._gpu.devices if self._gpu is not None else 0
            await asyncio.to_thread(memory.prime_runtime, gpus)
            await self.on_demand.start()
            names = [check_name("model", n) for n in self.settings.model_memory.pinned]
        for name in sorted(names, key=self.repository.is_pipeline):  # steps before pipelines
            await self._load(name)
        if mode == "poll":
            self._poller = asyncio.create_task(self._poll(seen), name="repository-poll")

    def stop_polling(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self.on_demand is not None:
            self.on_demand.stop()

    async def close(self) -> None:
        self.stop_polling()
        if self.on_demand is not None:
            self.on_demand.close()
        for model in self.all():
            await model.close()
        self.serving.clear()

    def serving_all(self) -> bool:
        """Every model asked for serves: none is loading or failed without a version serving.
        A reload (or a failed reload) of a model whose old version still serves counts as
        serving: readiness does not flap while a repository changes."""
        asked = self.loading | {name for name, _ in self.failures}
        if self.on_demand is not None:  # a model loaded on demand is not asked for: pinned are
            asked = self.on_demand.pinned & asked
        return all(name in self.serving for name in asked)

    def versions(self, name: str) -> list[LoadedModel]:
        """The loaded (or, on_demand, last loaded) versions of `name` (ModelNotFound if none)."""
        self.describe(name, None)
        return list((self.serving.get(name) or self.last_loaded[name]).values())

    def memory_of(self, name: str, version: str) -> dict[str, int]:
        """The statistics' memory fields of one version."""
        return {"resident_bytes": self.budget.resident_bytes(name, version)}

    def memory(self) -> dict[str, object]:
        """What the metrics read of the budget: the books, per-model usage, queued loads."""
        return {
            "budget": self.budget,
            "queued": self.on_demand.queued() if self.on_demand is not None else {},
        }

    async def acquire(self, name: str, version: str | None, wait_s: float) -> LoadedModel:
        """`resolve`, except that in `on_demand` mode a model not resident is loaded first (the
        caller waits at most `wait_s`)."""
        if self.on_demand is None or name in self.serving:
            return self.resolve(name, version)
        return await self.on_demand.serve(name, version, wait_s)

    def describe(self, name: str, version: str | None) -> LoadedModel:
        """The version whose metadata and config answer for (name, version): the loaded one, or
        in `on_demand` mode the one last loaded (closed since), without loading anything."""
        if self.on_demand is None or name in self.serving:
            return self.resolve(name, version)
        if name not in self.last_loaded:
            check_name("model", name)
            if name in self.loading or not (self.repository.root / name).is_dir():
                return self.resolve(name, version)  # loading, or no such model
            raise self.on_demand.not_loaded(name, version)
        versions = self.last_loaded[name]
        if version is None or version == "":
            return versions[max(versions, key=int)]
        if version not in versions:
            raise ModelNotFound(name, version, available=sorted(versions, key=int))
        return versions[version]

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Triton's repository index: every model folder and the state of its versions."""
        rows = []
        for name in self.repository.names():
            for version in self.version_names(name):
                reason = ""
                if self.on_demand is not None:
                    reason = f"resident: {self.budget.resident_bytes(name, version)} bytes"
                rows.append({"name": name, "version": version, "state": "READY", "reason": reason})
            failed = sorted((v, r) for (n, v), r in self.failures.items() if n == name)
            for version, reason in failed:
                rows.append(
                    {"name": name, "version": version, "state": "UNAVAILABLE", "reason": reason}
                )
            on_demand = self.on_demand
            if name in self.loading or (on_demand is not None and on_demand.loading(name)):
                why = on_demand.waiting_for_room.get(name, "") if on_demand is not None else ""
                rows.append({"name": name, "version": "", "state": "LOADING", "reason": why})
            elif name not in self.serving and not failed:
                rows.append(
                    {"name": name, "version": "", "state": "UNAVAILABLE", "reason": self._why(name)}
                )
        return [row for row in rows if row["state"] == "READY"] if ready_only else rows

    def _why(self, name: str) -> str:
        """Why a model without a failure is not loaded."""
        if self.on_demand is None:
            return "unloaded"
        return self.on_demand.evicted.get(name, NOT_LOADED)

    async def load(self, name: str, config: ModelConfig | None = None) -> None:
        """Load (or reload) a model by API: in `explicit`, `poll` and `on_demand` modes (where
        it pins the model until it is unloaded). With `config`, it replaces the folder's
        config.yaml until the next load without one or an unload; a load that fails keeps the
        config that was in force (its versions keep serving)."""
        self._require_control()
        check_name("model", name)
        if self.on_demand is not None:
            await self.on_demand.make_room(name)
        if config is not None and name in self.serving:
            # A config that serves nothing (its backend's file or its version_policy's versions
            # are not in the folder) would retire the serving versions: refused before that.
            entry = self.repository.entry(name, config)
            if entry is None or not entry.versions:
                raise InvalidInput(f"failed to load model '{name}': {NO_VERSION}")
        before = self.load_configs.pop(name, None)
        if config is not None:
            self.load_configs[name] = config
        await self._load(name)
        if self.on_demand is not None and name in self.serving:
            self.on_demand.pinned.add(name)
            await self.on_demand.settle(name)
        failed = [reason for (n, _), reason in self.failures.items() if n == name]
        if failed:
            self.load_configs.pop(name, None)
            if before is not None:
                self.load_configs[name] = before
            raise InvalidInput(f"failed to load model '{name}': {failed[0]}")
        if name not in self.serving:
            raise ModelNotFound(name, available=self.repository.names())

    async def unload(self, name: str) -> None:
        """Unload every version of a model once its queued requests are answered."""
        self._require_control()
        check_name("model", name)
        if name not in self.serving and name not in self.repository.names():
            raise ModelNotFound(name, available=self.repository.names())
        async with self._lock(name):
            # Forgotten with the versions, not after their drain: meanwhile a new request is
            # told the model is unknown, not that a reload that changed nothing failed.
            self.clear_failures(name)
            await self._retire(list(self.serving.pop(name, {}).values()))
            self.load_configs.pop(name, None)
            self.last_loaded.pop(name, None)
            self.budget.forget(name)
            if self.on_demand is not None:
                self.on_demand.pinned.discard(name)
                self.on_demand.evicted.pop(name, None)
            await asyncio.to_thread(memory.release_free_memory)

    def _require_control(self) -> None:
        if self.settings.model_control_mode == "none":
            raise InvalidInput(
                "model control mode is 'none': loading and unloading by API needs "
                "--model-control-mode explicit, poll or on_demand"
            )

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def _load(self, name: str) -> None:
        """Bring the model's served versions in line with its folder: load new or changed
        versions, retire versions no longer served (after their in-flight requests finish)."""
        async with self._lock(name):
            self.loading.add(name)
            try:
                if self.on_demand is not None:  # what its check for changed files compares
                    await self.on_demand.note_files(name)
                try:
                    entry = self.repository.entry(name, self.load_configs.get(name))
                except SettingsError as exc:  # e.g. a config.yaml saved half-edited
                    log.error("model '%s' cannot be loaded: %s", name, exc)
                    self.clear_failures(name)
                    self.failures[(name, "")] = str(exc)
                    return
                if entry is None or not entry.versions:
                    self.clear_failures(name)
                    await self._retire(list(self.serving.pop(name, {}).values()))
                    self.budget.forget(name)
                    if entry is not None:
                        self.failures[(name, "")] = NO_VERSION
                    return
                await self._load_entry(entry)
            finally:
                self.loading.discard(name)
        if self.has(name):  # outside its lock: a pipeline's load may be waiting on this one
            await self._retry_pipelines(name)

    async def _retry_pipelines(self, step: str) -> None:
        """Pipelines that failed to load while `step` was missing or broken load once it
        serves: their own files did not change, so nothing else would retry them."""
        for name in sorted({n for n, _ in self.failures} - {step}):
            try:
                folder = self.repository.root / name
                config = self.load_configs.get(name) or load_model_config(folder)
            except SettingsError:
                continue
            if config.pipeline is not None and step in {s.model for s in config.pipeline.steps}:
                await self._load(name)

    async def _load_entry(self, entry: ModelEntry) -> None:
        self.clear_failures(entry.name)
        current = self.serving.get(entry.name, {})
        fresh: dict[str, LoadedModel] = {}
        pipeline = entry.config.pipeline
        for step in pipeline.steps if pipeline is not None else ():
            if not self.has(step.model) and not self.repository.is_pipeline(step.model):
                await self._load(step.model)  # as Triton loads an ensemble's models
        for version, path in entry.versions.items():
            try:
                if entry.config.backend == "python" and not self.settings.allow_python_models:
                    raise refuse(f"model '{entry.name}' version {version}")  # never imported
                before = await asyncio.to_thread(self._measure)
                if pipeline is not None:
                    model = await load_pipeline(
                        entry.name,
                        version,
                        path,
                        entry.config,
                        self.settings.batching,
                        self._tenant_share,
                        self.resolve,
                    )
                else:
                    stats = None  # a reload by file or API counts afresh, as in Triton
                    if self.on_demand is not None:  # an eviction is not a reload
                        stats = self._stats.setdefault((entry.name, str(version)), ModelStats())
                    model = await load_model(
                        entry.name,
                        version,
                        path,
                        entry.config,
                        self.settings.batching,
                        self._tenant_share,
                        stats,
                    )
                after = await asyncio.to_thread(self._measure)
                fresh[str(version)] = model
                # A generative version's key/value cache is reserved as sequences run, not at
                # load: the most it may take is added to what the load measured.
                self.budget.record(
                    entry.name, str(version), after - before + kv_cost(model, path.parent)
                )
            except Exception as exc:
                log.error("failed to load model '%s' version %d: %s", entry.name, version, exc)
                self.failures[(entry.name, str(version))] = f"{type(exc).__name__}: {exc}"
        if current and len(fresh) < len(entry.versions):
            # A failed reload changes nothing that serves: the versions serving now stay (also
            # when a new version's file is broken or half-written), next to those that loaded.
            fresh = {**current, **fresh}
        if fresh:
            self.serving[entry.name] = fresh
            self.last_loaded[entry.name] = fresh
        else:
            self.serving.pop(entry.name, None)
        for gone in set(current) - set(fresh):
            self.budget.costs.pop((entry.name, gone), None)
        await self._retire([m for v, m in current.items() if fresh.get(v) is not m])

    def _measure(self) -> Cost:
        """The process's memory now (blocking): a load costs the difference across it."""
        gpu = self._gpu.used_bytes() if self._gpu is not None else {}
        return Cost(memory.heap_bytes(), gpu)

    async def _retire(self, models: list[LoadedModel]) -> None:
        for model in models:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.drain_timeout_s):
                    await model.batcher.drain()
                    if model.generator is not None:  # streams finish on the old version
                        await model.generator.drain()
            await model.close()

    async def _poll(self, seen: dict[str, tuple[tuple[str, int, int], ...]]) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_interval_s)
            try:
                now = await asyncio.to_thread(self._fingerprints)
            except Exception:  # a file vanished mid-scan, say: keep polling
                log.exception("repository poll failed; trying again next interval")
                continue
            for name in sorted(set(seen) | set(now)):
                if seen.get(name) != now.get(name):
                    log.info("model '%s' changed on disk; reloading", name)
                    try:
                        await self._load(name)
                    except Exception as exc:  # one model's failure leaves the others' reloads
                        log.exception("model '%s' could not be reloaded", name)
                        self.failures[(name, "")] = f"{type(exc).__name__}: {exc}"
            seen = now

    def _fingerprints(self) -> dict[str, tuple[tuple[str, int, int], ...]]:
        return {name: self.repository.files(name) for name in self.repository.names()}
