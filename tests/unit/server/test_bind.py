"""server.bind: which addresses the server may bind as configured."""

from __future__ import annotations

import pytest

from engine.auth import digest_key
from engine.settings import ApiKey, AuthSettings, SettingsError
from server.bind import ensure_safe_bind, is_loopback, metrics_need_key, note_metrics_key

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
