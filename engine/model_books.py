"""What the registry knows of each model, and the lookup every request makes through it.

The books: the versions serving, the versions that failed to load and why, the models loading,
the versions each model last loaded (kept, closed, after an `on_demand` eviction), and the
configs that load requests carried, each a public attribute: engine.registry.ModelRegistry keeps
them (it loads, unloads and polls); engine.on_demand.OnDemandLoader reads them to decide what to
load and evict, and drives loads through the functions the registry hands it. Neither of those is
imported here."""

from __future__ import annotations

from engine.errors import ModelNotFound, ModelNotReady
from engine.model import LoadedModel
from engine.model_config import ModelConfig
from engine.repository import Repository, check_name


class ModelBooks:
    """The state of every model of one repository (see the module docstring)."""

    def __init__(self, repository: Repository) -> None:
        self.repository = repository
        self.serving: dict[str, dict[str, LoadedModel]] = {}
        """The versions serving, by model name and version."""
        self.failures: dict[tuple[str, str], str] = {}
        """Why each (name, version) failed to load since its last load ("" the folder's)."""
        self.loading: set[str] = set()
        """The models whose load is under way."""
        self.load_configs: dict[str, ModelConfig] = {}
        """Configs that load requests carried: each replaces the folder's config.yaml until a
        load without one or an unload."""
        self.last_loaded: dict[str, dict[str, LoadedModel]] = {}
        """The versions each model last loaded, kept (closed) after an eviction: metadata and
        config answer from them without loading the model again."""

    def all(self, known: bool = False) -> list[LoadedModel]:
        """Every loaded model version; with `known`, also those evicted (on_demand mode)."""
        models = {**self.last_loaded, **self.serving} if known else self.serving
        return [m for versions in models.values() for m in versions.values()]

    def version_names(self, name: str) -> tuple[str, ...]:
        return tuple(sorted(self.serving.get(name, {}), key=int))

    def has(self, name: str) -> bool:
        return name in self.serving

    def serves(self, model: LoadedModel) -> bool:
        """Whether `model` is still loaded (not retired by a reload or an unload since)."""
        versions = self.serving.get(model.name)
        return versions is not None and versions.get(model.version) is model

    def config_loaded(self, name: str) -> bool:
        """Whether a load request's config replaces the folder's config.yaml of `name`."""
        return name in self.load_configs

    def known(self, name: str) -> bool:
        """Loaded now or, in `on_demand` mode, loaded before."""
        return name in self.serving or name in self.last_loaded

    def failed(self, name: str) -> bool:
        """Whether a version of `name` (or its folder) failed to load since its last load."""
        return any(n == name for n, _ in self.failures)

    def resolve(self, name: str, version: str | None) -> LoadedModel:
        """The version a request goes to: the one named, or the highest loaded."""
        versions = self.serving.get(name)  # loaded names are valid: check only the others
        if not versions:
            check_name("model", name)
            if name in self.loading:
                raise ModelNotReady(name, version or "latest", "loading")
            failed = [reason for (n, _), reason in sorted(self.failures.items()) if n == name]
            if failed:
                raise ModelNotReady(name, version or "latest", f"failed to load: {failed[0]}")
            raise ModelNotFound(name, available=sorted(self.serving))
        if version is None or version == "":
            return versions[max(versions, key=int)]
        model = versions.get(version)
        if model is None:
            check_name("version", version)
            reason = self.failures.get((name, version))
            if reason is not None:  # its folder is there; it failed to load
                raise ModelNotReady(name, version, f"failed to load: {reason}")
            raise ModelNotFound(name, version, available=sorted(versions, key=int))
        return model

    def clear_failures(self, name: str) -> None:
        for key in [key for key in self.failures if key[0] == name]:
            del self.failures[key]
