"""`sluice keys`: create API keys and compute the digest lines that go under `auth.keys`.

The server stores only `sha256:<hex>` digests, so a key is shown once, when it is created.
"""

from __future__ import annotations

import json
import re
import secrets
import sys

import click

from engine.auth import digest_key

KEY_PREFIX = "sluice_"
"""Marks sluice keys so secret scanners and people can tell them from other tokens."""

_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


def new_key() -> str:
    """A fresh random key: the prefix and 32 random bytes, URL-safe base64 (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def key_entry(digest: str, tenant: str, role: str, models: tuple[str, ...]) -> dict[str, object]:
    """One item of `auth.keys`, as the settings expect it."""
    entry: dict[str, object] = {"digest": digest, "tenant": tenant, "role": role}
    if models:
        entry["models"] = list(models)
    return entry


def _tenant(ctx: click.Context, param: click.Parameter, value: str) -> str:
    if not _TENANT.fullmatch(value):
        raise click.BadParameter(
            f"{value!r} is not a tenant name: use 1-128 letters, digits, '_', '.' or '-'"
        )
    return value


@click.group("keys")
def keys() -> None:
    """Create API keys and compute their digests for auth.keys."""


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
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead.")
def create(tenant: str, role: str, models: tuple[str, ...], as_json: bool) -> None:
    """Create a random API key for a tenant.

    Prints the key once (sluice stores only its digest) and the entry to paste under auth.keys.
    """
    key = new_key()
    entry = key_entry(digest_key(key), tenant, role, models)
    if as_json:
        click.echo(json.dumps({"key": key, **entry}))
        return
    # JSON scalars are YAML too, and quoting keeps tenants such as "1.5" or "null" strings.
    snippet = "\n".join(
        f"{'-' if i == 0 else ' '} {name}: {json.dumps(value)}"
        for i, (name, value) in enumerate(entry.items())
    )
    click.echo(f"# API key for tenant '{tenant}'. It is shown only now: store it safely.")
    click.echo(key)
    click.echo("# Add this entry under auth.keys in the server config:")
    click.echo(snippet)


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
