"""loadtests.benchmarks.json_cost: the JSON bodies it sends (flat or nested data), decoding them
to the same array every way, timing calls, and sluice's ratios to its peers round by round."""

from __future__ import annotations

import orjson

from loadtests.benchmarks.json_cost import json_body, per_call_us, ratios, read_body
from server.http import json_header


def test_flat_and_nested_bodies_decode_to_the_same_array() -> None:
    flat, nested = json_body("cnn"), json_body("cnn", nested=True)
    first_row = orjson.loads(nested)["inputs"][0]["data"][0][0][0]
    assert first_row == orjson.loads(flat)["inputs"][0]["data"][:64]
    arrays = [
        read_body(body, parse)
        for body in (flat, nested)
        for parse in (orjson.loads, json_header.loads)
    ]
    assert arrays[0].shape == (1, 3, 64, 64)
    assert all(a.tobytes() == arrays[0].tobytes() for a in arrays)


def test_per_call_times_each_function() -> None:
    times = per_call_us({"none": lambda: None, "sum": lambda: sum(range(20_000))}, 0.001)
    assert set(times) == {"none", "sum"}
    assert 0 < times["none"] < times["sum"]


def test_ratios_are_sluice_over_each_peer_per_round() -> None:
    rows = [
        {"round": n, "server": server, "model": model, "throughput": rate * (n + 1)}
        for n in (0, 1)
        for model in ("mlp", "cnn")
        for server, rate in (("sluice", 300.0), ("plain", 100.0), ("floor", 600.0))
    ]
    assert ratios(rows, "throughput") == {
        "mlp": {"plain": [3.0, 3.0], "floor": [0.5, 0.5]},
        "cnn": {"plain": [3.0, 3.0], "floor": [0.5, 0.5]},
    }
