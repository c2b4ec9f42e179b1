"""`model_control_mode: on_demand`: a model loads on its first inference request, within the
memory budget (engine.budget), and idle ones are evicted to make room or after `idle_unload_s`.

Requests for the same cold model share one load; loads run off the event loop (the registry's
load opens sessions in threads), at most `max_concurrent_loads` at once; a request waits at most
its own timeout (or `load_wait_s`), behind at most `load_queue_size` others, and past either is
answered 503 with Retry-After. A failed load answers its waiters with the reason and is tried
again once the model's files change. Never evicted: a model with requests holding it (queued,
running, in a cache lookup, a generation's stream until it ends), one loading, a pinned one
(`model_memory.pinned`, or loaded by API), a step of a resident pipeline.

Generative models live under the same rule: a generate request loads its model (the same load,
bounds and 503), and a generative version's cost adds the key/value cache it may hold
(engine.kv_budget). Every `poll_interval_s` the files of the models loaded are checked (size
and modification time, as `poll` mode does, engine.repository): a resident model whose files
changed is reloaded in place (its old version serves until the new one does), an evicted one's
last load is forgotten, so its next request loads the new files."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING

from engine.budget import Cost, MemoryBudget
from engine.errors import EngineError, ModelNotFound, ModelNotReady, Overloaded, ShuttingDown
from engine.kv_budget import GenerativeScan, generating, is_generative
from engine.memory import release_free_memory
from engine.model_books import ModelBooks
from engine.on_demand_answers import NotResidentAnswers
from engine.repository import check_name
from engine.settings import ModelMemorySettings

if TYPE_CHECKING:
    from engine.model import LoadedModel

log = logging.getLogger("sluice.on_demand")

EVICTED = {
    "budget": "evicted: least recently used, to make room for another load",
    "idle": "evicted: idle for idle_unload_s",
    "changed": "evicted: its files changed (too large to reload beside its old version)",
}


class OnDemandLoader(NotResidentAnswers):
    """Loads, evicts and pins for one registry in `on_demand` mode: reads its books, and loads
    and retires versions through the `load` and `retire` it hands over (engine.registry)."""

    def __init__(
        self,
        books: ModelBooks,
        load: Callable[[str], Awaitable[None]],
        retire: Callable[[list[LoadedModel]], Awaitable[None]],
        memory: ModelMemorySettings,
        budget: MemoryBudget,
        check_files_s: float,
    ) -> None:
        self._books = books
        self._load_model = load
        self._retire = retire
        self._memory = memory
        self.budget = budget
        self._slots = asyncio.Semaphore(memory.max_concurrent_loads)
        self._loads: dict[str, asyncio.Task[None]] = {}
        self._failed_files: dict[str, object] = {}  # name -> its files when its load failed
        self._check_files_s = check_files_s
        self._loaded_files: dict[str, object] = {}  # name -> its files when its last load began
        self.generative: frozenset[str] = frozenset()
        """The repository's generative models, resident or not (rescanned with the files)."""
        self._generative = GenerativeScan(books.repository, self._entry)
        self.pinned = set(memory.pinned)
        """Never evicted: `model_memory.pinned`, and models loaded by API until unloaded."""
        self.evicted: dict[str, str] = {}
        """Why a model that was resident is not (for the repository index)."""
        self._idle_task: asyncio.Task[None] | None = None
        self._files_task: asyncio.Task[None] | None = None
        self._released = asyncio.Event()  # set when a model's last holding request leaves
        self.waiting_for_room: dict[str, str] = {}
        """Loads waiting for a resident model to be left idle, and why (for the index)."""

    async def start(self) -> None:
        self.generative = await asyncio.to_thread(self._generative.scan)
        if self._memory.idle_unload_s is not None:
            self._idle_task = asyncio.create_task(self._unload_idle(), name="idle-unload")
        self._files_task = asyncio.create_task(self._check_files(), name="check-files")

    def stop(self) -> None:
        """No more idle unloads nor reloads (a drain began). Loads under way go on: the
        requests waiting for them were accepted, and are answered once the model serves."""
        for task in (self._idle_task, self._files_task):
            if task is not None:
                task.cancel()

    def close(self) -> None:
        self.stop()
        for task in self._loads.values():
            task.cancel()  # its waiters are answered ShuttingDown

    def is_generative(self, name: str) -> bool:
        """Whether `name` is a generative model of the repository (ModelNotFound for a name
        that is no model): a generate request loads only those."""
        self.exists(name)
        if name in self.generative:
            return True
        entry = self._entry(name)  # one added since the last scan
        return entry is not None and is_generative(entry)

    def loading(self, name: str) -> bool:
        return name in self._loads

    def queued(self) -> dict[str, int]:
        """Requests waiting for each model's load (non-zero only)."""
        return {n: u.waiting for n, u in self.budget.usage.items() if u.waiting}

    @contextlib.contextmanager
    def held(self, name: str) -> Iterator[None]:
        """A request holds `name` while inside: the model is not evicted under it."""
        release = self.hold(name)
        try:
            yield
        finally:
            release()

    def hold(self, name: str) -> Callable[[], None]:
        """Hold `name` until the returned function is called (once; later calls do nothing):
        what a generation's stream does from its start to its end."""
        usage = self.budget.of(name)
        usage.in_use += 1
        usage.last_used = time.monotonic()
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                usage.in_use -= 1
                usage.last_used = time.monotonic()
                if not usage.in_use:
                    self._released.set()

        return release

    # -- loading ---------------------------------------------------------------------------------

    def exists(self, name: str) -> None:
        """None for a model that is in the repository (to be loaded), else ModelNotFound (or
        InvalidInput for a name that is not one)."""
        check_name("model", name)
        if not (self._books.repository.root / name).is_dir():
            raise ModelNotFound(name)

    async def serve(self, name: str, version: str | None, wait_s: float) -> LoadedModel:
        """The version to serve, loading the model first if it is not resident: waits at most
        `wait_s`, sharing the load with the other requests for it."""
        books = self._books
        self.exists(name)
        task = self._loads.get(name)
        if task is None:
            failed = books.failed(name)  # (a load by API clears it)
            if failed and self._failed_files.get(name) == self._files(name):
                return books.resolve(name, version)  # the failure, until its files change
            self._failed_files.pop(name, None)
            task = self._start(name)
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
        return books.resolve(name, version)

    def _start(self, name: str, reload: bool = False) -> asyncio.Task[None]:
        kind = "reload" if reload else "load"
        task = self._loads[name] = asyncio.create_task(
            self._load(name, reload), name=f"{kind}-{name}"
        )
        task.add_done_callback(functools.partial(self._loaded, name))
        return task

    def _loaded(self, name: str, task: asyncio.Task[None]) -> None:
        if self._loads.get(name) is task:
            del self._loads[name]
        if task.cancelled():
            return
        task.exception()  # retrieved: its waiters raised it (or none waited)
        if self._books.failed(name):
            self._failed_files[name] = self._files(name)  # retried once its files change

    def _retry_after(self, name: str) -> float:
        """About one typical cold start (at least 1 s): when a retry may find the model loaded."""
        starts = self.budget.cold_start
        return max(1.0, starts.total / starts.count) if starts.count else 1.0

    async def _load(self, name: str, reload: bool = False) -> None:
        """Load `name` (or, `reload`, load its changed files while its old version serves)."""
        started = time.monotonic()  # waiting for a load slot is part of a cold start
        async with self._slots:
            try:
                await self.make_room(name)
            except EngineError:
                self.budget.of(name).load_failures += 1
                raise  # (a reload: tried again at the next check, its files noted unchanged)
            await self._load_model(name)
            await self.settle(name)
            usage = self.budget.of(name)
            failed = self._books.failed(name)
            if name in self._books.serving and not (reload and failed):
                usage.loads += 1
                usage.last_used = time.monotonic()
                self.evicted.pop(name, None)
                if not reload:
                    self.budget.cold_start.observe(time.monotonic() - started)
            else:  # (a reload that failed keeps its old version serving)
                usage.load_failures += 1

    async def make_room(self, name: str) -> None:
        """Evict idle models until `name`'s expected cost fits: its last measured cost, or
        (never loaded) the size of its files plus the key/value cache its config implies. One
        that cannot fit even alone is refused."""
        need = self.budget.measured.get(name) or Cost(await asyncio.to_thread(self._estimate, name))
        too_large = self.budget.too_large(need)
        if too_large is not None:
            raise self._refuse(name, too_large)
        await self._evict_until(need, keep=name)

    async def settle(self, name: str) -> None:
        """After `name` loaded: its measured cost becomes its estimate, and if the measurement
        passes the budget, idle others go; if it cannot fit even alone, it is unloaded."""
        cost = self.budget.model_cost(name)
        if name not in self._books.serving:
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
        self._books.failures[(name, "")] = reason
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

    def _idle(self, keep: str | None, pinned: bool = False) -> list[str]:
        """Resident models that may be evicted now (with `pinned`, pinned ones too)."""
        models = self._books.serving
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
            if name == keep or (name in self.pinned and not pinned) or name in steps:
                continue
            if name in self._loads:
                continue
            if usage.in_use or usage.waiting or name in self._books.loading:
                continue
            if any(generating(m) or m.batcher.queue.requests for m in versions.values()):
                continue
            idle.append(name)
        return idle

    async def evict(self, name: str, reason: str) -> None:
        """Unload `name` now: new requests load it again; its bytes leave the books once its
        sessions are closed and the allocator handed the free pages back."""
        versions = self._books.serving.pop(name, {})
        if not versions:
            return
        usage = self.budget.of(name)
        usage.evictions[reason] = usage.evictions.get(reason, 0) + 1
        self.evicted[name] = EVICTED[reason]
        log.info("evicting model '%s' (%s)", name, EVICTED[reason])
        await self._retire(list(versions.values()))
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

    # -- the model's files -----------------------------------------------------------------------

    async def note_files(self, name: str) -> None:
        """Called as any load of `name` begins (on demand, pinned, by API): its files then are
        what the check compares with (a change during the load is seen by the next check)."""
        self._loaded_files[name] = await asyncio.to_thread(self._files, name)

    def _files(self, name: str) -> object:
        try:
            return self._books.repository.files(name)
        except OSError:
            return None

    async def _check_files(self) -> None:
        while True:
            await asyncio.sleep(self._check_files_s)
            try:
                await self.check_files()
            except Exception:  # a file vanished mid-scan, say: check again next interval
                log.exception("checking the loaded models' files failed; trying again")

    async def check_files(self) -> None:
        """Reload each resident model whose files changed since its load began (in place:
        its old version serves until the new one loads; a reload that fails keeps it); forget
        the last load of an evicted one whose files changed (its metadata and cached answers
        were the old files'), so its next request loads the new ones. Also rescans which
        models are generative. Only loaded models' files are read: bounded by what is loaded."""
        books = self._books
        names = sorted(books.last_loaded)
        now = await asyncio.to_thread(lambda: {name: self._files(name) for name in names})
        self.generative = await asyncio.to_thread(self._generative.scan)
        for name in names:
            if name in self._loads or now[name] == self._loaded_files.setdefault(name, now[name]):
                continue  # loading (it reads the files itself), or unchanged
            if name not in books.serving:
                books.last_loaded.pop(name, None)
                self._loaded_files.pop(name, None)
                continue
            cost = self.budget.model_cost(name)
            if self.budget.too_large(cost + cost) is None:  # old and new fit together
                log.info("model '%s' changed on disk; reloading it", name)
                self._start(name, reload=True)
            elif name in self._idle(None, pinned=True):
                # Not beside its old version: unloaded, and loaded anew by its next request
                # (a pinned one at once). In use, it is tried again at the next check.
                await self.evict(name, "changed")
                books.last_loaded.pop(name, None)
                if name in self.pinned:
                    self._start(name)
