"""What `on_demand` mode answers for a model that is not resident, without loading it:
readiness (a request would load it), why it is not loaded, and an ONNX model's metadata from its
file's declared inputs and outputs."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from engine.errors import EngineError, ModelNotFound, ModelNotReady
from engine.model_file import declared_specs
from engine.repository import ModelEntry, check_name
from engine.settings import SettingsError
from engine.types import ModelMetadata

if TYPE_CHECKING:
    from engine.registry import ModelRegistry

NOT_LOADED = "not loaded; loads on its first inference request (on_demand)"


class NotResidentAnswers:
    """The answers of engine.on_demand.OnDemandLoader for models not resident."""

    _registry: ModelRegistry

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
