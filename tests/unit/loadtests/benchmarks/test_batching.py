"""loadtests.benchmarks.batching: the request bodies it sends and its results table, each server
against the raw limit and the plain FastAPI peer of the same run (measuring: the benchmark's own
command)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from loadtests.benchmarks.batching import binary_body, json_body, output_names, table


def test_a_json_body_is_one_row_of_the_models_input() -> None:
    body = json.loads(json_body("cnn"))
    (tensor,) = body["inputs"]
    assert (tensor["name"], tensor["shape"], tensor["datatype"]) == ("x", [1, 3, 64, 64], "FP32")
    assert len(tensor["data"]) == 3 * 64 * 64
    assert json_body("cnn") == json_body("cnn")  # the same request every time


def test_a_binary_body_is_its_header_then_the_raw_tensor() -> None:
    body, header_length = binary_body("mlp")
    header = json.loads(body[:header_length])
    assert header["inputs"][0]["parameters"] == {"binary_data_size": 64 * 4}
    assert header["outputs"] == [{"name": "probabilities", "parameters": {"binary_data": True}}]
    data = np.frombuffer(body[header_length:], np.float32)
    assert data.tolist() == json.loads(json_body("mlp"))["inputs"][0]["data"]
    assert output_names("cnn") == ["logits"]


def row(server: str, throughput: float, **extra: Any) -> dict[str, Any]:
    return {"server": server, "protocol": "http-json", "model": "mlp", "concurrency": 16,
            "throughput": throughput, "p50_us": 1500.0, "p99_us": 4250.0, "errors": 1,
            "non2xx": 2, **extra}  # fmt: skip


def test_the_table_rates_each_server_against_the_limit_and_plain_fastapi() -> None:
    report = {
        "machine": {"cpus": 2},
        "limits": {"mlp": [{"batch": 1, "samples_per_s": 1000.0},
                           {"batch": 32, "samples_per_s": 8000.0}]},
        "rows": [row("plain", 1000.0), row("sluice", 3000.0), row("floor", 9000.0)],
    }  # fmt: skip
    text = table(report, argparse.Namespace(seconds=5.0))
    assert "Command: `python -m loadtests.benchmarks.batching --seconds 5`" in text
    assert "mlp 8,000 samples/s at batch 32" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "mlp" in line]
    assert rows == [
        "| plain | http-json | mlp | 16 | 1,000 | 12.5% | - | 1.50 | 4.25 | 3 |",
        "| sluice | http-json | mlp | 16 | 3,000 | 37.5% | 3.00 | 1.50 | 4.25 | 3 |",
        "| floor | http-json | mlp | 16 | 9,000 | - | 9.00 | 1.50 | 4.25 | 3 |",
    ]
