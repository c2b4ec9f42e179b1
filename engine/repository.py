"""The model repository on disk: `<root>/<name>/config.yaml`, `<root>/<name>/<version>/model.*`."""

from __future__ import annotations

import re
import stat
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InvalidInput
from engine.model_config import ModelConfig, load_model_config
from engine.settings import SettingsError

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
MODEL_FILES = {
    "onnxruntime": "model.onnx",
    "tensorrt": "model.plan",
    "tokenizer": "tokenizer.json",
    "python": "model.py",
}


def check_name(kind: str, value: str) -> str:
    """A model or version name from a client: letters, digits, `_`, `-`, `.`, never a path."""
    if not NAME_PATTERN.fullmatch(value) or value in {".", ".."}:
        raise InvalidInput(
            f"invalid {kind} name {value!r}: use 1-128 letters, digits, '_', '-' or '.', "
            "not starting with '.' or '-'"
        )
    return value


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One model folder as found on disk: its config and the version files its policy serves."""

    name: str
    path: Path
    config: ModelConfig
    versions: dict[int, Path]


class Repository:
    """Scans a model repository folder. Only names matching NAME_PATTERN are ever looked up."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def names(self) -> list[str]:
        return sorted(
            child.name
            for child in self.root.iterdir()
            if child.is_dir() and NAME_PATTERN.fullmatch(child.name)
        )

    def entry(self, name: str, config: ModelConfig | None = None) -> ModelEntry | None:
        """The model's entry, or None when the folder does not exist (or has no versions).
        `config` stands in for the folder's config.yaml (one a load request carried)."""
        path = self.root / check_name("model", name)
        if not path.is_dir():
            return None
        config = config or load_model_config(path)
        if config.backend == "pipeline":
            # No model file: the config is the model. Version folders are optional (Triton's
            # ensembles need an empty one); without any, the pipeline is version 1.
            numbered = [int(c.name) for c in path.iterdir() if c.is_dir() and _is_version(c.name)]
            served = config.version_policy.select(numbered or [1])
            return ModelEntry(name, path, config, {v: path / "config.yaml" for v in served})
        filename = MODEL_FILES[config.backend]
        found = {
            int(child.name): child / filename
            for child in path.iterdir()
            if child.is_dir() and _is_version(child.name) and (child / filename).is_file()
        }
        served = config.version_policy.select(list(found))
        return ModelEntry(name, path, config, {v: found[v] for v in served})

    def is_pipeline(self, name: str) -> bool:
        """Whether the folder's config.yaml is a pipeline's (unreadable or invalid: no, and its
        load says why)."""
        try:
            return load_model_config(self.root / check_name("model", name)).pipeline is not None
        except (SettingsError, InvalidInput):
            return False

    def files(self, name: str) -> tuple[tuple[str, int, int], ...]:
        """The cheap fingerprint of a model's folder: every file's path, size and modification
        time (ns), without reading the files (blocking: call it off the event loop). What `poll`
        mode and `on_demand`'s check of loaded models compare; a rewrite within the clock's
        granularity that keeps the size is not seen (engine/model.py's content hash would be)."""
        prints = []
        for path in (self.root / name).rglob("*"):
            try:
                found = path.stat()
            except FileNotFoundError:  # removed during the walk: not there any more
                continue
            if stat.S_ISREG(found.st_mode):
                prints.append((str(path), found.st_size, found.st_mtime_ns))
        return tuple(sorted(prints))

    def scan(self) -> dict[str, ModelEntry]:
        entries = {}
        for name in self.names():
            entry = self.entry(name)
            if entry is not None and entry.versions:
                entries[name] = entry
        return entries


def _is_version(name: str) -> bool:
    return name.isascii() and name.isdigit()  # '²'.isdigit() is true, int('²') fails
