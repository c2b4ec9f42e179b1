"""server.auth_headers: the API key read from HTTP headers or gRPC metadata."""

from __future__ import annotations

import pytest

from engine.errors import InvalidInput, Unauthenticated
from server.auth_headers import UniqueHeaders, api_key_from_headers


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
