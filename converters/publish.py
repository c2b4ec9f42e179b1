"""Publish a converted model as a model-repository entry that `sluice serve` loads unchanged:
`<repository>/<name>/config.yaml` and `<repository>/<name>/<version>/model.onnx` (or
`model.plan`), plus `conversion.json`, the conversion report, beside the model file.

A version folder appears all at once: it is written under a hidden temporary name and renamed,
so a server polling the repository never loads a half-written model."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from converters.errors import ConversionError
from converters.spec import PadRequest
from engine.model_config import load_model_config
from engine.repository import NAME_PATTERN
from engine.settings import SettingsError


@dataclass(frozen=True)
class Published:
    """Where the entry went."""

    model_dir: Path
    version: int
    model_path: Path
    config_written: bool

    def summary(self) -> dict[str, Any]:
        """What the conversion report (`--json`) says of it."""
        return {
            "model_path": str(self.model_path),
            "version": self.version,
            "config_written": self.config_written,
        }


def check_name(name: str) -> str:
    """A model name usable as a folder and in URLs."""
    if not NAME_PATTERN.fullmatch(name):
        raise ConversionError(
            f"model name '{name}' is not allowed; use 1-128 letters, digits, '_', '-' and '.' "
            "(not starting with '.' or '-')"
        )
    return name


def versions(model_dir: Path) -> list[int]:
    """The numeric version folders of a model, ascending."""
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def build_config(
    backend: str,
    max_batch_size: int,
    preferred_batch_sizes: list[int],
    pads: list[PadRequest],
) -> dict[str, Any]:
    """A config.yaml mapping: batching on for batched models, padding only where asked."""
    config: dict[str, Any] = {"backend": backend, "max_batch_size": max_batch_size}
    if max_batch_size > 0:
        batching: dict[str, Any] = {"enabled": True}
        if preferred_batch_sizes:
            batching["preferred_batch_sizes"] = sorted(set(preferred_batch_sizes))
        if pads:
            batching["pad"] = {p.name: {"axis": p.axis, "value": p.value} for p in pads}
        config["dynamic_batching"] = batching
        # The preferred sizes too: each is the top of a TensorRT optimization profile, whose
        # context would otherwise pay its first-run cost on a real request.
        sizes = {1, max_batch_size, *preferred_batch_sizes}
        config["warmup"] = {"enabled": True, "batch_sizes": sorted(sizes)}
    else:
        config["dynamic_batching"] = {"enabled": False}
    return config


def config_text(config: dict[str, Any], header: list[str]) -> str:
    """YAML with a comment header (provenance, and the inputs/outputs read from the model)."""
    comments = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header)
    return comments + yaml.safe_dump(config, sort_keys=False)


def describe_tensors(
    inputs: list[dict[str, Any]], outputs: list[tuple[str, str, list[Any]]]
) -> list[str]:
    """Comment lines listing the model's tensors (the server reads them from the model file);
    `inputs` as the report lists them (name, datatype, shape)."""
    lines = ["Inputs and outputs come from the model file:"]
    lines += [f"  input  {i['name']}: {i['datatype']} {i['shape']}" for i in inputs]
    lines += [f"  output {name}: {datatype} {dims}" for name, datatype, dims in outputs]
    return lines


def publish(
    repository: Path,
    name: str,
    version: int | None,
    model_file: str,
    payload: bytes,
    config: str,
    report_json: str,
    replace_config: bool = False,
    extra_files: dict[str, bytes] | None = None,
) -> Published:
    """Write config.yaml (unless one exists and `replace_config` is false) and a new version;
    `extra_files` (a generative model's tokenizer files) go into the version folder too."""
    model_dir = repository / check_name(name)
    existing = versions(model_dir)
    chosen = version if version is not None else (existing[-1] + 1 if existing else 1)
    if chosen <= 0:
        raise ConversionError(f"--version must be 1 or more; got {chosen}")
    if (model_dir / str(chosen)).exists():
        raise ConversionError(
            f"version {chosen} of model '{name}' already exists in {repository}; "
            f"existing versions: {existing}; omit --version to write version {existing[-1] + 1}"
        )
    model_dir.mkdir(parents=True, exist_ok=True)
    config_path = model_dir / "config.yaml"
    write_config = replace_config or not config_path.exists()
    staging = Path(tempfile.mkdtemp(prefix=".sluice-convert-", dir=model_dir))
    try:
        (staging / "config.yaml").write_text(config)
        _check_config(staging, config_path if write_config else None)
        if not write_config:
            _check_config(model_dir, None)
        (staging / model_file).write_bytes(payload)
        for extra_name, extra_payload in (extra_files or {}).items():
            (staging / extra_name).write_bytes(extra_payload)
        (staging / "conversion.json").write_text(report_json)
        if write_config:
            os.replace(staging / "config.yaml", config_path)
        else:
            (staging / "config.yaml").unlink()
        staging.chmod(0o755)  # mkdtemp makes it 0700: the server may run as another user
        os.rename(staging, model_dir / str(chosen))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Published(model_dir, chosen, model_dir / str(chosen) / model_file, write_config)


def _check_config(folder: Path, destination: Path | None) -> None:
    try:
        load_model_config(folder)
    except SettingsError as exc:
        where = destination or folder / "config.yaml"
        raise ConversionError(f"{where} would not load in sluice serve: {exc}") from exc
