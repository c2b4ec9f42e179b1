"""transformers' ContinuousBatchingManager in process, for loadtests/benchmarks/generation.py
where `transformers serve` cannot run (it needs `accelerate` for a CPU device map): the same
cases, prompts as token ids from the same tokenizer, every stream submitted at once, greedy.
No HTTP, no SSE: its latencies are the library's own token timestamps, so this system has no
server or client overhead, which favours it against the servers measured over the API.

    python -m loadtests.benchmarks.generation_cb HF_FOLDER CASES_JSON

CASES_JSON is a list of {"prompt", "streams", "tokens", "warm", "texts"}; prints a JSON list of
rows (the fields generation.py's measure() gives) on the last line of stdout.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan")}
    p50, p99 = np.quantile(np.array(values), [0.5, 0.99])
    return {"p50": float(p50), "p99": float(p99)}


def run(manager: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Every prompt at once; wait for all; tokens/s, latencies, process CPU per token."""
    cpu, started = time.process_time(), time.perf_counter()
    ids = {manager.add_request(p, max_new_tokens=tokens, record_timestamps=True) for p in prompts}
    results: list[Any] = []
    while len(results) < len(ids):
        result = manager.get_result(timeout=600)
        if result is None:
            raise RuntimeError("the continuous batching manager stopped answering")
        if result.request_id in ids and result.is_finished():
            if result.error is not None:
                raise RuntimeError(result.error)
            results.append(result)
    cpu = time.process_time() - cpu
    end = max(r.timestamps[-1] for r in results)
    generated = sum(len(r.generated_tokens) for r in results)
    return {
        "tokens_per_s": generated / (end - started),
        "seconds": end - started,
        "generated_tokens": generated,
        "prompt_tokens": sorted({len(p) for p in prompts}),
        "ttft_s": percentiles([r.timestamps[0] - started for r in results]),
        "inter_token_s": percentiles([float(g) for r in results for g in np.diff(r.timestamps)]),
        "cpu_s_per_token": cpu / max(generated, 1),
    }


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, cases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    torch.set_num_threads(1)  # one core, as the servers are pinned to
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()  # type: ignore[no-untyped-call]
    config = GenerationConfig(do_sample=False, eos_token_id=model.config.eos_token_id)  # type: ignore[no-untyped-call]
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    rows = []
    try:
        for case in cases:
            run(manager, [tokenizer(case["warm"]).input_ids], 2)  # warm-up, not measured
            prompts = [tokenizer(text).input_ids for text in case["texts"]]
            row = run(manager, prompts, case["tokens"])
            rows.append({**row, "prompt": case["prompt"], "streams": case["streams"]})
    finally:
        manager.stop(block=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
