"""loadtests.benchmarks.generation: its percentiles and its table of each system's tokens/s and
latencies (measuring: the benchmark's own command, with the generative models it builds)."""

from __future__ import annotations

import math

from loadtests.benchmarks.generation import percentiles, table


def test_percentiles_of_latencies() -> None:
    assert percentiles([1.0, 2.0, 3.0]) == {"p50": 2.0, "p99": 2.98}
    assert all(math.isnan(v) for v in percentiles([]).values())


def test_the_table_orders_rows_and_names_failures() -> None:
    def row(model: str, streams: int, system: str) -> dict[str, object]:
        latencies = {"ttft_s": {"p50": 0.0123, "p99": 0.05},
                     "inter_token_s": {"p50": 0.00125, "p99": 0.004}}  # fmt: skip
        return {"model": model, "prompt": 32, "streams": streams, "system": system,
                "tokens_per_s": 1234.5, "cpu_s_per_token": 0.0021, **latencies}  # fmt: skip

    report = {
        "tokens_per_stream": 64, "machine": {"server_cores": "0-1"}, "command": "python -m x",
        "rows": [row("llama", 8, "sluice"), row("gpt2", 1, "vllm"), row("gpt2", 8, "sluice")],
        "failures": [{"system": "vllm", "model": "llama", "error": "out of memory"}],
    }  # fmt: skip
    lines = table(report).splitlines()
    assert lines[0].startswith("Generation over the OpenAI API, 64 tokens per stream")
    body = [
        line for line in lines if (line.startswith("| ") and "gpt2" in line) or "llama |" in line
    ]
    assert body == [
        "| gpt2 | 32 | 1 | vllm | 1,234 | 12.3 / 50.0 | 1.25 / 4.00 | 2.10 |",
        "| gpt2 | 32 | 8 | sluice | 1,234 | 12.3 / 50.0 | 1.25 / 4.00 | 2.10 |",
        "| llama | 32 | 8 | sluice | 1,234 | 12.3 / 50.0 | 1.25 / 4.00 | 2.10 |",
    ]
    assert lines[-1] == "vllm on llama failed: out of memory"
