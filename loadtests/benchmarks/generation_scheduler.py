"""The generation benchmark, in process, pinned to one core: generated tokens per second of
sluice's generation scheduler (continuous batching over the ONNX decoder `sluice convert`
exported) with 16 concurrent streams of different prompt lengths, against transformers
`generate` run one request at a time and static batched `generate` (all 16 prompts left-padded
into one call), on the same core in the same run. A small random GPT-2 (4 layers, width 128)
built locally; every stream generates exactly `--tokens` tokens (no end-of-text stop), so every
system does the same work; with `--varied` each stream asks for its own 8 to 120 tokens. TTFT
and inter-token latency p50/p99 for each.

    python -m loadtests.benchmarks.generation_scheduler --out loadtests/benchmarks/results \
        [--varied]

Each system runs `--rounds` times, interleaved; the round with the median tokens/s is reported.
Writes generation.json (every round) and generation.md (the table).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

STREAMS = 16


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """16 prompts of 8 to 64 tokens."""
    rng = np.random.default_rng(seed)
    return [list(rng.integers(1, vocab, int(n))) for n in np.linspace(8, 64, STREAMS)]


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan")}
    p50, p99 = np.quantile(np.array(values), [0.5, 0.99])
    return {"p50": float(p50), "p99": float(p99)}


def one_at_a_time(model: Any, cases: list[list[int]], tokens: list[int]) -> dict[str, Any]:
    """transformers generate, one request after another; per-token times from a streamer."""
    import torch

    ttft, gaps = [], []
    started = time.perf_counter()
    for ids, count in zip(cases, tokens, strict=True):
        times: list[float] = []
        begin = time.perf_counter()
        with torch.no_grad():
            model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=count,
                min_new_tokens=count,
                do_sample=False,
                pad_token_id=0,
                streamer=_Clock(times),
            )
        # The streamer's first put is the prompt itself; then one per generated token.
        ttft.append(times[1] - begin)
        gaps += list(np.diff(times[1:]))
    seconds = time.perf_counter() - started
    return {
        "tokens_per_s": sum(tokens) / seconds,
        "seconds": seconds,
        "ttft_s": percentiles(ttft),
        "inter_token_s": percentiles(gaps),
    }


def static_batch(model: Any, cases: list[list[int]], tokens: list[int]) -> dict[str, Any]:
    """transformers generate on all prompts at once, left-padded (every stream waits for the
    whole batch to be formed and for the longest prompt's prefill, and the batch runs until its
    longest completion: only each stream's own tokens count)."""
    import torch

    longest = max(len(ids) for ids in cases)
    ids = torch.zeros(len(cases), longest, dtype=torch.long)
    mask = torch.zeros(len(cases), longest, dtype=torch.long)
    for row, prompt in enumerate(cases):
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        mask[row, longest - len(prompt) :] = 1
    times: list[float] = []
    started = time.perf_counter()
    with torch.no_grad():
        model.generation_config.pad_token_id = 0
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max(tokens),
            min_new_tokens=max(tokens),
            do_sample=False,
            streamer=_Clock(times),
        )
    seconds = time.perf_counter() - started
    assert out.shape[1] == longest + max(tokens)
    return {
        "tokens_per_s": sum(tokens) / seconds,
        "seconds": seconds,
        "ttft_s": percentiles([times[1] - started] * len(cases)),
        "inter_token_s": percentiles(list(np.diff(times[1:])) * len(cases)),
    }


class _Clock:
    """A generate streamer that only records when each step's tokens (all rows) came out."""

    def __init__(self, times: list[float]) -> None:
        self.times = times

    def put(self, value: Any) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


async def served(version: Path, cases: list[list[int]], tokens: list[int]) -> dict[str, Any]:
    """sluice's scheduler: 16 concurrent sequences submitted at once."""
    from engine.generation.sampling import sampling_params
    from engine.model import load_model
    from engine.model_config import load_model_config
    from engine.settings import BatchingDefaults

    config = load_model_config(version.parent)
    assert config.generative is not None
    config.generative.eos_token_ids = []  # exactly `tokens` per stream, as the others
    model = await load_model("bench", 1, version / "model.onnx", config, BatchingDefaults())
    generator = model.generator
    assert generator is not None
    try:
        warm = generator.start(cases[0], sampling_params(2, temperature=0))
        [c async for c in warm.stream()]
        stats = generator.scheduler.stats
        stats.time_to_first_token_s.clear()
        stats.inter_token_s.clear()
        started = time.perf_counter()
        sequences = [
            generator.start(ids, sampling_params(count, temperature=0))
            for ids, count in zip(cases, tokens, strict=True)
        ]

        async def drain(sequence: Any) -> int:
            return sum([len(chunk.tokens) async for chunk in sequence.stream()])

        counts = await asyncio.gather(*(drain(s) for s in sequences))
        seconds = time.perf_counter() - started
        assert counts == tokens, counts
        return {
            "tokens_per_s": sum(counts) / seconds,
            "seconds": seconds,
            "ttft_s": percentiles(list(stats.time_to_first_token_s)),
            "inter_token_s": percentiles(list(stats.inter_token_s)),
            "steps": stats.steps,
        }
    finally:
        await model.close()


SYSTEMS = ("sluice_continuous_16", "transformers_one_at_a_time", "transformers_static_batch_16")


def median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median tokens/s (its latencies come with it)."""
    return sorted(runs, key=lambda run: run["tokens_per_s"])[len(runs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per stream")
    parser.add_argument(
        "--varied",
        action="store_true",
        help="streams ask for 8 to 120 tokens each (results in generation_varied.*)",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of all three, interleaved; medians reported"
    )
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {0})  # one core for everything: the ratios compare like with like
    import torch
    from transformers import AutoModelForCausalLM

    from tests.generative import publish_tiny, tiny_gpt2

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        tiny_gpt2(root / "hf", n_layer=4, n_embd=128, n_head=4, n_positions=256)
        version = publish_tiny(root / "hf", root / "models", name="bench")
        model = AutoModelForCausalLM.from_pretrained(root / "hf", local_files_only=True).eval()
        cases = prompts(model.config.vocab_size)
        tokens = [args.tokens] * STREAMS
        if args.varied:
            tokens = [
                int(n) for n in np.random.default_rng(1).permutation(np.linspace(8, 120, STREAMS))
            ]
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in SYSTEMS}
        for _ in range(args.rounds):  # interleaved, so a noisy neighbour hits all three alike
            rounds["sluice_continuous_16"].append(asyncio.run(served(version, cases, tokens)))
            rounds["transformers_one_at_a_time"].append(one_at_a_time(model, cases, tokens))
            rounds["transformers_static_batch_16"].append(static_batch(model, cases, tokens))
        results = {name: median_round(runs) for name, runs in rounds.items()}
    base = results["transformers_one_at_a_time"]["tokens_per_s"]
    static = results["transformers_static_batch_16"]["tokens_per_s"]
    report = {
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cores": 1,
            "torch": torch.__version__,
        },
        "streams": STREAMS,
        "tokens_per_stream": tokens,
        "prompt_tokens": [len(c) for c in cases],
        "rounds": args.rounds,
        "results": results,
        "every_round": rounds,
        "ratio_vs_one_at_a_time": results["sluice_continuous_16"]["tokens_per_s"] / base,
        "ratio_vs_static_batch": results["sluice_continuous_16"]["tokens_per_s"] / static,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "generation_varied" if args.varied else "generation"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(table(report))
    print(table(report))


def _span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


def table(report: dict[str, Any]) -> str:
    lines = [
        f"Generation, {report['streams']} streams of {_span(report['tokens_per_stream'])} tokens, "
        "prompts "
        f"{min(report['prompt_tokens'])}-{max(report['prompt_tokens'])} tokens, one core, "
        f"median of {report['rounds']} interleaved rounds",
        "",
        "| system | tokens/s | vs one at a time | TTFT p50 / p99 (ms) "
        "| inter-token p50 / p99 (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    base = report["results"]["transformers_one_at_a_time"]["tokens_per_s"]
    for name, row in report["results"].items():
        ttft, itl = row["ttft_s"], row["inter_token_s"]
        lines.append(
            f"| {name} | {row['tokens_per_s']:.0f} | {row['tokens_per_s'] / base:.2f}x | "
            f"{ttft['p50'] * 1e3:.1f} / {ttft['p99'] * 1e3:.1f} | "
            f"{itl['p50'] * 1e3:.2f} / {itl['p99'] * 1e3:.2f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
