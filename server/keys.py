"""`sluice keys`: create API keys, manage an `auth.keys_file`, compute digests.

The server stores only `sha256:<hex>` digests, so a key is shown once, when it is created.
`create --file F` adds the new key to a keys file, `revoke --file F NAME` removes one and
`list --file F` shows them; a server with `auth.keys_file: F` picks each change up within
`auth.keys_file_poll_interval_s` (or at once on SIGHUP), without a restart.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
import secrets
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import click
from pydantic import ValidationError

from engine.auth import digest_key
from engine.keys_file import FileKey, read_keys, write_keys
from engine.settings import ApiKey, SettingsError

KEY_PREFIX = "sluice_"
"""Marks sluice keys so secret scanners and people can tell them from other tokens."""

_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,128}$")


def new_key() -> str:
    """A fresh random key: the prefix and 32 random bytes, URL-safe base64 (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_entry(
    digest: str,
    tenant: str,
    role: str,
    models: tuple[str, ...],
    name: str | None = None,
    expires_at: datetime | None = None,
) -> dict[str, object]:
    """One item of `auth.keys` (or of a keys file), as the settings expect it."""
    entry: dict[str, object] = {"digest": digest, "tenant": tenant, "role": role}
    if models:
        entry["models"] = list(models)
    if name is not None:
        entry["name"] = name
    if expires_at is not None:
        entry["expires_at"] = expires_at.isoformat()
    return entry


def _tenant(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not _TENANT.fullmatch(value):
        raise click.BadParameter(
            f"{value!r} is not a tenant name: use 1-128 letters, digits, '_', '.' or '-'"
        )
    return value


def _name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not _NAME.fullmatch(value):
        raise click.BadParameter(
            f"{value!r} is not a key name: use 1-128 letters, digits, '_', '.', '@' or '-'"
        )
    return value


def _expiry(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError as exc:
        raise click.BadParameter(
            f"{value!r} is not an ISO 8601 time (e.g. 2027-01-01T00:00:00Z)"
        ) from exc
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@contextlib.contextmanager
def _edit(path: Path) -> Iterator[list[ApiKey]]:
    """The keys of `path` (none if it does not exist yet), written back when the block ends.
    A lock file beside it keeps two `sluice keys` commands from losing each other's change."""
    lock_path = path.with_name(f".{path.name}.lock")
    try:
        lock = open(lock_path, "a")  # noqa: SIM115 - closed below, after the write
    except OSError as exc:
        raise click.ClickException(f"cannot write beside {path}: {exc.strerror}") from exc
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            found = read_keys(path) if path.exists() else []
        except SettingsError as exc:
            raise click.ClickException(str(exc)) from exc
        yield found
        try:
            write_keys(path, found)
        except OSError as exc:
            raise click.ClickException(f"cannot write {path}: {exc.strerror}") from exc


_FILE = click.option(
    "--file",
    "file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="The auth.keys_file to add the key to (created if missing).",
)


@click.group("keys")
def keys() -> None:
    """Create API keys, manage an auth.keys_file, compute digests for auth.keys."""


@keys.command("create")
@click.option("--tenant", required=True, callback=_tenant, help="Tenant the key acts as.")
@click.option(
    "--role",
    type=click.Choice(["user", "admin"]),
    default="user",
    show_default=True,
    help="admin may also call the admin-only endpoints (auth.admin_endpoints).",
)
@click.option(
    "--model",
    "models",
    multiple=True,
    help="Allow only this model (repeat for several); default: every model.",
)
@click.option(
    "--name",
    callback=_name,
    help="The key's name in logs and for revoke (default with --file: TENANT-<digest start>).",
)
@click.option("--expires-at", callback=_expiry, help="ISO 8601 time the key stops working.")
@_FILE
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead.")
def create(
    tenant: str,
    role: str,
    models: tuple[str, ...],
    name: str | None,
    expires_at: datetime | None,
    file: Path | None,
    as_json: bool,
) -> None:
    """Create a random API key for a tenant.

    Prints the key once (sluice stores only its digest) and the entry to paste under auth.keys,
    or, with --file, adds the entry to that keys file.
    """
    key = new_key()
    digest = digest_key(key)
    if file is not None and name is None:
        name = f"{tenant}-{digest.removeprefix('sha256:')[:8]}"
    entry = key_entry(digest, tenant, role, models, name, expires_at)
    if file is not None:
        with _edit(file) as found:
            if any(existing.name == name for existing in found):
                raise click.ClickException(f"{file} already has a key named '{name}'")
            try:
                found.append(FileKey.model_validate(entry))
            except ValidationError as exc:  # pragma: no cover - the options are checked above
                raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps({"key": key, **entry}))
        return
    click.echo(f"# API key for tenant '{tenant}'. It is shown only now: store it safely.")
    click.echo(key)
    if file is not None:
        click.echo(f"# Added to {file} as '{name}'; `sluice keys revoke --file {file} {name}`")
        return
    # JSON scalars are YAML too, and quoting keeps tenants such as "1.5" or "null" strings.
    snippet = "\n".join(
        f"{'-' if i == 0 else ' '} {field}: {json.dumps(value)}"
        for i, (field, value) in enumerate(entry.items())
    )
    click.echo("# Add this entry under auth.keys in the server config:")
    click.echo(snippet)


@keys.command("revoke")
@click.option(
    "--file",
    "file",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    required=True,
    help="The auth.keys_file to remove the key from.",
)
@click.argument("name")
def revoke(file: Path, name: str) -> None:
    """Remove the key called NAME from a keys file; a server watching it refuses the key
    within auth.keys_file_poll_interval_s."""
    with _edit(file) as found:
        kept = [key for key in found if key.name != name]
        if len(kept) == len(found):
            names = ", ".join(sorted(str(key.name) for key in found)) or "none"
            raise click.ClickException(f"{file} has no key named '{name}' (it has: {names})")
        found[:] = kept
    click.echo(f"revoked '{name}' in {file}")


@keys.command("list")
@click.option(
    "--file",
    "file",
    type=click.Path(path_type=Path, dir_okay=False, exists=True),
    required=True,
    help="The auth.keys_file to list.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per key.")
def list_keys(file: Path, as_json: bool) -> None:
    """List the keys of a keys file: name, tenant, role, models, expiry (never the keys)."""
    try:
        found = read_keys(file)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from exc
    now = datetime.now(UTC)
    for key in found:
        expires = key.expires_at
        if expires is not None and expires.tzinfo is None:
            expires = expires.replace(tzinfo=UTC)
        row = {
            "name": key.name,
            "tenant": key.tenant,
            "role": key.role,
            "models": key.models,
            "expires_at": expires.isoformat() if expires else None,
            "expired": expires is not None and expires <= now,
            "digest": key.digest[:19] + "...",
        }
        if as_json:
            click.echo(json.dumps(row))
            continue
        models = ",".join(key.models) if key.models else "*"
        expiry = "never" if expires is None else row["expires_at"]
        state = " (expired)" if row["expired"] else ""
        click.echo(
            f"{key.name}\ttenant={key.tenant}\trole={key.role}\tmodels={models}\t"
            f"expires={expiry}{state}"
        )


@keys.command("digest")
@click.argument("key", required=False)
def digest(key: str | None) -> None:
    """Print the sha256:<hex> digest of an existing KEY.

    Reads the key from stdin when KEY is omitted, which keeps it out of the shell history.
    """
    if key is None:
        key = sys.stdin.readline().strip()
    if not key:
        raise click.UsageError("no key given: pass KEY or send it on stdin")
    click.echo(digest_key(key))
