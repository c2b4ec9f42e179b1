"""A generative model's key/value cache in the memory budget (engine.budget).

A generative version costs its session, measured like any model's across its load, plus the
key/value cache its sequences may hold, which is not allocated at load (sequences reserve it as
they run) and so is not in that measurement. That part is computed from the configuration, the
most the version may take, and added to its cost:

- sluice's own decoder loop (engine/generation/scheduler.py): its `kv_cache_bytes`, the budget
  its cache manager hands out (slots and prefix-cache blocks, host numpy arrays, whatever
  device the decoder runs on);
- onnxruntime-genai (engine/generation/genai.py): a whole context per place of the decode
  batch, `max_running_sequences x context_length x layers x kv_heads x head_size x 2 x` the
  cache's element size, on the device the Engine runs on.

Computed rather than measured because a measurement would see only what the sequences running
at that moment hold: the budget must keep room for the most they can take, or a burst of long
streams would pass it."""

from __future__ import annotations

import json
from collections.abc import Callable, Sized
from typing import TYPE_CHECKING, Any, Protocol, cast

from engine.backends.base import CPU_PROVIDER
from engine.budget import Cost
from engine.generation.genai import GENAI_CONFIG, is_genai_folder, kv_budget_bytes

if TYPE_CHECKING:
    from pathlib import Path

    from engine.model import LoadedModel
    from engine.repository import ModelEntry, Repository


class _Cache(Protocol):
    @property
    def budget_bytes(self) -> int: ...


class _Scheduler(Protocol):
    """What both generation schedulers show of their sequences and cache."""

    @property
    def running(self) -> Sized: ...
    @property
    def waiting(self) -> Sized: ...
    @property
    def cache(self) -> _Cache: ...


def _scheduler(model: LoadedModel) -> _Scheduler | None:
    generator = model.generator
    return None if generator is None else cast(_Scheduler, generator.scheduler)


def kv_cost(model: LoadedModel, folder: Path) -> Cost:
    """The key/value cache budget of a loaded version (its files in `folder`), on the device
    that holds it; nothing for a model that does not generate."""
    scheduler = _scheduler(model)
    if scheduler is None:
        return Cost()
    size = scheduler.cache.budget_bytes
    if not is_genai_folder(folder) or model.backend.provider == CPU_PROVIDER:
        return Cost(size)  # the loop's cache is numpy arrays on the host, wherever it runs
    return Cost(0, {_genai_device(folder): size})


def generating(model: LoadedModel) -> bool:
    """Whether the version has sequences running or waiting in its scheduler."""
    scheduler = _scheduler(model)
    return scheduler is not None and bool(len(scheduler.running) or len(scheduler.waiting))


def kv_estimate(entry: ModelEntry) -> int:
    """The key/value cache of a model's served versions, from its files before its first load
    (blocking: an onnxruntime-genai model's decoder header is read); 0 for one that does not
    generate, or whose files cannot say (its load does)."""
    total = 0
    for path in entry.versions.values():
        if is_genai_folder(path.parent):
            try:
                total += kv_budget_bytes(path.parent, entry.config.generative)
            except (OSError, ValueError, KeyError, TypeError):
                continue
        elif entry.config.generative is not None:
            total += entry.config.generative.kv_cache_bytes
    return total


def is_generative(entry: ModelEntry) -> bool:
    """Whether the model generates text: a `generative:` section, or onnxruntime-genai files."""
    if entry.config.generative is not None:
        return True
    return any(is_genai_folder(path.parent) for path in entry.versions.values())


class GenerativeScan:
    """Which models of a repository are generative, reading again only the configs of folders
    whose listing or times changed since the last scan (a scan runs every check interval)."""

    def __init__(self, repository: Repository, entry: Callable[[str], ModelEntry | None]) -> None:
        self._repository = repository
        self._entry = entry  # None for a folder that is no model (its load says why)
        self._scanned: dict[str, tuple[object, bool]] = {}  # name -> (folder key, generative)

    def scan(self) -> frozenset[str]:
        """The generative models now (blocking)."""
        found, scanned = set(), {}
        for name in self._repository.names():
            key = self._folder_key(name)
            known = self._scanned.get(name)
            if known is None or key is None or known[0] != key:
                entry = self._entry(name)
                known = (key, entry is not None and is_generative(entry))
            scanned[name] = known
            if known[1]:
                found.add(name)
        self._scanned = scanned
        return frozenset(found)

    def _folder_key(self, name: str) -> object:
        """What changes when a model's config or versions do: the times and sizes of its
        folder and of what is in it (a version folder's time changes with its files)."""
        folder = self._repository.root / name
        try:
            paths = [folder, *folder.iterdir()]
            return tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in paths)
        except OSError:
            return None


def _genai_device(folder: Path) -> int:
    """The GPU an onnxruntime-genai model runs on: its provider options' device_id, else 0."""
    try:
        genai: dict[str, Any] = json.loads((folder / GENAI_CONFIG).read_text())
        options = genai["model"]["decoder"]["session_options"]["provider_options"]
        for provider in options:
            for values in provider.values():
                if "device_id" in values:
                    return int(values["device_id"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return 0
