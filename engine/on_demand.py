"""`model_control_mode: on_demand`: a model loads on its first inference request, within the
memory budget (engine.budget), and idle ones are evicted to make room or after `idle_unload_s`.

Requests for the same cold model share one load; loads run off the event loop (the registry's
load opens sessions in threads), at most `max_concurrent_loads` at once; a request waits at most
its own timeout (or `load_wait_s`), behind at most `load_queue_size` others, and past either is
answered 503 with Retry-After. A failed load answers its waiters with the reason and is tried
again once the model's files change. Never evicted: a model with requests holding it (queued,
running, in a cache lookup), one loading, a pinned one (`model_memory.pinned`, or loaded by
API), a step of a resident pipeline, a generative model (its streams are not counted here)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from engine.budget import Cost, MemoryBudget
from engine.errors import EngineError, ModelNotFound, ModelNotReady, Overloaded, ShuttingDown
from engine.memory import release_free_memory
from engine.model_file import declared_specs
from engine.repository import MODEL_FILES, ModelEntry, check_name
from engine.settings import ModelMemorySettings, SettingsError
from engine.types import ModelMetadata

if TYPE_CHECKING:
    from engine.model import LoadedModel
    from engine.registry import ModelRegistry

log = logging.getLogger("sluice.on_demand")

NOT_LOADED = "not loaded; loads on its first inference request (on_demand)"
EVICTED = {
    "budget": "evicted: least recently used, to make room for another load",
    "idle": "evicted: idle for idle_unload_s",
}


class OnDemandLoader:
    """Loads, evicts and pins for one registry in `on_demand` mode."""

    def __init__(
        self, registry: ModelRegistry, memory: ModelMemorySettings, budget: MemoryBudget
    ) -> None:
        self._registry = registry
        self._memory = memory
        self.budget = budget
        self._slots = asyncio.Semaphore(memory.max_concurrent_loads)
        self._loads: dict[str, asyncio.Task[None]] = {}
        self._failed_files: dict[str, object] = {}  # name -> its files when its load failed
        self.pinned = set(memory.pinned)
        """Never evicted: `model_memory.pinned`, and models loaded by API until unloaded."""
        self.evicted: dict[str, str] = {}
        """Why a model that was resident is not (for the repository index)."""
        self._idle_task: asyncio.Task[None] | None = None
        self._released = asyncio.Event()  # set when a model's last holding request leaves
        self.waiting_for_room: dict[str, str] = {}
        """Loads waiting for a resident model to be left idle, and why (for the index)."""

    def start(self) -> None:
        if self._memory.idle_unload_s is not None:
            self._idle_task = asyncio.create_task(self._unload_idle(), name="idle-unload")

    def stop(self) -> None:
        """No more idle unloads (a drain began). Loads under way go on: the requests waiting
        for them were accepted, and are answered once the model serves."""
        if self._idle_task is not None:
            self._idle_task.cancel()

    def close(self) -> None:
        self.stop()
        for task in self._loads.values():
            task.cancel()  # its waiters are answered ShuttingDown

    def pin_generative(self) -> list[str]:
        """Pin the repository's generative models (loaded at start): their streams are served
        by the generation scheduler, which does not load models on demand."""
        found = []
        for name in self._registry.repository.names():
            entry = self._entry(name)
            if entry is not None and entry.config.generative is not None:
                found.append(name)
        self.pinned.update(found)
        return found

    def loading(self, name: str) -> bool:
        return name in self._loads

    def queued(self) -> dict[str, int]:
        """Requests waiting for each model's load (non-zero only)."""
        return {n: u.waiting for n, u in self.budget.usage.items() if u.waiting}

    @contextlib.contextmanager
    def held(self, name: str) -> Iterator[None]:
        """A request holds `name` while inside: the model is not evicted under it."""
        usage = self.budget.of(name)
        usage.in_use += 1
        usage.last_used = time.monotonic()
        try:
            yield
        finally:
            usage.in_use -= 1
            usage.last_used = time.monotonic()
            if not usage.in_use:
                self._released.set()

    # -- loading ---------------------------------------------------------------------------------

    def exists(self, name: str) -> None:
        """None for a model that is in the repository (to be loaded), else ModelNotFound (or
        InvalidInput for a name that is not one)."""
        check_name("model", name)
        if not (self._registry.repository.root / name).is_dir():
            raise ModelNotFound(name)

    async def serve(self, name: str, version: str | None, wait_s: float) -> LoadedModel:
        """The version to serve, loading the model first if it is not resident: waits at most
        `wait_s`, sharing the load with the other requests for it."""
        registry = self._registry
        self.exists(name)
        task = self._loads.get(name)
        if task is None:
            failed = any(n == name for n, _ in registry._failed)  # (a load by API clears it)
            if failed and self._failed_files.get(name) == self._files(name):
                return registry.resolve(name, version)  # the failure, until its files change
            self._failed_files.pop(name, None)
            task = self._loads[name] = asyncio.create_task(self._load(name), name=f"load-{name}")
            task.add_done_callback(lambda done: self._loaded(name, done))
        usage = self.budget.of(name)
        if usage.waiting >= self._memory.load_queue_size:
            raise Overloaded(
                f"model '{name}' is loading and {usage.waiting} requests already wait for it "
                "(model_memory.load_queue_size); retry shortly",
                retry_after_s=self._retry_after(name),
            )
        usage.waiting += 1
        try:
            async with asyncio.timeout(wait_s):
                await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():  # the server closed under the load, not this request
                raise ShuttingDown() from None
            raise
        except TimeoutError:
            raise Overloaded(
                f"model '{name}' is not loaded yet: its load is still running after this "
                f"request's wait of {wait_s:g} s; retry shortly",
                retry_after_s=self._retry_after(name),
            ) from None
        finally:
            usage.waiting -= 1
        return registry.resolve(name, version)

    def _loaded(self, name: str, task: asyncio.Task[None]) -> None:
        if self._loads.get(name) is task:
            del self._loads[name]
        if task.cancelled():
            return
        task.exception()  # retrieved: its waiters raised it (or none waited)
        if any(n == name for n, _ in self._registry._failed):
            self._failed_files[name] = self._files(name)  # retried once its files change

    def _retry_after(self, name: str) -> float:
        """About one typical cold start (at least 1 s): when a retry may find the model loaded."""
        starts = self.budget.cold_start
        return max(1.0, starts.total / starts.count) if starts.count else 1.0

    async def _load(self, name: str) -> None:
        started = time.monotonic()  # waiting for a load slot is part of a cold start
        async with self._slots:
            try:
                await self.make_room(name)
            except EngineError:
                self.budget.of(name).load_failures += 1
                raise
            await self._registry._load(name)
            await self.settle(name)
            usage = self.budget.of(name)
            if name in self._registry._models:
                usage.loads += 1
                usage.last_used = time.monotonic()
                self.evicted.pop(name, None)
                self.budget.cold_start.observe(time.monotonic() - started)
            else:
                usage.load_failures += 1

    async def make_room(self, name: str) -> None:
        """Evict idle models until `name`'s expected cost fits: its last measured cost, or
        (never loaded) the size of its files. One that cannot fit even alone is refused."""
        need = self.budget.measured.get(name) or Cost(self._file_bytes(name))
        too_large = self.budget.too_large(need)
        if too_large is not None:
            raise self._refuse(name, too_large)
        await self._evict_until(need, keep=name)

    async def settle(self, name: str) -> None:
        """After `name` loaded: its measured cost becomes its estimate, and if the measurement
        passes the budget, idle others go; if it cannot fit even alone, it is unloaded."""
        cost = self.budget.model_cost(name)
        if name not in self._registry._models:
            return
        self.budget.measured[name] = cost
        too_large = self.budget.too_large(cost)
        if too_large is not None:
            await self.evict(name, "budget")
            raise self._refuse(name, too_large)
        await self._evict_until(Cost(), keep=name)

    def _refuse(self, name: str, why: str) -> ModelNotReady:
        """A model too large for the budget even alone: its status says so until its files (or
        the budget) change."""
        reason = f"it cannot fit in the memory budget even alone: it needs {why}"
        self._registry._failed[(name, "")] = reason
        return ModelNotReady(name, "latest", reason)

    async def _evict_until(self, need: Cost, keep: str) -> None:
        """Evict idle models until `need` fits. While every resident model is in use, wait for
        one to be left idle (their requests are drained, never cut), up to `load_wait_s`."""
        deadline = time.monotonic() + self._memory.load_wait_s
        while (excess := self.budget.excess(need, keep)) is not None:
            victim = self.budget.victim(self._idle(keep))
            if victim is not None:
                await self.evict(victim, "budget")
                continue
            self._released.clear()
            self.waiting_for_room[keep] = f"waiting for room: {excess}"
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._released.wait()
            except TimeoutError:
                raise Overloaded(
                    f"no room to load model '{keep}' ({excess}): every resident model stayed "
                    f"pinned, loading or in use for {self._memory.load_wait_s:g} s "
                    "(model_memory.load_wait_s); retry shortly",
                    retry_after_s=1.0,
                ) from None
            finally:
                self.waiting_for_room.pop(keep, None)

    def _idle(self, keep: str | None) -> list[str]:
        """Resident models that may be evicted now."""
        models = self._registry._models
        steps = {
            step.model
            for versions in models.values()
            for model in versions.values()
            if model.config.pipeline is not None
            for step in model.config.pipeline.steps
        }
        idle = []
        for name, versions in models.items():
            usage = self.budget.of(name)
            if name == keep or name in self.pinned or name in steps or name in self._loads:
                continue
            if usage.in_use or usage.waiting or name in self._registry._loading:
                continue
            if any(m.generator is not None or m.batcher.queue.requests for m in versions.values()):
                continue
            idle.append(name)
        return idle

    async def evict(self, name: str, reason: str) -> None:
        """Unload `name` now: new requests load it again; its bytes leave the books once its
        sessions are closed and the allocator handed the free pages back."""
        versions = self._registry._models.pop(name, {})
        if not versions:
            return
        usage = self.budget.of(name)
        usage.evictions[reason] = usage.evictions.get(reason, 0) + 1
        self.evicted[name] = EVICTED[reason]
        log.info("evicting model '%s' (%s)", name, EVICTED[reason])
        await self._registry._retire(list(versions.values()))
        self.budget.forget(name)
        await asyncio.to_thread(release_free_memory)

    async def _unload_idle(self) -> None:
        idle_s = self._memory.idle_unload_s
        assert idle_s is not None
        while True:
            await asyncio.sleep(min(idle_s / 4, 1.0))
            for name in self._idle(None):
                # Checked again at each: while the last one closed, this one may have been
                # pinned or begun a reload by API (a request taking it renews its last use).
                idle = name in self._idle(None)
                if idle and time.monotonic() - self.budget.of(name).last_used >= idle_s:
                    await self.evict(name, "idle")

    # -- answers without loading -----------------------------------------------------------------

    def loadable(self, name: str, version: str | None) -> bool:
        """Readiness of a model not resident: its folder serves the version asked for (any,
        without one) and its last load did not fail; a request would load it."""
        if any(n == name for n, _ in self._registry._failed):
            return False
        entry = self._entry(name)
        if entry is None or not entry.versions:
            return False
        return not version or (version.isdigit() and int(version) in entry.versions)

    def not_loaded(self, name: str, version: str | None) -> ModelNotReady:
        """What a config request for a model never loaded answers: why it is not."""
        failed = [r for (n, _), r in sorted(self._registry._failed.items()) if n == name]
        return ModelNotReady(
            name, version or "latest", f"failed to load: {failed[0]}" if failed else NOT_LOADED
        )

    async def metadata(self, name: str, version: str | None) -> ModelMetadata:
        """The metadata of a model never loaded, from its model file's declared inputs and
        outputs (engine.model_file: the weights are not read). ONNX models only; others answer
        why they cannot be described before their first load."""
        check_name("model", name)
        entry = self._entry(name)
        if entry is None or not entry.versions:
            raise self.not_loaded(name, version) if entry else ModelNotFound(name)
        served = sorted(entry.versions)
        chosen = max(served) if not version else int(version) if version.isdigit() else None
        if chosen not in entry.versions:
            check_name("version", version or "")
            raise ModelNotFound(name, version, available=[str(v) for v in served])
        if entry.config.backend != "onnxruntime" or entry.config.pipeline is not None:
            raise self.not_loaded(name, version)
        try:
            inputs, outputs = await asyncio.to_thread(declared_specs, entry.versions[chosen])
        except (OSError, ValueError) as exc:
            raise ModelNotReady(name, str(chosen), f"its model file cannot be read: {exc}") from exc
        versions = tuple(str(v) for v in served)
        return ModelMetadata(name, versions, "onnxruntime_onnx", inputs, outputs)

    def _entry(self, name: str) -> ModelEntry | None:
        try:
            return self._registry.repository.entry(name, self._registry._configs.get(name))
        except (SettingsError, EngineError, OSError):
            return None

    # -- the model's files -----------------------------------------------------------------------

    def _files(self, name: str) -> object:
        folder = self._registry.repository.root / name
        try:
            return tuple(sorted((str(p), p.stat().st_mtime_ns) for p in folder.rglob("*")))
        except OSError:
            return None

    def _file_bytes(self, name: str) -> int:
        """The size of the files of the versions the model's policy serves: the estimate of
        a model never loaded (its measured cost replaces it after its first load)."""
        entry = self._entry(name)  # None: the load reports why
        if entry is None or entry.config.backend not in MODEL_FILES:
            return 0
        files = [p for path in entry.versions.values() for p in path.parent.rglob("*")]
        return sum(p.stat().st_size for p in files if p.is_file())
