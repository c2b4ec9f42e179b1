"""The converted text-pipeline benchmark: sentences/s of a sentence-transformers folder (the shape
of all-MiniLM-L6-v2, random weights, built here) converted with `sluice convert` (fp32 and int8)
and served by `sluice serve` at concurrency 32 over HTTP (one text per request, varied texts,
wrk), against the limit: sentence-transformers `encode` in process at its best batch size.
Both are pinned to the same core (the load generator to another); also measured: the converted
steps run directly in process at their best batch (tokenizer + ONNX Runtime, no server), and
the served answers against `encode` with the conversion gates.

    python -m loadtests.benchmarks.text_pipeline --out loadtests/benchmarks/results [--rounds 2]

Writes text_pipeline.json (every measurement) and text_pipeline.md (the table). Needs `wrk` and
`taskset`. Subcommands `limit FOLDER` and `direct REPO NAME` run pinned in a child process.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadtests.benchmarks.batching import CLIENT_CORE, SERVER_CORE, machine, pinned, run_wrk, server
from loadtests.benchmarks.harness import write_results

CONCURRENCY = 32
BATCHES = (8, 16, 32, 64, 128)
PRECISIONS = ("fp32", "int8")
TEXTS = 512
_WORD_TEXT = (
    "the quick brown fox jumps over a lazy dog while the server answers every request once and "
    "batches merge concurrent requests of different lengths into one run so text goes in and "
    "embeddings come out placing similar sentences close together for search and clustering"
)
WORDS = tuple(_WORD_TEXT.split())
LUA = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local bodies = {{}}
for line in io.lines("{bodies}") do bodies[#bodies + 1] = line end
local i = 0
request = function()
  i = i % #bodies + 1
  return wrk.format(nil, nil, nil, bodies[i])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('RESULT {{"requests": %d, "duration_us": %d, "errors": %d, ' ..
    '"non2xx": %d, "p50_us": %d, "p99_us": %d}}\\n', summary.requests, summary.duration,
    e.connect + e.read + e.write + e.timeout, e.status, latency:percentile(50),
    latency:percentile(99)))
end
"""


def corpus(count: int, seed: int = 0) -> list[str]:
    """Sentences of 6 to 30 words (about 8 to 35 tokens), as search queries and passages are."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(6, 31)))) for _ in range(count)]


def limit(folder: Path) -> dict[str, float]:
    """sentence-transformers `encode` on one thread: sentences/s per batch size."""
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    model = SentenceTransformer(str(folder), device="cpu")
    texts = corpus(TEXTS, seed=1)
    rates = {}
    for batch in BATCHES:
        model.encode(texts[:batch], batch_size=batch)
        start = time.perf_counter()
        model.encode(texts, batch_size=batch)
        rates[str(batch)] = len(texts) / (time.perf_counter() - start)
    return rates


def direct(repo: Path, name: str) -> dict[str, float]:
    """The converted steps run directly, no server: sluice's tokenizer step, then the ONNX
    model (one thread, all graph optimizations, as the server loads it), per batch size."""
    import onnxruntime as ort

    from engine.backends.tokenizer import TokenizerBackend
    from engine.model_config import load_model_config

    tokenizer_dir, encoder_dir = repo / f"{name}-tokenizer", repo / f"{name}-encoder"
    options = load_model_config(tokenizer_dir).tokenizer
    tokenizer = TokenizerBackend(tokenizer_dir / "1" / "tokenizer.json", options, "tok")
    session_options = ort.SessionOptions()
    session_options.intra_op_num_threads = session_options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(encoder_dir / "1" / "model.onnx"), session_options)
    inputs = [i.name for i in session.get_inputs()]
    texts = np.array(corpus(TEXTS, seed=1), dtype=object)
    rates = {}
    for batch in BATCHES:
        start = time.perf_counter()
        for first in range(0, len(texts), batch):
            tokens = tokenizer.run({"text": texts[first : first + batch]})
            session.run(None, {n: tokens[n] for n in inputs})
        rates[str(batch)] = len(texts) / (time.perf_counter() - start)
    return rates


def child(*args: str) -> dict[str, float]:
    command = [sys.executable, "-m", "loadtests.benchmarks.text_pipeline", *args]
    out = subprocess.run(
        pinned(SERVER_CORE, *command), capture_output=True, text=True, check=True
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def wrk_texts(url: str, texts: list[str], seconds: float) -> dict[str, Any]:
    """Closed-loop one-text POSTs at CONCURRENCY, cycling through `texts` (distinct bodies, so
    no two in-flight requests coalesce)."""
    with tempfile.TemporaryDirectory() as tmp:
        bodies = Path(tmp) / "bodies"
        rows = [
            {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [t]}]}
            for t in texts
        ]
        bodies.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
        script = Path(tmp) / "post.lua"
        script.write_text(LUA.format(bodies=bodies))
        return run_wrk(script, url, CONCURRENCY, seconds)


def step_stats(url: str) -> dict[str, dict[str, float]]:
    """Per model: successes, queue and compute nanoseconds, rows and batches run."""
    stats = {}
    for model in httpx.get(f"{url}/v2/models/stats", timeout=10).json()["model_stats"]:
        inference = model["inference_stats"]
        batches = model.get("batch_stats") or []
        stats[model["name"]] = {
            "count": inference["success"]["count"],
            "queue_ns": inference["queue"]["ns"],
            # Per batch, not per request: a request's compute_infer counts its whole batch.
            "compute_ns": sum(b["compute_infer"]["ns"] for b in batches),
            "rows": sum(b["batch_size"] * b["compute_infer"]["count"] for b in batches),
            "batches": sum(b["compute_infer"]["count"] for b in batches),
        }
    return stats


def where_time_goes(
    before: dict[str, Any], after: dict[str, Any], seconds: float, pipeline: str
) -> dict[str, Any]:
    """Per step of the pipeline's run: share of the run's wall time spent computing batches,
    mean rows per batch, mean queue wait per request."""
    out = {}
    for name, end in after.items():
        if not name.startswith(f"{pipeline}-"):
            continue  # the pipeline's own entry, or another model
        start = before.get(name, dict.fromkeys(end, 0))
        delta = {key: end[key] - start[key] for key in end}
        if not delta["count"] or not delta["batches"]:
            continue
        out[name] = {
            "compute_share": round(delta["compute_ns"] / 1e9 / seconds, 3),
            "rows_per_batch": round(delta["rows"] / max(delta["batches"], 1), 1),
            "queue_ms": round(delta["queue_ns"] / 1e6 / delta["count"], 2),
        }
    return out


def gates(url: str, name: str, texts: list[str], want: np.ndarray) -> dict[str, Any]:
    """The served embeddings of `texts` against `encode`, with the conversion's gates."""
    from converters.validate import OutputCheck, _compare_output, tolerances_for

    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}]}
    answer = httpx.post(f"{url}/v2/models/{name}/infer", json=body, timeout=60).json()
    (output,) = answer["outputs"]
    got = np.array(output["data"], np.float32).reshape(output["shape"])
    check = OutputCheck("embeddings")
    precision = name.rsplit("-", 1)[1]
    _compare_output(check, want.reshape(-1), got.reshape(-1), tolerances_for(precision))
    return {
        "passed": check.passed,
        "cosine": check.cosine,
        "norm_error": check.norm_error,
        "max_abs_error": check.max_abs_error,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for tool in ("wrk", "taskset"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is needed (apt-get install wrk util-linux)")
    from sentence_transformers import SentenceTransformer

    from tests.hf_models import MINILM, sentence_transformer_folder

    args.out.mkdir(parents=True, exist_ok=True)
    texts = corpus(TEXTS)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = sentence_transformer_folder(
            Path(tmp) / "minilm", shape=MINILM, max_seq_length=128, corpus=texts
        )
        repo = Path(tmp) / "repository"
        for precision in PRECISIONS:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "server",
                    "convert",
                    str(folder),
                    "--name",
                    f"minilm-{precision}",
                    "--precision",
                    precision,
                    "--repository",
                    str(repo),
                    "--measure-iterations",
                    "0",
                ],
                check=True,
                capture_output=True,
            )
        check_texts = texts[:64]
        want = SentenceTransformer(str(folder), device="cpu").encode(check_texts)
        for index in range(args.rounds):
            # The limit is measured before and after the served runs, and the faster of the two
            # counts (the less disturbed one): the host is shared, and its load drifts.
            before_limit = child("limit", str(folder))
            record: dict[str, Any] = {"round": index + 1, "limit_runs": [before_limit]}
            record["direct"] = {p: child("direct", str(repo), f"minilm-{p}") for p in PRECISIONS}
            record["served"] = {}
            with server("sluice", repo) as (url, _):
                for precision in PRECISIONS:
                    name = f"minilm-{precision}"
                    wrk_texts(f"{url}/v2/models/{name}/infer", texts, 2)  # warm the batchers
                    before = step_stats(url)
                    result = wrk_texts(f"{url}/v2/models/{name}/infer", texts, args.seconds)
                    result["steps"] = where_time_goes(before, step_stats(url), args.seconds, name)
                    result["gates"] = gates(url, name, check_texts, want)
                    record["served"][precision] = result
                    print(json.dumps({"round": index + 1, precision: result}), flush=True)
            record["limit_runs"].append(child("limit", str(folder)))
            record["limit"] = {
                batch: max(run[batch] for run in record["limit_runs"]) for batch in before_limit
            }
            rounds.append(record)
    report = {"rounds": rounds, "machine": machine(), "concurrency": CONCURRENCY}
    write_results(args.out, "text_pipeline", report, table(report))


def table(report: dict[str, Any]) -> str:
    lines = [
        "# Converted text pipeline vs sentence-transformers encode",
        "",
        f"Model: the shape of all-MiniLM-L6-v2 (6 layers, 384 wide, random weights), texts of 6 "
        f"to 30 words, max_seq_length 128. sluice: `sluice convert` -> tokenizer -> encoder "
        f"pipeline, one text per HTTP JSON request, c = {report['concurrency']} (wrk on core "
        f"{CLIENT_CORE}); server, `encode` and the direct runs pinned to core {SERVER_CORE}, one "
        f"thread each. Limit: `encode` at its best batch size (the faster of a run before and one "
        f"after the served runs). {report['machine']['date']}, "
        f"{report['machine']['cpus']} shared cores.",
        "",
        "| round | precision | limit sentences/s (batch) | direct tokenizer+ORT (batch) | "
        "sluice c=32 sentences/s | p50 ms | ratio to limit | target | gates |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for record in report["rounds"]:
        best = max(record["limit"], key=lambda b: record["limit"][b])
        limit_rate = record["limit"][best]
        for precision, served in record["served"].items():
            direct = record["direct"][precision]
            direct_best = max(direct, key=lambda b: direct[b])
            ratio = served["throughput"] / limit_rate
            target = 0.9 if precision == "fp32" else 1.3
            gate = served["gates"]
            lines.append(
                f"| {record['round']} | {precision} | {limit_rate:,.0f} ({best}) | "
                f"{direct[direct_best]:,.0f} ({direct_best}) | {served['throughput']:,.0f} | "
                f"{served['p50_us'] / 1000:.1f} | {ratio:.2f}x | {target}x "
                f"{'met' if ratio >= target else 'missed'} | "
                f"{'pass' if gate['passed'] else 'FAIL'} (cosine {gate['cosine']:.5f}) |"
            )
    lines += [
        "",
        "Where the time goes in each served run (per step: share of the served run's "
        "wall time spent computing batches, mean rows per batch, mean queue wait; the rest "
        "of the core goes to HTTP, JSON, the pipeline and the batchers):",
        "",
    ]
    for record in report["rounds"]:
        for precision, served in record["served"].items():
            steps = "; ".join(
                f"{name}: {s['compute_share']:.0%} compute, {s['rows_per_batch']} rows/batch, "
                f"{s['queue_ms']} ms queued"
                for name, s in served["steps"].items()
            )
            lines.append(f"- round {record['round']} {precision}: {steps}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "limit":
        print(json.dumps(limit(Path(sys.argv[2]))))
    elif len(sys.argv) > 1 and sys.argv[1] == "direct":
        print(json.dumps(direct(Path(sys.argv[2]), sys.argv[3])))
    else:
        main()
