from __future__ import annotations

import asyncio
import logging
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from engine.auth import Authenticator, digest_key
from engine.errors import InvalidApiKey, Unauthenticated
from engine.keys_file import KeyFileWatcher, parse_keys, read_keys, write_keys
from engine.settings import ApiKey, AuthSettings, SettingsError
from server.bind import ensure_safe_bind


def entry(name: str, key: str, tenant: str = "acme", **extra: object) -> dict[str, object]:
    return {"name": name, "digest": digest_key(key), "tenant": tenant, **extra}


def keys_yaml(*entries: dict[str, object]) -> str:
    return yaml.safe_dump({"keys": list(entries)})


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("keys: [ {name: a", "not YAML"),
        ("- just a list", "expected a mapping with 'keys', got list"),
        ("keys:\n  - {digest: 'sha256:00', tenant: t, name: a}", "keys.0.digest"),
        (keys_yaml({"digest": digest_key("k"), "tenant": "t"}), "keys.0.name: Field required"),
        (keys_yaml(entry("a", "k1"), entry("a", "k2")), "key name 'a' is listed twice"),
        (keys_yaml(entry("a", "k1"), entry("b", "k1")), "(keys 'a' and 'b')"),
        ("keys: []\nextra: 1", "extra: unknown key; allowed keys here: keys"),
    ],
)
def test_broken_key_files_name_the_problem(text: str, problem: str) -> None:
    with pytest.raises(SettingsError) as caught:
        parse_keys(text, source="keys.yaml")
    assert problem in str(caught.value)
    assert str(caught.value).startswith(("keys.yaml", "invalid configuration in keys.yaml"))


def test_an_empty_file_has_no_keys() -> None:
    assert parse_keys("", source="f") == []
    assert parse_keys("keys: []", source="f") == []


def test_write_then_read_round_trips_and_is_private(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    keys = parse_keys(keys_yaml(entry("a", "k1", expires_at="2030-01-02T03:04:05Z")), "f")
    write_keys(path, keys)
    assert read_keys(path) == keys
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind
    assert path.read_text().startswith("keys:\n- name: a\n")


def file_settings(path: Path, *static: ApiKey) -> AuthSettings:
    return AuthSettings(keys=list(static), keys_file=path)


def test_file_and_config_keys_combine(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(entry("ci", "file-key", role="admin")))
    static = ApiKey(digest=digest_key("config-key"), tenant="beta")
    authenticator = Authenticator(file_settings(path, static))
    ci = authenticator.authenticate("file-key")
    assert (ci.tenant, ci.role, ci.key_name) == ("acme", "admin", "ci")
    beta = authenticator.authenticate("config-key")
    assert (beta.tenant, beta.key_name) == ("beta", digest_key("config-key")[:19])
    assert authenticator.tenants == {"acme", "beta"}


def test_an_empty_keys_file_still_closes_the_server(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("")
    authenticator = Authenticator(file_settings(path))
    assert not authenticator.open
    with pytest.raises(Unauthenticated):
        authenticator.authenticate(None)
    with pytest.raises(Unauthenticated):
        authenticator.authenticate("anything")


def test_an_unreadable_keys_file_fails_the_start(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=r"cannot read auth.keys_file .*absent.yaml"):
        Authenticator(file_settings(tmp_path / "absent.yaml"))


def test_a_file_key_with_a_config_keys_digest_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(entry("dup", "same")))
    static = ApiKey(digest=digest_key("same"), tenant="beta")
    with pytest.raises(SettingsError, match=r"key 'dup' has the digest of auth\.keys entry"):
        Authenticator(file_settings(path, static))


def test_expired_key_says_when_it_expired(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(
        keys_yaml(
            entry("old", "old-key", expires_at="2020-01-01T00:00:00"),  # no zone: UTC
            entry("new", "new-key", expires_at="2999-01-01T00:00:00+02:00"),
        )
    )
    authenticator = Authenticator(file_settings(path))
    with pytest.raises(Unauthenticated) as caught:
        authenticator.authenticate("old-key")
    assert caught.value.message == (
        "API key 'old' (tenant 'acme') expired at 2020-01-01T00:00:00+00:00"
    )
    assert type(caught.value) is InvalidApiKey  # OpenAI's invalid_api_key for a revoked key
    assert authenticator.authenticate("new-key").key_name == "new"


def test_reload_logs_added_and_revoked_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(entry("a", "key-a")))
    authenticator = Authenticator(file_settings(path))
    caplog.set_level(logging.INFO, logger="sluice.audit")
    authenticator.reload_file(parse_keys(keys_yaml(entry("b", "key-b", tenant="beta")), "f"))
    records = [r for r in caplog.records if r.name == "sluice.audit"]
    actions = [
        (r.action, r.actor, r.subject_key, r.subject_tenant)  # type: ignore[attr-defined]
        for r in records
    ]
    assert actions == [
        ("key_added", "auth.keys_file", "b", "beta"),
        ("key_revoked", "auth.keys_file", "a", "acme"),
    ]
    # The file is the actor, the key the subject: never "key_revoked by key a".
    assert [r.getMessage() for r in records] == [
        f"keys file {path}: key_added key b (tenant beta)",
        f"keys file {path}: key_revoked key a (tenant acme)",
    ]
    assert not any(hasattr(r, "key") or hasattr(r, "tenant") for r in records)
    with pytest.raises(Unauthenticated):
        authenticator.authenticate("key-a")
    assert authenticator.authenticate("key-b").tenant == "beta"


async def test_watcher_applies_changes_and_keeps_old_keys_on_a_broken_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(entry("a", "key-a")))
    authenticator = Authenticator(file_settings(path))
    watcher = KeyFileWatcher(path, 0.01, authenticator.reload_file)
    task = asyncio.create_task(watcher.run())

    async def until(check: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 5
        while not check():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)

    def accepts(key: str) -> bool:
        try:
            authenticator.authenticate(key)
        except Unauthenticated:
            return False
        return True

    try:
        write_keys(path, parse_keys(keys_yaml(entry("b", "key-b")), "f"))
        await until(lambda: accepts("key-b") and not accepts("key-a"))
        path.write_text("keys: [ broken")
        assert not await watcher.reload(reason="test")
        assert accepts("key-b")
        path.unlink()
        assert not await watcher.reload(reason="test")
        assert accepts("key-b")
    finally:
        task.cancel()


def test_a_keys_file_counts_as_keys_for_a_public_bind(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("")
    ensure_safe_bind("0.0.0.0", file_settings(path), allow_unauthenticated=False)
    with pytest.raises(SettingsError, match=r"refusing to bind 0\.0\.0\.0"):
        ensure_safe_bind("0.0.0.0", AuthSettings(), allow_unauthenticated=False)


async def test_the_watcher_survives_a_failing_apply(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(keys_yaml(entry("a", "key-a")))
    applied: list[list[ApiKey]] = []

    def apply(keys: list[ApiKey]) -> None:
        if not applied:
            applied.append([])
            raise RuntimeError("a bug in apply")
        applied.append(keys)

    watcher = KeyFileWatcher(path, 0.01, apply)
    task = asyncio.create_task(watcher.run())
    try:
        path.write_text(keys_yaml(entry("b", "key-b")))
        deadline = time.monotonic() + 5
        while len(applied) < 1:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        write_keys(path, parse_keys(keys_yaml(entry("c", "key-c")), "f"))
        while len(applied) < 2:
            assert time.monotonic() < deadline
            assert not task.done()
            await asyncio.sleep(0.01)
        assert [key.name for key in applied[1]] == ["c"]
    finally:
        task.cancel()
