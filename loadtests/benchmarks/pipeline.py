"""The text-pipeline benchmark, in process: concurrent one-text requests through sluice's engine
serving `embedder` (tokenizer -> ONNX embedding-sum -> Python normalization, each step batched by
its own batcher) against the limit, the same three computations run directly at their best batch
size, and against running them directly one text at a time (what a server without batching does
per request). All in one run, pinned to one core; no HTTP (see batching.py for the front-ends).

    python -m loadtests.benchmarks.pipeline --out loadtests/benchmarks/results [--texts 3000]

Writes pipeline.json (every measurement) and pipeline.md (the table).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from engine.engine import Engine
from engine.types import InferRequest
from loadtests.benchmarks.harness import write_results
from server.settings import load_settings

BATCHES = (1, 8, 32, 64)
CONCURRENCY = (1, 16, 64)
SENTENCE = "the quick brown fox jumps over a lazy dog text goes in and answers come out"
WORDS = tuple(SENTENCE.split())


def corpus(count: int, seed: int = 0) -> list[str]:
    """Texts of 3 to 14 words, so rows differ in length as real text does."""
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 15))) for _ in range(count)]


def direct(repo: Path, texts: list[str], batch: int) -> float:
    """Texts per second for the pipeline's three steps run directly, `batch` texts at a time."""
    import onnxruntime as ort
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(repo / "tok" / "1" / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=512)
    tokenizer.enable_padding(pad_id=0)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(repo / "embed" / "1" / "model.onnx"), options)
    started = time.perf_counter()
    for first in range(0, len(texts), batch):
        encodings = tokenizer.encode_batch(texts[first : first + batch])
        ids = np.array([e.ids for e in encodings], np.int64)
        mask = np.array([e.attention_mask for e in encodings], np.int64)
        (raw,) = session.run(None, {"input_ids": ids, "attention_mask": mask})
        raw / np.maximum(np.linalg.norm(raw, axis=1, keepdims=True), 1e-12)
    return len(texts) / (time.perf_counter() - started)


async def served(repo: Path, texts: list[str], concurrency: int) -> dict[str, Any]:
    """Texts per second through the engine, and the mean rows per batch of each step."""
    settings = load_settings(model_repository=repo, allow_python_models=True, log_level="error")
    engine = Engine(settings)
    await engine.start()
    slots = asyncio.Semaphore(concurrency)

    async def one(text: str) -> None:
        array = np.empty(1, dtype=object)
        array[0] = text.encode()
        async with slots:
            await engine.infer(InferRequest("embedder", {"TEXT": array}, {"TEXT": "BYTES"}))

    try:
        await asyncio.gather(*(one(text) for text in texts[:200]))  # warm
        before = {s["name"]: s for s in (await engine.statistics())["model_stats"]}
        started = time.perf_counter()
        await asyncio.gather(*(one(text) for text in texts))
        seconds = time.perf_counter() - started
        after = {s["name"]: s for s in (await engine.statistics())["model_stats"]}
    finally:
        await engine.close()
    batch = {}
    for name in ("tok", "embed", "norm"):
        rows = after[name]["inference_count"] - before[name]["inference_count"]
        runs = after[name]["execution_count"] - before[name]["execution_count"]
        batch[name] = round(rows / max(runs, 1), 1)
    return {"concurrency": concurrency, "texts_per_s": len(texts) / seconds, "mean_batch": batch}


def main() -> None:
    from tests.text_models import write_text_repository

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--texts", type=int, default=3000)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})  # one core for everything: the ratios compare like with like
    texts = corpus(args.texts)
    with tempfile.TemporaryDirectory() as tmp:
        repo = write_text_repository(Path(tmp))
        limits = [{"batch": b, "texts_per_s": direct(repo, texts, b)} for b in BATCHES]
        rows = [asyncio.run(served(repo, texts, c)) for c in CONCURRENCY]
    report = {"limits": limits, "rows": rows, "texts": args.texts, "machine": machine()}
    write_results(args.out, "pipeline", report, table(report))


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def table(report: dict[str, Any]) -> str:
    best = max(report["limits"], key=lambda r: r["texts_per_s"])
    one_by_one = next(r for r in report["limits"] if r["batch"] == 1)["texts_per_s"]
    lines = [
        "# Text pipeline benchmark (in process)",
        "",
        f"Command: `python -m loadtests.benchmarks.pipeline --texts {report['texts']}`; one "
        f"core; {report['machine']}.",
        "",
        "Direct (the limit): "
        + "; ".join(
            f"batch {r['batch']} {r['texts_per_s']:,.0f} texts/s" for r in report["limits"]
        ),
        "",
        "| concurrency | texts/s | % of limit | x direct one at a time | rows per batch "
        "(tok / embed / norm) |",
        "|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        b = r["mean_batch"]
        lines.append(
            f"| {r['concurrency']} | {r['texts_per_s']:,.0f} | "
            f"{100 * r['texts_per_s'] / best['texts_per_s']:.1f}% | "
            f"{r['texts_per_s'] / one_by_one:.2f} | {b['tok']} / {b['embed']} / {b['norm']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
