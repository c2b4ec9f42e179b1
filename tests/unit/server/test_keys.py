from __future__ import annotations

import json

import yaml
from click.testing import CliRunner

from engine.auth import Authenticator, digest_key
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
