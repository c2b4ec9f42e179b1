"""What `on_demand` mode answers for a model that is not resident, without loading it:
readiness (a request would load it), why it is not loaded, an ONNX model's metadata from its
file's declared inputs and outputs, and the bytes a first load is expected to take."""

from __future__ import annotations

import asyncio

from engine.errors import EngineError, ModelNotFound, ModelNotReady
from engine.kv_budget import kv_estimate
from engine.model_books import ModelBooks
from engine.model_file import declared_specs
from engine.repository import MODEL_FILES, ModelEntry, check_name
from engine.settings import SettingsError
from engine.types import ModelMetadata

NOT_LOADED = "not loaded; loads on its first inference request (on_demand)"


class NotResidentAnswers:
    """The answers of engine.on_demand.OnDemandLoader for models not resident."""

    _books: ModelBooks

    def loadable(self, name: str, version: str | None) -> bool:
        """Readiness of a model not resident: its folder serves the version asked for (any,
        without one) and its last load did not fail; a request would load it."""
        if self._books.failed(name):
            return False
        entry = self._entry(name)
        if entry is None or not entry.versions:
            return False
        return not version or (version.isdigit() and int(version) in entry.versions)

    def not_loaded(self, name: str, version: str | None) -> ModelNotReady:
        """What a config request for a model never loaded answers: why it is not."""
        failed = [r for (n, _), r in sorted(self._books.failures.items()) if n == name]
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

    def _estimate(self, name: str) -> int:
        """The host bytes of a model never loaded (its measured cost replaces it after its
        first load): the size of the files of the versions its policy serves, plus the
        key/value cache of a generative one (blocking)."""
        entry = self._entry(name)  # None: the load reports why
        if entry is None or entry.config.backend not in MODEL_FILES:
            return 0
        files = [p for path in entry.versions.values() for p in path.parent.rglob("*")]
        return sum(p.stat().st_size for p in files if p.is_file()) + kv_estimate(entry)

    def _entry(self, name: str) -> ModelEntry | None:
        try:
            return self._books.repository.entry(name, self._books.load_configs.get(name))
        except (SettingsError, EngineError, OSError):
            return None
