from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.locust_summary import read_summary
from loadtests.results import Latency

FIXTURES = Path(__file__).parent / "fixtures"


def test_real_summary_of_a_rate_limited_tenant_mix() -> None:
    summary = read_summary(FIXTURES / "grpc_tenants_summary.json")
    assert summary.total.name == "Aggregated"
    assert (summary.total.requests, summary.total.failures) == (2368, 1533)
    assert summary.errors == {"RESOURCE_EXHAUSTED": 1533}
    assert summary.exceptions == 0
    assert summary.cpu_bound is False  # written before locust_summary recorded it: default
    names = sorted(entry.name for entry in summary.infer_entries)
    assert names == ["infer [tenant 1]", "infer [tenant 2]"]
    assert sum(entry.requests for entry in summary.infer_entries) == 2368


def test_errors_are_grouped_by_status(tmp_path: Path) -> None:
    entry = {
        "name": "infer",
        "requests": 10,
        "failures": 6,
        "rps": 5.0,
        "failures_per_s": 3.0,
        "latency": {
            "p50_ms": 1.0,
            "p95_ms": 2.0,
            "p99_ms": 3.0,
            "p999_ms": 3.0,
            "avg_ms": 1.5,
            "max_ms": 3.2,
        },
    }
    empty = {
        **entry,
        "name": "metadata",
        "requests": 0,
        "failures": 0,
        "latency": dict.fromkeys(["p50_ms", "p95_ms", "p99_ms", "p999_ms", "avg_ms", "max_ms"]),
    }
    path = tmp_path / "summary.json"
    path.write_text(
        json.dumps(
            {
                "total": {**entry, "name": "Aggregated"},
                "entries": [entry, empty],
                "errors": [
                    {
                        "name": "infer",
                        "error": "CatchResponseError('status=429')",
                        "occurrences": 2,
                    },
                    {
                        "name": "infer",
                        "error": "CatchResponseError('status=500: boom')",
                        "occurrences": 1,
                    },
                    {"name": "infer", "error": "'status=429'", "occurrences": 1},
                    {"name": "infer", "error": "ConnectionResetError(104)", "occurrences": 2},
                ],
                "exceptions": [{"count": 2, "message": "KeyError('x')"}],
                "cpu_bound": True,
            }
        )
    )
    summary = read_summary(path)
    assert summary.errors == {"429": 3, "500": 1, "connection_error": 2}
    assert summary.exceptions == 2
    assert summary.exception_messages == ["KeyError('x')"]
    assert summary.cpu_bound is True
    assert [e.name for e in summary.infer_entries] == ["infer"]
    assert summary.entries[1].latency == Latency()


def test_missing_summary_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_summary(tmp_path / "absent.json")
