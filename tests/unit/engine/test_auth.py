from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.auth import (
    ANONYMOUS_TENANT,
    Authenticator,
    Principal,
    UniqueHeaders,
    api_key_from_headers,
    digest_key,
    ensure_safe_bind,
    is_loopback,
    metrics_need_key,
    note_metrics_key,
)
from engine.errors import Forbidden, InvalidInput, Unauthenticated
from engine.settings import ApiKey, AuthSettings, SettingsError

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


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": "Bearer k1"},
        {"authorization": "bearer   k1 "},
        {"AUTHORIZATION": "BEARER k1"},
        {"X-API-Key": "k1"},
        {"x-api-key": " k1"},
        {"Authorization": "Bearer k1", "x-api-key": "k1"},
        {"Authorization": "Basic dXNlcjpwdw==", "x-api-key": "k1"},
        [("x-api-key", "k1"), ("user-agent", "grpc-python")],
        [("authorization", "Bearer k1")],
        [("authorization", b"Bearer k1")],
    ],
)
def test_key_from_http_headers_or_grpc_metadata(headers: object) -> None:
    assert api_key_from_headers(headers) == "k1"  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer "}, {"x-api-key": ""}, [("te", "trailers")]]
)
def test_no_key_in_headers(headers: object) -> None:
    assert api_key_from_headers(headers) is None  # type: ignore[arg-type]


def test_other_authorization_scheme_is_rejected() -> None:
    with pytest.raises(Unauthenticated) as caught:
        api_key_from_headers({"Authorization": "Basic dXNlcjpwdw=="})
    assert caught.value.message == (
        "Authorization header uses scheme 'Basic'; expected 'Bearer <key>' "
        "(or send the key as 'x-api-key: <key>')"
    )


@pytest.mark.parametrize(
    "headers",
    [
        [("x-api-key", "k1"), ("X-Api-Key", "k1")],
        [("authorization", "Bearer k1"), ("authorization", b"Bearer k2")],
    ],
)
def test_a_key_header_sent_twice_is_invalid_input(headers: object) -> None:
    # The last one winning would let a proxy and the server disagree on who is calling.
    with pytest.raises(InvalidInput) as caught:
        api_key_from_headers(headers)  # type: ignore[arg-type]
    name = "x-api-key" if "api" in str(headers) else "authorization"
    assert caught.value.message == f"header '{name}' is sent 2 times; send it once"


def test_two_different_keys_are_rejected() -> None:
    with pytest.raises(Unauthenticated, match="two different API keys sent"):
        api_key_from_headers({"Authorization": "Bearer k1", "x-api-key": "k2"})


def test_unique_headers_are_read_as_any_headers() -> None:
    """An HTTP request's headers (UniqueHeaders: lower-case, each once) give what the same
    pairs give, read only for their two credential headers."""
    for pairs in (
        {"authorization": "bearer   k1 ", "host": "x"},
        {"x-api-key": " k1", "content-type": "application/json"},
        {"authorization": "Bearer k1", "x-api-key": "k1"},
        {"host": "x", "content-length": "2"},
        {"authorization": "Bearer ", "x-api-key": ""},
    ):
        assert api_key_from_headers(UniqueHeaders(pairs)) == api_key_from_headers(pairs)
    with pytest.raises(Unauthenticated, match="scheme 'Basic'"):
        api_key_from_headers(UniqueHeaders({"authorization": "Basic dXNlcjpwdw=="}))
    with pytest.raises(Unauthenticated, match="two different API keys sent"):
        api_key_from_headers(UniqueHeaders({"authorization": "Bearer k1", "x-api-key": "k2"}))


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("example.com", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("host", "require_key", "needed"),
    [
        ("127.0.0.1", None, False),
        ("::1", None, False),
        ("0.0.0.0", None, True),
        ("10.0.0.5", None, True),
        ("sluice.example.com", None, True),
        ("0.0.0.0", False, False),
        ("127.0.0.1", True, True),
    ],
)
def test_metrics_need_a_key_off_loopback_unless_told(
    host: str, require_key: bool | None, needed: bool
) -> None:
    assert metrics_need_key(host, require_key) is needed


def test_a_public_bind_with_keys_says_metrics_need_a_key(caplog: pytest.LogCaptureFixture) -> None:
    keyed = AuthSettings(keys=[ApiKey(digest=digest_key("k"), tenant="a")])
    caplog.set_level("INFO", logger="sluice.auth")
    assert note_metrics_key("0.0.0.0", keyed, None)
    assert not note_metrics_key("127.0.0.1", keyed, None)
    assert not note_metrics_key("0.0.0.0", keyed, False)  # the operator chose
    assert not note_metrics_key("0.0.0.0", keyed, True)
    assert not note_metrics_key("0.0.0.0", AuthSettings(), None)  # no keys: nobody has one
    assert [r.getMessage() for r in caplog.records] == [
        "/metrics on the HTTP port needs an admin key (bound to 0.0.0.0 with API keys; "
        "metrics.require_key unset). Scrape with one, serve them on metrics.port, or set "
        "metrics.require_key: false"
    ]


def test_open_server_refuses_a_public_bind_unless_allowed() -> None:
    with pytest.raises(SettingsError, match=r"refusing to bind 0\.0\.0\.0 with no API keys"):
        ensure_safe_bind("0.0.0.0", AuthSettings(), allow_unauthenticated=False)
    ensure_safe_bind("0.0.0.0", AuthSettings(), allow_unauthenticated=True)
    ensure_safe_bind("127.0.0.1", AuthSettings(), allow_unauthenticated=False)
    ensure_safe_bind("0.0.0.0", auth_settings(), allow_unauthenticated=False)


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
