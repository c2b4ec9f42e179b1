from __future__ import annotations

import pytest

from loadtests.failures import (
    CONNECTION,
    error_detail,
    failure_message,
    is_expected,
    status_of,
)


def test_expected_statuses_carry_no_detail() -> None:
    assert failure_message(429, "tenant 'a' over 50/s") == "status=429"
    assert failure_message("UNAVAILABLE", "queue full") == "status=UNAVAILABLE"


def test_unexpected_statuses_keep_the_servers_words_on_one_line() -> None:
    message = failure_message(400, "input 'x' has shape [1,4];\n model expects [-1,16]")
    assert message == "status=400: input 'x' has shape [1,4]; model expects [-1,16]"
    assert len(failure_message(500, "x" * 1000)) == len("status=500: ") + 160


@pytest.mark.parametrize(
    ("text", "status"),
    [
        ("CatchResponseError('status=429')", "429"),
        ("'status=503'", "503"),
        ("InferFailure('status=RESOURCE_EXHAUSTED')", "RESOURCE_EXHAUSTED"),
        ("status=bad_response: outputs ['y'] missing", "bad_response"),
        ("ConnectionRefusedError(111, 'Connection refused')", CONNECTION),
    ],
)
def test_status_of(text: str, status: str) -> None:
    assert status_of(text) == status


def test_expected() -> None:
    assert [is_expected(s) for s in ("429", "503", "RESOURCE_EXHAUSTED", "UNAVAILABLE")] == [
        True
    ] * 4
    assert not is_expected("500")
    assert not is_expected(CONNECTION)


def test_error_detail() -> None:
    assert error_detail(b'{"error":"unknown model \\"x\\""}') == 'unknown model \\"x\\"'
    assert error_detail(b"<html>bad gateway</html>") == "<html>bad gateway</html>"
