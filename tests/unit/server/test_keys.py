from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from click.testing import CliRunner

from engine.auth import Authenticator, digest_key
from engine.keys_file import read_keys
from engine.settings import AuthSettings
from server.keys import KEY_PREFIX, keys


def test_create_prints_a_key_and_an_entry_that_authenticates() -> None:
    result = CliRunner().invoke(
        keys, ["create", "--tenant", "acme", "--model", "resnet", "--model", "bert"]
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    key = lines[1]
    assert key.startswith(KEY_PREFIX)
    assert len(key) == len(KEY_PREFIX) + 43  # 32 random bytes, URL-safe base64
    entries = yaml.safe_load("\n".join(lines[2:]))
    assert entries == [
        {"digest": digest_key(key), "tenant": "acme", "role": "user", "models": ["resnet", "bert"]}
    ]
    principal = Authenticator(AuthSettings.model_validate({"keys": entries})).authenticate(key)
    assert (principal.tenant, principal.role, principal.models) == (
        "acme",
        "user",
        ("resnet", "bert"),
    )


def test_create_admin_key_as_json() -> None:
    result = CliRunner().invoke(keys, ["create", "--tenant", "ops", "--role", "admin", "--json"])
    assert result.exit_code == 0, result.output
    created = json.loads(result.output)
    assert created["digest"] == digest_key(created["key"])
    assert (created["tenant"], created["role"], "models" in created) == ("ops", "admin", False)
    entry = {name: value for name, value in created.items() if name != "key"}
    principal = Authenticator(AuthSettings.model_validate({"keys": [entry]})).authenticate(
        created["key"]
    )
    assert principal.is_admin


def test_tenant_names_that_look_like_numbers_stay_strings() -> None:
    result = CliRunner().invoke(keys, ["create", "--tenant", "1.5"])
    entries = yaml.safe_load("\n".join(result.output.splitlines()[2:]))
    assert entries[0]["tenant"] == "1.5"


def test_every_key_is_new() -> None:
    runner = CliRunner()
    created = {
        json.loads(runner.invoke(keys, ["create", "--tenant", "a", "--json"]).output)["key"]
        for _ in range(5)
    }
    assert len(created) == 5


def test_create_rejects_a_bad_tenant_name() -> None:
    result = CliRunner().invoke(keys, ["create", "--tenant", "acme corp"])
    assert result.exit_code == 2
    assert "'acme corp' is not a tenant name" in result.output


def test_digest_of_an_argument_or_stdin() -> None:
    runner = CliRunner()
    expected = digest_key("sluice_abc") + "\n"
    assert runner.invoke(keys, ["digest", "sluice_abc"]).output == expected
    assert runner.invoke(keys, ["digest"], input="sluice_abc\n").output == expected


def test_digest_without_a_key_is_a_usage_error() -> None:
    result = CliRunner().invoke(keys, ["digest"], input="")
    assert result.exit_code == 2
    assert "no key given" in result.output


def test_create_revoke_and_list_a_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    runner = CliRunner()
    made = runner.invoke(
        keys, ["create", "--file", str(path), "--tenant", "acme", "--name", "ci", "--json"]
    )
    assert made.exit_code == 0, made.output
    key = json.loads(made.output)["key"]
    second = runner.invoke(keys, ["create", "--file", str(path), "--tenant", "beta"])
    assert second.exit_code == 0, second.output
    found = read_keys(path)
    assert [k.tenant for k in found] == ["acme", "beta"]
    assert found[0].name == "ci"
    assert found[0].digest == digest_key(key)
    generated = found[1].name
    assert generated is not None
    assert re.fullmatch(r"beta-[0-9a-f]{8}", generated)
    assert f"as '{generated}'" in second.output

    listed = runner.invoke(keys, ["list", "--file", str(path)])
    assert listed.exit_code == 0, listed.output
    assert [line.split("\t")[:2] for line in listed.output.splitlines()] == [
        ["ci", "tenant=acme"],
        [generated, "tenant=beta"],
    ]
    assert key not in listed.output

    revoked = runner.invoke(keys, ["revoke", "--file", str(path), "ci"])
    assert revoked.exit_code == 0, revoked.output
    assert [k.name for k in read_keys(path)] == [generated]
    again = runner.invoke(keys, ["revoke", "--file", str(path), "ci"])
    assert again.exit_code == 1
    assert f"has no key named 'ci' (it has: {generated})" in again.output


def test_create_refuses_a_taken_name_and_keeps_the_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    runner = CliRunner()
    args = ["create", "--file", str(path), "--tenant", "acme", "--name", "ci"]
    assert runner.invoke(keys, args).exit_code == 0
    before = path.read_text()
    taken = runner.invoke(keys, args)
    assert taken.exit_code == 1
    assert "already has a key named 'ci'" in taken.output
    assert path.read_text() == before


def test_expiry_is_stored_in_utc_and_listed_as_expired(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    runner = CliRunner()
    args = ["create", "--file", str(path), "--tenant", "acme", "--name", "old"]
    assert runner.invoke(keys, [*args, "--expires-at", "2020-01-01T00:00:00"]).exit_code == 0
    rows = runner.invoke(keys, ["list", "--file", str(path), "--json"]).output.splitlines()
    row = json.loads(rows[0])
    assert (row["expires_at"], row["expired"]) == ("2020-01-01T00:00:00+00:00", True)
    bad = runner.invoke(keys, [*args, "--expires-at", "next week"])
    assert bad.exit_code == 2
    assert "'next week' is not an ISO 8601 time" in bad.output


def test_a_broken_keys_file_is_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("keys: [ {broken")
    result = CliRunner().invoke(keys, ["create", "--file", str(path), "--tenant", "acme"])
    assert result.exit_code == 1
    assert "not YAML" in result.output
    assert path.read_text() == "keys: [ {broken"


def test_a_keys_file_in_a_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "absent" / "keys.yaml"
    result = CliRunner().invoke(keys, ["create", "--file", str(path), "--tenant", "acme"])
    assert result.exit_code == 1
    assert f"cannot write beside {path}: No such file or directory" in result.output
