"""`auth.keys_file`: API keys in a YAML file of their own, changed without a restart.

    keys:
      - name: ci-bot                 # required here, unique: logs and `sluice keys revoke`
        digest: sha256:<64 hex>
        tenant: acme
        role: user                   # or admin
        models: [resnet]             # optional allow-list
        expires_at: 2027-01-01T00:00:00Z   # optional

The fields are those of `auth.keys` (engine.settings.ApiKey). `sluice keys create|revoke|list
--file F` edits the file (atomically, mode 0600); people may edit it too. The server re-reads it
on SIGHUP and when its modification time, size or inode changes (`KeyFileWatcher`); a file that
does not parse keeps the keys read before, and the reason is logged once per change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError

from engine.settings import ApiKey, SettingsError, describe
from engine.settings_sections import Section

log = logging.getLogger("sluice.auth")


class FileKey(ApiKey):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.@-]+$")
    """The key's name: unique within the file."""


class KeyFile(Section):
    keys: list[FileKey] = Field(default_factory=list)
    """The keys; an empty list (or an empty file) serves no key from this file."""


def parse_keys(text: str, source: str) -> list[ApiKey]:
    """The keys in a key file's text; SettingsError naming every problem (bad YAML, a bad field,
    a name or digest listed twice)."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise SettingsError(f"{source}: not YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"{source}: expected a mapping with 'keys', got {type(data).__name__}")
    try:
        keys = KeyFile.model_validate(data).keys
    except ValidationError as exc:
        raise SettingsError(describe(exc, KeyFile, source=source)) from exc
    names: set[str] = set()
    digests: dict[str, str] = {}
    for key in keys:
        if key.name in names:
            raise SettingsError(f"{source}: key name '{key.name}' is listed twice")
        if key.digest in digests:
            raise SettingsError(
                f"{source}: digest {key.digest[:15]}... is listed twice (keys "
                f"'{digests[key.digest]}' and '{key.name}'); each key must map to one entry"
            )
        names.add(key.name)
        digests[key.digest] = key.name
    return list(keys)


def read_keys(path: Path) -> list[ApiKey]:
    """The keys in the file at `path`; SettingsError when it cannot be read or parsed."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SettingsError(f"cannot read auth.keys_file {path}: {exc}") from exc
    return parse_keys(text, source=f"auth.keys_file {path}")


def write_keys(path: Path, keys: list[ApiKey]) -> None:
    """Replace the file at `path` with `keys`, atomically (a reader sees the old file or the new
    one, never half of one) and readable by its owner only."""
    entries = [
        {"name": key.name, **key.model_dump(mode="json", exclude_none=True)} for key in keys
    ]  # the name first: it is what people look for
    text = yaml.safe_dump({"keys": entries}, sort_keys=False)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _signature(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file does (an atomic replace changes the inode even within one
    mtime tick); None when it cannot be stat'ed."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size, stat.st_ino)


class KeyFileWatcher:
    """Re-reads a key file when it changes (polled every `interval_s`) or when asked
    (`reload()`, on SIGHUP), handing the keys to `apply`; a broken file is logged and skipped."""

    def __init__(self, path: Path, interval_s: float, apply: Callable[[list[ApiKey]], Any]) -> None:
        self.path = path
        self.interval_s = interval_s
        self._apply = apply
        self._seen = _signature(path)  # the caller read this version at start
        self._lock = asyncio.Lock()

    async def run(self) -> None:
        """Poll until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            if _signature(self.path) != self._seen:
                await self.reload(reason="changed")

    async def reload(self, reason: str) -> bool:
        """Read the file now (off the event loop) and apply it; False when it is broken."""
        async with self._lock:
            self._seen = _signature(self.path)
            try:
                keys = await asyncio.to_thread(read_keys, self.path)
                self._apply(keys)
            except SettingsError as exc:
                log.error(
                    "auth.keys_file not reloaded, the keys read before stay in force: %s",
                    exc,
                    extra={"action": "keys_reload", "reason": reason, "path": str(self.path)},
                )
                return False
            except Exception:  # a bug: log it, but never stop watching (revocations need it)
                log.exception(
                    "auth.keys_file not reloaded, the keys read before stay in force",
                    extra={"action": "keys_reload", "reason": reason, "path": str(self.path)},
                )
                return False
            return True
