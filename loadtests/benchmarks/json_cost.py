"""The per-core cost of JSON tensors: sluice serving the CNN and the tiny MLP over JSON against a
plain FastAPI + onnxruntime server and the HTTP floor (a no-op ASGI app), in one run, each server
on core 0 and wrk on core 1, with one worker; plus decode alone, in process, on core 0: the
reference element walk (`json_arrays.walk_data`) against the vectorized decoder
(`json_arrays.decode_data`).

    python -m loadtests.benchmarks.json_cost [--out DIR] [--seconds 5] [--rounds 5]

Each round loads every server in turn; the machine is shared, so `--rounds` (5) rounds are run
and the table gives each figure's median and its range over the rounds. The bodies are what a
client sends: orjson text of normally distributed values rounded to 4 decimals (the CNN's
12,288 values are a 91 kB body), flat; decode alone also times the CNN's body with its data
nested in lists of its shape. Writes json_cost.json and json_cost.md. Needs wrk and taskset.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import timeit
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from loadtests.benchmarks.batching import SERVER_CORE, machine, wrk
from loadtests.benchmarks.harness import (
    cpu_s,
    markdown_table,
    require,
    serving,
    spread,
    write_results,
)
from loadtests.benchmarks.models import MODELS, write_repository
from server.http import json_arrays, json_header

CONCURRENCY = 16
KINDS = ("sluice", "plain", "floor")
THREADS = ("loop_us", "cpu_us")


def json_body(model: str, nested: bool = False) -> bytes:
    """One request for `model` with input `x` of batch 1, as JSON text; its data flat, as
    tritonclient sends it, or `nested` in lists of the tensor's shape."""
    shape = [1, *MODELS[model][1]]
    data = np.round(np.random.default_rng(1).standard_normal(shape), 4)
    values = data.tolist() if nested else data.ravel().tolist()
    tensor = {"name": "x", "shape": shape, "datatype": "FP32", "data": values}
    return orjson.dumps({"inputs": [tensor]})


DECODED = (("mlp", False), ("cnn", False), ("cnn", True))
"""The bodies whose decode is timed alone: (model, nested data)."""


def per_call_us(funcs: dict[str, Callable[[], object]], seconds: float = 0.1) -> dict[str, float]:
    """Each function's best time in microseconds per call, over 15 timings of about `seconds`
    taken in turn, so that every function sees the same spells of the machine's other load."""
    calls = {
        name: max(1, int(seconds / max(timeit.timeit(func, number=1), 1e-7)))
        for name, func in funcs.items()
    }
    best = dict.fromkeys(funcs, float("inf"))
    for _ in range(15):
        for name, func in funcs.items():
            elapsed = timeit.timeit(func, number=calls[name]) / calls[name] * 1e6
            best[name] = min(best[name], elapsed)
    return best


def read_body(body: bytes, parse: Callable[[bytes], Any]) -> np.ndarray:
    """The body's one tensor as an array: the body parsed by `parse`, then its data decoded."""
    tensor = parse(body)["inputs"][0]
    return json_arrays.decode_data("x", tensor["datatype"], tensor["shape"], tensor["data"])


def decode_costs() -> list[dict[str, Any]]:
    """Parse, reference walk and vectorized decode of each model's body, µs per body, on core 0;
    and the whole body to an array, parsed by orjson then decoded, against the server's way
    (json_header.loads: a large body's numbers read straight from its text). Every way is
    checked to give the walk's array before they are timed."""
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {int(SERVER_CORE)})
    rows = []
    try:
        for model, nested in DECODED:
            body = json_body(model, nested)
            tensor = orjson.loads(body)["inputs"][0]
            args = ("x", tensor["datatype"], tensor["shape"], tensor["data"])
            walked = json_arrays.walk_data(*args)
            for way in (
                json_arrays.decode_data(*args),
                read_body(body, orjson.loads),
                read_body(body, json_header.loads),
            ):
                if way.dtype != walked.dtype or way.tobytes() != walked.tobytes():
                    raise AssertionError(f"{model}: a decoder disagrees with walk_data")
            times = per_call_us(
                {
                    "parse_us": lambda b=body: orjson.loads(b),  # type: ignore[misc]
                    "walk_us": lambda a=args: json_arrays.walk_data(*a),  # type: ignore[misc]
                    "decode_us": lambda a=args: json_arrays.decode_data(*a),  # type: ignore[misc]
                    "parsed_us": lambda b=body: read_body(b, orjson.loads),  # type: ignore[misc]
                    "read_us": lambda b=body: read_body(b, json_header.loads),  # type: ignore[misc]
                }
            )
            row = {
                "model": model,
                "nested": nested,
                "body_bytes": len(body),
                "values": walked.size,
                **times,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        os.sched_setaffinity(0, affinity)
    return rows


def throughput(repo: Path, rounds: int, seconds: float) -> list[dict[str, Any]]:
    """Every server runs for the whole benchmark (idle ones cost nothing) and each round loads
    them in turn, so the figures a ratio compares are measured seconds apart. Besides req/s,
    each row has the server's CPU time per request: other work on the shared core lowers req/s
    but hardly changes what each request costs; and its main thread's (the event loop's, where
    HTTP, decoding and encoding run; ONNX Runtime runs in other threads when not inline)."""
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        servers = {
            kind: stack.enter_context(serving(kind, repo, SERVER_CORE, "--workers", "1"))
            for kind in KINDS
        }
        for round_ in range(rounds):
            for model in MODELS:
                for kind, served in servers.items():
                    target, pid = f"{served.url}/v2/models/{model}/infer", served.pid
                    used, loop_used = cpu_s(pid), cpu_s(pid, main_thread=True)
                    result = wrk(target, json_body(model), CONCURRENCY, seconds, {})
                    answered = max(result["requests"] - result["non2xx"], 1)
                    result["cpu_us"] = (cpu_s(pid) - used) / answered * 1e6
                    result["loop_us"] = (cpu_s(pid, main_thread=True) - loop_used) / answered * 1e6
                    result["per_core"] = 1e6 / result["cpu_us"]
                    rows.append({"round": round_, "server": kind, "model": model, **result})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def ratios(rows: list[dict[str, Any]], field: str) -> dict[str, dict[str, list[float]]]:
    """Per model, sluice's `field` (req/s, or requests per CPU second) over each peer's, one
    value per round."""
    rate = {(r["round"], r["server"], r["model"]): r[field] for r in rows}
    rounds = sorted({r["round"] for r in rows})
    return {
        model: {
            peer: [rate[(n, "sluice", model)] / rate[(n, peer, model)] for n in rounds]
            for peer in KINDS[1:]
        }
        for model in MODELS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    require("wrk", "taskset")
    decode = decode_costs()
    with tempfile.TemporaryDirectory() as tmp:
        rows = throughput(write_repository(Path(tmp)), args.rounds, args.seconds)
    report = {
        "decode": decode,
        "rows": rows,
        "machine": machine(),
        "seconds": args.seconds,
        "concurrency": CONCURRENCY,
        "ratios": ratios(rows, "throughput"),
        "per_core_ratios": ratios(rows, "per_core"),
    }
    write_results(args.out, "json_cost", report, table(report))


def table(report: dict[str, Any]) -> str:
    rounds = len({r["round"] for r in report["rows"]})

    def values(kind: str, model: str, field: str) -> list[float]:
        return [r[field] for r in report["rows"] if (r["server"], r["model"]) == (kind, model)]

    lines = [
        "# JSON cost benchmark",
        "",
        f"Command: `python -m loadtests.benchmarks.json_cost --seconds {report['seconds']:g} "
        f"--rounds {rounds}`; JSON bodies, {report['concurrency']} connections, one sluice "
        f"worker; servers on core {SERVER_CORE}, wrk on the other core; {report['machine']}. "
        f"Each figure is the median of {rounds} rounds, with the range in brackets. "
        "req per CPU second: requests answered over the CPU time (user + system, every thread) "
        "the server used meanwhile, what one core does when it is the server's alone; on a "
        "shared machine it is the steadier figure, req/s moves with the others' load. "
        "event loop / all: the CPU µs a request of the server's main thread (HTTP, decoding, "
        "encoding) and of every thread (ONNX Runtime's too), medians.",
        "",
    ]
    columns = [
        "model",
        "body",
        "measure",
        "sluice",
        "plain FastAPI",
        "floor",
        "sluice x plain",
        "sluice / floor",
    ]
    cells = []
    for model in MODELS:
        size = next(d["body_bytes"] for d in report["decode"] if d["model"] == model)  # flat
        for label, field, key in (
            ("req/s", "throughput", "ratios"),
            ("req per CPU second", "per_core", "per_core_ratios"),
        ):
            vs = report[key][model]
            spreads = [spread(values(kind, model, field), "{:,.0f}") for kind in KINDS]
            ratios = [spread(vs[peer], "{:,.2f}") for peer in ("plain", "floor")]
            cells.append([model, f"{size / 1e3:,.1f} kB", label, *spreads, *ratios])
        threads = [
            " / ".join(f"{statistics.median(values(kind, model, f)):,.0f}" for f in THREADS)
            for kind in KINDS
        ]
        cells.append(
            [
                model,
                f"{size / 1e3:,.1f} kB",
                "CPU µs a request: event loop / all",
                *threads,
                "-",
                "-",
            ]
        )
    lines += markdown_table(columns, cells)
    lines += [
        "",
        f"Decode alone (in process, core {SERVER_CORE}, best of 15, taken in turn), µs per body:",
        "",
    ]
    columns = [
        "model",
        "values",
        "orjson.loads",
        "reference walk (`walk_data`)",
        "vectorized (`decode_data`)",
        "speed-up",
        "body to array: orjson.loads + `decode_data`",
        "body to array: `json_header.loads` + `decode_data`",
        "speed-up",
    ]
    cells = [
        [
            d["model"] + (" (nested data)" if d.get("nested") else ""),
            f"{d['values']:,}",
            f"{d['parse_us']:,.1f}",
            f"{d['walk_us']:,.1f}",
            f"{d['decode_us']:,.1f}",
            f"{d['walk_us'] / d['decode_us']:.1f}x",
            f"{d['parsed_us']:,.1f}",
            f"{d['read_us']:,.1f}",
            f"{d['parsed_us'] / d['read_us']:.1f}x",
        ]
        for d in report["decode"]
    ]
    lines += markdown_table(columns, cells)
    lines += [
        "",
        "The last three columns time the whole body: parsed by orjson, then its data decoded, "
        "against the server's way, `json_header.loads` (a body of "
        f"{json_header.LAZY_BYTES // 1024} KiB or more: its header parsed alone and each "
        "input's numbers, flat or in regularly nested lists, read straight from the text by "
        "simdjson). The throughput rows send flat data.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
