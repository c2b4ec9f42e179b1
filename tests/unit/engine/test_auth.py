from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.auth import ANONYMOUS_TENANT, Authenticator, Principal, digest_key
from engine.errors import Forbidden, Unauthenticated
from engine.settings import ApiKey, AuthSettings

USER_KEY = "sluice_user-key"
ADMIN_KEY = "sluice_admin-key"


def auth_settings(**extra: object) -> AuthSettings:
    return AuthSettings.model_validate(
        {
            "keys": [
                {"digest": digest_key(USER_KEY), "tenant": "acme", "models": ["resnet", "bert"]},
                {"digest": digest_key(ADMIN_KEY), "tenant": "ops", "role": "admin"},
            ],
            **extra,
        }
    )


def test_digest_key_is_prefixed_sha256_hex() -> None:
    assert digest_key("abc") == (
        "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )


def test_no_keys_means_an_anonymous_admin() -> None:
    authenticator = Authenticator(AuthSettings())
    principal = authenticator.authenticate(None)
    assert authenticator.open
    assert principal == Principal(ANONYMOUS_TENANT, "admin", None, frozenset({"repository"}))
    assert authenticator.authenticate("anything") is principal
    for group in ("repository", "config", "statistics"):
        principal.require_admin(group)
    principal.check_model("whatever")


def test_missing_key_is_unauthenticated() -> None:
    authenticator = Authenticator(auth_settings())
    for missing in (None, ""):
        with pytest.raises(Unauthenticated) as caught:
            authenticator.authenticate(missing)
        assert caught.value.message == (
            "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
        )


def test_unknown_key_is_unauthenticated_with_a_distinct_message() -> None:
    with pytest.raises(Unauthenticated) as caught:
        Authenticator(auth_settings()).authenticate("sluice_wrong")
    prefix = hashlib.sha256(b"sluice_wrong").hexdigest()[:12]
    assert caught.value.message == (
        f"unknown API key (digest sha256:{prefix}...): it is not configured on this server"
    )


def test_keys_map_to_their_tenant_role_and_models() -> None:
    authenticator = Authenticator(auth_settings())
    assert not authenticator.open
    assert authenticator.tenants == {"acme", "ops"}
    user = authenticator.authenticate(USER_KEY)
    admin = authenticator.authenticate(ADMIN_KEY)
    assert (user.tenant, user.role, user.models) == ("acme", "user", ("resnet", "bert"))
    assert (admin.tenant, admin.role, admin.models) == ("ops", "admin", None)


def test_user_key_on_an_admin_group_is_forbidden() -> None:
    user = Authenticator(auth_settings()).authenticate(USER_KEY)
    with pytest.raises(Forbidden) as caught:
        user.require_admin("repository")
    assert caught.value.message == (
        "tenant 'acme' has role 'user'; repository endpoints need an admin key"
    )
    user.require_admin("statistics")  # not admin-only by default
    user.require_admin("config")


def test_admin_endpoints_setting_decides_which_groups_are_protected() -> None:
    authenticator = Authenticator(auth_settings(admin_endpoints=["statistics", "config"]))
    user = authenticator.authenticate(USER_KEY)
    user.require_admin("repository")
    for group in ("statistics", "config"):
        with pytest.raises(Forbidden, match=f"{group} endpoints need an admin key"):
            user.require_admin(group)
    authenticator.authenticate(ADMIN_KEY).require_admin("statistics")


def test_key_limited_to_other_models_is_forbidden() -> None:
    user = Authenticator(auth_settings()).authenticate(USER_KEY)
    user.check_model("resnet")
    assert user.may_use("bert")
    with pytest.raises(Forbidden) as caught:
        user.check_model("gpt")
    assert caught.value.message == "tenant 'acme' may use models [resnet, bert]; got 'gpt'"


def test_unknown_endpoint_group_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="unknown endpoint group 'models'"):
        Principal("acme", "admin").require_admin("models")  # type: ignore[arg-type]


def test_the_last_of_many_keys_still_authenticates() -> None:
    keys = [{"digest": digest_key(f"key-{i}"), "tenant": f"t{i}"} for i in range(200)]
    authenticator = Authenticator(AuthSettings.model_validate({"keys": keys}))
    assert authenticator.authenticate("key-199").tenant == "t199"
    assert authenticator.authenticate("key-0").tenant == "t0"


def test_a_digest_listed_twice_is_a_settings_error() -> None:
    digest = digest_key("k")
    with pytest.raises(ValidationError, match="is listed twice \\(tenants 'a' and 'b'\\)"):
        AuthSettings.model_validate(
            {"keys": [{"digest": digest, "tenant": "a"}, {"digest": digest, "tenant": "b"}]}
        )


def test_listeners_hear_the_keys_served_after_each_reload(tmp_path: Path) -> None:
    # What a revoked key held (its shared-memory regions) is dropped by such a listener.
    path = tmp_path / "keys.yaml"
    path.write_text("keys: []\n")
    static = ApiKey(digest=digest_key("s"), tenant="acme", name="static")
    authenticator = Authenticator(AuthSettings(keys=[static], keys_file=path))
    heard: list[frozenset[str | None]] = []
    authenticator.on_reload.append(heard.append)
    filed = [ApiKey(digest=digest_key(k), tenant="acme", name=k) for k in ("a", "b")]
    authenticator.reload_file(filed)
    authenticator.reload_file(filed[1:])
    assert heard == [frozenset({"static", "a", "b"}), frozenset({"static", "b"})]
