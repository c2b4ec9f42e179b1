"""The engine's answers about models rather than with them: server and model metadata, the
front-ends' input checks, readiness, config, statistics, usage and the repository API. A part
of `Engine` (its base class), apart so that each reads on its own.

Metadata, config, statistics and the index are coroutines as the facade has them (a worker
awaits the engine process for each); here each answers at once."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from engine.errors import EngineError
from engine.limits import Limiter
from engine.model import LoadedModel
from engine.regions import SystemRegions
from engine.registry import ModelRegistry
from engine.triton_config import triton_config
from engine.types import ModelMetadata
from engine.validate import (
    InputCheck,
    check_load_parameters,
    check_unload_parameters,
    unchecked,
)

VERSION = "0.1.0"
EXTENSIONS = [
    "binary_tensor_data",
    "model_configuration",
    "model_repository",
    "model_repository(unload_dependents)",
    "statistics",
    "schedule_policy",
]


class ModelQueries:
    """Metadata, readiness, config, statistics and model control, read from the registry."""

    limiter: Limiter
    regions: SystemRegions
    _draining: bool
    _registry: ModelRegistry | None

    @property
    def registry(self) -> ModelRegistry:
        if self._registry is None:
            raise RuntimeError("engine not started")
        return self._registry

    def server_metadata(self) -> dict[str, Any]:
        extensions = EXTENSIONS + (["system_shared_memory"] if self.regions.enabled else [])
        return {"name": "sluice", "version": VERSION, "extensions": extensions}

    async def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        registry = self.registry
        if registry.on_demand is not None and not registry.known(name):
            return await registry.on_demand.metadata(name, version)  # from the file, not loaded
        model = registry.describe(name, version)
        return ModelMetadata(
            name=model.name,
            versions=tuple(sorted((m.version for m in registry.versions(name)), key=int)),
            platform=model.backend.platform,
            inputs=model.backend.inputs,
            outputs=model.backend.outputs,
        )

    def cached_input_check(self, name: str, version: str | None = None) -> InputCheck | None:
        """`input_check`'s answer, never None: the models are in this process."""
        model = self.checked_model(name, version)
        return unchecked if model is None else model.input_check

    async def input_check(self, name: str, version: str | None = None) -> InputCheck:
        model = self.checked_model(name, version)
        return unchecked if model is None else model.input_check

    def checked_model(self, name: str, version: str | None = None) -> LoadedModel | None:
        """The version whose inputs a request is checked against before it is decoded: the
        loaded one, or in `on_demand` mode the one last loaded (the request's inference loads
        it again). None for a model never loaded in `on_demand` mode: only inference loads,
        bounded by the request's own timeout, which is not decoded yet; the engine checks the
        decoded request once the model is loaded."""
        registry = self.registry
        if registry.on_demand is not None and not registry.known(name):
            return None
        return registry.describe(name, version)

    async def model_ready(self, name: str, version: str | None = None) -> bool:
        return self._serves(name, version)

    def _serves(self, name: str, version: str | None) -> bool:
        if self._draining:
            return False
        on_demand = self.registry.on_demand
        if on_demand is not None and not self.registry.has(name):
            return on_demand.loadable(name, version)  # ready: a request would load it
        try:
            model = self.registry.resolve(name, version)
        except EngineError:
            return False
        # A pipeline serves only while every one of its steps does.
        pipeline = model.config.pipeline
        return pipeline is None or all(
            self._serves(step.model, step.version) for step in pipeline.steps
        )

    async def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        """Triton's model config; parameters `sluice_config` (the config as JSON) and
        `sluice_config_source` (`load` when a load request's config replaced config.yaml, else
        `repository`)."""
        config = triton_config(self.registry.describe(name, version))
        source = "load" if self.registry.config_loaded(name) else "repository"
        config["parameters"]["sluice_config_source"] = {"string_value": source}
        return config

    async def statistics(
        self, name: str | None = None, version: str | None = None
    ) -> dict[str, Any]:
        registry = self.registry
        if name is None:
            models = registry.all(known=True)
        elif version is None:
            models = registry.versions(name)
        else:
            models = [registry.describe(name, version)]
        return {
            "model_stats": [
                # `resident_bytes`: a sluice field (gRPC's message has none; 0 once evicted).
                {**m.stats.triton(m.name, m.version), **registry.memory_of(m.name, m.version)}
                for m in models
            ]
        }

    async def usage(self, tenant: str) -> dict[str, Any]:
        """The tenant's quotas, buckets and slots now, for `GET /v2/tenants/self/usage`."""
        return await self.limiter.usage(tenant)

    def label_for(self, name: str) -> str:
        """`name` if such a model is loaded, else a fixed label (clients cannot grow metrics)."""
        return name if self._registry is not None and self._registry.known(name) else "_unknown"

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        return self.registry.index(ready_only)

    async def load_model(
        self, name: str, parameters: Mapping[str, Any] | Collection[str] = ()
    ) -> None:
        """Load (or reload) a model by API: only in `explicit` and `poll` modes. Triton's
        `config` parameter (a JSON model config) replaces the folder's config.yaml until the next
        load without one; file overrides are refused: model files come from the repository."""
        await self.registry.load(name, check_load_parameters(parameters))

    async def unload_model(self, name: str, parameters: Collection[str] = ()) -> None:
        check_unload_parameters(parameters)
        await self.registry.unload(name)
