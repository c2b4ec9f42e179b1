"""The generation benchmark over the OpenAI API (issue 37): streamed /v1/completions against
servers on the same machine, the same random-weight Llama models (generated here), the same
prompts:

- `sluice-genai`: sluice on onnxruntime-genai's Engine (the model builder's fp32 output);
- `sluice-genai-int4`: the same, int4 (the builder's `-p int4`);
- `sluice-loop`: sluice's own scheduler on the same weights exported by `sluice convert`'s
  decoder export (converters/causal_lm.py);
- `transformers-serve`: `transformers serve --continuous-batching` (Hugging Face's OpenAI server,
  paged attention) on the Hugging Face folder itself.

Models: `tiny` (2 layers, width 64, 4 heads over 2 key/value heads) and `100m` (12 layers, width
768, 12 heads over 4, MLP 3072: about 100M parameters), both with a 2,048-token context and the
tests' BOS-adding tokenizer; the end-of-text row of the output projection is zeroed, so no
system stops early and every stream generates exactly `--tokens` tokens (greedy). Prompts of
exactly 128 and 1,024 tokens (BOS included; every stream's own, so no prefix cache helps), 1,
16 and 64 concurrent streams, each case after one warm-up request. Per case: tokens/s
(generated tokens over the wall time of the case), TTFT and inter-token gaps p50/p99 (from the
client's SSE chunks), server CPU seconds per generated token (/proc of the server process).

    python -m loadtests.benchmarks.generation --out loadtests/benchmarks/results
    python -m loadtests.benchmarks.generation --short --out /tmp/gen   # seconds: a smoke run

`--systems`, `--models`, `--prompts`, `--streams` and `--tokens` select cases. The server runs
on `--server-cores` (default 0), the client on the next core. Writes generation_openai.json,
.csv and .md (the table).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from loadtests.benchmarks.generation_models import CONTEXT, MODELS, build_llama, prompts, publish
from loadtests.benchmarks.harness import (
    cpu_s,
    free_port,
    http_ready,
    markdown_table,
    pinned,
    running,
    sluice_command,
)

SYSTEMS = (
    "sluice-genai",
    "sluice-genai-int4",
    "sluice-loop",
    "transformers-serve",
    "transformers-cb",
)


@contextmanager
def server(system: str, hf: Path, repository: Path, core: str) -> Iterator[tuple[str, int]]:
    """The server of `system`, pinned to `core`, once it answers: its URL and process id."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if system == "transformers-serve":
        command = [
            str(Path(sys.executable).parent / "transformers"),
            "serve",
            str(hf),
            "--continuous-batching",
            "--device",
            "cpu",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
        ]
        ready = http_ready(url + "/health")
    else:
        command = sluice_command(repository, port, free_port())
        ready = http_ready(url + "/v2/health/ready")
    with running(pinned(core, *command), ready, system, timeout_s=300) as process:
        yield url, process.pid


async def stream(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int
) -> dict[str, Any]:
    """One streamed completion: arrival times of its content chunks and its usage."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    begin, times, usage = time.perf_counter(), [], None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if any(choice.get("text") for choice in event.get("choices") or []):
                times.append(time.perf_counter())
            usage = event.get("usage") or usage
    assert usage is not None, "no usage in the stream"
    return {"begin": begin, "end": time.perf_counter(), "times": times, "usage": usage}


async def case(url: str, model: str, texts: list[str], tokens: int) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=len(texts) + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        return await asyncio.gather(*(stream(client, url, model, t, tokens) for t in texts))


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan")}
    p50, p99 = np.quantile(np.array(values), [0.5, 0.99])
    return {"p50": float(p50), "p99": float(p99)}


def measure(
    url: str, pid: int, model: str, warm: str, texts: list[str], tokens: int
) -> dict[str, Any]:
    """One case: every stream at once, after a warm-up request of its own prompt (so no
    stream finds its prompt cached); tokens/s, latencies, server CPU per token."""
    asyncio.run(case(url, model, [warm], 2))
    cpu = cpu_s(pid)
    results = asyncio.run(case(url, model, texts, tokens))
    cpu = cpu_s(pid) - cpu
    # From the first request sent to the last stream closed (not the client's set-up).
    seconds = max(r["end"] for r in results) - min(r["begin"] for r in results)
    generated = sum(r["usage"]["completion_tokens"] for r in results)
    ttft = [r["times"][0] - r["begin"] for r in results if r["times"]]
    gaps = [float(g) for r in results for g in np.diff(r["times"])]
    return {
        "tokens_per_s": generated / seconds,
        "seconds": seconds,
        "generated_tokens": generated,
        "prompt_tokens": sorted({r["usage"]["prompt_tokens"] for r in results}),
        "ttft_s": percentiles(ttft),
        "inter_token_s": percentiles(gaps),
        "cpu_s_per_token": cpu / max(generated, 1),
    }


def run_system(
    system: str, hf: Path, scratch: Path, args: argparse.Namespace, model: str
) -> list[dict[str, Any]]:
    repository = scratch / f"repo-{system}"
    rows = []
    cases = [
        (length, streams, *prompts(hf, length, streams + 1, seed=length * 1000 + streams))
        for length in args.prompts
        for streams in args.streams
    ]  # every system gets the same prompts (a warm-up's first); no two cases share one
    if system == "transformers-cb":
        return in_process(hf, scratch, cases, args, model)
    publish(system, hf, repository, max(args.streams))
    served_model = str(hf) if system == "transformers-serve" else "bench"
    with server(system, hf, repository, args.server_cores) as (url, pid):
        for length, streams, warm, *texts in cases:
            row = measure(url, pid, served_model, warm, texts, args.tokens)
            row.update(system=system, model=model, prompt=length, streams=streams)
            rows.append(row)
            print(
                f"{system} {model} prompt {length} x{streams}: {row['tokens_per_s']:,.0f} tokens/s",
                flush=True,
            )
    return rows


def in_process(
    hf: Path, scratch: Path, cases: list[Any], args: argparse.Namespace, model: str
) -> list[dict[str, Any]]:
    """transformers-cb: loadtests/benchmarks/generation_cb.py in a child pinned as a server."""
    spec = scratch / "cb-cases.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(
        json.dumps(
            [
                {
                    "prompt": length,
                    "streams": streams,
                    "tokens": args.tokens,
                    "warm": warm,
                    "texts": texts,
                }
                for length, streams, warm, *texts in cases
            ]
        )
    )
    command = [sys.executable, "-m", "loadtests.benchmarks.generation_cb", str(hf), str(spec)]
    done = subprocess.run(
        pinned(args.server_cores, *command), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr else "failed")
    rows: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    for row in rows:
        row.update(system="transformers-cb", model=model)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--prompts", nargs="+", type=int, default=[128, 1024])
    parser.add_argument("--streams", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per stream")
    parser.add_argument("--server-cores", default="0", help="taskset CPU list of the servers")
    parser.add_argument(
        "--short",
        action="store_true",
        help="smoke run: the tiny model, 16-token prompts, 8 tokens, 1 and 4 streams",
    )
    args = parser.parse_args()
    if args.short:
        args.models, args.prompts, args.streams, args.tokens = ["tiny"], [16], [1, 4], 8
    if max(args.prompts) + args.tokens > CONTEXT:
        parser.error(f"prompt + tokens must fit the {CONTEXT}-token context")
    if shutil.which("taskset") is None:
        sys.exit("taskset is needed (apt-get install util-linux)")
    client_core = (int(args.server_cores.split(",")[0].split("-")[-1]) + 1) % (os.cpu_count() or 1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {client_core})
    rows: list[dict[str, Any]] = []
    failures: list[dict[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="sluice-generation-") as scratch:
        for model in args.models:
            hf = build_llama(Path(scratch) / f"hf-{model}", MODELS[model])
            for system in args.systems:
                try:
                    rows += run_system(system, hf, Path(scratch) / model, args, model)
                except (
                    RuntimeError,
                    AssertionError,
                    httpx.HTTPError,
                    subprocess.SubprocessError,
                ) as exc:
                    failures.append({"system": system, "model": model, "error": repr(exc)})
                    print(f"{system} on {model} failed: {exc!r}", file=sys.stderr, flush=True)
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "date": time.strftime("%Y-%m-%d"),
            "server_cores": args.server_cores,
        },
        "command": " ".join(["python -m loadtests.benchmarks.generation", *sys.argv[1:]]),
        "tokens_per_stream": args.tokens,
        "rows": rows,
        "failures": failures,
    }
    write(args.out, report)


def write(out: Path, report: dict[str, Any]) -> None:
    """generation_openai.json (everything), .csv (a row per case) and .md (the table)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "generation_openai.json").write_text(json.dumps(report, indent=1))
    columns = [
        "system",
        "model",
        "prompt",
        "streams",
        "tokens_per_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "itl_p50_s",
        "itl_p99_s",
        "cpu_s_per_token",
        "generated_tokens",
    ]
    with (out / "generation_openai.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for row in report["rows"]:
            writer.writerow(
                [
                    row["system"],
                    row["model"],
                    row["prompt"],
                    row["streams"],
                    f"{row['tokens_per_s']:.1f}",
                    row["ttft_s"]["p50"],
                    row["ttft_s"]["p99"],
                    row["inter_token_s"]["p50"],
                    row["inter_token_s"]["p99"],
                    row["cpu_s_per_token"],
                    row["generated_tokens"],
                ]
            )
    text = table(report)
    (out / "generation_openai.md").write_text(text)
    print(text)


def table(report: dict[str, Any]) -> str:
    head = (
        f"Generation over the OpenAI API, {report['tokens_per_stream']} tokens per stream, "
        f"streamed, greedy; server on cores {report['machine']['server_cores']}; "
        f"`{report['command']}`"
    )
    columns = [
        "model",
        "prompt",
        "streams",
        "system",
        "tokens/s",
        "TTFT p50 / p99 (ms)",
        "inter-token p50 / p99 (ms)",
        "server CPU ms / token",
    ]
    ordered = sorted(report["rows"], key=lambda r: (r["model"], r["prompt"], r["streams"]))
    rows = [
        (
            r["model"],
            r["prompt"],
            r["streams"],
            r["system"],
            f"{r['tokens_per_s']:,.0f}",
            f"{r['ttft_s']['p50'] * 1e3:.1f} / {r['ttft_s']['p99'] * 1e3:.1f}",
            f"{r['inter_token_s']['p50'] * 1e3:.2f} / {r['inter_token_s']['p99'] * 1e3:.2f}",
            f"{r['cpu_s_per_token'] * 1e3:.2f}",
        )
        for r in ordered
    ]
    lines = [head, "", *markdown_table(columns, rows)]
    for failure in report["failures"]:
        lines.append(f"\n{failure['system']} on {failure['model']} failed: {failure['error']}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
